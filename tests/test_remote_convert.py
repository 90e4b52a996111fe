"""`convert --to safetensors` to an object store's URL, against moto's S3 server behind the counting proxy
(tests/remote_support.py): shards uploaded as each is complete, the index last; the result opens bit-exact; a failed
upload leaves the prefix empty; the local disk keeps nothing.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from remote_support import CountingProxy, S3Endpoint

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError, UnsupportedError

pytestmark = pytest.mark.timeout(180)

BUCKET = "converted"
SHARD_SIZE = "300KB"  # the tiny Llama's 1.1 MB of weights in several shards


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with S3Endpoint() as endpoint:
        endpoint.make_bucket(BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def proxy(s3: S3Endpoint) -> Iterator[CountingProxy]:
    with CountingProxy(s3.endpoint) as counting:
        yield counting


@pytest.fixture(autouse=True)
def _private_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Path]:
    """Local temporary files go to a folder of the test's own, which must be empty afterwards; fresh proxy counts."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    if "proxy" in request.fixturenames:
        request.getfixturevalue("proxy").clear_faults()
        request.getfixturevalue("proxy").reset()
    yield temp
    assert list(temp.iterdir()) == []


def keys(s3: S3Endpoint, prefix: str) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
    return sorted(item["Key"][len(prefix) + 1:] for item in listed)


def new_prefix() -> str:
    return f"out-{uuid.uuid4().hex[:8]}"


def test_convert_to_safetensors_on_s3_uploads_the_index_last_and_reads_back_bit_exact(hf_llama_safetensors, s3,
                                                                                      proxy):
    prefix = new_prefix()
    url = f"s3://{BUCKET}/{prefix}"
    with tm.remote_options(s3.storage_options_via(proxy.url), cache=False):
        result = tm.convert(hf_llama_safetensors, url, to="safetensors", max_shard_size=SHARD_SIZE)
        assert result.check is not None and result.check.identical
        shards = [f for f in result.files if f.endswith(".safetensors")]
        assert len(shards) > 1 and result.destination == url
        assert keys(s3, prefix) == sorted([*shards, "model.safetensors.index.json"])
        puts = [r.path.rsplit("/", 1)[-1] for r in proxy.requests if r.method == "PUT"]
        assert sorted(puts[:-1]) == sorted(shards) and puts[-1] == "model.safetensors.index.json"
        source, converted = tm.open(hf_llama_safetensors), tm.open(f"{url}/model.safetensors.index.json")
        assert list(converted) == list(source)
        for name in source:
            got, want = converted[name].full(), source[name].full()
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name


def test_a_failed_upload_deletes_what_it_uploaded(hf_llama_safetensors, s3, proxy):
    prefix = new_prefix()
    proxy.fail_next(1, status=403, path_contains="-00002-of-", method="PUT")  # the second shard: refused
    with tm.remote_options(s3.storage_options_via(proxy.url), cache=False), \
            pytest.raises(CheckpointError, match="00002") as caught:
        tm.convert(hf_llama_safetensors, f"s3://{BUCKET}/{prefix}", to="safetensors", max_shard_size=SHARD_SIZE)
    assert f"s3://{BUCKET}/{prefix}" in str(caught.value)
    puts = [r.path.rsplit("/", 1)[-1] for r in proxy.requests if r.method == "PUT"]
    deleted = [r.path.rsplit("/", 1)[-1] for r in proxy.requests if r.method == "DELETE"]
    assert "-00001-of-" in puts[0] and deleted == puts[:1]  # the first shard was uploaded, then deleted
    assert keys(s3, prefix) == []


def test_a_prefix_that_holds_objects_or_an_http_url_is_refused(hf_llama_safetensors, s3, proxy):
    prefix = new_prefix()
    s3.client().put_object(Bucket=BUCKET, Key=f"{prefix}/keep.txt", Body=b"precious")
    with tm.remote_options(s3.storage_options_via(proxy.url), cache=False):
        with pytest.raises(CheckpointError, match="already holds objects"):
            tm.convert(hf_llama_safetensors, f"s3://{BUCKET}/{prefix}", to="safetensors")
        with pytest.raises(UnsupportedError, match="HTTP is read-only"):
            tm.convert(hf_llama_safetensors, f"{proxy.url}/out", to="safetensors")
    assert keys(s3, prefix) == ["keep.txt"]
    assert not any(r.method == "PUT" for r in proxy.requests)


def test_the_cli_converts_a_single_file_to_s3(hf_llama_safetensors, s3, proxy, tmp_path):
    source = hf_llama_safetensors / "model-00002-of-00003.safetensors"
    prefix = new_prefix()
    options = [f"--storage-option={k}" for k in (f"key={s3.key}", f"secret={s3.secret}",
                                                 f"client_kwargs.endpoint_url={proxy.url}",
                                                 "client_kwargs.region_name=us-east-1")]
    result = CliRunner().invoke(main, [*options, "--no-cache", "convert", str(source), f"s3://{BUCKET}/{prefix}",
                                       "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["files"] == ["model.safetensors"] and report["check"]["counts"] == {"equal": report["tensors"]}
    assert keys(s3, prefix) == ["model.safetensors"]
    with tm.remote_options(s3.storage_options_via(proxy.url), cache=False):
        converted = tm.open(f"s3://{BUCKET}/{prefix}/model.safetensors")
        source_ck = tm.open(source)
        assert {n: converted[n].full().tobytes() for n in converted} == \
            {n: source_ck[n].full().tobytes() for n in source_ck}
