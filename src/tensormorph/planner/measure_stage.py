"""One stage of a measured plan (`planner.measure_run`): a process that holds only its units of the real transformers
model, runs them on a prompt, and hands activations to the next stage over torch.distributed send/recv.

The model is built without weights (accelerate's `init_empty_weights`: parameters on the meta device, buffers such
as the rotary tables real), and only the tensors of this stage's units are read from the checkpoint, one at a time,
with Tensormorph's own reader. Every step is timed on CLOCK_MONOTONIC, which all processes of one machine share, so
the parent can line up a receive with the matching send: the wait before the sender had the data ready is idle
time, the rest is transfer.

torch and transformers are imported inside the functions: `import tensormorph.planner` needs numpy alone.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import CheckpointError
from ..formats import opened
from .runtime import _assign

EMBED, NORM, HEAD = "embed", "norm", "head"  # the ops besides the layers, which are their numbers


@dataclass(frozen=True)
class StageTask:
    """What one stage process runs: its rank among the stages, the checkpoint, and the whole pipeline's ops in
    order with the rank that runs each (so that every stage knows whom it receives from and sends to)."""

    rank: int
    world: int
    port: int
    folder: str  # the HF folder (config.json + safetensors)
    device: str  # the torch device this stage runs on: "cpu", "cuda:1"
    ops: tuple[tuple[str | int, int], ...]  # (EMBED | layer number | NORM | HEAD, rank), in pipeline order
    tensors: tuple[str, ...]  # the checkpoint tensors this stage loads (a tied head's is the embedding's)
    prompt: tuple[tuple[int, ...], ...]  # token ids, one row per sequence
    chunk: int  # prompt tokens per prefill pass
    new_tokens: int  # decode steps after the prefill
    dtype: str  # torch dtype name of weights and activations: "float32", "bfloat16"
    threads: int  # torch intra-op threads
    timeout_s: float
    warmup: bool  # run the whole prompt once untimed first: the first pass pays for lazy initialisation


@dataclass(frozen=True)
class Segment:
    """A maximal run of consecutive ops on one rank."""

    index: int
    rank: int
    ops: tuple[str | int, ...]

    @property
    def output_only(self) -> bool:
        """Only the final norm and head: it needs just the last position of the prompt."""
        return all(op in (NORM, HEAD) for op in self.ops)


def segments(ops: tuple[tuple[str | int, int], ...]) -> list[Segment]:
    out: list[Segment] = []
    for op, rank in ops:
        if out and out[-1].rank == rank:
            out[-1] = Segment(out[-1].index, rank, (*out[-1].ops, op))
        else:
            out.append(Segment(len(out), rank, (op,)))
    return out


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; elsewhere its peak, the best available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def run_stage(task: StageTask, results: Any) -> None:
    """Process entry point: put (rank, record) on `results`, or (rank, {"error": ...}) when the stage fails."""
    try:
        results.put((task.rank, _run(task)))
    except CheckpointError as exc:
        results.put((task.rank, {"error": str(exc)}))
    except Exception as exc:  # carried to the parent, which names the stage
        results.put((task.rank, {"error": f"{type(exc).__name__}: {exc}"}))


def _run(task: StageTask) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(task.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{task.port}", rank=task.rank,
                            world_size=task.world, timeout=timedelta(seconds=task.timeout_s))
    try:
        device = torch.device(task.device)
        model = _empty_model(task.folder, getattr(torch, task.dtype))
        before = rss_bytes()
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.reset_peak_memory_stats(device)
        loaded, held = _load(model, task, device)
        runner = _Runner(task, model, device)
        with torch.inference_mode():
            if task.warmup:
                runner.generate(None)
            dist.barrier()
            events: list[dict[str, Any]] = []
            tokens, logits, kv = runner.generate(events)
        dist.barrier()
        record = {"device": str(device), "tensors": loaded, "tensor_bytes": held, "kv_cache_bytes": kv,
                  "rss_before": before, "rss_peak": peak_rss_bytes(), "events": events,
                  "tokens": tokens, "logits": logits,
                  "accelerator_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
        return record
    finally:
        dist.destroy_process_group()


def _empty_model(folder: str, dtype: Any) -> Any:
    """The model of `folder`'s config.json with its parameters on the meta device, attention by SDPA."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    # never a checkpoint's own code: a config naming remote code (auto_map) is refused, not run or asked about
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype,
                                                trust_remote_code=False).eval()


