"""CPU: the same model pushed at window 1 and at window 4 in one run, and the ratio.

A Qwen3-shaped bf16 model made locally (`--layers`, 32: about 1 GB) is pushed over shared memory into a
receiver process. Sender and receiver get one intra-op thread each, so on a machine with two cores the ratio
measures the pipeline's overlap (the pack of chunk i+1 while the receiver loads chunk i). Reported per window:
the median of `--repeat` pushes (after a first push and `--warmup` rounds; the model changes in place before
each repeat), against the copy floor (a pack and an unpack copy of every byte, warm), and whether the receiver
holds the trainer's weights bit for bit.

`--one-copy`: the same pushes over the packed path (`ShmTransport()`, the default), over one copy
(`ShmTransport(one_copy=True)`: the receiver copies straight out of the trainer's own storages, mapped by
reference) and over one copy with 1 GiB of references per chunk, in blocks into one receiver: their push
times and ratios, each block's first push and its one-copy counts (`ref_stats`: tensors referenced and packed,
storages exported). One copy moves the trainer's parameters into shared memory on its first push.

`--device cuda` runs a GPU benchmark instead: the two-GPU cases (benchmarks.two_gpu) where two GPUs are
visible, else the one-GPU benchmark (benchmarks.cuda); `--gpus 1|2` picks one.

    python -m benchmarks [--layers 32] [--chunk-mib 64] [--repeat 3] [--json OUT.json]
    python -m benchmarks --one-copy [--repeat 5] [--json OUT.json]
    python -m benchmarks --device cuda [--gpus 1|2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from benchmarks.report import ref_counts, write_json
from streamsync.models.synthetic import StateModule, perturb_, qwen3_specs, save_specs
from streamsync.report import MiB, PushReport
from streamsync.sync import WeightSync
from streamsync.testing.receiver import ReceiverProcess

CPU_SHAPE = dict(vocab=32768, hidden=1024, layers=32, heads=16, kv_heads=8, head_dim=64, intermediate=3072)


def compare(name: str, seconds: float, other: str, other_seconds: float) -> str:
    """Which of two timed runs is faster, said in words: "window 4 is 1.18x faster than window 1", or when it
    was slower, "window 4 is 1.18x slower than window 1 (0.85x its speed)"."""
    speed = other_seconds / seconds
    if speed >= 1:
        return f"{name} is {speed:.2f}x faster than {other}"
    return f"{name} is {1 / speed:.2f}x slower than {other} ({speed:.2f}x its speed)"


def _table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


async def _measure(rp: ReceiverProcess, model: torch.nn.Module, args: argparse.Namespace,
                   transport: Any = "auto", label: str = "") -> tuple[dict[int, list[float]], int, bool, PushReport]:
    """(push seconds per window, chunks, receiver bit-exact, the first push's report) of `--repeat` pushes per
    window after a first push and `--warmup`, the model perturbed in place before each repeat."""
    from streamsync.checksum import digests

    times: dict[int, list[float]] = {1: [], 4: []}
    chunks = 0
    engine = rp.engine(timeout=300)
    sync = WeightSync([engine], chunk_bytes=args.chunk_mib * MiB, timeout=300, transport=transport)
    await sync.connect()
    first = await sync.push(model, max_inflight=4)
    for _ in range(args.warmup):
        for w in (1, 4):
            await sync.push(model, max_inflight=w)
    for r in range(args.repeat):
        perturb_(model, r)
        order = (1, 4) if r % 2 == 0 else (4, 1)  # alternate so neither window always runs second
        for w in order:
            report = await sync.push(model, max_inflight=w)
            times[w].append(report.seconds)
            chunks = report.chunks
            print(f"  {label}repeat {r + 1}/{args.repeat} window {w}: {report.seconds * 1e3:.0f} ms", flush=True)
    exact = await engine.checksums() == digests(model.state_dict().items())
    await sync.close()
    return times, chunks, exact, first


async def _bench_cpu(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    shape = dict(CPU_SHAPE, layers=args.layers)
    specs = qwen3_specs(**shape)
    work = Path(tempfile.mkdtemp(prefix="streamsync-bench-"))
    print(f"building a Qwen3-shaped bf16 model ({args.layers} layers) ...", flush=True)
    model = StateModule(specs, fill="random", seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"model: {nbytes / 1e9:.2f} GB, {len(specs)} tensors; starting receiver process ...", flush=True)
    with ReceiverProcess(str(save_specs(specs, work / "model.json")), threads=1) as rp:
        if args.one_copy:
            return await _bench_one_copy(rp, model, nbytes, args)
        times, chunks, exact, _ = await _measure(rp, model, args)
    floor, floors, floor_threads = _copy_floor(model, repeat=max(args.repeat, 5))
    t1, t4 = statistics.median(times[1]), statistics.median(times[4])
    result = {
        "device": "cpu", "model": f"qwen3-shaped bf16 {args.layers} layers", "bytes": nbytes, "chunks": chunks,
        "chunk_bytes": args.chunk_mib * MiB, "repeat": args.repeat,
        "push_s_window1": t1, "push_s_window4": t4, "speedup_window4_vs_1": t1 / t4,
        "push_s_window1_all": times[1], "push_s_window4_all": times[4], "bit_exact": exact,
        "gbps_window4": nbytes / t4 / 1e9,
        "floor_s": floor, "floor_s_all": floors, "floor_threads": floor_threads, "window4_vs_floor": t4 / floor,
    }
    print()
    print(_table([
        ("model", f"{nbytes / 1e9:.2f} GB in {chunks} chunks of {args.chunk_mib} MiB"),
        ("push, window 1", f"{t1 * 1e3:.0f} ms (median of {args.repeat})"),
        ("push, window 4", f"{t4 * 1e3:.0f} ms ({nbytes / t4 / 1e9:.2f} GB/s)"),
        ("window 4 vs window 1", compare("window 4", t4, "window 1", t1)),
        ("copy floor", f"{floor * 1e3:.0f} ms (pack + unpack copies of every byte, {floor_threads} thread(s); "
                       f"warm, median of {len(floors)})"),
        ("window 4 vs floor", f"{t4 / floor:.2f}x"),
        ("receiver bit-exact", str(exact)),
    ]))
    return result


async def _bench_one_copy(rp: ReceiverProcess, model: torch.nn.Module, nbytes: int, args: argparse.Namespace) -> dict:
    """Packed, then one copy (which moves the model into shared memory on its first push), into one receiver."""
    from streamsync.transports.shm import ShmTransport

    runs = {}
    modes = {"packed": dict(one_copy=False), "one_copy": dict(one_copy=True),
             "one_copy_ref1g": dict(one_copy=True, ref_bytes=1 << 30)}
    for mode, kw in modes.items():
        print(f"{mode}:", flush=True)
        transport = ShmTransport(**kw)
        times, chunks, exact, first = await _measure(rp, model, args, transport, f"{mode} ")
        runs[mode] = {
            "push_s_window1": statistics.median(times[1]), "push_s_window4": statistics.median(times[4]),
            "push_s_window1_all": times[1], "push_s_window4_all": times[4], "chunks": chunks,
            "bit_exact": exact, "first_push_s": first.seconds, "ref_stats": ref_counts(first),
            "moved_bytes": transport.moved_bytes,
        }
    floor, floors, floor_threads = _copy_floor(model, repeat=max(args.repeat, 5))
    p, o = runs["packed"], runs["one_copy"]
    result = {
        "device": "cpu", "model": f"qwen3-shaped bf16 {args.layers} layers", "bytes": nbytes,
        "chunk_bytes": args.chunk_mib * MiB, "repeat": args.repeat, "threads": torch.get_num_threads(),
        "packed": p, "one_copy": o,
        "one_copy_ref1g": runs["one_copy_ref1g"],
        "one_copy_speedup_window4": p["push_s_window4"] / o["push_s_window4"],
        "one_copy_speedup_window1": p["push_s_window1"] / o["push_s_window1"],
        "one_copy_ref1g_speedup_window4": p["push_s_window4"] / runs["one_copy_ref1g"]["push_s_window4"],
        "floor_s": floor, "floor_s_all": floors, "floor_threads": floor_threads,
    }
    print()
    rows = [("model", f"{nbytes / 1e9:.2f} GB; packed chunks of {args.chunk_mib} MiB")]
    for mode, r in runs.items():
        rows += [(f"{mode}, window 4", f"{r['push_s_window4'] * 1e3:.0f} ms (median of {args.repeat}, "
                                       f"{r['chunks']} chunks, bit-exact {r['bit_exact']})"),
                 (f"{mode}, window 1", f"{r['push_s_window1'] * 1e3:.0f} ms"),
                 (f"{mode}, first push", f"{r['first_push_s'] * 1e3:.0f} ms")]
    r1g = runs["one_copy_ref1g"]
    rows += [("one copy vs packed, window 4",
              compare("one copy", o["push_s_window4"], "packed", p["push_s_window4"])),
             ("one copy vs packed, window 1",
              compare("one copy", o["push_s_window1"], "packed", p["push_s_window1"])),
             ("one copy (1 GiB of references per chunk) vs packed, window 4",
              compare("one copy", r1g["push_s_window4"], "packed", p["push_s_window4"])),
             ("two-copy floor", f"{floor * 1e3:.0f} ms ({floor_threads} thread(s))")]
    print(_table(rows))
    return result


def _copy_floor(model: torch.nn.Module, repeat: int = 5, warmup: int = 1) -> tuple[float, list[float], int]:
    """Two copies of every byte (pack into a buffer, unpack out of it): a push can't beat it.

    Measured warm, as the pushes are: a first pass faults in the fresh buffers' pages, which costs many times a
    warm pass, so `warmup` passes are dropped and the median of `repeat` counts. Measured with one thread and
    with every core, the faster counting: on a loaded machine threads fighting for the cores copy slower than
    one thread. Returns (floor, that setting's timed passes, its thread count)."""
    srcs = [t.reshape(-1).view(torch.uint8) for t in model.state_dict().values()]
    buf = torch.empty(sum(t.numel() for t in srcs), dtype=torch.uint8)
    outs = [torch.empty_like(t) for t in srcs]
    best: tuple[float, list[float], int] | None = None
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        try:
            times: list[float] = []
            for i in range(warmup + repeat):
                t0 = time.perf_counter()
                off = 0
                for t in srcs:
                    buf[off:off + t.numel()].copy_(t)
                    off += t.numel()
                off = 0
                for o in outs:
                    o.copy_(buf[off:off + o.numel()])
                    off += o.numel()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
        finally:
            torch.set_num_threads(1)
        if best is None or statistics.median(times) < best[0]:
            best = (statistics.median(times), times, threads)
    assert best is not None
    return best


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the CPU model (32: 0.94 GB)")
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--one-copy", action="store_true",
                    help="CPU: compare the packed shared-memory path with one copy (ShmTransport(one_copy=True))")
    ap.add_argument("--gpus", choices=["auto", "1", "2"], default="auto",
                    help="--device cuda: the one-GPU benchmark (1), the two-GPU cases (2), or 2 where two GPUs are "
                    "visible (auto)")


def run(args: argparse.Namespace) -> dict:
    gpus = args.gpus
    if args.device == "cuda" and (gpus == "2" or (gpus == "auto" and torch.cuda.device_count() >= 2)):
        from benchmarks.two_gpu import run_defaults

        result = run_defaults(args)
    elif args.device == "cuda":
        from benchmarks.cuda import run as run_cuda

        result = run_cuda(args)
    else:
        t0 = time.perf_counter()
        result = anyio.run(_bench_cpu, args)
        result["wall_s"] = time.perf_counter() - t0
    write_json(args.json, result)
    return result
