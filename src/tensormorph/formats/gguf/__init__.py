"""GGUF (llama.cpp): one `.gguf` file, or a split set `<stem>-00001-of-0000N.gguf` ... shown as file shards.

Layout: magic `GGUF`, u32 version, u64 tensor count, u64 key/value count, the key/values, the tensor
infos (name, dims with ne[0] the fastest axis, ggml type, offset into the data section), padding to
`general.alignment` (default 32), then the data. The logical shape is the dims reversed, as numpy and
gguf's own reader see it.

Float and integer tensors (F32, F16, BF16, F64, I8..I64) are memory-mapped chunks. Quantized tensors
(Q4_0, Q4_K, Q8_0, ...) read as float32, the type llama.cpp dequantizes to, via `gguf.quants.dequantize`
over only the blocks a region touches; their block format is the chunk source's `encoding`.
Metadata arrays longer than EAGER_ARRAY_ITEMS (the tokenizer's vocabulary) are summarised in
Checkpoint.metadata and decoded in full on demand as objects under the same key.

Modules: `header` (the binary header parser and its bounds), `quantized` (QuantizedBlocks and
dequantization), `reader` (detect, open, the files of a split set).
"""

from __future__ import annotations

from .header import GGML_TYPES, MAX_COUNT, read_header
from .reader import NAME, checksum_problems, detect, open

__all__ = ["GGML_TYPES", "MAX_COUNT", "NAME", "checksum_problems", "detect", "open", "read_header"]
