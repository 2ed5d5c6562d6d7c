"""Sharded pushes (transport "p2p") measured against the planner's prediction (`streamsync plan`), in one run.

First the rates: a plain gloo send/recv of a buffer of about one bucket's size between two processes on this
host (median of a few sends), `R`, and one process's copy rate `M`. Then each case (real processes: megatron-core
TP2 x PP2 over gloo into two engines of TP2 sliced receiver workers, FSDP2 over 4 ranks into one TP2 engine, a
plain module on one rank into one TP2 engine) pushes `--pushes` times; its time is the median of the pushes
after the first. The prediction is `plan.scale.predict` for the same shape and layouts with every process on
one node and three rate models:

* `link`: each rank's and worker's own link at R, all at once;
* `host`: the whole host moves R in all (one sender and one receiver already keep both cores busy);
* `cpu`: every process shares the host's cores and costs CPU time per byte it sends (a copy at M and its side
  of the wire at R), per byte it receives (its side of the wire, two copies: assembling and loading) and per
  bucket it takes part in. The per-bucket cost is calibrated first, on a case of its own (a small model in
  small buckets, one rank into a TP2 engine, where buckets dominate), never on the cases it predicts.

Ratio = measured / predicted.

    python -m benchmarks.sharded [--pushes 3] [--json docs/benchmarks/cpu-sharded.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import write_json
from streamsync.models.megatron import TinyModel
from streamsync.plan.scale import Engines, Links, Trainer, predict
from streamsync.plan.shapes import Shape
from streamsync.testing.sharded import EngineShape, ShardedCase, endpoints, run_sharded, start_engines

MODEL = TinyModel("qwen3", vocab=8192, hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, ffn=3072)
CALIB = ShardedCase("calibration", TinyModel("qwen3", vocab=1024, hidden=256, layers=2, heads=4, kv_heads=2,
                                             head_dim=64, ffn=768), trainer="module", engines=(EngineShape("e"),),
                    chunk_bytes=32 << 10)
CALIB_BUCKETS = (32 << 10, 512 << 10)


def _pingpong(rank: int, world: int, nbytes: int, reps: int) -> list[float]:
    import torch.distributed as dist

    buf = torch.empty(nbytes, dtype=torch.uint8)
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        out.append(time.perf_counter() - t0)
    return out


def gloo_rate(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of one gloo send/recv between two processes here (median)."""
    from streamsync.testing.megatron import launch

    times = launch(_pingpong, 2, nbytes, reps, timeout=120)[1]
    return nbytes / statistics.median(times[1:])


def _copies(rank: int, world: int, nbytes: int, reps: int) -> list[float]:
    import torch.distributed as dist

    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return times


def copy_rate(nbytes: int, reps: int = 9) -> float:
    """Bytes/s of one process's copy of `nbytes` (median) while every core copies too, on one thread as each
    process here runs: the rate a process gets when the others are busy (they share the memory bandwidth)."""
    from streamsync.testing.megatron import launch

    times = [t for r in launch(_copies, os.cpu_count() or 1, nbytes, reps, timeout=120) for t in r[1:]]
    return nbytes / statistics.median(times)


def _measure(case: ShardedCase, world: int, pushes: int) -> tuple[float, list[dict[str, Any]]]:
    """Median seconds of the pushes after the first (the slowest rank's), and each rank's results."""
    from streamsync.testing.megatron import launch

    case = ShardedCase(**{**case.__dict__, "pushes": pushes})
    with tempfile.TemporaryDirectory() as tmp, start_engines(case, Path(tmp)) as procs:
        res = launch(run_sharded, world, case, endpoints(procs), timeout=240, collective_timeout=case.timeout)
    errors = [r["error"] for r in res if r["error"]]
    if errors:
        raise SystemExit(f"{case.name}: {errors[0]}")
    return statistics.median(max(r["seconds"][i] for r in res) for i in range(1, pushes)), res


def cpu_links(rate: float, copy: float, bucket_us: float = 0.0, push_ms: float = 0.0) -> Links:
    gb = rate / 1e9
    # colocated: the workers on the trainer ranks' node (every process on this one host)
    return Links(nic_gbit=gb * 8, nvlink_gbyte=gb, copy_gbyte=gb, colocated=True, cpu_cores=os.cpu_count() or 1,
                 cpu_tx_ns=1e9 / copy + 1e9 / rate, cpu_rx_ns=1e9 / rate + 2e9 / copy, cpu_bucket_us=bucket_us,
                 push_latency_ms=push_ms)


