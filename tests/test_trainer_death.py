"""A trainer that dies inside `paused()` (SIGKILL, or Ctrl-C mid-push) leaves its engine paused; the next
trainer process finds it so at connect, continues the version numbers, and resumes the engine once its push
succeeds, so generation answers again. Real processes: a `vllm serve` engine and trainer subprocesses."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

from streamsync import WeightSync
from streamsync.engines.vllm import VllmHttpEngine
from streamsync.testing.vllm import trainer_from

pytestmark = pytest.mark.vllm

TRAINER = textwrap.dedent("""
    import sys, time, anyio
    from streamsync import WeightSync
    from streamsync.engines.vllm import VllmHttpEngine
    from streamsync.testing.vllm import trainer_from

    url, model_dir = sys.argv[1], sys.argv[2]

    def stall(chunk):  # the signal lands mid-push: a chunk is in the engine, the round is open
        print("CHUNK", flush=True)
        time.sleep(8)  # Ctrl-C cancels the push when the event loop runs again

    async def main():
        sync = WeightSync([VllmHttpEngine(url, name="serve")], chunk_bytes=256 << 10, on_chunk=stall)
        async with sync.paused(mode="keep"):
            await sync.push(trainer_from(model_dir, step=50))

    anyio.run(main)
""")


def sigint_as_at_a_terminal() -> None:
    """The trainer's SIGINT back to the default (Popen's `preexec_fn`): a suite run as a background job of a
    non-interactive shell hands its children SIGINT ignored, and Python then raises no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_mid_push(tmp_path, url: str, model_dir: str, sig: int) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), url, model_dir], stdout=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_at_a_terminal)
    try:
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("CHUNK"):
                break
            assert time.monotonic() < deadline, "the trainer never reached its first chunk"
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
async def test_a_trainer_dead_inside_paused_leaves_nothing_hanging_for_the_next(server, model_dir, tmp_path, sig,
                                                                                caplog):
    engine = VllmHttpEngine(server.url, name="serve")
    before = await engine.get_version()
    _kill_mid_push(tmp_path, server.url, model_dir, sig)
    sync = WeightSync([VllmHttpEngine(server.url, name="serve", timeout=5)], timeout=5, chunk_bytes=1 << 20)
    ok = False
    try:
        assert await engine.is_paused()  # what the dead trainer left

        # A new trainer process (this one). A round left open by a SIGKILLed owner is taken over once it has
        # been idle longer than the sync's timeout.
        await sync.connect()
        assert "serve" in sync.upkeep.stale_paused and "not by this sync" in caplog.text
        if sig == signal.SIGKILL:
            await anyio.sleep(6)
        report = await sync.push(trainer_from(model_dir, step=51))
        if before is not None:  # numbers move on; a round ended as mixed:N (SIGINT) has N taken too
            assert report.version > before + (1 if sig == signal.SIGINT else 0)
        assert not await engine.is_paused()
        with anyio.fail_after(60):  # generation answers, no silent hang
            tokens, _ = await engine.greedy([1, 2, 3, 4], 4)
        assert len(tokens) == 4
        assert await engine.get_version() == report.version
        ok = True
    finally:  # the server is shared by the session's tests: leave no round open and nothing paused
        await sync.close()
        with anyio.CancelScope(shield=True):
            if not ok:
                await _clean_up(server.url, model_dir, engine)
            await engine.close()


async def _clean_up(url: str, model_dir: str, engine: VllmHttpEngine) -> None:
    """After a failure: a whole version pushed (a dead owner's round is taken over after the timeout) and the
    engine resumed, so the session's other tests find it serving."""
    await anyio.sleep(6)
    cleanup = WeightSync([VllmHttpEngine(url, name="serve", timeout=5)], timeout=5)
    try:
        await cleanup.push(trainer_from(model_dir, step=52))
    except Exception as e:  # the test's own failure is the one to report
        print(f"clean-up push failed: {e}")
    await cleanup.close()
    await engine.resume()
