"""Delta pushes: per tensor, the changed elements against the version every engine holds, or the tensor whole
(docs/delta.md). `codec` encodes and decodes one tensor; `shadow` is what the sender keeps to find what
changed; receivers keep the base they apply onto in `streamsync.receiver.base_copy`."""

from .auto import AutoDelta
from .codec import DeltaRefused, refused
from .shadow import ChunkDelta, Shadow

__all__ = ["AutoDelta", "ChunkDelta", "DeltaRefused", "Shadow", "refused"]
