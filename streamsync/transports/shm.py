"""Colocated CPU transport: one POSIX shared-memory segment per chunk.

The sender creates the segment (pre-faulted with MAP_POPULATE), packs into it, hands its name to the
receivers, and unlinks it once every receiver acknowledged. The segment is also registered with
multiprocessing's resource tracker, so a crashed trainer does not leave it behind in /dev/shm.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import Any

import torch

from ..errors import TransportError, ValidationError
from ..sources.base import ChunkPlan
from .base import Receiver, SendBuffer, Transport

SHM_DIR = "/dev/shm"
PREFIX = "streamsync-"
_NAME = re.compile(r"^streamsync-[A-Za-z0-9_.-]{1,200}$")
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _map(path: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size < nbytes:
            raise TransportError(f"segment {path} holds {os.fstat(fd).st_size} bytes, chunk needs {nbytes}")
        return mmap.mmap(fd, nbytes, flags=_FLAGS)
    finally:
        os.close(fd)


class ShmTransport(Transport):
    name = "shm"

    def allocate(self, chunk: ChunkPlan, push_id: str) -> SendBuffer:
        seg = f"{PREFIX}{os.getpid()}-{push_id}-{chunk.index}-{secrets.token_hex(3)}"
        path = os.path.join(SHM_DIR, seg)
        try:
            mm = _map(path, chunk.nbytes, create=True)
        except OSError as e:
            raise TransportError(f"cannot create shared-memory segment of {chunk.nbytes} bytes: {e}") from e
        resource_tracker.register("/" + seg, "shared_memory")
        tensor = torch.frombuffer(mm, dtype=torch.uint8, count=chunk.nbytes)
        return SendBuffer(chunk.index, chunk.nbytes, tensor, {"name": seg, "nbytes": chunk.nbytes},
                          {"mmap": mm, "path": path, "seg": seg})

    def free(self, buf: SendBuffer) -> None:
        path = buf.state.pop("path", None)
        if path is None:
            return
        buf.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        resource_tracker.unregister("/" + buf.state["seg"], "shared_memory")
        mm = buf.state.pop("mmap")
        try:
            mm.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the mapping goes with it, the name is gone already


class ShmReceiver(Receiver):
    name = "shm"

    @contextmanager
    def open(self, update_info: dict[str, Any]) -> Iterator[torch.Tensor]:
        handle = update_info.get("handle")
        if not isinstance(handle, dict) or not isinstance(handle.get("name"), str):
            raise ValidationError(f"shm handle must be {{'name': str, 'nbytes': int}}, got {handle!r:.200}")
        name, nbytes = handle["name"], int(handle.get("nbytes", 0))
        if not _NAME.match(name):
            raise ValidationError(f"refusing shared-memory segment name {name!r}")
        try:
            mm = _map(os.path.join(SHM_DIR, name), nbytes, create=False)
        except FileNotFoundError:
            raise TransportError(f"shared-memory segment {name} does not exist (sender gone?)") from None
        tensor = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        try:
            yield tensor
        finally:
            del tensor
            try:
                mm.close()
            except BufferError:
                pass  # the loader kept a view; the mapping is released when it is collected
