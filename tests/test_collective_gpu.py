"""The collective transport with CUDA tensors: gloo on one GPU, NCCL where two GPUs are visible (marked
`gpu`: skipped where CUDA is absent)."""

from __future__ import annotations

import anyio
import pytest
import torch

from streamsync import WeightSync
from streamsync.checksum import device_digests, digests
from streamsync.models.synthetic import StateModule, qwen3_specs, save_specs
from streamsync.sources.module import ModuleSource
from streamsync.testing import faults
from streamsync.testing.faults import Rig
from streamsync.testing.gpu import gpu
from streamsync.testing.gpu import perturb as _perturb
from streamsync.testing.receiver import ReceiverProcess
from streamsync.transports.collective import CollectiveTransport

CHUNK = 1 << 20


@gpu
async def test_collective_with_cuda_tensors_over_gloo(cuda_mixed):
    model, rp = cuda_mixed
    engine = rp.engine()
    transport = CollectiveTransport("gloo", device="cuda", group_timeout=30)
    sync = WeightSync([engine], transport=transport, chunk_bytes=2048, timeout=60)
    await sync.push(model)
    assert transport.pool.device.type == "cuda"
    assert await engine.checksums() == digests(model.state_dict().items())
    _perturb(model, 2)
    await sync.push(model)
    assert await engine.checksums() == digests(model.state_dict().items())
    await sync.close()


# ------------------------------------------------------------------------------- NCCL between two GPUs

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (it refuses two ranks on one)")
QWEN_SMALL = qwen3_specs(vocab=4096, hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, intermediate=768)


@gpu
@two_gpus
async def test_collective_over_nccl_between_two_gpus(tmp_path):
    model = StateModule(QWEN_SMALL, fill="random", seed=5, device="cuda:0")
    with ReceiverProcess(str(save_specs(QWEN_SMALL, tmp_path / "q.json")), device="cuda:1", fused=True) as rp:
        engine = rp.engine()
        transport = CollectiveTransport("nccl", group_timeout=60)
        sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK, timeout=120)
        for step, window in enumerate((4, 1, 4, 4)):
            _perturb(model, step)
            await sync.push(model, max_inflight=window)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items())
        # From the second push of a chunk into the same buffer its pack is a captured graph: replayed since.
        assert transport.graph_stats["captured"] > 0 and transport.graph_stats["replayed"] > 0
        with anyio.fail_after(15):  # it used to hang here forever (ProcessGroupNCCL.shutdown on the loop)
            await sync.close()


@gpu
@two_gpus
async def test_nccl_buffers_are_not_reused_before_a_slow_receiver_gpu_unpacked_them(tmp_path):
    # The receiver's GPU is busy ~5 ms before each chunk's copies, and the trainer's stream is busy when each
    # push starts: only the device-side waits (ready, sent, the receiver's two slots) keep the bits right.
    model = StateModule(QWEN_SMALL, fill="random", seed=6, device="cuda:0")
    with ReceiverProcess(str(save_specs(QWEN_SMALL, tmp_path / "q.json")), device="cuda:1", fused=True,
                         gpu_delay_ms=5) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CollectiveTransport("nccl", group_timeout=60), chunk_bytes=CHUNK // 2,
                          timeout=120)
        for step, window in enumerate((4, 2, 1, 4)):
            _perturb(model, 30 + step)
            torch.cuda._sleep(int(40e6))
            report = await sync.push(model, max_inflight=window)
            assert report.chunks > 8
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), window
        await sync.close()


@gpu
@two_gpus
async def test_nccl_ordering_can_change_between_pushes(tmp_path):
    # Device-ordered and host-ordered pushes (the handle says which) alternate on one group and one pair of
    # receive buffers, with a slow receiver GPU: a missed wait when switching would show in the bits.
    model = StateModule(QWEN_SMALL, fill="random", seed=7, device="cuda:0")
    with ReceiverProcess(str(save_specs(QWEN_SMALL, tmp_path / "q.json")), device="cuda:1", fused=True,
                         gpu_delay_ms=2) as rp:
        engine = rp.engine()
        transport = CollectiveTransport("nccl", group_timeout=60)
        sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK, timeout=120)
        for step, ordering in enumerate(("device", "host", "device", "host")):
            transport.ordering = ordering
            _perturb(model, 40 + step)
            await sync.push(model, max_inflight=4)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), ordering
        await sync.close()


