"""`wsum64`: the checksum a delta's tensors are checked with, computed where the tensor lives.

For a tensor of n elements read as signed integers of its element width, w_0 .. w_{n-1}:

    H = sum_j w_j * (2 j + 1)   mod 2^64

Every weight is odd, so any one changed element changes H, and two values that traded places change it too
(their weights differ). It is linear, so it is no defence against a crafted collision; it is there to catch a
delta applied wrongly (a base that is not the sender's, a position off by one, a NaN that appears only once
applied). All arithmetic is int64, which wraps mod 2^64 on every device, so the order of the additions does not
change H. It is computed per block of BLOCK elements, as two sums a block, and the blocks are combined on the host:

    H = sum_b A_b + 2 BLOCK (b - b0) S_b,   A_b = sum_i w_i (2 i + 1),   S_b = sum_i w_i   (i within block b)

so a sender that lays a chunk's tensors out at BLOCK-aligned offsets gets every tensor's checksum from one pass
over the chunk (`block_sums`), and a receiver checks one tensor with `wsum64` alone: both give the same H.

On a GPU the blocks' sums are one Triton kernel (a program per block, reading each word once); elsewhere, or
where the kernel fails to build, torch's int64 products, 256 blocks per launch.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np
import torch

BLOCK = 1 << 16
INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROWS = 256  # blocks per launch: bounds the int64 temporaries to 128 MiB
_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_STEP = 4096  # words a kernel program reads per step
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # tests: the kernel on CPU tensors
_broken: list[str] = []  # why the kernel is not used (once it failed)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def block_sums_kernel(words, a_out, s_out, BLOCK: tl.constexpr, STEP: tl.constexpr):
        b = tl.program_id(0)
        base = b.to(tl.int64) * BLOCK
        acc_s = tl.zeros([STEP], dtype=tl.int64)
        acc_a = tl.zeros([STEP], dtype=tl.int64)
        for i in range(0, BLOCK, STEP):
            offs = i + tl.arange(0, STEP)
            w = tl.load(words + base + offs).to(tl.int64)
            acc_s += w
            acc_a += w * (2 * offs + 1).to(tl.int64)
        tl.store(s_out + b, tl.sum(acc_s, axis=0))
        tl.store(a_out + b, tl.sum(acc_a, axis=0))

    return block_sums_kernel


def _kernel_sums(grid: torch.Tensor) -> torch.Tensor | None:
    """(2, blocks) int64 on the device by the kernel; None where it does not run here."""
    if _broken or not (grid.is_cuda or _INTERPRET):
        return None
    try:
        out = torch.empty(2, grid.shape[0], dtype=torch.int64, device=grid.device)
        _kernel()[(grid.shape[0],)](grid, out[0], out[1], BLOCK=BLOCK, STEP=_STEP)
        return out
    except Exception as e:  # no Triton, or it cannot build here: torch's products instead
        _broken.append(f"{type(e).__name__}: {e}")
        logging.getLogger(__name__).warning("the wsum64 kernel is not used: %s", _broken[0])
        return None


def _weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.arange(1, 2 * BLOCK, 2, dtype=torch.int64, device=device)
    return w


def block_sums(words: torch.Tensor, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(A, S) of each block of `words`, a flat integer tensor of a whole number of blocks, as int64 arrays on
    the host (one sync). `rows`: only those blocks."""
    if words.dtype not in INT.values() or words.numel() % BLOCK:
        raise ValueError(f"block sums need integer words in whole blocks of {BLOCK}, got {words.dtype} "
                         f"x {words.numel()}")
    grid = words.view(-1, BLOCK)
    if rows is not None:
        grid = grid[rows]
    if grid.shape[0] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    fast = _kernel_sums(grid)
    if fast is not None:
        both = fast.cpu().numpy()
        return both[0], both[1]
    w = _weights(words.device)
    a, s = [], []
    for r in range(0, grid.shape[0], _ROWS):
        x = grid[r:r + _ROWS].to(torch.int64)
        s.append(x.sum(1))
        a.append((x * w).sum(1))  # not in place: int64 words are `words` itself
    both = torch.stack([torch.cat(a), torch.cat(s)]).cpu().numpy()
    return both[0], both[1]


def combine(a: np.ndarray, s: np.ndarray) -> int:
    """H of a tensor whose blocks' sums are `a`, `s` (its first block first)."""
    rel = np.arange(a.size, dtype=np.int64)
    with np.errstate(over="ignore"):
        h = (a + (2 * BLOCK) * rel * s).sum(dtype=np.int64)
    return int(h) & ((1 << 64) - 1)


def words_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat tensor of signed integers of its element width (a view where it can)."""
    flat = t.detach().contiguous().reshape(-1)
    try:
        return flat.view(INT[flat.element_size()])
    except KeyError:
        raise ValueError(f"no checksum for elements of {flat.element_size()} bytes ({t.dtype})") from None


def wsum64(t: torch.Tensor) -> int:
    """H of `t`, on its own device (one host sync, a few launches per 256 blocks)."""
    w = words_of(t)
    whole = w.numel() - w.numel() % BLOCK
    a, s = block_sums(w[:whole])
    if whole < w.numel():
        tail = torch.zeros(BLOCK, dtype=w.dtype, device=w.device)
        tail[:w.numel() - whole] = w[whole:]
        ta, ts = block_sums(tail)
        a, s = np.concatenate([a, ta]), np.concatenate([s, ts])
    return combine(a, s)
