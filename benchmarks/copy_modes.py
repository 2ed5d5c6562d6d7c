"""GPU probe: how fast one process copies a model's tensors into a flat buffer, by copy method.

The tensors: Qwen3-8B's HF tensors (bf16), or with `--shape moe` the copies a one-copy MoE push makes
(Qwen3-30B-A3B widths, 12 layers: per expert its fc1, gate and up as one run, and its fc2; attention and the
embeddings). They are copied into one flat buffer by per-tensor `copy_` (cudaMemcpyAsync), the same captured
as a CUDA graph (memcpy nodes), `torch._foreach_copy_` (kernels), that captured, and, where Triton works,
`streamsync.receiver.kernels.SegmentCopy` (one persistent kernel over every copy's byte runs) captured, at a
few program counts; against one large copy of the same bytes. Printed per method: the time (CUDA events,
median of 7) and the rate (bytes read plus written).

    python -m benchmarks.copy_modes [--shape 8b|moe] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.report import write_json
from streamsync.models.synthetic import qwen3_specs
from streamsync.pack import dtype_from_name
from streamsync.receiver import kernels


def timed(fn, repeat: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.copy_modes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shape", choices=("8b", "moe"), default="8b")
    args = ap.parse_args(argv)
    if args.shape == "8b":
        specs = qwen3_specs(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                            intermediate=12288)
        shapes = [(tuple(s), dtype_from_name(d)) for _, d, s in specs]
    else:  # per layer: q, k, v, o; 128 experts x (fc1 [2I, H], fc2 [H, I]); and the embeddings
        hidden, inter, heads, kv, hd = 2048, 768, 32, 4, 128
        shapes = [((151936, hidden), torch.bfloat16)] * 2
        for _ in range(12):
            shapes += [((heads * hd, hidden), torch.bfloat16), ((kv * hd, hidden), torch.bfloat16),
                       ((kv * hd, hidden), torch.bfloat16), ((hidden, heads * hd), torch.bfloat16)]
            shapes += [((2 * inter, hidden), torch.bfloat16), ((hidden, inter), torch.bfloat16)] * 128
    srcs = [torch.randn(shape, device="cuda").to(dt) for shape, dt in shapes]
    total = sum(t.numel() * t.element_size() for t in srcs)
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    dsts, off = [], 0
    for t in srcs:
        n = t.numel() * t.element_size()
        dsts.append(flat[off:off + n].view(t.dtype).view(t.shape))
        off += n
    big_src = torch.empty(total, dtype=torch.uint8, device="cuda")

    def per_tensor() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s, non_blocking=True)

    def foreach() -> None:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def graphed(fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            g.capture_begin(capture_error_mode="thread_local")
            fn()
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        return g.replay

    out = {"shape": args.shape, "bytes": total, "tensors": len(srcs)}
    modes = {"one large copy": lambda: flat.copy_(big_src), "per-tensor copy_": per_tensor,
             "per-tensor copy_, graph": graphed(per_tensor), "_foreach_copy_": foreach,
             "_foreach_copy_, graph": graphed(foreach)}
    if kernels.available():  # one persistent Triton kernel over every copy's byte runs
        kernels.warm(flat.device)
        for programs in (None, 264, 1056):
            seg = kernels.SegmentCopy(dsts, srcs, programs=programs)
            modes[f"segment kernel ({programs or 'default'} programs), graph"] = graphed(seg)
    for name, fn in modes.items():
        s = timed(fn)
        out[name] = {"ms": s * 1e3, "tb_per_s_read_plus_written": 2 * total / s / 1e12}
        print(f"{name:28s} {s * 1e3:7.2f} ms  {2 * total / s / 1e12:5.2f} TB/s (read + written)")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
