"""The one way streamsync changes a vLLM class: `wrap_method` replaces a method by a wrapper made around it, once,
and marks the wrapper (`MARK`), so that a second call (the plugin runs in every process, a client may be built
twice) finds it wrapped and leaves it. Used for the engine core's round end (`core.rpc`), its prefix-cache reset
(`core.prefix_cache`) and the in-process client's dispatch signal (`engines.vllm.inproc`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: set on every wrapper streamsync puts on a vLLM class
MARK = "__streamsync__"


def wrapped(fn: object) -> bool:
    """Whether `fn` is a wrapper of streamsync's."""
    return bool(getattr(fn, MARK, False))


def wrap_method(cls: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]],
                when: Callable[[Callable[..., Any]], bool] | None = None) -> bool:
    """`cls.name = make(original)`, with the original's name and doc, marked; True where it is wrapped (now or
    before), False where `cls` has no such method, `when(original)` says no, or the class takes no attribute."""
    orig = getattr(cls, name, None)
    if not callable(orig):
        return False
    if wrapped(orig):
        return True
    if when is not None and not when(orig):
        return False
    new = functools.wraps(orig)(make(orig))
    setattr(new, MARK, True)
    try:
        setattr(cls, name, new)
    except (AttributeError, TypeError):  # a class that takes no attributes
        return False
    return True
