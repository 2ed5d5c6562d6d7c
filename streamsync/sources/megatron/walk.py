"""The model a megatron source reads: its parameters under global names (layer and expert indices as the whole
model numbers them), each rank's coordinates and process groups, and the table of every parameter's full shape,
owner and expert rank that every rank plans from."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...convert import (
    TRAINED_BUFFERS,
)
from ...convert.mappings import TPLayout
from ...errors import ValidationError
from ...pack import dtype_from_name, dtype_name
from ...plan.chunking import order_key

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
# an MTP layer and the decoder layer it holds (megatron-core 0.16 `transformer_layer`, later `mtp_model_layer`)
_MTP = re.compile(r"mtp\.layers\.(\d+)\.(?:(transformer_layer|mtp_model_layer)\.)?")
# local expert index: SequentialMLP `experts.local_experts.<i>.`, TEGroupedMLP `experts.linear_fc1.weight<i>`
_SEQ_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.linear_fc\d\.weight(\d+)$")


def _expert_match(name: str) -> re.Match[str] | None:
    return _SEQ_EXPERT.search(name) or _GROUPED_EXPERT.search(name)




# ------------------------------------------------------------------------------------------ model walking


def unwrap_chunks(model: object) -> list[Any]:
    """The model chunks (one per virtual pipeline stage), with DDP / Float16Module wrappers removed. Typed as
    Any: megatron-core's modules carry their structure (`decoder`, `config`) as dynamic attributes."""
    chunks: list[Any] = list(model) if isinstance(model, list | tuple) else [model]
    if not chunks:
        raise ValidationError("empty list of model chunks")
    out: list[Any] = []
    for m in chunks:
        while not hasattr(m, "decoder") and hasattr(m, "module"):
            m = m.module
        if not hasattr(m, "decoder") or not hasattr(m, "config"):
            raise ValidationError(f"{type(m).__name__} is not a megatron-core GPTModel (no decoder/config)")
        out.append(m)
    return out


