"""What every benchmark command leaves behind (its JSON), and the counts a push's trace carries."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamsync.report import PushReport

#: a push's one-copy counts (`refs.*` in its trace): tensors sent by reference, tensors packed, storages
#: exported, milliseconds spent exporting them
REF_COUNTS = ("referenced", "packed", "exports", "export_ms")


def commit() -> str | None:
    """The code a result came from: `STREAMSYNC_COMMIT` where the command sets it (a copy of the checkout on
    another machine may carry a stale `.git`), else the checkout's HEAD."""
    if os.environ.get("STREAMSYNC_COMMIT"):
        return os.environ["STREAMSYNC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def median_ms(fn: Callable[[], Any], repeat: int, sync: Callable[[], Any] | None = None) -> float:
    """The median wall clock of `repeat` calls of `fn` after one not counted, in milliseconds; `sync` (a device's
    synchronize) is called before each call and inside its timing, so queued device work counts."""
    fn()
    ts = []
    for _ in range(repeat):
        if sync is not None:
            sync()
        t = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    """Write `result` to `path` (parents made) and say where; nothing when no path was asked for."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")


def ref_counts(report: PushReport) -> dict[str, int]:
    """One push's one-copy counts, read from its trace (zeros where nothing went by reference)."""
    counts = report.trace.counts if report.trace is not None else {}
    return {k: counts.get(f"refs.{k}", 0) for k in REF_COUNTS}


def pack_graphs(report: PushReport) -> dict[str, int]:
    """One push's captured packs on the sender, read from its trace: graphs captured, packs replayed from one."""
    counts = report.trace.counts if report.trace is not None else {}
    return {k: counts.get(f"pack_graphs_{k}", 0) for k in ("captured", "replayed")}
