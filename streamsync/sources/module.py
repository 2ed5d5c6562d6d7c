"""A plain `torch.nn.Module` (e.g. a Hugging Face model) whose state-dict names are already HF names."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import anyio
import torch

from ..errors import ValidationError
from ..pack import TensorSpec, align_up, dtype_name
from ..plan.chunk import ChunkPlan
from ..plan.chunking import Item, layer_index, order_key, plan_chunks, row_parts
from .base import AddressCache, Source


class ModuleSource(Source):
    """Streams `module.state_dict()`; tied tensors (one storage under two names) are sent once.

    `dtype` casts floating-point tensors to the receiver's dtype in the convert stage; by default tensors
    go as they are, so the receiver gets the trainer's bits.
    """

    def __init__(self, module: torch.nn.Module, *, dtype: torch.dtype | None = None,
                 include_tied: bool = False) -> None:
        self.module = module
        self.dtype = dtype
        self._tensors: dict[str, torch.Tensor] = {}
        self._addresses = AddressCache()
        seen: dict[tuple[int, int], str] = {}
        # Parameter objects are kept (detached at gather), so a later `param.data = ...` is still seen when
        # WeightSync reuses this source for the next push.
        for name, t in module.state_dict(keep_vars=True).items():
            if t.device.type == "meta":
                raise ValidationError(f"parameter {name!r} is on the meta device: it holds no data to send")
            dtype_name(t.dtype)  # unsupported dtypes fail here, before any byte moves
            key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (id(t), 0)
            if key in seen and not include_tied:
                continue  # tied weight (lm_head = embed_tokens): HF checkpoints keep one copy
            seen[key] = name
            self._tensors[name] = t
        if not self._tensors:
            raise ValidationError("the model has no parameters or buffers to push")
        devices = {t.device for t in self._tensors.values()}
        if len(devices) > 1:
            raise ValidationError(f"model tensors span several devices {sorted(map(str, devices))}")
        self._device = devices.pop()

    @property
    def device(self) -> torch.device:
        return self._device

    def local_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t.detach()) for n, t in self._tensors.items())

    def local_addresses(self, device: torch.device) -> set[int]:
        return self._addresses.get(list(self._tensors.values()), device)

    def _spec(self, name: str) -> TensorSpec:
        t = self._tensors[name]
        dtype = self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype
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
        out = []
        for k in chunk.keys:
            if isinstance(k, str):
                out.append(self._tensors[k].detach())
            else:  # (name, first row, end row)
                assert isinstance(k, tuple)
                out.append(self._tensors[k[0]].detach()[k[1]:k[2]])
        return out

    async def convert(self, chunk: ChunkPlan, gathered: object, *, cast: bool = True) -> Sequence[torch.Tensor]:
        tensors: list[torch.Tensor] = gathered  # type: ignore[assignment]
        if not cast or all(t.dtype == s.dtype for t, s in zip(tensors, chunk.specs, strict=True)):
            return tensors
        if self._device.type == "cpu":  # casting a chunk on CPU takes a while: keep it off the loop
            return await anyio.to_thread.run_sync(
                lambda: [t.to(s.dtype) for t, s in zip(tensors, chunk.specs, strict=True)])
        return [t.to(s.dtype) for t, s in zip(tensors, chunk.specs, strict=True)]
