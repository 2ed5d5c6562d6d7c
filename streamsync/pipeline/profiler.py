"""Ranges in the user's own profiler (torch.profiler, NVTX) around pushes and stages."""

from __future__ import annotations

import torch


class ProfilerRange:
    """A named range in the user's own profiler: `torch.profiler.record_function` while a torch profiler
    runs, and an NVTX range (Nsight Systems) when CUDA is available.

    Stages interleave on the event loop's thread, so ranges are started and ended by handle, never pushed
    and popped on a per-thread stack. With no profiler and no CUDA it costs one C call.
    """

    __slots__ = ("name", "nvtx", "rf")

    def __init__(self, name: str) -> None:
        self.name = name
        self.rf: torch.profiler.record_function | None = None
        self.nvtx: object = None

    def __enter__(self) -> ProfilerRange:
        if torch._C._autograd._profiler_enabled():
            self.rf = torch.profiler.record_function(self.name)
            self.rf.__enter__()
        if _nvtx():
            self.nvtx = torch.cuda.nvtx.range_start(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.rf is not None:
            self.rf.__exit__(None, None, None)
            self.rf = None
        if self.nvtx is not None:
            torch.cuda.nvtx.range_end(self.nvtx)
            self.nvtx = None


_NVTX: list[bool] = []


def _nvtx() -> bool:
    if not _NVTX:
        _NVTX.append(torch.cuda.is_available())
    return _NVTX[0]
