"""`Planner`: a model's push plan for these engines, made once and kept while the model stays the same object.

It knows what the engines expect (`learn`, at connect: the tensors each expects, the model classes it serves,
the layers it does not load) and checks every plan against that before a byte moves; where the engines hold
another dtype than the trainer, the plan casts as vLLM's loaders cast a checkpoint (`Checks.strict_dtypes`
refuses instead).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio

from ..engines.abilities import Checkpointed, Family, Fused
from ..engines.base import Declined, Engine
from ..errors import StreamSyncError, ValidationError
from ..log import get_logger
from ..options import Checks, PushOptions
from ..pack import dtype_name
from ..pipeline.stages import check_converted
from ..report import GiB, MiB
from ..sources import GatheredElsewhere, ModuleSource, Source, as_source, is_fsdp1
from ..sources.sharded import ShardedSource
from ..transports.base import Primes, Transport
from .check import Expected, check_family, check_plan, dtype_casts
from .chunk import ChunkPlan
from .chunking import split_layers


class Planner:
    """The source and chunk plan of a push, and what the engines expect of it."""

    def __init__(self) -> None:
        self.expected: dict[str, Expected] = {}  # engine -> the tensors it expects (name -> dtype, shape)
        self.declined: dict[str, Declined] = {}  # engine -> the layers it does not load (MTP layers)
        self.architectures: dict[str, tuple[str, ...]] = {}  # engine -> the model classes it serves
        self.casts: dict[str, int] = {}  # what the current plan casts to the engines' dtypes ("a -> b": tensors)
        self._warned_cast = False
        self._cache: tuple[tuple[int | None, ...], object, Source, list[ChunkPlan]] | None = None
        self._hold: tuple[list[ChunkPlan], dict[int, list[str]]] | None = None

    async def learn(self, e: Engine, timeout: float) -> dict[str, Any] | None:
        """What engine `e` expects a push to carry, from its answers at connect; returns its fused layout (the
        JSON `Fused.fused_layout` gives) for the messages."""
        if isinstance(e, Checkpointed):
            with anyio.fail_after(timeout):
                exp = await e.expected_weights()
            if exp is not None:
                self.expected[e.name] = exp
        if isinstance(e, Family):
            with anyio.fail_after(timeout):
                served = await e.architectures()
            if served:
                self.architectures[e.name] = served
            with anyio.fail_after(timeout):
                declined = await e.declined_layers()
            if declined is not None:
                self.declined[e.name] = declined
        if not isinstance(e, Fused):
            return None
        with anyio.fail_after(timeout):
            return await e.fused_layout()

    def plan(self, model: object, transport: Transport | None, options: PushOptions, checks: Checks, *,
             by_reference: bool = True) -> tuple[Source, list[ChunkPlan]]:
        """`WeightSync.plan`: the source and chunk plan a push of `model` would use, kept for the next push of
        the same model object (key: its id and the byte budgets, which may change between pushes).
        `by_reference=False` (a sync that pushes deltas packs every byte): chunks of the packed budget only."""
        ref_bytes = transport.ref_chunk_bytes if transport is not None and by_reference else None
        key = (tuple(map(id, model)) if isinstance(model, list | tuple) else (id(model),)) + (options.chunk_bytes,
                                                                                               ref_bytes)
        # an FSDP1 model's tensors are gathered afresh by every push (`as_source`): nothing of it is kept
        reuse = options.reuse_plan and not is_fsdp1(model)
        if reuse and self._cache is not None and self._cache[0] == key:
            _, _, source, plans = self._cache
            return source, plans
        source = as_source(model, **options.source_options)
        if isinstance(source, GatheredElsewhere):  # a rank whose tensors another rank gathered and sends
            return source, []
        budget = options.chunk_bytes or (GiB if source.device.type == "cuda" else 64 * MiB)
        if transport is not None:  # sharded sending: what this rank sends of it (collective there)
            source = transport.source_for(source, budget)
        plans = source.plan(budget, ref_bytes=max(ref_bytes, budget) if ref_bytes else None)
        self.casts = {}
        casts = None if checks.strict_dtypes else dtype_casts(source.delivers(plans), self.expected)
        if casts and not isinstance(model, Source):  # in the engines' dtypes, as vLLM's loaders would cast
            source, plans = self._cast(model, source, plans, casts, budget, ref_bytes, transport, options)
        check_family(source.architectures, self.architectures)
        check_plan(source.delivers(plans), self.expected, once=not isinstance(source, ShardedSource),
                   declined=self.declined)
        if reuse:  # the model itself is kept too, so its id cannot be reused by another object
            self._cache = (key, model, source, plans)
        return source, plans

    async def prepare(self, source: Source, plans: list[ChunkPlan], transport: Transport, engines: Sequence[Engine],
                      timeout: float, checked: dict[int, tuple[ChunkPlan, Sequence[Any]]], *, prime: bool) -> None:
        """`connect(model)`, where a gather is the sender's own tensors: gather and convert every chunk once, so
        that the first push finds the views the source keeps between pushes made and checked against the plan
        (`checked`: `pipeline.check_converted`'s record), and, with `prime`, send each chunk's references ahead
        to the engines that take them (`Transport.prime`). No byte moves."""
        primer = transport if prime and isinstance(transport, Primes) and transport.begin_prime(source, engines) \
            else None
        primed, ok = 0, False
        t0 = time.perf_counter()
        try:
            for p in plans:
                try:
                    with anyio.fail_after(timeout):
                        tensors = await source.convert(p, await source.gather(p), cast=False)
                except StreamSyncError:
                    raise
                except Exception as e:
                    raise ValidationError(f"chunk {p.index} of the model (first tensor {p.names[0]!r}) cannot "
                                          f"be gathered and converted: {type(e).__name__}: {e}") from e
                check_converted(checked, p, tensors)
                if primer is not None:
                    primed += int(await primer.prime(p, tensors, engines, timeout) > 0)
            ok = True
        finally:
            if primer is not None:
                primer.end_prime(ok)
        if primed:
            get_logger().info("references sent ahead of the first push", chunks=primed, of=len(plans),
                              ms=round((time.perf_counter() - t0) * 1e3, 1))

    def forget(self) -> None:
        """Drop the kept source and plan: the next push plans again."""
        self._cache = None

    def hold(self, source: Source, plans: list[ChunkPlan]) -> dict[int, list[str]]:
        """Chunk -> names of its tensors whose decoder layer continues in a later chunk (`pipeline.PushJob.hold`)."""
        if self._hold is None or self._hold[0] is not plans:
            self._hold = (plans, split_layers([p.names for p in source.delivers(plans)]))
        return self._hold[1]

    def _cast(self, model: object, source: Source, plans: Sequence[ChunkPlan], casts: dict[str, str], budget: int,
              ref_bytes: int | None, transport: Transport | None, options: PushOptions
              ) -> tuple[Source, list[ChunkPlan]]:
        """The source made again with the engines' dtypes (`Checks.strict_dtypes`): one per tensor for a module,
        the engines' dtype for a Megatron model (its float32 expert bias keeps float32 by its mapping)."""
        held = {s.name: dtype_name(s.dtype) for p in source.delivers(plans) for s in p.specs}
        counts = Counter(f"{held[n]} -> {d}" for n, d in casts.items())
        dtype: object = casts if isinstance(source, ModuleSource) else Counter(casts.values()).most_common(1)[0][0]
        cast = as_source(model, **{**options.source_options, "dtype": dtype})
        if transport is not None:
            cast = transport.source_for(cast, budget)
        self.casts = dict(counts)
        if not self._warned_cast:
            self._warned_cast = True
            get_logger().warning("casting the trainer's tensors to the engines' dtype, as vLLM's loaders cast a "
                                 "checkpoint", casts=self.casts,
                                 strict="WeightSync(strict_dtypes=True) refuses instead")
        return cast, cast.plan(budget, ref_bytes=max(ref_bytes, budget) if ref_bytes else None)
