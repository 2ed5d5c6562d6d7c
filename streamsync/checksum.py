"""Per-tensor checksums over raw bytes: equal checksums mean bit-identical tensors (dtype and shape too)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from .pack import dtype_name


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    raw = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if raw.numel():
        h.update(raw.numpy().data)
    return h.hexdigest()


def digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: tensor_digest(t) for name, t in named}


def device_digest(t: torch.Tensor, block: int = 1 << 26) -> str:
    """A checksum of a tensor's raw bytes computed where it lives (no host copy of a 16 GB model).

    Two wrapping int64 sums over the bytes read as 32/16/8-bit words: the plain sum and one weighted by
    position (1 + i mod 1000003), so a flipped bit, a changed value or moved rows all change it. Integer
    sums are exact and order-independent, so the two sides agree bit for bit. dtype and shape are included.
    """
    t = t.detach()
    raw = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    words = raw
    for wd in (torch.int32, torch.int16):
        if raw.numel() % wd.itemsize == 0:
            try:
                words = raw.view(wd)
                break
            except RuntimeError:  # storage offset not aligned to the word size: try a smaller word
                pass
    s1 = torch.zeros((), dtype=torch.int64, device=t.device)
    s2 = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), block):
        w = words[start:start + block].to(torch.int64)
        idx = torch.arange(start, start + w.numel(), device=t.device, dtype=torch.int64)
        s1 += w.sum()
        s2 += (w * (idx % 1000003 + 1)).sum()
    return f"{dtype_name(t.dtype)}{tuple(t.shape)}:{int(s1)}:{int(s2)}"


def device_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: device_digest(t) for name, t in named}
