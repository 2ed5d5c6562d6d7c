"""A refused weight-transfer call is one line in a server's log, not four tracebacks.

A call out of order (`update_weights` with no round open, a start before `init_weight_transfer_engine`, a
second start, a round owned by another trainer) is refused by the worker with a reason, and the reason reaches
the trainer in the HTTP answer's body. On its way vLLM logs it as a crash three times over: the worker
("WorkerProc hit an exception"), the engine core ("Invocation of collective_rpc method failed") and the API
server (uvicorn's "Exception in ASGI application", after the 500 answer went out), each with a full traceback:
about 120 lines a refusal, which read as a broken server.

`install()` (every vLLM process, from the plugin's `register`) adds a filter to those three loggers: a record
whose exception is a refusal becomes one WARNING line naming the reason; every other record, and every other
exception, is left exactly as vLLM logs it. A refusal is recognised by its text (`REASONS`), which crosses
the processes inside vLLM's own error messages.
"""

from __future__ import annotations

import logging
import re

#: the reasons a round's call is refused for: vLLM's own order checks and streamsync's backend's
REASONS = (
    "start_weight_update must be called before update_weights",
    "start_weight_update called while a weight update is already active",
    "finish_weight_update called without a matching start_weight_update",
    "Cannot release a trainer connection during a weight update",
    "Weight transfer not configured",
    "streamsync: start_weight_update before init_weight_transfer_engine",
    "refused: the open round belongs to another WeightSync",
    "refused: a round of another WeightSync",
)
_PATTERN = re.compile("|".join(re.escape(r) for r in REASONS))
#: the loggers that log a refused call with its traceback: the worker's, the engine core's, the API server's
LOGGERS = ("vllm.v1.executor.multiproc_executor", "vllm.v1.engine.core", "uvicorn.error")


def reason(exc: BaseException | None) -> str | None:
    """The refusal `exc` (or an exception it was raised from) carries, or None where it is no refusal."""
    seen = 0
    while exc is not None and seen < 8:
        m = _PATTERN.search(str(exc))
        if m:
            text = str(exc)
            start = m.start()
            end = text.find("', please", start)  # vLLM quotes a worker's error: "with error '...', please check"
            return text[start:end if end > start else None].strip().rstrip(".")
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


class OneLine(logging.Filter):
    """Turns a record of a refused call into one WARNING line; lets every other record through as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        why = reason(exc)
        if why is None:
            return True
        record.msg = "weight-transfer call refused: %s"
        record.args = (why,)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = None
        record.exc_text = None
        return True


def install() -> None:
    """Filter the three loggers (idempotent)."""
    for name in LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, OneLine) for f in log.filters):
            log.addFilter(OneLine())
