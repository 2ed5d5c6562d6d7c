"""The slice of each HF tensor each worker of a vLLM engine holds, from the checkpoint's shapes and the arch
tables' mappings (`Mapping.engine_splits`).

The tables say how a tensor-parallel engine splits each HF tensor, as vLLM's column/row-parallel layers do: q rows
by heads, k/v rows by query group (replicated where `tp` exceeds the kv heads), o_proj and down_proj columns,
gate/up rows (GLM-4's fused gate_up_proj: the rows of each half), MLA's up projections by heads and its down
projections whole, the vocabulary padded to 64 rows split by rows, norms and routers whole. Experts: with
`expert_parallel` whole experts over the workers, else each split as a dense MLP. A tensor no table names is
held whole. The planner (`streamsync plan`) and the test engines use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache

from ..convert import ARCHS
from ..convert.archs import table
from ..convert.mappings import GATED, KV_HEADS, VOCAB, EngineSplit, TPLayout
from ..errors import ValidationError
from ..models.synthetic import Spec
from .shards import Box

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _pad(n: int, to: int = 64) -> int:
    return -(-n // to) * to


@cache
def engine_splits() -> tuple[tuple[re.Pattern[str], EngineSplit], ...]:
    """(HF name pattern, the engine's split) for every HF tensor of every family's table. Tables that name one
    HF tensor must agree on its split (checked here)."""
    seen: dict[str, EngineSplit] = {}
    for arch in ARCHS:
        for m in table(arch):
            for template, split in zip(m.hf, m.engine_splits(), strict=True):
                if seen.setdefault(template, split) != split:
                    raise ValueError(f"the tables split {template} two ways: {seen[template]} and {split}")

    def pattern(template: str) -> re.Pattern[str]:
        return re.compile(re.sub(r"\\\{[LEM]\\\}", r"\\d+", re.escape(template)) + "$")

    return tuple((pattern(t), split) for t, split in seen.items())


def engine_split(name: str) -> EngineSplit:
    """How a tensor-parallel engine splits HF tensor `name` (None: every worker holds it whole)."""
    return next((split for pattern, split in engine_splits() if pattern.match(name)), None)


def vllm_layout(specs: Iterable[Spec], tp: int, *, heads: int, kv_heads: int, head_dim: int,
                expert_parallel: bool = False) -> list[list[tuple[str, Box]]]:
    """Per worker, the (HF name, box) pairs a vLLM engine of tensor parallel size `tp` holds (module doc).
    Experts: with `expert_parallel`, whole experts over the `tp` workers (linear placement, the remainder to
    the first workers); else each expert's rows / columns as a dense MLP's."""
    specs = [(n, d, tuple(s)) for n, d, s in specs]
    if heads % tp:
        raise ValidationError(f"{heads} attention heads do not split over {tp} workers")
    nkv, rep = (1, tp // kv_heads) if tp >= kv_heads else (kv_heads // tp, 1)
    experts = sorted({int(m.group(1)) for n, _, _ in specs if (m := _EXPERT.search(n))})
    out: list[list[tuple[str, Box]]] = [[] for _ in range(tp)]
    for w in range(tp):
        mine = set(experts)
        if expert_parallel and experts:
            base, rem = divmod(len(experts), tp)
            first = w * base + min(w, rem)
            mine = set(experts[first:first + base + (w < rem)])
        for name, _, shape in specs:
            e = _EXPERT.search(name)
            if e is not None and int(e.group(1)) not in mine:
                continue
            split = None if e is not None and expert_parallel else engine_split(name)
            out[w] += _boxes(name, shape, split, tp, w, nkv, rep, head_dim)
    return out


def _boxes(name: str, shape: tuple[int, ...], split: EngineSplit, tp: int, w: int, nkv: int, rep: int,
           head_dim: int) -> list[tuple[str, Box]]:
    """Worker `w`'s boxes of one tensor split as `split`."""
    if split == GATED:  # [gate; up] in one tensor: this worker's rows of each half
        n = shape[0] // 2 // tp
        return [(name, Box.rows(shape, w * n, n)), (name, Box.rows(shape, shape[0] // 2 + w * n, n))]
    if split is None or tp == 1:
        return [(name, Box.whole(shape))]
    if split == KV_HEADS:
        return [(name, Box.rows(shape, (w // rep) * nkv * head_dim, nkv * head_dim))]
    if split == VOCAB:
        per = _pad(shape[0]) // tp
        a, b = min(w * per, shape[0]), min((w + 1) * per, shape[0])
        return [(name, Box.rows(shape, a, b - a))] if b > a else []
    assert isinstance(split, TPLayout)
    if split.stride != 1 or shape[split.dim] % tp:
        raise ValidationError(f"{name}: dimension {split.dim} of {shape} does not split over {tp} workers")
    n = shape[split.dim] // tp
    return [(name, Box.rows(shape, w * n, n, dim=split.dim))]
