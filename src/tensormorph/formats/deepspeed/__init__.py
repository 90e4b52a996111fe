"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3, any dtype, any model-parallel degree), read without torch or
deepspeed.

Files, in the tag folder (`<save_dir>/latest` names the tag; the tag folder itself opens too):
- `mp_rank_00_model_states.pt` (stage 3: `zero_pp_rank_<r>_mp_rank_00_model_states.pt` per rank): the
  module's state dict, `param_shapes` (trainable parameters, per group, in flattening order),
  `shared_params` (tied name -> source), frozen parameters, step counters and the config.
- `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, one per data-parallel rank: rank r's flat fp32
  partitions and the optimizer state of those flat tensors.

Names in the logical checkpoint:
- `<param>`: the fp32 master weight, rebuilt as DeepSpeed's zero_to_fp32 does. Stages 1/2: each group's
  partitions concatenated over ranks, parameters taken in `param_shapes` order (plus any
  `param_alignment_paddings`). Stage 3: each parameter split on its own into ceil(n / ranks) elements per
  rank, at the same running offset in every rank's flat groups, padding at the end. Frozen parameters
  come from `frozen_param_fragments` (stage 3: one fragment per rank); ZeRO-1 records none, so there
  they are the module's own weights (metadata["frozen"] lists them).
- `<buffer>`: the module's buffers, as stored.
- `<tied>`: a tied parameter (`shared_params`): the same chunks as its source; metadata["aliases"].
- `optimizer.state.<param>.<key>`: the optimizer state per parameter. Flat state (AdamW's exp_avg and
  exp_avg_sq) is laid out like the masters; scalars (step) are those of the flat tensor holding the
  parameter's first element.
- `module.<param>`: stages 1-2, the module's own (bf16/fp16/fp32) weights; stage 3 saves only
  placeholders, which are left out.
- Objects: the model-states file's other entries (global_steps, ds_config, lr_scheduler...) and
  `optimizer.<key>` for the optimizer's settings (param_groups, loss_scaler...).

Model parallelism (`mp_rank_01...`, tensor parallelism over `mp_world_size` ranks): each model-parallel rank's
files are a ZeRO checkpoint of its shards, read as above (`part`). The global rank of (data-parallel rank d,
model-parallel rank m) is d * mp_world_size + m (DeepSpeed AutoTP's and Megatron's order; the files record only
the two coordinates), and every chunk keeps it in `ranks`. With `universal_checkpoint_info` in the model states
(AutoTP writes it, Megatron-DeepSpeed models set it), each parameter, its `module.` copy and its optimizer state
are one logical tensor, joined as DeepSpeed's own ds_to_universal joins them (`splits`: affine maps, replicated,
row-parallel on dim 1, otherwise dim 0, vocabulary padding cut); placement mesh(mp, dp) [Shard(1), ZeRO-2 flat
partition] and the like. Replicated tensors, and tensors the info does not describe (buffers, step counters),
are read from model-parallel rank 0 (metadata["tp_replicated"]); verify compares the other ranks' copies with
it. What DeepSpeed averages is one Partial(avg) tensor, each model-parallel rank's copy a contribution
(the mean, as ds_to_universal takes it). Sub-parameter layouts are listed per rank as `mp_rank_XX.<name>`
(metadata["tp_unmerged"] says why). Without the info (a plain run with an mpu) the split is unrecorded, so
every tensor is listed per rank as `mp_rank_XX.<name>` (metadata["tp_layout"] says so): guessing a dimension
would be a silent wrong merge. Objects are model-parallel rank 0's; pipeline parallelism is refused.

A parameter is a contiguous range of flat elements, and each rank holds one contiguous piece of it.
Chunks must be boxes, so each piece is cut at row edges into at most 2·ndim − 1 boxes (a partial
first row, whole rows, a partial last row, recursively), each a memory-mapped view of that rank's
file with `ranks=(r,)`. A region read therefore touches only the partitions, and bytes, that overlap
it, and the chunk table says which rank holds which part. metadata["partition_sizes"] lists the
elements of each rank's flat tensors (without DeepSpeed's trailing padding), [mp][dp] with model parallelism.

Modules: `discovery` (the tag folder and the per-rank files), `states` (parsing the files), `pieces`,
`zero12` and `zero3` (which rank holds which flat elements of each parameter), `arrays` (those elements
as memory-mapped boxes), `tensors` and `objects` (the logical checkpoint's entries), `part` (one
model-parallel rank's files), `splits` and `tp` (joining the model-parallel ranks), `reader` (detect,
open, checksums). The universal reader (formats/deepspeed_universal.py) reuses the parsing and naming.
"""

from __future__ import annotations

from .arrays import flat_boxes, reshaped
from .discovery import tag_folder
from .names import NAME, STATE_PREFIX
from .objects import model_objects, optimizer_objects
from .reader import checksum_problems, detect, open
from .states import FLAT_KEYS, load, read_model_states
from .tensors import add_aliases, in_model_order, module_tensors

__all__ = [
    "FLAT_KEYS", "NAME", "STATE_PREFIX", "add_aliases", "checksum_problems", "detect", "flat_boxes",
    "in_model_order", "load", "model_objects", "module_tensors", "open", "optimizer_objects", "read_model_states",
    "reshaped", "tag_folder",
]
