"""`BoundedCache`: the one cache helper. A mapping that keeps at most `maxsize` entries, dropping the least
recently used first. `StableList`: a list whose identity stands for its contents, for caches keyed by it.

Why bounded everywhere: the caches streamsync keeps across pushes (parsed layouts, views, captured graphs,
reference sets) are keyed by what a push looked like (layout keys, addresses). A trainer whose chunking or
storages keep changing would otherwise grow them without end; a steady trainer hits the same few keys every
push and never notices the bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import ItemsView, Iterator, MutableMapping, ValuesView
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")


class StableList(list[T]):
    """A list its maker makes anew whenever what it holds changes, and never edits: a later user may take the
    same object (held by a weak reference, which keeps nothing alive) for the same contents."""

    __slots__ = ("__weakref__",)


class BoundedCache(MutableMapping[K, V]):
    """A least-recently-used mapping of at most `maxsize` entries; reads (`get`, `[]`) count as uses."""

    __slots__ = ("_data", "maxsize")

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()

    def __getitem__(self, key: K) -> V:
        value = self._data[key]
        self._data.move_to_end(key)
        return value

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    # Iterating is not a use: these read the entries without reordering them (which would also break the
    # iteration itself).
    def items(self) -> ItemsView[K, V]:
        return self._data.items()

    def values(self) -> ValuesView[V]:
        return self._data.values()

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()

    def __repr__(self) -> str:
        return f"BoundedCache({len(self._data)}/{self.maxsize})"
