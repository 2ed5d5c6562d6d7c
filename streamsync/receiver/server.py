"""A plain receiver in another process, speaking the four phases as JSON lines over TCP on loopback.

`ReceiverServer` serves any module (plain parameters copied by name, or a module with the vLLM model
protocol `load_weights`) and applies chunks with the same `WeightReceiver` the vLLM backend uses;
`ReceiverEngine` is its client. Messages are plain JSON, never pickles. The reference receiver for new
transports; `streamsync.receiver.process` starts one holding a model built from specs.

Security (docs/reliability.md, "Security model"): anyone on the machine can connect to a TCP port, so every
connection first proves it holds the receiver's secret, an HMAC-SHA256 challenge-response in both
directions, before any op is served; the secret itself never crosses the socket. Connections are served
concurrently (an idle one blocks nobody; ops on the receiver's state run one at a time), lines are
bounded, a connection that has not authenticated within `handshake_timeout` is dropped, and waits a
caller asks for (`init_info["timeout_s"]`) are capped by the receiver's owner (`max_wait_s`).
"""

from __future__ import annotations

import cProfile
import json
import math
import os
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from ..checksum import digests
from ..errors import ValidationError
from ..log import get_logger
from .loaders import Loader, LoadingModule, ModuleLoader
from .protocol import HELLO_LINE, MAX_LINE, proof, same_secret
from .state import WeightReceiver

# --------------------------------------------------------------------------------------------- server


_OPS = frozenset({"init", "start", "update", "finish", "abort", "version", "status", "fused_layout", "layout",
                  "weight_info", "checksums", "pause", "resume", "shutdown", "ping", "capture", "delta_base"})


