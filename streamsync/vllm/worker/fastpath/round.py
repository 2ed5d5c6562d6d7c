"""One round on the fast path: the copies of each received chunk, REBUILD modules filled and processed as they
complete, DERIVE layers derived again at the end."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ....receiver.base_copy import aliased
from ...quantizations import FP8_PER_TENSOR
from .plan import Plan, _Op
from .trace import _TB, Slots, Weights, _expert_layout, _place, _tensors


@dataclass
class _Pending:
    """A REBUILD module the round has started writing: its fresh tensors and how much of them arrived."""

    params: Slots
    buffers: Slots
    filled: int = 0


@dataclass(slots=True)
class Direct:
    """A linear layer under vLLM's online per-tensor fp8 (`Fp8PerTensorOnlineLinearMethod`) processed without
    vLLM: its live fp8 weight is `ops.scaled_fp8_quant` of the loaded bf16 weight (as it is or transposed: `out`
    is the live weight seen in the load's order), its live scale that one scale, and every other live tensor
    what was loaded. Learned by comparing with vLLM's own processing of the module's first round (`_learn`,
    settled at the next round's start: `resolve`); where processing makes anything else (another fp8 kernel's
    repacking), the module keeps vLLM's processing. One quantization kernel pair and a scale copy instead of
    vLLM's Python, its new tensors and their copies."""

    out: torch.Tensor
    scale: torch.Tensor
    copies: tuple[tuple[str, torch.Tensor], ...]

    def apply(self, fresh: Slots) -> None:
        from vllm import _custom_ops as ops

        w = fresh["weight"]
        assert w is not None
        _, s = ops.scaled_fp8_quant(w, None, output=self.out)
        self.scale.copy_(s.reshape(()))
        for name, live in self.copies:
            src = fresh[name]
            assert src is not None
            live.copy_(src)


def _in_place_views(plan: Plan) -> dict[str, torch.Tensor]:
    """Per name, the live view its one whole copy writes, where a delta may be decoded into it (`in_place`)."""
    views: dict[str, torch.Tensor] = {}
    for name, ops in plan.ops.items():
        copies = [op for op in ops if op.write.src_offset is not None and op.write.numel]
        if len(copies) == 1 and copies[0].dst is not None and copies[0].whole and copies[0].dst.is_contiguous():
            views[name] = copies[0].dst
    fused = {n: v for n, v in views.items() if n in plan.fusions}
    shared = aliased({n: v for n, v in views.items() if n not in fused}) | aliased(fused)
    return {n: v for n, v in views.items() if n not in shared}


@dataclass
class FastRound:
    """One round's state on the fast path: REBUILD modules being filled, and what went which way."""

    plan: Plan
    rebuilt: int = 0  # modules processed this round
    direct: int = 0  # of those, quantized without vLLM's processing (`Direct`, fp8 experts)
    pending: dict[int, _Pending] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        resolve(self.plan)  # what the last round's first processing by vLLM showed

    def split(self, weights: Weights) -> tuple[list[tuple[tuple[_Op, ...], torch.Tensor]],
                                               list[tuple[str, torch.Tensor]]]:
        """(fast: each tensor with its copies, slow: the tensors for `load_weights`)."""
        fast: list[tuple[tuple[_Op, ...], torch.Tensor]] = []
        slow: list[tuple[str, torch.Tensor]] = []
        ops = self.plan.ops
        for name, t in weights:
            hit = ops.get(name)
            if hit is None:
                slow.append((name, t))
            else:
                fast.append((hit, t))
        return fast, slow

    def in_place(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The live tensor that holds `name` (of HF `shape`) whole and as it is, which a delta may be decoded into
        in place (`Loader.direct`): its one copy goes into a module whose kernels read what is loaded (COPY),
        contiguous, every element, sharing no byte with another name's (a fused name's members aside: a sender
        sends one or the other). A TP-sharded, rebuilt, quantized or layerwise tensor has none."""
        views = self.plan.in_place
        if views is None:
            views = self.plan.in_place = _in_place_views(self.plan)
        d = views.get(name)
        return d if d is not None and d.numel() == math.prod(shape) else None

    @torch.no_grad()
    def load(self, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]],
             process: Callable[[list[int]], None] | None = None) -> list[int]:
        """Replay the copies; returns the REBUILD modules this completed (process them with `process`). Given
        `process`, each completed module is handed to it as soon as its copies are queued (and nothing is
        returned): a chunk's fresh tensors then live one module at a time, not a whole chunk's worth at once
        (an fp8 engine's modules are rebuilt from bf16 tensors twice the size of what they hold)."""
        complete: list[int] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []

        def flush() -> None:
            if dsts:  # one call for many copies (an MoE chunk makes thousands): no Python loop per copy
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                dsts.clear()
                srcs.clear()

        for dst, src, value in self.writes(fast, complete):
            if src is None:
                dst.fill_(value)
            else:
                dsts.append(dst)
                srcs.append(src)
            if process is not None and complete:
                flush()
                process(list(complete))
                complete.clear()
        flush()
        return complete

    def writes(self, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]], complete: list[int]
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, float]]:
        """Each copy as (destination view, source view, 0) and each constant fill as (destination, None, value),
        REBUILD modules' fresh tensors made on first write; appends to `complete` the modules it completes.

        A source may come *blocked* (`pack.fits`: Q as a (groups, rows, hidden) view of megatron's interleaved
        QKV, the same row-major order as its HF shape): a whole write into a contiguous destination reads it as
        it is, so no reshaped copy of it is ever made; any other write reads a contiguous copy."""
        for ops, src in fast:
            flat: torch.Tensor | None = src if src.is_contiguous() else None
            for op in ops:
                w = op.write
                if w.numel == 0:  # a loader's empty write (no padding rows on this rank): nothing to do
                    continue
                dst = op.dst
                if dst is None:
                    pend = self._pending(op.module)
                    t = pend.params.get(op.tensor)
                    t = pend.buffers[op.tensor] if t is None else t
                    assert t is not None  # a traced target: a tensor in the module's load format
                    dst = t.as_strided(w.size, w.stride, t.storage_offset() + w.offset)
                    pend.filled += w.numel
                    if pend.filled == self.plan.rebuilt[op.module].numel:
                        complete.append(op.module)
                if w.src_offset is None:
                    yield dst, None, w.value
                elif op.whole and src.numel() != w.numel:  # the source's first rows only (a TP rank's slice)
                    if flat is None:
                        flat = src.contiguous()
                    yield dst, flat.view(-1)[:w.numel].view(w.size), 0.0
                elif op.whole and flat is not None:
                    yield dst, flat.view(w.size), 0.0
                elif op.whole and dst.is_contiguous():
                    yield dst.view(src.shape), src, 0.0
                else:
                    if flat is None:
                        flat = src.contiguous()
                    yield dst, flat.as_strided(w.size, w.src_stride, flat.storage_offset() + w.src_offset), 0.0

    def _pending(self, i: int) -> _Pending:
        pend = self.pending.get(i)
        if pend is None:
            if i in self.done:
                raise RuntimeError(f"module {self.plan.rebuilt[i].name!r} was written twice in one round")
            r = self.plan.rebuilt[i]
            if r.fresh is not None:
                pend = _Pending({n: torch.empty_strided(shape, stride, dtype=dt, device=dev)
                                 for n, (shape, stride, dt, dev) in r.fresh.items()}, {})
            else:
                pend = _materialize(r.layer)
            self.pending[i] = pend
        return pend

    @torch.no_grad()
    def process(self, modules: Sequence[int]) -> None:
        """Process each completed REBUILD module with its own `process_weights_after_loading` and copy the result
        into the tensors its kernels hold (their addresses stay). A fused-MoE layer under vLLM's online fp8 is
        quantized by `quant.rebuild_fp8_experts` (the same arithmetic over many experts at once) instead."""
        from ..quant import fp8_experts_rebuildable, rebuild_fp8_experts

        for i in modules:
            pend = self.pending.pop(i)
            r = self.plan.rebuilt[i]
            layer = r.layer
            if r.direct is not None:
                r.direct.apply(pend.params)
                self.done.add(i)
                self.rebuilt += 1
                self.direct += 1
                continue
            kernel_params, kernel_buffers, non_persistent = _tensors(layer)
            if fp8_experts_rebuildable(layer):
                rebuild_fp8_experts(layer, pend.params, kernel_params)
                if r.fresh is None and not any(b is not None for b in pend.buffers.values()):
                    r.fresh = _layout(pend.params)
                self.done.add(i)
                self.rebuilt += 1
                self.direct += 1
                continue
            learn = not r.learned and _fp8_linear(layer)
            r.learned = True
            _place(layer, pend.params, pend.buffers, non_persistent)
            try:
                if hasattr(layer, "_already_called_process_weights_after_loading"):
                    delattr(layer, "_already_called_process_weights_after_loading")
                layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
                _expert_layout(layer)
                update: Any = getattr(layer, "update_param_tp_status", None)
                if update is not None:  # processing may have made new Parameters: vLLM reconciles their TP state
                    update()
                if learn:
                    r.candidate = _learn(layer, pend, kernel_params, kernel_buffers)
                live: dict[int, torch.Tensor] = {}  # a processed tensor's address -> the live tensor it lands in
                for name, p in kernel_params.items():
                    if p is not None:
                        new = getattr(layer, name)
                        if p.numel() == 0 and new.numel():  # a weight its module's user released (AMX MLA's
                            kernel_params[name] = new  # kv_b_proj): the processed one is held as it is
                            continue
                        p.data.copy_(new)
                        live[_TB.data_ptr(new)] = p
                for name, b in kernel_buffers.items():
                    made = name not in non_persistent or name in pend.buffers
                    if b is not None and name in layer._buffers and made:
                        b.data.copy_(getattr(layer, name))
            finally:
                _place(layer, kernel_params, kernel_buffers, non_persistent)
            _repoint(getattr(layer, "quant_method", None), live)
            self.done.add(i)
            self.rebuilt += 1

    def drop(self) -> list[str]:
        """End the round: REBUILD modules not completely written keep their old weights; returns their names."""
        left = [self.plan.rebuilt[i].name for i in self.pending]
        self.pending.clear()
        return left


