"""A chunk's plan: the HF tensors it carries, their packed layout and its key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ..pack import Layout, TensorSpec, plan_layout


def layout_key(layout_json: dict) -> str:
    """A short digest of a layout's JSON: updates name a layout a receiver has seen by it."""
    return hashlib.blake2b(json.dumps(layout_json).encode(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk: the HF tensors it will carry (in pack order), their packed layout and source keys."""

    index: int
    specs: tuple[TensorSpec, ...]
    keys: tuple[object, ...]
    layout: Layout = field(init=False)

    layout_json: dict = field(init=False, repr=False)
    layout_key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", plan_layout(self.specs))
        object.__setattr__(self, "layout_json", self.layout.to_json())  # sent with every push of this plan
        object.__setattr__(self, "layout_key", layout_key(self.layout_json))  # receivers reuse what they parsed

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]
