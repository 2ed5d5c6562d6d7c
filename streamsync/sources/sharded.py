"""`ShardedSource`: a source's shards, sent by every trainer rank that holds them (the "p2p" transport).

Built on every rank of the trainer's default process group at the same point of a push (construction
exchanges each rank's `Shards.declaration()` once, with one `all_gather_object`): every rank then derives the
same `ShardPlan` from the same declarations and engine layouts, and checks that it did (plan digests,
all-gathered once). Chunk i of this rank is bucket i of the plan: the pieces this rank sends in it, grouped by
destination (engine, worker) in plan order, so each destination's pieces are one contiguous segment of the
packed buffer, sent as one message. Conversions happen where the bytes are: each rank casts its own pieces
while packing them.

The chunks an engine receives are the bucket's whole tensors (`delivered`): each worker assembles the pieces
it gets into a buffer laid out as those tensors, then loads them as it loads any chunk (vLLM's `load_weights`
narrows its own slice out of each; only that slice was sent and filled).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ValidationError
from ..pack import Layout, TensorSpec, dtype_from_name, plan_layout
from ..plan.chunk import ChunkPlan
from ..plan.shards import EngineLayout, Piece, ShardPlan, Shards, merge_declarations, plan_transfers
from .base import Source


@dataclass(frozen=True)
class Segment:
    """What one destination receives from one trainer rank in one bucket: `nbytes` from offset `offset` of
    that rank's packed buffer, holding `pieces` as (piece, offset within the segment)."""

    src: int
    offset: int
    nbytes: int
    pieces: tuple[tuple[Piece, int], ...]


def trainer_rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj: object) -> list[object]:
    """`obj` of every rank of the default group (just `[obj]` in a world of one)."""
    _, world = trainer_rank_world()
    if world == 1:
        return [obj]
    out: list[object] = [None] * world
    dist.all_gather_object(out, obj)
    return out


