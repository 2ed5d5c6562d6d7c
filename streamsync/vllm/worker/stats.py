"""What one round did inside a vLLM worker: its phases, timed where they run, and the memory it took.

The worker times its own phases (the sender sees only how long each call took, round trip included) and keeps
them with wall-clock timestamps, so the sender can draw them in the push's trace on the same axis as its own
spans (`time.time`: one clock on one host; an engine on another host is drawn with that host's clock):

    map      start: checking (or tracing) where each tensor goes; per chunk: looking each tensor up
    arm      start: arming vLLM's layerwise reload for the modules that need it
    load     per chunk: the fast path's copies, and `load_weights` for the layerwise rest
    process  per chunk: rebuilt modules processed (`process_weights_after_loading`) once complete
    finish   finish: layerwise finalize and shared-kernel refresh (nothing when every tensor took the fast path)
    call     per `streamsync_update` call (a push's first chunk, which opens the round, and its last, which ends
             it), around the others: from the call's arrival in the worker to its answer, so the sender's send
             span minus it is the call's way there and back

Extra memory is what the round allocated above what the worker held when it began: on CUDA the allocator's
peak (`torch.cuda.max_memory_allocated`, its peak counter reset at the round's start); on CPU the process's
peak resident memory (Linux `VmHWM`, reset through /proc/self/clear_refs), which also counts the pages of
mapped chunk buffers the worker read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

PHASES = ("map", "arm", "load", "process", "finish")


def _status_kib(*keys: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    return out


class _Open:
    """A phase being timed: recorded as one span per stretch it ran (`paused` ends one, its exit starts the next)."""

    def __init__(self, log: RoundLog, name: str, chunk: int | None) -> None:
        self.log, self.name, self.chunk = log, name, chunk
        self.t0: float | None = time.time()

    def close(self) -> None:
        if self.t0 is not None:
            self.log.phases.append([self.name, self.chunk, self.t0, time.time()])
            self.t0 = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.close()
        try:
            yield
        finally:
            self.t0 = time.time()


def _cuda_allocated(device: torch.device, which: str) -> int:
    """The allocator's allocated bytes now ("current") or at their peak ("peak"), as `torch.cuda.memory_allocated`
    and `max_memory_allocated` say, read from the raw nested stats: those functions flatten about a hundred keys
    in Python first, twice per round in a push that takes a few milliseconds."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return int(torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"][which])
    except (AttributeError, KeyError, TypeError):
        fn = torch.cuda.memory_allocated if which == "current" else torch.cuda.max_memory_allocated
        return int(fn(device))


class RoundLog:
    """One round's phases and memory (module doc); `report()` is the plain data the sender reads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: list[list[Any]] = []
        self._base: int | None = None
        self._how = ""

    def begin(self) -> None:
        self.phases = []
        self._base, self._how = None, ""
        try:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                self._base = _cuda_allocated(self.device, "current")
                self._how = "torch.cuda.max_memory_allocated above the round's start"
            else:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak resident set (VmHWM); changes nothing else
                self._base = _status_kib("VmRSS")["VmRSS"] << 10
                self._how = ("peak resident memory above the round's start (Linux VmHWM; counts the pages of "
                             "mapped chunk buffers the worker read)")
        except (OSError, KeyError, RuntimeError) as e:
            self._how = f"not measured: {type(e).__name__}: {e}"

    @contextmanager
    def phase(self, name: str, chunk: int | None = None) -> Iterator[_Open]:
        """Time the body as phase `name` (of `chunk`); the phase's `paused()` leaves a nested phase out of it."""
        open_ = _Open(self, name, chunk)
        try:
            yield open_
        finally:
            open_.close()

    def extra_bytes(self) -> int | None:
        if self._base is None:
            return None
        try:
            if self.device.type == "cuda":
                return max(0, _cuda_allocated(self.device, "peak") - self._base)
            return max(0, (_status_kib("VmHWM")["VmHWM"] << 10) - self._base)
        except (OSError, KeyError, RuntimeError):
            return None

    def report(self, **fields: Any) -> dict[str, Any]:
        return {"phases": list(self.phases), "extra_bytes": self.extra_bytes(), "memory": self._how, **fields}
