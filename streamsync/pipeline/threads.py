"""While a push runs, the interpreter hands the GIL to a thread that waits for it sooner.

A push's engine calls run in worker threads (an `LLM`'s calls block), and so do gathers and CPU packs; the event
loop's own thread meanwhile packs the next chunk in Python. CPython lets a waiting thread take the GIL only after
the holder ran for the switch interval (5 ms by default) or released it: an engine call started while the loop
packs waited up to that long before it even reached the engine, on every chunk but the last. A push therefore
lowers the interval to `SWITCH_S` while it runs and puts the interpreter's own back when the last running push
ends (unless the application changed it meanwhile).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: the switch interval while a push runs, seconds
SWITCH_S = 1e-4

_lock = threading.Lock()
_running = 0
_saved: float | None = None


@contextmanager
def responsive_threads() -> Iterator[None]:
    global _running, _saved
    with _lock:
        if _running == 0:
            _saved = sys.getswitchinterval()
            if _saved > SWITCH_S:
                sys.setswitchinterval(SWITCH_S)
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0 and _saved is not None:
                # nobody else changed it since (the interpreter keeps it in whole microseconds: 1e-4 reads back
                # as 9.999999999999999e-05)
                if abs(sys.getswitchinterval() - min(_saved, SWITCH_S)) < 1e-6:
                    sys.setswitchinterval(_saved)
                _saved = None
