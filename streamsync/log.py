"""structlog setup. An application that configured structlog keeps its own configuration; otherwise events
go to stderr, colored for people (or JSON with STREAMSYNC_LOG_JSON=1), filtered by STREAMSYNC_LOG level,
stamped with local ISO-8601 time to the millisecond (`2026-11-30T11:23:23.123+00:00`)."""

from __future__ import annotations

import logging
import os
import sys
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


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    if not structlog.is_configured():
        configure()
    return structlog.get_logger("streamsync").bind(**bound)


def quiet_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    """Like `get_logger`, but at warning level at least (the configured processors and output are kept)."""
    if not structlog.is_configured():
        configure()
    return structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                                 logger_factory_args=("streamsync",)).bind(**bound)
