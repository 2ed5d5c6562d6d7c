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
    of (name, tensor) pairs (vLLM's own `load_weights` input) as named tensors, and an FSDP1 model by its full
    state dict (`_fsdp1_state`). `dtype` may be a torch dtype or its name ("bfloat16"), or for a module a
    mapping of HF name to either (the dtype each floating tensor goes in; the rest go as they are)."""
    if isinstance(model, Source):
        return model
    if "dtype" in kwargs:
        dt = kwargs["dtype"]
        kwargs = {**kwargs, "dtype": {n: as_dtype(d) for n, d in dt.items()} if isinstance(dt, Mapping)
                  else as_dtype(dt)}
    model = unwrap(model)
    if is_fsdp1(model):
        model = _fsdp1_state(model)
        if not model:  # a rank other than 0: its part was the gather
            return GatheredElsewhere()
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
    `torch.compile` (`._orig_mod`), nested in any order. FSDP1 stays wrapped (its flat parameters are not the
    model's tensors): `as_source` takes its full state dict (`_fsdp1_state`)."""
    import torch

    for _ in range(8):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        else:
            break
    return model


def is_fsdp1(model: object) -> bool:
    """An FSDP1 (`FullyShardedDataParallel`) model, once training wrappers are taken off (`unwrap`)."""
    return type(unwrap(model)).__name__ == "FullyShardedDataParallel"


def _fsdp1_state(model: Any) -> dict[str, Any]:
    """An FSDP1 (`FullyShardedDataParallel`) model's weights: its flat parameters are shards of no HF tensor, so
    its full state dict is gathered, as FSDP's own FULL_STATE_DICT does it (a collective: every rank pushes, as
    with a Megatron model; rank 0 gets the tensors, on the model's device, and sends them; the other ranks get
    none and pass `engines=[]`). Rank 0 holds one full copy of the weights for the push; FSDP2
    (`fully_shard`) needs none."""
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

    cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    import torch

    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}  # not FSDP's extra state


class GatheredElsewhere(Source):
    """A rank whose tensors another rank sends (FSDP1's full state dict is gathered on rank 0): nothing to plan,
    gather or send here."""

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cpu")

    def plan(self, chunk_bytes: int, *, ref_bytes: int | None = None) -> list[ChunkPlan]:
        return []

    async def gather(self, chunk: ChunkPlan) -> object:
        raise AssertionError("a rank that sends nothing gathers nothing")

    async def convert(self, chunk: ChunkPlan, gathered: object, *, cast: bool = True) -> Any:
        raise AssertionError("a rank that sends nothing converts nothing")

    @property
    def is_sender(self) -> bool:
        return False


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


__all__ = ["ChunkPlan", "GatheredElsewhere", "ModuleSource", "Source", "as_source", "is_fsdp1", "unwrap"]
