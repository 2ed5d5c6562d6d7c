"""`ReceiverEngine`: the client of a receiver process (receiver/server.py)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from ..cache import BoundedCache
from ..errors import EngineError
from ..message import UpdateMessage, wire
from ..plan.shards import Box, EngineLayout, Need
from ..receiver.protocol import HELLO_LINE, REPLY_LINE, proof, same_secret
from .abilities import Checkpointed, Fused, KeepsDeltaBase, Pausable, ReadsBack, Sharded
from .base import Engine, EngineState

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------------------------- client


class ReceiverEngine(Engine, Checkpointed, Fused, Sharded, KeepsDeltaBase, ReadsBack, Pausable):
    """Client of a receiver process. One request at a time; every request has a timeout.

    `secret` is the receiver's (`ReceiverProcess.secret`, or what its owner handed over out of band); each
    new connection proves it and checks the receiver's proof before any request is sent."""

    def __init__(self, host: str, port: int, *, secret: str, name: str | None = None, timeout: float = 60.0,
                 device: str = "cpu") -> None:
        self.host, self.port = host, port
        self._secret = secret  # proves who we are to the receiver, and the receiver to us; never sent
        self.name = name or f"receiver@{host}:{port}"
        self.timeout = timeout
        self.device = device
        self._stream: anyio.abc.ByteStream | None = None
        self._buffered: BufferedByteReceiveStream | None = None
        self._lock = anyio.Lock()
        # layout keys this connection's receiver has parsed (it keeps as many: `WeightReceiver`)
        self._known: BoundedCache[str, bool] = BoundedCache(4096)
        #: per op: [calls, seconds from request to reply, seconds encoding and writing the request] (for
        #: benchmarks: the rest, less the receiver's own busy time, is the socket and the two processes' waits)
        self.rpc_seconds: dict[str, list[float]] = {}

    async def _connect(self) -> None:
        try:
            self._stream = await anyio.connect_tcp(self.host, self.port)
        except OSError as e:
            raise EngineError(self.name, f"cannot connect: {e}") from e
        self._buffered = BufferedByteReceiveStream(self._stream)
        hello = _json_line(self.name, await self._buffered.receive_until(b"\n", HELLO_LINE))
        challenge = hello.get("challenge")
        if hello.get("ok") is False:  # e.g. too many connections waiting to authenticate
            raise EngineError(self.name, f"receiver refused the connection: {hello.get('error')}")
        if not isinstance(challenge, str):
            raise EngineError(self.name, "not a streamsync receiver: no authentication challenge")
        nonce = secrets.token_hex(16)
        mac = proof(self._secret, "client", challenge, nonce)
        await self._stream.send(json.dumps({"op": "auth", "nonce": nonce, "mac": mac}).encode() + b"\n")
        reply = _json_line(self.name, await self._buffered.receive_until(b"\n", HELLO_LINE))
        if not reply.get("ok"):
            raise EngineError(self.name, f"receiver refused the connection: {reply.get('error')}")
        if not same_secret((reply.get("result") or {}).get("mac"), proof(self._secret, "server", challenge, nonce)):
            raise EngineError(self.name, "the receiver could not prove it holds the secret (another process "
                              "on its port?)")

    async def call(self, op: str, timeout: float | None = None, **kw: Any) -> Any:
        async with self._lock:
            try:
                with anyio.fail_after(timeout or self.timeout):
                    if self._stream is None:
                        await self._connect()
                    assert self._stream is not None and self._buffered is not None
                    t0 = time.perf_counter()
                    await self._stream.send(json.dumps({"op": op, **kw}).encode() + b"\n")
                    t1 = time.perf_counter()
                    line = await self._buffered.receive_until(b"\n", REPLY_LINE)
                    st = self.rpc_seconds.setdefault(op, [0, 0.0, 0.0])
                    st[0] += 1
                    st[1] += time.perf_counter() - t0
                    st[2] += t1 - t0
            except TimeoutError:
                await self._drop()
                raise EngineError(self.name, f"{op}: no reply in {timeout or self.timeout:.1f} s",
                                  unresponsive=True) from None
            except anyio.DelimiterNotFound:
                await self._drop()
                raise EngineError(self.name, f"{op}: reply line too long") from None
            except EngineError:
                raise
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError) as e:
                await self._drop()
                raise EngineError(self.name, f"{op} failed: engine process exited (connection closed: "
                                  f"{type(e).__name__}; the receiver process died?)") from None
            except BaseException:  # cancelled mid-request: its reply would answer the next request
                await self._drop()
                raise
        reply = _json_line(self.name, line)
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
        await self.call("init", info=init_info, owner=self.owner)

    async def start_update(self) -> None:
        # stale_after: a round this client left open (a crashed trainer) is abandoned after our own
        # timeout, when our push has failed anyway; another WeightSync may then take the receiver over.
        await self.call("start", owner=self.owner, stale_after=self.timeout)

    async def update(self, message: UpdateMessage | Mapping[str, Any]) -> None:
        """Apply one chunk. A layout the receiver has parsed before goes by its key only (a dense chunk's
        layout is a few KB of JSON, an MoE chunk's tens of KB, each push); if the receiver no longer knows
        the key, the update is sent again with the layout."""
        key = message.layout_key if isinstance(message, UpdateMessage) else message.get("layout_key")
        if isinstance(key, str) and key in self._known:
            try:
                await self.call("update", info=wire(message, layout=False))
                return
            except EngineError as e:
                if "UnknownLayout:" not in str(e):
                    raise
                del self._known[key]
        info = wire(message)
        await self.call("update", info=info)
        if isinstance(key, str) and info.get("layout") is not None:
            self._known[key] = True

    async def finish_update(self, version: int) -> None:
        await self.call("finish", version=version, owner=self.owner)

    async def get_version(self) -> int | None:
        return await self.call("version")

    async def abort_update(self, version: int | None = None) -> None:
        await self.call("abort", owner=self.owner)

    async def state(self) -> EngineState:
        st = await self.call("status")
        return EngineState(st["version"], mixed=bool(st.get("mixed")), updating=bool(st["updating"]),
                           paused=bool(st.get("paused")))

    async def delta_base(self) -> tuple[int, str] | None:
        held = (await self.call("delta_base"))["held"]
        return None if held is None else (int(held[0]), str(held[1]))

    async def fused_layout(self) -> dict[str, Any] | None:
        """The receiver's fused tensors and their HF members ({name: [[members], shape]}), None if it takes
        HF names only."""
        return await self.call("fused_layout")

    async def layout(self) -> EngineLayout | None:
        """What the receiver's module holds, where it holds slices (the sliced stand-in); a receiver process
        is one worker."""
        held = await self.call("layout")
        if held is None:
            return None
        return EngineLayout(self.name, 1, tuple(Need(self.name, 0, n, Box.from_json(b)) for n, b in held))

    async def expected_weights(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        info = await self.call("weight_info")
        return {n: (d, tuple(s)) for n, (d, s) in info.items()}

    async def checksums(self, device: bool = False) -> dict[str, str]:
        """Per-tensor checksums of what the receiver holds (`device=True`: computed on its device)."""
        return await self.call("checksums", device=device)

    async def holds(self, hf: Mapping[str, torch.Tensor], tied: bool = False) -> bool | None:
        from ..checksum import digests

        return await self.checksums() == digests(hf.items())

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self.call("pause")

    async def resume(self) -> None:
        await self.call("resume")

    async def close(self) -> None:
        await self._drop()


def _json_line(engine: str, line: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(line)
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        raise EngineError(engine, f"receiver sent a line that is not a JSON object: {line[:80]!r}")
    return msg
