"""structlog setup. An application that configured structlog keeps its own configuration. Otherwise each event
goes, decided when it is logged:

* to stdlib `logging` when the application configured it (the root logger or the `streamsync` logger has a
  handler: `logging.basicConfig`, `dictConfig`, ...): a record on the `streamsync` logger at the event's level,
  whose message is `event key=value ...` (the JSON object with STREAMSYNC_LOG_JSON=1) and whose `streamsync`
  attribute holds the event's fields. The application's handlers, formatters and logger levels decide the rest.
* else to stderr, colored for people (or JSON with STREAMSYNC_LOG_JSON=1), stamped with local ISO-8601 time to
  the millisecond (`2026-11-30T11:23:23.123+00:00`).

Either way STREAMSYNC_LOG (default info) is the lowest level logged: `STREAMSYNC_LOG=debug` and a `streamsync`
logger at DEBUG show the debug events.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import structlog

LOGGER_NAME = "streamsync"


def _timestamp(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event["timestamp"] = datetime.now().astimezone().isoformat(timespec="milliseconds")
    return event


def stdlib_configured() -> bool:
    """Whether the application set up stdlib logging: a handler on the root logger or on `streamsync`'s."""
    return bool(logging.getLogger().handlers or logging.getLogger(LOGGER_NAME).handlers)


_INTERNAL = (os.path.dirname(structlog.__file__), __file__)


def _stacklevel() -> int:
    """logging's stacklevel for a record logged from `_Output`: it names the line that logged the event, not
    structlog's frames in between."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


class _Output:
    """structlog's final logger: receives the processed event dict and writes it where `stdlib_configured()`
    says, when it is logged (an application may set up `logging` after streamsync made its loggers)."""

    def __init__(self, name: str, json: bool) -> None:
        self.name = name or LOGGER_NAME
        self.json = json
        self.console = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty())
        self.message = structlog.processors.JSONRenderer() if json else structlog.processors.KeyValueRenderer(
            key_order=["event"], drop_missing=True)

    def _emit(self, method: str, event: dict[str, Any]) -> None:
        if stdlib_configured():
            logger = logging.getLogger(self.name)
            level = logging.getLevelName(method.upper()) if method != "exception" else logging.ERROR
            level = level if isinstance(level, int) else logging.INFO
            if not logger.isEnabledFor(level):
                return
            exc_info = event.pop("exc_info", None)
            # the event first; time and level are the handler's formatter's to add
            fields = {"event": event.get("event", ""),
                      **{k: v for k, v in event.items() if k not in ("event", "timestamp", "level")}}
            text = self.message(None, method, dict(fields)) if self.json else self._key_values(fields)
            logger.log(level, "%s", text, exc_info=exc_info, extra={"streamsync": fields}, stacklevel=_stacklevel())
            return
        print(self.console(None, method, event), file=sys.stderr, flush=True)

    def _key_values(self, fields: dict[str, Any]) -> str:
        # "push done ms=12.5 mib=5.0": the event as it reads, then its fields (KeyValueRenderer would quote it)
        rest = {k: v for k, v in fields.items() if k != "event"}
        tail = str(self.message(None, "", rest)) if rest else ""
        return f"{fields['event']} {tail}".rstrip()

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda event: self._emit(method, event)


def _pass_dict(_: Any, __: str, event: MutableMapping[str, Any]) -> tuple[tuple[MutableMapping[str, Any]], dict]:
    """The last processor: hand the event dict itself to `_Output`, which renders it for where it goes."""
    return (event,), {}


@functools.cache
def _output(name: str, json: bool) -> _Output:
    """One `_Output` per name and format: structlog asks its factory for a logger at every `bind` (nothing is
    cached on first use), and a console renderer costs a fraction of a millisecond to make."""
    return _Output(name, json)


def configure(level: str | None = None, json: bool | None = None) -> None:
    level = (level or os.environ.get("STREAMSYNC_LOG", "info")).upper()
    json = json if json is not None else os.environ.get("STREAMSYNC_LOG_JSON") == "1"
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _timestamp,
            _pass_dict,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=lambda *args: _output(str(args[0]) if args else LOGGER_NAME, json),
        cache_logger_on_first_use=False,
    )


#: set where only warnings and errors are logged (ranks that only take part in gathers: `quiet`)
_QUIET: ContextVar[bool] = ContextVar("streamsync_quiet", default=False)


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    if _QUIET.get():
        return quiet_logger(**bound)
    if not structlog.is_configured():
        configure()
    return structlog.get_logger(LOGGER_NAME).bind(**bound)


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
                                 logger_factory_args=(LOGGER_NAME,)).bind(**bound)


def bound(**values: object) -> AbstractContextManager[object]:
    """Bind `values` (push, version, stage, chunk) to every event logged in this context, its tasks included:
    bound once where a push, a stage's work on a chunk, ... begins, not passed along as arguments."""
    return structlog.contextvars.bound_contextvars(**values)
