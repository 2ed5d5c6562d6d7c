"""vLLM's online per-tensor fp8, made in a few batched launches: fused-MoE experts (a kernel call per expert in
vLLM), and linear layers quantized from the pushed tensors where they lie (`quantize_sourced`).

An engine started with `quantization="fp8"` on a bf16 checkpoint quantizes each expert's weights on their own
(`Fp8PerTensorOnlineMoEMethod.process_weights_after_loading`: `ops.scaled_fp8_quant` once per expert and
projection, a Python loop of thousands of calls per push for a 128-expert model). The fast path rebuilds such a
layer with the same arithmetic over many experts at once:

    scale_e = amax(|w_e|) / 448              an IEEE fp32 division (a tensor divisor: a Python number would
                                             make PyTorch multiply by its reciprocal, which rounds otherwise)
    q_e     = fp8(fmax(fmin(w_e * (1 / scale_e), 448), -448))    a multiply by the reciprocal, as the kernel
                                             does; fmin/fmax map a NaN (an all-zero expert's 0 * inf) to 448
                                             as the kernel's fminf/fmaxf do; the cast rounds to nearest even

which is element for element the kernel's (GPU test: the engine then equals one that loaded the same weights
from disk). Only for the Triton backends, whose kernels read the experts as quantized; any other backend may
convert them afterwards and keeps vLLM's own processing.

On CUDA the amax is one reduction over all experts and the rest one Triton kernel: five bytes of memory traffic
an element in all, against about forty for torch's passes above, which are the fallback and the reference the
GPU test holds the kernel to. The kernel's fp32 -> e4m3 conversion is the hardware's (round to nearest even):
Triton's interpreter rounds otherwise, so it is not used off the GPU.

`quantize_sourced` makes the same of weights that arrive in pieces (a merged q/k/v or gate/up weight from its HF
tensors, each a view of the pushed chunk): one amax per weight over all of its pieces (max is exact, so this is
the amax of the weight they make up), then every piece quantized straight into its rows of the live fp8 weight.
No bf16 copy of the weight is made, and a chunk's weights take two kernel launches, not two per weight. Experts
are such weights too, one per expert and projection (`fastpath.direct.Experts`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...receiver.kernels import rows_of, triton_imports
from ..quantizations import FP8_PER_TENSOR

FP8_MAX = 448.0
#: experts quantized per pass (fp32 temporaries of this many experts at a time)
GROUP = 16
_PLAIN_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})


def fp8_experts_rebuildable(layer: torch.nn.Module) -> bool:
    """Whether `layer` is a fused-MoE layer under vLLM's online per-tensor fp8 on a Triton backend whose experts
    each rank quantizes from its own shard alone. Where vLLM takes an expert's amax over every rank that shards it
    (`amax_for_moe_weight_quant`, vLLM 0.32+, MoE tensor parallelism above 1), a rank's shard does not decide its
    scale: vLLM's own processing quantizes the layer."""
    method = getattr(layer, "quant_method", None)
    backend = getattr(getattr(method, "fp8_backend", None), "name", None)
    sharded = int(getattr(getattr(method, "moe", None), "tp_size", 1) or 1) > 1
    return (type(method).__name__ == FP8_PER_TENSOR.moe and backend in _PLAIN_BACKENDS
            and not (sharded and _amax_across_ranks()))


@functools.cache
def _amax_across_ranks() -> bool:
    """Whether this vLLM reduces a tensor-sharded expert's amax across its ranks before quantizing."""
    try:
        from vllm.model_executor.layers.quantization.utils.quant_utils import amax_for_moe_weight_quant  # noqa: F401
    except ImportError:
        return False
    return True


_BLOCK = 4096  # elements a kernel program quantizes
_broken: list[str] = []  # why the kernel is not used (once it failed)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def quant_kernel(w, out, inv, per, BLOCK: tl.constexpr):
        e = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < per
        x = tl.load(w + e * per + offs, mask=m, other=0.0).to(tl.float32) * tl.load(inv + e)
        x = tl.where(x != x, 448.0, x)  # 0 * inf of an all-zero expert: the kernel's fminf makes it 448
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        tl.store(out + e * per + offs, x.to(tl.float8e4nv), mask=m)

    return quant_kernel


