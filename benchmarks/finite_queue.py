"""What queuing the finite check costs the host, per push, over many tensors: a plain list (the check keys its
tile table by every tensor's address, size, dtype and layout) against the `StableList` a source hands out (known
again by its identity), with the time until the answer is ready. The default is an MoE's tensor count on a GPU
(16.2 GB of bf16 in 4,719 tensors); a NaN and an inf are then put in and found both ways.

    python -m benchmarks.finite_queue --json finite-queue.json            # 4,719 tensors
    python -m benchmarks.finite_queue --tensors 399 --json q399.json     # an 8B's count

It imports only torch (and Triton) and the check's own modules, not the package, so it runs on a GPU machine
with nothing installed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parent.parent / "streamsync"


def _finite() -> Any:
    # the package's __init__ imports anyio, structlog and more; the check needs none of them
    for name in ("streamsync", "streamsync.receiver"):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(_ROOT.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = pkg
    return importlib.import_module("streamsync.plan.finite"), importlib.import_module("streamsync.cache")


def run(count: int, total_bytes: int, repeat: int) -> dict[str, Any]:
    finite, cache = _finite()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    each = max(1, total_bytes // 2 // count)
    ts = [torch.randn(each, dtype=torch.bfloat16, device=dev) for _ in range(count)]
    stable = cache.StableList((f"t{i}", t) for i, t in enumerate(ts))
    rows = []
    for label, named in (("plain list", list(stable)), ("StableList", stable)):
        finite.nonfinite(named)  # tables made, kernel built
        queue, answer = [], []
        for _ in range(repeat):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            pending = finite.launch(named)
            t1 = time.perf_counter()
            assert pending.names() == []
            queue.append(t1 - t0)
            answer.append(time.perf_counter() - t0)
        rows.append({"list": label, "queue_ms": statistics.median(queue) * 1e3,
                     "answered_ms": statistics.median(answer) * 1e3})
    ts[count // 2][5] = float("nan")
    ts[-1][-1] = float("inf")
    want = [f"t{count // 2}", f"t{count - 1}"]
    found = finite.launch(stable).names() == want and finite.launch(list(stable)).names() == want
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "tensors": count,
            "bytes": each * 2 * count, "repeat": repeat, "found_both_ways": found, "rows": rows,
            "commit": os.environ.get("STREAMSYNC_COMMIT")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.finite_queue", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=4719)
    ap.add_argument("--gbytes", type=float, default=16.2, help="bytes in all (GB; on CPU 2 KiB a tensor instead)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    total = int(args.gbytes * 1e9) if torch.cuda.is_available() else args.tensors * 2048
    result = run(args.tensors, total, args.repeat)
    print(f"{result['device']}, {result['tensors']} tensors, {result['bytes'] / 1e9:.2f} GB; "
          f"NaN and inf found both ways: {result['found_both_ways']}")
    print("list        queue (host) ms  answered ms")
    for r in result["rows"]:
        print(f"{r['list']:<11} {r['queue_ms']:<16.2f} {r['answered_ms']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
