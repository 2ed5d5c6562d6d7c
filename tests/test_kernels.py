"""The segment copy (streamsync.receiver.kernels): which copies become byte runs, and its kernel run bit for bit.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, read when the module is imported: a fresh
process); on a GPU `test_kernels.py` and `test_cuda_ipc.py` run it compiled, inside the receiver's captured loads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from streamsync.receiver import kernels


def test_rows_of_takes_evenly_spaced_contiguous_rows():
    fused = torch.zeros(8, 96, 64)  # a fused QKV: groups x (q, k, v rows) x hidden
    assert kernels.rows_of(fused) == (1, 8 * 96 * 64, 8 * 96 * 64)
    assert kernels.rows_of(fused[:, :64]) == (8, 64 * 64, 96 * 64)  # Q, blocked
    assert kernels.rows_of(fused[:, 80:96]) == (8, 16 * 64, 96 * 64)  # V
    assert kernels.rows_of(fused.view(-1, 64)[10:20]) == (1, 640, 640)  # a row slice
    assert kernels.rows_of(torch.zeros(5, 1, 7)[:, :, 2:5]) == (5, 3, 7)  # size-1 dims do not count


@pytest.mark.parametrize("t", [torch.zeros(4, 4).t(), torch.zeros(4, 6)[:, ::2], torch.zeros(3, 4, 5)[:, 1:3, 1:4],
                               torch.zeros(0)])
def test_rows_of_refuses_what_is_not_rows(t):
    assert kernels.rows_of(t) is None


def test_runs_pair_up_source_and_destination_rows_and_merge_what_continues():
    fused = torch.zeros(4, 96, 64, dtype=torch.bfloat16)
    q = fused[:, :64]
    dst = torch.zeros(4, 64, 64, dtype=torch.bfloat16)
    r = kernels.runs(dst, q)
    row = 64 * 64 * 2
    assert r == [(dst.data_ptr() + i * row, fused.data_ptr() + i * 96 * 64 * 2, row) for i in range(4)]
    flat = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert kernels.runs(flat, fused.view(-1, 64)[:8]) == [(flat.data_ptr(), fused.data_ptr(), 8 * 64 * 2)]


@pytest.mark.parametrize(("dst", "src", "why"), [
    (torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16), "a cast"),
    (torch.zeros(4, 8), torch.zeros(8, 4), "another shape"),
    (torch.zeros(7), torch.zeros(7), "28 bytes: not whole 16-byte accesses"),
    (torch.zeros(9)[1:], torch.zeros(8), "a destination 4 bytes off alignment"),
    (torch.zeros(8, 8), torch.zeros(8, 8).t(), "a transpose"),
])
def test_runs_decline_what_the_kernel_cannot_copy(dst, src, why):
    assert kernels.runs(dst, src) is None, why


def test_off_gpu_every_copy_is_pytorchs():
    src = [torch.arange(64, dtype=torch.float32), torch.ones(16, 8)]
    dst = [torch.zeros(64), torch.zeros(16, 8)]
    copy = kernels.SegmentCopy(dst, src)
    assert copy.runs == 0 and len(copy.rest) == 2
    copy()
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


@pytest.mark.timeout(300)
def test_the_kernel_copies_bit_for_bit_in_the_interpreter():
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from streamsync.receiver import kernels
        g = torch.Generator().manual_seed(0)
        fused = torch.randn(4, 6 * 16, 64, generator=g).to(torch.bfloat16)
        big = torch.randn(3, kernels.TILE, generator=g)  # runs of several tiles, and a ragged last tile
        srcs = [fused[:, :64], fused[:, 64:80], fused.view(-1, 64)[8:296], big, big[1, :-4],
                torch.randn(7, generator=g), torch.randn(16, 8, generator=g).t(), torch.randn(4, 24, generator=g),
                torch.randn(4, 24, generator=g)]
        dsts = [torch.zeros(t.shape, dtype=t.dtype) for t in srcs]
        dsts[7] = torch.zeros(8, 24)[::2]  # destination rows with gaps between them
        dsts[8] = torch.zeros(4, 24, dtype=torch.bfloat16)  # a cast: PyTorch's copy
        copy = kernels.SegmentCopy(dsts, srcs, programs=3)  # three programs striding over the tiles
        assert len(copy.rest) == 3, len(copy.rest)  # 28 bytes, a transpose, a cast
        copy()
        for d, s in zip(dsts, srcs):
            assert torch.equal(d, s.to(d.dtype)), (d.shape, s.shape)
        for d in dsts:  # a second call (as a graph replays) after the sources changed
            d.zero_()
        for s in srcs:
            s.add_(1)
        copy()
        assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dsts, srcs))
        print("copied", len(dsts), "runs", copy.runs)
    """)
    assert "copied 9" in _run_fresh(code)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_segment_copy_kernel_is_bit_exact_compiled_and_replayed_from_a_graph():
    # The layouts a receiver's load copies (Q/K/V blocks of a fused QKV, row slices, whole tensors, runs of many
    # tiles), with the ones it declines (a cast, a transpose, 28 bytes) beside them; then captured and replayed
    # after every source changed, as a captured load is.
    from streamsync.receiver import kernels

    if not kernels.available():
        pytest.skip("no Triton here")
    g = torch.Generator(device="cuda").manual_seed(0)
    fused = torch.randn(8, 96, 256, device="cuda", generator=g).to(torch.bfloat16)
    big = torch.randn(5, kernels.TILE + 8, device="cuda", generator=g)
    srcs = [fused[:, :64], fused[:, 64:80], fused.view(-1, 256)[8:296], big, big[2, :-4], fused.view(-1)[:7],
            torch.randn(64, 8, device="cuda", generator=g).t(), torch.randn(4, 24, device="cuda", generator=g)]
    dsts = [torch.zeros(t.shape, dtype=t.dtype, device="cuda") for t in srcs]
    dsts[-1] = torch.zeros(4, 24, dtype=torch.bfloat16, device="cuda")
    copy = kernels.SegmentCopy(dsts, srcs)
    assert copy.runs >= 8 + 5 and len(copy.rest) == 3
    copy()
    torch.cuda.synchronize()
    assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dsts, srcs, strict=True))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        copy()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    for step in range(3):
        for d in dsts:
            d.zero_()
        for s in srcs:
            s.add_(step + 1)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dsts, srcs, strict=True)), step