def _kernel_quantize(w: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> bool:
    """The CUDA path of `quantize_experts`; False where it cannot run (the torch passes then do it)."""
    if _broken or not w.is_cuda or not w.is_contiguous() or not out.is_contiguous() or not triton_imports():
        return False
    e = w.shape[0]
    amax = torch.linalg.vector_norm(w.view(e, -1), float("inf"), dim=1).float()
    scale = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.ones_like(scale) / scale
    per = w[0].numel()
    try:
        _kernel()[(e, (per + _BLOCK - 1) // _BLOCK)](w, out, inv, per, BLOCK=_BLOCK)
    except Exception as err:  # a Triton that cannot build it here: torch's passes
        _broken.append(f"{type(err).__name__}: {err}")
        logging.getLogger(__name__).warning("fp8 expert kernel unavailable, using torch: %s", err)
        return False
    scales[:e].copy_(scale)
    return True


@torch.no_grad()
def quantize_experts(w: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, kernel: bool = True) -> None:
    """Quantize every expert of `w` ([E, rows, cols], bf16/fp16) into `out` (fp8, same shape) and `scales`
    (fp32, [E] or more: the first E are written), as `ops.scaled_fp8_quant(w[e])` makes each. `kernel=False`:
    torch's passes even on CUDA (the reference)."""
    if out.shape != w.shape or out.dtype != torch.float8_e4m3fn or scales.dim() != 1 or scales.numel() < w.shape[0]:
        raise ValueError(f"fp8 experts: {w.dtype}{tuple(w.shape)} into {out.dtype}{tuple(out.shape)} with "
                         f"scales {tuple(scales.shape)}")
    if w.numel() and kernel and _kernel_quantize(w, out, scales):
        return
    hi = torch.tensor(FP8_MAX, dtype=torch.float32, device=w.device)
    lo = -hi
    for e0 in range(0, w.shape[0], GROUP):
        part = w[e0:e0 + GROUP]
        amax = part.abs().amax(dim=(1, 2)).float()
        scale = amax / torch.full_like(amax, FP8_MAX)
        inv = torch.ones_like(scale) / scale
        x = part.float()
        x.mul_(inv[:, None, None])
        torch.fmin(x, hi, out=x)
        torch.fmax(x, lo, out=x)
        n = part.shape[0]
        out[e0:e0 + n].copy_(x)  # fp32 -> e4m3fn: round to nearest even (every value is within +-448)
        scales[e0:e0 + n].copy_(scale)


def rebuild_fp8_experts(layer: torch.nn.Module, fresh: Mapping[str, torch.Tensor | None],
                        live: Mapping[str, torch.Tensor | None]) -> None:
    """Quantize a fused-MoE layer's freshly loaded bf16 experts (`fresh`: its load format) into the fp8 experts and
    scales its kernels read (`live`), and point its quant config's scales at those."""
    experts = int(getattr(layer, "local_num_experts", 0) or 0)
    for proj in ("w13", "w2"):
        w, out, scales = fresh.get(f"{proj}_weight"), live.get(f"{proj}_weight"), live.get(f"{proj}_weight_scale")
        if w is None or out is None or scales is None or (experts and w.shape[0] != experts):
            raise ValueError(f"fp8 experts of {type(layer).__name__}: no {proj} weights or scales to rebuild")
        quantize_experts(w, out, scales)
    point_config_at_scales(layer, live)


def point_config_at_scales(layer: torch.nn.Module, live: Mapping[str, torch.Tensor | None]) -> None:
    """Point a fused-MoE layer's quant config at its live expert scales (its kernels read them there; a reload
    through vLLM's own processing leaves it holding copies)."""
    cfg: Any = getattr(getattr(layer, "quant_method", None), "moe_quant_config", None)
    for attr, name in (("_w1", "w13_weight_scale"), ("_w2", "w2_weight_scale")):
        desc: Any = getattr(cfg, attr, None)
        held, scale = getattr(desc, "scale", None), live.get(name)
        if isinstance(held, torch.Tensor) and held is not scale and scale is not None and held.shape == scale.shape:
            desc.scale = scale


SEG = 1 << 20  # elements of a run one table row covers (a longer run takes several rows)
_TILE = 16384  # elements a sourced-quantization program reads
_TBLOCK = 1024


@functools.cache
def _sourced_kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    # Each table row: a run of `n` contiguous elements at `so` (source elements from `src`) and `do` (fp8
    # elements from `dst`), belonging to weight `own`; programs (row, tile) cover it `TILE` elements at a time.
    # ALIGNED: every run starts at a multiple of 16 bytes on both sides (SALIGN source elements) and is a multiple
    # of 16 elements long, so Triton may load and store 16 bytes an access instead of one element.
    @triton.jit
    def sourced_amax(src, table, amax, TILE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
                     SALIGN: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start = tl.program_id(1).to(tl.int64) * TILE
        n = tl.load(table + row * 4 + 2)
        if start >= n:  # the grid is sized for the longest row
            return
        so = tl.load(table + row * 4)
        own = tl.load(table + row * 4 + 3)
        if ALIGNED:
            so = tl.multiple_of(so, SALIGN)
            n = tl.multiple_of(n, 16)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(0, TILE, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            x = tl.abs(tl.load(src + so + offs, mask=offs < n, other=0.0).to(tl.float32))
            acc = tl.maximum(acc, tl.where(x != x, 0.0, x))  # the kernel's fmaxf passes NaN over
        tl.atomic_max(amax + own, tl.max(acc, axis=0))

    @triton.jit
    def sourced_quant(src, dst, table, inv, TILE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
                      SALIGN: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start = tl.program_id(1).to(tl.int64) * TILE
        n = tl.load(table + row * 4 + 2)
        if start >= n:
            return
        so = tl.load(table + row * 4)
        do = tl.load(table + row * 4 + 1)
        if ALIGNED:
            so = tl.multiple_of(so, SALIGN)
            do = tl.multiple_of(do, 16)
            n = tl.multiple_of(n, 16)
        k = tl.load(inv + tl.load(table + row * 4 + 3))
        for i in tl.static_range(0, TILE, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.load(src + so + offs, mask=m, other=0.0).to(tl.float32) * k
            x = tl.where(x != x, 448.0, x)
            x = tl.minimum(tl.maximum(x, -448.0), 448.0)
            tl.store(dst + do + offs, x.to(tl.float8e4nv), mask=m)

    return sourced_amax, sourced_quant


#: a piece's runs as `layout` gives them: (source address, destination address, elements a run, runs, source runs
#: a row, source row stride, destination runs a row, destination row stride); run k starts at address +
#: ((k // runs a row) * row stride + (k % runs a row) * elements a run) * element size, on each side
Layout = tuple[int, int, int, int, int, int, int, int]


def layout(src: torch.Tensor, dst: torch.Tensor) -> Layout | None:
    """The piece src -> dst (same shape) as runs contiguous on both sides (`Layout`); None where either side is
    not evenly spaced rows of contiguous elements, or it is empty. Called once per piece a push brings: where both
    sides are contiguous (most pieces) it walks no layout."""
    n = src.numel()
    if not n or src.shape != dst.shape:
        return None
    a, b = src.is_contiguous(), dst.is_contiguous()
    if a and b:  # one run
        return src.data_ptr(), dst.data_ptr(), n, 1, 1, n, 1, n
    ra = (1, n, n) if a else rows_of(src)
    rb = (1, n, n) if b else rows_of(dst)
    if ra is None or rb is None:
        return None
    cols = math.gcd(ra[1], rb[1])
    return src.data_ptr(), dst.data_ptr(), cols, n // cols, ra[1] // cols, ra[2], rb[1] // cols, rb[2]


def sourced_layout(src: torch.Tensor, dst: torch.Tensor) -> Layout | None:
    """The piece's `layout` where `quantize_sourced`'s kernel reads it where it lies (else its caller gives it a
    contiguous copy to read): a bf16, fp16 or fp32 source into an fp8 destination on the same GPU."""
    if not (((src.is_cuda and dst.is_cuda and src.get_device() == dst.get_device()) or _interpreted(src, dst))
            and not _broken and src.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and dst.dtype == torch.float8_e4m3fn):
        return None
    return layout(src, dst)


def _interpreted(*tensors: torch.Tensor) -> bool:
    """Whether Triton interprets its kernels (`TRITON_INTERPRET=1`, read at its import) and the tensors are on the
    CPU: the sourced kernels then run there, which is how the tests check where they read and write without a GPU
    (the interpreter's fp8 rounding is not the GPU's: only for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and all(t.device.type == "cpu" for t in tensors)


def sourceable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether `quantize_sourced`'s kernel reads the piece src -> dst where it lies."""
    return sourced_layout(src, dst) is not None


def writable(dst: torch.Tensor) -> bool:
    """Whether `quantize_sourced`'s kernel writes the fp8 view `dst` (evenly spaced rows of contiguous elements)."""
    return ((dst.is_cuda or _interpreted(dst)) and dst.dtype == torch.float8_e4m3fn and rows_of(dst) is not None
            and not _broken)


@torch.no_grad()
def warm_sourced(device: torch.device) -> None:
    """Compile `quantize_sourced`'s kernels for bf16 sources now (at connect), for every alignment of the first
    source and destination a push may bring, so no push waits for Triton."""
    src = torch.zeros(2, 48, dtype=torch.bfloat16, device=device)
    dst = torch.empty(2, 48, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(1, dtype=torch.float32, device=device)
    for s, d in ((src, dst), (src[:, 1:17], dst[:, :16]), (src[:, :16], dst[:, 1:17]), (src[:, 1:17], dst[:, 1:17])):
        quantize_sourced([(s, d, 0)], [scale])
    # the first piece aligned, a later one not: the kernels' unaligned build from aligned first addresses
    quantize_sourced([(src[0, :16], dst[0, :16], 0), (src[1, 1:17], dst[1, 1:17], 0)], [scale])
    torch.cuda.synchronize(device)


@torch.no_grad()
def quantize_sourced(pieces: Sequence[tuple[torch.Tensor, torch.Tensor, int]], scales: Sequence[torch.Tensor],
                     kernel: bool = True, layouts: Sequence[Layout | None] | None = None) -> None:
    """Quantize weights that arrive in pieces, as `ops.scaled_fp8_quant` makes each weight they make up: `pieces`
    are (source view, fp8 destination view of the same shape, weight index); weight j's scale is the amax of
    all its pieces / 448, written to `scales[j]` (one element). One source dtype. `layouts`: each piece's
    `sourced_layout`, where the caller has them. `kernel=False`: torch's passes (the reference; also where the
    kernel cannot run)."""
    if not pieces:
        return
    if kernel and _sourced_kernel(pieces, scales, layouts):
        return
    hi = torch.tensor(FP8_MAX, dtype=torch.float32, device=pieces[0][0].device)
    amax = [torch.zeros((), dtype=torch.float32, device=hi.device) for _ in scales]
    for src, _, j in pieces:  # a NaN is passed over, as the kernel's fmaxf does
        amax[j] = torch.fmax(amax[j], src.abs().float().nan_to_num(nan=0.0, posinf=math.inf).amax())
    for j, a in enumerate(amax):
        scale = a / torch.full_like(a, FP8_MAX)
        scales[j].view(()).copy_(scale)
        amax[j] = torch.ones_like(scale) / scale
    for src, dst, j in pieces:
        x = src.float() * amax[j]
        torch.fmin(x, hi, out=x)
        torch.fmax(x, -hi, out=x)
        dst.copy_(x)


def sourced_table(pieces: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
                  layouts: Sequence[Layout | None] | None = None) -> tuple[Any, bool, int] | None:
    """The sourced kernels' table: one row (source element from the first piece's source, fp8 element from its
    destination, elements, weight) per run of at most `SEG` elements contiguous on both sides, as an [R, 4] int64
    numpy array; whether every run is 16-byte aligned on both sides and a multiple of 16 elements long; the
    longest row. None where a piece is not evenly spaced rows of contiguous elements on both sides. `layouts`:
    each piece's `layout`, where the caller has them. The arithmetic per run is numpy's: a chunk's table has
    thousands of rows (megatron's QKV views, an MoE's experts), and a Python loop over them took milliseconds of
    every load."""
    import numpy as np

    si = pieces[0][0].element_size()
    if layouts is None:
        layouts = [layout(src, dst) for src, dst, _ in pieces]
    if any(x is None for x in layouts):
        return None
    g = np.asarray(layouts, dtype=np.int64)
    sb, db = int(g[0, 0]), int(g[0, 1])
    g[:, 0] -= sb
    g[:, 1] -= db
    if (g[:, 0] % si).any():
        return None
    g[:, 0] //= si
    j = np.asarray([p[2] for p in pieces], dtype=np.int64)
    count = g[:, 3]
    at = np.repeat(np.arange(len(g)), count)  # each run's piece
    k = np.arange(len(at)) - np.repeat(np.cumsum(count) - count, count)  # each run's index in its piece
    cols = g[at, 2]
    so = g[at, 0] + (k // g[at, 4]) * g[at, 5] + (k % g[at, 4]) * cols
    do = g[at, 1] + (k // g[at, 6]) * g[at, 7] + (k % g[at, 6]) * cols  # fp8: an element is a byte
    aligned = (sb % 16 == 0 and db % 16 == 0 and not (g[:, 2] % 16).any() and not ((so * si) % 16).any()
               and not (do % 16).any())
    per = -(-cols // SEG)  # table rows a run takes
    if int(per.max()) > 1:
        r = np.repeat(np.arange(len(cols)), per)
        off = (np.arange(len(r)) - np.repeat(np.cumsum(per) - per, per)) * SEG  # each row's start in its run
        rows = np.stack([so[r] + off, do[r] + off, np.minimum(SEG, cols[r] - off), j[at[r]]], axis=1)
    else:
        rows = np.stack([so, do, cols, j[at]], axis=1)
    return rows, bool(aligned), min(int(cols.max()), SEG)


def launch_sourced(src0: torch.Tensor, dst0: torch.Tensor, rows: torch.Tensor, aligned: bool, longest: int,
                   weights: int) -> torch.Tensor:
    """Queue the sourced kernels over `sourced_table`'s rows (on the host; copied to the device without a wait)
    from the first piece's source and destination: the weights' amax, then their quantization. Returns the
    weights' scales ([weights] on the device)."""
    table = rows.to(src0.device, non_blocking=True)
    amax = torch.zeros(weights, dtype=torch.float32, device=src0.device)
    grid = (len(rows), -(-longest // _TILE))
    salign = 16 // src0.element_size()
    amax_k, quant_k = _sourced_kernels()
    amax_k[grid](src0, table, amax, TILE=_TILE, BLOCK=_TBLOCK, ALIGNED=aligned, SALIGN=salign)
    scale = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.ones_like(scale) / scale
    quant_k[grid](src0, dst0, table, inv, TILE=_TILE, BLOCK=_TBLOCK, ALIGNED=aligned, SALIGN=salign)
    return scale


class SourcedLaunch:
    """`quantize_sourced`'s kernels over a set of pieces, their table built: the call queues the kernels and the
    scales' copies and does no host work. With the table on the device (`sourced_launcher(upload=True)`) it
    uploads nothing either, so a CUDA graph may record it. It holds the pieces' first source and destination:
    keep `table` (which a graph reads), not the call."""

    def __init__(self, src0: torch.Tensor, dst0: torch.Tensor, table: torch.Tensor, aligned: bool, longest: int,
                 scales: Sequence[torch.Tensor]) -> None:
        self.src0, self.dst0, self.table, self.aligned, self.longest = src0, dst0, table, aligned, longest
        self.outs = [s.view(1) for s in scales]

    def __call__(self) -> None:
        src0 = self.src0
        with torch.cuda.device(src0.device) if src0.is_cuda else contextlib.nullcontext():
            scale = launch_sourced(src0, self.dst0, self.table, self.aligned, self.longest, len(self.outs))
        torch._foreach_copy_(self.outs, list(scale.view(-1, 1).unbind(0)))


def sourced_launcher(pieces: Sequence[tuple[torch.Tensor, torch.Tensor, int]], scales: Sequence[torch.Tensor],
                     layouts: Sequence[Layout | None] | None, upload: bool = False) -> SourcedLaunch | None:
    """`quantize_sourced` of these pieces by its kernels, as a `SourcedLaunch` (`upload`: its table on the device
    now, else in pinned host memory, copied at launch without a wait); None where the kernels do not take them
    (`quantize_sourced` then quantizes them by torch's passes)."""
    src0, dst0, _ = pieces[0]
    cuda = src0.is_cuda
    if (_broken or not (cuda or _interpreted(src0, dst0)) or not triton_imports()
            or any(s.dtype != src0.dtype for s, _, _ in pieces)):
        return None
    built = sourced_table(pieces, layouts)
    if built is None:
        return None
    rows = torch.from_numpy(built[0])
    if cuda:
        rows = rows.to(src0.device) if upload else rows.pin_memory()
    return SourcedLaunch(src0, dst0, rows, built[1], built[2], scales)


def _sourced_kernel(pieces: Sequence[tuple[torch.Tensor, torch.Tensor, int]], scales: Sequence[torch.Tensor],
                    layouts: Sequence[Layout | None] | None) -> bool:
    launch = sourced_launcher(pieces, scales, layouts)
    if launch is None:
        return False
    try:
        launch()
    except Exception as err:  # a Triton that cannot build it here: torch's passes
        _broken.append(f"{type(err).__name__}: {err}")
        logging.getLogger(__name__).warning("fp8 sourced kernel unavailable, using torch: %s", err)
        return False
    return True
