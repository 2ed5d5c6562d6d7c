"""Weight sources: plain modules, and Megatron-core models (sharded over TP/PP/EP)."""

from __future__ import annotations

from ..plan.chunk import ChunkPlan
from .base import Source
from .module import ModuleSource


def as_source(model: object, **kwargs: object) -> Source:
    """Pick the source for `model`: a Source as is, a megatron-core model (or its list of virtual-pipeline
    chunks) through MegatronSource, any other `nn.Module` through ModuleSource."""
    if isinstance(model, Source):
        return model
    if _is_megatron(model):
        from .megatron import MegatronSource

        return MegatronSource(model, **kwargs)  # type: ignore[arg-type]
    import torch

    if isinstance(model, torch.nn.Module):
        return ModuleSource(model, **kwargs)  # type: ignore[arg-type]
    raise TypeError(f"cannot push a {type(model).__name__}: expected a torch.nn.Module or a Source")


def _is_megatron(model: object) -> bool:
    first = model[0] if isinstance(model, list | tuple) and model else model
    return type(first).__module__.startswith("megatron.")


__all__ = ["ChunkPlan", "ModuleSource", "Source", "as_source"]
