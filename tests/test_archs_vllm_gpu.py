"""DeepSeek-V3 (MLA with a query low rank, shared experts, the first layer dense, the float32 expert bias), GLM-4
and GLM-4.5 MoE pushed into a real vLLM on the GPU (marked `gpu`: skipped without CUDA; docs/gpu.md says how to
run them with the GPU machine's vLLM 0.25.1). The CPU twin is tests/test_archs_vllm.py.

The reference is a tiny transformers model of each family (its own config class, random weights), moved by a
stand-in training step before each push and saved as a checkpoint. The trainer sits on the engine's GPU (CUDA
IPC, `transport="auto"`): a megatron-core model built from the reference by the project's loader, or, for the
second push, the transformers module itself. After each push every engine parameter equals the reference fused
and stacked the engine's way, bit for bit (device digests); after the last, the engine is held against one
started on the same checkpoint: every tensor it computes with, MLA's absorbed matrices included, equal, and
the same greedy tokens on prompts longer than a KV block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from streamsync import WeightSync
from streamsync.checksum import device_digest
from streamsync.testing.gpu import gpu

vllm = pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from safetensors.torch import load_file  # noqa: E402

from streamsync.engines.vllm import VllmEngine, engine_kwargs  # noqa: E402
from streamsync.models.tiny import TINY, make_tiny  # noqa: E402
from streamsync.testing.vllm import (  # noqa: E402
    as_mimo,
    reference_checkpoint,
    stop_llm,
    trainer_from,
    with_mtp_layer,
)
from streamsync.verify import check_prompts, compare_engines  # noqa: E402
from streamsync.vllm.trainer.digests import expected_digests  # noqa: E402

# two engine start-ups a test (30-70 s each there)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

ENGINE: dict[str, Any] = dict(dtype="bfloat16", max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.1,
                              use_tqdm_on_load=False)
FAMILIES = ["deepseek_v3", "glm4", "glm4_moe"]
STEPS = (1, 2, 3)
HF_MODULE_STEP = 2  # this push comes from the transformers module itself, the others from megatron-core


def _gpu_env() -> None:
    import os

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not in the GPU machine's bundle
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the trainer holds CUDA: spawn, never fork


def _trainer(model_dir: Any, ref: Any, step: int) -> Any:
    """The step's trainer on the GPU: the transformers module, or megatron-core built from the reference (a
    world of one over NCCL, as a trainer on a GPU runs)."""
    if step == HF_MODULE_STEP:
        return trainer_from(model_dir, step).cuda()
    import torch.distributed as dist

    from streamsync.models.megatron import megatron_from_hf

    if not dist.is_initialized():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    return [c.cuda() for c in megatron_from_hf(ref)]


def _engine_dtypes(llm: Any) -> dict[str, torch.dtype]:
    """Each engine parameter's dtype (GLM-4.5's router holds its gate in float32 and casts the checkpoint's bf16
    gate as it loads: the reference is compared the way the engine holds it)."""
    return {n: getattr(torch, d) for n, d in llm.collective_rpc("streamsync_weight_dtypes")[0].items()}


@contextmanager
def _llm(model: Any, **kwargs: Any) -> Iterator[Any]:
    """A vLLM engine on the GPU for the block's duration, stopped however the block ends."""
    llm = vllm.LLM(model=str(model), **ENGINE, **engine_kwargs(), **kwargs)
    try:
        yield llm
    finally:
        stop_llm(llm)


def _same(what: str, got: dict[str, str], want: dict[str, str]) -> None:
    """Two engines' digests (`weight_digests`, `draft_digests`) name the same tensors and agree on each."""
    assert set(got) == set(want)
    differ = sorted(n for n in want if got[n] != want[n])
    assert not differ, f"{what}: {len(differ)} engine tensors differ, e.g. {differ[:4]}"


async def _same_tokens(model_type: str, pushed: VllmEngine, loaded: VllmEngine) -> None:
    prompts = check_prompts(int(TINY[model_type]["vocab_size"]), count=2)
    check = await compare_engines(pushed, loaded, prompts, max_tokens=8, as_served=True)
    assert check.ok, f"{model_type}: {check}"