class ReceiverServer:
    """Serve one module to authenticated clients. `secret`: at least 32 characters (`new_secret()`),
    handed to clients out of band. `max_wait_s` caps the waits a client may ask for (a collective's
    `timeout_s`); `max_pending` caps connections that have not authenticated yet."""

    def __init__(self, module: torch.nn.Module, device: str, delay_s: float = 0.0, gpu_delay_ms: float = 0.0, *,
                 secret: str, max_line: int = MAX_LINE, handshake_timeout: float = 5.0,
                 max_wait_s: float = 600.0, max_pending: int = 64,
                 profiler: cProfile.Profile | None = None) -> None:
        if not isinstance(secret, str) or len(secret) < 32:
            raise ValidationError("a receiver secret must be a string of at least 32 characters (new_secret())")
        self.module = module
        self.gpu_delay_ms = gpu_delay_ms
        # A module with a layout of its own (the fused stand-in) makes its loader; a plain one is copied by name.
        self.loader: Loader = module.loader() if isinstance(module, LoadingModule) else ModuleLoader(module)
        self.rx = WeightReceiver(device)
        if self.rx.device.type == "cuda":  # the captured loads' kernel, compiled before any client connects
            from . import kernels

            try:
                kernels.warm(self.rx.device)
            except Exception as e:  # no working Triton here: captured loads record PyTorch's copies
                self.rx.kernel_copies = False
                get_logger().warning("receiver: the segment copy kernel is unavailable", error=str(e))
        self.delay_s = delay_s
        self.paused = False
        self._secret = secret
        self.max_line = max_line
        self.handshake_timeout = handshake_timeout
        self.max_wait_s = max_wait_s
        self.max_pending = max_pending
        self.profiler = profiler
        self._pending = threading.BoundedSemaphore(max_pending)  # connections not yet authenticated
        self._lock = threading.Lock()  # one op at a time on the receiver's state
        self._server: _Listener | None = None
        #: op -> [calls, seconds from its line read to its reply written]: where a push's time goes here
        self.busy: dict[str, list[float]] = {}

    def handle(self, msg: dict[str, Any]) -> Any:
        op = msg.get("op")
        owner = msg.get("owner") if isinstance(msg.get("owner"), str) else None
        if op == "init":
            self.rx.init(self._bounded(msg["info"]), owner)
        elif op == "start":
            stale = msg.get("stale_after")
            self.rx.start(owner, float(stale) if isinstance(stale, int | float) and stale > 0 else None)
        elif op == "update":
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.gpu_delay_ms:  # a device busy before the copies: tests that the sender waits on the device
                torch.cuda._sleep(int(self.gpu_delay_ms * 2e6))
            return self.rx.update(msg["info"], self.loader)
        elif op == "finish":
            self.rx.finish(msg["version"], owner)
        elif op == "abort":
            self.rx.abort(owner)
        elif op == "version":  # the version held whole: None while a failed round left mixed weights
            return self.rx.clean_version
        elif op == "status":
            return {"version": self.rx.clean_version, "last_version": self.rx.version,
                    "updating": self.rx.updating, "dirty": self.rx.dirty,
                    "mixed": self.rx.dirty and not self.rx.updating, "paused": self.paused, "pid": os.getpid(),
                    "graphs": {"replayed": self.rx.stats.replayed, "captured": self.rx.stats.captured,
                               "held": self.rx.graphs_held},
                    "busy_ms": {k: [int(n), round(t * 1e3, 3)] for k, (n, t) in self.busy.items()},
                    "update_split_ms": {k: round(t * 1e3, 3) for k, t in self._split().items()}}
        elif op == "delta_base":  # the push a delta must be computed against, and the copy's size
            held = self.rx.base.held
            return {"held": list(held) if held else None, "bytes": self.rx.base.nbytes, "where": self.rx.base.where,
                    "in_place_bytes": self.rx.base.in_place_bytes}
        elif op == "fused_layout":  # the engine's own layout a sender may convert into (pack.fuse_layout)
            return self.module.fused_layout() if isinstance(self.module, LoadingModule) else None
        elif op == "layout":  # the boxes of HF tensors it holds, for sharded sending (None: whole tensors)
            boxes = self.module.layout() if isinstance(self.module, LoadingModule) else None
            return None if boxes is None else [[n, b.to_json()] for n, b in boxes]
        elif op == "weight_info":
            expected = self.loader.expected() or {}
            return {n: [d, list(s)] for n, (d, s) in expected.items()}
        elif op == "checksums":
            # HF-named tensors (views into fused parameters where the module fuses them); "device": checksums
            # computed on the device, for models too large to copy to the host and hash.
            named = (self.module.hf_tensors() if isinstance(self.module, LoadingModule)
                     else self.module.state_dict().items())
            if msg.get("device"):
                from ..checksum import device_digests

                return device_digests(named)
            return digests(named)
        elif op == "pause":
            self.paused = True
        elif op == "resume":
            self.paused = False
        elif op == "shutdown":
            self.rx.close()  # unmap chunks (CUDA IPC: the sender may free its buffers) before exiting
            return None
        elif op == "ping":
            return "pong"
        elif op == "capture":  # benchmarks: replay loads as captured graphs (default) or load every tensor
            self.rx.capture = bool(msg.get("on", True))
            self.rx.kernel_copies = bool(msg.get("kernel", True))  # graphs of one kernel (default) or of copies
        else:
            raise ValueError(f"unknown op {op!r}")
        return None

    def _split(self) -> dict[str, float]:
        """Host seconds in update by part, the transport's own measurements beside them."""
        return {**self.rx.stats.seconds, **(self.rx.transport.stats() if self.rx.transport is not None else {})}

    def _bounded(self, info: Any) -> Any:
        """Refuse waits longer than the owner allows: `timeout_s` comes from the client."""
        t = info.get("timeout_s") if isinstance(info, dict) else None
        if t is not None and not (isinstance(t, int | float) and 0 < t <= self.max_wait_s and math.isfinite(t)):
            raise ValidationError(f"init_info timeout_s must be in (0, {self.max_wait_s:g}] s here, got {t!r:.40}")
        return info

    def _call(self, msg: dict[str, Any]) -> Any:
        return self.profiler.runcall(self.handle, msg) if self.profiler else self.handle(msg)

    def serve(self, host: str, port: int, ready: Callable[[int], None] | None = None) -> None:
        """Listen on exactly `host` (no wildcard unless asked for), port `port` (0: a free one, passed to
        `ready`), until a `shutdown` op or `stop()`; then unmap every chunk (CUDA IPC: the sender may free
        its buffers). Each connection has its own thread; ops take the state lock, one at a time."""
        self._server = _Listener((host, port), self)
        try:
            if ready is not None:
                ready(self._server.server_address[1])
            self._server.serve_forever(poll_interval=0.2)
        finally:
            self._server.server_close()
            with self._lock:  # after the op in flight, if any
                self.rx.close()

    def stop(self) -> None:
        """Make `serve` return (callable from any thread, a signal handler included)."""
        if self._server is not None:
            threading.Thread(target=self._server.shutdown, daemon=True).start()

    def _converse(self, conn: socket.socket) -> None:
        with conn.makefile("rb") as rf, conn.makefile("wb") as wf:
            if not self._pending.acquire(blocking=False):
                _refuse(conn, rf, wf, "too many connections waiting to authenticate; try again")
                return
            # The whole handshake within handshake_timeout (a per-read timeout would let a client that sends a
            # byte at a time hold its slot for hours): the watchdog shuts the socket, which ends any read.
            watchdog = threading.Timer(self.handshake_timeout, _shut, (conn,))
            watchdog.daemon = True  # a pending handshake never delays the receiver's exit
            watchdog.start()
            try:
                authenticated = self._handshake(conn, rf, wf)
            finally:
                watchdog.cancel()
                self._pending.release()
            if not authenticated:
                return
            while line := rf.readline(self.max_line + 1):  # an authenticated client may idle between pushes
                t0 = time.perf_counter()
                if not line.endswith(b"\n") and len(line) > self.max_line:
                    _refuse(conn, rf, wf, f"request line longer than {self.max_line} bytes: connection closed")
                    return
                reply, shutdown, op = self._answer(line)
                _send(wf, reply)
                if isinstance(op, str) and op in _OPS:
                    b = self.busy.setdefault(op, [0, 0.0])
                    b[0] += 1
                    b[1] += time.perf_counter() - t0
                if shutdown:
                    self.stop()
                    return

    def _handshake(self, conn: socket.socket, rf: BinaryIO, wf: BinaryIO) -> bool:
        """Challenge-response: the client proves it holds the secret, then the server does. False (and the
        connection refused) on anything else: a line before authentication is never served as an op."""
        challenge = secrets.token_hex(16)
        _send(wf, {"protocol": "streamsync-receiver/1", "challenge": challenge})
        line = rf.readline(HELLO_LINE + 1)
        if not line.endswith(b"\n") and len(line) > HELLO_LINE:
            _refuse(conn, rf, wf, f"line longer than {HELLO_LINE} bytes before authentication")
            return False
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        nonce = msg.get("nonce") if isinstance(msg, dict) else None
        if not (isinstance(msg, dict) and msg.get("op") == "auth" and isinstance(nonce, str) and len(nonce) >= 16):
            _refuse(conn, rf, wf, 'authentication required: the first message must be {"op": "auth", "nonce", "mac"}')
            return False
        if not same_secret(msg.get("mac"), proof(self._secret, "client", challenge, nonce)):
            _refuse(conn, rf, wf, "authentication failed")
            return False
        _send(wf, {"ok": True, "result": {"mac": proof(self._secret, "server", challenge, nonce)}})
        return True

    def _answer(self, line: bytes) -> tuple[dict[str, Any], bool, object]:
        """(reply, shutdown requested, the op asked for)."""
        msg: Any = None
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError(f"expected a JSON object, got {type(msg).__name__}")
            with self._lock:
                result = self._call(msg)
            json.dumps(result)  # a result that cannot be sent is this op's error, not the connection's
        except Exception as e:
            op = msg.get("op") if isinstance(msg, dict) else None
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}, False, op
        return {"ok": True, "result": result}, msg.get("op") == "shutdown", msg.get("op")


