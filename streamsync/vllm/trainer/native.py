"""streamsync as a trainer-side backend of vLLM's own weight-transfer API.

Code written for vLLM's native weight transfer picks a backend by name:

    engine = WeightTransferTrainerFactory.trainer_init(
        StreamSyncTrainerInitInfo(rank=rank), client=HTTPVLLMWeightSyncClient(url), source=weights)
    engine.send_weights()          # every round, on every trainer rank

`register_trainer()` (called by `streamsync.vllm.register`, the plugin entry point, and at import of this
module) adds "streamsync" to vLLM's trainer-side registry where the installed vLLM has one (0.32+). The engine
drives the same control plane as vLLM's own backends through the client (`VLLMWeightSyncClient`: HTTP routes,
Ray actors, or any object with those four methods) and pushes through a `BlockingWeightSync`, so chunks are
planned, packed and streamed as in any streamsync push. Where vLLM has no trainer-side registry (0.25.x),
`StreamSyncWeightTransferEngine.trainer_send_weights(iterator, trainer_args)` is the entry point of that shape.

What the client cannot do, this path does not either: it cannot read the engine's weights back, so the checks
that need them (names and shapes before bytes move) are skipped; a streamsync engine client (`VllmHttpEngine`,
`RayVllmEngine`, `VllmEngine`) does all of them. Versions move forward across trainer restarts where the
client names its server (vLLM's HTTP client: `base_url`): the engine's version is read from it at connect, and
the next push takes the one after it. A call the engine refuses raises naming the engine's own reason (the
server's answer body), not a bare HTTP status.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio

from ...engines.base import Engine, EngineState
from ...errors import EngineError, ValidationError
from ...message import UpdateMessage, wire
from .. import BACKEND, register_trainer

register_trainer()  # importing this module is enough in a trainer process that never loads vLLM's plugins


class ClientEngine(Engine):
    """An engine reached through a vLLM `VLLMWeightSyncClient` (its four synchronous methods, called in a
    worker thread). `device`: where the engine's workers run, which picks the transport ("cpu": shared memory,
    "cuda": CUDA IPC, both on this host)."""

    def __init__(self, client: Any, *, name: str = "vllm-client", device: str = "cpu", timeout: float = 300.0,
                 api_key: str | None = None) -> None:
        for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
            if not callable(getattr(client, method, None)):
                raise ValidationError(f"client {type(client).__name__} has no {method}(): a VLLMWeightSyncClient "
                                      "has init_weight_transfer_engine, start_weight_update, update_weights and "
                                      "finish_weight_update")
        self.client = client
        self.name = name
        self.device = device
        self.timeout = timeout
        #: the server behind an HTTP client, read for the engine's version and state (the client has no read)
        self.reader: Engine | None = None
        url = getattr(client, "base_url", None)
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            from ...engines.vllm import VllmHttpEngine

            self.reader = VllmHttpEngine(url, name=name, timeout=timeout, device=device, api_key=api_key)

    async def _call(self, what: str, *args: Any) -> None:
        try:
            with anyio.fail_after(self.timeout):
                await anyio.to_thread.run_sync(getattr(self.client, what), *args, abandon_on_cancel=True)
        except TimeoutError:
            raise EngineError(self.name, f"{what}: no reply in {self.timeout:.1f} s") from None
        except Exception as e:
            raise EngineError(self.name, f"{what} refused: {_reason(e)}") from e

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self._call("init_weight_transfer_engine", {BACKEND: init_info})

    async def start_update(self) -> None:
        await self._call("start_weight_update")

    async def update(self, message: UpdateMessage | Mapping[str, Any]) -> None:
        await self._call("update_weights", {BACKEND: wire(message)})

    async def finish_update(self, version: int) -> None:
        await self._call("finish_weight_update", str(version))

    async def abort_update(self, version: int | None = None) -> None:
        await self._call("finish_weight_update", f"mixed:{'' if version is None else version}")

    async def get_version(self) -> int | None:
        return None if self.reader is None else await self.reader.get_version()

    async def state(self) -> EngineState:
        return EngineState(None) if self.reader is None else await self.reader.state()

    async def close(self) -> None:
        if self.reader is not None:
            await self.reader.close()


def _reason(err: BaseException) -> str:
    """What the engine said when it refused a call: the HTTP answer's body (vLLM's JSON error names the reason;
    `requests`' own message holds only the status), else the exception itself."""
    import json

    response = getattr(err, "response", None)
    text = getattr(response, "text", None)
    if isinstance(text, str) and text:
        status = getattr(response, "status_code", "?")
        try:
            body = json.loads(text)
        except ValueError:
            return f"HTTP {status}: {text[:500]}"
        said = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
        if isinstance(said, dict):
            said = said.get("message", said)
        return f"HTTP {status}: {str(said)[:500]}"
    return f"{type(err).__name__}: {err}"