def calibrate(rate: float, copy: float, pushes: int) -> dict[str, Any]:
    """The per-push latency (ms) and per-bucket CPU cost (us) that make the cpu model meet the calibration case
    pushed in two bucket sizes: two measurements, two unknowns."""
    engines = Engines(1, CALIB.engines[0].tp, per_node=64)
    rows = []
    for bucket in CALIB_BUCKETS:
        case = ShardedCase(**{**CALIB.__dict__, "chunk_bytes": bucket})
        measured, _ = _measure(case, 1, pushes)

        def at(us: float, bucket: int = bucket) -> float:
            return predict(shape_of(CALIB.model), Trainer(per_node=64), engines, cpu_links(rate, copy, us),
                           name=CALIB.name, bucket_bytes=bucket).seconds

        rows.append((bucket, measured, at(0.0), (at(1000.0) - at(0.0)) / 1000.0))
    (_, m1, b1, s1), (_, m2, b2, s2) = rows
    # m = push_s + base + slope * us, for both bucket sizes (the CPU bound holds in both)
    us = max(0.0, ((m1 - b1) - (m2 - b2)) / (s1 - s2)) if s1 != s2 else 0.0
    push_s = max(0.0, m2 - b2 - s2 * us)
    return {"case": CALIB.name, "model": repr(CALIB.model), "bucket_bytes": [r[0] for r in rows],
            "measured_s": [r[1] for r in rows], "cpu_bucket_us": us, "push_latency_ms": push_s * 1e3}


def shape_of(m: TinyModel) -> Shape:
    return Shape({"model_type": "qwen3", "num_hidden_layers": m.layers, "hidden_size": m.hidden,
                  "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
                  "intermediate_size": m.ffn, "vocab_size": m.vocab, "tie_word_embeddings": m.tie,
                  "torch_dtype": m.dtype})


CASES = [  # (case, world, planner's trainer layout)
    (ShardedCase("megatron-tp2pp2", MODEL, tp=2, pp=2, engines=(EngineShape("a"), EngineShape("b")),
                 chunk_bytes=8 << 20), 4, Trainer(tp=2, pp=2, per_node=64)),
    (ShardedCase("fsdp2-4", MODEL, trainer="fsdp2", engines=(EngineShape("e"),), chunk_bytes=8 << 20), 4,
     Trainer(fsdp=4, per_node=64)),
    (ShardedCase("module-1", MODEL, trainer="module", engines=(EngineShape("e"),), chunk_bytes=8 << 20), 1,
     Trainer(per_node=64)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--cases", default=",".join(c.name for c, _, _ in CASES))
    ap.add_argument("--json", type=Path, default=Path("docs/benchmarks/cpu-sharded.json"))
    args = ap.parse_args()
    rate = gloo_rate(8 << 20)
    copy = copy_rate(8 << 20)
    print(f"gloo loopback, one pair, 8 MiB messages: {rate / 1e9:.3f} GB/s; a copy on every core at once: "
          f"{copy / 1e9:.2f} GB/s each ({os.cpu_count()} cores)")
    calib = calibrate(rate, copy, max(args.pushes, 3))
    bucket_us, push_ms = calib["cpu_bucket_us"], calib["push_latency_ms"]
    print(f"calibration ({CALIB.name}, buckets of {[b >> 10 for b in CALIB_BUCKETS]} KiB: "
          f"{[round(m * 1e3, 1) for m in calib['measured_s']]} ms): {push_ms:.1f} ms per push, {bucket_us:.0f} us of "
          "CPU per bucket per process")
    rows: list[dict[str, Any]] = []
    for case, world, trainer in CASES:
        if case.name not in args.cases.split(","):
            continue
        t0 = time.perf_counter()
        measured, res = _measure(case, world, args.pushes)
        engines = Engines(len(case.engines), case.engines[0].tp, per_node=64)
        gb = rate / 1e9
        preds = {kind: predict(shape_of(MODEL), trainer, engines, links, name=case.name, bucket_bytes=case.chunk_bytes)
                 for kind, links in (("link", Links(nic_gbit=gb * 8, nvlink_gbyte=gb, copy_gbyte=gb)),
                                     ("host", Links(nic_gbit=gb * 8, nvlink_gbyte=gb, copy_gbyte=gb, host_gbyte=gb)),
                                     ("cpu", cpu_links(rate, copy, bucket_us, push_ms)))}
        link = preds["link"]
        row = {"case": case.name, "ranks": world, "engines": engines.describe(), "bytes": link.plan_bytes,
               "sent_by_plan": res[0]["sent_bytes"], "exact": res[0]["exact"], "measured_s": measured,
               "pushes_s": [max(r["seconds"][i] for r in res) for i in range(args.pushes)],
               **{f"predicted_{k}_s": p.seconds for k, p in preds.items()},
               **{f"ratio_{k}": measured / p.seconds for k, p in preds.items()},
               "bound_link": link.bound, "bound_cpu": preds["cpu"].bound, "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"{case.name:16s} {world} ranks  {link.plan_bytes / 1e6:8.1f} MB  measured {measured:.3f} s  "
              + "  ".join(f"{k} {p.seconds:.3f} s (x{measured / p.seconds:.2f})" for k, p in preds.items())
              + f"  exact {all(res[0]['exact'])}")
    write_json(args.json, {"gloo_rate_Bps": rate, "copy_Bps": copy, "cores": os.cpu_count(), "model": repr(MODEL),
                           "calibration": calib,
                           "rows": rows})


if __name__ == "__main__":
    main()
