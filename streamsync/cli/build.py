"""What a spec's tables build: the trainer model, the engines, the WeightSync."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from ..report import MiB
from ..sync import WeightSync
from .spec import ReceiverEngineSpec, SyncSpec, SyntheticQwen3

ModelBuilder = Callable[[Any, Path], Any]

EngineBuilder = Callable[[Any, Any, AsyncExitStack, Path], Awaitable[Any]]


def _synthetic_qwen3(cfg: SyntheticQwen3, work: Path) -> Any:
    from ..models.synthetic import StateModule, qwen3_specs

    shape = cfg.model_dump(exclude={"kind", "seed"})
    return StateModule(qwen3_specs(**shape), fill="random", seed=cfg.seed)


async def _receiver(cfg: ReceiverEngineSpec, model: Any, stack: AsyncExitStack, work: Path) -> Any:
    from ..models.synthetic import save_specs
    from ..receiver.process import ReceiverProcess

    specs = save_specs(model.specs(), work / "model-specs.json")
    proc = stack.enter_context(ReceiverProcess(str(specs), name=cfg.name))
    return proc.engine(timeout=cfg.timeout)


MODELS: dict[str, ModelBuilder] = {"synthetic-qwen3": _synthetic_qwen3}

ENGINES: dict[str, EngineBuilder] = {"receiver": _receiver}


def make_sync(engines: list[Any], scfg: SyncSpec, work: Path, **kwargs: Any) -> WeightSync:
    """The WeightSync a spec's [sync] table describes (shared by the demo)."""
    return WeightSync(
        engines, transport=scfg.transport,
        chunk_bytes=int(scfg.chunk_mib * MiB) if scfg.chunk_mib is not None else None,
        max_inflight=scfg.max_inflight, timeout=scfg.timeout,
        trace_dir=scfg.trace_dir or str(work / "traces"), **kwargs,
    )
