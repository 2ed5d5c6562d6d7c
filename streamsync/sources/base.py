"""Where weights come from. A source plans chunks up front, then gathers and converts them one by one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..cache import StableList
from ..plan.chunk import ChunkPlan
from ..plan.shards import Shards


def addresses(tensors: Iterable[torch.Tensor], device: torch.device) -> set[int]:
    """The storage addresses of `tensors` on `device` that hold elements (no tensor objects made: an MoE model
    has thousands of parameters, and this runs every push)."""
    want = -1 if device.type == "cpu" else (device.index if device.index is not None else torch.cuda.current_device())
    return {int(t.data_ptr() - t.storage_offset() * t.element_size()) for t in tensors
            if t.get_device() == want and t.numel()}


class AddressCache:
    """`addresses` of a source's own tensors, computed again only when one of their data pointers moved (one
    pass of `data_ptr` over thousands of parameters, instead of five calls each). A storage swapped under an
    unchanged data pointer keeps its old address here: its tensors are then packed, never misread."""

    def __init__(self) -> None:
        self._key: tuple[list[int], torch.device] | None = None
        self._value: set[int] = set()

    def get(self, tensors: list[torch.Tensor], device: torch.device) -> set[int]:
        key = (list(map(torch.Tensor.data_ptr, tensors)), device)
        if key != self._key:
            self._key, self._value = key, addresses(tensors, device)
        return self._value


class DetachedCache:
    """A source's own tensors detached, as one list made again only when one of them moved, changed size,
    dtype or contiguity (a pass of four attribute reads over thousands of parameters each push, instead of a
    new tensor object each: `detach` is most of an MoE trainer's host time before a push). The list is a
    `StableList`: the finite check knows it again by its identity."""

    def __init__(self) -> None:
        self._key: tuple[list[Any], ...] | None = None
        self._value: StableList[tuple[str, torch.Tensor]] = StableList()

    def get(self, names: Sequence[str], tensors: Sequence[torch.Tensor],
            detach: Callable[[str, torch.Tensor], torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        T = torch.Tensor
        key = (list(names), list(map(T.data_ptr, tensors)), list(map(T.numel, tensors)),
               [t.dtype for t in tensors], list(map(T.is_contiguous, tensors)))
        if key != self._key:
            self._key, self._value = key, StableList((n, detach(n, t)) for n, t in zip(names, tensors, strict=True))
        return self._value


class Source(ABC):
    """A model seen as a stream of HF-named tensors.

    Contract: `plan` is pure (no collectives) and returns the same plan on every rank of a model-parallel
    group; `gather` for the chunks is called in plan order on every rank (collectives line up); `convert`
    returns one tensor per spec of the chunk, with exactly the spec's dtype and shape. With `cast=False` a
    floating tensor may keep another floating dtype: the pack stage casts it while it copies (the same
    rounding as `.to`), which saves a kernel, an allocation and a copy per cast tensor. A `convert` may hand
    back the list it returned for the chunk before (its cached views); it must then hold the same tensors at the
    same addresses, shapes and strides: transports key their per-chunk work (destination views, captured
    copies, references) by that list's identity.
    """

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def plan(self, chunk_bytes: int, *, ref_bytes: int | None = None) -> list[ChunkPlan]:
        """Chunks of at most `chunk_bytes` packed bytes. `ref_bytes`: where a transport sends the source's own
        tensors by reference (`Transport.ref_chunk_bytes`), the budget of referenced bytes per chunk; a source
        that cannot tell which tensors are plain views of its own may plan by `chunk_bytes` alone."""

    @abstractmethod
    async def gather(self, chunk: ChunkPlan) -> object: ...

    @abstractmethod
    async def convert(self, chunk: ChunkPlan, gathered: object, *, cast: bool = True) -> Sequence[torch.Tensor]: ...

    #: the HF model classes this source's tensors are a model of (`DeepseekV3ForCausalLM`, ...); empty where
    #: the source cannot say. An engine serving none of them is refused before bytes move.
    architectures: tuple[str, ...] = ()

    @property
    def gathers_here(self) -> bool:
        """Gathers are plain work on the event loop (the sender's own tensors: no collective, no thread). On a GPU
        the pipeline then gathers a chunk only once the requests of the one before it left for the engines:
        gathering it earlier would hold the chunk before back on the same loop (an MoE chunk's gather checks
        thousands of parameters)."""
        return False

    def local_tensors(self) -> Sequence[tuple[str, torch.Tensor]]:
        """(name, tensor) of every weight this rank holds and will contribute, for checks before a push
        (names as the trainer knows them). Empty where a source cannot say. Runs every push: a source may hand
        back the list it made before while its tensors have not moved (`DetachedCache`); callers do not edit it."""
        return ()

    def local_addresses(self, device: torch.device) -> set[int]:
        """Storage addresses of the tensors `local_tensors` yields that lie on `device` and hold elements: the
        storages a transport may send by reference (CUDA IPC one copy). Computed every push."""
        return addresses((t for _, t in self.local_tensors()), device)

    def shards(self) -> Shards | None:
        """What every trainer rank holds, for sharded sending (`plan.shards`): None where the source cannot
        say (a push then goes through a single sender)."""
        return None

    def delivers(self, plans: Sequence[ChunkPlan]) -> Sequence[ChunkPlan]:
        """The chunks as the engines receive them (checked against what they hold; the layers they complete):
        `plans` themselves, except where a rank sends pieces of tensors (a sharded source: per bucket, the
        whole tensors it completes)."""
        return plans

    def begin_push(self) -> None:  # noqa: B027 - a notification
        """A push of this source's plan starts (a plan is reused across pushes): reset per-push counters."""

    @property
    def is_sender(self) -> bool:
        """False on ranks that take part in gathers but send nothing (non-zero TP/PP/EP ranks)."""
        return True

    @property
    def collectives(self) -> int:
        """How many collectives the gathers issued so far (0 for a local model)."""
        return 0
