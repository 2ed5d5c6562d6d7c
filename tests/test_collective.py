"""The collective transport over gloo on CPU: a real process group between this process (rank 0) and
receiver processes (ranks 1..N), one broadcast per chunk. The same code runs NCCL on GPUs."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

from streamsync import PushError, WeightSync
from streamsync.checksum import digests
from streamsync.engines.base import Engine
from streamsync.errors import TransportError, ValidationError
from streamsync.models.synthetic import StateModule, perturb_
from streamsync.testing import faults
from streamsync.testing.faults import Rig
from streamsync.testing.receiver import ReceiverProcess
from streamsync.transports.collective import CollectiveReceiver, CollectiveTransport
from streamsync.transports.collective.group import BroadcastHandle, GroupInit

CHUNK = 1 << 20


def _gloo(**kw: Any) -> CollectiveTransport:
    return CollectiveTransport("gloo", group_timeout=20, **kw)


async def test_push_over_gloo_is_bit_exact_and_the_group_is_reused(qwen_receiver, qwen_model):
    engine = qwen_receiver.engine()
    transport = _gloo()
    sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK, timeout=30)
    report = await sync.push(qwen_model)
    assert report.chunks > 4
    assert await engine.checksums() == digests(qwen_model.state_dict().items())

    model = StateModule(qwen_model.specs(), fill="random", seed=3)
    perturb_(model, 1)
    report = await sync.push(model, max_inflight=1)  # same group, sequence numbers carry on
    assert report.version == 2 and await engine.get_version() == 2
    assert await engine.checksums() == digests(model.state_dict().items())
    assert transport.pool.buffers <= 4  # buffers came back to the pool and were reused
    await sync.close()


async def test_one_broadcast_reaches_every_engine(qwen_specs_path, qwen_model):
    with ReceiverProcess(str(qwen_specs_path), name="a", threads=1) as a, \
            ReceiverProcess(str(qwen_specs_path), name="b", threads=1) as b:
        engines = [a.engine(), b.engine()]
        sync = WeightSync(engines, transport=_gloo(), chunk_bytes=CHUNK, timeout=30)
        await sync.push(qwen_model)
        want = digests(qwen_model.state_dict().items())
        for e in engines:
            assert await e.checksums() == want
        await sync.close()


async def test_mixed_dtypes_survive_the_broadcast(receiver, mixed_model):
    engine = receiver.engine()
    sync = WeightSync([engine], transport=_gloo(), chunk_bytes=2048, timeout=30)
    await sync.push(mixed_model)
    assert await engine.checksums() == digests(mixed_model.state_dict().items())
    await sync.close()


class _Absent(Engine):
    """An engine that accepts init but never joins the group."""

    name = "absent"

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        pass

    async def start_update(self) -> None: ...
    async def update(self, update_info: dict[str, Any]) -> None: ...
    async def finish_update(self, version: int) -> None: ...
    async def get_version(self) -> int | None:
        return None


async def test_rendezvous_with_a_missing_worker_times_out_instead_of_hanging():
    transport = CollectiveTransport("gloo", group_timeout=2)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="rendezvous"):
        await transport.connect([_Absent()], timeout=2)
    assert time.monotonic() - t0 < 10
    await transport.close()


async def test_a_receiver_dying_mid_push_fails_the_push_and_the_group(qwen_specs_path, qwen_model):
    with ReceiverProcess(str(qwen_specs_path), name="slow", delay=0.3, threads=1) as rp:
        sync = WeightSync([rp.engine(timeout=20)], transport=_gloo(), chunk_bytes=CHUNK, timeout=20)
        await sync.connect()
        killer = threading.Timer(0.5, rp.kill)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(PushError, match=r"broadcast|connection lost|process exited"):
            await sync.push(qwen_model)
        killer.join()
        assert time.monotonic() - t0 < 20
        with pytest.raises(PushError):  # the group lost a rank: later pushes refuse at once
            await sync.push(qwen_model)
        await sync.close()


def test_receiver_refuses_malformed_init_info():
    base = {"transport": "collective", "backend": "gloo", "group": "g", "master_addr": "127.0.0.1",
            "master_port": 1, "world_size": 2, "rank_offset": 1, "workers": 1, "timeout_s": 1.0}
    for bad in ({"backend": "mpi"}, {"world_size": "2"}, {"rank_offset": 0}, {"rank_offset": 2},
                {"timeout_s": -1}, {"workers": 0}, {"group": ""}):
        with pytest.raises(ValidationError):
            CollectiveReceiver({**base, **bad})
    with pytest.raises(ValidationError, match="CUDA"):
        CollectiveReceiver({**base, "backend": "nccl"}, device="cpu")


def test_a_handle_whose_size_disagrees_with_its_layout_is_refused_before_the_receive_buffer_grows():
    rx = object.__new__(CollectiveReceiver)  # past the rendezvous: only the handle checks run here
    rx.group, rx._seq, rx._pg, rx._bufs, rx.backend = "g", 0, object(), [None, None], "gloo"
    with pytest.raises(ValidationError, match="its layout 4096"), rx.open(
            {"handle": {"group": "g", "seq": 0, "nbytes": 1 << 40}}, 4096):
        pass
    assert rx._bufs == [None, None] and rx._seq == 0


# ------------------------------------------------------------------------------- never hang (issue 10)
# The same scenarios run on NCCL between two GPUs in tests/test_collective_gpu.py.

GROUP_TIMEOUT = 3.0
CLOSE_BOUND = 10.0


@pytest.fixture
def rig(qwen_specs_path, qwen_specs):
    return Rig("gloo", StateModule(qwen_specs, fill="random", seed=11), str(qwen_specs_path),
               group_timeout=GROUP_TIMEOUT)


async def test_close_returns_promptly_while_receivers_live_and_a_new_group_can_be_made(rig):
    out = await faults.close_with_live_receivers(rig)
    assert out.exact_before and out.close_s < CLOSE_BOUND
    assert out.exact_after


async def test_close_returns_promptly_while_receivers_shut_down_at_the_same_time(rig):
    out = await faults.close_while_receivers_shut_down(rig)
    assert out.exact_before and out.close_s < CLOSE_BOUND


async def test_a_receiver_killed_mid_broadcast_fails_the_push_naming_it_and_the_transport_reconnects(rig):
    out = await faults.killed_receiver(rig)
    assert out.notes["fault_fired"] and out.error is not None
    assert out.error.stage == "send" and out.error.chunk is not None and out.error.receiver == "doomed"
    assert out.fail_s < GROUP_TIMEOUT + 5 and out.close_s < CLOSE_BOUND
    assert out.exact_after


async def test_a_receiver_frozen_mid_broadcast_fails_the_push_within_the_group_timeout(rig):
    out = await faults.frozen_receiver(rig)
    assert out.notes["fault_fired"] and out.error is not None
    assert out.error.stage == "send" and out.error.chunk is not None and out.error.receiver == "frozen"
    assert GROUP_TIMEOUT - 1 < out.fail_s < GROUP_TIMEOUT + 5
    assert out.close_s < CLOSE_BOUND  # while the receiver is still stopped
    assert out.exact_after


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as the kernel lists them) of TCP sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.append(local.rsplit(":", 1)[0])
    return found


async def test_the_rendezvous_store_listens_only_on_the_address_asked_for(receiver):
    transport = _gloo()
    sync = WeightSync([receiver.engine()], transport=transport, timeout=30)
    await sync.connect()
    assert _listening(transport._store.port) == ["0100007F"]  # 127.0.0.1 only; 0.0.0.0 would be 00000000
    await sync.close()


def test_a_handle_must_say_plainly_whether_it_is_device_ordered():
    rx = object.__new__(CollectiveReceiver)  # past the rendezvous: only the handle checks run here
    rx.group, rx._seq, rx._pg, rx._bufs, rx.backend = "g", 0, object(), [None, None], "gloo"
    with pytest.raises(ValidationError, match="device_ordered"), rx.open(
            {"handle": {"group": "g", "seq": 0, "nbytes": 64, "device_ordered": "yes"}}, 64):
        pass


class _StuckGroup:
    """A process group whose abort never returns (as a communicator whose kernel cannot be stopped). The one
    stand-in here: such a failure cannot be produced on purpose with a real group."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def abort(self) -> None:
        self.release.wait(60)


