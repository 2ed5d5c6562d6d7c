"""A prefix-cache reset that visits only the KV blocks that hold a hash.

Every push ends with a prefix-cache reset (KV computed with the old weights must not be reused). vLLM's
`BlockPool.reset_prefix_cache` drops its hash map and then calls `reset_hash()` on every KV block of the
pool, in Python: O(blocks), not O(cached blocks). A small model in a large KV cache has millions of blocks
(the tiny Qwen3 at gpu_memory_utilization 0.35 of an H200: 3 M blocks, 143 ms per reset, against about 9 ms
for the rest of its push). A block holds a hash exactly while the pool's hash map lists it (the map is
where `_insert_block_hash` puts it, eviction takes it out of both), so the blocks the map lists are the
only ones whose `reset_hash()` does anything.

`install()` wraps vLLM's own method: for the duration of the call the pool's `blocks` iterate as the blocks
of the hash map (indexing and length stay the whole list's), and everything else the method does (its check
that no block is in use, events, metrics, its return value) is vLLM's. It is installed by the `vllm.general_plugins`
entry point (so in the engine-core process, where the scheduler's pool lives), only where vLLM's method
still has the loop it shortens and the pool the attributes it reads; `STREAMSYNC_FAST_PREFIX_RESET=0` leaves
vLLM's method alone.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..patches import wrap_method

ENV = "STREAMSYNC_FAST_PREFIX_RESET"


class HashedBlocks:
    """Stands in for a pool's `blocks` during a reset: iterates the hashed blocks only; indexes and sizes as
    the whole list."""

    __slots__ = ("all", "hashed")

    def __init__(self, all_blocks: list[Any], hashed: list[Any]) -> None:
        self.all = all_blocks
        self.hashed = hashed

    def __iter__(self) -> Iterator[Any]:
        return iter(self.hashed)

    def __getitem__(self, i: Any) -> Any:
        return self.all[i]

    def __len__(self) -> int:
        return len(self.all)


def hashed_blocks(pool: Any) -> list[Any] | None:
    """The blocks the pool's hash map lists (each once), or None where the pool is not laid out as expected."""
    cache = getattr(getattr(pool, "cached_block_hash_to_block", None), "_cache", None)
    if not isinstance(cache, dict) or not isinstance(getattr(pool, "blocks", None), list):
        return None
    out: dict[int, Any] = {}
    for v in cache.values():
        for b in v.values() if isinstance(v, dict) else (v,):
            out[id(b)] = b
    return list(out.values())


def _shortens(method: Any) -> bool:
    """vLLM's reset still walks every block to reset its hash (the loop this shortens)."""
    try:
        src = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return "for block in self.blocks" in src and "reset_hash()" in src


def install() -> bool:
    """Wrap `BlockPool.reset_prefix_cache` (idempotent); False where it is left as vLLM's."""
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        from vllm.v1.core.block_pool import BlockPool
    except ImportError:
        return False

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
            blocks = self.blocks
            hashed = hashed_blocks(self)  # taken before vLLM drops the map
            if hashed is None:
                return orig(self, *args, **kwargs)
            self.blocks = HashedBlocks(blocks, hashed)
            try:
                return orig(self, *args, **kwargs)
            finally:
                self.blocks = blocks
        return reset_prefix_cache

    return wrap_method(BlockPool, "reset_prefix_cache", make, when=_shortens)
