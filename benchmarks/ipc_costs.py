"""GPU probe: the colocated GPU path's fixed costs on this machine, measured apart from streamsync.

1. Exporting and opening trainer storages by PyTorch's CUDA IPC (what a cold one-copy push through
   `ipc="torch"` pays once per storage): the sender's `reduce_tensor` per storage, and the receiver's
   `rebuild_cuda_tensor` per storage in another process, serially and from `--threads` threads, for storages
   sized like a TP=1 Qwen3-8B's parameters and for many small ones (a MoE trainer's experts).
2. Many mid-sized device copies (a MoE layer's experts) as one copy call each, the same captured in one CUDA
   graph, and `torch._foreach_copy_` (eager and captured), against one copy of the same bytes.

    python -m benchmarks.ipc_costs [--threads 4] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import write_json

MB = 1 << 20


def _receiver(conn: Any) -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.cuda.init()
    torch.empty(1, device="cuda")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        mode, arglist = msg
        keep = []
        t0 = time.perf_counter()
        if mode == "serial":
            per = []
            for a in arglist:
                t1 = time.perf_counter()
                keep.append(rebuild_cuda_tensor(*a))
                per.append(time.perf_counter() - t1)
        else:
            with ThreadPoolExecutor(int(mode)) as ex:
                keep = list(ex.map(lambda a: rebuild_cuda_tensor(*a), arglist))
            per = []
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        s = sum(float(k[:1].float().item()) for k in keep[:4])  # touch a few
        conn.send({"total_s": total, "per_s": per, "touched": s})
        del keep
        torch.cuda.ipc_collect()


def _exports(sizes: list[int]) -> tuple[list[torch.Tensor], list[tuple], list[float]]:
    from torch.multiprocessing.reductions import reduce_tensor

    ts = [torch.ones(n, dtype=torch.uint8, device="cuda") for n in sizes]
    torch.cuda.synchronize()
    args, per = [], []
    for t in ts:
        t0 = time.perf_counter()
        _fn, a = reduce_tensor(t)
        per.append(time.perf_counter() - t0)
        args.append(a)
    return ts, args, per


def ipc(sizes: list[int], threads: list[int]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_receiver, args=(child,), daemon=True)
    p.start()
    rows = []
    try:
        for mode in ["serial", *[str(n) for n in threads], "serial"]:
            ts, args, per_export = _exports(sizes)
            parent.send((mode, args))
            if not parent.poll(300):
                raise TimeoutError("receiver did not answer in 300 s")
            got = parent.recv()
            row = {"mode": mode if mode == "serial" else f"{mode} threads", "storages": len(sizes),
                   "bytes": sum(sizes), "export_ms": sum(per_export) * 1e3, "open_ms": got["total_s"] * 1e3}
            if got["per_s"]:
                per = sorted(got["per_s"])
                row["open_us_median"] = per[len(per) // 2] * 1e6
                row["open_us_max"] = per[-1] * 1e6
                small = [x for x, n in zip(got["per_s"], sizes, strict=True) if n < 32 * MB]
                big = [x for x, n in zip(got["per_s"], sizes, strict=True) if n >= 32 * MB]
                if small:
                    row["open_us_median_small"] = statistics.median(small) * 1e6
                if big:
                    row["open_us_median_big"] = statistics.median(big) * 1e6
            rows.append(row)
            print(f"  ipc {row['mode']:>10}: {len(sizes)} storages, {sum(sizes) / 1e9:.2f} GB: export "
                  f"{row['export_ms']:.1f} ms, open {row['open_ms']:.1f} ms"
                  + (f" (median {row['open_us_median']:.0f} us)" if "open_us_median" in row else ""), flush=True)
            del ts, args
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
    finally:
        parent.send(None)
        p.join(30)
    return rows


def _time(fn: Any, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(max(a.elapsed_time(b), (time.perf_counter() - t0) * 1e3))
    return statistics.median(out)


def copies(n_layers: int, experts: int, hidden: int, inter: int) -> list[dict[str, Any]]:
    dt = torch.bfloat16
    shapes = [(2 * inter, hidden), (hidden, inter)] * (experts * n_layers)
    srcs = [torch.randn(s, dtype=dt, device="cuda") for s in shapes]
    total = sum(t.numel() for t in srcs)
    flat = torch.empty(total, dtype=dt, device="cuda")
    dsts, off = [], 0
    for t in srcs:
        dsts.append(flat[off:off + t.numel()].view(t.shape))
        off += t.numel()
    src_flat = torch.randn(total, dtype=dt, device="cuda")
    nbytes = total * 2

    def loop() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s, non_blocking=True)

    def foreach() -> None:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def graph_of(fn: Any) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            g.capture_begin()
            fn()
            g.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        return g.replay

    cases = {"one big copy (floor)": lambda: flat.copy_(src_flat), "copy_ per tensor (eager)": loop,
             "copy_ per tensor (graph)": graph_of(loop), "_foreach_copy_ (eager)": foreach,
             "_foreach_copy_ (graph)": graph_of(foreach)}
    rows = []
    for name, fn in cases.items():
        ms = _time(fn)
        rows.append({"case": name, "tensors": len(srcs), "bytes": nbytes, "ms": ms,
                     "gbps_rw": 2 * nbytes / ms / 1e6})
        print(f"  copies {name:>26}: {len(srcs)} tensors {nbytes / 1e9:.2f} GB: {ms:.2f} ms "
              f"({2 * nbytes / ms / 1e6:.0f} GB/s read+written)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ipc_costs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",") if x], default=[4])
    args = ap.parse_args(argv)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    # Qwen3-8B's TP=1 Megatron storages: per layer QKV 50 MB, proj 33.5 MB, fc1 201 MB, fc2 100 MB, two norms;
    # embedding and output 1.24 GB each.
    layer = [50331648, 33554432, 201326592, 100663296, 8192, 8192]
    sizes = [1244659712, *layer * 36, 1244659712]
    small = [4 * MB] * 256  # many small storages (a MoE trainer's experts)
    out: dict[str, Any] = {"ipc_8b": ipc(sizes, args.threads), "ipc_small": ipc(small, args.threads)}
    out["copies_moe_layers"] = copies(12, 128, 2048, 768)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
