"""What a spec's tables build: the trainer model, what changes its weights before each push, the engines,
the WeightSync."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from ..report import MiB
from ..sync import WeightSync
from .spec import HfCheckpoint, ReceiverEngineSpec, SyncSpec, SyntheticQwen3, VllmHttpEngineSpec

ModelBuilder = Callable[[Any, Path], Any]

StepRunner = Callable[[Any, Any, int], None]  # (model, model table, step) before each push

EngineBuilder = Callable[[Any, Any, AsyncExitStack, Path], Awaitable[Any]]


def _synthetic_qwen3(cfg: SyntheticQwen3, work: Path) -> Any:
    from ..models.synthetic import StateModule, qwen3_specs

    shape = cfg.model_dump(exclude={"kind", "seed"})
    return StateModule(qwen3_specs(**shape), fill="random", seed=cfg.seed)


def _hf_checkpoint(cfg: HfCheckpoint, work: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the runner says what it builds; a bar on stderr buries its errors
    return AutoModelForCausalLM.from_pretrained(cfg.path, dtype=getattr(torch, cfg.dtype))


def _perturb(model: Any, cfg: Any, step: int) -> None:
    from ..models.synthetic import perturb_

    perturb_(model, step)  # what a training step does to the weights


def _hf_step(model: Any, cfg: HfCheckpoint, step: int) -> None:
    if cfg.update == "perturb":
        _perturb(model, cfg, step)
    elif cfg.update == "train":
        from transformers import AutoTokenizer

        from .training import training_step

        training_step(model, model, AutoTokenizer.from_pretrained(cfg.path), cfg.train_text, cfg.lr)


async def _receiver(cfg: ReceiverEngineSpec, model: Any, stack: AsyncExitStack, work: Path) -> Any:
    from ..models.synthetic import save_specs
    from ..receiver.process import ReceiverProcess

    specs = save_specs(model.specs(), work / "model-specs.json")
    proc = stack.enter_context(ReceiverProcess(str(specs), name=cfg.name))
    return proc.engine(timeout=cfg.timeout)


async def _vllm_http(cfg: VllmHttpEngineSpec, model: Any, stack: AsyncExitStack, work: Path) -> Any:
    from ..engines.vllm import VllmHttpEngine

    # The spec names the variable, so the key itself never sits in a file or on a command line.
    key = os.environ[cfg.api_key_env] if cfg.api_key_env else None
    return VllmHttpEngine(cfg.url, name=cfg.label, timeout=cfg.timeout, api_key=key)


MODELS: dict[str, ModelBuilder] = {"synthetic-qwen3": _synthetic_qwen3, "hf-checkpoint": _hf_checkpoint}

STEPS: dict[str, StepRunner] = {"synthetic-qwen3": _perturb, "hf-checkpoint": _hf_step}

ENGINES: dict[str, EngineBuilder] = {"receiver": _receiver, "vllm-http": _vllm_http}


def make_sync(engines: list[Any], scfg: SyncSpec, work: Path, **kwargs: Any) -> WeightSync:
    """The WeightSync a spec's [sync] table describes (shared by the demo)."""
    return WeightSync(
        engines, transport=scfg.transport,
        chunk_bytes=int(scfg.chunk_mib * MiB) if scfg.chunk_mib is not None else None,
        max_inflight=scfg.max_inflight, timeout=scfg.timeout,
        trace_dir=scfg.trace_dir or str(work / "traces"), **kwargs,
    )
