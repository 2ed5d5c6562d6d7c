"""`Messages`: builds each engine's `UpdateMessage` for a chunk, once, in the send stage.

The layout a message names is the transport's for that engine where it has one (one copy: only the packed
part), else the plan's; for an engine that declared its own fused tensors (`Fused.fused_layout`: vLLM-style
`qkv_proj`, `gate_up_proj`, stacked MoE experts) it is converted into them where some run of the chunk's
packed tensors makes one up (`pack.fuse_layout`), so an MoE layer arrives as a few large tensors instead of
hundreds. The bytes are the same. The conversion of a layout is made once per engine and layout key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..cache import BoundedCache
from ..message import ChunkHandle, UpdateMessage
from ..pack import Fusion, Layout, fuse_layout
from ..plan.chunk import ChunkPlan, layout_key

_Fused = tuple[Layout, Mapping[str, Any], str]


class Messages:
    """One per connection of a WeightSync: `fusions[i]` is engine i's fused layout (None: HF names only)."""

    def __init__(self, fusions: Sequence[dict[str, Fusion] | None]) -> None:
        self.fusions = list(fusions)
        # per engine: layout key -> its fused layout (or None: nothing in it fuses)
        self._fused: list[BoundedCache[str, _Fused | None]] = [BoundedCache(4096) for _ in self.fusions]

    def build(self, push_id: str, version: int, owner: str | None, plan: ChunkPlan, hold: Sequence[str],
              handles: Sequence[ChunkHandle], *, fuse: bool = True,
              delta: Mapping[str, Any] | None = None) -> list[UpdateMessage]:
        """Each engine's message for the chunk; `fuse`: in the engine's fused layout where it has one; `delta`:
        the delta mark every engine's message carries (`UpdateMessage.delta`)."""
        if len(handles) != len(self.fusions):
            raise ValueError(f"{len(handles)} handles for {len(self.fusions)} engines")
        out = []
        for i, h in enumerate(handles):
            if h.layout is not None and h.layout_json is not None and h.layout_key is not None:
                layout, js, key = h.layout, h.layout_json, h.layout_key
            else:
                layout, js, key = plan.layout, plan.layout_json, plan.layout_key
            fused = self._fuse(i, layout, key) if fuse else None
            if fused is not None:
                layout, js, key = fused
            out.append(UpdateMessage(push_id, version, plan.index, layout, js, key, h.data, owner, tuple(hold), delta))
        return out

    def _fuse(self, engine: int, layout: Layout, key: str) -> _Fused | None:
        fusions = self.fusions[engine]
        if not fusions:
            return None
        cache = self._fused[engine]
        if key in cache:
            return cache[key]
        fused = fuse_layout(layout, fusions)
        hit: _Fused | None = None
        if fused is not None:
            js = fused.to_json()
            hit = (fused, js, layout_key(js))
        cache[key] = hit
        return hit
