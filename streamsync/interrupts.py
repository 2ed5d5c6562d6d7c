"""How a push ends when its process is told to stop: SIGTERM (how Ray, Kubernetes and Slurm stop a trainer) and
Ctrl-C (SIGINT).

Either arriving mid-push must end the push's round as a cancellation does (every engine that opened it marked
mixed, kept paused inside `paused()`, never resumed before its round is ended), then stop the process. Python's
default SIGTERM ends the process at once, with the round left open; so while a push runs:

* the async API, on an asyncio loop in the main thread: SIGTERM cancels the push (`sigterm_cancels`), which
  ends its round, and the push then raises `Terminated` (a SystemExit: status 143, as a process that SIGTERM
  killed reports to a shell);
* the blocking API: SIGTERM raises `Terminated` in the waiting thread (`sigterm_raises`), as Ctrl-C raises
  KeyboardInterrupt there; `BlockingWeightSync` then cancels the push on its loop and waits for the round to end
  before the exception goes on.

A handler the program installed itself is left alone (the program decides), and so is every thread but the
main one (only it receives signals).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: what `Terminated` carries: the exit status of a process that SIGTERM ended
SIGTERM_STATUS = 128 + int(signal.SIGTERM)


class Terminated(SystemExit):
    """SIGTERM arrived during a push; raised once the push's round was ended on every engine."""

    def __init__(self) -> None:
        super().__init__(SIGTERM_STATUS)

    def __str__(self) -> str:
        return ("SIGTERM during a push: the push was cancelled and its round ended (engines that received part "
                "of it are mixed; inside paused() they stay paused until a push makes them whole)")


def _ours() -> bool:
    """Whether this thread may handle SIGTERM for the push: the main thread, the default handler in place."""
    return threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
        signal.SIG_DFL, None)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the body runs (a blocking call waiting for its push), SIGTERM raises `Terminated` here."""
    if not _ours():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


#: the async pushes running on this process's main thread, each (loop, cancel, fired); while any runs SIGTERM's
#: handler is `_on_sigterm`
_running: dict[int, tuple[asyncio.AbstractEventLoop, Any, list[int]]] = {}


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM while async pushes run: each is cancelled on its loop (as asyncio's own Ctrl-C handling wakes its
    loop: `call_soon_threadsafe` from the handler). With none left running (it arrived as the last one ended),
    the default action: the process ends."""
    if not _running:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    for loop, cancel, fired in list(_running.values()):
        fired.append(int(signum))
        loop.call_soon_threadsafe(cancel)


@contextmanager
def sigterm_cancels(cancel: Any) -> Iterator[list[int]]:
    """While the body runs (an async push on an asyncio loop in the main thread), SIGTERM calls `cancel()` and is
    recorded in the list yielded; the caller raises `Terminated` once the body ended. Every push running at once
    is cancelled. The handler is Python's `signal.signal` (installed by the first push to start, the default
    put back by the last to end), not the loop's `add_signal_handler`, which costs a quarter of a millisecond
    a push in its checks."""
    fired: list[int] = []
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio, or no loop: the default handler stays
        loop = None
    main = threading.current_thread() is threading.main_thread()
    if loop is None or not main or not (_running or _ours()):
        yield fired
        return
    if not _running:
        signal.signal(signal.SIGTERM, _on_sigterm)
    key = id(fired)
    _running[key] = (loop, cancel, fired)
    try:
        yield fired
    finally:
        del _running[key]
        if not _running and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # back to the default handler
