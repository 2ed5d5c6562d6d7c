"""fp8 modules processed without vLLM: linear layers (`Direct`), learned from vLLM's own processing of a random
weight at connect (`learn_ahead`), or of a module's first round (`_learn`; both settled by `resolve`), and fused-MoE
experts (`Experts`). Each is quantized from a fresh
weight, or from the pushed tensors where they lie (`quant.quantize_sourced`): a module's quantized tensors are split
into *groups*, the elements one scale covers (a linear layer's weight; one expert's w13 or w2), and a group is
quantized once every one of its elements arrived."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ....log import get_logger
from ...quantizations import FP8_PER_TENSOR
from .plan import Plan, _Rebuilt
from .trace import Slots, _place, _tensors, materialize


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

    @property
    def outs(self) -> dict[str, torch.Tensor]:
        """The live fp8 tensors a push quantizes into, by load-format name, each seen in the load's order."""
        return {"weight": self.out}

    def group(self, tensor: str, offset: int, size: Sequence[int], stride: Sequence[int]) -> int | None:
        """The group a write into `tensor` falls in: one scale for the whole weight."""
        return 0

    def group_numel(self, tensor: str) -> int:
        return self.out.numel()

    def scale_of(self, tensor: str, group: int) -> torch.Tensor:
        return self.scale

    def apply(self, fresh: Slots, quantized: bool = False) -> None:
        """Quantize the fresh weight into the live one (`quantized`: already done from its pieces) and copy the
        module's other tensors."""
        from vllm import _custom_ops as ops

        if not quantized:
            w = fresh["weight"]
            assert w is not None
            _, s = ops.scaled_fp8_quant(w, None, output=self.out)
            self.scale.copy_(s.reshape(()))
        for name, live in self.copies:
            src = fresh[name]
            assert src is not None
            live.copy_(src)


@dataclass(slots=True)
class Experts:
    """A fused-MoE layer under vLLM's online per-tensor fp8 on a Triton backend (`quant.fp8_experts_rebuildable`)
    processed without vLLM: every expert's w13 and w2 quantized on its own, one scale each, as vLLM's processing
    does expert by expert. `outs`: the live fp8 experts ([E, rows, cols], contiguous, the load format's shape);
    `scales`: their live scales ([E]); `live`: the layer's kernel tensors."""

    layer: torch.nn.Module
    outs: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor]
    live: dict[str, torch.Tensor | None]

    @classmethod
    def of(cls, layer: torch.nn.Module, live: dict[str, torch.Tensor | None]) -> Experts | None:
        """The layer's experts as `Experts`, or None where a live tensor is not as this class reads it."""
        outs: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        for proj in ("w13", "w2"):
            out, scale = live.get(f"{proj}_weight"), live.get(f"{proj}_weight_scale")
            if (out is None or scale is None or out.dim() != 3 or not out.is_contiguous() or scale.dim() != 1
                    or scale.numel() < out.shape[0] or not scale.is_contiguous()):
                return None
            outs[f"{proj}_weight"], scales[f"{proj}_weight"] = out, scale
        return cls(layer, outs, scales, live)

    def group(self, tensor: str, offset: int, size: Sequence[int], stride: Sequence[int]) -> int | None:
        """The expert a write of `size`/`stride` at element `offset` of `tensor` falls in; None where it spans
        experts (or has a negative stride)."""
        per = self.outs[tensor].stride(0)
        last = offset  # the last element it writes (called once per write: plain arithmetic)
        for n, s in zip(size, stride, strict=True):
            if s < 0:
                return None
            last += (n - 1) * s
        e = offset // per
        return e if last < (e + 1) * per else None

    def group_numel(self, tensor: str) -> int:
        return self.outs[tensor].stride(0)

    def scale_of(self, tensor: str, group: int) -> torch.Tensor:
        return self.scales[tensor][group:group + 1]

    def apply(self, fresh: Slots, quantized: bool = False) -> None:
        """Quantize the fresh experts into the live ones (`quantized`: already done from their pieces), and point
        the layer's quant config at the live scales."""
        from ..quant import point_config_at_scales, rebuild_fp8_experts

        if quantized:
            point_config_at_scales(self.layer, self.live)
        else:
            rebuild_fp8_experts(self.layer, fresh, self.live)



def dense(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a write of `size`/`stride` covers consecutive elements in row-major order (one flat run)."""
    expect = 1
    for n, s in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _same_layout(live: torch.Tensor, fresh: tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device] | None
                 ) -> bool:
    """Whether a `Direct` module's live weight (seen in the load's order) has its fresh weight's shape, strides and
    device: then a write's geometry into the one is its geometry into the other."""
    return (fresh is not None and tuple(live.shape) == fresh[0] and tuple(live.stride()) == fresh[1]
            and live.device == torch.device(fresh[3]) and live.is_cuda)


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
            r.direct, r.fresh, r.sourceable = hits[0], r.candidate.fresh, None
        r.candidate = None


