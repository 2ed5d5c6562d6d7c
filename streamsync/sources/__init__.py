"""Weight sources: plain modules, and Megatron-core models (sharded over TP/PP/EP)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ValidationError
from ..plan.chunk import ChunkPlan
from .base import Source
from .module import ModuleSource


def as_source(model: object, **kwargs: object) -> Source:
    """Pick the source for `model`: a Source as is, a megatron-core model (or its list of virtual-pipeline
    chunks) through MegatronSource, any other `nn.Module` through ModuleSource (DDP, DataParallel and
    `torch.compile` wrappers unwrapped: their parameters are the wrapped module's), a state dict or an iterable
    of (name, tensor) pairs (vLLM's own `load_weights` input) as named tensors. `dtype` may be a torch dtype
    or its name ("bfloat16")."""
    if isinstance(model, Source):
        return model
    if "dtype" in kwargs:
        kwargs = {**kwargs, "dtype": as_dtype(kwargs["dtype"])}
    model = unwrap(model)
    if _is_megatron(model):
        from .megatron import MegatronSource

        return MegatronSource(model, **kwargs)  # type: ignore[arg-type]
    import torch

    if isinstance(model, torch.nn.Module):
        return ModuleSource(model, **kwargs)  # type: ignore[arg-type]
    named = _named_tensors(model)
    if named is not None:
        return ModuleSource(named, **kwargs)  # type: ignore[arg-type]
    raise TypeError(f"cannot push a {type(model).__name__}: expected a torch.nn.Module (or a list of megatron-core "
                    "model chunks), a state dict, an iterable of (name, tensor) pairs, or a Source")


def as_dtype(dtype: object) -> object:
    """A torch dtype from a dtype or its name ("bfloat16", "torch.float16"); None stays None."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        got = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(got, torch.dtype):
            return got
    raise ValidationError(f"source_options dtype must be a torch dtype or its name (e.g. 'bfloat16'), "
                          f"got {dtype!r:.60}")


def unwrap(model: object) -> object:
    """The module a training wrapper holds: DistributedDataParallel / DataParallel (`.module`) and
    `torch.compile` (`._orig_mod`), nested in any order. FSDP1 is refused: its flat parameters are not the
    model's tensors."""
    import torch

    for _ in range(8):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        else:
            break
    if type(model).__name__ == "FullyShardedDataParallel":
        raise ValidationError("an FSDP1 (FullyShardedDataParallel) model cannot be pushed: its parameters are flat "
                              "shards. Use FSDP2 (torch.distributed.fsdp.fully_shard), or push "
                              "model.state_dict() taken under FULL_STATE_DICT")
    return model


def _named_tensors(model: object) -> dict[str, Any] | None:
    """A state dict or an iterable of (name, tensor) pairs as a dict, checked; None for anything else."""
    import torch

    if isinstance(model, Mapping):
        items = list(model.items())
    elif isinstance(model, Iterable) and not isinstance(model, str | bytes | torch.Tensor):
        items = list(model)
        if not all(isinstance(x, tuple | list) and len(x) == 2 for x in items):
            return None
    else:
        return None
    out: dict[str, Any] = {}
    for name, t in items:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValidationError(f"a state dict to push maps names to tensors; got {name!r:.60} -> "
                                  f"{type(t).__name__}")
        if name in out:
            raise ValidationError(f"tensor {name!r} is given twice")
        out[name] = t
    return out


def _is_megatron(model: object) -> bool:
    first = model[0] if isinstance(model, list | tuple) and model else model
    return type(first).__module__.startswith("megatron.")


__all__ = ["ChunkPlan", "ModuleSource", "Source", "as_source"]