def _try_vllm_base() -> tuple[type, type] | None:
    try:
        from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
    except ImportError:
        return None
    return TrainerInitInfo, TrainerWeightTransferEngine


_BASES = _try_vllm_base()

if _BASES is not None:
    _InitBase, _EngineBase = _BASES

    @dataclass
    class StreamSyncTrainerInitInfo(_InitBase):  # type: ignore[valid-type,misc]
        """vLLM trainer init info of the streamsync backend. `rank` (keyword): this trainer rank (0 sends);
        `device`: where the engine's workers run ("cpu" / "cuda", default: "cuda" where this process sees a
        GPU); `chunk_bytes`, `timeout`: as `WeightSync`'s."""

        backend: ClassVar[str] = BACKEND
        device: str | None = None
        chunk_bytes: int = 64 << 20
        timeout: float = 300.0

    class StreamSyncTrainerEngine(_EngineBase):  # type: ignore[valid-type,misc]
        """`send_weights()` pushes the source's (name, tensor) pairs through a `BlockingWeightSync` (rank 0
        sends; the other ranks iterate the source too, as its collectives need, and send nothing)."""

        init_info_cls = StreamSyncTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> StreamSyncTrainerEngine:
            from ...blocking import BlockingWeightSync

            if source is None:
                raise ValidationError("the streamsync trainer engine pushes a WeightSource each round: pass source=")
            is_sender = init_info.rank == 0
            self = cls(client=client, source=source, is_sender=is_sender)
            device = init_info.device or _device()
            engines = [ClientEngine(client, device=device, timeout=init_info.timeout)] if is_sender else []
            self.sync = BlockingWeightSync(engines, chunk_bytes=init_info.chunk_bytes, timeout=init_info.timeout)
            if is_sender:
                self.sync.connect()
            return self

        def send_weights(self) -> None:
            pairs = list(iter(self.source))  # materializing may be a collective: every rank iterates
            if self.is_sender:
                self.sync.push(pairs)

        def shutdown(self) -> None:
            self.sync.close()


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def send_weights(iterator: Iterable[tuple[str, Any]], trainer_args: Any) -> None:
    """vLLM 0.25's `trainer_send_weights(iterator, trainer_args)` shape: push `iterator`'s (name, tensor) pairs.
    `trainer_args`: a `BlockingWeightSync` (kept between calls), or a mapping with "sync" (one) or "engines"
    (streamsync engine clients: a sync is made, used once and closed)."""
    from ...blocking import BlockingWeightSync

    pairs = list(iterator)
    if isinstance(trainer_args, BlockingWeightSync):
        trainer_args.push(pairs)
        return
    if isinstance(trainer_args, Mapping) and isinstance(trainer_args.get("sync"), BlockingWeightSync):
        trainer_args["sync"].push(pairs)
        return
    if isinstance(trainer_args, Mapping) and trainer_args.get("engines"):
        sync = BlockingWeightSync(list(trainer_args["engines"]))
        try:
            sync.push(pairs)
        finally:
            sync.close()
        return
    raise ValidationError("trainer_args must be a streamsync.BlockingWeightSync, or a mapping with 'sync' (one) or "
                          f"'engines' (streamsync engine clients), got {type(trainer_args).__name__}")

