"""A receiver model laid out like vLLM's: fused parameters, loaded through `load_weights`.

vLLM does not hold HF checkpoint tensors one to one. Its Qwen3/Llama models fuse q/k/v into `qkv_proj` and
gate/up into `gate_up_proj`, and FusedMoE stacks every expert of a layer into `experts.w13_weight`
[E, 2I, H] and `experts.w2_weight` [E, H, I]. `load_weights(iterable of (HF name, tensor))` maps each
checkpoint tensor into its slice through mapping tables (`stacked_params_mapping`, the expert mapping).
`FusedModel` does the same, so a GPU benchmark without vLLM pays the receiver's real copy pattern: one
copy of every received tensor into a slice of a larger parameter.

Built from the HF specs a push sends, so it accepts exactly those names, dtypes and shapes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ValidationError
from ..models.synthetic import Spec, fill_random
from ..pack import batched, coalesce, dtype_from_name, dtype_name, fits
from ..receiver.kernels import SegmentCopy
from ..receiver.loaders import Loader, LoadingModule, Weights

# (fused parameter, HF projection, shard id), as vLLM's Qwen3/Llama `stacked_params_mapping`. Shards lie in
# the fused parameter's rows in this order.
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

# (fused expert parameter, HF projection, shard id): FusedMoE's w13 holds [gate; up] rows per expert, w2 the
# down projection.
EXPERT_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("w13_weight", "gate_proj", 0),
    ("w13_weight", "up_proj", 1),
    ("w2_weight", "down_proj", 0),
)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one HF tensor lives: rows [offset, offset + rows) of `param` (of expert `expert`, if set)."""

    param: str
    expert: int | None
    offset: int
    rows: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _stacked(name: str) -> tuple[str, str | int] | None:
    for fused, proj, shard in STACKED_PARAMS:
        marker = f".{proj}."
        if marker in name:
            return name.replace(marker, f".{fused}.", 1), shard
    return None


def _expert(name: str) -> tuple[str, int, int] | None:
    m = _EXPERT.match(name)
    if m is None:
        return None
    for fused, proj, shard in EXPERT_PARAMS:
        if m["proj"] == proj:
            return f"{m['prefix']}.{fused}", int(m["e"]), shard
    return None


class FusedLoader(Loader):
    """A FusedModel's loader. Its load is copies into the model's parameters and nothing else (checks aside,
    which a repeat of the same chunk passes): WeightReceiver may capture a chunk's load as a CUDA graph and
    replay it. vLLM's layerwise reload is not (it swaps parameters and runs weight processing), so this
    stand-in is faster than a vLLM engine from the second push on; benchmarks say which they measure."""

    accepts_blocked = True  # takes a tensor in a blocked shape of its slot's (see `pack.fits`)
    capturable = True

    def __init__(self, model: FusedModel) -> None:
        self.model = model

    def load(self, weights: Weights) -> set[str]:
        return self.model.load_weights(weights)

    def prepare_load(self, weights: Weights) -> SegmentCopy:
        return self.model.prepare_load(weights)

    def expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return self.model.expected()


