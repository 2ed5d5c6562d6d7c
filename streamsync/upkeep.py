"""What a sync keeps of its engines besides their weights: paused or not, and KV caches to scrub.

An engine kept paused (a failed push inside `paused()` left it mixed, or it was found paused at connect) is
resumed by the next push that makes it whole, unless the caller holds it in `paused()`. Engines that took
weights no finite check vouched for may hold NaN in freed KV blocks: the next checked push scrubs them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio

from .errors import PushError, StreamSyncError, ValidationError
from .rounds import EngineGroup

if TYPE_CHECKING:
    from .sync import WeightSync


class Upkeep:
    """One sync's engine upkeep (module doc); `WeightSync.upkeep`."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync = sync
        #: engines left paused (a failed push, or found so at connect) until a push makes them whole
        self.stale_paused: set[str] = set()
        self.pausing = False  # inside `paused()`: its exit resumes every engine
        #: engines that took weights no finite check vouched for: their KV caches are scrubbed after the next
        #: checked push (`scrub_kv_caches`)
        self.unchecked: set[str] = set()

    async def after_whole(self) -> None:
        """A push made every engine whole: scrub what unchecked weights left, resume engines kept paused."""
        if self.unchecked and self.sync.checks.check_finite:
            await self.scrub_kv_caches()
        if self.stale_paused and not self.pausing:
            await self.resume_stale()

    async def scrub_kv_caches(self) -> None:
        """After checked weights replaced weights pushed without the finite check: zero the KV caches those
        engines may hold NaN in (requests served from non-finite weights leave NaN in freed blocks, and a block
        reused by a later request poisons it: the engine answers empty text until it restarts). Only an engine
        no request holds cache blocks in can be scrubbed; the others are named, with what to do."""
        for e in [e for e in self.sync.engines if e.name in self.unchecked]:
            clear = getattr(e, "clear_kv_cache", None)
            if clear is None:
                self.unchecked.discard(e.name)
                continue
            try:
                with anyio.fail_after(self.sync.timeout):
                    bad = await clear()
            except (StreamSyncError, TimeoutError) as err:
                self.sync.log.warning("weights pushed without the finite check were replaced, but the engine's KV "
                                      "cache could not be scrubbed (requests hold cache blocks?): pause with "
                                      "mode='abort' or 'wait' around the next push, or call "
                                      "engine.clear_kv_cache()", engine=e.name, error=str(err))
                continue
            self.unchecked.discard(e.name)
            (self.sync.log.warning if bad else self.sync.log.info)(
                "KV cache scrubbed after weights pushed without the finite check were replaced", engine=e.name,
                nonfinite_values=bad)

    async def resume_stale(self) -> None:
        """Resume the engines found paused at connect, now that they hold a whole version; a resume that
        fails raises naming the engine (its requests would hang)."""
        stale = [e for e in self.sync.engines if e.name in self.stale_paused]
        await EngineGroup(stale, self.sync.timeout, self.sync.abort_timeout).resume()
        self.sync.log.info("resumed engines found paused at connect", engines=[e.name for e in stale])
        self.stale_paused.clear()

    @asynccontextmanager
    async def paused(self, mode: str = "keep", clear_cache: bool = False, *,
                     resume_on_failure: bool = False) -> AsyncIterator[None]:
        """`WeightSync.paused`."""
        if mode not in ("keep", "wait", "abort"):
            raise ValidationError(f"pause mode must be keep, wait or abort, got {mode!r}")
        group = EngineGroup(self.sync.engines, self.sync.timeout, self.sync.abort_timeout)
        try:
            await group.pause(mode, clear_cache)
        except BaseException:  # engines that did pause must not stay paused
            with anyio.CancelScope(shield=True):
                try:
                    await group.resume()
                except PushError as err:
                    self.sync.log.warning("resume after a failed pause failed", error=str(err))
            raise
        failed = True
        self.pausing = True
        try:
            yield
            failed = False
        finally:
            self.pausing = False
            with anyio.CancelScope(shield=True):
                keep = set() if not failed or resume_on_failure else set(self.sync.mixed) | self.sync.open_rounds
                if keep:
                    self.sync.log.warning("engines left paused after a failed push (mixed weights or an open "
                                          "round); the next successful push resumes them (resume_on_failure=True: "
                                          "at once)", engines=sorted(keep))
                await group.resume([e for e in self.sync.engines if e.name not in keep])
                # the next push that makes them whole resumes them, inside paused() or not
                self.stale_paused = (self.stale_paused - {e.name for e in self.sync.engines}) | keep
