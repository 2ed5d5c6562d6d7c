"""Pushes into a real vLLM engine on a GPU (marked `gpu`: skipped without CUDA). docs/gpu.md says how to run
them on the GPU machine with its vLLM 0.25.1; any supported vLLM with CUDA runs them as well.

A trainer on the same GPU as the engine (CUDA IPC, `transport="auto"`): an HF module and a megatron-core
GPTModel, tied and untied embeddings, three pushes each, every engine parameter compared with the trainer's
HF export bit for bit after each (device digests on both sides: `streamsync_weight_digests`). Then `paused()`
in its three modes with requests in flight, the version labels of a streaming rollout across an update, and an
engine that received a push against one that loaded the same weights from disk (`verify.compare_engines`).

Engines start once per module (30-70 s each there); the tests run their coroutines with anyio.run (`@gpu`):
the GPU machine has no pytest-asyncio, and an AsyncLLM, bound to its event loop, lives inside one test.
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import pytest
import torch

from streamsync import StreamSyncError, ValidationError, WeightSync
from streamsync.checksum import device_digest
from streamsync.testing.gpu import gpu, perturb

vllm = pytest.importorskip("vllm")

from streamsync.engines.vllm import AsyncVllmEngine, VllmEngine, engine_kwargs, shutdown  # noqa: E402
from streamsync.testing.vllm import stop_llm  # noqa: E402
from streamsync.verify import check_prompts, compare_engines, save_checkpoint  # noqa: E402
from streamsync.vllm.trainer.digests import expected_digests  # noqa: E402

# engine start-ups count against a test's time (pytest-timeout): up to three per test here
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

#: small engines: several share the GPU with the trainer (gpu_memory_utilization is a fraction of the GPU)
ENGINE: dict[str, Any] = dict(dtype="bfloat16", max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.08,
                              use_tqdm_on_load=False)
TIES = {"untied": False, "tied": True}


def _gpu_env() -> None:
    # flashinfer is not in the GPU machine's vLLM bundle (its sampler import would fail the engine at load)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    # before the trainer touches CUDA, vLLM would fork its engine core out of the pytest process, and the
    # forked engine core hangs while loading the model; spawn it, as vLLM does once CUDA is initialized
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


@pytest.fixture(scope="module")
def gpu_model_dirs(tmp_path_factory) -> dict[str, str]:
    from streamsync.models.tiny import make_tiny_qwen3

    cache = tmp_path_factory.mktemp("gpu-models")
    return {k: str(make_tiny_qwen3(cache, tie_word_embeddings=tie)) for k, tie in TIES.items()}


@pytest.fixture(scope="module")
def gpu_moe_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny Qwen3-MoE checkpoints (8 experts a layer: vLLM's FusedMoE, its kernels carried by the GPU bundle)."""
    from streamsync.models.tiny import make_tiny_qwen3_moe

    cache = tmp_path_factory.mktemp("gpu-moe-models")
    return {k: str(make_tiny_qwen3_moe(cache, tie_word_embeddings=tie)) for k, tie in TIES.items()}


@pytest.fixture(scope="module")
def gpu_llms(gpu_model_dirs):
    """One `vllm.LLM` per tiny checkpoint (untied, tied), on the GPU, receiving through streamsync."""
    _gpu_env()
    llms = {k: vllm.LLM(model=d, **ENGINE, **engine_kwargs()) for k, d in gpu_model_dirs.items()}
    yield llms
    for llm in llms.values():
        stop_llm(llm)


