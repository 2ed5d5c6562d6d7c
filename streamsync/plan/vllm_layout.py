"""The slice of each HF tensor each worker of a vLLM engine holds, from the checkpoint's shapes alone.

For a Qwen/Llama-shaped checkpoint at tensor parallel size `tp` (experts over the workers with
`expert_parallel`), as vLLM's column/row-parallel layers split them: q/k/v rows (k/v replicated where `tp`
exceeds the kv heads; MLA's q_b_proj / kv_b_proj rows by heads), o_proj and down_proj columns, gate/up rows,
the vocabulary padded to 64 rows split by rows. The planner (`streamsync plan`) and the test engines use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import ValidationError
from ..models.synthetic import Spec
from .shards import Box

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _pad(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def vllm_layout(specs: Iterable[Spec], tp: int, *, heads: int, kv_heads: int, head_dim: int,
                expert_parallel: bool = False) -> list[list[tuple[str, Box]]]:
    """Per worker, the (HF name, box) pairs a vLLM engine of tensor parallel size `tp` holds (module doc).
    Experts: with `expert_parallel`, whole experts over the `tp` workers (linear placement, the remainder to
    the first workers); else each expert's rows / columns as a dense MLP's."""
    specs = [(n, d, tuple(s)) for n, d, s in specs]
    if heads % tp:
        raise ValidationError(f"{heads} attention heads do not split over {tp} workers")
    nh = heads // tp
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
            split_mlp = e is None or not expert_parallel
            box: Box | None = Box.whole(shape)
            if re.search(r"\.q_proj\.(weight|bias)$", name):  # by heads (MLA's q heads are nope + rope wide)
                per = shape[0] // heads
                box = Box.rows(shape, w * nh * per, nh * per)
            elif re.search(r"\.[kv]_proj\.(weight|bias)$", name):
                box = Box.rows(shape, (w // rep) * nkv * head_dim, nkv * head_dim)
            elif re.search(r"\.(q_b_proj|kv_b_proj)\.weight$", name):  # MLA: column parallel, by heads
                n = shape[0] // tp
                box = Box.rows(shape, w * n, n)
            elif name.endswith(".o_proj.weight"):
                box = Box.rows(shape, w * nh * head_dim, nh * head_dim, dim=1)
            elif name.endswith(".gate_up_proj.weight"):  # GLM-4's fused [gate; up]: this worker's rows of each
                n = shape[0] // 2 // tp
                out[w] += [(name, Box.rows(shape, w * n, n)), (name, Box.rows(shape, shape[0] // 2 + w * n, n))]
                box = None
            elif split_mlp and re.search(r"\.(gate_proj|up_proj)\.weight$", name):
                n = shape[0] // tp
                box = Box.rows(shape, w * n, n)
            elif split_mlp and name.endswith(".down_proj.weight"):
                n = shape[1] // tp
                box = Box.rows(shape, w * n, n, dim=1)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                per = _pad(shape[0]) // tp
                a, b = min(w * per, shape[0]), min((w + 1) * per, shape[0])
                box = Box.rows(shape, a, b - a) if b > a else None
            if box is not None:
                out[w].append((name, box))
    return out
