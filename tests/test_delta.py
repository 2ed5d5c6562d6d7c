"""Delta pushes on real optimizer steps: a float32 tiny Qwen3 trained by AdamW, pushed in bf16 into receiver
processes over gloo (the collective transport) and shared memory; the receivers' checksums must equal the
served bf16 state bit for bit after every push."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from streamsync import PushError, WeightSync
from streamsync.checksum import digests
from streamsync.delta.auto import PROBE_EVERY
from streamsync.delta.codec import PIECES, decode_into, encode, sizes
from streamsync.delta.wsum import BLOCK
from streamsync.engines.receiver import ReceiverEngine
from streamsync.errors import PushTimeout
from streamsync.testing.faults import inject
from streamsync.testing.receiver import ReceiverProcess
from streamsync.testing.training import AdamTrainer
from streamsync.transports.collective import CollectiveTransport

BF16 = {"dtype": torch.bfloat16}


def _gloo() -> CollectiveTransport:
    return CollectiveTransport("gloo", group_timeout=30)


@pytest.fixture
def trainer(model_dir) -> AdamTrainer:
    return AdamTrainer(model_dir, lr=1e-5, seed=1)


@pytest.fixture
def specs(trainer, tmp_path) -> Path:
    return trainer.save_specs(tmp_path / "tiny.json")


async def _exact(engine: ReceiverEngine, trainer: AdamTrainer) -> bool:
    return await engine.checksums() == digests(trainer.served().items())


def _sync(engine, transport, **kw) -> WeightSync:
    return WeightSync([engine], transport=transport, chunk_bytes=1 << 20, timeout=60, source_options=BF16,
                      delta=kw.pop("delta", True), **kw)


@pytest.mark.parametrize("codec_n", [1, 255, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 200_003])
def test_every_encoding_round_trips_bit_for_bit(codec_n):
    gen = torch.Generator().manual_seed(codec_n)
    for dtype in (torch.bfloat16, torch.float32, torch.int8):
        base = torch.randint(-100, 100, (codec_n,), generator=gen).to(dtype)
        for density in (0.0, 1e-3, 0.03, 0.3, 1.0):
            new = base.clone()
            m = torch.rand(codec_n, generator=gen) < density
            new[m] = new[m] + 1
            if dtype.is_floating_point:
                new[:1] = -0.0 if base[0] == 0 else new[:1]  # -0.0 against +0.0 is a change of bits
            e = encode(new, base)
            out = base.clone()
            decode_into(out, e.enc, e.changed, dict(zip(PIECES[e.enc], e.pieces, strict=True)))
            assert torch.equal(out.view(torch.uint8), new.view(torch.uint8)), (dtype, density, e.enc)
            full = sizes(codec_n, 0, dtype.itemsize)["full"]
            assert e.nbytes <= full  # never larger than the tensor


async def test_delta_pushes_over_gloo_stay_bit_exact_after_real_adam_steps(trainer, specs):
    with ReceiverProcess(str(specs), name="rx-delta", threads=1) as rp:
        engine = rp.engine()
        sync = _sync(engine, _gloo())
        reports = []
        for i in range(5):
            if i:
                trainer.step()
            reports.append(await sync.push(trainer.model))
            assert await _exact(engine, trainer), f"push {i} is not bit-exact"
        assert [r.delta.mode for r in reports] == ["full"] + ["delta"] * 4
        assert reports[0].delta.why_full == "first push"
        full = reports[0].bytes
        for r in reports[1:]:
            assert 0 < r.delta.changed_fraction < 0.2  # Adam at 1e-5 moves few bf16 values per step
            assert r.delta.wire_bytes < 0.25 * full
            assert r.delta.base == (r.version - 1, reports[r.version - 2].push_id)
        served = sum(t.numel() * t.element_size() for t in trainer.served().values())
        # the sender's copy: the served model once, each tensor rounded up to whole blocks of 65,536 elements,
        # on the host for a CPU trainer
        blocks = sum(-(-t.numel() // BLOCK) * BLOCK * t.element_size() for t in trainer.served().values())
        assert reports[-1].delta.shadow_bytes == blocks and reports[-1].delta.shadow_where == "host"
        status = await engine.call("delta_base")
        assert status["held"] == [reports[-1].version, reports[-1].push_id]
        # a plain module holds every tensor as sent: each is its own base, decoded into in place, no copy kept
        assert status["bytes"] == 0 and status["in_place_bytes"] == served
        await sync.close()


async def test_delta_pushes_over_shared_memory_stay_bit_exact(trainer, specs):
    with ReceiverProcess(str(specs), name="rx-delta-shm", threads=1) as rp:
        engine = rp.engine()
        sync = _sync(engine, "shm")
        modes = []
        for i in range(4):
            if i:
                trainer.step()
            modes.append((await sync.push(trainer.model)).delta.mode)
            assert await _exact(engine, trainer)
        assert modes == ["full", "delta", "delta", "delta"]
        await sync.close()


async def test_auto_pushes_deltas_through_the_collective_and_not_through_shared_memory(trainer, specs):
    with ReceiverProcess(str(specs), name="rx-auto", threads=1) as rp:
        for transport, on in ((_gloo(), True), ("shm", False)):
            sync = _sync(rp.engine(), transport, delta="auto")
            await sync.push(trainer.model)
            trainer.step()
            report = await sync.push(trainer.model)
            assert sync.delta_on is on
            assert (report.delta is not None and report.delta.mode == "delta") is on
            assert await _exact(sync.engines[0], trainer)
            await sync.close()


async def test_auto_on_a_link_goes_full_while_its_last_delta_was_slower_and_tries_one_again_later(trainer, specs):
    """delta="auto" decides from this sync's measured pushes: a delta is tried once a full push was measured; a
    push goes full while the last delta took longer than the last full push (here made so), with the reason in
    the report; after PROBE_EVERY such pushes a delta is tried again."""
    with ReceiverProcess(str(specs), name="rx-auto-cost", threads=1) as rp:
        engine = rp.engine()
        sync = _sync(engine, _gloo(), delta="auto")
        assert (await sync.push(trainer.model)).delta.why_full == "first push"
        trainer.step()
        probe = (await sync.push(trainer.model)).delta
        assert probe.mode == "delta" and probe.auto.startswith("auto: no delta measured yet")
        assert sync.auto.delta_s is not None and sync.auto.full_s is not None
        sync.auto.delta_s = 10 * sync.auto.full_s  # the link made the delta slower than a full push
        modes = []
        for _ in range(PROBE_EVERY + 1):
            trainer.step()
            d = (await sync.push(trainer.model)).delta
            modes.append(d.mode)
            if d.mode == "full":
                assert d.why_full == d.auto and "the last delta took" in d.auto and "tried again after" in d.auto
                assert "changed" in d.auto and "GB/s" in d.auto and "encoding and decoding" in d.auto
            assert await _exact(engine, trainer)
        assert modes == ["full"] * PROBE_EVERY + ["delta"]
        assert "trying a delta again" in d.auto
        assert sync.shadow.nbytes > 0
        await sync.close()
        assert sync.shadow.nbytes == 0  # a closed sync keeps no copy of the model


async def test_a_full_push_every_k_pushes(trainer, specs):
    with ReceiverProcess(str(specs), name="rx-k", threads=1) as rp:
        engine = rp.engine()
        sync = _sync(engine, "shm", full_every=3)
        modes = []
        for i in range(7):
            if i:
                trainer.step()
            r = await sync.push(trainer.model)
            modes.append(r.delta.mode)
            assert await _exact(engine, trainer)
        assert modes == ["full", "delta", "delta", "full", "delta", "delta", "full"]
        await sync.close()


def _changed_element(trainer: AdamTrainer, before: dict[str, torch.Tensor]) -> tuple[str, int]:
    """A tensor and position whose bf16 value the last step changed."""
    for name, t in trainer.served().items():
        diff = (t.view(torch.int16) != before[name].view(torch.int16)).reshape(-1).nonzero()
        if diff.numel():
            return name, int(diff[0])
    raise AssertionError("the step changed nothing")


async def test_a_tensor_that_does_not_match_its_digest_is_refused_and_pushed_in_full(trainer, specs):
    """The sender's shadow is corrupted where the step changed a value: its delta misses that change, the
    receiver's tensor then differs from the sender's digest, it refuses, and the sync pushes the same version in
    full (the gloo group the failure broke is made anew); the next push is a delta again."""
    with ReceiverProcess(str(specs), name="rx-digest", threads=1) as rp:
        engine = rp.engine()
        sync = _sync(engine, _gloo())
        await sync.push(trainer.model)
        before = trainer.served()
        trainer.step()
        name, pos = _changed_element(trainer, before)
        sync.shadow.tensors[name].view(-1)[pos] = trainer.served()[name].view(-1)[pos]
        report = await sync.push(trainer.model)
        assert report.delta.fallback and report.delta.mode == "full"
        assert "does not match the sender's digest" in report.delta.why_full and name in report.delta.why_full
        assert report.version == 2 and await engine.get_version() == 2 and not sync.mixed
        assert await _exact(engine, trainer)
        trainer.step()
        assert (await sync.push(trainer.model)).delta.mode == "delta"
        assert await _exact(engine, trainer)
        await sync.close()


class _Raced(ReceiverEngine):
    """A receiver whose base changes between the sync's check and its push: another sync's push lands in
    between (run by `between`); the answer it gives was true when it was read."""

    between = None

    async def delta_base(self):
        held = await super().delta_base()
        if self.between is not None:
            between, self.between = self.between, None
            await between()
        return held


async def test_a_delta_onto_another_base_is_refused_by_the_engine_and_pushed_in_full(trainer, specs, model_dir):
    with ReceiverProcess(str(specs), name="rx-base", threads=1) as rp:
        engine = _Raced(rp.host, rp.port, secret=rp.secret, name="raced", timeout=60)
        sync = _sync(engine, "shm")
        await sync.push(trainer.model, version=1)
        other = AdamTrainer(model_dir, lr=1e-3, seed=2)
        other.step()

        async def another_sync_pushes() -> None:
            plain = WeightSync([rp.engine()], transport="shm", chunk_bytes=1 << 20, source_options=BF16)
            await plain.push(other.model, version=10)  # a sync without deltas: the receiver drops its base
            await plain.close()

        engine.between = another_sync_pushes
        trainer.step()
        report = await sync.push(trainer.model, version=2)
        assert report.delta.fallback and "applies onto version 1" in report.delta.why_full
        assert await engine.get_version() == 2 and await _exact(engine, trainer)
        trainer.step()
        assert (await sync.push(trainer.model)).delta.mode == "delta"
        assert await _exact(engine, trainer)
        await sync.close()


async def test_an_engine_without_the_base_gets_a_full_push_without_a_refusal(trainer, specs, model_dir):
    with ReceiverProcess(str(specs), name="rx-nobase", threads=1) as rp:
        engine = rp.engine()
        sync = _sync(engine, "shm")
        await sync.push(trainer.model, version=1)
        plain = WeightSync([rp.engine()], transport="shm", chunk_bytes=1 << 20, source_options=BF16)
        await plain.push(AdamTrainer(model_dir, lr=1e-3, seed=3).model, version=5)
        await plain.close()
        trainer.step()
        report = await sync.push(trainer.model, version=6)
        assert report.delta.mode == "full" and not report.delta.fallback
        assert "do not hold version 1" in report.delta.why_full
        assert await _exact(engine, trainer)
        await sync.close()


async def test_a_failed_delta_push_leaves_the_engine_mixed_and_the_next_push_is_full(trainer, specs):
    with ReceiverProcess(str(specs), name="rx-fail", threads=1) as rp:
        engine = rp.engine()
        sync = _sync(engine, _gloo())
        await sync.push(trainer.model)
        trainer.step()
        faults = inject(sync, {"send": 1})  # chunk 0 reached the engine, chunk 1 fails
        with pytest.raises(PushError, match="fault injected in send of chunk 1"):
            await sync.push(trainer.model)
        state = await engine.state()
        assert state.mixed and state.version is None and sync.mixed == {engine.name: 2}
        faults.clear()
        await sync.close()  # the failed broadcast lost the group's sequence: connect again
        report = await sync.push(trainer.model)
        assert report.delta.mode == "full" and report.version == 2
        assert not (await engine.state()).mixed and await _exact(engine, trainer)
        trainer.step()
        assert (await sync.push(trainer.model)).delta.mode == "delta" and await _exact(engine, trainer)
        await sync.close()


async def test_a_worker_killed_mid_apply_leaves_its_engine_mixed_and_the_next_push_full(trainer, specs):
    """An engine of two receiving processes (`WorkerGroup`, a rank each in the gloo group) takes a delta push; one
    worker is killed (SIGKILL) while it applies a chunk. The push fails within its timeout naming the engine, the
    sync holds the engine mixed, the surviving worker claims no version, and once the dead worker is back (a fresh
    process, nothing held) the same sync pushes in full, bit for bit on both, and deltas again after that."""
    from streamsync.testing.sliced import WorkerGroup

    with ReceiverProcess(str(specs), name="w0", threads=1) as w0, \
            ReceiverProcess(str(specs), name="w1", threads=1, delay=0.3) as w1:
        group = WorkerGroup([w0.engine(timeout=20), w1.engine(timeout=20)], name="two")
        sync = WeightSync([group], transport=_gloo(), chunk_bytes=1 << 20, timeout=20, source_options=BF16, delta=True)
        assert (await sync.push(trainer.model)).delta.mode == "full"
        trainer.step()

        async def kill_mid_apply() -> None:
            await anyio.sleep(0.45)  # worker 1 is inside a chunk's update (0.3 s each)
            w1.kill()

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_mid_apply)
            with anyio.fail_after(120), pytest.raises(PushError, match="'two'"):
                await sync.push(trainer.model)
        # The engine owed that chunk's answer: it is not asked to abort (that would hold the error back by another
        # timeout) and keeps the round open; the surviving worker claims no version, old or new.
        assert sync.mixed == {"two": 2} and "two" in sync.open_rounds
        survivor = await group.members[0].state()
        assert survivor.version is None and (survivor.mixed or survivor.updating), survivor

        with ReceiverProcess(str(specs), name="w1b", threads=1) as back:
            group.members[1] = back.engine(timeout=20)
            await sync.close()  # the broadcast group lost a rank: connect again
            report = await sync.push(trainer.model)
            assert report.delta.mode == "full", report.delta  # (connecting again forgot the base in any case)
            want = digests(trainer.served().items())
            assert [await m.checksums() for m in group.members] == [want, want]
            assert not (await group.state()).mixed
            trainer.step()
            assert (await sync.push(trainer.model)).delta.mode == "delta"
            want = digests(trainer.served().items())
            assert [await m.checksums() for m in group.members] == [want, want]
            await sync.close()


async def test_a_cancelled_delta_push_leaves_the_engine_mixed_and_the_next_push_is_full(trainer, specs):
    with ReceiverProcess(str(specs), name="rx-cancel", threads=1, delay=0.4) as rp:
        engine = rp.engine()
        sync = _sync(engine, "shm")
        await sync.push(trainer.model)
        trainer.step()
        with pytest.raises(PushTimeout):
            await sync.push(trainer.model, time_limit=1.0)
        assert (await engine.state()).mixed and engine.name in sync.mixed
        report = await sync.push(trainer.model)
        assert report.delta.mode == "full" and "mixed" in report.delta.why_full
        assert not (await engine.state()).mixed and await _exact(engine, trainer)
        await sync.close()


async def test_delta_options_are_checked():
    from streamsync import ValidationError

    with pytest.raises(ValidationError, match="delta must be"):
        WeightSync([], delta="sometimes")
    with pytest.raises(ValidationError, match="full_every"):
        WeightSync([], delta=True, full_every=-1)
    with pytest.raises(ValidationError, match="shadow_device_bytes"):
        WeightSync([], delta=True, shadow_device_bytes=-1)
    with pytest.raises(ValidationError, match="engine_base must be 'auto' or 'host'"):
        WeightSync([], delta=True, engine_base="gpu")
    await anyio.sleep(0)
