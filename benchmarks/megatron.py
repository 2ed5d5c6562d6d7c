"""CPU: coalesced against per-parameter gathers for megatron-core models with TP=2 on gloo, in one run.

Two processes hold a bf16 GPTModel split over TP=2 (weights loaded from a seeded HF state); rank 0 pushes
into a receiver process, rank 1 takes part in the gathers. After `--warmup` rounds, each of `--repeat` rounds
pushes the same model once per mode, in rotating order:

  coalesced      one all-gather per (group, dtype) per chunk (MegatronSource's default)
  bucketed       coalesced, but at most --bucket-mib per all-gather, all in flight together
  per_parameter  one all-gather per tensor-parallel parameter (bucket_bytes=1)

Two workloads (`--workloads`): a dense Qwen3-shaped model (few large tensors: bandwidth-bound) and a
Qwen3-MoE-shaped model (many small expert tensors, split over expert TP: latency-bound). Reported per mode:
the median push time, the gather stage's busy time, collectives per push, and the receiver's bit-exactness.

    python -m benchmarks.megatron [--workloads dense moe] [--repeat 5] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from streamsync.models.megatron import TinyModel
from streamsync.testing.megatron import launch

MiB = 1 << 20


MODES = ("coalesced", "bucketed", "per_parameter")
WORKLOADS = {
    "dense": TinyModel("qwen3", vocab=16000, hidden=512, layers=12, heads=8, kv_heads=4, head_dim=64, ffn=1536),
    "moe": TinyModel("qwen3-moe", vocab=8000, hidden=256, layers=6, heads=4, kv_heads=2, head_dim=64,
                     experts=64, moe_ffn=128),
}


def _worker(rank: int, world_size: int, port: int, secret: str, workload: str,
            args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import torch

    from streamsync.checksum import digests
    from streamsync.engines.receiver import ReceiverEngine
    from streamsync.models.megatron import build_model, init_parallel, load_hf_weights
    from streamsync.sources.megatron import MegatronSource
    from streamsync.sync import WeightSync

    tiny = WORKLOADS[workload]
    init_parallel(tp=world_size)
    model = build_model(tiny)
    hf = tiny.hf_state(seed=0)
    load_hf_weights(model, hf)
    if rank != 0:
        del hf
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    out: dict[str, Any] = {}

    async def main() -> None:
        engines = [ReceiverEngine("127.0.0.1", port, secret=secret, timeout=300)] if rank == 0 else []
        sync = WeightSync(engines, chunk_bytes=args.chunk_mib * MiB, timeout=300)
        await sync.connect()

        async def push(mode: str) -> dict[str, float]:
            bucket = {"coalesced": None, "bucketed": args.bucket_mib * MiB, "per_parameter": 1}[mode]
            source = MegatronSource(model, hf_config=tiny.hf_config(), bucket_bytes=bucket)
            report = await sync.push(source)
            out.update(chunks=report.chunks, bytes=report.bytes)
            return {"seconds": report.seconds, "gather_s": report.stage_seconds["gather"],
                    "collectives": report.collectives}

        for _ in range(args.warmup):
            for mode in MODES:
                await push(mode)
        for r in range(args.repeat):
            for mode in MODES[r % 3:] + MODES[: r % 3]:  # rotate so no mode always runs first
                runs[mode].append(await push(mode))
                if rank == 0:
                    print(f"  {workload} repeat {r + 1}/{args.repeat} {mode:>13}: "
                          f"{runs[mode][-1]['seconds'] * 1e3:.0f} ms, "
                          f"{runs[mode][-1]['collectives']} collectives", flush=True)
        if engines:
            out["bit_exact"] = await engines[0].checksums() == digests(hf.items())
        await sync.close()

    torch.set_num_threads(1)
    anyio.run(main)
    out["runs"] = runs
    return out


def _table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


def _one(workload: str, args: argparse.Namespace) -> dict[str, Any]:
    from streamsync.models.synthetic import save_specs
    from streamsync.testing.receiver import ReceiverProcess

    tiny = WORKLOADS[workload]
    work = Path(tempfile.mkdtemp(prefix="streamsync-bench-megatron-"))
    print(f"{workload}: {tiny}; TP=2 over gloo, starting receiver and 2 ranks ...", flush=True)
    with ReceiverProcess(str(save_specs(tiny.hf_specs(), work / "model.json")), threads=1) as rp:
        sender = launch(_worker, 2, rp.port, rp.secret, workload, args, timeout=args.timeout, collective_timeout=300)[0]
    med = {m: {k: statistics.median(r[k] for r in runs) for k in ("seconds", "gather_s", "collectives")}
           for m, runs in sender["runs"].items()}
    base = med["per_parameter"]
    return {
        "model": str(tiny), "tp": 2, "bytes": sender["bytes"], "chunks": sender["chunks"],
        "modes": {m: {"push_s": v["seconds"], "gather_busy_s": v["gather_s"], "collectives": int(v["collectives"]),
                      "push_speedup_vs_per_parameter": base["seconds"] / v["seconds"],
                      "gather_speedup_vs_per_parameter": base["gather_s"] / v["gather_s"]}
                  for m, v in med.items()},
        "runs": sender["runs"], "bit_exact": sender["bit_exact"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "megatron TP=2 over gloo (CPU): coalesced vs per-parameter gathers",
        "chunk_bytes": args.chunk_mib * MiB, "bucket_bytes": args.bucket_mib * MiB, "repeat": args.repeat,
        "workloads": {w: _one(w, args) for w in args.workloads},
    }
    result["wall_s"] = time.perf_counter() - t0
    print()
    for w, r in result["workloads"].items():
        rows = [(w, f"{r['bytes'] / MiB:.0f} MiB bf16 in {r['chunks']} chunks of {args.chunk_mib} MiB, "
                    f"receiver bit-exact: {r['bit_exact']}"),
                ("mode", f"{'collectives':>11}  {'gather busy':>11}  {'push':>8}  push vs per-parameter")]
        for m, v in r["modes"].items():
            label = f"bucketed ({args.bucket_mib} MiB)" if m == "bucketed" else m
            rows.append((label, f"{v['collectives']:>11}  {v['gather_busy_s'] * 1e3:>8.0f} ms  "
                                f"{v['push_s'] * 1e3:>5.0f} ms  {v['push_speedup_vs_per_parameter']:.2f}x"))
        print(_table(rows))
        print()
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.megatron", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--chunk-mib", type=int, default=32)
    ap.add_argument("--bucket-mib", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    result = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