def _strided_and_cast(model: StateModule) -> dict[str, torch.Tensor]:
    """Norms made float32 (the pack copy casts them to the receivers' bf16) and one q_proj a transposed view
    (strided): both go through the sender's scratch in the direct protocol, the rest straight from the model.
    Returns what the receiver must then hold."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data = p.data.float() + 1e-3
            elif name == "model.layers.0.self_attn.q_proj.weight":
                p.data = p.data.t().contiguous().t()
    return {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in model.state_dict().items()}


@gpu
@two_gpus
@pytest.mark.parametrize("receiver", ["fused", "plain", "no-destinations"])
async def test_nccl_direct_and_chunk_protocols_alternate_bit_exact(tmp_path, receiver):
    # The direct protocol (one NCCL group of broadcasts per chunk, from the model's tensors into the receiver's
    # parameters) and the chunk protocol alternate on one group, with a slow receiver GPU and a busy trainer
    # stream: a missed device-side wait shows in the bits. 1 MiB chunks split the 2 MiB embedding and head.
    model = StateModule(QWEN_SMALL, fill="random", seed=8, device="cuda:0")
    with ReceiverProcess(str(save_specs(QWEN_SMALL, tmp_path / "q.json")), device="cuda:1",
                         fused=receiver == "fused", direct=receiver != "no-destinations", gpu_delay_ms=2) as rp:
        engine = rp.engine()
        transport = CollectiveTransport("nccl", group_timeout=60)
        assert transport.chunk_protocol == "chunk"  # NCCL's default (measured faster)
        sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK, timeout=120)
        for step, (protocol, window) in enumerate((("direct", 4), ("chunk", 4), ("direct", 1), ("direct", 2),
                                                   ("chunk", 1), ("direct", 4))):
            transport.protocol = protocol
            _perturb(model, 50 + step)
            torch.cuda._sleep(int(20e6))
            report = await sync.push(model, max_inflight=window)
            assert report.chunks > 4
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), (protocol,
                                                                                                       window)
        await sync.close()


@gpu
@two_gpus
async def test_nccl_direct_strided_and_cast_tensors_mixed_with_plain_ones(tmp_path):
    model = StateModule(QWEN_SMALL, fill="random", seed=9, device="cuda:0")
    want = _strided_and_cast(model)
    with ReceiverProcess(str(save_specs(QWEN_SMALL, tmp_path / "q.json")), device="cuda:1", fused=True) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CollectiveTransport("nccl", group_timeout=60, protocol="direct"),
                          chunk_bytes=CHUNK, timeout=120)
        for window in (4, 1):
            await sync.push(ModuleSource(model, dtype=torch.bfloat16), max_inflight=window)
            assert await engine.checksums(device=True) == device_digests(want.items()), window
        await sync.close()


@gpu
@two_gpus
async def test_nccl_direct_push_returns_after_the_last_broadcast_read_the_model(tmp_path):
    # The direct protocol reads the trainer's own tensors: once push() returned, the trainer may overwrite them
    # (an optimizer step) and the receiver must still hold what was pushed.
    model = StateModule(QWEN_SMALL, fill="random", seed=10, device="cuda:0")
    with ReceiverProcess(str(save_specs(QWEN_SMALL, tmp_path / "q.json")), device="cuda:1", fused=True,
                         gpu_delay_ms=5) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CollectiveTransport("nccl", group_timeout=60, protocol="direct"),
                          chunk_bytes=CHUNK, timeout=120)
        for step in range(3):
            _perturb(model, 60 + step)
            want = device_digests(model.state_dict().items())
            await sync.push(model, max_inflight=4)
            with torch.no_grad():  # at once, on the trainer's stream: no synchronize in between
                for t in model.state_dict().values():
                    t.add_(1)
            assert await engine.checksums(device=True) == want, step
        await sync.close()


NCCL_GROUP_TIMEOUT = 10.0  # NCCL's communicator set-up on a fresh group takes a few seconds


@pytest.fixture
def nccl_rig(tmp_path):
    model = StateModule(QWEN_SMALL, fill="random", seed=12, device="cuda:0")
    return Rig("nccl", model, str(save_specs(QWEN_SMALL, tmp_path / "q.json")), rx_device="cuda:1", fused=True,
               group_timeout=NCCL_GROUP_TIMEOUT)


@gpu
@two_gpus
async def test_nccl_close_returns_promptly_while_receivers_live_and_a_new_group_can_be_made(nccl_rig):
    out = await faults.close_with_live_receivers(nccl_rig)
    assert out.exact_before and out.close_s < 10
    assert out.exact_after


@gpu
@two_gpus
async def test_nccl_close_returns_promptly_while_receivers_shut_down_at_the_same_time(nccl_rig):
    out = await faults.close_while_receivers_shut_down(nccl_rig)
    assert out.exact_before and out.close_s < 10


@gpu
@two_gpus
async def test_nccl_receiver_killed_mid_broadcast_fails_the_push_naming_it_and_the_transport_reconnects(nccl_rig):
    out = await faults.killed_receiver(nccl_rig)
    assert out.notes["fault_fired"] and out.error is not None, out
    assert out.error.stage == "send" and out.error.chunk is not None and out.error.receiver == "doomed", out.error
    assert out.fail_s < NCCL_GROUP_TIMEOUT + 5 and out.close_s < 10
    assert out.exact_after


@gpu
@two_gpus
@pytest.mark.parametrize("protocol", ["direct", "chunk"])
async def test_nccl_receiver_killed_mid_push_fails_naming_it_and_reconnects_in_either_protocol(nccl_rig, protocol):
    nccl_rig.protocol = protocol
    out = await faults.killed_receiver(nccl_rig)
    assert out.notes["fault_fired"] and out.error is not None, out
    assert out.error.stage == "send" and out.error.receiver == "doomed", out.error
    assert out.fail_s < NCCL_GROUP_TIMEOUT + 5 and out.close_s < 10
    assert out.exact_after


@gpu
@two_gpus
async def test_nccl_receiver_frozen_mid_broadcast_fails_the_push_within_the_group_timeout(nccl_rig):
    out = await faults.frozen_receiver(nccl_rig)
    assert out.notes["fault_fired"] and out.error is not None, out
    assert out.error.stage == "send" and out.error.chunk is not None and out.error.receiver == "frozen", out.error
    assert out.fail_s < NCCL_GROUP_TIMEOUT + 5 and out.close_s < 10
    assert out.exact_after
