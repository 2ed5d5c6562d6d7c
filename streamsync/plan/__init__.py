"""Planning a push: chunks of whole layers by a byte budget, their packed layouts, and the checks made
before any byte moves."""

from .chunk import ChunkPlan, layout_key
from .chunking import Item, layer_index, order_key, plan_chunks, row_parts, split_layers

__all__ = ["ChunkPlan", "Item", "layer_index", "layout_key", "order_key", "plan_chunks", "row_parts", "split_layers"]
