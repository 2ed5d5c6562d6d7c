"""Streaming partial rollout: generation keeps going across weight updates, and every token knows its weights.

    rollout = StreamingRollout(sync, prompts, in_flight=16, max_tokens=256, max_staleness=2)
    async with rollout:                                # requests start flowing
        async for sample in rollout:                   # finished samples, as they complete
            buffer.append(sample)
            if len(buffer) >= batch:
                train_step(buffer)
                await rollout.update(model)            # pause, push, resume; no request lost

`update` pauses every engine (`pause_mode`), pushes through the `WeightSync`, and resumes:
* "keep" (default): in-flight requests freeze and continue on the new weights. With `clear_cache=False` the
  KV of their prefix stays as computed under the old weights (PipelineRL-style in-flight updates); with
  `clear_cache=True` vLLM preempts them and recomputes that KV under the new weights on resume.
* "abort": in-flight requests end; each is resubmitted with its prompt plus the tokens it had generated, so the
  sample continues where it stopped (the prefix is kept, not regenerated) under the new weights. A request the
  server ends before its first token (its stream closes with no finish reason) is resubmitted too; a stream
  that closes so outside an update is the engine's failure and ends the rollout.
* "wait": in-flight requests drain on the old weights before the push; new ones wait for the new weights.

Each `Sample` carries version spans: which weight version sampled which of its tokens (vLLM's
`weight_versions` for in-process `AsyncLLM`; for `vllm serve` the client labels tokens by the version live
when they arrived, which the pause makes exact up to tokens still in flight on the wire when it began; with
"abort", a stream's tokens all carry the version of its first ones, since the pause ends every stream it finds).
`max_staleness=k` drops (or, with `stale="flag"`, marks) samples whose oldest token is more than k versions
behind the newest pushed version. `stats` holds the figures to tune by: generation stall per update, tokens/s,
samples and versions in flight, stale samples.
"""

from __future__ import annotations

import itertools
import json
import operator
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from .engines.base import Engine
from .errors import EngineError, StreamSyncError, ValidationError
from .log import get_logger
from .report import PushReport
from .sync import WeightSync

