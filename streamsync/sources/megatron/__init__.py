"""A megatron-core GPTModel sharded over TP / PP / EP (and expert TP), streamed as full HF tensors.

Who does what. Every rank of the default process group calls `push(model)` (ranks other than the sender
with `WeightSync([])`, no engines), so the collectives line up:

* sender: global rank 0 (tensor, pipeline, data, context, expert and expert-tensor parallel rank all 0). It
  ends each gather holding every full Megatron tensor of the chunk, converts and sends.
* stage leader: on pipeline stage s, the rank whose other coordinates are all 0 (rank 0 leads stage 0).
  After the TP and EP rounds it holds the stage's full tensors and sends those of the chunk to the sender.
* writer replica: dense tensors are gathered only by data(+context)-parallel rank 0, experts only by
  expert-data-parallel rank 0; other replicas hold copies and issue nothing.

A chunk's gather runs three rounds, each coalesced to one collective per (group, dtype) per chunk (or per
bucket of at most `bucket_bytes`), all async and awaited together:

  1. TP:  all-gather the shards of the stage's dense tensors over the tensor-parallel group, and of its
          local experts over the expert-tensor-parallel group; merged by `partition_dim` / `partition_stride`.
  2. EP:  all-gather the (now full) local experts over the expert-parallel group: every expert of the layer.
  3. PP:  each other stage's leader sends its part of the chunk to the sender, point-to-point inside the
          pipeline group, with group-local ranks (`group_dst` / `group_src`: a global rank where a group
          rank is wanted is the classic bug here).

A group of size 1 issues nothing, so TP = PP = EP = 1 costs no collective at all. The whole gather of a chunk
runs in a worker thread (`anyio.to_thread`), so the event loop keeps converting, packing and sending earlier
chunks meanwhile. Every rank derives the same plan from one table of every parameter's full shape, dtype,
owning stage and expert rank, built at construction with one `all_gather_object` (skipped when nothing is
sharded; cached per model, so later pushes of the same model exchange nothing).
"""

from __future__ import annotations

from .source import MegatronSource
from .walk import Coords, Groups, ParamInfo, global_parameters, topology, unwrap_chunks

__all__ = ["Coords", "Groups", "MegatronSource", "ParamInfo", "global_parameters", "topology", "unwrap_chunks"]