class FusedModel(LoadingModule):
    """Parameters fused like vLLM's; `load_weights` is the vLLM model protocol."""

    def __init__(self, specs: Iterable[Spec], *, device: str | torch.device = "cpu", fill: str = "zeros",
                 seed: int = 0, tie: bool = False) -> None:
        super().__init__()
        specs = list(specs)
        self.slots: dict[str, Slot] = {}
        # fused name -> ordered [(shard, HF name, dtype, shape)]; experts: (expert, shard, ...)
        groups: dict[str, list[tuple[tuple[int, int], str, torch.dtype, tuple[int, ...]]]] = {}
        plain: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        shard_rank = {s: i for i, (_, _, s) in enumerate(STACKED_PARAMS)}
        for name, dt, shape in specs:
            dtype = dtype_from_name(dt)
            shape = tuple(shape)
            if (ex := _expert(name)) is not None:
                fused, e, shard = ex
                groups.setdefault(fused, []).append(((e, shard), name, dtype, shape))
            elif (st := _stacked(name)) is not None:
                fused, shard = st
                groups.setdefault(fused, []).append(((0, shard_rank[shard]), name, dtype, shape))
            else:
                plain.append((name, dtype, shape))
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape in plain:
            tensors[name] = torch.empty(shape, dtype=dtype, device=device)
        for fused, members in groups.items():
            tensors[fused] = self._fuse(fused, sorted(members, key=lambda m: m[0]), device)
        gen = torch.Generator().manual_seed(seed)
        for name, t in tensors.items():
            if fill == "random":
                fill_random(t, gen) if t.device.type == "cpu" else t.normal_()
            elif fill == "zeros":
                t.zero_()
            self._register(name, t)
        # A tied head is the embedding's Parameter itself, as vLLM's `ParallelLMHead.tie_weights` makes it: on
        # GPU the output matmul reads that Parameter, so loading the embedding updates the head by construction.
        self.tied = tie and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
        if self.tied:
            self.add_module("lm_head", torch.nn.Module())
            self.lm_head.register_parameter("weight", self.get_parameter("model.embed_tokens.weight"))
        self.hf_specs_: list[Spec] = [(n, d, tuple(s)) for n, d, s in specs]
        # Where each HF tensor lands, resolved once: a chunk's load is then lookups and copies only.
        params = dict(self.named_parameters())
        self._dst: dict[str, torch.Tensor] = {n: self._target(n, params).detach() for n, _, _ in self.hf_specs_}
        # Its fused parameters by their own names too: a sender that knows the layout (`fused_layout`) sends
        # a fused tensor whole, in one piece.
        self._fused: dict[str, list[str]] = {}
        for name, slot in sorted(self.slots.items(), key=lambda kv: (kv[1].expert or 0, kv[1].offset)):
            self._fused.setdefault(slot.param, []).append(name)
        for fused in self._fused:
            self._dst[fused] = params[fused].detach()

    def _fuse(self, fused: str, members: Sequence[tuple[tuple[int, int], str, torch.dtype, tuple[int, ...]]],
              device: str | torch.device) -> torch.Tensor:
        dtypes = {m[2] for m in members}
        tails = {m[3][1:] for m in members}
        if len(dtypes) != 1 or len(tails) != 1:
            raise ValidationError(f"tensors fused into {fused!r} disagree in dtype or trailing shape: "
                                  f"{[(m[1], dtype_name(m[2]), m[3]) for m in members]}")
        experts = sorted({m[0][0] for m in members})
        expert_param = fused.endswith(tuple(f".{p}" for p, _, _ in EXPERT_PARAMS))
        per_expert: dict[int, int] = {}
        for (e, _), name, dtype, shape in members:
            off = per_expert.get(e, 0)
            self.slots[name] = Slot(fused, e if expert_param else None, off, shape[0], dtype, shape)
            per_expert[e] = off + shape[0]
        rows = set(per_expert.values())
        if len(rows) != 1 or (expert_param and experts != list(range(len(experts)))):
            raise ValidationError(f"experts of {fused!r} are incomplete or uneven: {sorted(per_expert.items())}")
        (dtype,), (tail,), (n,) = dtypes, tails, rows
        shape = ((len(experts), n, *tail) if expert_param else (n, *tail))
        return torch.empty(shape, dtype=dtype, device=device)

    def _register(self, name: str, t: torch.Tensor) -> None:
        *path, leaf = name.split(".")
        mod: torch.nn.Module = self
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))

    # -- the vLLM model protocol -----------------------------------------------------------------------

    def _target(self, name: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
        slot = self.slots.get(name)
        if slot is None:
            t = params.get(name)
            if t is None:
                raise ValidationError(f"receiver has no parameter {name!r}")
            return t
        p = params[slot.param]
        if slot.expert is not None:
            p = p[slot.expert]
        return p.narrow(0, slot.offset, slot.rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each (HF name, tensor) into its (slice of a fused) parameter; returns the names loaded.

        Every tensor of the call is checked before any is copied, so a bad one leaves the weights as they were.
        """
        loaded, all_dst, all_src = self._resolve(weights)
        if all_dst and all_dst[0].is_cuda and torch.cuda.is_current_stream_capturing():
            all_dst, all_src = coalesce(all_dst, all_src)  # captured once, replayed every push: fewer copies
        big: list[tuple[torch.Tensor, torch.Tensor]] = []
        small_dst: list[torch.Tensor] = []
        small_src: list[torch.Tensor] = []
        for dst, src in zip(all_dst, all_src, strict=True):
            if batched(src):
                small_dst.append(dst)
                small_src.append(src)
            else:
                big.append((dst, src))
        with torch.no_grad():
            for dst, src in big:
                dst.copy_(src, non_blocking=True)
            if small_dst:
                torch._foreach_copy_(small_dst, small_src, non_blocking=True)
        return loaded

    def loader(self) -> FusedLoader:
        return FusedLoader(self)

    def prepare_load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SegmentCopy:
        """What `load_weights(weights)` copies, checked and planned now, queued by each call of the result: one
        kernel for every copy of contiguous runs (`kernels.SegmentCopy`). `WeightReceiver` captures the call in
        a CUDA graph and replays it every push."""
        _, all_dst, all_src = self._resolve(weights)
        return SegmentCopy(*coalesce(all_dst, all_src))

    def _resolve(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> tuple[set[str], list[torch.Tensor], list[torch.Tensor]]:
        """(names, destinations, sources) of a load, every tensor checked (ValidationError before any copy)."""
        loaded: set[str] = set()
        all_dst: list[torch.Tensor] = []
        all_src: list[torch.Tensor] = []
        for name, src in weights:
            dst = self._dst.get(name)
            if dst is None:
                raise ValidationError(f"receiver has no parameter {name!r}")
            if dst.shape != src.shape and fits(src, tuple(dst.shape)):
                dst = dst.view(src.shape)  # a blocked reference (Q of an interleaved QKV): row-major order
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValidationError(f"parameter {name!r}: received {src.dtype}{tuple(src.shape)}, receiver "
                                      f"holds {dst.dtype}{tuple(dst.shape)}")
            all_dst.append(dst)
            all_src.append(src)
            loaded.add(name)
        return loaded, all_dst, all_src

    def fused_layout(self) -> dict[str, Any]:
        """{fused parameter: [[its HF members, in the order their bytes lie in it], its shape]}: `load_weights`
        also takes a fused parameter whole under its own name (see `pack.fuse_layout`)."""
        return {f: [members, list(self._dst[f].shape)] for f, members in self._fused.items()}

    # -- what a sender compares against ----------------------------------------------------------------

    def expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """HF name -> (dtype name, shape): what `load_weights` accepts."""
        return {n: (d, tuple(s)) for n, d, s in self.hf_specs_}

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        """(HF name, view into the fused parameters): the checkpoint as this receiver holds it."""
        params = dict(self.named_parameters())
        for name, _, _ in self.hf_specs_:
            yield name, self._target(name, params)
        if self.tied:
            yield "lm_head.weight", self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer as an engine computes it (tied or not)."""
        return hidden @ self.get_parameter("lm_head.weight").t()





def receiver_module(specs: Sequence[Spec], *, device: str = "cpu", tie: bool = False) -> FusedModel:
    """A zero-filled FusedModel of `specs`, for `python -m streamsync.receiver.process --module ...`."""
    return FusedModel(specs, fill="zeros", device=device, tie=tie)
