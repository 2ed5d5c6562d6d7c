"""The CUDA IPC receiving half (inside an engine worker)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...cache import BoundedCache
from ...errors import TransportError, ValidationError
from ...pack import Layout, TensorMeta, unpack
from ..base import Receiver
from ..refs import ReferenceViews
from . import driver as cuda_driver
from .handle import UUID_RE, IpcHandle, live_tokens, local_index, parse_handle, refuse_same_process


@dataclass
class _Mapped:
    """An opened export: the buffer, its release event (if the sender sent one), and the raw handle data
    it was validated from (a later chunk with identical data skips the full validation)."""

    tensor: torch.Tensor
    release: torch.cuda.Event | None
    ready: torch.cuda.Event | None
    raw: dict[str, Any]
    # per layout: the chunk's views, made once (a chunking that keeps changing starts them over)
    views: BoundedCache[Layout, list[tuple[str, torch.Tensor]]] = field(default_factory=lambda: BoundedCache(64))


def _warm_copies(device: torch.device) -> None:
    """Run each kind of copy a load uses once, on tiny tensors: CUDA loads a kernel on its first use (a few ms
    each), and a first push would otherwise pay that inside its copies. Done while connecting."""
    with torch.cuda.device(device):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            a = torch.zeros(4, 2, 8, dtype=dt, device="cuda")
            b = torch.ones(2, 4, 8, dtype=dt, device="cuda")
            a.copy_(b.transpose(0, 1))  # strided (Q, K, V views of a fused QKV)
            a[0].copy_(b[0, :2], non_blocking=True)  # contiguous
            torch._foreach_copy_([a[1], a[2]], [b[1, :2], b[0, 2:]], non_blocking=True)  # batched small tensors
            a.copy_(b.float().transpose(0, 1))  # cast
        torch.cuda.current_stream().synchronize()


class CudaIpcReceiver(Receiver):
    name: ClassVar[str] = "cuda_ipc"
    orders_on_device: ClassVar[bool] = True

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cuda") -> None:
        super().__init__(init_info, device)
        refuse_same_process(init_info)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise TransportError(f"the cuda_ipc receiver needs a CUDA device, got {self.device}")
        _warm_copies(self.device)
        self._maps: dict[str, _Mapped] = {}
        self._open: _Mapped | None = None
        self.refs = ReferenceViews(self.name, self._map_storage)

    def ref_views(self, update_info: dict[str, Any], in_round: bool = True) -> list[tuple[TensorMeta, torch.Tensor]]:
        return self.refs.views(update_info, in_round)

    def stats(self) -> dict[str, float]:
        return {"map_storages": self.refs.map_seconds}

    def _map_storage(self, token: str, raw: dict[str, Any]) -> torch.Tensor:
        # No export event to wait on: the chunk's ready event, which every update waits for before its loads,
        # already orders these reads after the trainer's writes (it is recorded after the producer's stream).
        if raw.get("driver") == 1:
            gpu = raw.get("gpu")
            if not isinstance(gpu, str) or not UUID_RE.match(gpu):
                raise ValidationError(f"cuda_ipc storage {token}: gpu must be a device UUID, got {gpu!r:.80}")
            return cuda_driver.map_storage(raw, local_index(gpu), token)
        return self._rebuild(parse_handle({"token": token, "nbytes": 0, "ipc": raw}), event=False)

    def _rebuild(self, h: IpcHandle, event: bool = True) -> torch.Tensor:
        """Open an export. `event`: make the current stream wait on the export's event (opening that event
        costs about as much as mapping the memory)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = local_index(h.gpu)
        with torch.cuda.device(index):
            try:
                t = rebuild_cuda_tensor(
                    torch.Tensor, torch.Size([h.size]), (1,), h.tensor_offset, torch.UntypedStorage, torch.uint8,
                    index, h.handle, h.storage_size, h.storage_offset, False, h.ref_counter, h.ref_counter_offset,
                    h.event, h.event_sync and event)
            except RuntimeError as e:
                raise TransportError(f"cannot open CUDA IPC handle of buffer {h.token}: {e}") from e
        if t.numel() != h.size or t.dtype != torch.uint8:
            raise TransportError(f"CUDA IPC buffer {h.token} rebuilt as {t.dtype}[{t.numel()}], expected "
                                 f"uint8[{h.size}]")
        return t

    def _map(self, raw: dict[str, Any]) -> tuple[_Mapped, int, tuple[str, ...] | None]:
        """The mapping a handle names, opening it the first time; (mapping, chunk bytes, live tokens)."""
        token = raw.get("token")
        m = self._maps.get(token) if isinstance(token, str) else None
        if m is not None and raw.get("ipc") == m.raw:  # an export validated before: check the per-chunk fields
            nbytes = raw.get("nbytes")
            if type(nbytes) is not int or not 0 <= nbytes <= m.tensor.numel():
                raise ValidationError(f"cuda_ipc chunk size {nbytes!r:.40} does not fit buffer {token}")
            return m, nbytes, live_tokens(raw)
        h = parse_handle(raw)
        if m is not None:  # same token, different export data: never sent by a well-behaved sender
            raise ValidationError(f"cuda_ipc buffer {h.token} changed its export data")
        tensor = self._rebuild(h)
        events: list[torch.cuda.Event | None] = []
        for handle in (h.release_event, h.ready_event):
            try:
                events.append(None if handle is None else torch.cuda.Event.from_ipc_handle(tensor.device, handle))
            except RuntimeError as e:
                raise TransportError(f"cannot open an IPC event of buffer {h.token}: {e}") from e
        m = self._maps[h.token] = _Mapped(tensor, events[0], events[1], dict(raw["ipc"]))
        return m, h.nbytes, h.live

    def _forget(self, live: tuple[str, ...] | None) -> None:
        if live is None:
            return
        gone = [t for t in self._maps if t not in live]
        if gone:
            self._synchronize()  # copies out of those buffers may still be queued
            for token in gone:
                del self._maps[token]  # torch releases the mapping and its share of the sender's count

    def _devices(self) -> set[torch.device]:
        devs = {m.tensor.device for m in self._maps.values()}
        if self.device.index is not None:
            devs.add(self.device)
        return devs

    def _synchronize(self) -> None:
        for d in self._devices():
            torch.cuda.current_stream(d).synchronize()

    @contextmanager
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> Iterator[torch.Tensor]:
        raw = update_info.get("handle")
        if not isinstance(raw, dict):
            raise ValidationError(f"cuda_ipc handle must be {{token, nbytes, ipc, live}}, got {raw!r:.200}")
        m, nbytes, live = self._map(raw)
        self._forget(live)
        buf = m.tensor
        try:
            self._open = m
            if m.ready is not None:  # the sender's copies into this chunk come first (on the device)
                torch.cuda.current_stream(buf.device).wait_event(m.ready)
            yield buf[:nbytes]
        finally:
            # The ack. The loader's copies were queued on the current stream. With a release event the
            # sender's next pack into this buffer waits for them on the device; without, wait here.
            stream = torch.cuda.current_stream(buf.device)
            self._open = None
            if m.release is not None and self.device.index in (None, buf.device.index):
                m.release.record(stream)
            if m.release is None or self.device.index not in (None, buf.device.index):
                self._synchronize()

    def views(self, buf: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
        """The chunk's views, made once per (mapped buffer, layout) and kept with the mapping: a later push
        of the same plan unpacks nothing. They go when the mapping goes (views hold the memory)."""
        m = self._open
        if m is None or buf.data_ptr() != m.tensor.data_ptr():
            return list(unpack(buf, layout))
        views = m.views.get(layout)
        if views is None:
            views = m.views[layout] = list(unpack(m.tensor, layout))
        return views

    def end_round(self) -> None:
        """Before a round's end is acknowledged, every queued copy into the parameters has finished. Trainer
        storages this round did not reference are unmapped (the sender frees or reuses them once we let go)."""
        self._synchronize()
        self.refs.end_round()

    @property
    def mapped(self) -> int:
        """Buffers this receiver holds open."""
        return len(self._maps)

    def close(self) -> None:
        self._synchronize()
        self._maps.clear()
        self.refs.clear()
