"""The command line and the trace viewer, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from streamsync.trace import Trace
from streamsync.trace.viewer import make_app, summary

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamsync.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={"STREAMSYNC_LOG": "warning", "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_bench_prints_both_windows_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = _cli("bench", "--layers", "4", "--repeat", "1", "--json", str(out), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "window 4 vs 1" in r.stdout
    data = json.loads(out.read_text())
    for key in ("push_s_window1", "push_s_window4", "bytes", "chunks"):
        assert key in data
    assert data["bit_exact"] is True and data["chunks"] > 1


@pytest.mark.slow
def test_run_a_pipeline_spec(tmp_path):
    spec = (ROOT / "pipelines" / "cpu-receiver.toml").read_text().replace("layers = 8", "layers = 2")
    spec = f'work_dir = "{tmp_path}"\n' + spec  # top-level key must come before the tables
    (tmp_path / "p.toml").write_text(spec)
    r = _cli("run", str(tmp_path / "p.toml"), "--json", str(tmp_path / "reports.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "bit for bit: True" in r.stdout
    reports = json.loads((tmp_path / "reports.json").read_text())
    assert [rep["version"] for rep in reports] == [1, 2]


def test_run_refuses_a_missing_or_broken_spec(tmp_path):
    r = _cli("run", str(tmp_path / "nope.toml"), cwd=tmp_path)
    assert r.returncode != 0 and "no pipeline spec" in r.stderr
    (tmp_path / "bad.toml").write_text("[model]\nkind = 'synthetic-qwen3'\n")
    r = _cli("run", str(tmp_path / "bad.toml"), cwd=tmp_path)
    assert r.returncode != 0 and "missing [engines]" in r.stderr


def _trace_file(tmp_path: Path) -> Path:
    tr = Trace("abc123")
    for chunk in range(3):
        for i, stage in enumerate(("gather", "convert", "pack", "send", "release")):
            tr.add_span(stage, chunk, chunk * 0.01 + i * 0.002, chunk * 0.01 + i * 0.002 + 0.0015, 1 << 20)
    tr.sample("chunks_alive", 1)
    return tr.write(tmp_path / "t.trace.json")


def test_trace_summary_lists_every_stage(tmp_path):
    text = summary(_trace_file(tmp_path))
    assert "3 chunks" in text
    for stage in ("gather", "convert", "pack", "send", "release"):
        assert stage in text


async def test_viewer_serves_the_page_and_the_trace(tmp_path):
    path = _trace_file(tmp_path)
    runner = web.AppRunner(make_app(path))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/") as r:  # one file: straight to its view
                assert r.status == 200 and "<title>streamsync trace</title>" in await r.text()
                assert r.url.path == "/view" and r.url.query["f"] == "t.trace.json"
            async with s.get(f"http://127.0.0.1:{port}/api/trace", params={"f": "t.trace.json"}) as r:
                data = await r.json()
        assert sum(e["ph"] == "X" for e in data["trace"]["traceEvents"]) == 15
        assert data["summary"]["chunks"] == 3
    finally:
        await runner.cleanup()


@pytest.mark.slow
def test_the_async_trainer_example_runs_as_written():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "async_trainer.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={"STREAMSYNC_LOG": "warning", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "receiver at version 3, bit-exact: True" in r.stdout
