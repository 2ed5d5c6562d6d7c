"""Which event loop runs this code: its identity (`current_loop`: what a `WeightSync` binds its engine connections
to at connect) and its library (`running_library`: what `BlockingWeightSync` refuses to block)."""

from __future__ import annotations

import asyncio
import sys


def current_loop() -> object | None:
    """The running event loop (asyncio) or trio run, as an identity."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
    return None


def running_library() -> str | None:
    """The async library running an event loop in this thread, if any."""
    loop = current_loop()
    if loop is None:
        return None
    return "asyncio" if isinstance(loop, asyncio.AbstractEventLoop) else "trio"