def _fp8_linear(layer: torch.nn.Module) -> bool:
    return type(getattr(layer, "quant_method", None)).__name__ == FP8_PER_TENSOR.linear


def _layout(params: Slots) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]]:
    return {n: (tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for n, t in params.items() if t is not None}


@dataclass(slots=True)
class _Candidate:
    """What a module's first processing by vLLM suggests (`_learn`): each way its live weight may be the direct
    quantization, with a flag on the device saying whether vLLM made exactly that. The flags are read together
    at the next round's start (`resolve`), so the first round never waits for the device module by module."""

    options: list[tuple[Direct, torch.Tensor]]
    fresh: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]]


def resolve(plan: Plan) -> None:
    """Settle every module's `_Candidate` with one read of their flags: `Direct` where vLLM's processing made what
    it makes, else vLLM's processing for good."""
    waiting = [r for r in plan.rebuilt if r.candidate is not None]
    if not waiting:
        return
    flags = iter(torch.stack([f for r in waiting for _, f in r.candidate.options]).tolist())
    for r in waiting:
        hits = [d for d, _ in r.candidate.options if next(flags)]
        if hits:
            r.direct, r.fresh = hits[0], r.candidate.fresh
        r.candidate = None


def _learn(layer: torch.nn.Module, pend: _Pending, kernel_params: Slots, kernel_buffers: Slots) -> _Candidate | None:
    """The ways `Direct` may make what vLLM just made of a module (its new tensors are the layer's), each with its
    flag computed on the device (`_Candidate`); None where its tensors rule `Direct` out."""
    from vllm import _custom_ops as ops

    w = pend.params.get("weight")
    if (w is None or w.dim() != 2 or not w.is_cuda or any(b is not None for b in pend.buffers.values())
            or any(b is not None for b in kernel_buffers.values())):
        return None
    q, s = ops.scaled_fp8_quant(w, None)
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live weight seen in the load's order, its flag)
    scale: tuple[torch.Tensor, torch.Tensor] | None = None
    copies: list[tuple[str, torch.Tensor]] = []
    for name, live in kernel_params.items():
        new = getattr(layer, name, None)
        if live is None or new is None:
            if live is not None or new is not None:
                return None
            continue
        if name == "weight" and live.dtype == q.dtype and new.dim() == 2:
            outs = [(view, seen.view(torch.uint8).eq(q.view(torch.uint8)).all())
                    for seen, view in ((new, live), (new.t(), live.t()))
                    if seen.shape == q.shape and view.shape == q.shape and view.is_contiguous()]
            if not outs:
                return None
        elif name == "weight_scale" and live.dtype == s.dtype:
            scale = (live, new.eq(s.reshape(())).all())
        elif (fresh := pend.params.get(name)) is not None and new is fresh and live.shape == fresh.shape:
            copies.append((name, live))
        else:
            return None
    if not outs or scale is None:
        return None
    return _Candidate([(Direct(out, scale[0], tuple(copies)), ok & scale[1]) for out, ok in outs],
                      _layout(pend.params))