_FINITE = """
    import torch
    from streamsync.plan.finite import nonfinite, self_check, TILE
    assert self_check(torch.device(DEV))  # the check a device's first push runs before it trusts the kernel
    torch.manual_seed(0)
    sizes = torch.randint(1, 700, (60,)).tolist()
    named = [(f"w{i}", torch.randn(n, device=DEV).to([torch.bfloat16, torch.float16, torch.float32][i % 3]))
             for i, n in enumerate(sizes)]
    buf = torch.randn(TILE + 9, device=DEV).to(torch.bfloat16)  # views into one flat buffer
    named += [(f"v{j}", buf[a:b]) for j, (a, b) in enumerate([(1, 7), (7, 4000), (4001, 4002), (4002, TILE + 9)])]
    # the largest finite values, subnormals and -0.0 are finite: only an exponent of all ones is flagged
    edge = [(f"edge-{dt}", torch.tensor([torch.finfo(dt).max, -torch.finfo(dt).max, torch.finfo(dt).tiny / 4,
                                         -0.0, 0.0], dtype=dt, device=DEV)) for dt in (torch.bfloat16, torch.float16,
                                                                                    torch.float32)]
    named += edge
    assert nonfinite(named) == [], nonfinite(named)
    with torch.no_grad():
        named[5][1][-1] = float("nan")
        named[31][1][0] = float("inf")
        named[59][1][len(named[59][1]) // 2] = -float("inf")
        buf[4001] = float("nan")
        buf[TILE + 8] = -float("inf")
    want = ["w5", "w31", "w59", "v2", "v3"]
    assert nonfinite(named) == want, nonfinite(named)
    assert nonfinite(named, kernel=False) == want
    assert nonfinite(named) == want  # the kept tile table, a second time
    moved = named[0][1].clone()  # a tensor replaced by one elsewhere: the table is made again, not misread
    moved[-1] = float("inf")
    named[0] = ("w0", moved)
    assert nonfinite(named) == ["w0", *want], nonfinite(named)
    print("found", len(want))
"""


