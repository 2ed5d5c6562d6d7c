"""`MegatronSource`: a megatron-core model as a stream of HF-named tensors (see the package doc)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import anyio
import torch
import torch.distributed as dist

from ...convert import (
    HF_ARCHITECTURES,
    Dims,
    Resolved,
    canonical_arch,
    check_config,
    detect_arch,
    get_converter,
)
from ...convert.mappings import tp_merge
from ...errors import ValidationError
from ...pack import TensorSpec, dtype_name
from ...plan.chunk import ChunkPlan
from ...plan.chunking import Item, plan_chunks
from ...plan.shards import Box, Shards
from ..base import AddressCache, DetachedCache, Source
from .walk import Coords, Groups, ParamInfo, _build_table, _local_record, global_parameters, topology, unwrap_chunks

# all_gather_single is the new name (torch >= 2.12) of all_gather_into_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_WARNED_VOCAB: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models warned about their padded vocab
_TABLES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[dict[str, ParamInfo], list[Coords]]] = (
    weakref.WeakKeyDictionary())

# ------------------------------------------------------------------------------------------ source


@dataclass
class _Batch:
    """Tensors moved by one collective: one (group, dtype) of a chunk, or one bucket of it."""

    keys: list[str]
    dtype: torch.dtype
    numels: list[int]

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def slices(self) -> Iterator[tuple[str, int, int]]:
        """(key, offset, numel) of each tensor in the flat buffer."""
        off = 0
        for k, n in zip(self.keys, self.numels, strict=True):
            yield k, off, n
            off += n


class MegatronSource(Source):
    """A megatron-core GPTModel (or the list of its virtual-pipeline chunks) as a stream of HF tensors.

    arch:        a name of `convert.ARCHS` or an alias ('qwen3', 'qwen3-moe', 'deepseek-v3', 'kimi_k2', 'glm4',
                 'glm4-moe', 'llama', 'mistral', ...); default: detected from `hf_config`'s model_type, else from
                 the megatron config (`convert.detect_arch`). A config option the table does not map (linear
                 biases, a gated shared expert, MLA on a grouped-query table, ...) is refused, named
                 (`convert.check_config`).
    dtype:       the receiver's dtype for floating tensors (norms that megatron keeps in float32 are cast);
                 default: `hf_config`'s dtype, else the megatron `params_dtype`.
    vocab_size:  the HF vocabulary; padding rows beyond it are dropped. Default: `hf_config.vocab_size`,
                 else megatron's (padded) vocabulary, sent whole.
    bucket_bytes: cap one collective's payload (per rank): a (group, dtype) of a chunk then takes one
                 collective per bucket, all in flight together (1: one per parameter). Gloo runs concurrent
                 collectives on several threads, so on CPU a few MiB buckets beat one large message;
                 NCCL wants one large message (default None: one collective per (group, dtype) per chunk).
    every_rank_sends: colocated engines (one per trainer GPU, as vLLM TP workers that each load full
                 tensors): every rank keeps the full tensors its all-gathers brought and sends them to
                 its own engine, after the same one set of gathers. Needs PP = 1, and expert TP = 1
                 when EP > 1 (then every rank takes part in every all-gather).

    Construction is collective when the model is sharded: every rank of the default group must construct
    it (as `push` does) at the same point. Raises ValidationError for parameters no table entry maps, or a
    table whose TP layout disagrees with the parameter's `partition_dim` / `partition_stride`.
    """

    def __init__(self, model: object, *, arch: str | None = None, dtype: torch.dtype | str | None = None,
                 bucket_bytes: int | None = None, hf_config: object = None,
                 vocab_size: int | None = None, every_rank_sends: bool = False) -> None:
        self.chunks = unwrap_chunks(model)
        self.every_rank_sends = every_rank_sends
        first = self.chunks[0]
        cfg = first.config
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes < 1):
            raise ValidationError(f"bucket_bytes must be a positive integer or None, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.tied = bool(getattr(first, "share_embeddings_and_output_weights", False))
        hf_tied = _hf_get(hf_config, "tie_word_embeddings")
        if hf_tied is not None and bool(hf_tied) != self.tied:
            raise ValidationError(f"hf_config.tie_word_embeddings={hf_tied} but the megatron model has "
                                  f"share_embeddings_and_output_weights={self.tied}")
        names = (n for n, _ in first.named_parameters())
        self.arch = canonical_arch(arch) if arch else detect_arch(cfg, hf_config, names)
        check_config(self.arch, cfg)
        self.converter = get_converter(self.arch, tied=self.tied, num_layers=cfg.num_layers)
        self.architectures = HF_ARCHITECTURES[self.arch]
        vocab = vocab_size or _hf_get(hf_config, "vocab_size") or first.vocab_size
        self.dims = Dims(cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads,
                         cfg.kv_channels, int(vocab))
        dt = dtype or _hf_get(hf_config, "dtype") or _hf_get(hf_config, "torch_dtype") or cfg.params_dtype
        self.dtype: torch.dtype = getattr(torch, dt) if isinstance(dt, str) else dt

        self.coords, self.groups = topology(first)
        self._local = {n: (p, e) for n, p, e in global_parameters(self.chunks)}
        # chunk index -> (addresses and strides of its gathered tensors, their HF views): see `convert`
        self._views: dict[int, tuple[dict[str, torch.Tensor], list[torch.Tensor]]] = {}  # see convert
        self._addresses = AddressCache()
        self._own: dict[int, tuple[Sequence[object], tuple[list, list, list], dict[str, torch.Tensor]]] = {}
        self._detached = DetachedCache()
        if not self._local:
            raise ValidationError("the megatron model has no parameters on this rank")
        devices = {p.device for p, _ in self._local.values()}
        if len(devices) > 1:
            raise ValidationError(f"model parameters span several devices {sorted(map(str, devices))}")
        self._device = devices.pop()
        #: collectives construction issued: 1 (the metadata exchange) on a sharded model's first push, else 0.
        self.setup_collectives = 0
        self.table, self.all_coords = self._global_table(first)
        self._resolved: dict[str, Resolved] = {}
        self._specs: dict[str, tuple[TensorSpec, ...]] = {}
        for name, info in self.table.items():
            r = self.converter.resolve(name)
            _check_layout(name, r, info)
            self._resolved[name] = r
            shapes = r.mapping.hf_shapes(info.shape, self.dims)
            out_dtype = r.mapping.hf_dtype or (self.dtype if info.dtype.is_floating_point else info.dtype)
            self._specs[name] = tuple(TensorSpec(h, out_dtype, s) for h, s in zip(r.hf, shapes, strict=True))
        self._leaders = self._find_leaders()
        if vocab_size is None and _hf_get(hf_config, "vocab_size") is None and self.is_sender \
                and first not in _WARNED_VOCAB:
            _WARNED_VOCAB.add(first)
            from ...log import get_logger

            get_logger().warning(
                "no HF vocabulary size: sending the megatron model's vocabulary whole (padding rows included)",
                rows=int(first.vocab_size), fix="source_options={'hf_config': <the served model's config>}")
        g = self.groups
        if every_rank_sends and (g.pp_size > 1 or (g.ep_size > 1 and g.etp_size > 1)
                                 or not (self.coords.dense_writer and self.coords.expert_writer)):
            raise ValidationError("every_rank_sends needs PP = 1, expert TP = 1 when EP > 1, and no data-parallel "
                                  f"replicas (got pp {g.pp_size}, ep {g.ep_size}, etp {g.etp_size}, "
                                  f"coords {self.coords})")
        if self.is_sender and self.coords.rank != 0 and not every_rank_sends:
            raise ValidationError(f"rank {self.coords.rank} has all parallel ranks 0 but is not global rank 0: "
                                  "unsupported rank order")
        self._stream: Any = None
        self._collectives = 0
        #: (chunk, group, dtype) of every collective this rank issued since `plan`: the counter's detail.
        self.events: list[tuple[int, str, str]] = []

    # -- construction helpers --------------------------------------------------------------------------

    def _global_table(self, first: torch.nn.Module) -> tuple[dict[str, ParamInfo], list[Coords]]:
        cached = _TABLES.get(first)
        if cached is not None:
            return cached
        mine = _local_record(self.coords, self._local)
        if self.groups.sharded:
            records: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(records, mine)
            self.setup_collectives = 1
        else:
            records = [mine]  # nothing sharded: this rank (any data-parallel replica) holds the whole model
        built = _build_table(records, self.groups)
        _TABLES[first] = built
        return built

    def _find_leaders(self) -> dict[int, int]:
        if not self.groups.sharded:
            return {0: 0}  # every replica holds the whole model; rank 0's sends
        leaders: dict[int, int] = {}
        for c in self.all_coords:
            if c.leads():
                leaders.setdefault(c.pp, c.rank)
        stages = {i.stage for i in self.table.values()}
        missing = stages - set(leaders)
        if missing:
            raise ValidationError(f"no rank with all non-pipeline coordinates 0 on stage(s) {sorted(missing)}: "
                                  "unsupported rank order")
        return leaders

    # -- Source ----------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def collectives(self) -> int:
        """Collectives this rank's gathers issued since `plan` (one push); `events` says which."""
        return self._collectives

    @property
    def is_sender(self) -> bool:
        return self.every_rank_sends or (self.coords.pp == 0 and self.coords.leads())

    @property
    def sent(self) -> list[str]:
        """Global names of the Megatron parameters a push sends, in push order (tied copies excluded)."""
        return [n for n in self.table if self._resolved[n].mapping.send]

    def hf_specs(self) -> list[TensorSpec]:
        """Every HF tensor a push sends, in push order (what a receiver must hold)."""
        return [s for p in self.plan(1 << 62) for s in p.specs]

    def plan(self, chunk_bytes: int, *, ref_bytes: int | None = None) -> list[ChunkPlan]:
        """Chunks of Megatron parameters (keys: global names) with their HF specs; all experts of a layer stay
        in one chunk. Pure and the same on every rank; resets `collectives` for the push it plans.

        `ref_bytes`: the transport sends plain views of CUDA tensors by reference (CUDA IPC one copy). An
        unsharded model's HF tensors are views of its parameters (QKV and gate/up splits included) except
        where the dtype changes (float32 norms): those fill this budget per chunk instead (`plan_chunks`)."""
        self.begin_push()
        views = ref_bytes is not None and not self.groups.sharded and self._device.type == "cuda"
        items = []
        for name, info in self.table.items():
            r = self._resolved[name]
            if not r.mapping.send:
                continue
            nbytes = sum(s.nbytes for s in self._specs[name])
            unit = r.layer if r.layer is not None else name
            ref = views and all(s.dtype == info.dtype for s in self._specs[name])
            items.append(Item(name, nbytes, unit, ("experts", r.layer) if info.expert else None, ref=ref))
        chunks = [self._experts_by_kind(keys) for keys in plan_chunks(items, chunk_bytes, ref_bytes)]
        return [ChunkPlan(i, tuple(s for k in keys for s in self._specs[k]), tuple(keys))  # type: ignore[index]
                for i, keys in enumerate(chunks)]

    def _experts_by_kind(self, keys: list[object]) -> list[object]:
        """A layer's experts (one atomic group, so always in one chunk) ordered every fc1 first, then every
        fc2: the HF tensors then lie as [gate_0; up_0; gate_1; ...] then [down_0; down_1; ...], byte for byte
        an engine's stacked w13 [E, 2I, H] and w2 [E, H, I] (`pack.fuse_layout`)."""
        def kind(k: object) -> int:
            return 1 if self.table[k].expert and ".linear_fc2." in str(k) else 0  # type: ignore[index]

        out: list[object] = []
        run: list[object] = []
        for k in keys:
            if run and (not self.table[k].expert or self._resolved[k].layer != self._resolved[run[0]].layer):  # type: ignore[index]
                out += sorted(run, key=kind)
                run = []
            if self.table[k].expert:  # type: ignore[index]
                run.append(k)
            else:
                out.append(k)
        return out + sorted(run, key=kind)

    def local_tensors(self) -> Sequence[tuple[str, torch.Tensor]]:
        return self._detached.get(list(self._local), [p for p, _ in self._local.values()],
                                  lambda _, p: p.detach())

    def shards(self) -> Shards:
        """What this rank holds of each HF tensor, from its own parameters' shapes and the mappings' TP
        layouts (`Mapping.shard_parts`): a dense TP shard is one box per HF tensor (a fused QKV shard three per
        query group, a gated fc1 two), a padded vocabulary shard its real rows, an expert its own tensors
        (global index), a replicated parameter the whole tensor. Every rank of a stage holds its stage's
        tensors; data-parallel replicas declare the same boxes and share the sending."""
        c, g = self.coords, self.groups
        holds: list[tuple[str, Box]] = []
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        where: dict[str, list[tuple[Box, Box, torch.Tensor]]] = {}
        for name, (p, expert) in self._local.items():
            r, info = self._resolved[name], self.table[name]
            if not r.mapping.send:
                continue
            split = info.tp is not None
            size, rank = ((g.etp_size, c.etp) if expert else (g.tp_size, c.tp)) if split else (1, 0)
            for spec in self._specs[name]:
                tensors[spec.name] = (dtype_name(spec.dtype), spec.shape)
            for part in r.mapping.shard_parts(tuple(p.shape), self.dims, size, rank):
                hf = r.hf[part.hf]
                holds.append((hf, part.box))
                where.setdefault(hf, []).append((part.box, part.local, p))

        def local(name: str, box: Box) -> torch.Tensor:
            for held, at, p in where[name]:
                if box.intersect(held) == box:  # inside this part: the same offsets in the local shard
                    t = p.detach()
                    for d, (s, h, a, n) in enumerate(zip(box.start, held.start, at.start, box.size, strict=True)):
                        t = t.narrow(d, a + s - h, n)
                    return t
            raise ValidationError(f"trainer rank {c.rank} holds no {box} of {name!r}")

        return Shards(tuple(holds), tensors, local)

    def local_addresses(self, device: torch.device) -> set[int]:
        params: list[torch.Tensor] = [p for p, _ in self._local.values()]
        return self._addresses.get(params, device)

    @property
    def gathers_here(self) -> bool:
        return not self.groups.sharded

    def begin_push(self) -> None:
        self._collectives = 0
        self.events = []

    async def gather(self, chunk: ChunkPlan) -> dict[str, torch.Tensor] | None:
        """Run the chunk's TP, EP and PP rounds (see the module doc). Returns {global name: full tensor} on the
        sender, None elsewhere. Must be called for every chunk, in plan order, on every rank."""
        # abandon_on_cancel: a push that times out (a peer died) fails on time instead of waiting for the
        # process group's own timeout; the group is then out of step and the trainer must not reuse it.
        if not self.groups.sharded:  # nothing to collect: the sender's own parameters, no thread hop
            return self._own_tensors(chunk) if self.is_sender else None
        consumer = torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None
        return await anyio.to_thread.run_sync(self._gather_sync, chunk, consumer, abandon_on_cancel=True)

    def _own_tensors(self, chunk: ChunkPlan) -> dict[str, torch.Tensor]:
        """{name: the sender's own parameter, detached}. The same dict comes back while every parameter of the
        chunk keeps its address, size and contiguity (checked each push; a parameter the trainer replaced, resized
        or transposed gets a fresh one), so `convert` can reuse its views: an MoE chunk has thousands of tensors,
        and making new tensor objects for them was most of the sender's host time."""
        keys: list[str] = [k for k in chunk.keys if isinstance(k, str)]
        params = [self._local[k][0] for k in keys]
        # Plain ints, no tuples per parameter: nothing the garbage collector tracks (thousands of small tuples a
        # push set off collections). A new storage moves the address, a resize the size, a transpose the order.
        T = torch.Tensor
        key = list(map(T.data_ptr, params)), list(map(T.numel, params)), list(map(T.is_contiguous, params))
        hit = self._own.get(chunk.index)
        if hit is not None and hit[1] == key and hit[0] == chunk.keys:
            return hit[2]
        own = {k: p.detach() for k, p in zip(keys, params, strict=True)}
        self._own[chunk.index] = (chunk.keys, key, own)
        return own

    async def convert(self, chunk: ChunkPlan, gathered: object, *, cast: bool = True) -> Sequence[torch.Tensor]:
        full: dict[str, torch.Tensor] = gathered  # type: ignore[assignment]
        if not cast and not self.groups.sharded and self._device.type == "cuda":
            # The sender's own parameters: the HF views of a chunk are the same while every parameter keeps
            # its address, so the same list comes back (an MoE chunk has hundreds; building them is most of
            # the sender's host time, and transports key their per-chunk caches on the list).
            hit = self._views.get(chunk.index)
            if hit is not None and hit[0] is full:  # gather's cached tensors: every parameter where it was
                return hit[1]
            out: list[torch.Tensor] = []
            for k in chunk.keys:
                out += self._resolved[k].mapping.to_hf_views(full[k], self.dims)  # type: ignore[index]
            self._views[chunk.index] = (full, out)
            return out

        def work() -> list[torch.Tensor]:
            out: list[torch.Tensor] = []
            for k in chunk.keys:
                out += self._resolved[k].mapping.to_hf_views(full[k], self.dims)  # type: ignore[index]
            if not cast:  # norms megatron keeps in float32 are cast by the pack copy
                return out
            return [t if t.dtype == s.dtype else t.to(s.dtype) for t, s in zip(out, chunk.specs, strict=True)]

        if self._device.type == "cpu":  # QKV splits and casts copy: keep them off the loop
            return await anyio.to_thread.run_sync(work)
        return work()

    # -- the three rounds ------------------------------------------------------------------------------

    def _batches(self, keys: Sequence[str], numel: dict[str, int], wire: bool = False) -> list[_Batch]:
        """Group tensors into collectives: by dtype, in buckets of at most `bucket_bytes`. `wire`: floating
        tensors travel in the dtype they are sent in (the receiver's, or a mapping's own: the float32 expert
        bias), which the sender casts to anyway, so the bits are the same."""
        def dtype(k: str) -> torch.dtype:
            t = self.table[k].dtype
            return (self._resolved[k].mapping.hf_dtype or self.dtype) if wire and t.is_floating_point else t

        by_dtype: dict[torch.dtype, list[_Batch]] = {}
        for k in keys:
            dt = dtype(k)
            batches = by_dtype.setdefault(dt, [_Batch([], dt, [])])
            b = batches[-1]
            if self.bucket_bytes and b.keys and (b.numel + numel[k]) * dt.itemsize > self.bucket_bytes:
                b = _Batch([], dt, [])
                batches.append(b)
            b.keys.append(k)
            b.numels.append(numel[k])
        return [b for batches in by_dtype.values() for b in batches]

    def _count(self, chunk: ChunkPlan, group: str, dtype: torch.dtype) -> None:
        self._collectives += 1
        self.events.append((chunk.index, group, dtype_name(dtype)))

    def _flat(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One flat send buffer (one copy); a single contiguous tensor of the right dtype goes as a view."""
        if len(tensors) == 1 and tensors[0].dtype == dtype:
            return tensors[0].detach().reshape(-1)
        return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])

    def _gather_sync(self, chunk: ChunkPlan, consumer: Any = None) -> dict[str, torch.Tensor] | None:
        """`consumer`: the caller's current CUDA stream, taken in the caller's thread (a worker thread's
        current stream is its own default stream, which the trainer's writes need not be on)."""
        c, g = self.coords, self.groups
        stream = None
        if self._device.type == "cuda":  # a side stream that first sees the trainer's last writes
            if self._stream is None:
                self._stream = torch.cuda.Stream(self._device)
            stream = self._stream
            consumer = consumer if consumer is not None else torch.cuda.current_stream(self._device)
            stream.wait_stream(consumer)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            have = self._gather_rounds(chunk, c, g, stream)
        if not self.is_sender:
            return None
        if consumer is not None:  # buffers made on the side stream are used on the consumer's: keep them alive
            for k, t in have.items():
                own = self._local.get(k)
                if own is None or t.data_ptr() != own[0].data_ptr():
                    t.record_stream(consumer)
        return have

    def _gather_rounds(self, chunk: ChunkPlan, c: Coords, g: Groups, stream: Any) -> dict[str, torch.Tensor]:
        infos = [self.table[k] for k in chunk.keys]  # type: ignore[index]
        mine = [i for i in infos if i.stage == c.pp and (
            (i.expert and i.ep == c.ep and c.expert_writer) or (not i.expert and c.dense_writer))]
        have = {i.name: self._local[i.name][0].detach() for i in mine if i.tp is None}
        self._round_tp(chunk, [i for i in mine if i.tp is not None], have, stream)
        experts = [i for i in infos if i.expert and i.stage == c.pp]
        if experts and g.ep_size > 1 and c.expert_writer and c.etp == 0:
            self._round_ep(chunk, experts, have, stream)
        if g.pp_size > 1 and c.leads():
            self._round_pp(chunk, infos, have, stream)
        return have

    def _round_tp(self, chunk: ChunkPlan, split: list[ParamInfo], have: dict[str, torch.Tensor],
                  stream: Any) -> None:
        """Round 1: shards of this stage's dense tensors (TP group) and local experts (expert-TP group) ->
        full tensors, on the ranks that use them: stage leaders, and the ranks of the EP round."""
        c, g = self.coords, self.groups
        every = self.every_rank_sends
        merge = {False: c.leads() or every, True: c.leads() or every or (g.ep_size > 1 and c.etp == 0)}
        pending = []
        for expert, group, size, label in ((False, g.tp, g.tp_size, "tp"), (True, g.etp, g.etp_size, "etp")):
            keys = [i.name for i in split if i.expert == expert]
            for b in self._batches(keys, {k: _numel(self.table[k].local_shape) for k in keys}):
                out = torch.empty(size * b.numel, dtype=b.dtype, device=self._device)
                send = self._flat([self._local[k][0] for k in b.keys], b.dtype)
                pending.append((_all_gather(out, send, group=group, async_op=True), b, out, size, merge[expert]))
                self._count(chunk, label, b.dtype)
        self._wait([p[0] for p in pending], stream)
        for _, b, out, size, wanted in pending:
            if not wanted:
                continue
            rows = out.view(size, b.numel)
            for k, off, n in b.slices():
                info = self.table[k]
                have[k] = tp_merge([rows[r, off:off + n].view(info.local_shape) for r in range(size)], info.tp)

    def _round_ep(self, chunk: ChunkPlan, experts: list[ParamInfo], have: dict[str, torch.Tensor],
                  stream: Any) -> None:
        """Round 2: every expert-parallel rank's full local experts of the chunk -> all experts of the stage.
        Expert e's tensors sit in row e of the output, in the same order as on rank e (global expert ids)."""
        c, g = self.coords, self.groups
        numel = {i.name: _numel(i.shape) for i in experts}
        per_rank = [self._batches([i.name for i in experts if i.ep == e], numel) for e in range(g.ep_size)]
        mine = per_rank[c.ep]
        if any([b.numels for b in rb] != [b.numels for b in mine] for rb in per_rank):
            raise ValidationError(f"chunk {chunk.index}: expert-parallel ranks hold different expert shapes")
        pending = []
        for b in mine:
            out = torch.empty(g.ep_size * b.numel, dtype=b.dtype, device=self._device)
            send = self._flat([have[k] for k in b.keys], b.dtype)
            pending.append((_all_gather(out, send, group=g.ep, async_op=True), out))
            self._count(chunk, "ep", b.dtype)
        self._wait([p[0] for p in pending], stream)
        if not (c.leads() or self.every_rank_sends):
            return
        for j, (_, out) in enumerate(pending):
            rows = out.view(g.ep_size, mine[j].numel)
            for e in range(g.ep_size):
                for k, off, n in per_rank[e][j].slices():
                    have[k] = rows[e, off:off + n].view(self.table[k].shape)

    def _round_pp(self, chunk: ChunkPlan, infos: list[ParamInfo], have: dict[str, torch.Tensor],
                  stream: Any) -> None:
        """Round 3: each other stage's leader sends its part of the chunk to the sender, point to point in the
        pipeline group with group-local ranks. Floating tensors travel in the receiver's dtype, so float32
        norms and bf16 weights share one message."""
        c, g = self.coords, self.groups
        sender = dist.get_group_rank(g.pp, self._leaders[0])
        pending, recvs = [], []
        for s in sorted({i.stage for i in infos} - {0}):
            if c.pp not in (0, s):
                continue
            keys = [i.name for i in infos if i.stage == s]
            for tag, b in enumerate(self._batches(keys, {k: _numel(self.table[k].shape) for k in keys}, wire=True)):
                if c.pp == s:
                    send = self._flat([have[k] for k in b.keys], b.dtype)
                    pending.append(dist.isend(send, group=g.pp, group_dst=sender, tag=tag))
                else:
                    buf = torch.empty(b.numel, dtype=b.dtype, device=self._device)
                    src = dist.get_group_rank(g.pp, self._leaders[s])
                    pending.append(dist.irecv(buf, group=g.pp, group_src=src, tag=tag))
                    recvs.append((b, buf))
                self._count(chunk, f"pp{s}", b.dtype)
        self._wait(pending, stream)
        for b, buf in recvs:
            for k, off, n in b.slices():
                have[k] = buf[off:off + n].view(self.table[k].shape)

    def _wait(self, works: Sequence[Any], stream: Any) -> None:
        for w in works:
            if w is not None:
                w.wait()
        if stream is not None:  # NCCL's wait only orders streams: block this worker thread until done
            stream.synchronize()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _hf_get(hf_config: object, key: str) -> Any:
    if hf_config is None:
        return None
    if isinstance(hf_config, dict):
        return hf_config.get(key)
    return getattr(hf_config, key, None)


def _check_layout(name: str, r: Resolved, info: ParamInfo) -> None:
    """The table's TP layout must be the parameter's: else merged tensors would be silently scrambled."""
    if info.tp is not None and info.tp != r.mapping.tp:
        raise ValidationError(f"{name!r}: megatron splits it as {info.tp}, the {type(r.mapping).__name__} mapping "
                              f"expects {r.mapping.tp}")


