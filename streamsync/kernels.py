"""A copy on a few SMs: packs that leave an NCCL broadcast its share of the GPU.

Seen on two H200s (a Qwen3-8B push over NCCL, 1 GiB chunks, session 5's trace): while broadcast i streams out of
GPU 0, the pack of chunk i+w runs as PyTorch copies, which take every SM and most of HBM's bandwidth for the
copy's ~0.5 ms, and the broadcast all but stops meanwhile. The broadcasts of the chunks packed in parallel took
2.65-2.8 ms each, those after the last pack 1.8-2.0 ms: the push ran at 78 % of a raw broadcast. A copy that
runs on `programs` persistent Triton programs (about as many SMs) takes longer but leaves the link's kernel
alone; it only has to keep ahead of the broadcasts, which move ~370 GB/s.

`copy_rows(dst, src, programs)` copies a tensor whose elements lie in evenly spaced contiguous rows (any
contiguous tensor; Q, K or V of a fused QKV; a row slice) into a flat destination, in row-major order, and says
False for anything else (the caller copies with PyTorch). Needs Triton and a CUDA tensor; `available()` says.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: element size -> the integer dtype the copy moves (one compiled kernel per width, whatever the float dtype)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BLOCK = 8192  # elements per program per step
_MAX_COLS = (1 << 31) - BLOCK  # int32 column offsets inside the kernel


@functools.cache
def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # not installed, or installed without a working backend
        return False
    return True


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Sizes that vary per tensor are not specialized on (each specialization is a ~1 s compile); `cols` and
    # `src_stride` are: divisible by 16 is what lets the loads and stores go 16 bytes at a time.
    @triton.jit(do_not_specialize=["n_tiles", "tiles_per_row", "programs"])
    def copy_rows_kernel(src, dst, cols, src_stride, n_tiles, tiles_per_row, programs, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        for t in range(pid, n_tiles, programs):
            r = t // tiles_per_row
            c0 = (t - r * tiles_per_row) * BLOCK
            offs = c0 + tl.arange(0, BLOCK)
            mask = offs < cols
            r64 = r.to(tl.int64)
            x = tl.load(src + r64 * src_stride + offs, mask=mask)
            tl.store(dst + r64 * cols + offs, x, mask=mask)

    return copy_rows_kernel


def rows_of(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, cols, row stride) in elements when `t`'s row-major elements are `rows` runs of `cols` contiguous
    elements, `row stride` apart; None otherwise."""
    if t.numel() == 0:
        return None
    dims = [(n, s) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1]
    if not dims:
        return (1, 1, 1) if t.numel() == 1 else None
    n, s = dims.pop()
    if s != 1:
        return None
    cols = n
    while dims and dims[-1][1] == cols:  # an outer dim continues the contiguous run
        cols *= dims.pop()[0]
    if not dims:
        return 1, cols, cols
    rows, stride = dims.pop()
    while dims and dims[-1][1] == stride * rows:  # outer dims continue the evenly spaced rows
        rows *= dims.pop()[0]
    if dims or stride < cols:
        return None
    return rows, cols, stride


def copy_rows(dst: torch.Tensor, src: torch.Tensor, programs: int) -> bool:
    """dst (flat bytes, contiguous) <- src's bytes in row-major order, queued on the current stream by a
    kernel of `programs` programs. False (nothing queued) where this copy does not apply: no Triton, not CUDA,
    a layout `rows_of` does not take, or a destination of another size."""
    if programs <= 0 or not src.is_cuda or src.device != dst.device or not available():
        return False
    item = src.element_size()
    if item not in _INT or dst.dtype != torch.uint8 or dst.dim() != 1 or dst.numel() != src.numel() * item:
        return False
    shape = rows_of(src)
    if shape is None:
        return False
    if shape[1] > _MAX_COLS:
        return False
    _launch(dst, src, shape, programs)
    return True


def _launch(dst: torch.Tensor, src: torch.Tensor, shape: tuple[int, int, int], programs: int) -> None:
    rows, cols, stride = shape
    it = _INT[src.element_size()]
    s = src.view(it) if src.dtype != it else src
    d = dst.view(it)
    tiles = -(-cols // BLOCK)
    n_tiles = rows * tiles
    grid = min(programs, n_tiles)
    _kernel()[(grid,)](s, d, cols, stride, n_tiles, tiles, grid, BLOCK=BLOCK, num_warps=8)


def warm(device: torch.device) -> None:
    """Compile the kernel for the usual widths before the first push needs it (a compile takes ~1 s)."""
    if not available() or device.type != "cuda":
        return
    with torch.cuda.device(device):
        for item in (2, 4):
            src = torch.zeros(4 * BLOCK, dtype=_INT[item], device=device)
            dst = torch.empty(src.numel() * item, dtype=torch.uint8, device=device)
            copy_rows(dst, src, 2)
        torch.cuda.current_stream().synchronize()
