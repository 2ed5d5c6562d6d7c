"""A plain `torch.nn.Module` (e.g. a Hugging Face model) whose state-dict names are already HF names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import torch

from ..errors import ValidationError
from ..pack import TensorSpec, align_up, dtype_name
from ..plan.chunk import ChunkPlan
from ..plan.chunking import Item, layer_index, order_key, plan_chunks, row_parts
from ..plan.shards import Box, Shards
from .base import AddressCache, DetachedCache, Source


def _dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _one_rank(t: torch.Tensor) -> bool:
    """A DTensor on a mesh of one rank (FSDP2 or TP on one GPU): its local piece is the whole tensor."""
    return _dtensor(t) and t.device_mesh.size() == 1  # type: ignore[attr-defined]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece, read as the attribute it is kept in: `to_local()` is an autograd function call,
    tens of microseconds, and a push reads every tensor's piece to see whether it moved."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()  # type: ignore[attr-defined]


def _local_box(t: torch.Tensor) -> tuple[Box, torch.Tensor]:
    """The box of the full tensor this rank's piece of DTensor `t` is, and the piece (FSDP2 shards follow
    torch.chunk, so a trailing rank may hold fewer rows or none; TP+FSDP strided shards still give one box)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    return Box(tuple(int(o) for o in offset), tuple(int(n) for n in shape)), t.to_local()  # type: ignore[attr-defined]


def _fused_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, int, int]]:
    """transformers-5 MoE modules keep a layer's experts stacked (`mlp.experts.gate_up_proj` [E, 2I, H], gate
    rows first, and `mlp.experts.down_proj` [E, H, I]); checkpoints and engines name one tensor per expert
    (`mlp.experts.{e}.gate_proj.weight`, as `save_pretrained` writes them). {fused name: (per-expert name
    template, first row, end row)} for each stacked tensor whose pair has those shapes; anything else keeps
    its name (and an engine that does not know it refuses it)."""
    out: dict[str, tuple[str, int, int]] = {}
    for name, gu in tensors.items():
        if not name.endswith(".experts.gate_up_proj"):
            continue
        base = name[: -len("gate_up_proj")]
        down = tensors.get(base + "down_proj")
        if down is None or _dtensor(gu) or _dtensor(down) or gu.dim() != 3 or down.dim() != 3:
            continue
        (e, two_i, h), (e2, h2, i) = gu.shape, down.shape
        if e != e2 or h != h2 or two_i != 2 * i:
            continue
        out[name] = (base + "{e}.gate_proj.weight", 0, i)
        out[name + "\0up"] = (base + "{e}.up_proj.weight", i, two_i)
        out[base + "down_proj"] = (base + "{e}.down_proj.weight", 0, h)
    return out


