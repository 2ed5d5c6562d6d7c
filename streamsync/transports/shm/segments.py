"""memfd shared-memory segments: made, mapped and closed (shared by both halves)."""

from __future__ import annotations

import mmap
import os
import re
import secrets
from dataclasses import dataclass

import torch

from ...errors import TransportError
from ..pool import PoolBuffer

MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

MEMFD_PREFIX = "streamsync-chunk-"

# torch's file-descriptor sharing names its files "/dev/shm/torch_{pid}_{random}_{n}" and unlinks them at once:
# a storage export must name nothing else, so a handle cannot make a receiver map another file of the sender.
TORCH_SHM_LINK = re.compile(r"^/dev/shm/torch_-?[0-9]{1,20}_-?[0-9]{1,20}_-?[0-9]{1,20} \(deleted\)$")

MAX_INT = 1 << 50


def close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still referenced; the mapping goes when it is collected


@dataclass(frozen=True)
class Segment:
    """What a pooled segment keeps alive with its memory: the memfd (the number receivers open through
    /proc/<pid>/fd) and the sender's mapping."""

    fd: int
    mm: mmap.mmap


def create_segment(size: int) -> PoolBuffer:
    token = secrets.token_hex(8)
    try:
        fd = os.memfd_create(f"{MEMFD_PREFIX}{token}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
    except OSError as e:
        raise TransportError(f"cannot create a shared-memory segment of {size} bytes: {e}") from e
    return PoolBuffer(torch.frombuffer(mm, dtype=torch.uint8, count=size), size, token, backing=Segment(fd, mm))


def destroy_segment(buf: PoolBuffer) -> None:
    seg: Segment = buf.backing
    close_map(seg.mm)  # the caller dropped the tensor view first
    os.close(seg.fd)
