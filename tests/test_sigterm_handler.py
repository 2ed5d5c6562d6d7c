"""`interrupts.sigterm_cancels`, the SIGTERM handler of async pushes, in this process: real signals to itself
(the trainer processes of `test_interrupts` check a whole push stopped by one)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from streamsync.interrupts import _on_sigterm, sigterm_cancels


@pytest.fixture(autouse=True)
def _default_sigterm():
    """Each test starts with SIGTERM's default action, as a trainer does (the suite's process may hold a handler
    another test's engine installed), and leaves the handler it found."""
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


async def test_one_sigterm_cancels_every_push_running_and_the_default_handler_is_back_after_the_last():
    calls: list[str] = []
    with sigterm_cancels(lambda: calls.append("a")) as a:
        assert signal.getsignal(signal.SIGTERM) is _on_sigterm
        with sigterm_cancels(lambda: calls.append("b")) as b:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler queues each cancel on the loop
                await asyncio.sleep(0.01)
                if len(calls) == 2:
                    break
        assert signal.getsignal(signal.SIGTERM) is _on_sigterm  # push a still runs
    assert sorted(calls) == ["a", "b"] and a == b == [int(signal.SIGTERM)]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


async def test_a_handler_the_program_installed_is_left_alone():
    def own(signum, frame):
        pass

    signal.signal(signal.SIGTERM, own)
    with sigterm_cancels(lambda: None) as fired:
        assert signal.getsignal(signal.SIGTERM) is own
    assert signal.getsignal(signal.SIGTERM) is own and fired == []


def test_without_a_running_loop_the_default_stays():
    with sigterm_cancels(lambda: None) as fired:
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert fired == []


def test_a_sigterm_that_arrives_as_the_last_push_ends_still_ends_the_process():
    """The handler with no push left running (the signal raced the push's end) takes the default action."""
    code = ("import signal, time; from streamsync.interrupts import _on_sigterm\n"
            "signal.signal(signal.SIGTERM, _on_sigterm)\n_on_sigterm(signal.SIGTERM, None)\ntime.sleep(30)\n"
            "print('still running')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr[-2000:])
