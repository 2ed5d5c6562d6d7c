"""Host time to build one-copy reference views on a mapped storage, with and without the per-storage cache of
the storage viewed as each dtype (`streamsync.transports.refs.reference_view`'s `typed`).

A receiver's first one-copy push builds one such view per referenced tensor; later pushes reuse them. This
probe builds `--refs` of them (half plain 2-D views, half blocked views like Q of a fused QKV) on one storage,
both ways, and prints the host time per reference and the ratio. It runs anywhere: a CPU storage stands in for
a mapped one (the host work is the same).

    python -m benchmarks.ref_view_cost [--refs 2000] [--repeat 7] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import write_json
from streamsync.transports.refs import reference_view


def references(n: int) -> list[list[Any]]:
    """`n` references on one 64 MiB storage, in the wire format (hf name, dtype, hf shape, storage token, byte
    offset, view shape, view strides): plain ones, and blocked ones (4 of every 6 row blocks of a fused QKV)."""
    refs: list[list[Any]] = []
    for i in range(n):
        if i % 2:
            refs.append([f"l{i}.q", "bfloat16", [1024, 1024], "ab" * 8, (i % 16) * (2 << 20), [1024, 1024],
                         [1024, 1]])
        else:
            refs.append([f"l{i}.q", "bfloat16", [1024, 128], "ab" * 8, (i % 16) * (2 << 20), [8, 128, 128],
                         [24 * 128, 128, 1]])
    return refs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ref_view_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refs", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    storage = torch.zeros(64 << 20, dtype=torch.uint8)
    refs = references(args.refs)
    out: dict[str, Any] = {"refs": len(refs)}
    for label, cache in (("slice per reference", False), ("typed storage cache", True)):
        best = float("inf")
        for _ in range(args.repeat):
            typed: dict | None = {} if cache else None
            t0 = time.perf_counter()
            for r in refs:
                reference_view(r, storage, "bench", typed)
            best = min(best, (time.perf_counter() - t0) / len(refs))
        out[label] = {"us_per_ref": best * 1e6}
        print(f"{label:22s} {best * 1e6:6.2f} us per reference (best of {args.repeat})")
    out["ratio"] = out["slice per reference"]["us_per_ref"] / out["typed storage cache"]["us_per_ref"]
    print(f"ratio {out['ratio']:.2f}x")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