@gpu
@pytest.mark.parametrize("model_type", FAMILIES)
async def test_three_colocated_pushes_leave_the_gpu_engine_as_loading_the_checkpoint_does(model_type, tmp_path):
    _gpu_env()
    model_dir = make_tiny(model_type, tmp_path)
    refs = {step: reference_checkpoint(model_dir, step, tmp_path / f"step{step}") for step in STEPS}
    pushed_llm = vllm.LLM(model=str(model_dir), **ENGINE, **engine_kwargs())
    sync: WeightSync | None = None
    try:
        pushed = VllmEngine(pushed_llm, name="pushed")
        held = _engine_dtypes(pushed_llm)
        packed = await pushed.packed_modules()
        sync = WeightSync([pushed], transport="auto", chunk_bytes=1 << 20)
        for step in STEPS:
            trainer = _trainer(model_dir, refs[step], step)
            report = await sync.push(trainer, version=step)
            print(f"{model_type} push {step}: path {report.engine_paths['pushed']}, {report.seconds * 1e3:.1f} ms")
            # MLA's absorbed matrices are derived again from kv_b_proj at the round's end (fast path); GLM-4.5's
            # float32 router casts the bf16 gate as it loads, which only vLLM's reload does
            assert report.engine_paths["pushed"] == ("mixed" if model_type == "glm4_moe" else "fast"), (
                report.engine_rounds)
            ref = load_file(str(refs[step] / "model.safetensors"), device="cuda")
            ref = {n: t.to(held.get(n, t.dtype)) for n, t in ref.items()}
            got = await pushed.weight_digests(device=True)
            want = expected_digests(ref, packed, digest=device_digest, engine_names=got)
            missing = sorted(set(want) - set(got))
            differ = sorted(n for n in want if n in got and got[n] != want[n])
            assert not missing and not differ, f"{model_type} push {step}: missing {missing[:4]}, differ {differ[:4]}"
            del trainer, ref
        loaded_llm = vllm.LLM(model=str(refs[STEPS[-1]]), **ENGINE, **engine_kwargs())
        try:
            loaded = VllmEngine(loaded_llm, name="loaded")
            _same(model_type, await pushed.weight_digests(device=True), await loaded.weight_digests(device=True))
            await _same_tokens(model_type, pushed, loaded)
        finally:
            stop_llm(loaded_llm)
    finally:
        if sync is not None:
            await sync.close()
        stop_llm(pushed_llm)


MTP_DRAFT = {"method": "deepseek_mtp", "num_speculative_tokens": 1}
#: (tiny model type the main model is, how the MTP checkpoint is made from it, the engine's extra arguments)
MTP_FAMILIES: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "deepseek_v3": ("deepseek_v3", lambda src, out: src, {"speculative_config": MTP_DRAFT}),
    # MiMo: Qwen2's main model, its MTP layers apart (`model.mtp_layers.0`), its config class shipped as code
    "mimo": ("qwen2", as_mimo, {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
                                "trust_remote_code": True}),
}


@gpu
@pytest.mark.parametrize("family", list(MTP_FAMILIES))
async def test_a_trainers_mtp_layer_lands_in_the_gpu_engines_mtp_draft_model(family, tmp_path):
    """A megatron-core trainer with an MTP layer (DeepSeek-V3's, numbered after the decoder layers; MiMo's, held
    apart with its input halves swapped) on the GPU pushes into an engine running MTP speculative decoding: after
    two pushes the main and the draft model hold what an engine started on the last checkpoint holds, bit for bit
    (device digests), and both generate the same greedy tokens."""
    _gpu_env()
    model_type, convert, engine = MTP_FAMILIES[family]
    model_dir = make_tiny(model_type, tmp_path)
    start = with_mtp_layer(convert(model_dir, tmp_path / "converted"), tmp_path / "start", seed=1)
    refs = {step: with_mtp_layer(convert(reference_checkpoint(model_dir, step, tmp_path / f"dense{step}"),
                                         tmp_path / f"converted{step}"), tmp_path / f"ref{step}", seed=10 + step)
            for step in (1, 3)}
    with _llm(start, **engine) as pushed_llm:
        pushed = VllmEngine(pushed_llm, name="pushed")
        before = await pushed.draft_digests(device=True)
        assert before
        async with WeightSync([pushed], transport="auto", chunk_bytes=1 << 20) as sync:
            for step, ref in refs.items():
                report = await sync.push(_trainer(model_dir, ref, step), version=step)
                print(f"{family} MTP push {step}: path {report.engine_paths['pushed']}, "
                      f"{report.seconds * 1e3:.1f} ms, {report.engine_rounds[0].draft_tensors} draft tensors")
                assert report.not_loaded == {} and report.engine_rounds[0].draft_tensors > 0, report.engine_rounds
        with _llm(refs[3], **engine) as loaded_llm:
            loaded = VllmEngine(loaded_llm, name="loaded")
            assert await pushed.weight_digests(device=True) == await loaded.weight_digests(device=True)
            got = await pushed.draft_digests(device=True)
            assert got != before
            _same("the MTP draft", got, await loaded.draft_digests(device=True))
            await _same_tokens(model_type, pushed, loaded)
