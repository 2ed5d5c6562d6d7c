"""Mistakes a trainer makes when wiring streamsync in, and the errors that say how to fix them."""

from __future__ import annotations

import pytest

from streamsync import EngineError, ValidationError, WeightSync
from streamsync.engines.vllm import VllmHttpEngine
from streamsync.models.synthetic import StateModule, qwen3_specs, save_specs
from streamsync.sources import ModuleSource
from streamsync.testing.receiver import ReceiverProcess

SHAPE = dict(hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16, intermediate=128)


class _Replica(ModuleSource):
    """A data-parallel replica's view of the model: it holds the weights but another rank sends them."""

    @property
    def is_sender(self) -> bool:
        return False


async def test_engines_on_a_rank_that_does_not_send_are_an_error_naming_the_rank(receiver, mixed_model):
    sync = WeightSync([receiver.engine()], metrics=None)
    with pytest.raises(ValidationError, match=r"rank 0 was given engines .* does not send"):
        await sync.push(_Replica(mixed_model))
    await sync.close()


async def test_a_padded_vocabulary_error_names_the_option_that_drops_the_padding(tmp_path):
    served = save_specs(qwen3_specs(vocab=101, **SHAPE), tmp_path / "served.json")
    trainer = StateModule(qwen3_specs(vocab=128, **SHAPE))  # Megatron's vocabulary, padded to 128 rows
    with ReceiverProcess(str(served)) as rp:
        sync = WeightSync([rp.engine()], metrics=None)
        with pytest.raises(ValidationError, match=r"source_options=\{'hf_config'.*'vocab_size': 101"):
            await sync.push(trainer)
        await sync.close()


async def test_connect_to_an_unreachable_server_is_one_engine_error_with_its_session_closed(free_tcp_port):
    engine = VllmHttpEngine(f"http://127.0.0.1:{free_tcp_port}", name="rollout-0")
    sync = WeightSync([engine], timeout=10, metrics=None)
    with pytest.raises(EngineError, match=r"rollout-0.*cannot reach server") as info:
        await sync.connect()
    assert not isinstance(info.value, BaseExceptionGroup)
    assert engine._session is None or engine._session.closed  # no "Unclosed client session" at exit
    assert not sync.connected
