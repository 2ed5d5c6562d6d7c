"""A receiver process holding a model built from specs (tests and benchmarks).

    python -m streamsync.testing.receiver --specs model.json [--host 127.0.0.1] [--port 0] [--fused]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading

import torch

from ..engines.process import ReceiverEngine, ReceiverServer
from ..errors import StreamSyncError


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--specs", required=True, help="JSON list of [name, dtype, shape]")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--delay", type=float, default=0.0, help="sleep per update (tests of slow receivers)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--tie", action="store_true", help="with --fused: lm_head is the embedding's Parameter")
    ap.add_argument("--fused", action="store_true", help="hold vLLM-style fused parameters (streamsync.testing.fused)")
    ap.add_argument("--gpu-delay-ms", type=float, default=0.0, help="keep the GPU busy ~this long before each "
                    "update's copies (tests that a sender waits for the receiver on the device)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda:"):  # this process's work (and torch.cuda._sleep) goes to that GPU
        torch.cuda.set_device(args.device)
    from .models import StateModule, load_specs

    if args.fused:
        from .fused import FusedModel

        module: torch.nn.Module = FusedModel(load_specs(args.specs), fill="zeros", device=args.device,
                                             tie=args.tie)
    else:
        module = StateModule(load_specs(args.specs), fill="zeros", device=args.device)
    sock = socket.create_server((args.host, args.port))
    print(f"LISTENING {sock.getsockname()[1]}", flush=True)
    server = ReceiverServer(module, args.device, args.delay, args.gpu_delay_ms)
    profile_to = os.environ.get("STREAMSYNC_RECEIVER_PROFILE")  # benchmarks: where the receiver's time goes
    if not profile_to:
        server.serve(sock)
        return
    import cProfile

    with cProfile.Profile() as prof:
        server.serve(sock)
    prof.dump_stats(profile_to)



class ReceiverProcess:
    """Start `python -m streamsync.testing.receiver` and wait for it to listen."""

    def __init__(self, specs_path: str, *, delay: float = 0.0, threads: int = 0, start_timeout: float = 60.0,
                 name: str = "receiver", device: str = "cpu", fused: bool = False, gpu_delay_ms: float = 0.0,
                 tie: bool = False) -> None:
        cmd = [sys.executable, "-m", "streamsync.testing.receiver", "--specs", str(specs_path),
               "--delay", str(delay), "--threads", str(threads), "--device", device,
               "--gpu-delay-ms", str(gpu_delay_ms)] + (["--fused"] if fused else []) + (["--tie"] if tie else [])
        self.name = name
        self.device = device
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.port = self._wait_port(start_timeout)

    def _wait_port(self, timeout: float) -> int:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = result[0] if result else ""
        if not line.startswith("LISTENING "):
            self.kill()
            raise StreamSyncError(f"receiver process did not start within {timeout}s (got {line!r})")
        return int(line.split()[1])

    def engine(self, timeout: float = 60.0) -> ReceiverEngine:
        return ReceiverEngine("127.0.0.1", self.port, name=self.name, timeout=timeout, device=self.device)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
                    s.sendall(b'{"op": "shutdown"}\n')
                    s.recv(100)
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()



if __name__ == "__main__":
    main()
