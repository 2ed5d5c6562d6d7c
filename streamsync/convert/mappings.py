"""Mapping objects: how one Megatron-core parameter becomes one or more HF tensors, and back.

A mapping knows three things about its parameter and nothing about process groups:

* names: a Megatron name pattern and the HF name template(s), with `{L}` for the global layer index and
  `{E}` for the global expert index;
* layout: `to_hf` turns the *full* (TP-gathered) Megatron tensor into HF tensors, `to_megatron` the reverse;
* how the parameter is split over tensor parallelism (`tp`: dimension and stride), which `tp_split` and
  `tp_merge` use. The Megatron source checks it against the parameter's own `partition_dim` /
  `partition_stride` attributes, so a table that disagrees with megatron-core fails at construction.

`to_hf` returns views of its input where the layout allows (renames, vocab row slices, gate/up halves); the
pack stage copies those straight into the packed buffer, so they cost no extra copy. Only the QKV split,
whose rows interleave per query group, has to copy.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ..plan.shards import Box

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Dims:
    """The model dimensions mappings need. `vocab_size` is the HF (unpadded) vocabulary."""

    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_query_groups:
            raise ValueError(f"{self.num_heads} heads do not divide into {self.num_query_groups} query groups")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups


@dataclass(frozen=True, slots=True)
class TPLayout:
    """How a parameter is split over a tensor-parallel group: along `dim`, in `stride` interleaved blocks.

    stride 1: rank r holds the r-th contiguous slice. stride s: the full tensor is cut into s * size blocks
    and rank r holds blocks r, r + size, ... (megatron-core's `partition_stride`); the gated linear_fc1 has
    stride 2, so each rank holds [gate_r; up_r].
    """

    dim: int
    stride: int = 1


COLUMN = TPLayout(0)
ROW = TPLayout(1)
GATED = TPLayout(0, 2)

#: How an inference engine's tensor-parallel workers split one HF tensor (vLLM's parallel layers), where a TPLayout
#: cannot say it: k/v rows by query group, a group on several workers where the workers outnumber the groups
KV_HEADS: Literal["kv_heads"] = "kv_heads"
#: ... and the rows of the vocabulary padded to 64, split by rows (VocabParallelEmbedding, ParallelLMHead)
VOCAB: Literal["vocab"] = "vocab"
EngineSplit = TPLayout | Literal["kv_heads", "vocab"] | None


def tp_split(full: torch.Tensor, layout: TPLayout | None, size: int) -> list[torch.Tensor]:
    """The shard each of `size` ranks holds (views). Replicated parameters (layout None): the whole tensor."""
    if layout is None or size == 1:
        return [full] * size
    n = full.shape[layout.dim]
    if n % (size * layout.stride):
        raise ValueError(f"dimension {layout.dim} of size {n} does not split into {size} ranks x "
                         f"{layout.stride} strides")
    blocks = full.chunk(size * layout.stride, dim=layout.dim)
    return [blocks[r] if layout.stride == 1 else torch.cat(blocks[r::size], dim=layout.dim)
            for r in range(size)]


def tp_merge(shards: Sequence[torch.Tensor], layout: TPLayout | None) -> torch.Tensor:
    """Inverse of `tp_split`: the full tensor from every rank's shard, in group-rank order."""
    if layout is None or len(shards) == 1:
        return shards[0]
    if layout.stride == 1:
        return torch.cat(list(shards), dim=layout.dim)
    pieces = [s.chunk(layout.stride, dim=layout.dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(layout.stride) for r in range(len(shards))], dim=layout.dim)


class Mapping:
    """One Megatron parameter <-> `len(hf)` HF tensors. This base class is the 1:1 rename.

    `send=False` marks a mapping that only exists for the reverse direction: the tied output layer that
    megatron keeps on the last pipeline stage is filled from the embedding, and never sent (HF checkpoints
    with tied embeddings hold one copy).
    """

    tp_default: TPLayout | None = None
    #: the dtype the HF tensors keep whatever the receiver's dtype (None: the receiver's, as everything else)
    hf_dtype: torch.dtype | None = None
    #: the Megatron tensor is a buffer the trainer changes (`named_buffers`), not a parameter
    buffer: bool = False

    def __init__(self, megatron: str, *hf: str, tp: TPLayout | str | None = "default", send: bool = True,
                 engine: EngineSplit | str = "same") -> None:
        if len(hf) != self.arity():
            raise ValueError(f"{type(self).__name__} maps to {self.arity()} HF tensor(s), got {len(hf)}: {hf}")
        self.megatron = megatron
        self.hf = tuple(hf)
        self.tp: TPLayout | None = self.tp_default if tp == "default" else tp  # type: ignore[assignment]
        self.send = send
        self._engine = engine

    def engine_splits(self) -> tuple[EngineSplit, ...]:
        """How an inference engine's tensor-parallel workers split each of the HF tensors (`plan.vllm_layout`):
        as Megatron splits the parameter, unless the engine's layer differs (`engine=`: vLLM keeps MLA's down
        projections whole on every worker, where megatron-core's local spec splits them)."""
        split = self.tp if self._engine == "same" else self._engine
        return (split,) * self.arity()  # type: ignore[return-value]

    def arity(self) -> int:
        return 1

    def under(self, old: str, new: str, hf: tuple[str, str] | None = None) -> Mapping:
        """The same mapping for a copy of the module under another Megatron prefix (an MTP layer's transformer
        layer is a decoder layer under `mtp.layers.{L}.transformer_layer.`), and under another HF prefix where
        `hf` = (old, new) says so (MiMo holds it under `model.mtp_layers.{M}.`)."""
        m = copy.copy(self)
        if not self.megatron.startswith(old):
            raise ValueError(f"{self.megatron!r} does not start with {old!r}")
        m.megatron = new + self.megatron[len(old):]
        if hf is not None:
            if not all(h.startswith(hf[0]) for h in self.hf):
                raise ValueError(f"{self.hf!r} do not all start with {hf[0]!r}")
            m.hf = tuple(hf[1] + h[len(hf[0]):] for h in self.hf)
        return m

    def hf_shapes(self, shape: Shape, dims: Dims) -> list[Shape]:
        """HF shapes for a full Megatron tensor of `shape` (no data needed: plans are made from this)."""
        return [tuple(shape)]

    def to_hf(self, t: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        """Full Megatron tensor -> HF tensors (dtype unchanged; the caller casts to the receiver's dtype)."""
        return [t]

    def to_hf_views(self, t: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        """Like `to_hf`, but a tensor may come in a blocked shape (streamsync.pack.fits) to avoid a copy:
        for the pack stage, which writes it in row-major order; everyone else wants `to_hf`."""
        return self.to_hf(t, dims)

    def to_megatron(self, hf: Sequence[torch.Tensor], dims: Dims, shape: Shape | None = None) -> torch.Tensor:
        """HF tensors -> the full Megatron tensor (`shape`: the Megatron shape, where it is not implied)."""
        return hf[0]

    def shard_parts(self, local: Shape, dims: Dims, size: int, rank: int) -> list[Part]:
        """What tensor-parallel rank `rank` of `size` holds of each HF tensor, from its local shard's shape
        `local`: (HF tensor index, box in the HF tensor, box in the local shard), no data needed. The boxes
        of every rank together cover each HF tensor once (replicated parameters: every rank holds it all)."""
        full = list(local)
        if self.tp is not None and size > 1:
            full[self.tp.dim] *= size
        hf = self.hf_shapes(tuple(full), dims)[0]
        if self.tp is None or size == 1:
            return [Part(0, _box(hf), _box(local))]
        if self.tp.stride != 1:
            raise ValueError(f"{self.megatron}: stride {self.tp.stride} is not a plain split")
        return [Part(0, _box(hf, self.tp.dim, rank * local[self.tp.dim], local[self.tp.dim]), _box(local))]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.megatron!r} -> {', '.join(map(repr, self.hf))}, tp={self.tp})"


class Rename(Mapping):
    """Same tensor, another name. Pass tp=COLUMN / ROW for tensor-parallel weights, None if replicated."""


Auto = Rename


class Cast(Rename):
    """A replicated parameter megatron-core keeps in another dtype (layer norms: float32).

    Forward the caller casts to the receiver's dtype like everything else; the reverse gives back
    megatron's dtype, so an HF bf16 norm round-trips exactly (bf16 -> fp32 -> bf16 is lossless).
    """

    def __init__(self, megatron: str, hf: str, *, dtype: torch.dtype = torch.float32, send: bool = True) -> None:
        super().__init__(megatron, hf, tp=None, send=send)
        self.dtype = dtype

    def to_megatron(self, hf: Sequence[torch.Tensor], dims: Dims, shape: Shape | None = None) -> torch.Tensor:
        return hf[0].to(self.dtype)


class Buffer(Cast):
    """A float32 buffer the trainer learns and the engine keeps in float32 (the MoE router's expert bias:
    megatron's `router.expert_bias`, HF's `gate.e_score_correction_bias`): sent in float32 whatever the
    receiver's dtype, as checkpoints hold it and vLLM allocates it."""

    hf_dtype = torch.float32
    buffer = True


class SwappedHalves(Rename):
    """A projection of two concatenated inputs whose checkpoint takes them in the other order: MiMo's MTP
    `input_proj` computes from [hidden; embedding], Megatron's `eh_proj` from [embedding; hidden], so the two
    column halves trade places (each way). Megatron splits it by rows over TP; every rank's shard holds both
    halves of its rows."""

    tp_default = COLUMN

    def to_hf(self, t: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        return [_swap_halves(t, self.megatron)]

    def to_megatron(self, hf: Sequence[torch.Tensor], dims: Dims, shape: Shape | None = None) -> torch.Tensor:
        return _swap_halves(hf[0], self.hf[0])

    def shard_parts(self, local: Shape, dims: Dims, size: int, rank: int) -> list[Part]:
        rows, cols = local[0], local[1]
        if cols % 2:
            raise ValueError(f"{self.megatron}: {cols} columns cannot hold two halves")
        h, r0 = cols // 2, (rank * rows if self.tp is not None and size > 1 else 0)
        return [Part(0, Box((r0, h), (rows, h)), Box((0, 0), (rows, h))),
                Part(0, Box((r0, 0), (rows, h)), Box((0, h), (rows, h)))]


def _swap_halves(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2 or t.shape[1] % 2:
        raise ValueError(f"{name}: {tuple(t.shape)} is not a matrix of two column halves")
    a, b = t.chunk(2, dim=1)
    return torch.cat([b, a], dim=1)


class Vocab(Rename):
    """Embedding / output layer: megatron pads the vocabulary to a multiple of TP (x make_vocab_size_divisible_by);
    HF holds exactly `dims.vocab_size` rows. Forward drops the padding rows, reverse pads with zeros."""

    tp_default = COLUMN

    def hf_shapes(self, shape: Shape, dims: Dims) -> list[Shape]:
        if shape[0] < dims.vocab_size:
            raise ValueError(f"{self.megatron}: {shape[0]} rows, fewer than the vocabulary ({dims.vocab_size})")
        return [(dims.vocab_size, *shape[1:])]

    def to_hf(self, t: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        return [t[: dims.vocab_size]]

    def engine_splits(self) -> tuple[EngineSplit, ...]:
        return (VOCAB,)

    def shard_parts(self, local: Shape, dims: Dims, size: int, rank: int) -> list[Part]:
        # Rank r holds padded rows [r * n, (r + 1) * n); the HF tensor only the first `vocab_size` of them.
        n = local[0]
        a, b = rank * n, min((rank + 1) * n, dims.vocab_size)
        if b <= a:
            return []  # only padding rows here
        hf = (dims.vocab_size, *local[1:])
        return [Part(0, _box(hf, 0, a, b - a), _box(local, 0, 0, b - a))]

    def to_megatron(self, hf: Sequence[torch.Tensor], dims: Dims, shape: Shape | None = None) -> torch.Tensor:
        t = hf[0]
        rows = t.shape[0] if shape is None else shape[0]
        if rows == t.shape[0]:
            return t
        pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
        return torch.cat([t, pad], dim=0)


class QKV(Mapping):
    """Megatron's fused linear_qkv (weight or bias) <-> HF q_proj, k_proj, v_proj.

    Megatron groups rows per query group g: [q heads of g (heads/groups x head_dim rows); k_g; v_g], for
    g = 0..groups-1. TP splits whole groups (stride 1), so each rank's shard has the same grouped layout.
    """

    tp_default = COLUMN

    def arity(self) -> int:
        return 3

    def engine_splits(self) -> tuple[EngineSplit, ...]:
        return (COLUMN, KV_HEADS, KV_HEADS)  # q by heads; k and v by query group

    def hf_shapes(self, shape: Shape, dims: Dims) -> list[Shape]:
        rest = tuple(shape[1:])
        hd, g = dims.head_dim, dims.num_query_groups
        if shape[0] != (dims.num_heads + 2 * g) * hd:
            raise ValueError(f"{self.megatron}: {shape[0]} rows, expected (heads {dims.num_heads} + 2 x groups {g})"
                             f" x head_dim {hd}")
        return [(dims.num_heads * hd, *rest), (g * hd, *rest), (g * hd, *rest)]

    def to_hf(self, t: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        rest = tuple(t.shape[1:])
        hd, g, hpg = dims.head_dim, dims.num_query_groups, dims.heads_per_group
        q, k, v = t.reshape(g, (hpg + 2) * hd, *rest).split([hpg * hd, hd, hd], dim=1)
        return [q.reshape(g * hpg * hd, *rest), k.reshape(g * hd, *rest), v.reshape(g * hd, *rest)]

    def to_hf_views(self, t: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        # q/k/v of each query group interleave in the fused tensor: as (groups, rows, ...) they are views,
        # which pack copies straight into place (streamsync.pack.fits) instead of a reshape copy here.
        rest = tuple(t.shape[1:])
        hd, g, hpg = dims.head_dim, dims.num_query_groups, dims.heads_per_group
        return list(t.reshape(g, (hpg + 2) * hd, *rest).split([hpg * hd, hd, hd], dim=1))

    def shard_parts(self, local: Shape, dims: Dims, size: int, rank: int) -> list[Part]:
        # The shard holds whole query groups, each laid out [q heads; k; v]: three boxes per group.
        rest = tuple(local[1:])
        hd, g, hpg = dims.head_dim, dims.num_query_groups, dims.heads_per_group
        per = (hpg + 2) * hd
        if local[0] % per or (local[0] // per) * size != g:
            raise ValueError(f"{self.megatron}: a shard of {local[0]} rows is not {g // size} whole query groups")
        shapes = self.hf_shapes((g * per, *rest), dims)
        out = []
        for j in range(local[0] // per):
            grp, base = rank * (g // size) + j, j * per
            out += [Part(0, _box(shapes[0], 0, grp * hpg * hd, hpg * hd), _box(local, 0, base, hpg * hd)),
                    Part(1, _box(shapes[1], 0, grp * hd, hd), _box(local, 0, base + hpg * hd, hd)),
                    Part(2, _box(shapes[2], 0, grp * hd, hd), _box(local, 0, base + (hpg + 1) * hd, hd))]
        return out

    def to_megatron(self, hf: Sequence[torch.Tensor], dims: Dims, shape: Shape | None = None) -> torch.Tensor:
        q, k, v = hf
        rest = tuple(q.shape[1:])
        hd, g, hpg = dims.head_dim, dims.num_query_groups, dims.heads_per_group
        fused = torch.cat([q.reshape(g, hpg * hd, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], dim=1)
        return fused.reshape(g * (hpg + 2) * hd, *rest)


class GatedMLP(Mapping):
    """Megatron's linear_fc1 of a gated MLP (SwiGLU) <-> HF gate_proj, up_proj.

    The full tensor is [gate; up]; TP splits it with stride 2 so each rank holds [gate_r; up_r].
    """

    tp_default = GATED

    def arity(self) -> int:
        return 2

    def engine_splits(self) -> tuple[EngineSplit, ...]:
        return (COLUMN, COLUMN)  # gate and up, each by rows

    def hf_shapes(self, shape: Shape, dims: Dims) -> list[Shape]:
        if shape[0] % 2:
            raise ValueError(f"{self.megatron}: {shape[0]} rows cannot hold gate and up halves")
        half = (shape[0] // 2, *shape[1:])
        return [half, half]

    def to_hf(self, t: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        gate, up = t.chunk(2, dim=0)
        return [gate, up]

    def shard_parts(self, local: Shape, dims: Dims, size: int, rank: int) -> list[Part]:
        # Rank r holds [gate_r; up_r]: the r-th row block of each half, two contiguous halves of its shard.
        h = local[0] // 2
        hf = (h * size, *local[1:])
        return [Part(0, _box(hf, 0, rank * h, h), _box(local, 0, 0, h)),
                Part(1, _box(hf, 0, rank * h, h), _box(local, 0, h, h))]

    def to_megatron(self, hf: Sequence[torch.Tensor], dims: Dims, shape: Shape | None = None) -> torch.Tensor:
        return torch.cat(list(hf), dim=0)


class FusedGatedMLP(GatedMLP):
    """Megatron's gated linear_fc1 <-> a checkpoint that holds it fused as one `gate_up_proj` ([gate; up], as
    GLM-4 saves it): the same rows, one HF tensor; TP still splits each half (stride 2)."""

    def arity(self) -> int:
        return 1

    def engine_splits(self) -> tuple[EngineSplit, ...]:
        return (GATED,)

    def hf_shapes(self, shape: Shape, dims: Dims) -> list[Shape]:
        if shape[0] % 2:
            raise ValueError(f"{self.megatron}: {shape[0]} rows cannot hold gate and up halves")
        return [tuple(shape)]

    def to_hf(self, t: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        return [t]

    def shard_parts(self, local: Shape, dims: Dims, size: int, rank: int) -> list[Part]:
        # Rank r holds [gate_r; up_r]: rows r*h.. of the gate half and I + r*h.. of the up half.
        h = local[0] // 2
        hf = (2 * h * size, *local[1:])
        return [Part(0, _box(hf, 0, rank * h, h), _box(local, 0, 0, h)),
                Part(0, _box(hf, 0, h * size + rank * h, h), _box(local, 0, h, h))]

    def to_megatron(self, hf: Sequence[torch.Tensor], dims: Dims, shape: Shape | None = None) -> torch.Tensor:
        return hf[0]


@dataclass(frozen=True, slots=True)
class Part:
    """What one tensor-parallel shard holds of one HF tensor: the HF tensor's index among the mapping's, the
    box of it (`plan.shards.Box`), and where that box lies in the local shard (a box of the same size)."""

    hf: int
    box: Box
    local: Box


def _box(shape: Sequence[int], dim: int = 0, start: int = 0, rows: int | None = None) -> Box:
    """The whole of `shape`, or rows `[start, start + rows)` of dimension `dim`."""
    return Box.whole(shape) if rows is None else Box.rows(shape, start, rows, dim)


__all__ = ["COLUMN", "GATED", "QKV", "ROW", "Auto", "Buffer", "Cast", "Dims", "FusedGatedMLP", "GatedMLP", "Mapping",
           "Part", "Rename", "SwappedHalves", "TPLayout", "Vocab", "tp_merge", "tp_split"]
