"""The non-finite check a default push runs before any byte moves: the Triton kernel against the per-tensor norms,
on the trainer shapes of `benchmarks.cuda` (an HF-named module: one allocation per tensor), beside the one-copy
floor of the same bytes (one read and one write at the device copy rate measured in the same run).

    python -m benchmarks.finite_check --json finite.json

Both ways must name the same tensors: a NaN, an inf and a -inf are put into three tensors and found. The tensors
are passed as a push passes them (`Source.local_tensors`: a `StableList`, known again by its identity), so a
timed check is its launches and its answer, not the working out of which tensors it takes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import cuda as bc
from benchmarks.report import commit
from streamsync.cache import StableList
from streamsync.plan.finite import nonfinite


def _time(named: list[tuple[str, torch.Tensor]], kernel: bool, repeat: int) -> list[float]:
    out = []
    for _ in range(1 + repeat):
        bc._sync()
        t0 = time.perf_counter()
        nonfinite(named, kernel=kernel)
        out.append(time.perf_counter() - t0)
    return out


def run(models: list[str], repeat: int) -> dict[str, Any]:
    rate = bc.copy_rate()
    rows = []
    for key in models:
        model = bc.build_module(bc.SHAPES[key])
        named = StableList((n, p.detach()) for n, p in model.named_parameters())
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        floor = 2 * nbytes / rate
        row: dict[str, Any] = {"model": key, "tensors": len(named), "bytes": nbytes, "one_copy_floor_ms": floor * 1e3}
        for way, kernel in (("kernel", True), ("norms", False)):
            t = _time(named, kernel, repeat)
            row[f"{way}_first_ms"] = t[0] * 1e3
            row[f"{way}_ms"] = statistics.median(t[1:]) * 1e3
            row[f"{way}_over_floor"] = statistics.median(t[1:]) / floor
        picks = [named[i][0] for i in (3, len(named) // 2, len(named) - 1)]
        with torch.no_grad():
            for n, v in zip(picks, (float("nan"), float("inf"), -float("inf")), strict=True):
                dict(named)[n].view(-1)[-1] = v
        row["found_kernel"] = nonfinite(named, kernel=True) == picks
        row["found_norms"] = nonfinite(named, kernel=False) == picks
        rows.append(row)
        bc.log(f"{key}: {len(named)} tensors, {nbytes / 1e9:.2f} GB; kernel {row['kernel_ms']:.2f} ms, "
               f"norms {row['norms_ms']:.2f} ms, one-copy floor {floor * 1e3:.2f} ms; found {row['found_kernel']}")
        del model, named
        bc._free_cached()
    return {"commit": commit(), "machine": torch.cuda.get_device_name() if bc._cuda() else "cpu",
            "torch": torch.__version__,
            "copy_rate_Bps": rate, "repeat": repeat, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--models", type=lambda s: s.split(","), default=["8b", "moe", "moonlight"],
                    help="trainer shapes of benchmarks.cuda.SHAPES, comma-separated")
    ap.add_argument("--repeat", type=int, default=7, help="timed checks per way (after one not counted)")
    args = ap.parse_args()
    result = run(args.models, args.repeat)
    print("\n| model | tensors | GB | kernel | norms | one-copy floor | kernel / floor | found |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['model']} | {r['tensors']} | {r['bytes'] / 1e9:.2f} | {r['kernel_ms']:.2f} ms | "
              f"{r['norms_ms']:.2f} ms | {r['one_copy_floor_ms']:.2f} ms | {r['kernel_over_floor']:.2f}x | "
              f"{r['found_kernel'] and r['found_norms']} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