class ModuleSource(Source):
    """Streams `module.state_dict()`; tied tensors (one storage under two names) are sent once.

    `dtype` casts floating-point tensors to the receiver's dtype in the convert stage (one dtype, or one per HF
    name); by default tensors go as they are, so the receiver gets the trainer's bits.

    Stacked experts of a transformers-5 MoE module (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) go
    as the checkpoint's per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, ...): views, no copy.

    DTensor parameters (FSDP2, tensor parallel DTensors): through a single sender, each tensor is gathered
    whole (`full_tensor()`, a collective of its mesh: every rank pushes, global rank 0 sends, the others take
    part in the gathers with `engines=[]`); through sharded sending (`transport="p2p"`) each rank sends its
    own piece (`shards`). A DTensor on a mesh of one rank (FSDP2 on one GPU) is its local piece: it goes as a
    plain tensor does, by reference where the transport sends references, with no gather.
    """

    def __init__(self, module: torch.nn.Module | Mapping[str, torch.Tensor], *,
                 dtype: torch.dtype | Mapping[str, torch.dtype] | None = None, include_tied: bool = False) -> None:
        self.module = module
        self.dtype = dtype
        self._tensors: dict[str, torch.Tensor] = {}
        self._addresses = AddressCache()
        self._detached = DetachedCache()
        # chunk index -> (its keys, the key of its tensors, the list gather made): `gather`
        self._gathered: dict[int, tuple[Sequence[object], tuple[list[Any], ...], list[torch.Tensor]]] = {}
        seen: dict[tuple[int, int], str] = {}
        # Parameter objects are kept (detached at gather), so a later `param.data = ...` is still seen when
        # WeightSync reuses this source for the next push.
        state: Mapping[str, Any] = module.state_dict(keep_vars=True) if isinstance(module, torch.nn.Module) else module
        for name, t in state.items():
            if t.device.type == "meta":
                raise ValidationError(f"parameter {name!r} is on the meta device: it holds no data to send")
            dtype_name(t.dtype)  # unsupported dtypes fail here, before any byte moves
            # A DTensor has no storage of its own (its data pointer is 0): tie by its local piece's.
            own = t.to_local() if _dtensor(t) else t
            key = (own.untyped_storage().data_ptr(), own.storage_offset()) if own.numel() else (id(t), 0)
            if key in seen and not include_tied:
                continue  # tied weight (lm_head = embed_tokens): HF checkpoints keep one copy
            seen[key] = name
            self._tensors[name] = t
        if not self._tensors:
            raise ValidationError("the model has no parameters or buffers to push")
        # a transformers model says what it is: its config's `architectures`, else its classes (FSDP2 makes a
        # subclass, `FSDPQwen3ForCausalLM`, of the model's own)
        named = getattr(getattr(module, "config", None), "architectures", None) or ()
        self.architectures = tuple(named) or tuple(
            c.__name__ for c in type(module).__mro__ if c.__name__.endswith("ForCausalLM"))
        # stacked experts -> per-expert views: (stacked tensor, its data pointer when the views were made, views)
        self._stacked: list[tuple[torch.Tensor, int, list[tuple[str, int, int, int]]]] = []
        fused = _fused_experts(self._tensors)
        if fused:
            for fkey, (template, r0, r1) in fused.items():
                src = self._tensors[fkey.split("\0")[0]]
                self._stacked.append((src, -1, [(template.format(e=e), e, r0, r1) for e in range(src.shape[0])]))
            renamed = {fkey.split("\0")[0] for fkey in fused}
            # the per-expert names take the stacked tensor's place in the module's order
            tensors: dict[str, torch.Tensor] = {}
            for name, t in self._tensors.items():
                if name not in renamed:
                    tensors[name] = t
                    continue
                for src, _, views in self._stacked:
                    if src is t:
                        tensors.update((n, t.detach()[e, r0:r1]) for n, e, r0, r1 in views)
            self._tensors = tensors
            self._fresh()
        #: DTensors on a mesh of one rank: their local pieces are the tensors (`_one_rank`)
        self._whole = {n for n, t in self._tensors.items() if _one_rank(t)}
        self._distributed = {n for n, t in self._tensors.items() if _dtensor(t)} - self._whole
        devices = {t.device for t in self._tensors.values()}
        if len(devices) > 1:
            raise ValidationError(f"model tensors span several devices {sorted(map(str, devices))}")
        self._device = devices.pop()

    @property
    def device(self) -> torch.device:
        return self._device

    def _fresh(self) -> None:
        """Per-expert views made again on a stacked tensor whose data moved (`param.data = ...` after an
        optimizer swapped it): a view made before would read the old memory."""
        for i, (src, ptr, views) in enumerate(self._stacked):
            now = src.data_ptr()
            if now != ptr:
                data = src.detach()
                for n, e, r0, r1 in views:
                    self._tensors[n] = data[e, r0:r1]
                self._stacked[i] = (src, now, views)

    def _own(self, name: str) -> torch.Tensor:
        """This rank's data of a tensor: its local piece for a DTensor."""
        t = self._tensors[name].detach()
        return t.to_local() if name in self._distributed or name in self._whole else t  # type: ignore[attr-defined]

    def _current(self) -> list[torch.Tensor]:
        """Every tensor as a push reads it now: a one-rank DTensor's local piece (which moves when FSDP2
        reallocates it, the DTensor object staying), else the tensor."""
        if not self._whole:
            return list(self._tensors.values())
        return [_local(t) if n in self._whole else t for n, t in self._tensors.items()]

    def local_tensors(self) -> Sequence[tuple[str, torch.Tensor]]:
        self._fresh()
        if self._distributed:  # a DTensor's local piece is asked for each time
            return [(n, self._own(n)) for n in self._tensors]
        return self._detached.get(list(self._tensors), self._current(), lambda _, t: t.detach())

    def local_addresses(self, device: torch.device) -> set[int]:
        if self._distributed:  # pieces of gathered tensors are never sent by reference
            return set()
        self._fresh()
        return self._addresses.get(self._current(), device)

    @property
    def gathers_here(self) -> bool:
        return not self._distributed

    @property
    def is_sender(self) -> bool:
        """With DTensors, global rank 0 sends what every rank's gathers bring together."""
        if not self._distributed:
            return True
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0

    def shards(self) -> Shards:
        """This rank's tensors: whole, or for a DTensor the box of its local piece (replicas, e.g. DDP ranks or
        a Replicate mesh axis, declare the same boxes: the planner spreads their sends)."""
        holds: list[tuple[str, Box]] = []
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, t in self._tensors.items():
            spec = self._spec(name)
            tensors[name] = (dtype_name(spec.dtype), spec.shape)
            box = _local_box(t)[0] if name in self._distributed else Box.whole(spec.shape)
            if box.numel:
                holds.append((name, box))
        boxes = dict(holds)

        def local(name: str, box: Box) -> torch.Tensor:
            mine = boxes[name]
            return Box(tuple(a - b for a, b in zip(box.start, mine.start, strict=True)), box.size).view(self._own(name))

        return Shards(tuple(holds), tensors, local)

    def _spec(self, name: str) -> TensorSpec:
        t = self._tensors[name]
        want = self.dtype.get(name) if isinstance(self.dtype, Mapping) else self.dtype
        dtype = want if (want is not None and t.is_floating_point()) else t.dtype
        return TensorSpec(name, dtype, tuple(t.shape))

    def plan(self, chunk_bytes: int, *, ref_bytes: int | None = None) -> list[ChunkPlan]:
        """Keys are names, or (name, row0, row1) for the parts of a tensor larger than `chunk_bytes`, which is
        split by rows so that every chunk (its aligned layout) fits the budget.

        `ref_bytes`: the transport sends plain views of the model's tensors by reference (one copy: CUDA IPC, or
        shared memory on CPU); those tensors (every tensor that is not cast) fill this budget per chunk instead
        (see `plan_chunks`)."""
        # Stable: module order within a layer, except that a layer's expert down projections follow all of
        # its gate/up projections, so they lie as an engine's stacked w13 and w2 (`pack.fuse_layout`).
        names = sorted(self._tensors, key=lambda n: (order_key(n), ".down_proj." in n and ".experts." in n))
        items: list[Item] = []
        specs: dict[object, TensorSpec] = {}
        for n in names:
            spec = self._spec(n)
            unit = layer_index(n) if layer_index(n) is not None else n
            ref = (ref_bytes is not None and self._tensors[n].device.type in ("cuda", "cpu")
                   and self._tensors[n].dtype == spec.dtype)
            parts = row_parts(spec.shape, spec.dtype.itemsize, ref_bytes if ref and ref_bytes else chunk_bytes)
            if len(parts) == 1:
                specs[n] = spec
                items.append(Item(n, align_up(spec.nbytes), unit, ref=ref))
                continue
            for r0, r1 in parts:
                key = (n, r0, r1)
                specs[key] = TensorSpec(n, spec.dtype, (r1 - r0, *spec.shape[1:]), part=(r0, spec.shape[0]))
                items.append(Item(key, align_up(specs[key].nbytes), unit, ref=ref))
        return [ChunkPlan(i, tuple(specs[k] for k in keys), tuple(keys))
                for i, keys in enumerate(plan_chunks(items, chunk_bytes, ref_bytes))]

    async def gather(self, chunk: ChunkPlan) -> list[torch.Tensor]:
        # A part is a view of its rows: contiguous for a contiguous tensor, no copy.
        if self._distributed:
            return await anyio.to_thread.run_sync(self._gather_distributed, chunk, abandon_on_cancel=True)
        self._fresh()
        # The same list comes back while every tensor of the chunk keeps its address, size, shape, dtype and
        # contiguity (checked each push), as a megatron source's does: an MoE chunk has thousands of tensors,
        # making new tensor objects for them was most of the push's host time, and transports key their
        # per-chunk caches on the list.
        names = [k if isinstance(k, str) else k[0] for k in chunk.keys]  # type: ignore[index]
        ts = ([_local(self._tensors[n]) if n in self._whole else self._tensors[n] for n in names] if self._whole
              else [self._tensors[n] for n in names])
        T = torch.Tensor
        key = (list(map(T.data_ptr, ts)), list(map(T.numel, ts)), [t.shape for t in ts], [t.dtype for t in ts],
               list(map(T.is_contiguous, ts)))
        hit = self._gathered.get(chunk.index)
        if hit is not None and hit[0] == chunk.keys and hit[1] == key:
            return hit[2]
        out = []
        for k, t in zip(chunk.keys, ts, strict=True):
            if isinstance(k, str):
                out.append(t.detach())
            else:  # (name, first row, end row)
                assert isinstance(k, tuple)
                out.append(t.detach()[k[1]:k[2]])
        self._gathered[chunk.index] = (chunk.keys, key, out)
        return out

    def _gather_distributed(self, chunk: ChunkPlan) -> list[torch.Tensor]:
        """Every DTensor of the chunk made whole (on every rank, in plan order: the gathers are collectives);
        the parts of one tensor split across chunks gather it once per chunk."""
        out = []
        whole: dict[str, torch.Tensor] = {}
        for k in chunk.keys:
            name = k if isinstance(k, str) else k[0]  # type: ignore[index]
            t = self._tensors[name].detach()
            if name in self._distributed:
                if name not in whole:
                    whole[name] = t.full_tensor()  # type: ignore[attr-defined]
                t = whole[name]
            out.append(t if isinstance(k, str) else t[k[1]:k[2]])  # type: ignore[index]
        return out

    async def convert(self, chunk: ChunkPlan, gathered: object, *, cast: bool = True) -> Sequence[torch.Tensor]:
        tensors: list[torch.Tensor] = gathered  # type: ignore[assignment]
        if not cast or all(t.dtype == s.dtype for t, s in zip(tensors, chunk.specs, strict=True)):
            return tensors
        if self._device.type == "cpu":  # casting a chunk on CPU takes a while: keep it off the loop
            return await anyio.to_thread.run_sync(
                lambda: [t.to(s.dtype) for t, s in zip(tensors, chunk.specs, strict=True)])
        return [t.to(s.dtype) for t, s in zip(tensors, chunk.specs, strict=True)]
