"""The pipeline trace viewer: an aiohttp page that draws a push's stages per chunk over time.

`streamsync trace serve FILE` serves it; the same file opens in Perfetto (ui.perfetto.dev) too.
"""

from __future__ import annotations

import json
from collections import defaultdict
from importlib import resources
from pathlib import Path

from aiohttp import web

from . import STAGES, load_spans


def summary(path: Path) -> str:
    spans = load_spans(path)
    if not spans:
        return f"{path}: no spans"
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    busy: dict[str, float] = defaultdict(float)
    for s in spans:
        busy[s.stage] += s.end - s.start
    chunks = {s.chunk for s in spans}
    lines = [f"{path.name}: {len(chunks)} chunks, {(t1 - t0) * 1e3:.1f} ms wall",
             f"  {'stage':<8} {'busy ms':>9} {'share':>6}"]
    for st in STAGES:
        lines.append(f"  {st:<8} {busy.get(st, 0) * 1e3:9.1f} {busy.get(st, 0) / (t1 - t0):6.0%}")
    return "\n".join(lines)


def make_app(path: Path) -> web.Application:
    page = resources.files("streamsync.trace").joinpath("viewer.html").read_text()

    async def index(_: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    async def trace(_: web.Request) -> web.Response:
        return web.json_response(json.loads(path.read_text()))

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/trace.json", trace)
    return app


def serve(path: Path, host: str = "127.0.0.1", port: int = 8765) -> None:
    print(f"trace viewer for {path} on http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    web.run_app(make_app(path), host=host, port=port, print=None)
