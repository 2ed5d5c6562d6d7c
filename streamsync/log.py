"""structlog setup. An application that configured structlog keeps its own configuration; otherwise events
go to stderr, colored for people (or JSON with STREAMSYNC_LOG_JSON=1), filtered by STREAMSYNC_LOG level,
stamped with local ISO-8601 time to the millisecond (`2026-11-30T11:23:23.123+00:00`)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import structlog


def _timestamp(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    event["timestamp"] = datetime.now().astimezone().isoformat(timespec="milliseconds")
    return event


def configure(level: str | None = None, json: bool | None = None) -> None:
    level = (level or os.environ.get("STREAMSYNC_LOG", "info")).upper()
    json = json if json is not None else os.environ.get("STREAMSYNC_LOG_JSON") == "1"
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(
        colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _timestamp,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


#: set where only warnings and errors are logged (ranks that only take part in gathers: `quiet`)
_QUIET: ContextVar[bool] = ContextVar("streamsync_quiet", default=False)


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    if _QUIET.get():
        return quiet_logger(**bound)
    if not structlog.is_configured():
        configure()
    return structlog.get_logger("streamsync").bind(**bound)


@contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """In this context (its tasks included) `get_logger` logs warnings and errors only."""
    token = _QUIET.set(on)
    try:
        yield
    finally:
        _QUIET.reset(token)


def quiet_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    """Like `get_logger`, but at warning level at least (the configured processors and output are kept)."""
    if not structlog.is_configured():
        configure()
    return structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                                 logger_factory_args=("streamsync",)).bind(**bound)


def bound(**values: object) -> AbstractContextManager[object]:
    """Bind `values` (push, version, stage, chunk) to every event logged in this context, its tasks included:
    bound once where a push, a stage's work on a chunk, ... begins, not passed along as arguments."""
    return structlog.contextvars.bound_contextvars(**values)