if TYPE_CHECKING:
    from .engines.vllm import VllmHttpEngine


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens [start, end) of a sample were sampled by weights `version` (None: before any push)."""

    version: int | None
    start: int
    end: int


@dataclass
class Sample:
    index: int  # order in which the prompt was taken from the source
    prompt_ids: list[int]
    payload: Any = None  # whatever the prompt source gave beside the token ids
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    engine: str = ""
    finish_reason: str | None = None
    resubmits: int = 0  # times an abort-mode update ended the request and the rollout resubmitted it
    stale: bool = False  # flagged by the staleness bound (stale="flag")
    behind: int | None = None  # newest pushed version minus the sample's oldest, when it finished

    @property
    def versions(self) -> list[int | None]:
        return [s.version for s in self.spans]

    @property
    def oldest_version(self) -> int | None:
        known = [v for v in self.versions if v is not None]
        return min(known) if known else None

    def _relabel(self, start: int, spans: Sequence[tuple[int | None, int, int]]) -> None:
        """Tokens from `start` on were sampled by the versions of `spans` (engine labels, relative to start)."""
        per_token = [s.version for s in self.spans for _ in range(s.start, s.end)]
        for version, a, b in spans:
            per_token[start + a : start + b] = [version] * (b - a)
        self.spans = []
        for i, v in enumerate(per_token):
            if self.spans and self.spans[-1].version == v:
                self.spans[-1] = VersionSpan(v, self.spans[-1].start, i + 1)
            else:
                self.spans.append(VersionSpan(v, i, i + 1))

    def _extend(self, tokens: Sequence[int], logprobs: Sequence[float], version: int | None) -> None:
        start = len(self.tokens)
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        if not tokens:
            return
        if self.spans and self.spans[-1].version == version and self.spans[-1].end == start:
            last = self.spans.pop()
            self.spans.append(VersionSpan(version, last.start, len(self.tokens)))
        else:
            self.spans.append(VersionSpan(version, start, len(self.tokens)))


@dataclass
class UpdateReport:
    push: PushReport
    stall_seconds: float  # engines paused: from the pause call until resume returned
    in_flight: int  # requests in flight when the update began
    versions_in_flight: list[int | None]  # distinct oldest versions among them


@dataclass
class RolloutStats:
    started: float = field(default_factory=time.perf_counter)
    samples: int = 0
    tokens: int = 0
    in_flight: int = 0
    updates: int = 0
    failed_updates: int = 0
    stall_seconds: list[float] = field(default_factory=list)
    stale_dropped: int = 0
    stale_flagged: int = 0
    resubmitted: int = 0

    @property
    def tokens_per_second(self) -> float:
        dt = time.perf_counter() - self.started
        return self.tokens / dt if dt > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "tokens": self.tokens, "tokens_per_second": round(self.tokens_per_second, 1),
                "in_flight": self.in_flight, "updates": self.updates, "failed_updates": self.failed_updates,
                "stall_ms": [round(s * 1e3, 1) for s in self.stall_seconds], "stale_dropped": self.stale_dropped,
                "stale_flagged": self.stale_flagged, "resubmitted": self.resubmitted}


# ---------------------------------------------------------------------------------------- generation clients


@dataclass
class _Delta:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    # With the last delta, engines that label tokens (AsyncLLM's weight_versions) give (version, start, end)
    # spans over this submission's tokens; the others are labelled by the version live when they arrived.
    spans: list[tuple[int | None, int, int]] | None = None


class _AsyncLLMClient:
    """Generation on an in-process `vllm.AsyncLLM`; token versions from its `weight_versions`."""

    def __init__(self, client: Any, name: str) -> None:
        self.client, self.engine, self.name = client, client.engine, name

    async def stream(self, prompt_ids: list[int], params: dict[str, Any]) -> AsyncIterator[_Delta]:
        import vllm

        sp = vllm.SamplingParams(**params, logprobs=1)
        seen = 0
        async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, sp,
                                              request_id=f"streamsync-rollout-{uuid.uuid4().hex[:12]}"):
            c = out.outputs[0]
            ids = list(c.token_ids)
            new = ids[seen:]
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(new, start=seen)] if c.logprobs else [0.0] * len(new)
            seen = len(ids)
            spans = None
            # vLLM labels tokens in the final output only, and only where it keeps the version (0.32+); where
            # the workers keep it (0.25), tokens are labelled by the version live when they arrived
            if out.finished and self.client.native_versions and c.weight_versions:
                spans = [(_int_version(w.version), w.start, w.end) for w in c.weight_versions]
            yield _Delta(new, lps, c.finish_reason if out.finished else None, spans)


class _HttpClient:
    """Generation on `vllm serve` through /v1/completions (streamed, token ids in and out)."""

    def __init__(self, engine: VllmHttpEngine, name: str) -> None:
        self.engine, self.name = engine, name
        self._model: str | None = None

    async def stream(self, prompt_ids: list[int], params: dict[str, Any]) -> AsyncIterator[_Delta]:
        import aiohttp

        if self._model is None:
            self._model = await self.engine.served_model()
        body = {"model": self._model, "prompt": prompt_ids, "stream": True, "logprobs": 1,
                "return_tokens_as_token_ids": True, **params}
        async with self.engine.session().post(self.engine.url + "/v1/completions", json=body,
                                              timeout=aiohttp.ClientTimeout(total=None)) as r:
            if r.status >= 400:
                raise EngineError(self.name, f"/v1/completions -> HTTP {r.status}: {(await r.text())[:300]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[5:])["choices"][0]
                lp = choice.get("logprobs") or {}
                tokens = [int(t.rsplit(":", 1)[1]) for t in lp.get("tokens") or []]
                yield _Delta(tokens, [float(x) for x in lp.get("token_logprobs") or []][: len(tokens)],
                             choice.get("finish_reason"))


def _int_version(v: object) -> int | None:
    return int(v) if isinstance(v, str) and v.isdigit() else (v if isinstance(v, int) else None)


def _client_for(engine: Engine) -> Any:
    from .engines.vllm import AsyncVllmEngine, VllmHttpEngine

    if isinstance(engine, AsyncVllmEngine):
        return _AsyncLLMClient(engine, engine.name)
    if isinstance(engine, VllmHttpEngine):
        return _HttpClient(engine, engine.name)
    raise ValidationError(f"engine {engine.name!r} ({type(engine).__name__}) cannot stream generations: "
                          "StreamingRollout needs AsyncVllmEngine or VllmHttpEngine engines")


# ---------------------------------------------------------------------------------------------- prompts

_PROMPT_FORMS = ("a list of token ids, a (token ids, payload) pair, or a {'prompt_token_ids': [...]} dict "
                 "(as vLLM's TokensPrompt)")


def as_prompt(item: Any, index: int) -> tuple[list[int], Any]:
    """(token ids, payload) of one prompt in any form StreamingRollout takes; ValidationError naming the
    prompt's index and what is wrong otherwise."""
    payload = None
    if isinstance(item, tuple) and len(item) == 2 and not _is_token(item[0]):
        item, payload = item
    if isinstance(item, dict):
        if "prompt_token_ids" not in item:
            raise ValidationError(f"prompt {index}: a dict prompt needs 'prompt_token_ids', got keys {sorted(item)}")
        item = item["prompt_token_ids"]
    if isinstance(item, str | bytes):
        raise ValidationError(f"prompt {index} is text ({item[:40]!r}): StreamingRollout takes token ids; "
                              "tokenize it first (tokenizer.encode(text))")
    if _is_token(item):
        raise ValidationError(f"prompt {index} is one token id ({item!r}): prompts must be an iterable of "
                              f"prompts, each {_PROMPT_FORMS}; for a single prompt pass [ids]")
    try:
        ids = [_token(t) for t in item]
    except TypeError:
        raise ValidationError(f"prompt {index}: expected {_PROMPT_FORMS}, got {type(item).__name__} "
                              f"{item!r:.80}") from None
    if not ids:
        raise ValidationError(f"prompt {index} has no token ids")
    if min(ids) < 0:
        raise ValidationError(f"prompt {index}: token ids must be >= 0, got {min(ids)}")
    return ids, payload