def _load(model: Any, task: StageTask, device: Any) -> tuple[list[str], int]:
    """Read this stage's tensors (and only those) into the model on `device`, a tied head sharing the embedding;
    their names and the bytes they hold (each storage once)."""
    import torch

    from ..torch_arrays import to_torch

    dtype = getattr(torch, task.dtype)
    loaded = []
    with ExitStack() as stack:
        ck = opened(task.folder, stack)
        for name in task.tensors:
            tensor = ck[name]
            value = to_torch(tensor.full(force=True), tensor.dtype)
            if value.is_floating_point():
                value = value.to(dtype)
            _assign(model, name, value.to(device))
            loaded.append(name)
    holds_head = any(op == HEAD for op, rank in task.ops if rank == task.rank)
    if holds_head and getattr(_text_config(model), "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    storages = {}
    for name in loaded:
        storage = model.get_parameter(name).untyped_storage() if _is_parameter(model, name) \
            else model.get_buffer(name).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return loaded, sum(storages.values())


def _is_parameter(model: Any, name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(module)._parameters


def _text_config(model: Any) -> Any:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


class _Runner:
    """Runs this rank's segments for every prefill chunk and decode step, timing each receive, compute and send."""

    def __init__(self, task: StageTask, model: Any, device: Any):
        import inspect

        import torch

        self.task, self.model, self.device = task, model, device
        self.torch = torch
        self.inner = model.model
        self.segments = segments(task.ops)
        self.mine = [s for s in self.segments if s.rank == task.rank]
        self.embed_rank = self.segments[0].rank
        self.head_rank = self.segments[-1].rank
        self.dtype = getattr(torch, task.dtype)
        self.hidden = _text_config(model).hidden_size
        self.batch = len(task.prompt)
        self.prompt = torch.tensor(task.prompt, dtype=torch.long)
        layer = self.inner.layers[0]
        # transformers 5.x renamed past_key_values to cache in the decoder layers
        self.cache_kw = "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def items(self) -> list[tuple[str, int, int]]:
        """(phase, first position, end position) of every pass: the prefill chunks, then the decode steps."""
        length = self.prompt.shape[1]
        out = [("prefill", start, min(start + self.task.chunk, length)) for start in range(0, length, self.task.chunk)]
        return out + [("decode", length + k, length + k + 1) for k in range(self.task.new_tokens)]

    def generate(self, events: list[dict[str, Any]] | None) -> tuple[list[list[int]], list[Any], int]:
        """Prefill then decode; the generated tokens and last-position logits (head rank only), and the bytes of
        the KV cache this rank holds at the end."""
        import torch
        import torch.distributed as dist
        from transformers import DynamicCache

        cache = DynamicCache()
        pending: list[Any] = []  # isend works and their buffers, kept alive until they complete
        token: Any = None
        tokens: list[list[int]] = []
        logits: list[Any] = []
        items = self.items()
        length = self.prompt.shape[1]
        for index, (phase, start, end) in enumerate(items):
            last_of_prompt = phase == "decode" or end == length
            for seg in self.mine:
                if seg.output_only and not last_of_prompt:
                    continue
                record: dict[str, Any] = {"item": index, "phase": phase, "segment": seg.index}
                if seg.index == 0:
                    if phase == "prefill":
                        x = self.prompt[:, start:end].to(self.device)
                    elif self.head_rank == self.task.rank:
                        x = token
                    else:
                        x = self._recv((self.batch, 1), torch.long, self.head_rank, record)
                else:
                    width = 1 if seg.output_only else end - start
                    x = self._recv((self.batch, width, self.hidden), self.dtype, self.segments[seg.index - 1].rank,
                                   record)
                compute_start = time.monotonic()
                x = self._compute(seg, x, start, end, cache, last_of_prompt)
                self._sync()
                record["compute"] = (compute_start, time.monotonic())
                if seg.index == len(self.segments) - 1 and last_of_prompt:
                    token = x.argmax(dim=-1)  # greedy, (batch, 1)
                    logits.append(x[:, -1].float().cpu())
                    tokens.append(token[:, 0].tolist())
                    more = index + 1 < len(items)
                    if more and self.embed_rank != self.task.rank:
                        pending.append(self._send(token, self.embed_rank, record))
                elif seg.index < len(self.segments) - 1:
                    following = self.segments[seg.index + 1]
                    if following.output_only:
                        x = x[:, -1:]  # the head reads the last position only
                    if last_of_prompt or not following.output_only:
                        pending.append(self._send(x, following.rank, record))
                if events is not None:
                    events.append(record)
        for work, _ in pending:
            work.wait()
        dist.barrier()
        return tokens, [t.numpy() for t in logits], _cache_bytes(cache)

    def _recv(self, shape: tuple[int, ...], dtype: Any, source: int, record: dict[str, Any]) -> Any:
        import torch.distributed as dist

        buffer = self.torch.empty(shape, dtype=dtype)
        begin = time.monotonic()
        dist.recv(buffer, src=source)
        value = buffer.to(self.device)
        self._sync()
        record["recv"] = (begin, time.monotonic())
        return value

    def _send(self, value: Any, target: int, record: dict[str, Any]) -> tuple[Any, Any]:
        import torch.distributed as dist

        begin = time.monotonic()
        buffer = value.detach().to("cpu").contiguous()  # gloo moves host memory
        work = dist.isend(buffer, dst=target)
        record["send"] = (begin, time.monotonic())
        return work, buffer

    def _compute(self, seg: Segment, x: Any, start: int, end: int, cache: Any, final: bool) -> Any:
        """Run the segment's ops on positions [start, end); the norm and head only on the prompt's last pass."""
        torch = self.torch
        position_ids = torch.arange(start, end, device=self.device).unsqueeze(0).expand(self.batch, -1)
        rotary = None
        mask = None
        if start > 0 and end - start > 1:  # a later prefill chunk: SDPA's is_causal would align it top-left
            rows = torch.arange(start, end, device=self.device)[:, None]
            mask = (torch.arange(end, device=self.device)[None, :] <= rows)[None, None].expand(self.batch, 1, -1, -1)
        for op in seg.ops:
            if op == EMBED:
                x = self.inner.embed_tokens(x)
            elif op in (NORM, HEAD):
                if final:
                    x = self.inner.norm(x) if op == NORM else self.model.lm_head(x[:, -1:])
            else:
                if rotary is None:
                    rotary = self.inner.rotary_emb(x, position_ids)
                out = self.inner.layers[int(op)](x, attention_mask=mask, position_ids=position_ids,
                                                 position_embeddings=rotary, use_cache=True,
                                                 **{self.cache_kw: cache})
                x = out[0] if isinstance(out, tuple) else out
        return x


def _cache_bytes(cache: Any) -> int:
    import torch

    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                total += t.numel() * t.element_size()
    return total
