"""Per-tensor checksums over raw bytes: equal checksums mean bit-identical tensors (dtype and shape too)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


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
