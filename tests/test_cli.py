"""The command line and the trace viewer, run as a user runs them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import psutil
import pytest
from aiohttp import web

import streamsync
from streamsync.cli import main
from streamsync.cli.spec import load_spec
from streamsync.trace import Trace
from streamsync.trace.viewer import make_app, summary

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path, module: str = "streamsync") -> subprocess.CompletedProcess:
    # PYTHONPATH: the tree under test, not whichever streamsync the interpreter has installed
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300,
                          env={"STREAMSYNC_LOG": "warning", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_bench_prints_both_windows_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = _cli("--layers", "4", "--repeat", "1", "--json", str(out), cwd=ROOT, module="benchmarks")
    assert r.returncode == 0, r.stderr
    assert re.search(r"window 4 is \d+\.\d\dx (faster|slower) than window 1", r.stdout), r.stdout
    data = json.loads(out.read_text())
    for key in ("push_s_window1", "push_s_window4", "bytes", "chunks"):
        assert key in data
    assert data["bit_exact"] is True and data["chunks"] > 1


@pytest.mark.slow
def test_run_a_pipeline_spec(tmp_path):
    spec = (ROOT / "pipelines" / "cpu-receiver.toml").read_text().replace("layers = 8", "layers = 2")
    spec = f'work_dir = "{tmp_path}"\n' + spec  # top-level key must come before the tables
    (tmp_path / "p.toml").write_text(spec)
    r = _cli("run", str(tmp_path / "p.toml"), "--json", str(tmp_path / "reports.json"),
             "--set", "sync.max_inflight=1", "--set", "sync.pushes=3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "bit for bit: True" in r.stdout
    reports = json.loads((tmp_path / "reports.json").read_text())
    assert [rep["version"] for rep in reports] == [1, 2, 3]
    assert {rep["max_chunks_alive"] for rep in reports} == {1}


def test_the_bench_says_which_run_is_faster_in_words():
    from benchmarks.cpu import compare

    assert compare("window 4", 0.5, "window 1", 0.59) == "window 4 is 1.18x faster than window 1"
    # slower: the ratio is never printed as "faster"
    assert compare("window 4", 0.59, "window 1", 0.5) == "window 4 is 1.18x slower than window 1 (0.85x its speed)"


def test_streamsync_bench_says_where_the_benchmarks_are(tmp_path):
    r = _cli("bench", "--json", "x.json", cwd=tmp_path)
    assert r.returncode == 2
    assert "python -m benchmarks --json x.json" in r.stderr and "repository root" in r.stderr


def test_version_and_python_dash_m(tmp_path):
    r = _cli("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"streamsync {streamsync.__version__}"


BAD_SPECS = {
    # (what is wrong, the override that makes it so): the one-line error names the key
    "sync.max_inflite: unknown key": "sync.max_inflite=2",
    "sync.chunk_mib: input should be a valid number, got 'big'": 'sync.chunk_mib="big"',
    "sync.max_inflight: input should be greater than or equal to 1, got 0": "sync.max_inflight=0",
    # the choices are the transport registry's
    "sync.transport: input should be 'auto', 'shm', 'cuda_ipc', 'collective' or 'p2p', got 'tcp'": "sync.transport=tcp",
    "model.hiddn: unknown key": "model.hiddn=3",
    "engines[0].nme: unknown key": "engines.0.nme=x",
    "engines: model kind 'synthetic-qwen3' pushes into engines of kind 'receiver'": "engines.0.kind=vllm",
    "model.kind: unknown kind 'gpt'": "model.kind=gpt",
}

CHECKPOINT_SPEC = ROOT / "pipelines" / "checkpoint-to-server.toml"
BAD_CHECKPOINT_SPECS = {
    "model.updat: unknown key": "model.updat=train",
    "model.update: input should be 'perturb', 'train' or 'none', got 'sgd'": "model.update=sgd",
    "model.dtype: input should be 'bfloat16', 'float16' or 'float32', got 'bf16'": "model.dtype=bf16",
    "engines[0].url: expected an http(s) URL such as 'http://127.0.0.1:8000', got '127.0.0.1:8000'":
        'engines.0.url="127.0.0.1:8000"',
    "engines[0].api_key_env: expected the name of an environment variable holding the key":
        "engines.0.api_key_env=sk-123",
    "engines[0].api_ky: unknown key": "engines.0.api_ky=x",
}


@pytest.mark.parametrize("error", list(BAD_SPECS))
def test_a_bad_spec_is_refused_before_anything_starts_with_one_line_naming_the_key(error, capsys):
    code = main(["run", str(ROOT / "pipelines" / "cpu-receiver.toml"), "--set", BAD_SPECS[error]])
    err = capsys.readouterr().err
    assert code == 2 and error in err and err.count("\n") == 1, err


@pytest.mark.parametrize("error", list(BAD_CHECKPOINT_SPECS))
def test_a_bad_checkpoint_spec_is_refused_with_one_line_naming_the_key(error, capsys):
    code = main(["run", str(CHECKPOINT_SPEC), "--set", BAD_CHECKPOINT_SPECS[error]])
    err = capsys.readouterr().err
    assert code == 2 and error in err and err.count("\n") == 1, err


def test_a_checkpoint_pushes_into_servers_only(tmp_path, capsys):
    (tmp_path / "p.toml").write_text("[model]\nkind = 'hf-checkpoint'\npath = '.'\n[[engines]]\nkind = 'receiver'\n")
    assert main(["run", str(tmp_path / "p.toml")]) == 2
    assert "engines: model kind 'hf-checkpoint' pushes into engines of kind 'vllm-http'" in capsys.readouterr().err


def test_a_missing_checkpoint_or_key_variable_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("STREAMSYNC_TEST_NO_KEY", raising=False)
    code = main(["run", str(CHECKPOINT_SPEC), "--set", f"model.path={tmp_path}",
                 "--set", "engines.0.api_key_env=STREAMSYNC_TEST_NO_KEY"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"model.path: no Hugging Face checkpoint at '{tmp_path}' (no config.json there)" in err
    assert "engines[0].api_key_env: environment variable STREAMSYNC_TEST_NO_KEY is not set" in err


@pytest.mark.vllm
@pytest.mark.slow
def test_run_pushes_a_checkpoint_directory_into_a_server_url(server, model_dir, tmp_path):
    import tomllib

    spec = tomllib.loads(CHECKPOINT_SPEC.read_text())
    assert spec["model"]["kind"] == "hf-checkpoint" and spec["engines"][0]["kind"] == "vllm-http"
    for update in ("perturb", "train"):
        r = _cli("run", str(CHECKPOINT_SPEC), "--json", str(tmp_path / f"{update}.json"),
                 "--set", f"model.path={model_dir}", "--set", f"model.update={update}",
                 "--set", f"engines.0.url={server.url}", "--set", f'work_dir="{tmp_path}"', cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert f"engine {server.url}: weights equal the trainer's bit for bit: True" in r.stdout, r.stdout
        reports = json.loads((tmp_path / f"{update}.json").read_text())
        assert len(reports) == 2 and reports[1]["version"] == reports[0]["version"] + 1
        assert all(rep["bytes"] > 0 for rep in reports)


def test_tables_and_lists_must_be_what_the_schema_says(tmp_path, capsys):
    (tmp_path / "p.toml").write_text("[model]\nkind = 'synthetic-qwen3'\n[engines]\nkind = 'receiver'\n")
    assert main(["run", str(tmp_path / "p.toml")]) == 2
    assert "engines: input should be a valid list, got a table" in capsys.readouterr().err


def test_every_shipped_spec_passes_the_schema():
    for path in (ROOT / "pipelines").glob("*.toml"):
        load_spec(path)


def test_overrides_reach_the_checked_spec():
    spec = load_spec(ROOT / "pipelines" / "cpu-receiver.toml", ["sync.max_inflight=2", "engines.0.name=rx"])
    assert spec.sync.max_inflight == 2 and spec.engines[0].name == "rx"


def test_run_refuses_a_missing_or_broken_spec(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.toml")]) == 2
    assert "no pipeline spec" in capsys.readouterr().err
    (tmp_path / "bad.toml").write_text("[model]\nkind = 'synthetic-qwen3'\n")
    assert main(["run", str(tmp_path / "bad.toml")]) == 2
    assert "engines: missing" in capsys.readouterr().err


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
@pytest.mark.parametrize("example", ["async_trainer.py", "sync_trainer.py"])
def test_the_trainer_examples_run_as_written(example):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / example)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300,
                       env={"STREAMSYNC_LOG": "warning", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "receiver at version 3, bit-exact: True" in r.stdout


def test_cpu_serve_defaults_fill_only_the_options_left_unset(tmp_path):
    from streamsync.engines.vllm.launch import cpu_serve_defaults

    plain = cpu_serve_defaults(["--port", "8000", "--dtype", "bfloat16"], env={})
    assert plain[0] == "--enforce-eager" and plain[-2:] == ["--max-model-len", "auto"]
    assert plain[1] == "--kv-cache-memory-bytes" and plain[2] in {f"{n}G" for n in range(1, 9)}
    assert cpu_serve_defaults(["--enforce-eager", "--kv-cache-memory-bytes", "3G", "--max-model-len", "512"],
                              env={}) == []
    # vLLM's other spellings count as passed: -O levels, --opt=value, under_scores
    assert cpu_serve_defaults(["-O3", "--gpu_memory_utilization=0.5", "--max_model_len=1k"], env={}) == []
    assert cpu_serve_defaults(["--enforce-eager", "--max-model-len", "64"], env={"VLLM_CPU_KVCACHE_SPACE": "2"}) == []
    (tmp_path / "c.yaml").write_text("enforce_eager: true\nmax-model-len: 512\n")
    assert cpu_serve_defaults(["--config", str(tmp_path / "c.yaml")], env={})[0] == "--kv-cache-memory-bytes"


@pytest.mark.vllm
@pytest.mark.slow
async def test_streamsync_serve_as_the_readme_writes_it_starts_takes_a_push_and_dies_whole(model_dir, tmp_path):
    pytest.importorskip("vllm")
    from streamsync import WeightSync
    from streamsync.engines.vllm import VllmHttpEngine
    from streamsync.engines.vllm.launch import VllmServer, free_port, vllm_is_cpu_only
    from streamsync.testing.vllm import trainer_from

    if not vllm_is_cpu_only():
        pytest.skip("CPU-sized defaults apply to a CPU-only vLLM")
    port = free_port()
    # README: `streamsync serve ./my-model --port 8000 --dtype bfloat16`; no KV cache size in the environment
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(Path.home()), "VLLM_LOGGING_LEVEL": "INFO"}
    log = tmp_path / "serve.log"
    with VllmServer.command([sys.executable, "-m", "streamsync", "serve", model_dir, "--port", str(port),
                             "--dtype", "bfloat16"], port, env=env, log=log, start_timeout=400) as server:
        async with aiohttp.ClientSession() as s, s.post(f"{server.url}/v1/completions", json={
                "model": model_dir, "prompt": "the model weight", "max_tokens": 5, "temperature": 0}) as r:
            assert r.status == 200, await r.text()
            body = await r.json()
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["text"]
        engine = VllmHttpEngine(server.url)
        sync = WeightSync([engine], chunk_bytes=1 << 20)
        report = await sync.push(trainer_from(model_dir, step=4))
        assert await engine.get_version() == report.version
        await sync.close()
        # SIGKILLed (an orchestrator, the OOM killer): vLLM's engine core and workers go with it
        children = [p for p in server.processes() if p.pid != server.proc.pid]
        assert children
        os.kill(server.proc.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    text = log.read_text()
    said = text.splitlines()[0]
    assert said.startswith("streamsync serve: CPU-only vLLM: added --enforce-eager --kv-cache-memory-bytes "), said
    assert "--max-model-len auto" in said
    assert "'enforce_eager': True" in text and "'max_model_len': -1" in text  # what vLLM was given


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(("example", "shows"), [
    ("partial_rollout.py", r"weight versions used: \[\('1', 0, (\d+)\), \('2', \1, 64\)\]"),
    # the feature it exists for: samples sampled partly by the old weights and partly by the new ones
    # (one update or several while it was in flight: how many depends on how fast each push is)
    ("streaming_rl.py", r"sample +\d+ \(vllm-cpu\): v(\d+)\[0:\d+\](, v\d+\[\d+:\d+\])*, v\d+\[\d+:96\]  "
                        r"<- crosses an update"),
])
def test_the_vllm_examples_run_as_written_and_end_cleanly_and_quietly(example, shows):
    pytest.importorskip("vllm")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / example)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600,
                       env={"STREAMSYNC_LOG": "warning", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(shows, r.stdout), r.stdout[-3000:]
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
    assert not re.search(r"\) INFO ", r.stdout), "vLLM's info lines are shown"  # VLLM_LOGGING_LEVEL=WARNING
    assert "Failed to load weights" not in r.stdout + r.stderr  # the worker's filter


def test_every_cli_argument_has_help_and_the_viewer_says_its_default_port(capsys) -> None:
    import argparse

    from streamsync.cli import main

    def parsers(ap: argparse.ArgumentParser):
        yield ap
        for action in ap._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    captured: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_known_args

    def spy(self, *a, **kw):
        captured.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_known_args = spy  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            main(["--version"])
    finally:
        argparse.ArgumentParser.parse_known_args = real  # type: ignore[method-assign]
    missing = [f"{p.prog}: {a.dest}" for p in parsers(captured[0]) for a in p._actions
               if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert not missing, missing
    with pytest.raises(SystemExit):
        main(["trace", "serve", "--help"])
    assert "default: 8765" in capsys.readouterr().out
