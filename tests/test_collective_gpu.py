"""The collective transport with CUDA tensors: gloo on one GPU, NCCL where two GPUs are visible (marked
`gpu`: skipped where CUDA is absent)."""

from __future__ import annotations

import anyio
import pytest
import torch

from streamsync import WeightSync
from streamsync.checksum import device_digests, digests
from streamsync.models.synthetic import StateModule, qwen3_specs, save_specs
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
        counts = []
        for step, window in enumerate((4, 1, 4, 4)):
            _perturb(model, step)
            counts.append((await sync.push(model, max_inflight=window)).trace.counts)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items())
        # From the second push of a chunk into the same buffer its pack is a captured graph: replayed since.
        assert sum(c.get("pack_graphs_captured", 0) for c in counts) > 0
        assert sum(c.get("pack_graphs_replayed", 0) for c in counts) > 0
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
async def test_nccl_receiver_frozen_mid_broadcast_fails_the_push_within_the_group_timeout(nccl_rig):
    out = await faults.frozen_receiver(nccl_rig)
    assert out.notes["fault_fired"] and out.error is not None, out
    assert out.error.stage == "send" and out.error.chunk is not None and out.error.receiver == "frozen", out.error
    assert out.fail_s < NCCL_GROUP_TIMEOUT + 5 and out.close_s < 10
    assert out.exact_after
