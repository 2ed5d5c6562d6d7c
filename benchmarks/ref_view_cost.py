"""Host time to build one-copy reference views on a mapped storage, with and without the typed-storage cache
(`RefReceiver._ref_view`). A first one-copy push builds one per referenced tensor: 508 for the Qwen3-8B
shape, 9,340 for the MoE shape. Runs anywhere (a CPU storage stands in for the mapped one: the ops are the
same host work).

    python -m benchmarks.ref_view_cost [--refs 2000] [--json OUT]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.report import write_json
from streamsync.transports.refs import RefReceiver


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--refs", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    storage = torch.zeros(64 << 20, dtype=torch.uint8)
    # q/k/v-like references: plain and blocked (4 of every 6 row blocks of a fused QKV)
    refs = []
    for i in range(args.refs):
        if i % 2:
            refs.append([f"l{i}.q", "bfloat16", [1024, 1024], "ab" * 8, (i % 16) * (2 << 20), [1024, 1024],
                         [1024, 1]])
        else:
            refs.append([f"l{i}.q", "bfloat16", [1024, 128], "ab" * 8, (i % 16) * (2 << 20), [8, 128, 128],
                         [24 * 128, 128, 1]])
    out: dict = {"refs": len(refs)}
    for label, cache in (("slice per reference", False), ("typed storage cache", True)):
        best = float("inf")
        for _ in range(args.repeat):
            typed: dict | None = {} if cache else None
            t0 = time.perf_counter()
            for r in refs:
                RefReceiver._ref_view(r, storage, "bench", typed)
            best = min(best, (time.perf_counter() - t0) / len(refs))
        out[label] = {"us_per_ref": best * 1e6}
        print(f"{label:22s} {best * 1e6:6.2f} us per reference (best of {args.repeat})")
    out["ratio"] = out["slice per reference"]["us_per_ref"] / out["typed storage cache"]["us_per_ref"]
    print(f"ratio {out['ratio']:.2f}x")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