class _Listener(socketserver.ThreadingTCPServer):
    """Binds exactly the address given. A thread per connection rather than an event loop with ops in worker
    threads: a hop to a worker thread and back per op would add a thread switch to every chunk's round trip,
    and the thread that reads a request is the one that runs it."""

    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], owner: ReceiverServer) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.owner = owner
        super().__init__(address, _Connection)


class _Connection(socketserver.BaseRequestHandler):
    server: _Listener

    def handle(self) -> None:
        try:
            self.server.owner._converse(self.request)
        except Exception:
            pass  # the client went away (e.g. a cancelled push) or broke the protocol: others carry on


def _send(wf: BinaryIO, msg: dict[str, Any]) -> None:
    wf.write(json.dumps(msg).encode() + b"\n")
    wf.flush()


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _refuse(conn: socket.socket, rf: BinaryIO, wf: BinaryIO, error: str) -> None:
    """Say why, then close. What the client still sends is read and dropped, 64 KiB at a time, for up to a
    second and 16 MiB (closing with unread bytes resets the connection, and the client could lose the reason)."""
    _send(wf, {"ok": False, "error": error})
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(1.0)
    deadline = time.monotonic() + 1.0
    try:
        for _ in range(256):
            if time.monotonic() > deadline or not conn.recv(1 << 16):
                break
    except OSError:
        pass
