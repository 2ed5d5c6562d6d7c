"""`streamsync.vllm.worker.quant`: vLLM's online fp8 of fused-MoE experts in batched tensor ops, element for element the
per-expert arithmetic of vLLM's `scaled_fp8_quant` (the GPU test checks the engine against vLLM's own kernel)."""

from __future__ import annotations

import pytest
import torch

from streamsync.vllm.worker.quant import GROUP, quantize_experts

F8 = torch.float8_e4m3fn


def _one_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-tensor fp8 of one tensor, written out: scale = amax / 448 (IEEE), q = w * (1 / scale)
    clamped with fminf/fmaxf semantics (NaN -> 448), rounded to nearest even."""
    amax = w.abs().float().amax().reshape(1)
    scale = amax / torch.full_like(amax, 448.0)
    x = w.float() * (torch.ones_like(scale) / scale)
    x = torch.fmax(torch.fmin(x, torch.full_like(x, 448.0)), torch.full_like(x, -448.0))
    return x.to(F8), scale


def test_experts_quantized_in_groups_equal_each_expert_quantized_alone():
    torch.manual_seed(0)
    experts = GROUP + 5  # crosses a group boundary
    w = (torch.randn(experts, 24, 40) * torch.logspace(-3, 1, experts)[:, None, None]).to(torch.bfloat16)
    w[3] = 0  # an all-zero expert: scale 0, every element 448 (the kernel's 0 * inf -> NaN -> fminf -> 448)
    w[4, 0, 0] = -0.0
    out = torch.empty(w.shape, dtype=F8)
    scales = torch.full((experts + 2,), -1.0)  # more slots than experts: the rest is left alone
    quantize_experts(w, out, scales)
    for e in range(experts):
        q, s = _one_expert(w[e])
        assert torch.equal(out[e].view(torch.uint8), q.view(torch.uint8)), e
        assert torch.equal(scales[e:e + 1], s), e
    assert torch.equal(scales[experts:], torch.full((2,), -1.0))
    assert scales[3] == 0 and bool((out[3].view(torch.uint8) == 0x7E).all())


def test_mismatched_shapes_are_refused_before_anything_is_written():
    w = torch.randn(2, 4, 8).to(torch.bfloat16)
    out = torch.zeros(2, 4, 9, dtype=F8)
    with pytest.raises(ValueError, match="fp8 experts"):
        quantize_experts(w, out, torch.zeros(2))
    with pytest.raises(ValueError, match="fp8 experts"):
        quantize_experts(w, torch.zeros(2, 4, 8, dtype=F8), torch.zeros(1))
