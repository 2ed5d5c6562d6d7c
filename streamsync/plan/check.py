"""Checks of a push before any byte moves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .chunk import ChunkPlan

if TYPE_CHECKING:
    pass


def nonfinite(tensors: Sequence[tuple[str, Any]]) -> list[str]:
    """Names of the floating tensors holding NaN or inf, with one host sync.

    One L1 norm per tensor: NaN and inf propagate through it, and a norm of finite weights overflowing would
    need weights near 1e29. `torch._foreach_norm` computes a whole group (one device and dtype) in a few
    fused launches: per-tensor reductions were launch-bound (80 ms for the 4,719 tensors of an MoE shape on
    an H200). No tensor-sized temporaries, unlike `isfinite(t).all()`.
    """
    import torch

    named = [(n, t) for n, t in tensors if t.is_floating_point() and t.numel()]
    if not named:
        return []
    groups: dict[tuple[Any, Any], list[int]] = {}
    for i, (_, t) in enumerate(named):
        groups.setdefault((t.device, t.dtype), []).append(i)
    norms: list[Any] = [None] * len(named)
    for (_, dtype), idx in groups.items():
        ts = [named[i][1] for i in idx]
        try:
            if torch.finfo(dtype).bits < 16:
                raise TypeError("no foreach kernels for 8-bit floats")
            out = torch._foreach_norm(ts, 1)
        except (RuntimeError, TypeError):
            out = [t.float().abs().sum() for t in ts]
        for i, n in zip(idx, out, strict=True):
            norms[i] = n.float()
    device = norms[0].device
    flags = torch.stack([n.to(device) for n in norms]).isfinite().tolist()
    return [n for (n, _), ok in zip(named, flags, strict=True) if not ok]


VOCAB_NAMES = ("embed_tokens.weight", "lm_head.weight")


def vocab_hint(plans: Sequence[ChunkPlan], expected: dict[str, tuple[str, tuple[int, ...]]]) -> str:
    """Megatron pads its vocabulary (to a multiple of `make_vocab_size_divisible_by` x TP): when only
    the row count of an embedding or lm_head differs, say which option drops the padding rows."""
    for p in plans:
        for s in p.specs:
            exp = expected.get(s.name)
            shape = s.full_shape
            if (s.name.endswith(VOCAB_NAMES) and exp is not None and len(exp[1]) == 2 and len(shape) == 2
                    and exp[1][1] == shape[1] and exp[1][0] != shape[0]):
                return (f". {s.name} has {shape[0]} rows, the engine {exp[1][0]}: a Megatron model pads its "
                        "vocabulary; pass WeightSync(..., source_options={'hf_config': <the served model's config>})"
                        f" (or {{'vocab_size': {exp[1][0]}}}) so the padding rows are dropped")
    return ""
