"""The collective transport's direct protocol over gloo on CPU: one broadcast per tensor, from the trainer's
tensors where they can be sent as they are, into the receiver's parameters where its loader names them
(`destinations`). Real process groups and receiver processes; the same code runs NCCL (tests/test_collective_gpu.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import anyio
import pytest
import torch

from streamsync import PushError, WeightSync
from streamsync.checksum import digests
from streamsync.engines.base import Engine
from streamsync.errors import ValidationError
from streamsync.models.synthetic import StateModule, mixed_specs, perturb_, qwen3_specs, save_specs
from streamsync.pack import Layout, TensorSpec, plan_layout
from streamsync.receiver import ModuleLoader, WeightReceiver
from streamsync.sources.module import ModuleSource
from streamsync.testing import faults
from streamsync.testing.faults import Rig
from streamsync.testing.fused import FusedModel
from streamsync.testing.receiver import ReceiverProcess
from streamsync.transports.collective import CollectiveReceiver, CollectiveTransport

CHUNK = 1 << 20
MiB = 1 << 20


def _direct(**kw: Any) -> CollectiveTransport:
    return CollectiveTransport("gloo", **{"group_timeout": 20, "protocol": "direct", **kw})


class LocalEngine(Engine):
    """A receiver in this process (its group rank in a worker thread): the test sees what its loader got."""

    def __init__(self, module: torch.nn.Module, *, destinations: bool = True, name: str = "local") -> None:
        self.name = name
        self.module = module
        self.rx = WeightReceiver("cpu")
        plain = ModuleLoader(module)
        self.load_fn = getattr(module, "load_weights", None) or plain
        self.dest_fn = (getattr(module, "destinations", None) or plain.destinations) if destinations else None
        self.loaded: list[str] = []  # names the loader was handed
        self.handles: list[dict[str, Any]] = []

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = list(weights)
        self.loaded += [n for n, _ in weights]
        self.load_fn(weights)

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await anyio.to_thread.run_sync(self.rx.init, init_info)

    async def start_update(self) -> None:
        self.rx.start()

    async def update(self, update_info: dict[str, Any]) -> None:
        self.handles.append(update_info["handle"])
        await anyio.to_thread.run_sync(self.rx.update, update_info, self._load, self.dest_fn)

    async def finish_update(self, version: int) -> None:
        self.rx.finish(version)

    async def abort_update(self, version: int | None = None) -> None:
        self.rx.abort()

    async def get_version(self) -> int | None:
        return self.rx.clean_version

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.rx.close)

    def digests(self) -> dict[str, str]:
        named = self.module.hf_tensors() if hasattr(self.module, "hf_tensors") else self.module.state_dict().items()
        return digests(named)


# --------------------------------------------------------------------------------- bit-exact, receivers


async def test_direct_push_into_a_plain_module_writes_every_tensor_into_its_parameter(qwen_specs, qwen_model):
    engine = LocalEngine(StateModule(qwen_specs, fill="zeros"))
    sync = WeightSync([engine], transport=_direct(), chunk_bytes=CHUNK, timeout=30)
    report = await sync.push(qwen_model)
    assert report.chunks > 4
    assert engine.digests() == digests(qwen_model.state_dict().items())
    assert engine.loaded == []  # every tensor went into its parameter: nothing copied by the loader
    assert {h["protocol"] for h in engine.handles} == {"direct"}
    assert sync.transport.pool.buffers == 0  # contiguous tensors of the right dtype: no send buffer at all

    model = StateModule(qwen_specs, fill="random", seed=4)
    await sync.push(model, max_inflight=1)  # the same group; sequence numbers carry on
    assert engine.digests() == digests(model.state_dict().items())
    await sync.close()


async def test_direct_push_into_a_fused_receiver_lands_in_the_fused_slices(qwen_specs, qwen_model):
    fused = FusedModel(qwen_specs, fill="zeros")
    engine = LocalEngine(fused)
    sync = WeightSync([engine], transport=_direct(), chunk_bytes=CHUNK, timeout=30)
    await sync.push(qwen_model)
    assert engine.digests() == digests(qwen_model.state_dict().items())
    assert engine.loaded == []
    await sync.close()


async def test_a_loader_without_destinations_loads_everything_from_the_receive_buffer(qwen_specs, qwen_model):
    engine = LocalEngine(FusedModel(qwen_specs, fill="zeros"), destinations=False)  # as a vLLM engine
    sync = WeightSync([engine], transport=_direct(), chunk_bytes=CHUNK, timeout=30)
    await sync.push(qwen_model)
    assert engine.digests() == digests(qwen_model.state_dict().items())
    assert sorted(engine.loaded) == sorted(qwen_model.state_dict())
    await sync.close()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
async def test_direct_push_into_receiver_processes_is_bit_exact(qwen_specs_path, qwen_model, fused):
    with ReceiverProcess(str(qwen_specs_path), name="rx", threads=1, fused=fused) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=_direct(), chunk_bytes=CHUNK, timeout=30)
        await sync.push(qwen_model)
        assert await engine.checksums() == digests(qwen_model.state_dict().items())
        await sync.close()


async def test_mixed_dtypes_scalars_and_empty_tensors_go_direct(receiver, mixed_model):
    engine = receiver.engine()
    sync = WeightSync([engine], transport=_direct(), chunk_bytes=2048, timeout=30)
    await sync.push(mixed_model)
    assert await engine.checksums() == digests(mixed_model.state_dict().items())
    local = LocalEngine(StateModule(mixed_specs(), fill="zeros"))
    sync2 = WeightSync([local], transport=_direct(), chunk_bytes=2048, timeout=30)
    await sync2.push(mixed_model)
    assert local.digests() == digests(mixed_model.state_dict().items()) and local.loaded == []
    await sync.close()
    await sync2.close()


async def test_the_protocol_may_change_between_pushes_on_one_group(qwen_specs, qwen_model):
    engine = LocalEngine(FusedModel(qwen_specs, fill="zeros"))
    transport = _direct()
    sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK, timeout=30)
    model = StateModule(qwen_specs, fill="random", seed=9)
    for step, protocol in enumerate(("direct", "chunk", "direct", "chunk")):
        transport.protocol = protocol
        perturb_(model, step)
        engine.handles.clear()
        await sync.push(model)
        assert {h["protocol"] for h in engine.handles} == {protocol}
        assert engine.digests() == digests(model.state_dict().items()), protocol
    await sync.close()


# --------------------------------------------------------------------------------- split, strided, cast

# A 4 MiB embedding and lm_head (vocab 8192 x 256, bf16) against 1 MiB chunks: row parts in several chunks.
SPLIT = qwen3_specs(vocab=8192, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512)


@pytest.mark.parametrize("kind", ["plain", "fused", "no-destinations"])
async def test_split_tensors_are_reassembled_in_their_destination(kind):
    model = StateModule(SPLIT, fill="random", seed=2)
    receiver = FusedModel(SPLIT, fill="zeros") if kind == "fused" else StateModule(SPLIT, fill="zeros")
    engine = LocalEngine(receiver, destinations=kind != "no-destinations")
    sync = WeightSync([engine], transport=_direct(), chunk_bytes=CHUNK, timeout=30)
    report = await sync.push(model, max_inflight=2)
    assert any(m.part is not None for p in sync.plan(model)[1] for m in p.layout.metas)
    assert report.peak_bytes_inflight <= 2 * CHUNK
    assert engine.digests() == digests(model.state_dict().items())
    if kind == "no-destinations":  # staged parts, then the whole tensor handed to the loader once
        assert engine.loaded.count("model.embed_tokens.weight") == 1
    else:
        assert engine.loaded == []
    assert not engine.rx._staged
    await sync.close()


async def test_split_tensors_into_a_receiver_process(tmp_path):
    model = StateModule(SPLIT, fill="random", seed=5)
    with ReceiverProcess(str(save_specs(SPLIT, tmp_path / "s.json")), threads=1, fused=True) as rp:
        sync = WeightSync([rp.engine()], transport=_direct(), chunk_bytes=CHUNK, timeout=30)
        await sync.push(model)
        assert await rp.engine().checksums() == digests(model.state_dict().items())
        await sync.close()


def _strided_and_cast(specs: list) -> tuple[StateModule, dict[str, torch.Tensor]]:
    """A bf16 model where the norms are float32 (cast by the pack copy to the receivers' bf16) and q_proj of
    layer 0 is a transposed view (strided): both go through the sender's scratch, the rest straight."""
    model = StateModule(specs, fill="random", seed=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data = p.data.float() + 1e-3  # not representable in bf16: the cast rounds
            elif name == "model.layers.0.self_attn.q_proj.weight":
                p.data = p.data.t().contiguous().t()
                assert not p.is_contiguous()
    want = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in model.state_dict().items()}
    return model, want


async def test_strided_and_cast_tensors_mixed_with_plain_ones_in_one_chunk(qwen_specs):
    model, want = _strided_and_cast(qwen_specs)
    engine = LocalEngine(FusedModel(qwen_specs, fill="zeros"))
    sync = WeightSync([engine], transport=_direct(), chunk_bytes=CHUNK, timeout=30)
    await sync.push(ModuleSource(model, dtype=torch.bfloat16))
    assert engine.digests() == digests(want.items())
    assert engine.loaded == []
    await sync.close()


# --------------------------------------------------------------------------------- what is refused


def _bare_receiver() -> CollectiveReceiver:
    rx = object.__new__(CollectiveReceiver)  # past the rendezvous: only the handle checks run here
    rx.group, rx._seq, rx._pg, rx._bufs, rx.backend = "g", 0, object(), [None, None], "gloo"
    return rx


def test_a_handle_of_an_unknown_protocol_is_refused():
    with pytest.raises(ValidationError, match="protocol"), _bare_receiver().open(
            {"handle": {"group": "g", "seq": 0, "nbytes": 256, "protocol": "scatter"}}, 256):
        pass


def test_a_direct_handle_is_refused_by_a_receiver_that_passes_no_layout():
    rx = _bare_receiver()
    with pytest.raises(ValidationError, match="direct protocol"), rx.open(
            {"handle": {"group": "g", "seq": 0, "nbytes": 256, "protocol": "direct"}}, 256):
        pass
    assert rx._seq == 0  # refused before entering any collective


def test_a_direct_handle_whose_layout_disagrees_with_its_size_is_refused():
    layout = plan_layout([TensorSpec("w", torch.float32, (4,))])
    with pytest.raises(ValidationError, match="its layout"), _bare_receiver().open(
            {"handle": {"group": "g", "seq": 0, "nbytes": 512, "protocol": "direct"}}, layout=layout):
        pass


def test_the_protocol_is_checked_and_resolved_per_backend():
    with pytest.raises(ValidationError, match="protocol"):
        CollectiveTransport("gloo", protocol="scatter")
    assert CollectiveTransport("nccl").chunk_protocol == "chunk"  # measured faster on two H200s
    assert CollectiveTransport("nccl", protocol="direct").chunk_protocol == "direct"
    assert CollectiveTransport("gloo").chunk_protocol == "chunk"
    assert CollectiveTransport("gloo", protocol="direct").chunk_protocol == "direct"


def test_a_destination_of_another_shape_is_refused_before_anything_is_written():
    rx = WeightReceiver("cpu")
    layout = plan_layout([TensorSpec("w", torch.float32, (4,))])
    with pytest.raises(ValidationError, match="receiver holds"):
        rx._targets(layout, lambda specs: [torch.zeros(5)])


async def test_a_refused_direct_chunk_leaves_the_engine_clean(qwen_specs, qwen_model):
    """A receiver that refuses the first chunk's handle wrote nothing: the failed push leaves it clean."""
    engine = LocalEngine(StateModule(qwen_specs, fill="zeros"))
    sync = WeightSync([engine], transport=_direct(group_timeout=3), chunk_bytes=CHUNK, timeout=30)
    old = (await sync.push(qwen_model)).version

    async def refusing(update_info: dict[str, Any]) -> None:
        h = {**update_info["handle"], "protocol": "scatter"}  # a handle this receiver does not speak
        await LocalEngine.update(engine, {**update_info, "handle": h})

    engine.update = refusing  # type: ignore[method-assign]
    with pytest.raises(PushError, match="protocol"):
        await sync.push(qwen_model)
    assert not engine.rx.dirty and await engine.get_version() == old
    await sync.close()


async def test_a_direct_push_failing_midway_leaves_the_engine_reporting_mixed_weights(qwen_specs_path, qwen_model):
    with ReceiverProcess(str(qwen_specs_path), name="rx", threads=1, fused=True) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=_direct(), chunk_bytes=CHUNK, timeout=30)
        await sync.push(qwen_model)
        sync.faults["pack"] = 4
        with pytest.raises(PushError):
            await sync.push(qwen_model, max_inflight=1)  # chunks 0-3 were written into the parameters
        state = await engine.state()
        assert state.mixed and state.version is None
        sync.faults.clear()
        await sync.push(qwen_model)
        assert not (await engine.state()).mixed
        assert await engine.checksums() == digests(qwen_model.state_dict().items())
        await sync.close()


