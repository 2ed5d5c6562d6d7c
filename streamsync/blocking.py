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

import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from .engines.base import Engine
from .errors import StreamSyncError
from .interrupts import Terminated, sigterm_raises
from .log import get_logger
from .loops import running_library
from .report import PushReport
from .sync import WeightSync
from .transports.base import Transport

T = TypeVar("T")


def _stop(cm: AbstractContextManager[BlockingPortal], portal: BlockingPortal | None = None,
          sync: WeightSync | None = None) -> None:
    """Stop the loop thread; given the sync, close it on its loop first (a sync dropped without close(), or the
    interpreter exiting after an interrupt: engine sessions and sockets are closed, not left to the collector)."""
    if portal is not None and sync is not None:
        try:
            portal.call(sync.close)
        except BaseException as e:
            get_logger().warning("closing the sync at exit failed", error=f"{type(e).__name__}: {e}")
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
        """Run `fn` on the loop and wait. An interrupt while waiting (Ctrl-C, SIGTERM: `interrupts`, an exception
        raised into this thread) cancels `fn` there and waits, bounded, for it to end (a push's cancellation ends
        its round on every engine) before the interrupt goes on: an engine is never left in an open round."""
        _refuse_inside_event_loop(what)
        portal = self._ensure_portal()
        ended = threading.Event()

        async def call() -> T:
            try:
                return await fn(*args)
            finally:
                ended.set()

        future = portal.start_task_soon(call)
        try:
            with sigterm_raises():
                return future.result()
        except BaseException as interrupt:
            if future.done():
                raise
            future.cancel()  # cancels the task on the loop: its cleanup (the rounds' abort) runs now
            bound = self.sync.timeout + self.sync.abort_timeout
            if ended.wait(bound):
                get_logger().error(f"{what} interrupted ({_named(interrupt)}); its round was ended",
                                   engines_mixed=sorted(self.sync.mixed))
            else:
                get_logger().error(f"{what} interrupted ({_named(interrupt)}); its cancellation did not finish "
                                   f"within {bound:.0f} s", engines_open=sorted(self.sync.open_rounds))
            raise

    def _ensure_portal(self) -> BlockingPortal:
        with self._mutex:
            if self._portal is None:
                cm = start_blocking_portal(name="streamsync-loop")
                self._portal = cm.__enter__()
                self._portal_cm = cm
                # A sync dropped without close(), or the interpreter exiting: close it and stop its loop thread.
                self._finalizer = weakref.finalize(self, _stop, cm, self._portal, self.sync)
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


def _named(interrupt: BaseException) -> str:
    if isinstance(interrupt, KeyboardInterrupt):
        return "KeyboardInterrupt: Ctrl-C"
    if isinstance(interrupt, Terminated):
        return "SIGTERM"
    return type(interrupt).__name__


def _refuse_inside_event_loop(what: str) -> None:
    """Blocking on the loop's own thread would deadlock it: point async callers to `await`."""
    lib = running_library()
    if lib is not None:
        raise StreamSyncError(
            f"BlockingWeightSync.{what}() called inside a running {lib} event loop, which it would block: "
            "use WeightSync there and await it (`await sync.push(model)`, `async with sync.paused()`)")
