"""Sharded pushes (transport "p2p") measured against the planner's prediction (`streamsync plan`), in one run.

First the rates: a plain gloo send/recv of a buffer of about one bucket's size between two processes on this
host (median of a few sends), `R`; one process's copy rate `M` and its finite-check rate (`plan.check.nonfinite`,
which every push runs first) `C`, each while every core does the same. Then each case (real processes:
megatron-core TP2 x PP2 over gloo into two engines of TP2 sliced receiver workers, FSDP2 over 4 ranks into one
TP2 engine, a plain module on one rank into one TP2 engine) pushes `--pushes` times; its time is the median of
the pushes after the first (the slowest rank's, each push started from a barrier). The prediction is
`plan.scale.predict` for the same shape and layouts with every process on one node and three rate models:

* `link`: each rank's and worker's own link at R, all at once;
* `host`: the whole host moves R in all (one sender and one receiver already keep both cores busy);
* `cpu`: first every rank's finite check of what it holds at C (the ranks share the cores), then every process
  shares the host's cores and costs CPU time per byte it sends (a copy at M and its side of the wire at R) or
  receives (its side of the wire, two copies: assembling and loading), per push, per bucket and per piece, and
  rank 0 per bucket per worker (the rounds); plus a latency per push and per trainer rank beyond the first.
  Those costs are calibrated first on small cases of their own (4 MB models: one rank in two bucket sizes and
  in four times the tensors, FSDP2 over 2 and 4 ranks), never on the cases it predicts: each process's CPU
  time per push (its own clock; /proc for the workers) less what R, M and C charge gives the CPU costs (least
  squares, senders and workers apart); what the wall times hold beyond the model's bound gives the latencies.

Ratio = measured / predicted.

    python -m benchmarks.sharded [--pushes 10] [--json docs/benchmarks/cpu-sharded.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import write_json
from streamsync.models.megatron import TinyModel
from streamsync.plan.scale import Engines, Links, Trainer, cpu_seconds, predict
from streamsync.plan.shapes import PRESETS, Shape
from streamsync.testing.sharded import EngineShape, ShardedCase, endpoints, run_sharded, start_engines

MODEL = TinyModel("qwen3", vocab=8192, hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, ffn=3072)
CALIB = TinyModel("qwen3", vocab=1024, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=768)
#: small cases of their own for the cpu model's costs: one model in small and large buckets, one of about its bytes
#: in four times the tensors, and two FSDP2 ranks (trainer ranks that do not hold the engines)
CALIBS = [
    (ShardedCase("calibration", CALIB, trainer="module", engines=(EngineShape("e"),), chunk_bytes=32 << 10), 1,
     Trainer(per_node=64)),
    (ShardedCase("calibration", CALIB, trainer="module", engines=(EngineShape("e"),), chunk_bytes=512 << 10), 1,
     Trainer(per_node=64)),
    (ShardedCase("calibration-many", TinyModel("qwen3", vocab=1024, hidden=256, layers=8, heads=4, kv_heads=2,
                                               head_dim=64, ffn=192), trainer="module", engines=(EngineShape("e"),),
                 chunk_bytes=512 << 10), 1, Trainer(per_node=64)),
    (ShardedCase("calibration-fsdp2", CALIB, trainer="fsdp2", engines=(EngineShape("e"),), chunk_bytes=512 << 10), 2,
     Trainer(fsdp=2, per_node=64)),
    (ShardedCase("calibration-fsdp2", CALIB, trainer="fsdp2", engines=(EngineShape("e"),), chunk_bytes=512 << 10), 4,
     Trainer(fsdp=4, per_node=64)),
]


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


def gloo_rate(nbytes: int, reps: int = 15) -> float:
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


def _checks(rank: int, world: int, reps: int) -> list[float]:
    import torch.distributed as dist

    from streamsync.plan.finite import nonfinite

    tensors = list(MODEL.hf_state(seed=rank).items())
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        nonfinite(tensors)
        times.append(time.perf_counter() - t0)
    return times


def check_rate(reps: int = 5) -> float:
    """Bytes/s of one process's finite check (`plan.check.nonfinite`, what `check_finite` runs before a push) of
    the benchmark model's tensors (median) while every core checks too."""
    from streamsync.testing.megatron import launch

    nbytes = sum(t.numel() * t.element_size() for t in MODEL.hf_state(seed=0).values())
    times = [t for r in launch(_checks, os.cpu_count() or 1, reps, timeout=120) for t in r[1:]]
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


