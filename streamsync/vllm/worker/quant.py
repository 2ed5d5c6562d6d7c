"""vLLM's online fp8 of fused-MoE experts, made in a few batched tensor ops instead of a kernel call per expert.

An engine started with `quantization="fp8"` on a bf16 checkpoint quantizes each expert's weights on their own
(`Fp8PerTensorOnlineMoEMethod.process_weights_after_loading`: `ops.scaled_fp8_quant` once per expert and
projection, a Python loop of thousands of calls per push for a 128-expert model). The fast path rebuilds such a
layer with the same arithmetic over many experts at once:

    scale_e = amax(|w_e|) / 448              an IEEE fp32 division (a tensor divisor: a Python number would
                                             make PyTorch multiply by its reciprocal, which rounds otherwise)
    q_e     = fp8(fmax(fmin(w_e * (1 / scale_e), 448), -448))    a multiply by the reciprocal, as the kernel
                                             does; fmin/fmax map a NaN (an all-zero expert's 0 * inf) to 448
                                             as the kernel's fminf/fmaxf do; the cast rounds to nearest even

which is element for element the kernel's (GPU test: the engine then equals one that loaded the same weights
from disk). Only for the Triton backends, whose kernels read the experts as quantized; any other backend may
convert them afterwards and keeps vLLM's own processing.

On CUDA the amax is one reduction over all experts and the rest one Triton kernel: five bytes of memory traffic
an element in all, against about forty for torch's passes above, which are the fallback and the reference the
GPU test holds the kernel to. The kernel's fp32 -> e4m3 conversion is the hardware's (round to nearest even):
Triton's interpreter rounds otherwise, so it is not used off the GPU.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..quantizations import FP8_PER_TENSOR

FP8_MAX = 448.0
#: experts quantized per pass (fp32 temporaries of this many experts at a time)
GROUP = 16
_PLAIN_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})


def fp8_experts_rebuildable(layer: torch.nn.Module) -> bool:
    """Whether `layer` is a fused-MoE layer under vLLM's online per-tensor fp8 on a Triton backend."""
    method = getattr(layer, "quant_method", None)
    backend = getattr(getattr(method, "fp8_backend", None), "name", None)
    return type(method).__name__ == FP8_PER_TENSOR.moe and backend in _PLAIN_BACKENDS


_BLOCK = 4096  # elements a kernel program quantizes
_broken: list[str] = []  # why the kernel is not used (once it failed)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def quant_kernel(w, out, inv, per, BLOCK: tl.constexpr):
        e = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < per
        x = tl.load(w + e * per + offs, mask=m, other=0.0).to(tl.float32) * tl.load(inv + e)
        x = tl.where(x != x, 448.0, x)  # 0 * inf of an all-zero expert: the kernel's fminf makes it 448
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        tl.store(out + e * per + offs, x.to(tl.float8e4nv), mask=m)

    return quant_kernel


def _kernel_quantize(w: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> bool:
    """The CUDA path of `quantize_experts`; False where it cannot run (the torch passes then do it)."""
    from ...receiver.kernels import triton_imports

    if _broken or not w.is_cuda or not w.is_contiguous() or not out.is_contiguous() or not triton_imports():
        return False
    e = w.shape[0]
    amax = torch.linalg.vector_norm(w.view(e, -1), float("inf"), dim=1).float()
    scale = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.ones_like(scale) / scale
    per = w[0].numel()
    try:
        _kernel()[(e, (per + _BLOCK - 1) // _BLOCK)](w, out, inv, per, BLOCK=_BLOCK)
    except Exception as err:  # a Triton that cannot build it here: torch's passes
        _broken.append(f"{type(err).__name__}: {err}")
        logging.getLogger(__name__).warning("fp8 expert kernel unavailable, using torch: %s", err)
        return False
    scales[:e].copy_(scale)
    return True


@torch.no_grad()
def quantize_experts(w: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, kernel: bool = True) -> None:
    """Quantize every expert of `w` ([E, rows, cols], bf16/fp16) into `out` (fp8, same shape) and `scales`
    (fp32, [E] or more: the first E are written), as `ops.scaled_fp8_quant(w[e])` makes each. `kernel=False`:
    torch's passes even on CUDA (the reference)."""
    if out.shape != w.shape or out.dtype != torch.float8_e4m3fn or scales.dim() != 1 or scales.numel() < w.shape[0]:
        raise ValueError(f"fp8 experts: {w.dtype}{tuple(w.shape)} into {out.dtype}{tuple(out.shape)} with "
                         f"scales {tuple(scales.shape)}")
    if w.numel() and kernel and _kernel_quantize(w, out, scales):
        return
    hi = torch.tensor(FP8_MAX, dtype=torch.float32, device=w.device)
    lo = -hi
    for e0 in range(0, w.shape[0], GROUP):
        part = w[e0:e0 + GROUP]
        amax = part.abs().amax(dim=(1, 2)).float()
        scale = amax / torch.full_like(amax, FP8_MAX)
        inv = torch.ones_like(scale) / scale
        x = part.float()
        x.mul_(inv[:, None, None])
        torch.fmin(x, hi, out=x)
        torch.fmax(x, lo, out=x)
        n = part.shape[0]
        out[e0:e0 + n].copy_(x)  # fp32 -> e4m3fn: round to nearest even (every value is within +-448)
        scales[e0:e0 + n].copy_(scale)


def rebuild_fp8_experts(layer: torch.nn.Module, fresh: Mapping[str, torch.Tensor | None],
                        live: Mapping[str, torch.Tensor | None]) -> None:
    """Quantize a fused-MoE layer's freshly loaded bf16 experts (`fresh`: its load format) into the fp8 experts and
    scales its kernels read (`live`), and point its quant config's scales at those (a reload through vLLM's own
    processing leaves it holding copies)."""
    experts = int(getattr(layer, "local_num_experts", 0) or 0)
    for proj in ("w13", "w2"):
        w, out, scales = fresh.get(f"{proj}_weight"), live.get(f"{proj}_weight"), live.get(f"{proj}_weight_scale")
        if w is None or out is None or scales is None or (experts and w.shape[0] != experts):
            raise ValueError(f"fp8 experts of {type(layer).__name__}: no {proj} weights or scales to rebuild")
        quantize_experts(w, out, scales)
    cfg: Any = getattr(getattr(layer, "quant_method", None), "moe_quant_config", None)
    for attr, name in (("_w1", "w13_weight_scale"), ("_w2", "w2_weight_scale")):
        desc: Any = getattr(cfg, attr, None)
        held, scale = getattr(desc, "scale", None), live[name]
        if isinstance(held, torch.Tensor) and held is not scale and scale is not None and held.shape == scale.shape:
            desc.scale = scale