# --------------------------------------------------------------------------------- faults (issue 10)

GROUP_TIMEOUT = 3.0
CLOSE_BOUND = 10.0


@pytest.fixture(params=[False, True], ids=["plain", "fused"])
def rig(request, qwen_specs_path, qwen_specs):
    return Rig("gloo", StateModule(qwen_specs, fill="random", seed=11), str(qwen_specs_path),
               group_timeout=GROUP_TIMEOUT, fused=request.param, protocol="direct")


async def test_a_receiver_killed_mid_direct_push_fails_naming_it_and_the_transport_reconnects(rig):
    out = await faults.killed_receiver(rig)
    assert out.notes["fault_fired"] and out.error is not None
    assert out.error.stage == "send" and out.error.chunk is not None and out.error.receiver == "doomed"
    assert out.fail_s < GROUP_TIMEOUT + 5 and out.close_s < CLOSE_BOUND
    assert out.exact_after


async def test_a_receiver_frozen_mid_direct_push_fails_within_the_group_timeout(rig):
    out = await faults.frozen_receiver(rig)
    assert out.notes["fault_fired"] and out.error is not None
    assert out.error.stage == "send" and out.error.receiver == "frozen"
    assert GROUP_TIMEOUT - 1 < out.fail_s < GROUP_TIMEOUT + 5
    assert out.close_s < CLOSE_BOUND
    assert out.exact_after


async def test_close_with_live_receivers_then_a_new_group_direct(rig):
    out = await faults.close_with_live_receivers(rig)
    assert out.exact_before and out.close_s < CLOSE_BOUND and out.exact_after


def test_layout_parts_of_a_tensor_must_continue_before_a_direct_receive():
    rx = WeightReceiver("cpu")
    dst = torch.zeros(8, 2)
    layout = Layout.from_json(plan_layout([TensorSpec("w", torch.float32, (4, 2), part=(4, 8))]).to_json())
    with pytest.raises(ValidationError, match="does not continue"):
        rx._targets(layout, lambda specs: [dst])
