"""structlog setup. An application that configured structlog keeps its own configuration; otherwise events
go to stderr, colored for people (or JSON with STREAMSYNC_LOG_JSON=1), filtered by STREAMSYNC_LOG level."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(level: str | None = None, json: bool | None = None) -> None:
    level = (level or os.environ.get("STREAMSYNC_LOG", "info")).upper()
    json = json if json is not None else os.environ.get("STREAMSYNC_LOG_JSON") == "1"
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(
        colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
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
