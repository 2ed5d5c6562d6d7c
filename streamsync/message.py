"""The chunk message: what one engine receives for one chunk of a push.

The send stage builds each engine's `UpdateMessage` once, from the chunk's plan and the handle the transport
made for that engine (`ChunkHandle`); transports deliver it and engines serialize it (`wire()`), nobody edits
it on the way. The wire form is plain data (JSON-able), the `update_info` every receiver validates:

    {"push_id", "version", "chunk", "layout": {...}, "layout_key", "handle": {...}, "owner"?, "hold"?, "delta"?}

`layout` is the packed layout of the bytes the handle names (the plan's, the part of it a transport packs
when other tensors go by reference, or the engine's own fused layout of either); `layout_key` its digest, by
which a receiver that parsed the layout before may be sent the key alone (`wire(layout=False)`). `delta` marks
the chunks of a sync that pushes deltas (`streamsync.receiver.base_copy`): keep what a full push loads, or
apply the chunk's pieces onto the push named as its base.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .pack import Layout


@dataclass(frozen=True, slots=True)
class ChunkHandle:
    """What a transport gives one engine for one chunk: plain data naming where the bytes are, and the layout
    of those bytes where it is not the plan's (one copy: only the packed part; references ride in `data`)."""

    data: Mapping[str, Any]
    layout: Layout | None = None
    layout_json: Mapping[str, Any] | None = None
    layout_key: str | None = None


@dataclass(frozen=True, slots=True)
class UpdateMessage:
    """One chunk's update for one engine (module doc)."""

    push_id: str
    version: int
    chunk: int
    layout: Layout = field(repr=False)
    layout_json: Mapping[str, Any] = field(repr=False)
    layout_key: str
    handle: Mapping[str, Any] = field(repr=False)
    owner: str | None = None
    #: names of the chunk's tensors whose decoder layer continues in a later chunk: a receiver must not keep
    #: views of them past its update call (the sender reuses the buffer)
    hold: tuple[str, ...] = ()
    #: a delta sender's mark: {"chunks", "keep": True} for a full push, {"chunks", "base", "entries"} for a delta
    delta: Mapping[str, Any] | None = field(default=None, repr=False)

    def wire(self, *, layout: bool = True) -> dict[str, Any]:
        """The plain-data form receivers validate; `layout=False` sends the layout by its key only."""
        out: dict[str, Any] = {"push_id": self.push_id, "version": self.version, "chunk": self.chunk,
                               "layout_key": self.layout_key, "handle": self.handle}
        if layout:
            out["layout"] = self.layout_json
        if self.owner is not None:
            out["owner"] = self.owner
        if self.hold:
            out["hold"] = list(self.hold)
        if self.delta is not None:
            out["delta"] = self.delta
        return out


class Recipient(Protocol):
    """What a transport delivers a chunk to: an engine, or the pipeline's lane for it in the trace."""

    @property
    def name(self) -> str: ...

    async def update(self, message: UpdateMessage) -> None: ...


def wire(message: UpdateMessage | Mapping[str, Any], *, layout: bool = True) -> dict[str, Any]:
    """`message.wire()`, or a plain dict as given (tests of a receiver's validation send hand-made ones)."""
    if isinstance(message, UpdateMessage):
        return message.wire(layout=layout)
    out = dict(message)
    if not layout:
        out.pop("layout", None)
    return out
