"""A plain receiver in another process, speaking the four phases as JSON lines over TCP on loopback.

`ReceiverServer` serves any module (plain parameters copied by name, or a module with the vLLM model
protocol `load_weights`) and applies chunks with the same `WeightReceiver` the vLLM backend uses;
`ReceiverEngine` is its client. Messages are plain JSON, never pickles. The reference receiver for new
transports; `streamsync.testing.receiver` starts one holding a model built from specs.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import anyio
import torch

from ..checksum import digests
from ..errors import EngineError
from ..receiver import ModuleLoader, WeightReceiver
from .base import Engine

_MAX_LINE = 64 << 20


# --------------------------------------------------------------------------------------------- server


class ReceiverServer:
    def __init__(self, module: torch.nn.Module, device: str, delay_s: float = 0.0, gpu_delay_ms: float = 0.0) -> None:
        self.module = module
        self.gpu_delay_ms = gpu_delay_ms
        # A module with the vLLM model protocol (e.g. testing.fused.FusedModel) loads itself; else copy by name.
        self._plain = ModuleLoader(module)
        self.loader = getattr(module, "load_weights", None) or self._plain
        self.expected = getattr(module, "expected", None) or self._plain.expected
        self.rx = WeightReceiver(device)
        self.delay_s = delay_s
        self.paused = False

    def handle(self, msg: dict[str, Any]) -> Any:
        op = msg.get("op")
        if op == "init":
            self.rx.init(msg["info"])
        elif op == "start":
            self.rx.start()
        elif op == "update":
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.gpu_delay_ms:  # a device busy before the copies: tests that the sender waits on the device
                torch.cuda._sleep(int(self.gpu_delay_ms * 2e6))
            return self.rx.update(msg["info"], self.loader)
        elif op == "finish":
            self.rx.finish(msg["version"])
        elif op == "abort":
            self.rx.abort()
        elif op == "version":
            return self.rx.version
        elif op == "status":
            return {"version": self.rx.version, "updating": self.rx.updating, "dirty": self.rx.dirty,
                    "paused": self.paused, "pid": os.getpid()}
        elif op == "weight_info":
            return {n: [d, list(s)] for n, (d, s) in self.expected().items()}
        elif op == "checksums":
            # HF-named tensors (views into fused parameters where the module fuses them); "device": checksums
            # computed on the device, for models too large to copy to the host and hash.
            named = self.module.hf_tensors() if hasattr(self.module, "hf_tensors") else self.module.state_dict().items()
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
        else:
            raise ValueError(f"unknown op {op!r}")
        return None

    def serve(self, sock: socket.socket) -> None:
        while True:
            conn, _ = sock.accept()
            try:
                if self._serve_one(conn):
                    return
            except OSError:
                pass  # the sender dropped the connection (e.g. a cancelled push): wait for the next one

    def _serve_one(self, conn: socket.socket) -> bool:
        """Answer one connection's requests; True when asked to shut down."""
        with conn, conn.makefile("rb") as rf, conn.makefile("wb") as wf:
            for line in rf:
                msg: dict[str, Any] = {}
                try:
                    parsed = json.loads(line)
                    if not isinstance(parsed, dict):
                        raise ValueError(f"expected a JSON object, got {type(parsed).__name__}")
                    msg = parsed
                    reply = {"ok": True, "result": self.handle(msg)}
                except Exception as e:
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                wf.write(json.dumps(reply).encode() + b"\n")
                wf.flush()
                if msg.get("op") == "shutdown":
                    return True
        return False


# --------------------------------------------------------------------------------------------- client


class ReceiverEngine(Engine):
    """Client of a receiver process. One request at a time; every request has a timeout."""

    def __init__(self, host: str, port: int, *, name: str | None = None, timeout: float = 60.0,
                 device: str = "cpu") -> None:
        self.host, self.port = host, port
        self.name = name or f"receiver@{host}:{port}"
        self.timeout = timeout
        self.device = device
        self._stream: anyio.abc.ByteStream | None = None
        self._buffered: anyio.streams.buffered.BufferedByteReceiveStream | None = None
        self._lock = anyio.Lock()
        self._known: set[str] = set()  # layout keys this connection's receiver has parsed

    async def _connect(self) -> None:
        from anyio.streams.buffered import BufferedByteReceiveStream

        try:
            self._stream = await anyio.connect_tcp(self.host, self.port)
        except OSError as e:
            raise EngineError(self.name, f"cannot connect: {e}") from e
        self._buffered = BufferedByteReceiveStream(self._stream)

    async def call(self, op: str, timeout: float | None = None, **kw: Any) -> Any:
        async with self._lock:
            try:
                with anyio.fail_after(timeout or self.timeout):
                    if self._stream is None:
                        await self._connect()
                    assert self._stream is not None and self._buffered is not None
                    await self._stream.send(json.dumps({"op": op, **kw}).encode() + b"\n")
                    line = await self._buffered.receive_until(b"\n", _MAX_LINE)
            except TimeoutError:
                await self._drop()
                raise EngineError(self.name, f"{op} timed out after {timeout or self.timeout:.1f}s",
                                  unresponsive=True) from None
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError) as e:
                await self._drop()
                raise EngineError(self.name, f"{op} failed: connection lost ({type(e).__name__}); "
                                  "receiver process died?") from None
            except BaseException:  # cancelled mid-request: its reply would answer the next request
                await self._drop()
                raise
        reply = json.loads(line)
        if not reply.get("ok"):
            raise EngineError(self.name, f"{op} refused: {reply.get('error')}")
        return reply.get("result")

    async def _drop(self) -> None:
        self._known.clear()
        if self._stream is not None:
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()
        self._stream = self._buffered = None

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self.call("init", info=init_info)

    async def start_update(self) -> None:
        await self.call("start")

    async def update(self, update_info: dict[str, Any]) -> None:
        """Apply one chunk. A layout the receiver has parsed before goes by its key only (a dense chunk's
        layout is a few KB of JSON, an MoE chunk's tens of KB, each push); if the receiver no longer knows
        the key, the update is sent again with the layout."""
        key = update_info.get("layout_key")
        if isinstance(key, str) and key in self._known:
            try:
                await self.call("update", info={k: v for k, v in update_info.items() if k != "layout"})
                return
            except EngineError as e:
                if "UnknownLayout:" not in str(e):
                    raise
                self._known.discard(key)
        await self.call("update", info=update_info)
        if isinstance(key, str) and update_info.get("layout") is not None:
            if len(self._known) >= 4096:
                self._known.clear()
            self._known.add(key)

    async def finish_update(self, version: int) -> None:
        await self.call("finish", version=version)

    async def get_version(self) -> int | None:
        return await self.call("version")

    async def abort_update(self) -> None:
        await self.call("abort")

    async def expected_weights(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        info = await self.call("weight_info")
        return {n: (d, tuple(s)) for n, (d, s) in info.items()}

    async def checksums(self, device: bool = False) -> dict[str, str]:
        """Per-tensor checksums of what the receiver holds (`device=True`: computed on its device)."""
        return await self.call("checksums", device=device)

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self.call("pause")

    async def resume(self) -> None:
        await self.call("resume")

    async def close(self) -> None:
        await self._drop()