def _is_token(x: Any) -> bool:
    try:
        _token(x)
        return True
    except TypeError:
        return False


def _token(x: Any) -> int:
    if isinstance(x, bool):  # an int subclass, never a token id
        raise TypeError("bool")
    return operator.index(x)  # int, numpy and 0-d torch integers


async def _aiter(prompts: AsyncIterable[Any] | Iterable[Any]) -> AsyncIterator[Any]:
    if isinstance(prompts, AsyncIterable):
        async for item in prompts:
            yield item
        return
    for item in prompts:
        yield item
        await anyio.lowlevel.checkpoint()  # a long list does not starve the requests it started


# ----------------------------------------------------------------------------------------------- the loop


class StreamingRollout:
    """Keeps `in_flight` requests running across `sync`'s engines, fed by `prompts`, yields finished `Sample`s,
    and updates weights on demand. Use as `async with rollout:` then `async for sample in rollout`,
    `await rollout.update(model)`.

    `prompts` is a list (or any iterable, or async iterable) whose items are token-id lists, (token ids,
    payload) pairs or {"prompt_token_ids": ids} dicts. A list is checked when the rollout is made, raising
    ValidationError naming the bad prompt; items of other iterables are checked as they are taken. A bad item
    or a failing prompt source stops the feed: the requests in flight finish, and once their samples were
    taken, iterating the rollout (or `next`) raises that one ValidationError. A request an engine refuses or
    fails ends the rollout at once (the other requests are cancelled) with one EngineError naming engine and
    prompt. Neither comes wrapped in an ExceptionGroup."""

    def __init__(self, sync: WeightSync, prompts: AsyncIterable[Any] | Iterable[Any], *, in_flight: int = 8,
                 max_tokens: int = 128, sampling: dict[str, Any] | None = None, pause_mode: str = "keep",
                 clear_cache: bool = False, max_staleness: int | None = None, stale: str = "drop",
                 buffer: int = 64) -> None:
        if pause_mode not in ("keep", "abort", "wait"):
            raise ValidationError(f"pause_mode must be keep, abort or wait, got {pause_mode!r}")
        if stale not in ("drop", "flag"):
            raise ValidationError(f"stale must be 'drop' or 'flag', got {stale!r}")
        if in_flight < 1 or max_tokens < 1:
            raise ValidationError(f"in_flight and max_tokens must be >= 1, got {in_flight}, {max_tokens}")
        if max_staleness is not None and max_staleness < 0:
            raise ValidationError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        if not isinstance(prompts, AsyncIterable | Iterable) or isinstance(prompts, str | bytes | dict):
            raise ValidationError(f"prompts must be a list (or iterable, or async iterable) of prompts, each "
                                  f"{_PROMPT_FORMS}; got {type(prompts).__name__}")
        if isinstance(prompts, Sequence):  # checked up front: the error comes before anything starts
            prompts = [as_prompt(item, i) for i, item in enumerate(prompts)]
        self.sync = sync
        self.prompts = prompts
        self.in_flight = in_flight
        self.max_tokens = max_tokens
        self.sampling = {"temperature": 1.0, **(sampling or {})}
        self.pause_mode = pause_mode
        self.clear_cache = clear_cache
        self.max_staleness = max_staleness
        self.stale = stale
        self.clients = [_client_for(e) for e in sync.engines]
        if not self.clients:
            raise ValidationError("StreamingRollout needs a WeightSync with at least one engine")
        self.stats = RolloutStats()
        self.log = get_logger().bind(rollout=uuid.uuid4().hex[:6])
        self._send, self._recv = anyio.create_memory_object_stream[Sample](buffer)
        self._slots = anyio.Semaphore(in_flight)
        self._resumed = anyio.Event()
        self._resumed.set()
        self._updates_begun = 0  # updates that paused the engines so far
        self._label: int | None = None  # the version live on the engines, for engines that do not label tokens
        self._live: dict[int, Sample] = {}
        self._tg: TaskGroup | None = None
        self._cm: Any = None
        self._rr = itertools.count()
        self._update_lock = anyio.Lock()
        self._failure: BaseException | None = None
        self._feed_scope = anyio.CancelScope()  # the feed and every request: what a failure ends

    # -- lifecycle ------------------------------------------------------------------------------------

    async def __aenter__(self) -> StreamingRollout:
        await self.sync.connect()
        self._label = self.sync.version or None
        self.stats = RolloutStats()
        self._feed_scope = anyio.CancelScope()
        self._cm = anyio.create_task_group()
        self._tg = await self._cm.__aenter__()
        self._tg.start_soon(self._feed)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._cm.__aexit__(None, None, None)
        self._send.close()

    def __aiter__(self) -> StreamingRollout:
        return self

    async def __anext__(self) -> Sample:
        try:
            return await self.next()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def next(self, timeout: float | None = None) -> Sample:
        """The next finished sample (EndOfStream once the prompts ran out and every request finished; the
        rollout's error once it failed and the samples finished before were taken)."""
        with anyio.fail_after(timeout):
            try:
                return await self._recv.receive()
            except anyio.EndOfStream:
                if self._failure is not None:
                    raise self._failure from None
                raise

    def _fail(self, error: BaseException) -> None:
        """End the rollout with `error` (the first one counts): no request is started or continued, and the
        consumer gets it once it took the samples already finished. Tasks never raise it themselves: the
        task groups would wrap it in nested ExceptionGroups."""
        if self._failure is None:
            self._failure = error
            self.log.warning("rollout failed", error=str(error))
        # Not the task group's scope: the body of `async with rollout` runs in it, and the consumer must live
        # to take the error.
        self._feed_scope.cancel()
        self._send.close()

    # -- requests ------------------------------------------------------------------------------------

    async def _feed(self) -> None:
        with self._feed_scope:
            await self._feed_prompts()

    async def _feed_prompts(self) -> None:
        index = 0
        bad: Exception | None = None
        async with anyio.create_task_group() as requests:
            try:
                async for item in _aiter(self.prompts):
                    ids, payload = as_prompt(item, index)
                    await self._slots.acquire()
                    await self._resumed.wait()  # no new request starts in the middle of an update
                    sample = Sample(index, ids, payload)
                    index += 1
                    self._live[sample.index] = sample
                    self.stats.in_flight = len(self._live)
                    requests.start_soon(self._request, sample)
            except Exception as e:  # caught inside the task group, which would wrap it in an ExceptionGroup
                bad = e if isinstance(e, StreamSyncError) else ValidationError(
                    f"the prompt source failed after {index} prompts: {type(e).__name__}: {e}")
        # the prompts ran out (or went bad) and every request started finished
        if bad is not None:
            self._fail(bad)
        self._send.close()

    async def _request(self, sample: Sample) -> None:
        try:
            await self._generate(sample)
        except Exception as e:
            # An engine refused or failed the request (a token id beyond its vocabulary, an engine gone).
            self._fail(EngineError(sample.engine, f"the request for prompt {sample.index} failed: "
                                                  f"{getattr(e, 'message', None) or f'{type(e).__name__}: {e}'}"))
            return
        await self._finish(sample)

    async def _generate(self, sample: Sample) -> None:
        try:
            while True:
                client = self.clients[next(self._rr) % len(self.clients)]
                sample.engine = client.name
                remaining = self.max_tokens - len(sample.tokens)
                params = {**self.sampling, "max_tokens": remaining}
                start = len(sample.tokens)
                begun = self._updates_begun
                first: int | None = None  # the label of the stream's first tokens
                async for delta in client.stream(sample.prompt_ids + sample.tokens, params):
                    label = self._label
                    if self.pause_mode == "abort" and delta.tokens:
                        # An abort-mode pause ends every request it finds: one stream never spans two versions,
                        # and its tokens read after an update (buffered while it ran) were sampled before it.
                        first = label if first is None else first
                        label = first
                    sample._extend(delta.tokens, delta.logprobs, label)
                    self.stats.tokens += len(delta.tokens)
                    if delta.spans:
                        sample._relabel(start, delta.spans)
                    if delta.finish_reason is not None:
                        sample.finish_reason = delta.finish_reason
                    # Deltas already buffered (an HTTP response read late) are consumed without an await that
                    # yields: let the loop run between them, so an update sees requests in flight as they are.
                    await anyio.lowlevel.checkpoint()
                if sample.finish_reason is None and len(sample.tokens) < self.max_tokens:
                    # A stream that ends without saying why: an abort-mode pause ends a request the engine had
                    # not started yet so (no output, no finish reason). Any other is the engine's failure.
                    if self._updates_begun == begun and self._resumed.is_set():
                        raise EngineError(client.name, f"the stream for prompt {sample.index} ended without a "
                                                       f"finish reason ({len(sample.tokens)} of {self.max_tokens} "
                                                       "tokens)")
                    sample.finish_reason = "abort"
                if sample.finish_reason == "abort" and len(sample.tokens) < self.max_tokens:
                    # ended by an abort-mode update: continue from the prefix once the new weights are in
                    sample.resubmits += 1
                    self.stats.resubmitted += 1
                    sample.finish_reason = None
                    await self._resumed.wait()
                    continue
                break
        finally:
            self._live.pop(sample.index, None)
            self.stats.in_flight = len(self._live)
            self._slots.release()

    async def _finish(self, sample: Sample) -> None:
        newest = self.sync.version or None
        oldest = sample.oldest_version
        behind = None if newest is None else newest - (oldest if oldest is not None else 0)
        sample.behind = behind
        if self.max_staleness is not None and behind is not None and behind > self.max_staleness:
            if self.stale == "drop":
                self.stats.stale_dropped += 1
                self.log.debug("stale sample dropped", sample=sample.index, behind=behind)
                return
            sample.stale = True
            self.stats.stale_flagged += 1
        self.stats.samples += 1
        await self._send.send(sample)

    # -- updates -------------------------------------------------------------------------------------

    async def update(self, model: object, *, version: int | None = None) -> UpdateReport:
        """Pause every engine, push `model`, resume. On failure the error reaches the caller and generation
        goes on with the weights the engines hold (see README: failed pushes)."""
        async with self._update_lock:
            live = list(self._live.values())
            # Oldest version among requests that produced tokens (the others start on whatever comes next).
            versions = sorted({s.oldest_version for s in live if s.tokens}, key=lambda v: -1 if v is None else v)
            self._resumed = anyio.Event()
            self._updates_begun += 1
            t0 = time.perf_counter()
            try:
                async with self.sync.paused(mode=self.pause_mode, clear_cache=self.clear_cache):
                    report = await self.sync.push(model, version=version)
                # Tokens that arrive from here on were sampled by the new weights (label them after resume:
                # a token generated before the pause may still be on the wire while the engines are paused).
                self._label = report.version
            except StreamSyncError:
                self.stats.failed_updates += 1
                raise
            finally:
                stall = time.perf_counter() - t0
                self._resumed.set()
            self.stats.updates += 1
            self.stats.stall_seconds.append(stall)
            out = UpdateReport(report, stall, len(live), versions)
            if report.trace is not None:  # the rollout's figures travel with the push's trace
                report.trace.meta.update(stall_ms=round(stall * 1e3, 2), requests_in_flight=len(live),
                                         versions_in_flight=versions, pause_mode=self.pause_mode)
                if report.trace_path:
                    report.trace.write(report.trace_path)
            self.log.info("rollout update", version=report.version, stall_ms=round(stall * 1e3, 1),
                          in_flight=len(live), push_ms=round(report.seconds * 1e3, 1))
            return out
