"""Code written for vLLM's own trainer-side weight-transfer API switches to streamsync by the backend's name:
vLLM's `WeightTransferTrainerFactory` builds streamsync's trainer engine, which pushes through vLLM's own HTTP
client into a real `vllm serve` engine; and the 0.25-shaped `trainer_send_weights(iterator, trainer_args)`."""

from __future__ import annotations

import anyio
import pytest
import torch

from streamsync import ValidationError
from streamsync.engines.vllm import VllmHttpEngine
from streamsync.testing.vllm import trainer_from

pytestmark = pytest.mark.vllm

factory = pytest.importorskip("vllm.distributed.weight_transfer.factory")
base = pytest.importorskip("vllm.distributed.weight_transfer.base")
if not hasattr(factory, "WeightTransferTrainerFactory"):
    pytest.skip("this vLLM has no trainer-side registry", allow_module_level=True)


class _Pairs(base.WeightSource):
    """vLLM's WeightSource over a module's state dict."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self):
        return [base.ParamMeta(n, t.dtype, tuple(t.shape))
                for n, t in self.module.state_dict().items()]

    def __iter__(self):
        return iter(self.module.state_dict().items())


async def _holds(url: str, trainer: torch.nn.Module) -> bool:
    from streamsync.vllm.trainer.digests import expected_digests

    engine = VllmHttpEngine(url, name="check")
    try:  # every parameter the engine computes with, bit for bit
        return await engine.weight_digests() == expected_digests(trainer.state_dict(), await engine.packed_modules())
    finally:
        await engine.close()


async def test_vllms_trainer_factory_builds_streamsync_by_name_and_pushes_bit_exact(server, model_dir):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from streamsync.vllm.trainer.native import StreamSyncTrainerInitInfo

    assert "streamsync" in factory.WeightTransferTrainerFactory._registry
    trainer = trainer_from(model_dir, step=60)
    engine = await anyio.to_thread.run_sync(lambda: factory.WeightTransferTrainerFactory.trainer_init(
        StreamSyncTrainerInitInfo(rank=0, device="cpu"), client=HTTPVLLMWeightSyncClient(server.url),
        source=_Pairs(trainer)))
    try:
        for step in (61, 62):  # every round re-reads the source
            trainer.load_state_dict(trainer_from(model_dir, step=step).state_dict())
            await anyio.to_thread.run_sync(engine.send_weights)
            assert await _holds(server.url, trainer)
    finally:
        await anyio.to_thread.run_sync(engine.shutdown)


async def test_the_trainer_send_weights_shape_pushes_an_iterator(server, model_dir):
    from streamsync.vllm.worker.backend import StreamSyncWeightTransferEngine

    trainer = trainer_from(model_dir, step=63)
    args = {"engines": [VllmHttpEngine(server.url, name="serve")]}
    await anyio.to_thread.run_sync(StreamSyncWeightTransferEngine.trainer_send_weights,
                                   iter(trainer.state_dict().items()), args)
    assert await _holds(server.url, trainer)
    with pytest.raises(ValidationError, match=r"trainer_args must be a streamsync\.BlockingWeightSync"):
        StreamSyncWeightTransferEngine.trainer_send_weights(iter(()), {"nothing": 1})


def test_a_client_without_the_four_methods_is_refused_naming_them():
    from streamsync.vllm.trainer.native import ClientEngine

    with pytest.raises(ValidationError, match=r"has no start_weight_update\(\)"):
        ClientEngine(type("Half", (), {"init_weight_transfer_engine": lambda self, i: None})())


async def test_a_restarted_trainer_moves_the_engines_version_forward(server, model_dir):
    """Each `trainer_init` is a new trainer process's: it reads the engine's version through the client's server
    and pushes the one after it, never starting at 1 again."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from streamsync.vllm.trainer.native import StreamSyncTrainerInitInfo

    reader = VllmHttpEngine(server.url, name="check")
    trainer = trainer_from(model_dir, step=64)
    seen = []
    try:
        for _restart in range(2):
            engine = await anyio.to_thread.run_sync(lambda: factory.WeightTransferTrainerFactory.trainer_init(
                StreamSyncTrainerInitInfo(rank=0, device="cpu"), client=HTTPVLLMWeightSyncClient(server.url),
                source=_Pairs(trainer)))
            try:
                before = await reader.get_version()
                await anyio.to_thread.run_sync(engine.send_weights)
                seen.append((before, await reader.get_version()))
            finally:
                await anyio.to_thread.run_sync(engine.shutdown)
        (b0, a0), (b1, a1) = seen
        assert a0 == (b0 or 0) + 1 and b1 == a0 and a1 == a0 + 1, seen
        assert await _holds(server.url, trainer)
    finally:
        await reader.close()


async def test_a_call_the_engine_refuses_reaches_the_trainer_with_the_engines_reason(server):
    """vLLM's HTTP client raises a bare `500 Internal Server Error`; the engine's answer names why."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from streamsync.errors import EngineError
    from streamsync.vllm.trainer.native import ClientEngine

    engine = ClientEngine(HTTPVLLMWeightSyncClient(server.url), name="serve")
    try:
        with pytest.raises(EngineError, match=r"serve.*update_weights refused: HTTP 5\d\d: .*\w") as got:
            await engine._call("update_weights", {"streamsync": {"chunk": 0}})  # no round is open
        assert "Internal Server Error for url" not in str(got.value)
    finally:
        await engine.close()


async def test_calls_out_of_order_are_refused_with_their_reason_in_one_log_line(server, model_dir):
    """A start after the trainer's connection was released (as before any init) and an update with no round
    open are refused, each answer naming why; the server's log has one WARNING line per refusal and no traceback
    (vLLM logs a failed call in the worker, the engine core and the API server, each with its traceback). The
    next trainer's connect initializes the engine again, and its push lands."""
    import aiohttp

    from streamsync import WeightSync

    log = server.log_path
    assert log is not None
    start = len(log.read_bytes())
    # one connection a request: uvicorn closes the one an exception went through
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                     connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.post(f"{server.url}/shutdown_weight_transfer_engine") as r:
            assert r.status == 200, await r.text()
        async with http.post(f"{server.url}/start_weight_update") as r:
            assert r.status >= 400 and "before init_weight_transfer_engine" in await r.text()
        async with http.post(f"{server.url}/update_weights", json={"update_info": {"streamsync": {"chunk": 0}}}) as r:
            assert r.status >= 400 and "start_weight_update must be called before" in await r.text()
    await anyio.sleep(1.0)  # the three processes' log lines reach the file
    text = log.read_bytes()[start:].decode(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert text.count("weight-transfer call refused: streamsync: start_weight_update before init") >= 2, text
    assert text.count("weight-transfer call refused: start_weight_update must be called before") >= 2, text

    trainer = trainer_from(model_dir, step=71)
    sync = WeightSync([VllmHttpEngine(server.url, name="serve")])
    try:
        await sync.push(trainer)
        assert await _holds(server.url, trainer)
    finally:
        await sync.close()
