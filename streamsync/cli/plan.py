"""`streamsync plan`: the sharded push a model shape, a trainer layout and engine layouts give, and its
predicted time (`plan.scale`). Shapes only: no tensor is allocated."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from ..plan.scale import Engines, Links, Prediction, Trainer, predict
from ..plan.shapes import PRESETS, Shape, load_shape


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan a sharded push for a model shape and layouts; print bytes and time",
                       description="Plans a sharded push (transport 'p2p') from shapes alone and predicts its time "
                       "as the busiest link's bytes / rate (docs/scale.md). Presets: " + ", ".join(PRESETS))
    p.add_argument("model", help="an HF config.json path or a preset name")
    p.add_argument("--trainer", default="tp=1", help="'tp=8,pp=4,ep=8,dp=8' (or ranks=N) or 'fsdp=N'")
    p.add_argument("--trainer-per-node", type=int, default=8, help="trainer GPUs per node")
    p.add_argument("--engines", type=int, default=1, help="engines (model replicas)")
    p.add_argument("--engine-tp", type=int, default=1, help="tensor parallel size of each engine")
    p.add_argument("--engine-ep", type=int, default=1, help="expert parallel size (vLLM: EP = DP x TP)")
    p.add_argument("--engine-per-node", type=int, default=8, help="engine GPUs per node")
    p.add_argument("--colocated", action="store_true",
                   help="engine GPUs are the trainer's GPUs (worker g on rank g's GPU + --engine-first-gpu)")
    p.add_argument("--one-host", action="store_true",
                   help="trainer and engines on this one machine (no NIC between them; a CPU host: with "
                   "--cpu-cores and --host-gbyte); default: trainer and engines on separate nodes")
    p.add_argument("--engine-first-gpu", type=int, default=0,
                   help="with --colocated: the trainer GPU of worker 0 (e.g. 4: trainer on GPUs 0-3, engines on 4-7)")
    p.add_argument("--nic-gbit", "--nic-gbps", dest="nic_gbit", type=float, default=400.0,
                   help="NIC rate per GPU, gigabits/s per direction (400 = 50 GB/s)")
    p.add_argument("--nvlink-gbyte", type=float, default=450.0, help="NVLink per GPU, GB/s per direction")
    p.add_argument("--copy-gbyte", type=float, default=1000.0,
                   help="same-GPU rate (colocated), GB/s of bytes moved: each is copied twice (packed, then loaded), "
                   "so about a quarter of a device's read+write copy rate (an H200: 4200 GB/s)")
    p.add_argument("--host-gbyte", type=float, default=None,
                   help="cap on what one node's processes move together, GB/s (a CPU host); unset: none")
    p.add_argument("--bucket-latency-us", type=float, default=0.0, help="fixed cost per bucket (lock-step rounds)")
    p.add_argument("--push-latency-ms", type=float, default=0.0, help="fixed cost per push")
    p.add_argument("--agree-ms", type=float, default=0.0,
                   help="the trainer ranks' agreement before a push, per rank beyond the first")
    p.add_argument("--cpu-cores", type=int, default=None,
                   help="a CPU host: its processes share this many cores per node (then --cpu-*-ns/us count)")
    p.add_argument("--cpu-tx-ns", type=float, default=0.0, help="CPU ns per byte a trainer rank sends")
    p.add_argument("--cpu-rx-ns", type=float, default=0.0, help="CPU ns per byte an engine worker receives")
    for side, who in (("", "trainer rank"), ("rx-", "engine worker")):
        p.add_argument(f"--cpu-{side}push-us", type=float, default=0.0, help=f"CPU us per push per {who}")
        p.add_argument(f"--cpu-{side}bucket-us", type=float, default=0.0,
                       help=f"CPU us per bucket per {who} taking part")
        p.add_argument(f"--cpu-{side}piece-us", type=float, default=0.0, help=f"CPU us per piece per {who}")
    p.add_argument("--cpu-control-us", type=float, default=0.0,
                   help="CPU us on the rank holding the engines per bucket per worker taking part")
    p.add_argument("--check-gbyte", type=float, default=2000.0,
                   help="each trainer rank's NaN/inf scan of what it holds before a push, GB/s (an H200 scans "
                   "about 2000: docs/benchmarks/h200.json); 0: the push skips it (check_finite=False)")
    p.add_argument("--bucket-mib", type=float, default=256.0, help="bytes per sender per bucket, MiB")
    p.add_argument("--dtype", default=None, help="wire dtype instead of the config's (e.g. float8_e4m3fn)")
    p.add_argument("--full", action="store_true", help="plan every layer (default: one layer per kind and stage)")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")


def run(args: argparse.Namespace) -> int:
    cfg = load_shape(args.model)
    if args.dtype:
        cfg["torch_dtype"] = args.dtype
    links = Links(**{f.name: getattr(args, f.name) for f in fields(Links)})
    pred = predict(Shape(cfg), Trainer.parse(args.trainer, args.trainer_per_node),
                   Engines(args.engines, args.engine_tp, args.engine_ep, args.engine_per_node, args.engine_first_gpu),
                   links, name=args.model, bucket_bytes=int(args.bucket_mib * (1 << 20)), full=args.full)
    said = assumed(links, args)
    if args.json:
        print(json.dumps({**pred.summary(), "assumed": {k: v.strip() for k, _, v in
                                                        (line.partition(" ") for line in said)}}, indent=2))
    else:
        print(render(pred) + "\n" + "\n".join(said))
    return 0


def assumed(lk: Links, args: argparse.Namespace) -> list[str]:
    """What the prediction assumed, in words, and how to replace the assumptions with this machine's rates."""
    where = ("trainer and engines on one machine" if lk.one_host else
             "engines on the trainer's GPUs (colocated)" if lk.colocated else
             f"trainer and engines on separate nodes ({args.trainer_per_node} trainer / {args.engine_per_node} "
             "engine GPUs a node), linked by NICs")
    rates = (f"NIC {lk.nic_gbit:g} Gbit/s per GPU, NVLink {lk.nvlink_gbyte:g} GB/s, same-GPU {lk.copy_gbyte:g} GB/s"
             + (f", host {lk.host_gbyte:g} GB/s" if lk.host_gbyte else "")
             + (f", {lk.cpu_cores} CPU cores a node shared by its processes" if lk.cpu_cores else ", no CPU bound")
             + (f", finite check {lk.check_gbyte:g} GB/s" if lk.check_gbyte else ", no finite check"))
    calibrated = any(getattr(lk, f.name) != f.default for f in fields(Links)
                     if f.name.startswith("cpu_") and f.name != "cpu_cores")
    lines = [f"assumed          {where}; {rates}"]
    if not calibrated:
        lines.append("calibrate        these are default rates, not this machine's: pass your links' rates "
                     "(--nic-gbit, --nvlink-gbyte, --copy-gbyte); on a CPU host, --one-host --cpu-cores N and the "
                     "--host-gbyte, --check-gbyte and --cpu-* values that `python -m benchmarks.sharded` (a "
                     "checkout) measures and fits on that host (its JSON; docs/scale.md)")
    return lines


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f} GB"


