"""Stand-ins for tensor- and expert-parallel engines: receiver processes that each hold slices of HF tensors.

* `SlicedModule`: a receiver's model holding, per HF tensor, only the boxes one worker holds (`plan.shards`).
  It declares them (`LoadingModule.layout`), and its loader takes whole HF tensors and narrows its boxes out
  of each, as vLLM's weight loaders do (a sharded push fills only those boxes).
* `WorkerGroup`: receiver processes as the workers of one engine (one version, every round on all of them).
* `vllm_layout`: the boxes each worker of a vLLM-style engine holds for a Qwen/Llama-shaped checkpoint at
  tensor parallel size `tp` (experts over the workers when `expert_parallel`): q/k/v rows (k/v replicated where
  `tp` exceeds the kv heads; MLA's q_b_proj / kv_b_proj rows by heads), o_proj and down_proj columns, gate/up
  rows, the padded vocabulary's rows.

    python -m streamsync.receiver.process --specs model.json --module streamsync.testing.sliced:sliced_module \\
        --module-args '{"holds": [[name, [[start...], [size...]]], ...]}'
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import torch

from ..checksum import digests
from ..engines.abilities import KeepsDeltaBase, Pausable, ReadsBack, Sharded
from ..engines.base import Engine, EngineState
from ..engines.receiver import ReceiverEngine
from ..errors import EngineError, ValidationError
from ..message import UpdateMessage
from ..models.synthetic import Spec
from ..pack import dtype_from_name
from ..plan.shards import Box, EngineLayout, Need
from ..plan.vllm_layout import vllm_layout as vllm_layout  # the layouts its engines take
from ..receiver.loaders import Loader, LoadingModule, Weights

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def slice_name(name: str, box: Box, shape: Sequence[int]) -> str:
    """How a worker names the slice it holds in its checksums: the HF name, with the box unless whole."""
    return name if box == Box.whole(shape) else f"{name}{box}"


class _SliceLoader(Loader):
    def __init__(self, module: SlicedModule) -> None:
        self.module = module

    def load(self, weights: Weights) -> list[str]:
        loaded = []
        with torch.no_grad():
            for name, full in weights:
                held = self.module.held.get(name)
                if held is None:
                    raise ValidationError(f"worker holds no part of {name!r}")
                shape, dtype = self.module.shapes[name]
                if tuple(full.shape) != shape or full.dtype != dtype:
                    raise ValidationError(f"parameter {name!r}: received {full.dtype}{tuple(full.shape)}, worker's "
                                          f"tensor is {dtype}{shape}")
                for box, dst in held:
                    dst.copy_(box.view(full))
                loaded.append(name)
        return loaded

    def expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (str(d).removeprefix("torch."), s) for n, (s, d) in self.module.shapes.items()}


class SlicedModule(LoadingModule):
    """Holds `holds` ((HF name, box) pairs) of the tensors in `specs`, zero-filled."""

    def __init__(self, specs: Iterable[Spec], holds: Iterable[tuple[str, Box]], device: str | torch.device = "cpu"
                 ) -> None:
        super().__init__()
        self.shapes = {n: (tuple(int(x) for x in s), dtype_from_name(d)) for n, d, s in specs}
        self.held: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        self.slices = torch.nn.ParameterList()
        for name, box in holds:
            if name not in self.shapes:
                raise ValidationError(f"a worker cannot hold {name!r}: the model has no such tensor")
            shape, dtype = self.shapes[name]
            if not box.within(shape):
                raise ValidationError(f"slice {box} of {name!r} lies outside its shape {list(shape)}")
            t = torch.nn.Parameter(torch.zeros(box.size, dtype=dtype, device=device), requires_grad=False)
            self.slices.append(t)
            self.held.setdefault(name, []).append((box, t.data))

    def loader(self) -> Loader:
        return _SliceLoader(self)

    def layout(self) -> list[tuple[str, Box]] | None:
        return [(n, b) for n, held in self.held.items() for b, _ in held]

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, held in self.held.items():
            for box, t in held:
                yield slice_name(name, box, self.shapes[name][0]), t


def sliced_module(specs: Iterable[Spec], *, device: str = "cpu", tie: bool = False,
                  holds: Sequence[Any] = ()) -> SlicedModule:
    """`--module` factory of the receiver process (`--module-args '{"holds": [[name, box], ...]}'`)."""
    return SlicedModule(specs, [(n, Box.from_json(b)) for n, b in holds], device=device)


def module_args(holds: Iterable[tuple[str, Box]]) -> str:
    return json.dumps({"holds": [[n, b.to_json()] for n, b in holds]})


# ------------------------------------------------------------------------------------------ layouts


def expected_slices(hf: Mapping[str, torch.Tensor], holds: Iterable[tuple[str, Box]]) -> dict[str, str]:
    """The checksums a worker holding `holds` reports once it received `hf`."""
    return digests((slice_name(n, b, tuple(hf[n].shape)), b.view(hf[n])) for n, b in holds)


# ------------------------------------------------------------------------------------------ engine


class WorkerGroup(Engine, Sharded, KeepsDeltaBase, ReadsBack, Pausable):
    """Receiver processes as the workers of one engine: each call goes to every worker (concurrently), the
    version is theirs when they agree, and the layout is theirs, worker by worker."""

    def __init__(self, members: Sequence[ReceiverEngine], name: str) -> None:
        if not members:
            raise ValidationError("a worker group needs at least one worker")
        self.members = list(members)
        self.name = name
        self.workers = len(self.members)
        self.device = self.members[0].device

    async def _each(self, fn: Any) -> list[Any]:
        out: list[Any] = [None] * len(self.members)

        async def one(i: int, m: ReceiverEngine) -> None:
            m.owner = self.owner
            try:
                out[i] = await fn(i, m)
            except Exception as e:  # name the worker: the task group would hide it in an ExceptionGroup
                raise EngineError(self.name, f"worker {i} ({m.name}): {e}") from e

        try:
            async with anyio.create_task_group() as tg:
                for i, m in enumerate(self.members):
                    tg.start_soon(one, i, m)
        except ExceptionGroup as eg:
            raise eg.exceptions[0] from None
        return out

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self._each(lambda i, m: m.init_transfer({**init_info, "worker_rank": i}))

    async def start_update(self) -> None:
        await self._each(lambda i, m: m.start_update())

    async def update(self, message: UpdateMessage | Mapping[str, Any]) -> None:
        await self._each(lambda i, m: m.update(message))

    async def finish_update(self, version: int) -> None:
        await self._each(lambda i, m: m.finish_update(version))

    async def abort_update(self, version: int | None = None) -> None:
        """Every worker's round ends whatever another worker's abort does (a dead worker's fails): a failure is
        raised once every worker was asked, so a live worker never keeps a failed push's round open."""
        failed: list[EngineError] = []

        async def one(i: int, m: ReceiverEngine) -> None:
            try:
                await m.abort_update(version)
            except Exception as e:
                failed.append(EngineError(self.name, f"worker {i} ({m.name}): {e}"))

        async with anyio.create_task_group() as tg:
            for i, m in enumerate(self.members):
                tg.start_soon(one, i, m)
        if failed:
            raise failed[0]

    async def state(self) -> EngineState:
        states = await self._each(lambda i, m: m.state())
        versions = {s.version for s in states}
        mixed = any(s.mixed for s in states) or len(versions) > 1
        failed = next((s.failed_version for s in states if s.failed_version is not None), None)
        return EngineState(None if mixed else versions.pop(), mixed, failed,
                           any(bool(s.updating) for s in states))

    async def get_version(self) -> int | None:
        return (await self.state()).version

    async def delta_base(self) -> tuple[int, str] | None:
        """The push every worker keeps as its delta base (None unless all keep the same one)."""
        held = set(await self._each(lambda i, m: m.delta_base()))
        return held.pop() if len(held) == 1 else None

    async def layout(self) -> EngineLayout | None:
        layouts = await self._each(lambda i, m: m.layout())
        if all(lay is None for lay in layouts):
            return None
        needs = []
        for i, lay in enumerate(layouts):
            if lay is None:
                raise ValidationError(f"engine {self.name!r}: worker {i} declares no layout, the others do")
            needs += [Need(self.name, i, n.name, n.box) for n in lay.needs]
        return EngineLayout(self.name, self.workers, tuple(needs))

    async def holds(self, hf: Mapping[str, torch.Tensor], tied: bool = False) -> bool | None:
        lay = await self.layout()
        if lay is None:
            return all(await self._each(lambda i, m: m.holds(hf, tied)))
        got = await self._each(lambda i, m: m.checksums())
        return all(got[w] == expected_slices(hf, [(n.name, n.box) for n in lay.needs if n.worker == w])
                   for w in range(self.workers))

    async def checksums(self) -> list[dict[str, str]]:
        """Each worker's checksums of the slices it holds."""
        return await self._each(lambda i, m: m.checksums())

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self._each(lambda i, m: m.pause(mode, clear_cache))

    async def resume(self) -> None:
        await self._each(lambda i, m: m.resume())

    async def close(self) -> None:
        await self._each(lambda i, m: m.close())


def total_numel(holds: Iterable[tuple[str, Box]]) -> int:
    return sum(math.prod(b.size) for _, b in holds)
