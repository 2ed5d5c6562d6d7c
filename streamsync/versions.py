"""`VersionBook`: the versions a WeightSync may claim, and what each engine holds after a failed push.

Rules. Versions are non-negative integers that move forward. A push claims the version it is given, or the
last one + 1. A version that reached any engine whole, or that any engine reported when the sync connected
(clean or as the failed push that left it mixed), is never claimed again for other weights: two different
weights would share one number. The one exception is a retry: the version of this sync's last push, if that
push failed before any engine finished it, may be pushed again.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio

from .engines.base import EngineState
from .errors import ValidationError
from .sources.sharded import gather_objects
from .transports.collective.group import in_thread


@dataclass
class VersionBook:
    #: the last version pushed or seen on an engine; the next push claims a larger one (or retries)
    version: int = 0
    #: `version` was pushed or seen (else a first push may claim 0)
    claimed: bool = False
    #: a failed push's version, which a retry may claim again
    retry: int | None = None
    #: engine name -> version of the failed push that left part of its weights there. Such an engine reports
    #: itself mixed (`Engine.state()`), not its old version; the next successful push clears it.
    mixed: dict[str, int] = field(default_factory=dict)
    #: engines whose failed round could not be confirmed ended (their abort failed or timed out)
    open_rounds: set[str] = field(default_factory=set)

    def seen(self, engine: str, state: EngineState) -> None:
        """What an engine reported at connect: its numbers are taken (never claimed again), and an engine a
        failed push left mixed is remembered as such."""
        taken = [v for v in (state.version, state.failed_version) if v is not None]
        if taken:
            self.version = max(self.version, *taken) if self.claimed else max(taken)
            self.claimed = True
        if state.mixed:
            self.mixed[engine] = state.failed_version if state.failed_version is not None else self.version

    def next(self, version: Any) -> int:
        """The version a push will claim: `version` checked, or the next one."""
        if version is None:
            return self.retry if self.retry is not None else self.version + 1
        if isinstance(version, bool):
            raise ValidationError(f"version must be an integer, got {version!r}")
        try:
            v = operator.index(version)  # ints (and numpy ints), not "7" or 7.5
        except TypeError:
            raise ValidationError(f"version must be an integer, got {type(version).__name__} {version!r}") from None
        if v < 0:
            raise ValidationError(f"version must be >= 0, got {v}")
        if self.claimed and v <= self.version and v != self.retry:
            raise ValidationError(f"version {v} does not move forward: version {self.version} was already pushed "
                                  "(or found on the engines); pass a larger one, or assign sync.version (the last "
                                  "version: the next must be larger) to restart the numbering")
        return v

    def pushed(self, version: int, engines: Iterable[str]) -> None:
        """A push of `version` succeeded: every engine holds it whole."""
        self.version, self.claimed, self.retry = version, True, None
        for name in engines:
            self.mixed.pop(name, None)
            self.open_rounds.discard(name)

    def failed(self, version: int, *, finished: set[str], aborted: list[str], ended: set[str], sent: bool) -> None:
        """A push of `version` failed: `finished` engines hold it whole; of the `aborted` ones, `ended` had their
        round ended; if any chunk was `sent`, the aborted ones hold part of it."""
        for name in aborted:
            if name in ended:
                self.open_rounds.discard(name)
            else:
                self.open_rounds.add(name)
            if sent:
                self.mixed[name] = version
        for name in finished:
            self.mixed.pop(name, None)
        if finished:  # some engines report `version` now: never claim the number again
            self.version, self.claimed = max(self.version, version), True
            self.retry = None
        else:
            self.retry = version


async def one_version(v: int, timeout: float) -> int:
    """One push has one version on every trainer rank: global rank 0's, the rank with the engines (a rank
    without engines cannot know what they hold). Called where every rank takes part in the push."""
    with anyio.fail_after(timeout):
        got = await in_thread(gather_objects, v)
    return int(got[0])  # type: ignore[call-overload]
