"""`BlockingWeightSync`: `WeightSync` for plain synchronous training loops.

Most trainers (Megatron-LM, torchtitan, plain PyTorch scripts) are synchronous Python. `anyio.run(sync.push,
model)` once per step does not work: engines keep connections, locks and sessions bound to the event loop
they were made in, and every `anyio.run` makes a new loop. `BlockingWeightSync` runs one event loop in a
background thread for its whole life (anyio's blocking portal) and every call is run there:

    sync = BlockingWeightSync(engines, source_options={"hf_config": cfg})
    sync.connect()
    for step in range(steps):
        train_step(model)
        report = sync.push(model, version=step)
        with sync.paused():
            sync.push(model)
    sync.close()

Calls may come from any thread; pushes are serialized (one at a time, as with `WeightSync`).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from .engines.base import Engine
from .errors import StreamSyncError
from .report import PushReport
from .sync import WeightSync
from .transports.base import Transport

T = TypeVar("T")


def _stop(cm: AbstractContextManager[BlockingPortal]) -> None:
    cm.__exit__(None, None, None)


class BlockingWeightSync:
    """A `WeightSync` driven from plain (non-async) Python. Takes exactly `WeightSync`'s arguments.

    `connect`, `push`, `paused` and `close` block until done and may be called any number of times, from
    any thread that is not running an event loop (inside one, `await` a `WeightSync` instead). `close` ends
    the background loop; a later call starts a new one (the engines reconnect).
    """

    def __init__(self, engines: Sequence[Engine] = (), transport: str | Transport = "auto", **kwargs: Any) -> None:
        self.sync = WeightSync(engines, transport, **kwargs)  # argument errors surface here, in the caller
        self._portal: BlockingPortal | None = None
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._finalizer: weakref.finalize | None = None
        self._mutex = threading.Lock()

    # -- the background loop ---------------------------------------------------------------------------

    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any, what: str) -> T:
        _refuse_inside_event_loop(what)
        return self._ensure_portal().call(fn, *args)

    def _ensure_portal(self) -> BlockingPortal:
        with self._mutex:
            if self._portal is None:
                cm = start_blocking_portal(name="streamsync-loop")
                self._portal = cm.__enter__()
                self._portal_cm = cm
                # A sync dropped without close(): stop its loop thread when it is collected.
                self._finalizer = weakref.finalize(self, _stop, cm)
            return self._portal

    # -- WeightSync's API, blocking --------------------------------------------------------------------

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `await fn(*args)` on the sync's loop and return its result: for engine calls (e.g. an engine's
        `get_version`), whose connections belong to that loop."""
        return self._run(fn, *args, what="call")

    def connect(self, model: object | None = None) -> None:
        """Set up the transport and every engine, and plan `model`'s push where given (see `WeightSync.connect`)."""
        self._run(self.sync.connect, model, what="connect")

    def push(self, model: object, *, version: int | None = None, max_inflight: int | None = None) -> PushReport:
        """Stream `model` into every engine and return its report (see `WeightSync.push`)."""

        async def push() -> PushReport:
            return await self.sync.push(model, version=version, max_inflight=max_inflight)

        return self._run(push, what="push")

    @contextmanager
    def paused(self, mode: str = "keep", clear_cache: bool = False) -> Iterator[None]:
        """Pause generation on every engine for the body; resume even if the body raised."""
        _refuse_inside_event_loop("paused")
        with self._ensure_portal().wrap_async_context_manager(self.sync.paused(mode, clear_cache)):
            yield

    def close(self) -> None:
        """Close the transport and engine connections, then stop the background loop. Idempotent."""
        _refuse_inside_event_loop("close")
        with self._mutex:
            portal, cm, fin = self._portal, self._portal_cm, self._finalizer
            self._portal = self._portal_cm = self._finalizer = None
        if portal is None or cm is None:
            return
        try:
            portal.call(self.sync.close)
        finally:
            if fin is not None:
                fin.detach()
            _stop(cm)

    def __enter__(self) -> BlockingWeightSync:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- read-only views of the wrapped sync -----------------------------------------------------------

    @property
    def version(self) -> int:
        """The last version pushed (or the engines' highest version at connect)."""
        return self.sync.version

    @property
    def engines(self) -> list[Engine]:
        return self.sync.engines

    @property
    def connected(self) -> bool:
        return self.sync.connected

    def forget(self) -> None:
        """Drop the cached source and plan (see `WeightSync.forget`)."""
        self.sync.forget()


def _refuse_inside_event_loop(what: str) -> None:
    """Blocking on the loop's own thread would deadlock it: point async callers to `await`."""
    lib = running_event_loop()
    if lib is not None:
        raise StreamSyncError(
            f"BlockingWeightSync.{what}() called inside a running {lib} event loop, which it would block: "
            "use WeightSync there and await it (`await sync.push(model)`, `async with sync.paused()`)")


def running_event_loop() -> str | None:
    """The async library running an event loop in this thread, if any."""
    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
            return "trio"
        except RuntimeError:
            pass
    return None