def _hf_trainer(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()


def _megatron_trainer(model_dir: str) -> list[torch.nn.Module]:
    """A megatron-core GPTModel holding the checkpoint's weights, on the GPU (a world of one, NCCL, as a trainer
    on a GPU runs; megatron_from_hf keeps a group that exists)."""
    import torch.distributed as dist

    from streamsync.models.megatron import megatron_from_hf

    if not dist.is_initialized():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    return [c.cuda() for c in megatron_from_hf(model_dir)]


async def _hf_export(trainer: Any, model_dir: str) -> dict[str, torch.Tensor]:
    """What a push of `trainer` must leave in the engine: its HF state (through the converter for megatron)."""
    if isinstance(trainer, torch.nn.Module):
        return dict(trainer.state_dict())
    from streamsync.models.megatron import export_hf_async, hf_config

    state = await export_hf_async(trainer, dtype=torch.bfloat16, hf_config=hf_config(model_dir))
    assert state is not None
    return state


async def _assert_bit_exact(engine: VllmEngine, state: dict[str, torch.Tensor], tied: bool) -> None:
    want = expected_digests(state, await engine.packed_modules(), tied=tied, digest=device_digest)
    got = await engine.weight_digests(device=True)
    assert set(got) == set(want)
    assert got == want, sorted(k for k in want if got.get(k) != want[k])[:5]


def _perturb_all(trainer: Any, step: int) -> None:
    for m in trainer if isinstance(trainer, list) else [trainer]:
        perturb(m, step)


@pytest.mark.parametrize("tie", list(TIES))
@pytest.mark.parametrize("kind", ["hf", "megatron"])
@gpu
async def test_colocated_cuda_ipc_pushes_are_bit_exact_three_times(kind, tie, gpu_llms, gpu_model_dirs):
    model_dir = gpu_model_dirs[tie]
    engine = VllmEngine(gpu_llms[tie], name=f"vllm-{tie}")
    trainer = _hf_trainer(model_dir) if kind == "hf" else _megatron_trainer(model_dir)
    options = {} if kind == "hf" else {"dtype": torch.bfloat16, "hf_config": _config(model_dir)}
    sync = WeightSync([engine], transport="auto", chunk_bytes=1 << 20, source_options=options)
    # megatron: connected with the model, whose chunks' references the worker takes ahead (and captures their
    # copies); hf: connected without, so its chunks are seen, captured, then replayed
    await (sync.connect(trainer) if kind == "megatron" else sync.connect())
    assert sync.transport is not None and sync.transport.name == "cuda_ipc"
    for step in (1, 2, 3):
        _perturb_all(trainer, step)
        report = await sync.push(trainer)
        assert report.chunks >= 1 and await engine.get_version() == report.version
        # unquantized on CUDA: every tensor copied straight into the engine's own tensors, no module rebuilt
        (r,) = report.engine_rounds
        assert report.engine_paths == {engine.name: "fast"} and r.layerwise_tensors == 0, r
        assert r.rebuilt_modules == 0 and r.extra_bytes is not None, r
        counts = report.trace.counts
        if step == 3:  # every tensor copied by graph launches (a chunk's packed part and its references apart)
            assert r.replayed_tensors == r.fast_tensors, (step, r, counts)
        if kind == "megatron":  # every reference went ahead, and its copies were captured: the push replays them
            assert counts.get("refs.exports", 0) == 0 and counts["refs.referenced"] > 0, counts
            assert r.replayed_tensors >= counts["refs.referenced"] and r.replayed_chunks >= report.chunks, (step, r)
        await _assert_bit_exact(engine, await _hf_export(trainer, model_dir), tied=TIES[tie])
    # A NaN is refused while the engine's copies are captured and the check runs beside the push's host work
    # (answered before the round opens): no engine byte changes, no version moves, nothing is mixed.
    params = [p for m in (trainer if isinstance(trainer, list) else [trainer]) for p in m.parameters()]
    before, version = await engine.weight_digests(device=True), await engine.get_version()
    with torch.no_grad():
        keep = params[-1].view(-1)[0].clone()
        params[-1].view(-1)[0] = float("nan")
    with pytest.raises(ValidationError, match="non-finite"):
        await sync.push(trainer)
    assert await engine.weight_digests(device=True) == before and await engine.get_version() == version
    assert not sync.mixed and not sync.open_rounds
    with torch.no_grad():
        params[-1].view(-1)[0] = keep
    await sync.close()
    # and layerwise reload (fast_path=False) still lands exactly
    slow = VllmEngine(gpu_llms[tie], name=f"vllm-{tie}", fast_path=False)
    sync = WeightSync([slow], transport="auto", chunk_bytes=1 << 20, source_options=options)
    _perturb_all(trainer, 4)
    report = await sync.push(trainer)
    assert report.engine_paths == {slow.name: "layerwise"}, report.engine_rounds
    await _assert_bit_exact(slow, await _hf_export(trainer, model_dir), tied=TIES[tie])
    await sync.close()


def _small_step(model: torch.nn.Module, seed: int) -> None:
    """About 1 % of every floating tensor's elements take new values (the share an AdamW step at lr 1e-5 to
    1e-6 changes of bf16 weights)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                m = torch.rand(t.shape, generator=gen, device=t.device) < 0.01
                t[m] = (t[m].float() * 1.01 + 1e-3).to(t.dtype)


@gpu
async def test_sharded_delta_pushes_over_gloo_land_bit_exact_in_a_gpu_engine(gpu_llms, gpu_model_dirs):
    """A trainer on the GPU pushes deltas through the p2p transport (gloo: each worker receives its slices into
    host memory, keeps them as its base and applies the deltas there) into a vLLM engine on the GPU, through its
    fast path; after every push every parameter equals the trainer's bit for bit (device digests)."""
    from streamsync.transports.p2p import P2pTransport

    model_dir = gpu_model_dirs["untied"]
    engine = VllmEngine(gpu_llms["untied"], name="vllm-p2p-delta")
    trainer = _hf_trainer(model_dir)
    sync = WeightSync([engine], transport=P2pTransport("gloo"), chunk_bytes=1 << 20, delta=True, timeout=120)
    reports = []
    for step in range(3):
        if step:
            _small_step(trainer, step)
        report = await sync.push(trainer)
        reports.append(report)
        assert report.path == "sharded" and report.engine_paths == {engine.name: "fast"}, report.engine_rounds
        await _assert_bit_exact(engine, dict(trainer.state_dict()), tied=False)
    assert [r.delta.mode for r in reports] == ["full", "delta", "delta"], [r.delta.why_full for r in reports]
    assert all(r.delta.wire_bytes < 0.2 * reports[0].delta.wire_bytes for r in reports[1:])
    await sync.close()


@gpu
async def test_deltas_into_a_gpu_engine_are_decoded_in_place_and_it_generates_as_one_loaded_from_disk(
        gpu_llms, gpu_model_dirs, tmp_path):
    """A delta sync from a trainer on the engine's GPU (CUDA IPC): the engine holds every tensor of this bf16 model
    whole and as sent (TP 1, unquantized: the fast path's copies), so its worker keeps no copy of the model as the
    delta base; each delta is decoded straight into the engine's tensors on the GPU. Three pushes bit-exact by
    device digests, then the engine generates what an engine loaded from those weights on disk generates."""
    model_dir = gpu_model_dirs["untied"]
    llm = gpu_llms["untied"]
    engine = VllmEngine(llm, name="vllm-delta-in-place")
    trainer = _hf_trainer(model_dir)
    prompts = check_prompts(int(_config(model_dir)["vocab_size"]), count=3)
    sync = WeightSync([engine], chunk_bytes=1 << 20, delta=True, timeout=120)
    try:
        reports = await _full_then_two_deltas(sync, trainer, 60)
        assert all(r.engine_rounds[0].layerwise_tensors == 0 for r in reports)
        assert reports[-1].engine_rounds[0].in_place_tensors == len(trainer.state_dict())
        await _assert_bit_exact(engine, dict(trainer.state_dict()), tied=False)
        report = reports[-1]
        copy = llm.collective_rpc("streamsync_delta_copy")[0]
        model_bytes = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
        print(f"delta base in the worker: {copy}; the model: {model_bytes} bytes; the last delta push: "
              f"{report.seconds * 1e3:.1f} ms")
        assert copy["bytes"] == 0 and copy["in_place_bytes"] == model_bytes, copy
    finally:
        await sync.close()
    await _as_loaded_from_disk(engine, trainer.state_dict(), model_dir, tmp_path / "delta", prompts)


@pytest.mark.parametrize("quant", ["bf16", "fp8"])
@gpu
async def test_deltas_into_a_moe_engine_in_bf16_or_fp8_hold_what_vllm_makes_of_the_same_weights(quant, gpu_moe_dirs,
                                                                                                tmp_path):
    """A delta sync into a MoE engine (vLLM's FusedMoE, stacked experts), unquantized or quantizing to fp8 as it
    loads: what the engine holds as sent is decoded into in place, the rest (fp8 weights: vLLM quantizes them)
    onto the worker's copy and loaded as a full push loads it. After a full push and two deltas every engine tensor
    (fp8 weights and scales included) equals that of an engine of the same kind that loaded the weights from disk,
    and both generate the same greedy tokens."""
    model_dir = gpu_moe_dirs["untied"]
    _gpu_env()
    kind = dict(ENGINE, quantization=quant) if quant != "bf16" else dict(ENGINE)
    llm = vllm.LLM(model=model_dir, **kind, **engine_kwargs())
    sync = None
    try:
        engine = VllmEngine(llm, name=f"delta-moe-{quant}")
        trainer = _hf_trainer(model_dir)
        sync = WeightSync([engine], chunk_bytes=1 << 20, delta=True, timeout=120)
        report = (await _full_then_two_deltas(sync, trainer, 80))[-1]
        assert await engine.get_version() == report.version
        copy = llm.collective_rpc("streamsync_delta_copy")[0]
        print(f"delta moe {quant}: the worker's base {copy}; paths {report.engine_paths}")
        assert copy["in_place_bytes"] > 0 and (copy["bytes"] > 0 or quant == "bf16"), copy  # fp8: quantized ones
        prompts = check_prompts(int(_config(model_dir)["vocab_size"]), count=3)
        await _as_loaded_from_disk(engine, trainer.state_dict(), model_dir, tmp_path / f"delta-{quant}", prompts,
                                   kind, tensors=True)
    finally:
        if sync is not None:
            await sync.close()
        stop_llm(llm)


async def _full_then_two_deltas(sync: WeightSync, trainer: torch.nn.Module, seed: int) -> list[Any]:
    """A delta sync's three pushes: the first in full, then two of about 1 % changed each, as deltas."""
    reports = []
    for step in range(3):
        if step:
            _small_step(trainer, seed + step)
        reports.append(await sync.push(trainer))
    assert [r.delta.mode for r in reports] == ["full", "delta", "delta"]
    return reports


async def _as_loaded_from_disk(engine: VllmEngine, state: dict[str, torch.Tensor], model_dir: str, out: Any,
                               prompts: Any, kind: dict[str, Any] = ENGINE, tensors: bool = False) -> None:
    """`engine` generates what an engine of the same `kind` that loaded `state` from disk (a checkpoint like
    `model_dir`'s, written to `out`) generates; with `tensors`, it also holds the same tensors, bit for bit."""
    ckpt = save_checkpoint(state, like=model_dir, out=out, dtype=torch.bfloat16)
    llm = vllm.LLM(model=str(ckpt), **kind, **engine_kwargs())
    try:
        loaded = VllmEngine(llm, name=f"{engine.name}-loaded")
        if tensors:
            got, want = await engine.weight_digests(device=True), await loaded.weight_digests(device=True)
            assert set(got) == set(want) and got == want, sorted(k for k in want if got.get(k) != want[k])[:5]
        check = await compare_engines(engine, loaded, prompts, as_served=True)
        assert check.ok, check
    finally:
        stop_llm(llm)


@gpu
async def test_a_colocated_rank_sends_its_pieces_to_the_worker_on_its_gpu_by_cuda_ipc(gpu_llms, gpu_model_dirs,
                                                                                      tmp_path):
    """p2p with the trainer's buffers on the GPU (`P2pTransport("gloo", device="cuda")`) into a vLLM engine on the
    same GPU: every piece goes by CUDA IPC (a reference over gloo, the worker copies on the GPU), three full
    pushes bit-exact by device digests, and the engine then generates what an engine loaded from those weights
    on disk generates (prompts longer than a KV block, asked before the pushes too); a delta sync over the same
    transport sends its deltas over gloo from host copies, and lands bit-exact too. The pushes' times against
    gloo through host memory are printed."""
    import time

    from streamsync.transports.p2p import P2pTransport

    model_dir = gpu_model_dirs["untied"]
    engine = VllmEngine(gpu_llms["untied"], name="vllm-p2p-ipc")
    trainer = _hf_trainer(model_dir)
    prompts = check_prompts(int(_config(model_dir)["vocab_size"]), count=3)
    for p in prompts:  # their prefixes cached under the old weights
        await engine.greedy(p, 4)
    times: dict[str, list[float]] = {}
    for device in ("cuda", "cpu"):
        transport = P2pTransport("gloo", device=device)
        sync = WeightSync([engine], transport=transport, chunk_bytes=1 << 20, timeout=120)
        try:
            for step in range(3):
                perturb(trainer, 40 + step)
                t0 = time.perf_counter()
                report = await sync.push(trainer)
                times.setdefault(device, []).append(time.perf_counter() - t0)
                assert report.path == "sharded" and report.engine_paths == {engine.name: "fast"}
                counts = transport.counts  # segments: the pieces and the alignment gaps between them
                moved = counts["ipc_bytes"] if device == "cuda" else counts["group_bytes"]
                assert moved >= counts["sent_bytes"] > 0 and counts["ipc_bytes"] + counts["group_bytes"] == moved
                assert moved < counts["sent_bytes"] * 1.01, counts
                await _assert_bit_exact(engine, dict(trainer.state_dict()), tied=False)
            if device == "cuda":
                await _as_loaded_from_disk(engine, trainer.state_dict(), model_dir, tmp_path / "ipc", prompts)
        finally:
            await sync.close()
    print(f"p2p into a colocated engine: by CUDA IPC {[round(t * 1e3, 1) for t in times['cuda']]} ms, "
          f"over gloo through host memory {[round(t * 1e3, 1) for t in times['cpu']]} ms")
    transport = P2pTransport("gloo", device="cuda")
    sync = WeightSync([engine], transport=transport, chunk_bytes=1 << 20, delta=True, timeout=120)
    try:
        modes = []
        for step in range(3):
            if step:
                _small_step(trainer, step)
            report = await sync.push(trainer)
            modes.append(report.delta.mode if report.delta else None)
            assert (transport.counts["ipc_bytes"] > 0) == (modes[-1] == "full")
            await _assert_bit_exact(engine, dict(trainer.state_dict()), tied=False)
        assert modes == ["full", "delta", "delta"]
    finally:
        await sync.close()


def _config(model_dir: str) -> dict[str, Any]:
    from streamsync.models.megatron import hf_config

    return hf_config(model_dir)


@gpu
async def test_an_engine_pushed_version_n_generates_exactly_what_one_loaded_from_disk_generates(
        gpu_llms, gpu_model_dirs, tmp_path):
    """Tied (the head's kernel is rebuilt after a push), prompts asked before the push first (their prefixes
    cached under the old weights); and an engine holding other weights fails the same check."""
    model_dir = gpu_model_dirs["tied"]
    pushed = VllmEngine(gpu_llms["tied"], name="pushed")
    prompts = check_prompts(int(_config(model_dir)["vocab_size"]), count=3)
    for p in prompts:
        await pushed.greedy(p, 4)
    trainer = _hf_trainer(model_dir)
    perturb(trainer, 11)
    sync = WeightSync([pushed], transport="auto", chunk_bytes=1 << 20)
    await sync.push(trainer)
    ckpt = save_checkpoint(trainer.state_dict(), like=model_dir, out=tmp_path / "pushed", dtype=torch.bfloat16)
    llm = vllm.LLM(model=str(ckpt), **ENGINE, **engine_kwargs())
    try:
        loaded = VllmEngine(llm, name="loaded")
        check = await compare_engines(pushed, loaded, prompts, as_served=True)
        assert check.ok, check
        perturb(trainer, 12)
        await sync.push(trainer)
        other = await compare_engines(pushed, loaded, prompts)
        assert not other.ok, other
    finally:
        await sync.close()
        stop_llm(llm)


async def _pause_with_requests_in_flight(llm: Any, sync: WeightSync, trainer: Any, mode: str, vocab: int,
                                         step: int) -> tuple[int, int, dict[int, Any]]:
    """Four requests generating; `sync.paused(mode)` around a push. Returns (old version, new version, each
    request's final output)."""
    perturb(trainer, step)
    old = (await sync.push(trainer)).version
    params = vllm.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    prompts = check_prompts(vocab, count=4, length=40)
    finals: dict[int, Any] = {}
    started = [anyio.Event() for _ in range(4)]
    finished: set[int] = set()

    async def generate(j: int) -> None:
        async for out in llm.generate({"prompt_token_ids": prompts[j]}, params, request_id=f"{mode}-{step}-{j}"):
            finals[j] = out
            started[j].set()
        finished.add(j)

    async with anyio.create_task_group() as tg:
        for j in range(4):
            tg.start_soon(generate, j)
        for ev in started:
            await ev.wait()
        perturb(trainer, step + 1)
        async with sync.paused(mode=mode):
            if mode == "wait":  # drained: each completes while generation is paused, so on the old weights
                with anyio.fail_after(60):
                    while len(finished) < 4:
                        await anyio.sleep(0.005)
            new = (await sync.push(trainer)).version
            if mode == "keep":
                assert not finished  # frozen across the push, not ended
    return old, new, finals


@gpu
async def test_paused_keep_abort_wait_with_requests_in_flight(gpu_model_dirs):
    """An AsyncLLM with four requests generating when each pause begins. keep: they freeze and finish on the new
    weights; abort: they end at the pause; wait: they finish on the old weights before the push. Tokens are
    labelled with the version that sampled them (vLLM's labels where it keeps versions, else the rollout's)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from streamsync.rollout import StreamingRollout

    _gpu_env()
    model_dir = gpu_model_dirs["untied"]
    vocab = int(_config(model_dir)["vocab_size"])
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, **ENGINE, **engine_kwargs()))
    try:
        engine = AsyncVllmEngine(llm, name="async")
        trainer = _hf_trainer(model_dir)
        sync = WeightSync([engine], transport="auto", chunk_bytes=1 << 20)
        await sync.connect()
        for i, mode in enumerate(("keep", "abort", "wait")):
            old, new, finals = await _pause_with_requests_in_flight(llm, sync, trainer, mode, vocab, 20 + 2 * i)
            for j, out in finals.items():
                c = out.outputs[0]
                if mode == "abort":
                    assert c.finish_reason == "abort" and len(c.token_ids) < 400, (j, c.finish_reason)
                    continue
                assert len(c.token_ids) == 400 and c.finish_reason == "length"
                if engine.native_versions:
                    want = [str(old), str(new)] if mode == "keep" else [str(old)]
                    assert [w.version for w in c.weight_versions] == want
            assert await engine.get_version() == new
        # the version labels of a streaming rollout across an update, on either kind of vLLM
        rollout = StreamingRollout(sync, _prompts(vocab, 3), in_flight=3, max_tokens=200,
                                   sampling={"temperature": 0.0, "ignore_eos": True}, pause_mode="keep")
        async with rollout:
            with anyio.fail_after(120):
                while sum(len(s.tokens) >= 2 for s in rollout._live.values()) < 3:
                    await anyio.sleep(0.002)
            before = sync.version
            perturb(trainer, 40)
            update = await rollout.update(trainer)
            samples = [await rollout.next() for _ in range(3)]
        for s in samples:
            assert len(s.tokens) == 200 and s.versions == [before, update.push.version], s.spans
        await sync.close()
    finally:
        shutdown(llm)


@gpu
async def test_an_engine_worker_in_the_trainers_own_process_is_refused_at_connect_naming_why(gpu_model_dirs,
                                                                                               monkeypatch):
    """vLLM's engine core in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): CUDA IPC cannot open the
    process's own memory, so the connect fails saying so, before any push."""
    _gpu_env()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = vllm.LLM(model=gpu_model_dirs["untied"], **ENGINE, **engine_kwargs())
    sync = WeightSync([VllmEngine(llm, name="in-process")], transport="auto")
    try:
        with pytest.raises(StreamSyncError, match="runs in the trainer's own process"):
            await sync.connect()
    finally:
        await sync.close()
        stop_llm(llm)


def _prompts(vocab: int, n: int) -> Any:
    async def gen() -> Any:
        for p in check_prompts(vocab, count=n, length=24):
            yield p
    return gen()


# Block-wise fp8 quantizes the MoE's router too (one row per expert), and vLLM's block-scaled GEMM takes it only
# where its rows fill whole 128-row blocks, as a real MoE's 128 or 256 experts do: the MoE case has 128 experts.
@pytest.mark.parametrize(("arch", "method", "tie"), [(a, "fp8", t) for a in ("dense", "moe") for t in TIES]
                         + [(a, "fp8_per_block", "untied") for a in ("dense", "moe")])
@gpu
async def test_a_bf16_push_into_an_fp8_engine_holds_what_vllm_makes_of_the_same_weights(arch, method, tie,
                                                                                       gpu_model_dirs, gpu_moe_dirs,
                                                                                       tmp_path, monkeypatch):
    """`quantization="fp8"` (vLLM quantizes bf16 weights as it loads them, one scale per tensor) and
    "fp8_per_block" (128x128 blocks, DeepSeek-V3's layout), dense and MoE (fp8 stacked experts): two pushes from a
    bf16 HF module, a third from a bf16 megatron-core model, then every engine tensor (fp8 weights and their
    scales included) equal to those of an engine of the same method that loaded the pushed weights from disk, and
    the same greedy tokens."""
    model_dir = (gpu_model_dirs if arch == "dense" else gpu_moe_dirs)[tie]
    if arch == "moe" and method == "fp8_per_block":
        from streamsync.models.tiny import make_tiny_qwen3_moe

        model_dir = str(make_tiny_qwen3_moe(tmp_path / "models", num_experts=128, tie_word_embeddings=TIES[tie]))
    label = f"{arch}-{method}-{tie}"
    _gpu_env()
    if method == "fp8_per_block":  # DeepGEMM builds its kernels from headers the GPU test bundle does not carry
        monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    fp8 = dict(ENGINE, quantization=method)
    llm = vllm.LLM(model=model_dir, **fp8, **engine_kwargs())
    loaded_llm = None
    sync = None
    try:
        engine = VllmEngine(llm, name=f"fp8-{label}")
        trainer = _hf_trainer(model_dir)
        sync = WeightSync([engine], transport="auto", chunk_bytes=1 << 20)
        paths: list[Any] = []
        direct: list[list[int]] = []  # modules quantized by streamsync's kernels, per push
        sourced: list[list[int]] = []  # of those, quantized from the pushed tensors where they lie
        copied: list[list[int]] = []  # bytes of their pieces copied out of a chunk first (split groups)
        for step in (21, 22):  # the second lands on layers already quantized by the first
            perturb(trainer, step)
            report = await sync.push(trainer)
            assert await engine.get_version() == report.version
            paths.append((report.engine_paths, [r.rebuilt_modules for r in report.engine_rounds]))
            direct.append([r.direct_modules for r in report.engine_rounds])
            sourced.append([r.sourced_modules for r in report.engine_rounds])
            copied.append([r.sourced_copied_bytes for r in report.engine_rounds])
        await sync.close()
        mcore = _megatron_trainer(model_dir)  # fused QKV and gate/up, split and requantized by the engine
        _perturb_all(mcore, 23)
        sync = WeightSync([engine], transport="auto", chunk_bytes=1 << 20,
                          source_options={"dtype": torch.bfloat16, "hf_config": _config(model_dir)})
        report = await sync.push(mcore)
        assert await engine.get_version() == report.version
        paths.append((report.engine_paths, [r.rebuilt_modules for r in report.engine_rounds]))
        direct.append([r.direct_modules for r in report.engine_rounds])
        sourced.append([r.sourced_modules for r in report.engine_rounds])
        copied.append([r.sourced_copied_bytes for r in report.engine_rounds])
        ckpt = save_checkpoint(await _hf_export(mcore, model_dir), like=model_dir, out=tmp_path / f"fp8-{label}",
                               dtype=torch.bfloat16)
        loaded_llm = vllm.LLM(model=str(ckpt), **fp8, **engine_kwargs())
        loaded = VllmEngine(loaded_llm, name=f"fp8-{label}-loaded")
        got, want = await engine.weight_digests(device=True), await loaded.weight_digests(device=True)
        assert any(v.startswith("float8") for v in want.values()), want  # the engine computes in fp8
        assert set(got) == set(want) and got == want, sorted(k for k in want if got.get(k) != want[k])[:5]
        check = await compare_engines(engine, loaded, check_prompts(int(_config(model_dir)["vocab_size"]), count=3),
                                      as_served=True)
        assert check.ok, check
        # every quantized module rebuilt by the fast path through vLLM's own processing: no layerwise reload
        assert all(p == {engine.name: "fast"} and all(n > 0 for n in rebuilt) for p, rebuilt in paths), paths
        # per tensor: learned at connect (vLLM's processing of a random weight compared with its quantization
        # kernel), every quantized module is quantized by streamsync's kernels from the first push on; per block:
        # by vLLM's own processing, every push
        print(f"fp8 {label}: modules quantized by streamsync per push {direct}, from the pushed tensors {sourced}, "
              f"bytes of theirs copied out of a chunk first {copied}")
        if method == "fp8":
            assert all(n > 0 for d in direct for n in d), (direct, paths)
            # all of them from the pushed tensors (megatron's blocked Q too), each weight or expert as its last
            # piece arrives: one-MiB chunks split layers and experts, whose first pieces wait in copies
            assert sourced == direct, (sourced, direct)
    finally:
        if sync is not None:
            await sync.close()
        for x in (llm, loaded_llm):
            if x is not None:
                stop_llm(x)
