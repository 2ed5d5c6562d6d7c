"""Group tensors into chunks by a byte budget.

Order: embeddings first, decoder layers in index order, everything else (final norm, lm_head) last. A
decoder layer stays in one chunk where it fits the budget; an *atomic* group (all MoE experts of one layer)
is never split even when it exceeds the budget. A tensor larger than the budget is split by rows into parts
(`row_parts`) that sources plan as separate items, so every chunk fits the budget; only a tensor whose single
row exceeds the budget (or an atomic group) still gets a chunk of its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EMBED = re.compile(r"embed|word_embeddings|wte\b")


def layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def order_key(name: str) -> tuple[int, int]:
    """Sort key: (0, 0) embeddings, (1, layer) decoder layers, (2, 0) the rest (norm, lm_head)."""
    layer = layer_index(name)
    if layer is not None:
        return (1, layer)
    if _EMBED.search(name):
        return (0, 0)
    return (2, 0)


@dataclass(frozen=True, slots=True)
class Item:
    """One unit to place: `unit` keeps items together where they fit; `atomic` keeps them together always.
    `ref`: the item goes by reference (a view of the trainer's own memory, see `plan_chunks`)."""

    key: object
    nbytes: int
    unit: object
    atomic: object | None = None
    ref: bool = False


def row_parts(shape: tuple[int, ...], itemsize: int, budget: int, align: int = 256) -> list[tuple[int, int]]:
    """Row ranges [(r0, r1), ...] that each fit `budget` bytes once aligned; [(0, rows)] when the tensor
    fits whole, or when one row alone is larger than the budget (it cannot be split by rows)."""
    rows = shape[0] if shape else 1
    row_bytes = itemsize
    for d in shape[1:]:
        row_bytes *= d
    per = (budget // align * align) // row_bytes if row_bytes else rows
    if not shape or -(-rows * row_bytes // align) * align <= budget or per == 0:
        return [(0, rows)]
    return [(r, min(r + per, rows)) for r in range(0, rows, per)]


def plan_chunks(items: Sequence[Item], budget: int, ref_budget: int | None = None) -> list[list[object]]:
    """Split ordered items into chunks of keys. Items must already be in push order.

    `ref_budget`: items marked `ref` (sent by reference, CUDA IPC one copy) fill their own budget per chunk
    instead of `budget`. `budget` bounds the bytes a chunk packs, i.e. the sender's buffer memory; referenced
    bytes take no buffer, and what bounds their chunk is the per-chunk host work (fewer, larger chunks)."""
    if budget <= 0 or (ref_budget is not None and ref_budget <= 0):
        raise ValueError(f"chunk budget must be positive, got {budget} (referenced: {ref_budget})")

    def cost(its: Sequence[Item]) -> tuple[int, int]:
        packed = sum(i.nbytes for i in its if ref_budget is None or not i.ref)
        return packed, sum(i.nbytes for i in its) - packed

    limit = (budget, ref_budget if ref_budget is not None else budget)
    # Build units (consecutive items sharing `unit`), each a list of atomic groups.
    units: list[list[list[Item]]] = []
    last_unit = object()
    for it in items:
        if not units or it.unit != last_unit:
            units.append([])
            last_unit = it.unit
        groups = units[-1]
        if it.atomic is not None and groups and groups[-1][0].atomic == it.atomic:
            groups[-1].append(it)
        else:
            groups.append([it])

    chunks: list[list[object]] = []
    cur: list[object] = []
    used = [0, 0]

    def flush() -> None:
        nonlocal cur
        if cur:
            chunks.append(cur)
        cur = []
        used[0] = used[1] = 0

    def fits(c: tuple[int, int]) -> bool:
        return used[0] + c[0] <= limit[0] and used[1] + c[1] <= limit[1]

    def add(its: Sequence[Item], c: tuple[int, int]) -> None:
        cur.extend(i.key for i in its)
        used[0] += c[0]
        used[1] += c[1]

    for groups in units:
        unit_items = [i for g in groups for i in g]
        c = cost(unit_items)
        if fits(c):
            add(unit_items, c)
            continue
        if c[0] <= limit[0] and c[1] <= limit[1]:  # a whole layer fits an empty chunk: start one
            flush()
            add(unit_items, c)
            continue
        # The unit is larger than a chunk: fill by atomic groups.
        for g in groups:
            gc = cost(g)
            if not fits(gc):
                flush()
            add(g, gc)
            if used[0] >= limit[0] or used[1] >= limit[1]:
                flush()
    flush()
    return chunks


def split_layers(chunks: Sequence[Sequence[str]]) -> dict[int, list[str]]:
    """Per chunk: the names whose decoder layer continues in a later chunk.

    A receiver that buffers a layer until all of its tensors arrived (vLLM's layerwise reload) must copy
    these out of the chunk buffer, which the sender reuses once the chunk is acknowledged.
    """
    last: dict[int, int] = {}
    for i, names in enumerate(chunks):
        for n in names:
            layer = layer_index(n)
            if layer is not None:
                last[layer] = i
    out: dict[int, list[str]] = {}
    for i, names in enumerate(chunks):
        held = [n for n in names if (layer := layer_index(n)) is not None and last[layer] > i]
        if held:
            out[i] = held
    return out
