"""Sharded sending, planned: which trainer rank sends which slice of which HF tensor to which engine worker.

Both sides declare what they hold as *boxes* of full HF tensors (`Box`: a start and a size per dimension):

* a source, per trainer rank (`Have`): a Megatron TP shard is one box along its split dimension (a fused QKV
  shard several: the q, k and v rows of each of its query groups); an FSDP2 shard the box of its DTensor's
  local piece; a plain module one whole box per tensor on the rank that holds it. Ranks holding the same box
  (data-parallel replicas, norms on every TP rank) are replicas: any one of them may send it.
* an engine, per worker (`Need`): a vLLM TP worker holds column slices of q/k/v and gate/up, row slices of
  o_proj and down_proj, its rows of the vocabulary, its experts, and all of every norm.

`plan_transfers` maps one onto the other: every box an engine worker needs is cut into pieces, each the
intersection with one source box, and each piece is sent once, from the least loaded of the ranks that hold
it (bytes so far), so senders are balanced. Pieces are grouped into buckets in layer order (embeddings first,
whole decoder layers, the head last), at most `bucket_bytes` of pieces per sender per bucket: a bucket is what
one round of the pipeline moves, so every rank's extra memory stays within the window times that budget.

A layout that does not fit is refused before any byte moves, naming the tensor and the worker: a box outside
its tensor, a worker outside the engine or holding nothing, two workers claiming overlapping but different
slices, a tensor an engine does not hold whole, a slice no trainer rank holds. The plan is a pure function
of the declarations: every rank and every worker computes the same one, and its `digest` says so.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ValidationError
from .chunking import order_key

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True, order=True)
class Box:
    """A rectangular region of a tensor: `start[d]` and `size[d]` per dimension."""

    start: tuple[int, ...]
    size: tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @staticmethod
    def rows(shape: Sequence[int], row0: int, rows: int, dim: int = 0) -> Box:
        """Rows `[row0, row0 + rows)` of dimension `dim`, all of the others."""
        start = [0] * len(shape)
        size = [int(s) for s in shape]
        start[dim], size[dim] = int(row0), int(rows)
        return Box(tuple(start), tuple(size))

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.start, self.size, strict=True))

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This box of `t` (a view; `t` itself where the box is all of it)."""
        for d, (s, n) in enumerate(zip(self.start, self.size, strict=True)):
            if s or n != t.shape[d]:
                t = t.narrow(d, s, n)
        return t

    def within(self, shape: Sequence[int]) -> bool:
        return (len(shape) == len(self.start) and all(n >= 0 for n in self.size)
                and all(s >= 0 and s + n <= d for s, n, d in zip(self.start, self.size, shape, strict=True)))

    def intersect(self, other: Box) -> Box | None:
        if len(self.start) != len(other.start):
            raise ValueError(f"boxes {self} and {other} differ in rank")
        start: list[int] = []
        size: list[int] = []
        for a, n, b, m in zip(self.start, self.size, other.start, other.size, strict=True):  # hot loop
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                return None
            start.append(lo)
            size.append(hi - lo)
        return Box(tuple(start), tuple(size))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of `outer` (which contains it)."""
        return Box(tuple(s - o for s, o in zip(self.start, outer.start, strict=True)), self.size)

    def to_json(self) -> list[list[int]]:
        return [list(self.start), list(self.size)]

    @staticmethod
    def from_json(obj: object) -> Box:
        if (not isinstance(obj, list) or len(obj) != 2 or not all(isinstance(x, list) for x in obj)
                or len(obj[0]) != len(obj[1]) or len(obj[0]) > 8
                or not all(type(v) is int and 0 <= v < 1 << 50 for x in obj for v in x)):
            raise ValidationError(f"a box must be [[start per dim], [size per dim]], got {obj!r:.120}")
        return Box(tuple(obj[0]), tuple(obj[1]))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{s}:{s + n}" for s, n in zip(self.start, self.size, strict=True)) + "]"


@dataclass(frozen=True, slots=True)
class Have:
    """Trainer rank `rank` holds `box` of HF tensor `name`."""

    rank: int
    name: str
    box: Box


@dataclass(frozen=True, slots=True)
class Need:
    """Worker `worker` of engine `engine` holds `box` of HF tensor `name` (and must receive it each push)."""

    engine: str
    worker: int
    name: str
    box: Box


@dataclass(frozen=True, slots=True)
class Piece:
    """One transfer: `box` of tensor `name`, from trainer rank `src` to `worker` of `engine`."""

    name: str
    box: Box
    src: int
    engine: str
    worker: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.itemsize

    def to_json(self) -> list[object]:
        return [self.name, self.box.to_json(), self.src, self.engine, self.worker, self.itemsize]


@dataclass(frozen=True)
class Shards:
    """A source's declaration for sharded sending, on this rank: the boxes of HF tensors it holds (`holds`),
    the HF tensors a push sends as this rank knows them (name -> (dtype name, full shape), as the engines hold
    them; ranks of a pipeline stage know their stage's tensors, `merge_declarations` joins them), and
    `local(name, box)`: this rank's data for `box` of `name`, a box inside one it holds, as a tensor of
    `box.size` (a view where it can be; the pack stage casts it to the tensor's dtype)."""

    holds: tuple[tuple[str, Box], ...]
    tensors: Mapping[str, tuple[str, tuple[int, ...]]]
    local: Callable[[str, Box], torch.Tensor]

    def declaration(self) -> tuple[list[tuple[str, list[list[int]]]], list[tuple[str, str, list[int]]]]:
        """The plain data every rank sends the others once (`merge_declarations`)."""
        return ([(n, b.to_json()) for n, b in self.holds],
                [(n, d, list(shape)) for n, (d, shape) in self.tensors.items()])


def merge_declarations(declarations: Sequence[object]) -> tuple[list[Have], dict[str, tuple[str, tuple[int, ...]]]]:
    """Every rank's `Shards.declaration()` (index = trainer rank) -> what every rank holds and every tensor a
    push sends, in a order every rank derives alike (ranks in order, each in its own order). A tensor two ranks
    declare with different dtypes or shapes is refused, naming both."""
    haves: list[Have] = []
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    origin: dict[str, int] = {}
    for rank, dec in enumerate(declarations):
        if dec is None:  # a rank that holds nothing of the model
            continue
        if not (isinstance(dec, tuple | list) and len(dec) == 2):
            raise ValidationError(f"trainer rank {rank} declared {dec!r:.80}, not (holds, tensors)")
        holds, known = dec
        for name, dtype, shape in known:
            spec = (str(dtype), tuple(int(x) for x in shape))
            old = tensors.setdefault(name, spec)
            origin.setdefault(name, rank)
            if old != spec:
                raise ValidationError(f"tensor {name!r}: trainer rank {origin[name]} has {old[0]}{list(old[1])}, "
                                      f"rank {rank} {spec[0]}{list(spec[1])}")
        haves += [Have(rank, name, Box.from_json(box)) for name, box in holds]
    return haves, tensors


@dataclass
class ShardPlan:
    """The pieces of a sharded push, in buckets (indices into `pieces`), and what each rank sends."""

    pieces: list[Piece]
    buckets: list[list[int]]
    #: HF name -> (dtype name, full shape)
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    digest: str = ""
    sent_bytes: dict[int, int] = field(default_factory=dict)
    received_bytes: dict[tuple[str, int], int] = field(default_factory=dict)

    def bucket_pieces(self, bucket: int) -> list[Piece]:
        return [self.pieces[i] for i in self.buckets[bucket]]

    def sends(self, bucket: int, rank: int) -> dict[tuple[str, int], list[Piece]]:
        """(engine, worker) -> the pieces `rank` sends there in `bucket`, in plan order."""
        out: dict[tuple[str, int], list[Piece]] = {}
        for p in self.bucket_pieces(bucket):
            if p.src == rank:
                out.setdefault((p.engine, p.worker), []).append(p)
        return out

    def receives(self, bucket: int, engine: str, worker: int) -> dict[int, list[Piece]]:
        """rank -> the pieces (`engine`, `worker`) receives from it in `bucket`, in plan order."""
        out: dict[int, list[Piece]] = {}
        for p in self.bucket_pieces(bucket):
            if p.engine == engine and p.worker == worker:
                out.setdefault(p.src, []).append(p)
        return out

    def bucket_bytes(self, bucket: int, rank: int) -> int:
        return sum(p.nbytes for p in self.bucket_pieces(bucket) if p.src == rank)

    def balance(self) -> float:
        """max / mean bytes sent per sending rank (1.0: perfectly even)."""
        vals = [v for v in self.sent_bytes.values()]
        if not vals:
            return 1.0
        mean = sum(vals) / len(vals)
        return max(vals) / mean if mean else 1.0


@dataclass(frozen=True)
class EngineLayout:
    """What an engine's workers hold: `workers` receiving processes, and per HF tensor the box each needs."""

    engine: str
    workers: int
    needs: tuple[Need, ...]

    @staticmethod
    def whole(engine: str, workers: int, tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> EngineLayout:
        """Every worker holds every tensor whole (an engine that declares no layout)."""
        return EngineLayout(engine, workers, tuple(Need(engine, w, n, Box.whole(shape))
                                                   for w in range(workers) for n, (_, shape) in tensors.items()))

    def to_json(self) -> dict[str, object]:
        return {"engine": self.engine, "workers": self.workers,
                "needs": [[n.worker, n.name, n.box.to_json()] for n in self.needs]}

    @staticmethod
    def from_json(engine: str, obj: object) -> EngineLayout:
        if not isinstance(obj, dict) or type(obj.get("workers")) is not int or not isinstance(obj.get("needs"), list):
            raise ValidationError(f"engine {engine!r}: a layout must be {{workers, needs}}, got {obj!r:.120}")
        needs = []
        for item in obj["needs"]:
            if not isinstance(item, list) or len(item) != 3 or type(item[0]) is not int or not isinstance(item[1], str):
                raise ValidationError(f"engine {engine!r}: a need must be [worker, name, box], got {item!r:.120}")
            needs.append(Need(engine, item[0], item[1], Box.from_json(item[2])))
        return EngineLayout(engine, obj["workers"], tuple(needs))


def check_layout(layout: EngineLayout, tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
    """Refuse a layout that does not fit the model (module doc), naming the tensor and the worker."""
    e = layout.engine
    if layout.workers < 1:
        raise ValidationError(f"engine {e!r} declares {layout.workers} workers")
    by_name: dict[str, list[Need]] = {}
    holding: set[int] = set()
    for n in layout.needs:
        if not 0 <= n.worker < layout.workers:
            raise ValidationError(f"engine {e!r}: worker {n.worker} holds {n.name!r} but the engine has "
                                  f"{layout.workers} workers")
        spec = tensors.get(n.name)
        if spec is None:
            raise ValidationError(f"engine {e!r} worker {n.worker} holds {n.name!r}, which the model does not have")
        if not n.box.within(spec[1]):
            raise ValidationError(f"engine {e!r} worker {n.worker}: slice {n.box} of {n.name!r} lies outside its "
                                  f"shape {list(spec[1])}")
        if n.box.numel:
            holding.add(n.worker)
        by_name.setdefault(n.name, []).append(n)
    missing = sorted(set(range(layout.workers)) - holding)
    if missing:
        raise ValidationError(f"engine {e!r}: worker(s) {missing} hold nothing (a worker missing from the layout)")
    for name, spec in tensors.items():
        needs = by_name.get(name)
        if not needs:
            raise ValidationError(f"engine {e!r} holds no part of {name!r}")
        boxes = sorted({n.box for n in needs})  # identical boxes on several workers are replicas
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if a.intersect(b) is not None:
                    wa = [n.worker for n in needs if n.box == a]
                    wb = [n.worker for n in needs if n.box == b]
                    raise ValidationError(f"engine {e!r}: workers {wa} and {wb} claim overlapping slices {a} and {b} "
                                          f"of {name!r}")
        if sum(b.numel for b in boxes) != math.prod(spec[1]):
            raise ValidationError(f"engine {e!r} does not hold all of {name!r}: its workers' slices cover "
                                  f"{sum(b.numel for b in boxes)} of {math.prod(spec[1])} elements")


def plan_transfers(haves: Iterable[Have], layouts: Sequence[EngineLayout],
                   tensors: Mapping[str, tuple[str, tuple[int, ...]]], *, bucket_bytes: int,
                   itemsize: Mapping[str, int]) -> ShardPlan:
    """The sharded push (module doc). `tensors`: HF name -> (dtype name, full shape) as sent; `itemsize`: bytes
    per element of each tensor on the wire."""
    if bucket_bytes <= 0:
        raise ValidationError(f"bucket_bytes must be positive, got {bucket_bytes}")
    for layout in layouts:
        check_layout(layout, tensors)
    by_name: dict[str, dict[Box, list[int]]] = {}  # name -> box -> the ranks holding it (replicas)
    for h in haves:
        spec = tensors.get(h.name)
        if spec is None:
            raise ValidationError(f"trainer rank {h.rank} holds {h.name!r}, which no engine expects")
        if not h.box.within(spec[1]):
            raise ValidationError(f"trainer rank {h.rank}: slice {h.box} of {h.name!r} lies outside its shape "
                                  f"{list(spec[1])}")
        if h.box.numel:
            by_name.setdefault(h.name, {}).setdefault(h.box, []).append(h.rank)
    needs: list[dict[str, list[Need]]] = []  # per layout, name -> its needs (one pass, not one per tensor)
    for layout in layouts:
        mine: dict[str, list[Need]] = {}
        for n in layout.needs:
            if n.box.numel:
                mine.setdefault(n.name, []).append(n)
        needs.append(mine)
    sent: dict[int, int] = {}
    pieces: list[Piece] = []
    for name in sorted(tensors, key=order_key):
        held = sorted(by_name.get(name, {}).items())
        for mine in needs:
            for need in mine.get(name, ()):
                covered = 0
                for box, ranks in held:
                    cut = need.box.intersect(box)
                    if cut is None:
                        continue
                    src = min(ranks, key=lambda r: (sent.get(r, 0), r))  # the least loaded replica
                    p = Piece(name, cut, src, need.engine, need.worker, itemsize[name])
                    sent[src] = sent.get(src, 0) + p.nbytes
                    pieces.append(p)
                    covered += cut.numel
                if covered < need.box.numel:
                    raise ValidationError(f"engine {need.engine!r} worker {need.worker} needs {need.box} of {name!r}: "
                                          f"{need.box.numel - covered} of its elements are held by no trainer rank")
                if covered > need.box.numel:
                    raise ValidationError(f"trainer ranks hold overlapping but different slices of {name!r} (need "
                                          f"{need.box} of engine {need.engine!r} worker {need.worker} is covered "
                                          "twice): a source must declare its shards exactly")
    pieces = _interleave(pieces)
    buckets = _buckets(pieces, bucket_bytes)
    plan = ShardPlan(pieces, buckets, dict(tensors), sent_bytes=sent)
    for p in pieces:
        plan.received_bytes[(p.engine, p.worker)] = plan.received_bytes.get((p.engine, p.worker), 0) + p.nbytes
    plan.digest = hashlib.blake2b(json.dumps([[p.to_json() for p in pieces], buckets]).encode(),
                                  digest_size=12).hexdigest()
    return plan


def _interleave(pieces: list[Piece]) -> list[Piece]:
    """Pieces ordered so that every sender progresses through its own bytes at the same pace: a unit (one
    worker's slice of one tensor, all of its pieces) is placed by how far through its senders' bytes it starts.
    In layer order a pipeline-parallel trainer's stages would send one after another (bucket after bucket holds
    the layers of one stage, its ranks busy and the others waiting); interleaved, each bucket carries a share of
    every rank's bytes and all links work at once."""
    total: dict[int, int] = {}
    for p in pieces:
        total[p.src] = total.get(p.src, 0) + p.nbytes
    units: dict[tuple[str, str, int], list[Piece]] = {}
    for p in pieces:
        units.setdefault((p.name, p.engine, p.worker), []).append(p)
    done: dict[int, int] = {}
    keyed: list[tuple[float, int, list[Piece]]] = []
    for n, unit in enumerate(units.values()):
        start = max(done.get(p.src, 0) / total[p.src] if total[p.src] else 0.0 for p in unit)
        for p in unit:
            done[p.src] = done.get(p.src, 0) + p.nbytes
        keyed.append((start, n, unit))
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [p for _, _, unit in keyed for p in unit]


def _buckets(pieces: Sequence[Piece], budget: int) -> list[list[int]]:
    """Consecutive pieces (layer order) grouped so that no rank sends more than `budget` bytes in one bucket;
    a layer is not split across buckets unless its own pieces exceed the budget, and one worker's slice of a
    tensor never is (a worker loads whole tensors: all of its slice must arrive in one bucket), so a bucket
    holds at least one such slice however large."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    per_rank: dict[int, int] = {}

    def runs(i: int, j: int, key: Callable[[Piece], object]) -> Iterator[tuple[int, int]]:
        while i < j:
            k = i
            while k < j and key(pieces[k]) == key(pieces[i]):
                k += 1
            yield i, k
            i = k

    def add(i: int, j: int) -> None:
        nonlocal cur, per_rank
        group: dict[int, int] = {}
        for k in range(i, j):
            group[pieces[k].src] = group.get(pieces[k].src, 0) + pieces[k].nbytes
        if cur and any(per_rank.get(r, 0) + b > budget for r, b in group.items()):
            buckets.append(cur)
            cur, per_rank = [], {}
        cur.extend(range(i, j))
        for r, b in group.items():
            per_rank[r] = per_rank.get(r, 0) + b

    for i, j in runs(0, len(pieces), lambda p: order_key(p.name)):  # one layer (or the embeddings, the head)
        layer: dict[int, int] = {}
        for k in range(i, j):
            layer[pieces[k].src] = layer.get(pieces[k].src, 0) + pieces[k].nbytes
        if any(b > budget for b in layer.values()):  # larger than a bucket: split by worker slices
            for a, b in runs(i, j, lambda p: (p.name, p.engine, p.worker)):
                add(a, b)
        else:
            add(i, j)
    if cur:
        buckets.append(cur)
    return buckets
