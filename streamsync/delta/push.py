"""`DeltaPush`: one push of a sync that pushes deltas, as the pack stage sees it.

A "full" push (the first, every `full_every`-th, and any push after which not every engine holds the shadow's
version whole) sends every byte as usual and copies each chunk into the shadow; its messages say `keep`, so
receivers keep what they load as the next base. A "delta" push encodes each chunk against the shadow: the
pieces go in place of the tensors, and the messages carry the base and the entries (a sharded push: the base and
`sharded`; each sending rank's headers carry its pieces' entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import torch

from ..plan.chunk import ChunkPlan
from .shadow import PieceShadow, Shadow

Mode = Literal["full", "delta"]


@dataclass
class DeltaPush:
    shadow: Shadow | PieceShadow
    mode: Mode
    chunks: int
    #: the (version, push id) the deltas are computed against (delta mode)
    base: tuple[int, str] | None = None
    verify: bool = True
    #: the served model's bytes and where engines keep their copy of it (a full push's mark: `Deltas.engine_base`)
    model_bytes: int = 0
    engine_base: str = "auto"
    #: delta="auto": why this push goes as it does (`delta.auto.AutoDelta`)
    auto: str | None = None
    #: why a push of a delta sync is full ("first push", "every 32 pushes", "engine x holds no base", ...)
    why_full: str | None = None
    wire_bytes: int = 0
    changed: int = 0
    elements: int = 0
    encodings: dict[str, int] = field(default_factory=dict)

    async def prepare(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor]
                      ) -> tuple[ChunkPlan, Sequence[torch.Tensor], dict[str, Any]]:
        """What the chunk sends (its plan, tensors) and the mark its messages carry. Runs in a worker thread:
        a diff reads the whole chunk."""
        sharded = {"sharded": True} if isinstance(self.shadow, PieceShadow) else {}
        if self.mode == "full":
            await anyio.to_thread.run_sync(self.shadow.seed, plan, tensors)
            self.wire_bytes += plan.nbytes
            return plan, tensors, {"chunks": self.chunks, "keep": True, "bytes": self.model_bytes,
                                   "engine_base": self.engine_base, **sharded}
        assert self.base is not None
        d = await anyio.to_thread.run_sync(lambda: self.shadow.encode(plan, tensors, verify=self.verify))
        self.wire_bytes += d.wire.nbytes
        self.changed += d.changed
        self.elements += d.elements
        for k, v in d.encodings.items():
            self.encodings[k] = self.encodings.get(k, 0) + v
        # A sharded delta's entries travel in each sending rank's headers, not in trainer rank 0's messages.
        entries = {"sharded": True} if sharded else {"entries": d.entries}
        return d.wire, d.tensors, {"chunks": self.chunks, "base": list(self.base), **entries}