async def test_close_abandons_a_group_whose_abort_hangs_and_returns_within_its_bound():
    transport = CollectiveTransport("gloo", close_timeout=0.5)
    stuck = _StuckGroup()
    transport._pg = stuck
    ticks = 0

    async def tick() -> None:  # the event loop keeps running while close waits
        nonlocal ticks
        while True:
            await anyio.sleep(0.05)
            ticks += 1

    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        await transport.close()
        tg.cancel_scope.cancel()
    assert time.monotonic() - t0 < 2 and ticks >= 5
    assert transport._pg is None
    stuck.release.set()


async def test_auto_transport_per_engine_shared_memory_near_collective_far(qwen_specs_path, qwen_model):
    """transport="auto" with one engine on this host and one marked remote: one packed buffer per chunk goes to
    the near one as a shared-memory handle and to the far one by a gloo broadcast; both bit-exact."""
    from streamsync.transports.mixed import MixedTransport
    from streamsync.transports.shm import ShmTransport

    with ReceiverProcess(str(qwen_specs_path), name="near", threads=1) as a, \
            ReceiverProcess(str(qwen_specs_path), name="far", threads=1) as b:
        near, far = a.engine(), b.engine()
        far.remote, far.rendezvous_addr = True, "127.0.0.1"  # what a Ray engine on another node says of itself
        sync = WeightSync([near, far], chunk_bytes=CHUNK, timeout=30)
        report = await sync.push(qwen_model)
        assert isinstance(sync.transport, MixedTransport) and isinstance(sync.transport.local, ShmTransport)
        assert len([s for s in report.trace.spans if s.stage == "pack"]) == report.chunks  # packed once
        model = StateModule(qwen_model.specs(), fill="random", seed=3)
        perturb_(model, 2)
        await sync.push(model)  # the group and the segments are reused
        want = digests(model.state_dict().items())
        for e in (near, far):
            assert await e.checksums() == want and await e.get_version() == 2
        await sync.close()


