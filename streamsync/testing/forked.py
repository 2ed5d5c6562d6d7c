"""One fork server for the processes the test helpers start (megatron-core trainer ranks, receiver processes): it
imports torch, megatron-core and streamsync's process entry points once, and every such process is forked from it
instead of a fresh interpreter spending one to five seconds importing them.

A process has one fork server, started with the first process forked; `PRELOAD` is every helper's imports, so
whichever helper starts it first, it serves all of them. Where there is no fork server, or on a GPU machine (a
process forked from one whose imports asked CUDA anything may not use it), `context()` is None and the helpers
start their processes as they would without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

#: what the fork server imports once
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "streamsync.testing.megatron",
           "streamsync.testing.sharded", "streamsync.receiver.process", "streamsync.models.synthetic",
           "streamsync.testing.fused", "streamsync.testing.sliced", "streamsync.testing.receiver")


def context() -> Any | None:
    """torch.multiprocessing's fork-server context, preloading `PRELOAD`; None where it is not to be used."""
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.is_available():
        return None
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:  # a platform without it
        return None
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def become(env: Mapping[str, str] | None, cwd: str | None) -> None:
    """In a forked process: take the launching process's environment and working directory, as a process it
    started itself would have them (the fork server keeps those it was started with)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
