"""Issue 20: the integrity panel's API (files, CRC-32C, stripes, objects; a streamed verify) on a real
rs(3,1) Tensormorph checkpoint with files removed, and the Plan page's server side: config-only folders,
encoder-only models (the real MiniLM), errors in human units."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import crc32c
import pytest
from starlette.testclient import TestClient

import tensormorph as tm
from tensormorph.server import create_app

pytestmark = pytest.mark.timeout(120)

DEVICE = "cuda:0=8GiB,tflops=50,bw=500"


@pytest.fixture(scope="module")
def protected(dcp_ckpt, tmp_path_factory) -> Path:
    """The DCP fixture converted to the Tensormorph format on 3 ranks with rs(3,1): one stripe, one parity file."""
    out = tmp_path_factory.mktemp("rs31") / "tm"
    tm.convert(dcp_ckpt, out, to="tensormorph", mesh=3, placements=["Shard(0)"], redundancy="rs(3,1)")
    return out


@pytest.fixture
def work(protected, tmp_path) -> Path:
    copy = tmp_path / "tm"
    shutil.copytree(protected, copy)
    return copy


def lines(response) -> list[dict]:
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines()]


def test_integrity_lists_every_file_with_its_crc_and_the_stripe(protected):
    manifest = json.loads((protected / "manifest.json").read_text())["body"]
    with TestClient(create_app([protected])) as c:
        panel = c.get("/api/checkpoints/a/integrity").json()
    assert panel["format"] == "tensormorph" and panel["checksum"] == "crc32c" and panel["redundancy"] == "rs(3,1)"
    listed = {f["name"]: f for f in panel["files"]}
    assert set(listed) == {"manifest.json", "rank-00000.safetensors", "rank-00001.safetensors",
                           "rank-00002.safetensors", "parity-00000-0.bin"}
    for name, entry in listed.items():
        data = (protected / name).read_bytes()
        assert entry["actual_size"] == len(data) and entry["status"] == "ok"
        if name != "manifest.json":  # the CRC-32C the manifest records is the file's own
            assert entry["crc32c"] == f"{crc32c.crc32c(data):08x}" and entry["size"] == len(data)
    assert [listed[n]["role"] for n in sorted(listed)] == ["manifest", "parity", "data", "data", "data"]
    assert listed["rank-00001.safetensors"]["rank"] == 1
    (stripe,) = panel["stripes"]
    assert stripe["data"] == [f"rank-0000{r}.safetensors" for r in range(3)]
    assert stripe["parity"] == ["parity-00000-0.bin"]
    assert stripe["protects"] == sum(manifest["files"][n]["size"] for n in stripe["data"])
    assert (stripe["tolerates"], stripe["damaged"], stripe["recoverable"]) == (1, [], True)
    objects = {o["name"]: o for o in panel["objects"]}
    assert objects["step"]["value"] == 42 and objects["step"]["type"] == "int" and objects["step"]["preview"] == "42"
    assert objects["config.lr"]["value"] == 0.001 and objects["optim.param_groups.0.betas"]["value"] == [0.9, 0.999]


def test_removed_parity_file_is_shown_and_verified_as_recoverable(work):
    (work / "parity-00000-0.bin").unlink()
    with TestClient(create_app([work])) as c:
        panel = c.get("/api/checkpoints/a/integrity").json()
        parity = next(f for f in panel["files"] if f["role"] == "parity")
        assert (parity["status"], parity["actual_size"]) == ("missing", None) and parity["size"] > 0
        assert panel["stripes"][0]["damaged"] == ["parity-00000-0.bin"] and panel["stripes"][0]["recoverable"]
        assert panel["damaged_files"] == {"parity-00000-0.bin": "missing"}
        streamed = lines(c.get("/api/checkpoints/a/verify"))
    problems = [line["problem"] for line in streamed if "problem" in line]
    assert len(problems) == 1 and problems[0]["kind"] == "MissingFileError"
    assert problems[0]["file"].endswith("parity-00000-0.bin") and "recoverable from rs(3,1)" in problems[0]["message"]
    done = streamed[-1]
    assert done == {"done": True, "ok": False, "problems": 1, "checksums_checked": 4, "bytes_read": 0, "checked": 4}


def test_two_lost_files_of_a_stripe_are_not_recoverable(work):
    (work / "parity-00000-0.bin").unlink()
    (work / "rank-00001.safetensors").write_bytes(b"short")
    with TestClient(create_app([work])) as c:
        panel = c.get("/api/checkpoints/a/integrity").json()
        statuses = {f["name"]: f["status"] for f in panel["files"]}
        assert statuses["rank-00001.safetensors"] == "size" and statuses["parity-00000-0.bin"] == "missing"
        assert panel["stripes"][0]["damaged"] == ["rank-00001.safetensors", "parity-00000-0.bin"]
        assert panel["stripes"][0]["recoverable"] is False
        problems = [line["problem"] for line in lines(c.get("/api/checkpoints/a/verify")) if "problem" in line]
    assert {Path(p["file"]).name for p in problems} == {"parity-00000-0.bin", "rank-00001.safetensors"}
    assert all("not recoverable" in p["message"] for p in problems)


def test_full_verify_streams_progress_and_reads_every_value(protected):
    with TestClient(create_app([protected])) as c:
        ck = tm.open(protected)
        streamed = lines(c.get("/api/checkpoints/a/verify", params={"full": 1}))
    done = streamed[-1]
    assert done["ok"] and done["bytes_read"] == ck.nbytes and done["checksums_checked"] == 4
    assert done["checked"] == 4 + len(ck) + len(ck.objects)
    assert all(line["progress"]["total_bytes"] == ck.nbytes for line in streamed[:-1])


def test_integrity_of_other_formats_names_what_they_record(dcp_ckpt, minilm):
    with TestClient(create_app([dcp_ckpt, minilm / "model.safetensors"])) as c:
        dcp = c.get("/api/checkpoints/a/integrity").json()
        single = c.get("/api/checkpoints/b/integrity").json()
        verified = lines(c.get("/api/checkpoints/a/verify"))[-1]
    assert dcp["checksum"] == "crc32 (zip records)" and dcp["stripes"] == [] and dcp["redundancy"] is None
    assert {f["name"]: f["actual_size"] for f in dcp["files"]} == {
        f["name"]: (dcp_ckpt / f["name"]).stat().st_size for f in dcp["files"]}
    assert verified["ok"] and verified["checksums_checked"] > 0
    assert single["checksum"] is None and single["files"][0]["crc32c"] is None
    assert single["files"][0]["size"] == (minilm / "model.safetensors").stat().st_size


# ---------------------------------------------------------------------------
# the Plan page's server side
# ---------------------------------------------------------------------------


def test_a_config_only_folder_opens_for_the_plan_page(minilm, tmp_path):
    folder = tmp_path / "Llama-like"
    folder.mkdir()
    shutil.copy(minilm / "config.json", folder / "config.json")
    with TestClient(create_app([folder])) as c:
        (listed,) = c.get("/api/checkpoints").json()
        assert listed["config_only"] is True and listed["format"] is None and listed["tensor_count"] == 0
        summary = c.get("/api/checkpoints/a/summary").json()
        assert summary["config_only"] is True and summary["config"]["model_type"] == "bert"
        plan = c.get("/api/plan", params={"device": DEVICE}).json()
        assert plan["model"]["source"] == "config" and plan["model_kind"] == "encoder"
        assert plan["model"]["layers"] == 6 and plan["model"]["params"] == pytest.approx(22_713_216)
        for path in ("/api/checkpoints/a/verify", "/api/checkpoints/a/integrity"):
            response = c.get(path)
            assert response.status_code == 400 and "only config.json" in response.json()["error"]


def test_an_encoder_is_planned_as_an_encoder(minilm, hf_llama_safetensors):
    with TestClient(create_app([minilm / "model.safetensors", hf_llama_safetensors])) as c:
        bert = c.get("/api/plan", params={"ck": "a", "device": [DEVICE, DEVICE.replace("cuda:0", "cuda:1")]}).json()
        llama = c.get("/api/plan", params={"ck": "b", "device": DEVICE}).json()
        refused = c.get("/api/plan", params={"device": "cuda:0=1GiB,tflops=1,bw=1"})
    assert bert["model_kind"] == "encoder" and bert["model"]["kind"] == "encoder"
    assert bert["plans"].startswith("encoder-only (bert): one forward pass over 1×4,096 tokens; no KV cache")
    assert all(d["kv_cache"] == 0 and d["decode"]["tokens_per_s"] is None for d in bert["devices"])
    assert bert["overall"]["decode_tokens_per_s"] is None and bert["overall"]["prefill_tokens_per_s"] > 0
    assert bert["bottleneck"]["phase"] == "prefill" and "to encode" in bert["bottleneck"]["reason"]
    assert "lm_head" not in bert["device_map"] and not any("LM head" in n or "no config" in n for n in bert["notes"])
    # every stored byte is a weight (fp32 and the int64 position ids): the file less its header
    assert sum(d["weights"] for d in bert["devices"]) == (minilm / "model.safetensors").stat().st_size - \
        _header_bytes(minilm)
    assert llama["model_kind"] == "decoder" and llama["devices"][0]["kv_cache"] > 0
    assert llama["plans"].startswith("decoder (llama): prefill of 1×4,096 tokens, then decoding")
    assert refused.status_code == 400
    message = refused.json()["error"]
    assert "1.0 GiB" in message and "1073741824" not in message


def _header_bytes(minilm: Path) -> int:
    """The safetensors header of the model file: 8 bytes of length and the JSON."""
    raw = (minilm / "model.safetensors").read_bytes()[:8]
    return 8 + int.from_bytes(raw, "little")
