"""Worker calls that answer an error instead of raising it.

vLLM's multiprocess executor reads the workers' answers to a `collective_rpc` in worker order and raises at the
first failed one, leaving the answers of the workers after it queued, where the next call of any method reads
them as its own. A call that fails in one worker of several (a delta one worker refuses, a receive that timed out
there) would then shift every later answer by one. The extension's round calls (`streamsync_start_update`,
`streamsync_update`, `streamsync_finish_update`, `streamsync_prime`) therefore catch what they raise and answer
`{WORKER_ERROR: "Type: message"}`: every worker answers, and the engine client raises for it (`VllmEngine.rpc`),
naming the worker. An engine of several workers opens, loads and ends its rounds through these calls only, never
through vLLM's own `start_weight_update` / `update_weights` / `finish_weight_update`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

#: the key of a worker's answer that stands for the error its call raised
WORKER_ERROR = "streamsync_error"

F = TypeVar("F", bound=Callable[..., Any])


def answering(fn: F) -> F:
    """`fn`, answering `{WORKER_ERROR: ...}` where it raises an Exception (its traceback goes to the worker's
    log: the sender's error names the worker and the exception, the engine's log says where it was raised)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            logging.getLogger(__name__).exception("streamsync: %s failed in this worker", fn.__name__)
            return {WORKER_ERROR: f"{type(e).__name__}: {e}"}

    return call  # type: ignore[return-value]


def failed(answers: Any) -> bool:
    """Whether any worker's answer stands for an error."""
    return isinstance(answers, list) and any(isinstance(x, dict) and WORKER_ERROR in x for x in answers)
