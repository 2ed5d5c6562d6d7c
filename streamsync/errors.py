"""Errors raised by streamsync. Each names what is wrong, so a failed push can be traced to its cause."""

from __future__ import annotations


class StreamSyncError(RuntimeError):
    """Base class of every streamsync error."""


class ValidationError(StreamSyncError, ValueError):
    """Bad input found before any byte moved (names, shapes, dtypes, devices, configuration)."""


class TransportError(StreamSyncError):
    """A transport could not move or map a chunk."""


class EngineError(StreamSyncError):
    """An engine (receiver) refused a call, failed it, or did not answer in time.

    `unresponsive`: it did not answer in time (frozen, dead, or too slow); a failed push does not wait for
    it again to abort its round (it never reports the new version: it did not finish the round)."""

    def __init__(self, engine: str, message: str, *, unresponsive: bool = False) -> None:
        super().__init__(f"engine {engine!r}: {message}")
        self.engine = engine
        self.message = message
        self.unresponsive = unresponsive


class EngineUnreachable(EngineError):
    """Nothing answers at the engine's address (connection refused, no route, a server that died): the message
    says only that, since nothing is known of what runs there."""


class PushError(StreamSyncError):
    """A push failed. Names the stage, the chunk and (where one is involved) the receiver.

    When a push raises, every buffer it held has been freed and no engine reports the new version.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        chunk: int | None = None,
        receiver: str | None = None,
        push_id: str | None = None,
    ) -> None:
        where = [f"stage={stage}"]
        if chunk is not None:
            where.append(f"chunk={chunk}")
        if receiver is not None:
            where.append(f"receiver={receiver}")
        if push_id is not None:
            where.append(f"push={push_id}")
        super().__init__(f"push failed [{' '.join(where)}]: {message}")
        self.message = message
        #: engines that did not answer in time (from an unresponsive EngineError); not asked to abort
        self.unresponsive: frozenset[str] = frozenset()
        self.stage = stage
        self.chunk = chunk
        self.receiver = receiver
        self.push_id = push_id


class PushTimeout(PushError, TimeoutError):
    """A push did not finish within the time limit its caller gave (`push(time_limit=...)`)."""
