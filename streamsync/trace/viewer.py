"""The pipeline trace viewer: an aiohttp server and one self-contained page (no network dependencies).

* `streamsync trace serve FILE|DIR ...`: `/` lists the traces (pushes over time: duration, GB/s, version,
  failures); `/view?f=A&f=B` draws one or several on one shared time scale.
* `WeightSync(trace_live=...)` runs a `LiveViewer` in the trainer's event loop; `/live` follows the pushes
  as they run (server-sent events, polled from the trace ten times a second: the push itself does no work
  for the viewer).

The header numbers come from `summary.summarize` in both cases, so the page, the index and
`streamsync trace summary` print the same ones. The same files open in Perfetto (ui.perfetto.dev).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import deque
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from . import Trace, from_chrome, load
from .summary import summarize

SSE_TICK = 0.1  # seconds between live updates


def summary(path: Path) -> str:
    """`streamsync trace summary FILE`: the viewer's header numbers and a per-stage table."""
    return summarize(load(path)).text(path.name)


def _page() -> str:
    return resources.files("streamsync.trace").joinpath("viewer.html").read_text()


class TraceFiles:
    """The trace files behind a viewer: named files plus every `*.trace.json` in named directories
    (rescanned on each listing, so new pushes show up)."""

    def __init__(self, paths: Iterable[str | os.PathLike]) -> None:
        self.paths = [Path(p) for p in paths]

    def files(self) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for p in self.paths:
            found = sorted(p.glob("*.trace.json")) if p.is_dir() else [p]
            for f in found:
                key = f.name if f.name not in out else f"{len(out)}~{f.name}"
                out[key] = f
        return out

    def listing(self) -> list[dict[str, Any]]:
        rows = []
        for key, f in self.files().items():
            try:
                rows.append({"file": key, **summarize(load(f)).to_dict()})
            except (OSError, ValueError, KeyError, TypeError) as e:  # a half-written or foreign file
                rows.append({"file": key, "unreadable": f"{type(e).__name__}: {e}"})
        return sorted(rows, key=lambda r: r.get("started", 0.0))


def make_app(*paths: str | os.PathLike, live: LiveViewer | None = None) -> web.Application:
    """The viewer for trace files and directories (and, with `live`, the pushes of a running WeightSync)."""
    traces = TraceFiles(paths)
    page = _page()

    async def index(_: web.Request) -> web.Response:
        files = traces.files()
        if len(files) == 1 and live is None and all(p.is_file() for p in traces.paths):
            raise web.HTTPFound(f"/view?f={next(iter(files))}")
        return web.Response(text=page, content_type="text/html")

    async def view(_: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"live": live is not None})

    def in_memory() -> dict[str, Trace]:  # a live viewer's finished pushes, also without a trace_dir
        return {f"live:{t.push_id}": t for t in (live.traces if live is not None else ()) if t.done}

    async def listing(_: web.Request) -> web.Response:
        rows = traces.listing()
        on_disk = {r.get("push_id") for r in rows}
        rows += [{"file": key, **summarize(t).to_dict()} for key, t in in_memory().items()
                 if t.push_id not in on_disk]
        return web.json_response(sorted(rows, key=lambda r: r.get("started", 0.0)))

    async def trace(req: web.Request) -> web.Response:
        name = req.query.get("f", "")
        mem = in_memory().get(name)
        if mem is not None:
            return web.json_response({"file": name, "trace": mem.to_chrome(), "summary": summarize(mem).to_dict()})
        path = traces.files().get(name)
        if path is None:
            raise web.HTTPNotFound(text=f"no trace {name!r}")
        data = json.loads(path.read_text())
        return web.json_response({"file": name, "trace": data, "summary": summarize(from_chrome(data)).to_dict()})

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/view", view)
    app.router.add_get("/live", view)
    app.router.add_get("/api/info", info)
    app.router.add_get("/api/traces", listing)
    app.router.add_get("/api/trace", trace)
    if live is not None:
        app.router.add_get("/api/live", live.events)
    return app


def serve(paths: Iterable[Path], host: str = "127.0.0.1", port: int = 8765) -> None:
    paths = list(paths)
    print(f"trace viewer for {', '.join(map(str, paths))} on http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    web.run_app(make_app(*paths), host=host, port=port, print=None)


# -- live ------------------------------------------------------------------------------------------------


def _span_rows(trace: Trace, start: int) -> list[list[Any]]:
    with trace._lock:
        spans = trace.spans[start:]
    return [[s.stage, s.chunk, s.start * 1e3, (s.end - s.start) * 1e3, s.bytes, s.receiver] for s in spans]


def _sample_rows(trace: Trace, start: int) -> list[list[Any]]:
    with trace._lock:
        samples = trace.samples[start:]
    return [[s.name, s.t * 1e3, s.value] for s in samples]


class LiveViewer:
    """The viewer, served from the trainer's own event loop, following its pushes as they run.

    `add(trace)` at each push start; the page at `url` (`/live`) gets the spans and counters as they are
    recorded, and the header numbers (`summarize` of the trace so far), over server-sent events. The last
    `keep` pushes stay in memory (a page opened late sees the latest one whole); with `trace_dir` the index
    page lists the written files too.
    """

    def __init__(self, bind: str = "127.0.0.1:8765", *, trace_dir: str | os.PathLike | None = None,
                 keep: int = 8) -> None:
        host, _, port = bind.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.trace_dir = trace_dir
        self.traces: deque[Trace] = deque(maxlen=keep)
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/live"

    async def start(self) -> None:
        if self._runner is not None:
            return
        self._closing = asyncio.Event()
        app = make_app(*([self.trace_dir] if self.trace_dir is not None else []), live=self)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # port 0: the one picked

    async def stop(self) -> None:
        if self._runner is None:
            return
        self._closing.set()
        await self._runner.cleanup()
        self._runner = None

    def add(self, trace: Trace) -> None:
        self.traces.append(trace)

    async def events(self, req: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(req)

        async def send(event: str, data: object) -> None:
            await resp.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())

        current: Trace | None = None
        n_spans = n_samples = 0
        finished = False
        try:
            await send("hello", {"pushes": len(self.traces)})
            while not self._closing.is_set():
                latest = self.traces[-1] if self.traces else None
                if latest is not None and latest is not current:
                    current, n_spans, n_samples, finished = latest, 0, 0, False
                    await send("push", {"push_id": current.push_id, "epoch0": current.epoch0})
                if current is not None and not finished:
                    done = current.done  # read before the spans: the final batch then holds every span
                    spans, samples = _span_rows(current, n_spans), _sample_rows(current, n_samples)
                    n_spans, n_samples = n_spans + len(spans), n_samples + len(samples)
                    await send("update", {"push_id": current.push_id, "spans": spans, "samples": samples,
                                          "summary": summarize(current).to_dict()})
                    finished = done
                try:
                    await asyncio.wait_for(self._closing.wait(), SSE_TICK)
                except TimeoutError:
                    pass
        except ConnectionResetError:  # the page went away
            pass
        return resp
