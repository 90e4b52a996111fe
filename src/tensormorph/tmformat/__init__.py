"""The Tensormorph checkpoint format (docs/format.md), torch-free: everything that writes or reads it.

    manifest     the JSON manifest: records, tagged plain values, validation
    layout       placement arithmetic: each rank's box, the writer of each box
    stream       a safetensors file streamed block by block (the rank files)
    checksums    CRC-32C while writing, one block verifier while reading
    writer       SaveTransaction: plan -> prepare -> write -> commit, for tm.save and convert alike
    commit       where a save goes (a local folder or an fsspec prefix) and how it commits atomically
    parity       Reed-Solomon parity and copies (the coder)
    recovery     which files rebuild which, from the manifest
    integrity    whole files judged against the manifest
    reader       BoxReader: exact byte-run reads of boxes, checked, for tm.load
    checkpoint   a committed folder as a logical Checkpoint (tm.open), its reads checked

The reader under `formats/` is a thin adapter over `checkpoint`; torch's side (DTensors, collectives)
lives in `tensormorph.distributed`.
"""
