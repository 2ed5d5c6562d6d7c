"""Helpers of the GPU tests: run a coroutine test without pytest-asyncio, perturb weights on the device."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest
import torch


def gpu(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Mark a test `gpu` and run its coroutine with anyio.run: the GPU machine has no pytest-asyncio."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        anyio.run(functools.partial(fn, *args, **kwargs))

    return pytest.mark.gpu(run)


def perturb(model: torch.nn.Module, step: int) -> None:
    torch.manual_seed(step)
    with torch.no_grad():
        for t in model.state_dict().values():
            if not isinstance(t, torch.Tensor):  # megatron's state dict holds extra states that are None
                continue
            if t.is_floating_point() and t.element_size() >= 2:
                t.add_(torch.randn_like(t) * 0.01)
            elif t.dtype not in (torch.bool, torch.uint8) and not t.is_floating_point():
                t.add_(1)
