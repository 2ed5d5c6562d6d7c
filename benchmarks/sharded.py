"""Sharded pushes (transport "p2p") measured against the planner's prediction (`streamsync plan`), in one run.

First the link: a plain gloo send/recv of a buffer of about one bucket's size between two processes on this
host (median of a few sends), the rate `R`. Then each case (real processes: megatron-core TP2 x PP2 over gloo
into two engines of TP2 sliced receiver workers, FSDP2 over 4 ranks into one TP2 engine, a plain module on one
rank into one TP2 engine) pushes `--pushes` times; its time is the median of the pushes after the first. The
prediction is `plan.scale.predict` for the same shape and layouts with every process on one node and two rate
models: `link` (each rank's and worker's own link at R, all at once) and `host` (the whole host moves R in
all: on this two-core machine one sender and one receiver already keep both cores busy, so concurrent pairs
share R). Ratio = measured / predicted.

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
    print(f"gloo loopback, one pair, 8 MiB messages: {rate / 1e9:.3f} GB/s ({os.cpu_count()} cores)")
    rows: list[dict[str, Any]] = []
    for case, world, trainer in CASES:
        if case.name not in args.cases.split(","):
            continue
        case = ShardedCase(**{**case.__dict__, "pushes": args.pushes})
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp, start_engines(case, Path(tmp)) as procs:
            from streamsync.testing.megatron import launch

            res = launch(run_sharded, world, case, endpoints(procs), timeout=240, collective_timeout=case.timeout)
        errors = [r["error"] for r in res if r["error"]]
        if errors:
            raise SystemExit(f"{case.name}: {errors[0]}")
        measured = statistics.median(max(r["seconds"][i] for r in res) for i in range(1, args.pushes))
        engines = Engines(len(case.engines), case.engines[0].tp, per_node=64)
        gb = rate / 1e9
        link = predict(shape_of(MODEL), trainer, engines, Links(nic_gbit=gb * 8, nvlink_gbyte=gb, copy_gbyte=gb),
                       name=case.name, bucket_bytes=case.chunk_bytes)
        host = predict(shape_of(MODEL), trainer, engines,
                       Links(nic_gbit=gb * 8, nvlink_gbyte=gb, copy_gbyte=gb, host_gbyte=gb), name=case.name,
                       bucket_bytes=case.chunk_bytes)
        row = {"case": case.name, "ranks": world, "engines": engines.describe(), "bytes": link.plan_bytes,
               "sent_by_plan": res[0]["sent_bytes"], "exact": res[0]["exact"], "measured_s": measured,
               "pushes_s": [max(r["seconds"][i] for r in res) for i in range(args.pushes)],
               "predicted_link_s": link.seconds, "predicted_host_s": host.seconds,
               "ratio_link": measured / link.seconds, "ratio_host": measured / host.seconds,
               "bound_link": link.bound, "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"{case.name:16s} {world} ranks  {link.plan_bytes / 1e6:8.1f} MB  measured {measured:.3f} s  "
              f"predicted link {link.seconds:.3f} s (x{row['ratio_link']:.2f})  host {host.seconds:.3f} s "
              f"(x{row['ratio_host']:.2f})  exact {all(res[0]['exact'])}")
    write_json(args.json, {"gloo_rate_Bps": rate, "cores": os.cpu_count(), "model": repr(MODEL), "rows": rows})


if __name__ == "__main__":
    main()