def cpu_links(rate: float, copy: float, check: float, cal: dict[str, float] | None = None) -> Links:
    """The cpu model's links from the measured rates and (after calibration) the per-push, per-bucket and
    per-piece CPU costs and the per-push latency (`Links` fields)."""
    gb = rate / 1e9
    cal = cal or {}
    # colocated: the workers on the trainer ranks' node (every process on this one host)
    return Links(nic_gbit=gb * 8, nvlink_gbyte=gb, copy_gbyte=gb, colocated=True, cpu_cores=os.cpu_count() or 1,
                 cpu_tx_ns=1e9 / copy + 1e9 / rate, cpu_rx_ns=1e9 / rate + 2e9 / copy, check_gbyte=check / 1e9,
                 **cal)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """The non-negative x closest to a x = b (least squares over every subset of x free, the rest zero)."""
    best: tuple[float, list[float]] = (float("inf"), [0.0] * len(a[0]))
    n = len(a[0])
    for mask in range(1 << n):
        free = [j for j in range(n) if mask >> j & 1]
        x = [0.0] * n
        if free:
            sol = torch.linalg.lstsq(torch.tensor([[row[j] for j in free] for row in a], dtype=torch.float64),
                                     torch.tensor(b, dtype=torch.float64).unsqueeze(1)).solution.view(-1).tolist()
            if min(sol) < 0:
                continue
            for j, v in zip(free, sol, strict=True):
                x[j] = v
        err = sum((sum(r[j] * x[j] for j in range(n)) - m) ** 2 for r, m in zip(a, b, strict=True))
        if err < best[0] - 1e-18:
            best = (err, x)
    return best[1]


def process_cpu(case: ShardedCase, res: list[dict[str, Any]], pushes: int) -> dict[str, float]:
    """Each process's CPU seconds per push (the mean over the pushes after the first), by the planner's names."""
    steady = range(1, pushes)
    out = {f"trainer rank {r['rank']}": sum(r["cpu_seconds"][i] for i in steady) / len(steady) for r in res}
    names = {e.name: f"e{i}" for i, e in enumerate(case.engines)}
    for key, secs in res[0]["worker_cpu_seconds"].items():
        engine, _, worker = key.rpartition(".w")
        out[f"engine {names[engine]} worker {worker}"] = sum(secs[i] for i in steady) / len(steady)
    return out


def calibrate(rate: float, copy: float, check: float, pushes: int) -> dict[str, Any]:
    """The cpu model's costs, from small cases of their own (never the cases it predicts): every process's CPU
    time per push (its own clock, or /proc for the workers) less what the measured rates charge for its bytes
    and finite check gives the CPU per push, per bucket and per piece (least squares over every process of
    every case); then the per-push latency: what the cases' wall times hold beyond the model's CPU bound."""
    links = cpu_links(rate, copy, check)
    rows: list[dict[str, Any]] = []
    runs = []
    fit: dict[bool, tuple[list[list[float]], list[float]]] = {True: ([], []), False: ([], [])}  # by "sends"
    for case, world, trainer in CALIBS:
        measured, res = _measure(case, world, pushes)
        pred = predict(shape_of(case.model), trainer, Engines(len(case.engines), case.engines[0].tp, per_node=64),
                       links, name=case.name, bucket_bytes=case.chunk_bytes)
        cpu = process_cpu(case, res, pushes)
        for who, secs in cpu.items():
            proc = pred.processes[who]
            sends = who.startswith("trainer")
            own = cpu_seconds(links, proc) + (pred.held.get(int(who.rsplit(" ", 1)[1]), 0) / check if sends else 0.0)
            fit[sends][0].append([1.0, proc["buckets"], proc["pieces"]] + ([proc["control"]] if sends else []))
            fit[sends][1].append((secs - own) * 1e6)
        runs.append((case, trainer, measured))
        rows.append({"case": case.name, "ranks": world, "model": repr(case.model), "bucket_bytes": case.chunk_bytes,
                     "measured_s": measured, "cpu_s": cpu})
    tx, rx = _solve(*fit[True]), _solve(*fit[False])
    cal = {"cpu_push_us": tx[0], "cpu_bucket_us": tx[1], "cpu_piece_us": tx[2], "cpu_control_us": tx[3],
           "cpu_rx_push_us": rx[0], "cpu_rx_bucket_us": rx[1], "cpu_rx_piece_us": rx[2]}
    gaps: tuple[list[list[float]], list[float]] = ([], [])
    for (case, trainer, measured), row in zip(runs, rows, strict=True):
        pred = predict(shape_of(case.model), trainer, Engines(len(case.engines), case.engines[0].tp, per_node=64),
                       cpu_links(rate, copy, check, cal), name=case.name, bucket_bytes=case.chunk_bytes)
        gaps[0].append([1.0, trainer.world - 1.0])
        gaps[1].append((measured - pred.seconds) * 1e3)
        row["cpu_model_s"] = {who: cpu_seconds(cpu_links(rate, copy, check, cal), p)
                              for who, p in pred.processes.items()}
    cal["push_latency_ms"], cal["agree_ms"] = _solve(*gaps)
    return {"cases": rows, **cal}


