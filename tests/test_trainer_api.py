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


# ------------------------------------------------------------------------------- what push accepts


@pytest.fixture
def served(tmp_path):
    """A receiver holding a small Qwen3-shaped bf16 model, and a trainer module holding the same names."""
    specs = qwen3_specs(vocab=128, **SHAPE)
    with ReceiverProcess(str(save_specs(specs, tmp_path / "served.json"))) as rp:
        yield rp, StateModule(specs, fill="random", seed=5)


def _wrapped(kind, module):
    import torch
    import torch.distributed as dist

    if kind == "state dict":
        return module.state_dict()
    if kind == "pairs":
        return iter(list(module.state_dict().items()))  # an iterator, as vLLM's load_weights takes
    if kind == "compiled":
        return torch.compile(module)
    if kind == "ddp":
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        module.requires_grad_(True)  # DDP wraps a model that trains
        return torch.nn.parallel.DistributedDataParallel(module)
    if kind == "fsdp1":  # flat parameters: pushed by the full state dict FSDP gathers
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return FullyShardedDataParallel(module, device_id=torch.device("cpu"), use_orig_params=True)
    return torch.nn.DataParallel(torch.compile(module))  # wrappers nest


@pytest.mark.parametrize("kind", ["state dict", "pairs", "compiled", "ddp", "nested", "fsdp1"])
async def test_push_takes_state_dicts_pairs_and_wrapped_modules_bit_exact(served, kind):
    from streamsync.checksum import digests

    rp, module = served
    engine = rp.engine()
    want = digests(module.state_dict().items())
    async with WeightSync([engine], metrics=None) as sync:
        report = await sync.push(_wrapped(kind, module))
        assert report.bytes > 0
        assert await engine.checksums() == want


def _fsdp2_one_rank(module):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for layer in module.model.layers.children():
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
    return fully_shard(module, mesh=init_device_mesh("cpu", (1,)))


async def test_an_fsdp2_model_on_one_rank_is_pushed_as_its_local_pieces_without_a_gather_and_followed_when_they_move(
        served):
    """FSDP2 on one GPU (one rank): every parameter is a DTensor whose local piece is the whole tensor. It goes as
    a plain module's tensor does (no `full_tensor` gather, its storage eligible to go by reference), bit-exact;
    and where FSDP2 puts a parameter's piece in new memory (its lazy init may), the next push reads the new."""
    import torch
    from torch.distributed.tensor import DTensor

    from streamsync.checksum import digests

    rp, module = served
    want = digests(module.state_dict().items())
    model = _fsdp2_one_rank(module)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    source = ModuleSource(model)
    assert source.gathers_here and source.is_sender
    assert len(source.local_addresses(torch.device("cpu"))) == len(want)  # each piece's own storage
    engine = rp.engine()
    async with WeightSync([engine], metrics=None) as sync:
        await sync.push(model)
        assert await engine.checksums() == want
        name, p = next(iter(model.named_parameters()))
        was = p.to_local().data_ptr()
        with torch.no_grad():
            p._local_tensor = p._local_tensor + 1  # new memory under the same DTensor
        for q in model.parameters():
            with torch.no_grad():
                q.add_(0.5)  # and a step's in-place update of every piece
        local = {n: t.to_local() for n, t in model.state_dict().items()}
        assert local[name].data_ptr() != was
        await sync.push(model)
        assert await engine.checksums() == digests(local.items())


async def test_a_dtype_mismatch_is_cast_by_default_and_strict_dtypes_names_the_option(served):
    import torch

    from streamsync.checksum import digests

    rp, module = served
    fp32 = {k: v.float() for k, v in module.state_dict().items()}  # an fp32 trainer, a bf16 engine
    engine = rp.engine()
    want = digests((k, v.to(torch.bfloat16)) for k, v in fp32.items())
    async with WeightSync([engine], metrics=None, strict_dtypes=True) as sync:
        with pytest.raises(ValidationError, match=r"source_options=\{'dtype': 'bfloat16'\}"):
            await sync.push(fp32)
    async with WeightSync([engine], metrics=None) as sync:  # as vLLM's loaders cast a checkpoint
        report = await sync.push(fp32)
        assert report.casts == {"float32 -> bfloat16": len(fp32)}
        assert await engine.checksums() == want
    async with WeightSync([engine], metrics=None, source_options={"dtype": "bfloat16"}) as sync:
        report = await sync.push(fp32)
        assert report.casts == {} and await engine.checksums() == want


@pytest.mark.parametrize("bad, match", [
    ({"dtype": "bfloat17"}, r"dtype must be a torch dtype or its name.*bfloat17"),
    ({"dtype": 16}, r"dtype must be a torch dtype or its name"),
])
async def test_a_bad_dtype_option_is_refused_naming_it(served, bad, match):
    rp, module = served
    async with WeightSync([rp.engine()], metrics=None, source_options=bad) as sync:
        with pytest.raises(ValidationError, match=match):
            await sync.push(module)


async def test_what_push_cannot_take_is_named(served):
    import torch

    rp, _ = served
    async with WeightSync([rp.engine()], metrics=None) as sync:
        with pytest.raises(TypeError, match=r"cannot push a int: expected a torch.nn.Module .* state dict"):
            await sync.push(3)
        with pytest.raises(ValidationError, match=r"maps names to tensors; got 'w' -> int"):
            await sync.push({"w": 1})
        with pytest.raises(ValidationError, match=r"tensor 'w' is given twice"):
            await sync.push([("w", torch.zeros(2)), ("w", torch.ones(2))])


def test_a_transformers_moe_module_is_sent_as_the_per_expert_tensors_its_checkpoint_holds(tmp_path):
    # transformers-5 MoE modules stack a layer's experts (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    # [E, H, I]); the source sends views of them under the checkpoint's per-expert names, the tensors
    # save_pretrained writes, and sees a stacked tensor whose data an optimizer swapped
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from streamsync.models.tiny import make_tiny_qwen3_moe

    hf = AutoModelForCausalLM.from_pretrained(make_tiny_qwen3_moe(tmp_path / "m"), dtype=torch.bfloat16)
    stacked = dict(hf.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    src = ModuleSource(hf)
    got = dict(src.local_tensors())
    hf.save_pretrained(tmp_path / "saved")
    want = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    up = got["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert up.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()  # a view, no copy
    stacked.data = stacked.data + 1
    again = dict(src.local_tensors())["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(again, up + 1)