@pytest.mark.timeout(300)
def test_the_finite_check_kernel_flags_exactly_inf_and_nan_in_the_interpreter():
    # Every dtype it takes, tensors of any length at aligned and unaligned addresses (views into one buffer), a
    # view spanning several tiles, and the extreme finite values it must pass.
    pytest.importorskip("triton")
    assert "found 5" in _run_fresh("DEV = 'cpu'\n" + textwrap.dedent(_FINITE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_finite_check_kernel_flags_exactly_inf_and_nan_compiled():
    pytest.importorskip("triton")
    assert "found 5" in _run_fresh("DEV = 'cuda'\n" + textwrap.dedent(_FINITE), interpret=False)


def _run_fresh(code: str, interpret: bool = True) -> str:
    """Run `code` in a fresh Python (Triton reads TRITON_INTERPRET at import); its stdout, once it exited 0."""
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpret else None
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fp8_expert_kernel_quantizes_as_torchs_reference_arithmetic():
    """`vllm.worker.quant.quantize_experts` on CUDA (its Triton kernel) against its torch passes (the arithmetic checked
    against vLLM's `scaled_fp8_quant`): an all-zero expert, values on e4m3's rounding ties, ordinary weights."""
    pytest.importorskip("triton")
    from streamsync.vllm.worker import quant

    torch.manual_seed(0)
    w = (torch.randn(6, 256, 1000, device="cuda") * 0.02).bfloat16()
    w[1] = 0
    w[2, 0, 0] = 448.0  # scale 1: the rest of the expert is cast as it is, ties included
    w[2, 1, :8] = torch.tensor([42.0, 44.0, 46.0, 9.0, 9.5, -13.0, -0.0068359375, 300.0])
    w[3] *= 1e4
    got_q, want_q = (torch.empty(w.shape, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2))
    got_s, want_s = torch.full((8,), -1.0, device="cuda"), torch.full((8,), -1.0, device="cuda")
    quant.quantize_experts(w, got_q, got_s)
    quant.quantize_experts(w, want_q, want_s, kernel=False)
    assert not quant._broken, quant._broken
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_paired_runs_walk_two_layouts_of_different_dtypes_in_step():
    """`kernels.paired_runs`: Q of an interleaved bf16 QKV (a blocked view, a run per group) against its rows of a
    contiguous fp8 weight; then rows of 33 elements at two strides. Addresses in bytes, each side its own size."""
    inter = torch.zeros(4, 32, 64, dtype=torch.bfloat16)
    out = torch.empty(64, 64, dtype=torch.float8_e4m3fn)
    cols, starts = kernels.paired_runs(inter[:, :16], out.view(4, 16, 64))
    got = list(starts)
    assert cols == 16 * 64 and len(got) == 4
    assert [(s - inter.data_ptr(), d - out.data_ptr()) for s, d in got] == [(g * 32 * 64 * 2, g * 16 * 64)
                                                                           for g in range(4)]
    a, b = torch.zeros(6, 33), torch.zeros(6, 40)[:, :33]
    cols, starts = kernels.paired_runs(a, b)
    assert cols == 33 and [(x - a.data_ptr(), y - b.data_ptr()) for x, y in starts] == [(r * 132, r * 160)
                                                                                        for r in range(6)]
    assert kernels.paired_runs(torch.zeros(4, 4).t(), torch.zeros(4, 4)) is None  # not rows of contiguous elements


def _sourced_pieces() -> tuple[list[tuple[torch.Tensor, torch.Tensor, int]], list[torch.Tensor]]:
    """fp8 pieces of four weights in the layouts a push brings: megatron's interleaved QKV (Q, K and V as
    (groups, rows, cols) views into a contiguous fp8 weight), a weight of rows longer than a table row (SEG is
    set small by the callers), destination rows with gaps between them, and a source one element off 16 bytes."""
    g = torch.Generator().manual_seed(5)
    inter = (torch.randn(4, 32, 64, generator=g) * 0.05).to(torch.bfloat16)  # 4 groups: 16 Q, 8 K, 8 V rows
    qkv = torch.empty(128, 64, dtype=torch.float8_e4m3fn)
    long = (torch.randn(3, 5000, generator=g) * torch.tensor([[1.0], [3.0], [0.5]])).to(torch.bfloat16)
    gappy = torch.empty(6, 80, dtype=torch.float8_e4m3fn)
    rows_src = torch.randn(6, 48, generator=g).to(torch.bfloat16)
    odd = torch.randn(1 + 40 * 16, generator=g).to(torch.bfloat16)
    pieces = [(inter[:, :16], qkv[:64].view(4, 16, 64), 0), (inter[:, 16:24], qkv[64:96].view(4, 8, 64), 0),
              (inter[:, 24:], qkv[96:].view(4, 8, 64), 0), (long, torch.empty(3, 5000, dtype=torch.float8_e4m3fn), 1),
              (rows_src, gappy[:, 16:64], 2), (odd[1:].view(40, 16), torch.empty(40, 16, dtype=torch.float8_e4m3fn), 3)]
    return pieces, [torch.empty(1) for _ in range(4)]


def test_the_sourced_fp8_table_lists_every_run_of_every_piece(monkeypatch):
    """`vllm.worker.quant.sourced_table` (numpy) against the runs `kernels.paired_runs` walks one by one: the same
    rows (runs longer than SEG cut into rows of SEG), the longest row, and 16-byte alignment only where every run
    has it."""
    from streamsync.vllm.worker import quant

    monkeypatch.setattr(quant, "SEG", 1024)
    pieces, _ = _sourced_pieces()
    sb, db = pieces[0][0].data_ptr(), pieces[0][1].data_ptr()
    want = []
    for src, dst, j in pieces:
        cols, starts = kernels.paired_runs(src, dst)
        for s, d in starts:
            so, do = (s - sb) // 2, d - db
            want += [(so + k, do + k, min(1024, cols - k), j) for k in range(0, cols, 1024)]
    rows, aligned, longest = quant.sourced_table(pieces)
    assert rows.dtype.name == "int64" and [tuple(r) for r in rows.tolist()] == want
    assert longest == 1024 and not aligned  # the odd source is 2 bytes off
    rows, aligned, longest = quant.sourced_table(pieces[:3])
    assert aligned and longest == 16 * 64 and len(rows) == 12  # QKV: a run per group and projection
    assert quant.sourced_table([(torch.zeros(4, 4).t().bfloat16(), torch.empty(4, 4, dtype=torch.float8_e4m3fn), 0)]
                               ) is None  # a transpose is not rows of contiguous elements


@pytest.mark.timeout(300)
def test_the_sourced_fp8_kernels_read_and_write_every_layout_as_its_contiguous_copy_in_the_interpreter():
    """The sourced kernels (`quant.launch_sourced`) over the pushed layouts give the same scales and fp8 bytes as
    over contiguous copies of the same weights, with runs cut into several table rows. (Triton's interpreter
    rounds to fp8 its own way, so the bytes are compared with its own result; on CUDA `test_fp8_experts` and
    the fp8 GPU tests compare them with torch's and vLLM's.)"""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        import tests.test_kernels as t
        from streamsync.vllm.worker import quant
        quant.SEG = 1024
        def run(pieces):
            rows, aligned, longest = quant.sourced_table(pieces)
            return quant.launch_sourced(pieces[0][0], pieces[0][1], torch.from_numpy(rows), aligned, longest, 4)
        pieces, _ = t._sourced_pieces()
        flat = [(s.contiguous(), torch.empty(s.shape, dtype=torch.float8_e4m3fn), j) for s, _, j in pieces]
        got, want = run(pieces), run(flat)
        assert torch.equal(got, want), (got, want)
        for (_, d, _), (_, f, _) in zip(pieces, flat):
            assert torch.equal(d.view(torch.uint8), f.view(torch.uint8))
        ref = [torch.empty(1) for _ in range(4)]
        quant.quantize_sourced([(s, torch.empty_like(d), j) for s, d, j in pieces], ref, kernel=False)
        assert torch.equal(got, torch.cat(ref)), (got, ref)  # torch's passes make the same scales
        print("pieces", len(pieces))
    """)
    assert "pieces 6" in _run_fresh(code)