def _repoint(method: object, live: Mapping[int, torch.Tensor]) -> None:
    """A kernel config that processing built around the tensors it made is pointed at the live tensors those were
    copied into. vLLM's fused-MoE quant config holds the experts' scales (its kernels read them there, not from
    the module): left alone it would hold the round's fresh copies (the right values, but not the tensors the
    engine's CUDA graphs read, and kept alive until the next round)."""
    import dataclasses

    cfg = getattr(method, "moe_quant_config", None)
    if cfg is None or not dataclasses.is_dataclass(cfg):
        return
    for f in dataclasses.fields(cfg):
        desc = getattr(cfg, f.name, None)
        if desc is None or not dataclasses.is_dataclass(desc):
            continue
        for g in dataclasses.fields(desc):
            v = getattr(desc, g.name, None)
            to = live.get(_TB.data_ptr(v)) if isinstance(v, torch.Tensor) else None
            if to is not None and to.shape == v.shape and to.dtype == v.dtype:  # type: ignore[union-attr]
                object.__setattr__(desc, g.name, to)


def _materialize(layer: torch.nn.Module) -> _Pending:
    """Fresh tensors of the module's load format (vLLM's reload metadata: class and attributes kept), on the
    device it was loaded on; the module itself keeps its kernel tensors meanwhile."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    info = get_layerwise_info(layer)
    kept = _tensors(layer)
    try:
        restore_layer_on_meta(layer, info)
        materialize_layer(layer, info)
        params, buffers, _ = _tensors(layer)  # fresh ones, and those reload never moves to meta (a bias)
    finally:
        _place(layer, *kept)
    return _Pending(params, buffers)