async def test_auto_transport_refuses_a_remote_engine_without_a_rendezvous_address(qwen_receiver):
    engine = qwen_receiver.engine()
    engine.remote = True
    with pytest.raises(ValidationError, match="give no address"):
        await WeightSync([engine], timeout=30).connect()


def test_group_init_goes_over_the_wire_and_back_and_a_bad_field_is_refused_by_name():
    """The init info the collective and p2p senders write (`GroupInit.to_wire`) is what their receivers parse,
    and a malformed field is refused naming it before anything connects."""
    init = GroupInit("p2p", "gloo", "g", "127.0.0.1", 1234, 5, 3, 2, 30.0, trainer_ranks=3)
    wire = init.to_wire()
    assert "worker_rank" not in wire and GroupInit.parse(wire, "p2p") == init
    assert GroupInit.parse({**wire, "worker_rank": 1}, "p2p").rank() == 4
    with pytest.raises(ValidationError, match="worker rank 2 outside an engine of 2 workers"):
        GroupInit.parse({**wire, "worker_rank": 2}, "p2p").rank()
    with pytest.raises(ValidationError, match="p2p rank 5 outside a world of 5"):
        GroupInit.parse({**wire, "rank_offset": 4, "worker_rank": 1}, "p2p").rank()
    with pytest.raises(ValidationError, match="p2p init_info 'rank_offset' must be an int >= 3"):
        GroupInit.parse({**wire, "rank_offset": 1}, "p2p")  # a worker's rank among the senders'
    for key, bad in (("master_port", "80"), ("timeout_s", 0), ("group", ""), ("world_size", 1)):
        with pytest.raises(ValidationError, match=f"collective init_info '{key}'"):
            GroupInit.parse({**wire, key: bad}, "collective")
    with pytest.raises(ValidationError, match="backend must be one of"):
        GroupInit.parse({**wire, "backend": "mpi"}, "collective")


def test_a_broadcast_handle_is_checked_once_against_the_receivers_group_and_step():
    h = BroadcastHandle("g", 4, 1024, True)
    assert BroadcastHandle.parse(h.to_wire(), "g", 4) == h
    for wire, why in ((h.to_wire(), "out of step \\(expected 5\\)"), ({**h.to_wire(), "group": "x"}, "for group 'x'"),
                      ({**h.to_wire(), "nbytes": 0}, "size must be a positive int"),
                      ({**h.to_wire(), "device_ordered": 1}, "device_ordered must be a bool"),
                      ([4], "must be \\{group, seq, nbytes\\}")):
        with pytest.raises(ValidationError, match=why):
            BroadcastHandle.parse(wire, "g", 5 if why.startswith("out of step") else 4)
