"""The throttled copy (streamsync.kernels): which layouts it takes, and its kernel run bit for bit.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, read when the kernel is defined: a fresh
process); on a GPU `test_gpu.py` runs it compiled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from streamsync import kernels


def test_rows_of_takes_evenly_spaced_contiguous_rows():
    fused = torch.zeros(8, 96, 64)  # a fused QKV: groups x (q, k, v rows) x hidden
    assert kernels.rows_of(fused) == (1, 8 * 96 * 64, 8 * 96 * 64)
    assert kernels.rows_of(fused[:, :64]) == (8, 64 * 64, 96 * 64)  # Q, blocked
    assert kernels.rows_of(fused[:, 80:96]) == (8, 16 * 64, 96 * 64)  # V
    assert kernels.rows_of(fused.view(-1, 64)[10:20]) == (1, 640, 640)  # a row slice
    assert kernels.rows_of(torch.zeros(5, 1, 7)[:, :, 2:5]) == (5, 3, 7)  # size-1 dims do not count
    assert kernels.rows_of(torch.zeros(1)) == (1, 1, 1)


@pytest.mark.parametrize("t", [torch.zeros(4, 4).t(), torch.zeros(4, 6)[:, ::2], torch.zeros(3, 4, 5)[:, 1:3, 1:4],
                               torch.zeros(0)])
def test_rows_of_refuses_what_is_not_rows(t):
    assert kernels.rows_of(t) is None


def test_copy_rows_declines_where_it_does_not_apply():
    src = torch.arange(64, dtype=torch.float32)
    dst = torch.zeros(256, dtype=torch.uint8)
    assert kernels.copy_rows(dst, src, 4) is False  # not CUDA: the caller copies with PyTorch
    assert torch.count_nonzero(dst) == 0


@pytest.mark.timeout(300)
def test_the_kernel_copies_bit_for_bit_in_the_interpreter():
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from streamsync import kernels
        g = torch.Generator().manual_seed(0)
        fused = torch.randn(4, 6 * 16, 64, generator=g).to(torch.bfloat16)
        cases = [fused[:, :64], fused[:, 64:80], fused.view(-1, 64)[7:300],
                 torch.randn(3 * kernels.BLOCK + 5, generator=g),  # several tiles, a ragged last one
                 torch.randn(3, 5000, generator=g)[:, :4097].to(torch.float16),
                 torch.arange(20000, dtype=torch.int64).view(2, 10000)]
        for t in cases:
            shape = kernels.rows_of(t)
            dst = torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8)
            kernels._launch(dst, t, shape, 3)  # three programs striding over the tiles
            assert torch.equal(dst, t.contiguous().view(-1).view(torch.uint8)), (t.shape, shape)
        print("copied", len(cases))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "copied 6" in out.stdout