def _learn(layer: torch.nn.Module, fresh: Slots, fresh_buffers: Slots, kernel_params: Slots, kernel_buffers: Slots
           ) -> _Candidate | None:
    """The ways `Direct` may make what vLLM just made of a module (its new tensors are the layer's), each with its
    flag computed on the device (`_Candidate`); None where its tensors rule `Direct` out."""
    from vllm import _custom_ops as ops

    w = fresh.get("weight")
    if (w is None or w.dim() != 2 or not w.is_cuda or any(b is not None for b in fresh_buffers.values())
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
        elif (made := fresh.get(name)) is not None and new is made and live.shape == made.shape:
            copies.append((name, live))
        else:
            return None
    if not outs or scale is None:
        return None
    return _Candidate([(Direct(out, scale[0], tuple(copies)), ok & scale[1]) for out, ok in outs],
                      _layout(fresh))


@torch.no_grad()
def learn_ahead(plan: Plan) -> int:
    """What a module's first round would learn, learned before the first push (at connect), so that push already
    quantizes without vLLM: an fp8 linear layer's `Direct` candidates from vLLM's own processing of a random weight
    in fresh tensors (compared as `_learn` does; the first round's `resolve` settles them), a fused-MoE layer's
    `Experts`. The engine's own tensors are put back untouched, and the kernels those modules take are compiled.
    Returns the modules learned."""
    from ..quant import fp8_experts_rebuildable, warm_sourced

    learned = 0
    device: torch.device | None = None
    for r in plan.rebuilt:
        layer = r.layer
        experts = fp8_experts_rebuildable(layer)
        if r.learned or r.direct is not None or not (experts or _fp8_linear(layer)):
            continue
        try:
            device = _learn_one(r, experts) or device
        except Exception as e:  # its first round learns it, as without this
            get_logger().warning("vllm fast path: could not learn an fp8 module at connect", module=r.name,
                                 error=f"{type(e).__name__}: {e}")
            continue
        learned += 1
    if device is not None:
        warm_sourced(device)
    return learned


def _learn_one(r: _Rebuilt, experts: bool) -> torch.device | None:
    """`learn_ahead` of one module; the device of its tensors, or None where it cannot be learned ahead."""
    layer = r.layer
    params, buffers = materialize(layer)
    if any(b is not None for b in buffers.values()):
        return None
    kernel_params, kernel_buffers, non_persistent = _tensors(layer)
    if experts:
        r.fresh = _layout(params)
        r.direct, r.sourceable = Experts.of(layer, kernel_params), None
    else:
        weight = params.get("weight")
        if weight is None:
            return None
        gen = torch.Generator(device=weight.device)
        gen.manual_seed(0)
        for t in params.values():
            if t is not None and t.dtype in (torch.bfloat16, torch.float16, torch.float32):
                t.normal_(0.0, 0.02, generator=gen)
        _place(layer, params, buffers, non_persistent)
        try:
            if hasattr(layer, "_already_called_process_weights_after_loading"):
                delattr(layer, "_already_called_process_weights_after_loading")
            layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
            r.candidate = _learn(layer, params, buffers, kernel_params, kernel_buffers)
        finally:
            _place(layer, kernel_params, kernel_buffers, non_persistent)
    r.learned = True
    return next(t for t in kernel_params.values() if t is not None).device


def _sourcing(plan: Plan) -> None:
    """Settle `_Rebuilt.sourceable` for the modules processed without vLLM that have not been looked at: each
    write of one of their quantized tensors must be a copy (not a constant fill) that falls in one group and that
    the kernel can write (`quant.sourceable`'s destination half), into live tensors laid out as the fresh ones."""
    from ..quant import writable

    todo = {i: r for i, r in enumerate(plan.rebuilt) if r.direct is not None and r.sourceable is None}
    if not todo:
        return
    why: dict[int, str] = {}
    for i, r in todo.items():
        for n, out in r.direct.outs.items():
            fresh = r.fresh.get(n) if r.fresh is not None else None
            if i not in why and not _same_layout(out, fresh):
                why[i] = (f"{n}: live {tuple(out.shape)}/{tuple(out.stride())} on {out.device}, load format "
                          f"{fresh[:2] if fresh else None} on {fresh[3] if fresh else None}")
    for ops in plan.ops.values():
        for op in ops:
            if op.dst is not None or op.module not in todo or op.module in why:
                continue
            owner = plan.rebuilt[op.module].direct
            out = owner.outs.get(op.tensor)
            if out is None:
                continue
            w = op.write
            if w.numel == 0:
                continue
            view = out.as_strided(w.size, w.stride, out.storage_offset() + w.offset)
            if w.src_offset is None:
                why[op.module] = f"{op.tensor}: a constant fill"
            elif owner.group(op.tensor, w.offset, w.size, w.stride) is None and not dense(w.size, w.stride):
                why[op.module] = f"{op.tensor}: a write {tuple(w.size)}/{tuple(w.stride)} at {w.offset} spans groups"
            elif not writable(view):
                why[op.module] = f"{op.tensor}: a write {tuple(w.size)}/{tuple(w.stride)} the kernel cannot write"
    for i, r in todo.items():
        r.sourceable = i not in why
        if i in why:  # it still works, through fresh tensors: a push pays one more pass over its weights
            get_logger().info("vllm fast path: an fp8 module is quantized from fresh tensors, not where its "
                              "weights arrive", module=r.name, why=why[i])
