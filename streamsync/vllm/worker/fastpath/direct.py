"""fp8 linear layers processed without vLLM (`Direct`): learned from vLLM's own processing of a module's first
round (`_learn`, settled by `resolve`), then quantized by vLLM's kernel from a fresh weight, or by streamsync's from
the pushed tensors where they lie (`quant.quantize_sourced`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...quantizations import FP8_PER_TENSOR
from .plan import Plan
from .trace import Slots


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
            r.direct, r.fresh = hits[0], r.candidate.fresh
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