def shape_of(m: TinyModel) -> Shape:
    return Shape({"model_type": "qwen3", "num_hidden_layers": m.layers, "hidden_size": m.hidden,
                  "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
                  "intermediate_size": m.ffn, "vocab_size": m.vocab, "tie_word_embeddings": m.tie,
                  "torch_dtype": m.dtype})


def gpu_rows(two_gpu: Path, vllm_gpu: Path) -> list[dict[str, Any]]:
    """The planner against the GPU pushes committed in docs/benchmarks, each with the rate its own run measured:
    one rank's push to a receiver on the other GPU of two (NCCL over NVLink, at that run's raw broadcast rate,
    `benchmarks.two_gpu`), and one rank's push into a real vLLM engine on its own GPU (two copies per byte, the
    pack and the worker's load, at that run's copy rate, `benchmarks.vllm_gpu`). Those pushes ran without the
    finite check, so none is counted."""
    rows: list[dict[str, Any]] = []
    if two_gpu.exists():
        for r in json.loads(two_gpu.read_text())["rows"]:
            if r["case"] != "remote-tp1" or not r.get("raw_broadcast_ms"):
                continue
            rate = r["bytes"] / (r["raw_broadcast_ms"] * 1e-3)
            pred = predict(Shape(PRESETS["qwen3-8b"]), Trainer(), Engines(1, 1, first_gpu=1),  # GPU 0 -> GPU 1
                           Links(nvlink_gbyte=rate / 1e9, colocated=True), name="qwen3-8b",
                           bucket_bytes=r["chunk_bytes"])
            rows.append({"case": f"two H200: {r['model']}, {r.get('protocol', '')}", "source": two_gpu.name,
                         "bytes": r["bytes"], "plan_bytes": pred.plan_bytes, "rate_Bps": rate,
                         "measured_s": r["push_ms_window4"] * 1e-3, "predicted_s": pred.seconds,
                         "ratio": r["push_ms_window4"] * 1e-3 / pred.seconds, "bound": pred.bound})
    if vllm_gpu.exists():
        d = json.loads(vllm_gpu.read_text())
        shapes = {"8b": dict(PRESETS["qwen3-8b"]), "moe": {**PRESETS["qwen3-30b-a3b"], "num_hidden_layers": 12}}
        for r in d["rows"]:
            if r["case"] not in shapes:
                continue
            copy = d["copy_rate_Bps"] / 2 / 2  # the rate counts bytes read and written; two copies per byte
            pred = predict(Shape(shapes[r["case"]]), Trainer(), Engines(1, 1),
                           Links(copy_gbyte=copy / 1e9, colocated=True), name=r["case"])
            rows.append({"case": f"one H200, real vLLM: {r['label']}", "source": vllm_gpu.name, "bytes": r["bytes"],
                         "plan_bytes": pred.plan_bytes, "rate_Bps": d["copy_rate_Bps"],
                         "measured_s": r["steady_push_ms"] * 1e-3, "predicted_s": pred.seconds,
                         "ratio": r["steady_push_ms"] * 1e-3 / pred.seconds, "bound": pred.bound})
    return rows


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
    ap.add_argument("--pushes", type=int, default=10)
    ap.add_argument("--cases", default=",".join(c.name for c, _, _ in CASES))
    ap.add_argument("--json", type=Path, default=Path("docs/benchmarks/cpu-sharded.json"))
    ap.add_argument("--two-gpu-json", type=Path, default=Path("docs/benchmarks/h200x2.json"))
    ap.add_argument("--vllm-gpu-json", type=Path, default=Path("docs/benchmarks/h200-vllm.json"))
    args = ap.parse_args()
    rate = gloo_rate(8 << 20)
    copy = copy_rate(8 << 20)
    check = check_rate()
    print(f"gloo loopback, one pair, 8 MiB messages: {rate / 1e9:.3f} GB/s; a copy on every core at once: "
          f"{copy / 1e9:.2f} GB/s each ({os.cpu_count()} cores); the finite check on every core at once: "
          f"{check / 1e9:.2f} GB/s each")
    calib = calibrate(rate, copy, check, max(args.pushes, 8))
    cal = {k: v for k, v in calib.items() if k != "cases"}
    print(f"calibration ({[round(c['measured_s'] * 1e3, 1) for c in calib['cases']]} ms): a trainer rank's CPU "
          f"{cal['cpu_push_us']:.0f} us per push, {cal['cpu_bucket_us']:.0f} us per bucket, "
          f"{cal['cpu_piece_us']:.0f} us per piece, rank 0 {cal['cpu_control_us']:.0f} us per bucket per worker; "
          f"a worker's {cal['cpu_rx_push_us']:.0f} us per push, {cal['cpu_rx_bucket_us']:.0f} us per bucket, "
          f"{cal['cpu_rx_piece_us']:.0f} us per piece; beyond the CPU bound {cal['push_latency_ms']:.1f} ms per push "
          f"and {cal['agree_ms']:.1f} ms per trainer rank beyond the first")
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
                                     ("cpu", cpu_links(rate, copy, check, cal)))}
        link = preds["link"]
        row = {"case": case.name, "ranks": world, "engines": engines.describe(), "bytes": link.plan_bytes,
               "sent_by_plan": res[0]["sent_bytes"], "exact": res[0]["exact"], "measured_s": measured,
               "pushes_s": [max(r["seconds"][i] for r in res) for i in range(args.pushes)],
               **{f"predicted_{k}_s": p.seconds for k, p in preds.items()},
               **{f"ratio_{k}": measured / p.seconds for k, p in preds.items()},
               "bound_link": link.bound, "bound_cpu": preds["cpu"].bound,
               "check_s": preds["cpu"].check_seconds, "cpu_s": process_cpu(case, res, args.pushes),
               "cpu_model_s": {who: cpu_seconds(cpu_links(rate, copy, check, cal), p)
                               + preds["cpu"].held.get(int(who.rsplit(" ", 1)[1]), 0) / check * who.startswith("t")
                               for who, p in preds["cpu"].processes.items()},
               "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"{case.name:16s} {world} ranks  {link.plan_bytes / 1e6:8.1f} MB  measured {measured:.3f} s  "
              + "  ".join(f"{k} {p.seconds:.3f} s (x{measured / p.seconds:.2f})" for k, p in preds.items())
              + f"  exact {all(res[0]['exact'])}")
    gpu = gpu_rows(args.two_gpu_json, args.vllm_gpu_json)
    for g in gpu:
        print(f"{g['case'][:60]:60s} {g['bytes'] / 1e9:6.2f} GB  measured {g['measured_s'] * 1e3:.1f} ms  predicted "
              f"{g['predicted_s'] * 1e3:.1f} ms (x{g['ratio']:.2f}, {g['bound']['kind']})")
    write_json(args.json, {"gloo_rate_Bps": rate, "copy_Bps": copy, "check_Bps": check, "cores": os.cpu_count(),
                           "model": repr(MODEL), "calibration": calib, "rows": rows, "gpu_rows": gpu})


if __name__ == "__main__":
    main()