def render(p: Prediction) -> str:
    s = p.summary()
    sent, recv = s["sent_per_rank"], s["received_per_worker"]
    assert isinstance(sent, dict) and isinstance(recv, dict)
    b = p.bound
    how = "every layer" if p.planned_layers == p.layers else "one per kind and stage, counted per layer"
    lines = [f"model {p.shape}: {_gb(p.model_bytes)}; trainer {p.trainer}; engines {p.engines}",
             f"planned {p.planned_layers} of {p.layers} layers ({how}), "
             f"{p.pieces} pieces, ~{p.buckets:g} buckets",
             f"bytes moved      {_gb(p.plan_bytes)} ({p.plan_bytes / p.model_bytes:.2f} x the model)",
             f"sent per rank    max {_gb(sent['max'])}  mean {_gb(sent['mean'])}  min {_gb(sent['min'])}",
             f"recv per worker  max {_gb(recv['max'])}  mean {_gb(recv['mean'])}  min {_gb(recv['min'])}",
             "per link class   " + "  ".join(f"{k} {_gb(v)}" for k, v in p.link_bytes.items()),
             f"bounding link    {b['kind']} of {b['who']}: {_gb(float(b['bytes']))} in {float(b['seconds']):.3f} s",  # type: ignore[arg-type]
             f"predicted push   {p.seconds:.3f} s (every link busy at once; a prediction from link rates, not a "
             "measurement)" + (f", of which {p.check_seconds:.3f} s the finite check before it" if p.check_seconds
                               else ""),
             f"lock-step bound  {p.lockstep_seconds:.3f} s (buckets one after another, each its busiest link)"]
    return "\n".join(lines)