def global_parameters(chunks: Sequence[Any]) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(global name, parameter, is_expert) for every parameter on this rank, and every buffer training changes
    (`convert.TRAINED_BUFFERS`: the router's expert bias).

    megatron-core numbers `decoder.layers.i` per pipeline stage (and per virtual stage) and local experts
    per expert-parallel rank; global names use the layer's `layer_number` and the MoE layer's
    `local_expert_indices`, so every rank names a tensor the same way. MTP layers (`mtp.layers.m`, on the last
    stage) are named by the index HF checkpoints give them, num_layers + m.
    """
    for chunk in chunks:
        layers: Any = chunk.decoder.layers
        mtp: Any = getattr(chunk, "mtp", None)
        buffers = ((n, b) for n, b in chunk.named_buffers() if n.endswith(TRAINED_BUFFERS))
        for name, p in itertools.chain(chunk.named_parameters(), buffers):
            expert = False
            m = _LAYER.match(name)
            t = _MTP.match(name) if m is None and mtp is not None else None
            if m:
                layer = layers[int(m.group(1))]
                name = f"decoder.layers.{layer.layer_number - 1}.{name[m.end():]}"
            elif t:
                layer = getattr(mtp.layers[int(t.group(1))], t.group(2) or "", None)
                name = f"mtp.layers.{chunk.config.num_layers + int(t.group(1))}.{name[t.end(1) + 1:]}"
            if m or t:
                e = _expert_match(name)
                if e:
                    expert = True
                    gid = layer.mlp.local_expert_indices[int(e.group(1))]
                    name = f"{name[:e.start(1)]}{gid}{name[e.end(1):]}"
            yield name, p, expert


# ------------------------------------------------------------------------------------------ topology


@dataclass(frozen=True, slots=True)
class Coords:
    """This rank's place in the dense (tp, pp, dp incl. cp) and expert (etp, ep, edp) decompositions."""

    rank: int
    tp: int = 0
    pp: int = 0
    dp: int = 0
    ep: int = 0
    etp: int = 0
    edp: int = 0

    @property
    def dense_writer(self) -> bool:
        return self.dp == 0

    @property
    def expert_writer(self) -> bool:
        return self.edp == 0

    def leads(self) -> bool:
        """Rank whose non-pipeline coordinates are all 0: the one that hands its stage to the sender."""
        return self.tp == self.dp == self.ep == self.etp == self.edp == 0


@dataclass
class Groups:
    tp: Any = None
    pp: Any = None
    ep: Any = None
    etp: Any = None
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    etp_size: int = 1

    @property
    def sharded(self) -> bool:
        return max(self.tp_size, self.pp_size, self.ep_size, self.etp_size) > 1


def topology(chunk: torch.nn.Module) -> tuple[Coords, Groups]:
    """This rank's coordinates and the model's process groups (from its pg_collection, else parallel_state)."""
    if not dist.is_available() or not dist.is_initialized():
        return Coords(0), Groups()
    pgs = getattr(chunk, "pg_collection", None)

    def group(field: str, getter: str) -> Any:
        g = getattr(pgs, field, None) if pgs is not None else None
        if g is None:
            from megatron.core import parallel_state

            try:
                g = getattr(parallel_state, getter)(check_initialized=False)
            except TypeError:
                g = getattr(parallel_state, getter)()
        return g

    def rank(g: Any) -> int:
        return 0 if g is None else dist.get_rank(g)

    def size(g: Any) -> int:
        return 1 if g is None else dist.get_world_size(g)

    tp = group("tp", "get_tensor_model_parallel_group")
    pp = group("pp", "get_pipeline_model_parallel_group")
    ep = group("ep", "get_expert_model_parallel_group")
    etp = group("expt_tp", "get_expert_tensor_parallel_group")
    dp = group("dp_cp", "get_data_parallel_group")
    edp = group("expt_dp", "get_expert_data_parallel_group")
    coords = Coords(dist.get_rank(), rank(tp), rank(pp), rank(dp), rank(ep), rank(etp), rank(edp))
    return coords, Groups(tp, pp, ep, etp, size(tp), size(pp), size(ep), size(etp))


# ------------------------------------------------------------------------------------------ global table


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One Megatron parameter as the whole model sees it (same on every rank)."""

    name: str                 # global name
    shape: tuple[int, ...]    # full shape, TP shards merged
    dtype: torch.dtype        # megatron's dtype (norms: float32)
    stage: int                # pipeline rank that holds it
    expert: bool
    ep: int                   # expert-parallel rank that holds it (0 for dense parameters)
    tp: TPLayout | None       # split over the (expert-)tensor-parallel group; None: whole on every rank
    local_shape: tuple[int, ...]


_Record = tuple[tuple[int, ...], list[tuple[str, tuple[int, ...], str, int | None, int, bool]]]


def _local_record(coords: Coords, params: dict[str, tuple[torch.Tensor, bool]]) -> _Record:
    rows = []
    for name, (p, expert) in params.items():
        dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else None
        rows.append((name, tuple(p.shape), dtype_name(p.dtype), dim, int(getattr(p, "partition_stride", 1)), expert))
    c = coords
    return (c.rank, c.tp, c.pp, c.dp, c.ep, c.etp, c.edp), rows


def _build_table(records: Sequence[_Record], groups: Groups) -> tuple[dict[str, ParamInfo], list[Coords]]:
    """Merge every rank's parameters into the global table, sorted in push order: embeddings, layers (experts
    by global index after the layer's other tensors), final norm and output layer. Only writer replicas'
    rows count when the model is sharded; unsharded, the one record is this rank's whole model."""
    table: dict[str, ParamInfo] = {}
    first_seen: dict[str, int] = {}
    all_coords = []
    for rec_coords, rows in records:
        c = Coords(*rec_coords)
        all_coords.append(c)
        for name, shape, dt, dim, stride, expert in rows:
            if groups.sharded and not (c.expert_writer if expert else c.dense_writer):
                continue
            size = groups.etp_size if expert else groups.tp_size
            layout = TPLayout(dim, stride) if dim is not None and dim >= 0 and size > 1 else None
            full = list(shape)
            if layout is not None:
                full[layout.dim] *= size
            info = ParamInfo(name, tuple(full), dtype_from_name(dt), c.pp, expert, c.ep if expert else 0, layout,
                             tuple(shape))
            old = table.get(name)
            if old is None:
                table[name] = info
                first_seen[name] = len(first_seen)
            elif (old.shape, old.dtype, old.ep) != (info.shape, info.dtype, info.ep):
                raise ValidationError(f"parameter {name!r} differs between ranks: {old} vs {info}")
            elif info.stage < old.stage:
                # a replica megatron keeps on another stage too (the embedding the last stage's MTP layers
                # read): sent once, from the first stage that holds it
                table[name] = info

    def key(n: str) -> tuple:
        m = _expert_match(n) if table[n].expert else None
        return (order_key(n), int(m.group(1)) if m else -1, first_seen[n])

    return {n: table[n] for n in sorted(table, key=key)}, all_coords


