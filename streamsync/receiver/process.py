"""A receiver process: a module built from tensor specs, served by `ReceiverServer` (`ReceiverEngine` talks to it).

    STREAMSYNC_RECEIVER_SECRET=... python -m streamsync.receiver.process --specs model.json [--host 127.0.0.1]
        [--port 0] [--module PACKAGE.MODULE:FACTORY]
    python -m streamsync.receiver.process --specs model.json --secret-file DIR/secret   # generates one, mode 0600

The module is a `StateModule` of the specs (zeros), or what `FACTORY(specs, device=..., tie=...)` returns.

The secret comes from the environment (how `ReceiverProcess` hands it over) or is generated and written to a
new file only its owner can read; never from the command line, which every local user can read.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

import torch

from ..engines.receiver import ReceiverEngine
from ..errors import StreamSyncError
from .protocol import SECRET_ENV, new_secret, proof
from .server import ReceiverServer


def write_secret_file(path: str, secret: str) -> None:
    """Create `path` readable and writable by its owner only; refuse an existing file or a symlink (someone
    else may have placed it to read what is written)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--specs", required=True, help="JSON list of [name, dtype, shape]")
    ap.add_argument("--host", default="127.0.0.1", help="the one address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--delay", type=float, default=0.0, help="sleep per update (tests of slow receivers)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--module", help="PACKAGE.MODULE:FACTORY building the module to serve from the specs "
                    "(default: a StateModule of them)")
    ap.add_argument("--tie", action="store_true", help="passed to --module's factory: lm_head is the embedding's")
    ap.add_argument("--module-args", default="{}", help="JSON object of further keywords for --module's factory")
    ap.add_argument("--gpu-delay-ms", type=float, default=0.0, help="keep the GPU busy ~this long before each "
                    "update's copies (tests that a sender waits for the receiver on the device)")
    ap.add_argument("--no-capture", action="store_true", help="never replay a chunk's load as a captured CUDA "
                    "graph (as a vLLM engine: a Python call and a copy launch per tensor, every push)")
    ap.add_argument("--secret-file", help=f"without {SECRET_ENV}: generate a secret and write it to this new file")
    ap.add_argument("--max-wait", type=float, default=600.0, help="longest wait a client may ask for (seconds)")
    args = ap.parse_args(argv)
    secret = os.environ.pop(SECRET_ENV, None)  # not inherited by anything this process starts
    if secret is None:
        if not args.secret_file:
            ap.error(f"no secret: set {SECRET_ENV} or pass --secret-file")
        secret = new_secret()
        write_secret_file(args.secret_file, secret)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda:"):  # this process's work (and torch.cuda._sleep) goes to that GPU
        torch.cuda.set_device(args.device)
    from ..models.synthetic import StateModule, load_specs

    specs = load_specs(args.specs)
    if args.module:
        import importlib

        mod_name, _, factory = args.module.partition(":")
        extra = json.loads(args.module_args)
        if not isinstance(extra, dict):
            ap.error("--module-args must be a JSON object")
        module: torch.nn.Module = getattr(importlib.import_module(mod_name), factory)(specs, device=args.device,
                                                                                   tie=args.tie, **extra)
    else:
        module = StateModule(specs, fill="zeros", device=args.device)
    profile_to = os.environ.get("STREAMSYNC_RECEIVER_PROFILE")  # benchmarks: where the receiver's time goes
    import cProfile

    prof = cProfile.Profile() if profile_to else None
    server = ReceiverServer(module, args.device, args.delay, args.gpu_delay_ms, secret=secret,
                            max_wait_s=args.max_wait, profiler=prof)
    server.rx.capture = not args.no_capture
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop cleanly: every chunk is unmapped before exiting
        signal.signal(sig, lambda *_: server.stop())
    server.serve(args.host, args.port, ready=lambda port: print(f"LISTENING {port}", flush=True))
    if prof is not None and profile_to:
        prof.dump_stats(profile_to)


class ReceiverProcess:
    """Start `python -m streamsync.receiver.process` and wait for it to listen. `module`: see `--module`.

    A fresh secret is generated here and handed to the child in its environment; `engine()` uses it, and
    `secret` is there for clients built by hand (e.g. in other processes of a multi-rank job)."""

    def __init__(self, specs_path: str, *, delay: float = 0.0, threads: int = 0, start_timeout: float = 60.0,
                 name: str = "receiver", device: str = "cpu", module: str | None = None, gpu_delay_ms: float = 0.0,
                 tie: bool = False, host: str = "127.0.0.1", capture: bool = True, module_args: str | None = None
                 ) -> None:
        args = ["--specs", str(specs_path), "--delay", str(delay), "--threads", str(threads), "--device", device,
                "--host", host, "--gpu-delay-ms", str(gpu_delay_ms)] + (["--module", module] if module else []) \
            + (["--module-args", module_args] if module_args else []) \
            + (["--tie"] if tie else []) + ([] if capture else ["--no-capture"])
        self.name = name
        self.device = device
        self.host = host
        self.secret = new_secret()
        self.proc = self._start(args, {**os.environ, SECRET_ENV: self.secret})
        self.port = self._wait_port(start_timeout)

    def _start(self, args: list[str], env: dict[str, str]) -> Any:
        """The process running `main(args)` in `env`, its stdout a text pipe (`subprocess.Popen`'s interface)."""
        return subprocess.Popen([sys.executable, "-m", "streamsync.receiver.process", *args],
                                stdout=subprocess.PIPE, text=True, env=env)

    def _wait_port(self, timeout: float) -> int:
        result: list[str] = []
        out = self.proc.stdout
        assert out is not None
        reader = threading.Thread(target=lambda: result.append(out.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = result[0] if result else ""
        if not line.startswith("LISTENING "):
            self.kill()
            raise StreamSyncError(f"receiver process did not start within {timeout}s (got {line!r})")
        return int(line.split()[1])

    def engine(self, timeout: float = 60.0) -> ReceiverEngine:
        return ReceiverEngine(self.host, self.port, secret=self.secret, name=self.name, timeout=timeout,
                              device=self.device)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def raw_socket(self, timeout: float = 10.0) -> socket.socket:
        """A blocking socket that has authenticated (tests of the wire protocol itself)."""
        s = socket.create_connection((self.host, self.port), timeout=timeout)
        rf = s.makefile("rb")
        challenge = json.loads(rf.readline())["challenge"]
        nonce = secrets.token_hex(16)
        mac = proof(self.secret, "client", challenge, nonce)
        s.sendall(json.dumps({"op": "auth", "nonce": nonce, "mac": mac}).encode() + b"\n")
        if not json.loads(rf.readline()).get("ok"):
            s.close()
            raise StreamSyncError(f"receiver {self.name} refused the secret")
        return s

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM (the receiver unmaps every chunk and exits), SIGKILL if it has not within 10 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()
