"""The receiver process for tests and benchmarks: `ReceiverProcess(..., fused=True)` serves the vLLM-style
fused stand-in (`streamsync.testing.fused.FusedModel`) instead of plain parameters.

It runs the product's receiver (`streamsync.receiver.process.main`) in a process of its own: started as
`python -m streamsync.receiver.process`, as the product's `ReceiverProcess` does, or, once `fork_server` is set
(the test suite's conftest sets it), forked from the test helpers' fork server (`testing.forked`) where there is
one: a fresh interpreter spends over a second importing torch before it listens, and a test session starts about
a hundred receivers. Not by default: a process forked from the server first imports the launching program's
`__main__` again, which a script without a `__name__ == "__main__"` guard does not survive."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from ..receiver.process import ReceiverProcess as _ReceiverProcess

FUSED = "streamsync.testing.fused:receiver_module"
SLICED = "streamsync.testing.sliced:sliced_module"


class ReceiverProcess(_ReceiverProcess):
    """`fused`: the vLLM-style fused stand-in; `holds` ((HF name, box) pairs): one worker of a sharded engine
    holding those slices (`streamsync.testing.sliced`)."""

    #: fork the receivers from the test helpers' fork server (module doc)
    fork_server = False

    def __init__(self, specs_path: str, *, fused: bool = False, holds: Any = None, **kwargs: Any) -> None:
        if holds is not None:
            from .sliced import module_args

            kwargs.update(module=SLICED, module_args=module_args(holds))
        super().__init__(specs_path, module=FUSED if fused else kwargs.pop("module", None), **kwargs)

    def _start(self, args: list[str], env: dict[str, str]) -> Any:
        from .forked import context

        ctx = context() if self.fork_server else None
        if ctx is None:
            return super()._start(args, env)
        read, write = ctx.Pipe(duplex=False)
        err = ctx.Pipe(duplex=False)[1].__class__(os.dup(sys.stderr.fileno()), readable=False)
        proc = ctx.Process(target=_serve, args=(args, env, os.getcwd(), write, err), name=f"receiver {self.name}",
                           daemon=True)  # daemon: one a test leaked is ended at exit, not waited for
        proc.start()
        write.close()
        err.close()
        out = os.fdopen(os.dup(read.fileno()), "r")
        read.close()
        return _Forked(proc, out)


def _serve(args: list[str], env: dict[str, str], cwd: str, out: Any, err: Any) -> None:
    """The forked receiver: stdout into the pipe the launcher reads its port from, stderr the launcher's."""
    from ..receiver.process import main
    from .forked import become

    become(env, cwd)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    main(args)
    sys.stdout.flush()


class _Forked:
    """A forked receiver behind the part of `subprocess.Popen`'s interface `ReceiverProcess` and the tests use."""

    def __init__(self, proc: Any, stdout: Any) -> None:
        self._proc = proc
        self.stdout = stdout
        self.pid: int = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"receiver {self.pid}", timeout or 0.0)
        self.stdout.close()
        return self._proc.exitcode

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)