class ShardedSource(Source):
    """`inner`'s shards, planned onto `layouts` (None for an engine: every worker takes whole tensors).

    bucket_bytes: at most this many bytes of pieces per sending rank per bucket (a bucket is one chunk of the
    pipeline: every rank's extra memory stays within the window times this budget)."""

    def __init__(self, inner: Source, layouts: Sequence[tuple[str, int, EngineLayout | None]],
                 bucket_bytes: int) -> None:
        self.inner = inner
        self.rank, self.world = trainer_rank_world()
        shards = inner.shards()
        if shards is None:
            raise ValidationError(f"{type(inner).__name__} cannot say which slices this rank holds, so it cannot "
                                  "be sent by every rank (transport='p2p'); use a single-sender transport")
        self.declared: Shards = shards
        haves, tensors = merge_declarations(gather_objects(shards.declaration()))
        if not tensors:
            raise ValidationError("nothing to push: no trainer rank declared a tensor")
        self.tensors = tensors
        self.layouts = [lay if lay is not None else EngineLayout.whole(name, workers, tensors)
                        for name, workers, lay in layouts]
        self.dtypes = {n: dtype_from_name(d) for n, (d, _) in tensors.items()}
        self.plan_: ShardPlan = plan_transfers(haves, self.layouts, tensors, bucket_bytes=bucket_bytes,
                                               itemsize={n: dt.itemsize for n, dt in self.dtypes.items()})
        digests = gather_objects(self.plan_.digest)
        if len(set(digests)) != 1:
            raise ValidationError(f"trainer ranks planned different sharded pushes (digests {digests}): every rank "
                                  "must declare its shards from the same model")
        self._device = self.inner.device
        self._chunks: dict[int, list[ChunkPlan]] = {}  # rank -> its chunk plans (this rank's made eagerly)
        self._segments: dict[int, dict[tuple[str, int], list[Segment]]] = {}  # bucket -> destination -> segments
        self._delivered: dict[tuple[int, str], Layout] = {}

    # -- the plan ----------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_sender(self) -> bool:
        return True

    @property
    def senders(self) -> int:
        """Trainer ranks that send bytes in a push."""
        return sum(1 for b in self.plan_.sent_bytes.values() if b)

    def engine_index(self, name: str) -> int:
        return next(i for i, lay in enumerate(self.layouts) if lay.engine == name)

    def _ordered(self, bucket: int, rank: int) -> list[Piece]:
        """`rank`'s pieces of `bucket`, grouped by destination (engines in order, workers in order), each
        destination's in plan order."""
        order = {lay.engine: i for i, lay in enumerate(self.layouts)}
        pieces = [p for p in self.plan_.bucket_pieces(bucket) if p.src == rank]
        return sorted(pieces, key=lambda p: (order[p.engine], p.worker))  # stable: plan order within

    def chunks_of(self, rank: int) -> list[ChunkPlan]:
        hit = self._chunks.get(rank)
        if hit is None:
            hit = []
            for b in range(len(self.plan_.buckets)):
                pieces = self._ordered(b, rank)
                specs = tuple(TensorSpec(p.name, self.dtypes[p.name], p.box.size) for p in pieces)
                hit.append(ChunkPlan(b, specs, tuple(pieces)))
            self._chunks[rank] = hit
        return hit

    def plan(self, chunk_bytes: int, *, ref_bytes: int | None = None) -> list[ChunkPlan]:
        """This rank's chunks: one per bucket, every rank the same number (some may be empty)."""
        return self.chunks_of(self.rank)

    def segments(self, bucket: int) -> dict[tuple[str, int], list[Segment]]:
        """(engine, worker) -> what it receives in `bucket`, one segment per sending rank (ranks in order)."""
        hit = self._segments.get(bucket)
        if hit is not None:
            return hit
        out: dict[tuple[str, int], list[Segment]] = {}
        for src in sorted({p.src for p in self.plan_.bucket_pieces(bucket)}):
            chunk = self.chunks_of(src)[bucket]
            metas = chunk.layout.metas
            i = 0
            pieces: Sequence[Piece] = chunk.keys  # type: ignore[assignment]
            while i < len(pieces):
                dest = (pieces[i].engine, pieces[i].worker)
                j = i
                while j < len(pieces) and (pieces[j].engine, pieces[j].worker) == dest:
                    j += 1
                start = metas[i].offset
                end = metas[j - 1].offset + metas[j - 1].nbytes
                seg = Segment(src, start, end - start,
                              tuple((pieces[k], metas[k].offset - start) for k in range(i, j)))
                out.setdefault(dest, []).append(seg)
                i = j
        self._segments[bucket] = out
        return out

    def sends(self, bucket: int) -> list[tuple[tuple[str, int], int, int]]:
        """This rank's messages in `bucket`: ((engine, worker), offset, nbytes) in send order."""
        return [(dest, s.offset, s.nbytes) for dest, segs in self.segments(bucket).items()
                for s in segs if s.src == self.rank]

    def delivered(self, bucket: int, engine: str) -> Layout:
        """The whole tensors of `bucket` that some worker of `engine` receives part of, laid out as one chunk
        (what its workers assemble and load), in plan order."""
        key = (bucket, engine)
        hit = self._delivered.get(key)
        if hit is None:
            names = list(dict.fromkeys(p.name for p in self.plan_.bucket_pieces(bucket) if p.engine == engine))
            hit = self._delivered[key] = plan_layout(
                TensorSpec(n, self.dtypes[n], self.tensors[n][1]) for n in names)
        return hit

    def delivers(self, plans: Sequence[ChunkPlan]) -> list[ChunkPlan]:
        """Per bucket, the whole tensors it completes on the engines (checks and layer bookkeeping)."""
        out = []
        for b in range(len(self.plan_.buckets)):
            names = list(dict.fromkeys(p.name for p in self.plan_.bucket_pieces(b)))
            specs = tuple(TensorSpec(n, self.dtypes[n], self.tensors[n][1]) for n in names)
            out.append(ChunkPlan(b, specs, tuple(names)))
        return out

    # -- a push ------------------------------------------------------------------------------------------

    def begin_push(self) -> None:
        self.inner.begin_push()

    async def gather(self, chunk: ChunkPlan) -> object:
        return None  # every piece is this rank's own: nothing to collect

    async def convert(self, chunk: ChunkPlan, gathered: object, *, cast: bool = True) -> Sequence[torch.Tensor]:
        local = self.declared.local
        pieces: Sequence[Piece] = chunk.keys  # type: ignore[assignment]
        out = [local(p.name, p.box) for p in pieces]
        if cast:
            return [t if t.dtype == s.dtype else t.to(s.dtype) for t, s in zip(out, chunk.specs, strict=True)]
        return out

    def local_tensors(self) -> Sequence[tuple[str, torch.Tensor]]:
        return self.inner.local_tensors()

    def local_addresses(self, device: torch.device) -> set[int]:
        return self.inner.local_addresses(device)

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends in a push."""
        return self.plan_.sent_bytes.get(self.rank, 0)

    def stats(self) -> Mapping[str, object]:
        """The plan's shape: senders, bytes per rank, balance."""
        return {"senders": self.senders, "buckets": len(self.plan_.buckets), "pieces": len(self.plan_.pieces),
                "sent_bytes": dict(self.plan_.sent_bytes), "balance": round(self.plan_.balance(), 4)}
