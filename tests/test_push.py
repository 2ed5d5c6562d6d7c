"""WeightSync.push into a receiver in another process, over shared memory: the core contracts."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import anyio
import pytest
import torch

from streamsync import EngineError, PushError, ValidationError, WeightSync
from streamsync.checksum import digests
from streamsync.models.synthetic import StateModule, perturb_
from streamsync.testing.faults import inject
from streamsync.testing.receiver import ReceiverProcess
from streamsync.trace import STAGES

CHUNK = 1 << 20  # 1 MiB chunks: the ~17 MB test model becomes ~20 chunks


async def test_mixed_dtypes_and_odd_shapes_arrive_bit_exact(receiver, mixed_model):
    engine = receiver.engine()
    sync = WeightSync([engine], chunk_bytes=2048)
    report = await sync.push(mixed_model, version=7)
    assert report.chunks > 1
    assert await engine.checksums() == digests(mixed_model.state_dict().items())
    assert await engine.get_version() == 7
    assert report.bytes > 0 and set(report.stage_seconds) == set(STAGES)
    await sync.close()


async def test_a_second_push_carries_the_new_weights(qwen_receiver, qwen_model):
    engine = qwen_receiver.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    await sync.push(qwen_model)
    model = StateModule(qwen_model.specs(), fill="random", seed=3)
    perturb_(model, 1)
    report = await sync.push(model)
    assert report.version == 2 and await engine.get_version() == 2
    assert await engine.checksums() == digests(model.state_dict().items())
    await sync.close()


async def test_a_push_gives_the_interpreter_its_switch_interval_back(qwen_receiver, qwen_model):
    """A push lowers the GIL switch interval while it runs (streamsync.pipeline.threads) and restores the
    application's own after it, succeeded or failed; a value the application set meanwhile is kept."""
    before = sys.getswitchinterval()
    sync = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK)
    await sync.push(qwen_model)
    assert sys.getswitchinterval() == before
    with pytest.raises(PushError):
        await sync.push(qwen_model, time_limit=1e-6)
    assert sys.getswitchinterval() == before
    try:
        sys.setswitchinterval(0.002)
        await sync.push(qwen_model)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)
    await sync.close()


@pytest.mark.parametrize("window", [1, 2, 4])
async def test_spans_never_show_more_chunks_alive_than_the_window(qwen_receiver, qwen_model, window):
    sync = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK, max_inflight=window)
    report = await sync.push(qwen_model)
    assert report.chunks > 2 * window
    assert report.trace.max_alive() <= window
    assert report.max_chunks_alive <= window
    assert report.peak_bytes_inflight <= window * max(p.nbytes for p in sync.plan(qwen_model)[1])
    await sync.close()


def _cross_stage_overlaps(spans) -> int:
    n = 0
    for a in spans:
        for b in spans:
            if a.stage < b.stage and a.start < b.end and b.start < a.end:
                n += 1
    return n


async def test_window_4_overlaps_stages_window_1_does_not(qwen_receiver, qwen_model):
    sync = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK)
    serial = await sync.push(qwen_model, max_inflight=1)
    piped = await sync.push(qwen_model, max_inflight=4)
    assert _cross_stage_overlaps(serial.trace.spans) == 0
    assert _cross_stage_overlaps(piped.trace.spans) > 0
    # the overlap that matters: packing a chunk while the receiver loads another
    packs = [s for s in piped.trace.spans if s.stage == "pack"]
    sends = [s for s in piped.trace.spans if s.stage == "send"]
    assert any(p.start < s.end and s.start < p.end for p in packs for s in sends)
    await sync.close()


@pytest.mark.parametrize("stage", STAGES)
async def test_a_failure_in_any_stage_raises_push_error_naming_it_and_frees_everything(
        qwen_receiver, qwen_model, stage, memfds):
    shm_before = set(os.listdir("/dev/shm"))
    engine = qwen_receiver.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    inject(sync, {stage: 3})
    with pytest.raises(PushError) as err:
        await sync.push(qwen_model, version=5)
    assert err.value.stage == stage and err.value.chunk == 3
    assert f"stage={stage}" in str(err.value) and "chunk=3" in str(err.value)
    assert sync.transport is not None and sync.transport.pool.busy == 0  # no chunk buffer outlives the push
    await sync.close()
    assert memfds() == 0  # every segment closed
    assert set(os.listdir("/dev/shm")) <= shm_before
    assert await engine.get_version() is None  # the failed round never claimed the version
    await engine.close()


async def test_receiver_error_names_the_receiver_and_chunk(qwen_specs, qwen_receiver, tmp_path):
    # The trainer has a layer the receiver lacks: found up front, before any byte moves.
    extra = StateModule([*qwen_specs, ("model.layers.0.extra.weight", "bfloat16", (4,))], fill="random")
    sync = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK)
    with pytest.raises(ValidationError, match=r"unknown parameter 'model\.layers\.0\.extra\.weight'"):
        await sync.push(extra)
    await sync.close()


async def test_connect_with_the_model_plans_its_push_and_refuses_a_model_that_does_not_fit(qwen_specs, qwen_receiver,
                                                                                              qwen_model):
    engine = qwen_receiver.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK, strict_dtypes=True)
    wrong = [(n, "float32" if n.endswith("q_norm.weight") else d, s) for n, d, s in qwen_specs]
    with pytest.raises(ValidationError, match=r"q_norm.weight.*float32.*engine holds bfloat16"):
        await sync.connect(StateModule(wrong))
    assert sync.connected and (await engine.call("status"))["dirty"] is False  # connected; nothing applied
    await sync.connect(qwen_model)  # connected already: plans the model
    planned = sync.plan(qwen_model)
    # ... and converted every chunk once, checked against the plan (a GPU source's views are then reused)
    assert sorted(sync._checked) == [p.index for p in planned[1]]
    assert all(sync._checked[p.index][0] is p for p in planned[1])
    report = await sync.push(qwen_model)
    assert sync.plan(qwen_model)[1] is planned[1] and report.chunks == len(planned[1])  # the push used that plan
    assert await engine.checksums() == digests(qwen_model.state_dict().items())
    await sync.close()


async def test_shape_dtype_and_missing_parameters_are_refused_before_bytes_move(qwen_specs, qwen_receiver):
    engine = qwen_receiver.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK, strict_dtypes=True)
    wrong = [(n, "float32" if n.endswith("q_norm.weight") else d, s) for n, d, s in qwen_specs]
    with pytest.raises(ValidationError, match=r"q_norm.weight.*float32.*engine holds bfloat16"):
        await sync.push(StateModule(wrong))
    with pytest.raises(ValidationError, match="missing from the push"):
        await sync.push(StateModule(qwen_specs[:-1]))
    assert (await engine.call("status"))["dirty"] is False  # nothing was applied
    await sync.close()


async def test_an_fp32_trainer_is_cast_to_the_engines_bf16_as_vllms_loaders_cast_said_once(qwen_specs, qwen_receiver):
    """Most RL trainers hold float32 weights; the engine holds bfloat16: every floating tensor is cast as it is
    packed (the bits `tensor.to(bfloat16)` makes), the log says so once, each report counts the casts."""
    import structlog

    engine = qwen_receiver.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    fp32 = StateModule([(n, "float32", s) for n, _, s in qwen_specs], fill="random", seed=3)
    with structlog.testing.capture_logs() as logs:
        first = await sync.push(fp32)
        fp32.load_state_dict({n: t * 1.5 for n, t in fp32.state_dict().items()})
        second = await sync.push(fp32)
    cast = {n: t.to(torch.bfloat16) for n, t in fp32.state_dict().items()}
    assert await engine.checksums() == digests(cast.items())
    assert first.casts == second.casts == {"float32 -> bfloat16": len(qwen_specs)}
    assert [e["event"] for e in logs if e["log_level"] == "warning"].count(
        "casting the trainer's tensors to the engines' dtype, as vLLM's loaders cast a checkpoint") == 1
    await sync.close()


async def test_a_receiver_killed_mid_push_ends_the_push_within_its_timeout(qwen_specs_path, qwen_model, memfds):
    with ReceiverProcess(str(qwen_specs_path), delay=0.2, name="doomed") as rp:
        killed: list[int] = []

        def kill(_):  # a real crash, mid-push: once the first chunk has landed
            if not killed:
                killed.append(rp.pid)
                os.kill(rp.pid, signal.SIGKILL)

        sync = WeightSync([rp.engine(timeout=10)], chunk_bytes=CHUNK, timeout=10, on_chunk=kill)
        await sync.connect()
        t0 = time.monotonic()
        with pytest.raises(PushError) as err:
            await sync.push(qwen_model)
        assert killed and time.monotonic() - t0 < 10
        assert err.value.stage == "send" and err.value.receiver == "doomed"
        assert "died" in str(err.value)
        await sync.close()
    assert memfds() == 0


async def test_a_frozen_receiver_times_out_instead_of_hanging(qwen_specs_path, qwen_model):
    with ReceiverProcess(str(qwen_specs_path), name="frozen") as rp:
        sync = WeightSync([rp.engine(timeout=2)], chunk_bytes=CHUNK, timeout=2)
        await sync.connect()
        os.kill(rp.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(PushError, match=r"no reply in 2\.0 s") as err:
                await sync.push(qwen_model)
            assert time.monotonic() - t0 < 2 + sync.abort_timeout + 1  # not twice the timeout
            assert err.value.receiver == "frozen"
        finally:
            os.kill(rp.pid, signal.SIGCONT)
        await sync.close()


async def test_fan_out_to_two_receivers_packs_once(qwen_specs_path, qwen_model):
    with ReceiverProcess(str(qwen_specs_path), name="a") as a, ReceiverProcess(str(qwen_specs_path), name="b") as b:
        ea, eb = a.engine(), b.engine()
        sync = WeightSync([ea, eb], chunk_bytes=CHUNK)
        report = await sync.push(qwen_model)
        want = digests(qwen_model.state_dict().items())
        assert await ea.checksums() == want and await eb.checksums() == want
        assert len([s for s in report.trace.spans if s.stage == "pack"]) == report.chunks
        await sync.close()


async def test_trace_file_is_chrome_trace_json(qwen_receiver, qwen_model, tmp_path):
    import json

    sync = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK, trace_dir=tmp_path)
    report = await sync.push(qwen_model)
    data = json.loads(Path(report.trace_path).read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X" and e["args"]["receiver"] is None]
    assert len(spans) == report.chunks * len(STAGES)  # and one send span per engine besides (test_viewer.py)
    assert {e["args"]["stage"] for e in spans} == set(STAGES)
    assert any(e["ph"] == "C" and e["name"] == "chunks_alive" for e in data["traceEvents"])
    await sync.close()


async def test_bad_configuration_is_refused_clearly():
    with pytest.raises(ValidationError, match="max_inflight"):
        WeightSync([], max_inflight=0)
    with pytest.raises(ValidationError, match="unknown transport 'carrier-pigeon'"):
        await WeightSync([], transport="carrier-pigeon").connect()
    with pytest.raises(TypeError, match="cannot push a str"):
        await WeightSync([]).push("model")


async def test_unreachable_engine_is_an_engine_error():
    from streamsync.engines.receiver import ReceiverEngine
    from streamsync.receiver.protocol import new_secret

    with pytest.raises(EngineError, match="cannot connect"):
        await ReceiverEngine("127.0.0.1", 1, secret=new_secret(), name="nobody").get_version()


def test_meta_tensors_are_refused_before_anything_moves():
    from streamsync.sources import ModuleSource

    with pytest.raises(ValidationError, match="meta device"):
        ModuleSource(torch.nn.Linear(2, 2, device="meta"))


async def test_the_plan_is_reused_and_replaced_parameter_data_is_still_seen(qwen_receiver, qwen_specs):
    engine = qwen_receiver.engine()
    model = StateModule(qwen_specs, fill="random", seed=11)
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    await sync.push(model)
    source, plans = sync.plan(model)
    param = next(iter(model.parameters()))
    param.data = torch.randn(param.shape).to(param.dtype)  # a new storage behind the same Parameter
    report = await sync.push(model)
    assert sync.plan(model)[0] is source  # planned once, reused
    assert report.chunks == len(plans)
    assert await engine.checksums() == digests(model.state_dict().items())
    sync.forget()
    assert sync.plan(model)[0] is not source
    sync.chunk_bytes = CHUNK // 4  # a new budget plans again
    report = await sync.push(model)
    assert report.chunks > len(plans) and len(sync.plan(model)[1]) == report.chunks
    assert await engine.checksums() == digests(model.state_dict().items())
    await sync.close()


async def test_a_failed_push_ends_the_round_on_the_engine_and_the_next_push_works(qwen_receiver, qwen_model):
    engine = qwen_receiver.engine()
    failing = WeightSync([engine], chunk_bytes=CHUNK)
    inject(failing, {"pack": 4})
    with pytest.raises(PushError):
        await failing.push(qwen_model, version=3)
    status = await engine.call("status")
    assert status["updating"] is False and status["dirty"] is True and status["version"] is None
    await failing.close()
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    await sync.push(qwen_model, version=4)
    assert await engine.get_version() == 4
    assert await engine.checksums() == digests(qwen_model.state_dict().items())
    await sync.close()


def test_shm_handles_must_name_a_streamsync_segment():
    from streamsync.errors import TransportError
    from streamsync.transports.shm import ShmReceiver

    rx = ShmReceiver({"transport": "shm"})
    with open(__file__) as f:  # an open file of this process that is not a segment
        bad = {"handle": {"pid": os.getpid(), "fd": f.fileno(), "token": "abcd", "nbytes": 10}}
        with pytest.raises(ValidationError, match="not the streamsync segment"), rx.open(bad):
            pass
    for h in ({"pid": 1, "fd": 3, "token": "ab", "nbytes": 0}, {"pid": 1, "fd": 3, "token": "../x", "nbytes": 8},
              {"pid": "x"}, None):
        with pytest.raises(ValidationError), rx.open({"handle": h}):
            pass
    with pytest.raises(TransportError, match="gone"), rx.open(
            {"handle": {"pid": os.getpid(), "fd": 999_999, "token": "ab", "nbytes": 8}}):
        pass


def test_a_malformed_message_does_not_kill_the_receiver(qwen_receiver):
    import json as _json

    with qwen_receiver.raw_socket() as s:
        s.sendall(b"[1]\n")
        reply = _json.loads(s.makefile().readline())
        assert reply["ok"] is False and "JSON object" in reply["error"]
        s.sendall(b'{"op": "ping"}\n')
        assert _json.loads(s.makefile().readline())["result"] == "pong"


async def test_layouts_go_by_key_once_known_and_are_resent_when_the_receiver_lacks_them(qwen_receiver, qwen_model):
    from streamsync.transports.shm import ShmTransport

    engine = qwen_receiver.engine()
    # Packed: the plan's layouts are what goes (one copy sends each chunk's packed part's own layout instead).
    sync = WeightSync([engine], chunk_bytes=CHUNK, transport=ShmTransport(one_copy=False))
    plans = sync.plan(qwen_model)[1]
    # The client believes the receiver knows every layout; it does not (a cache it cleared, say).
    engine._known.update((p.layout_key, True) for p in plans)
    sent: list[bool] = []
    call = engine.call

    async def spy(op, timeout=None, **kw):
        if op == "update":
            sent.append("layout" in kw["info"])
        return await call(op, timeout, **kw)

    engine.call = spy
    await sync.push(qwen_model)
    assert await engine.checksums() == digests(qwen_model.state_dict().items())
    assert sent == [False, True] * len(plans)  # refused by key, then resent with the layout
    sent.clear()
    model = StateModule(qwen_model.specs(), fill="random", seed=5)
    await sync.push(model)  # now it knows them: keys only
    assert sent == [False] * len(plans)
    assert await engine.checksums() == digests(model.state_dict().items())
    await sync.close()


async def test_a_stage_stuck_on_one_chunk_fails_the_push_naming_stage_and_chunk(qwen_receiver, qwen_model):
    from streamsync.sources import ModuleSource

    class Stuck(ModuleSource):
        async def convert(self, chunk, gathered, *, cast=True):
            if chunk.index == 2:
                await anyio.sleep(60)
            return await super().convert(chunk, gathered, cast=cast)

    sync = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(PushError, match=r"timed out after 1\.0s") as err:
        await sync.push(Stuck(qwen_model))
    assert time.monotonic() - t0 < 3
    assert (err.value.stage, err.value.chunk) == ("convert", 2)
    await sync.push(qwen_model)  # the engine's round was aborted; the next push works
    await sync.close()


async def test_an_engine_that_cannot_open_its_round_fails_the_push_before_any_chunk_is_sent(
        qwen_receiver, qwen_model, memfds):
    # start_update runs alongside the first gathers and packs; no chunk may reach an engine before it ended.
    engine = qwen_receiver.engine()
    sent: list[int] = []

    async def refuse() -> None:
        await anyio.sleep(0.2)  # long enough for the first chunks to be packed meanwhile
        raise RuntimeError("engine is shutting down")

    async def update(info):
        sent.append(info["chunk"])

    engine.start_update, engine.update = refuse, update
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    with pytest.raises(PushError, match="shutting down") as err:
        await sync.push(qwen_model)
    assert err.value.stage == "start" and sent == []
    assert sync.transport.pool.busy == 0
    await sync.close()
    assert memfds() == 0


async def test_a_slow_round_opening_is_not_charged_to_the_first_send(qwen_receiver, qwen_model):
    # start_update (0.7 s) and the first update (0.5 s) are each within the 1 s timeout; together they are not.
    engine = qwen_receiver.engine()
    start, update = engine.start_update, engine.update
    first = [True]

    async def slow_start() -> None:
        await anyio.sleep(0.7)
        await start()

    async def slow_first_update(info):
        if first[0]:
            first[0] = False
            await anyio.sleep(0.5)
        await update(info)

    engine.start_update, engine.update = slow_start, slow_first_update
    sync = WeightSync([engine], chunk_bytes=CHUNK, timeout=1.0)
    await sync.push(qwen_model)
    assert await engine.checksums() == digests(qwen_model.state_dict().items())
    await sync.close()


async def test_a_pipeline_failure_lets_the_round_opening_finish_before_the_abort(qwen_receiver, qwen_model):
    engine = qwen_receiver.engine()
    calls: list[str] = []
    start, abort = engine.start_update, engine.abort_update

    async def slow_start() -> None:
        calls.append("start")
        await anyio.sleep(0.5)
        await start()
        calls.append("started")

    async def logged_abort(version: int | None = None) -> None:
        calls.append("abort")
        await abort(version)

    engine.start_update, engine.abort_update = slow_start, logged_abort
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    inject(sync, {"convert": 0})
    with pytest.raises(PushError) as err:
        await sync.push(qwen_model)
    assert err.value.stage == "convert" and calls == ["start", "started", "abort"]
    await sync.close()


async def test_a_tied_receivers_output_layer_computes_with_the_pushed_embedding(tmp_path):
    """A tied model sends its embedding once; the receiver's head is that Parameter (vLLM's tie_weights), so
    what its output matmul multiplies by is the new embedding after every push."""
    from streamsync.models.synthetic import qwen3_specs, save_specs

    specs = qwen3_specs(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, tie=True)
    assert not any(name == "lm_head.weight" for name, _, _ in specs)
    with ReceiverProcess(str(save_specs(specs, tmp_path / "tied.json")), fused=True, tie=True) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], chunk_bytes=64 << 10)
        model = StateModule(specs, fill="random", seed=5)
        for step in (1, 2):
            perturb_(model, step)
            await sync.push(model)
            got = await engine.checksums()
            embed = digests([("w", model.state_dict()["model.embed_tokens.weight"])])["w"]
            assert got["lm_head.weight"] == embed == got["model.embed_tokens.weight"]
        await sync.close()


async def test_non_finite_weights_are_refused_naming_them_before_any_byte_moves(qwen_receiver, qwen_model):
    engine = qwen_receiver.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    await sync.push(qwen_model)
    before = await engine.checksums()
    bad = StateModule(qwen_model.specs(), fill="random", seed=9)
    names = [n for n, t in bad.state_dict().items() if t.is_floating_point()]
    with torch.no_grad():
        bad.state_dict()[names[3]].view(-1)[7] = float("nan")
        bad.state_dict()[names[-1]].view(-1)[0] = float("-inf")
    with pytest.raises(ValidationError, match="non-finite") as err:
        await sync.push(bad)
    assert names[3] in str(err.value) and names[-1] in str(err.value)
    assert await engine.checksums() == before and (await engine.state()).mixed is False
    await sync.close()


async def test_a_parameter_replaced_between_pushes_is_checked_and_sent_from_its_new_storage(qwen_receiver,
                                                                                           qwen_model):
    # The sources keep their detached tensors and gathered chunks between pushes, and the finite check what it
    # worked out per tensor set; a `param.data = ...` (a new storage) must be seen by all three.
    engine = qwen_receiver.engine()
    model = StateModule(qwen_model.specs(), fill="random", seed=11)
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    await sync.push(model)
    await sync.push(model)  # every cache made
    before = await engine.checksums()
    name, param = next((n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.numel() > 8)
    bad = param.detach().clone()
    bad.view(-1)[5] = float("nan")
    param.data = bad
    with pytest.raises(ValidationError, match="non-finite") as err:
        await sync.push(model)
    assert name in str(err.value) and await engine.checksums() == before
    param.data = bad.nan_to_num(0.0) + 1  # another storage, new values
    await sync.push(model)
    got = await engine.checksums()
    assert got == digests(list(model.state_dict().items())) and got[name] != before[name]
    await sync.close()


class _NoCopy:
    """A transport that moves nothing (the order of the stages is under test, not bytes)."""

    @staticmethod
    def make() -> object:
        from streamsync.transports.base import SendBuffer, Transport

        class NoCopy(Transport):
            name, reaches = "nocopy", "cpu"

            def allocate(self, chunk, tensors):  # type: ignore[no-untyped-def]
                return SendBuffer(chunk.index, chunk.nbytes, torch.empty(0, dtype=torch.uint8), {})

            async def pack(self, buf, layout, tensors) -> None:  # type: ignore[no-untyped-def]
                pass

            def free(self, buf) -> None:  # type: ignore[no-untyped-def]
                pass

        return NoCopy()


@pytest.mark.parametrize(("signals", "slow_start"), [(True, False), (False, False), (True, True)])
async def test_on_a_gpu_a_chunk_is_gathered_once_the_requests_of_the_one_before_left(monkeypatch, signals,
                                                                                     slow_start):
    """A source gathering its own tensors on a GPU: gather, convert and pack run in turn, one chunk at a time, and
    chunk i+1 starts only once chunk i's request left for the engine (`DISPATCHED`), but before the engine
    answered it (its load overlaps the next pack). An engine that does not signal counts as dispatched when its
    update is called. While the engines still open their round (`start_update`), the next chunk is gathered: the
    first one cannot leave before the round is open anyway."""
    from streamsync.engines.base import DISPATCHED, Engine
    from streamsync.sources.module import ModuleSource

    monkeypatch.setattr(ModuleSource, "device", property(lambda self: torch.device("cuda")))
    times: dict[str, dict[int, float]] = {"called": {}, "dispatched": {}, "answered": {}, "started": {}}

    class Slow(Engine):
        name, signals_dispatch = "slow", signals

        async def init_transfer(self, init_info): ...  # type: ignore[no-untyped-def]
        async def finish_update(self, version: int) -> None: ...

        async def start_update(self) -> None:
            if slow_start:
                await anyio.sleep(0.3)
            times["started"][0] = time.perf_counter()
        async def get_version(self) -> int | None:
            return None

        async def update(self, message) -> None:  # type: ignore[no-untyped-def]
            times["called"][message.chunk] = time.perf_counter()
            await anyio.sleep(0.05)  # the request on its way
            if signals:
                times["dispatched"][message.chunk] = time.perf_counter()
                DISPATCHED.get()()
            await anyio.sleep(0.2)  # the engine loads the chunk
            times["answered"][message.chunk] = time.perf_counter()

    model = StateModule([(f"model.layers.{i}.w", "float32", [64, 64]) for i in range(4)])
    sync = WeightSync([Slow()], transport=_NoCopy.make(), chunk_bytes=64 * 64 * 4, check_finite=False)
    report = await sync.push(model)
    assert report.chunks == 4
    t0 = report.trace.t0
    spans = {(s.stage, s.chunk): (t0 + s.start, t0 + s.end) for s in report.trace.spans if s.receiver is None}
    gone = times["dispatched"] if signals else times["called"]
    for i in range(report.chunks):
        gather, convert, pack = spans[("gather", i)], spans[("convert", i)], spans[("pack", i)]
        assert gather[1] <= convert[0] and convert[1] <= pack[0]  # in turn, one task
        if i == 1 and slow_start:
            assert pack[1] < times["started"][0]  # prepared while the round opens
        elif i:
            assert gather[0] >= gone[i - 1]  # not before chunk i-1's request left
            assert pack[1] < times["answered"][i - 1]  # but while the engine loads it
    await sync.close()


def test_the_finite_check_names_every_bad_tensor_across_dtypes_in_order():
    from streamsync.plan.finite import nonfinite

    named = [(f"w{i}", torch.randn(4, 4, dtype=torch.bfloat16)) for i in range(300)]
    named += [("bias", torch.randn(8)), ("steps", torch.arange(3)), ("empty", torch.empty(0)),
              ("half", torch.randn(5, dtype=torch.float16)), ("fp8", torch.randn(6).to(torch.float8_e4m3fn))]
    named[7][1][1, 2] = float("nan")
    named[250][1][0, 0] = float("-inf")
    dict(named)["half"][4] = float("inf")
    dict(named)["fp8"][0] = float("nan")
    assert nonfinite(named) == ["w7", "w250", "half", "fp8"]
    assert nonfinite(named[8:250]) == [] and nonfinite([]) == []


def test_the_finite_check_knows_a_sources_list_again_reads_its_values_each_time_and_keeps_no_tensor(monkeypatch):
    # A source's tensors come as a StableList, made anew whenever one moves: the check knows it again by its
    # identity (no per-tensor key), still reads every value, and its cache keeps none of the tensors alive.
    import gc
    import weakref

    from streamsync.cache import StableList
    from streamsync.plan import finite

    ts = [torch.ones(n, dtype=torch.bfloat16) for n in (5, 70, 3)]
    named = StableList((f"w{i}", t) for i, t in enumerate(ts))
    assert finite.nonfinite(named) == [] and not finite.known(named)  # CPU tensors: checked as queued, in a thread
    keyed: list[int] = []
    key = finite._key
    monkeypatch.setattr(finite, "_key", lambda ts, kernel: keyed.append(len(ts)) or key(ts, kernel))
    ts[1][69] = float("nan")
    assert finite.nonfinite(named) == ["w1"] and keyed == []  # known by identity, every value read again
    assert finite.nonfinite(list(named)) == ["w1"] and keyed == [3]  # a plain list is keyed tensor by tensor
    moved = StableList([named[0], ("w1", torch.ones(70, dtype=torch.bfloat16)), named[2]])
    assert finite.nonfinite(moved) == [] and keyed == [3, 3]  # a new list (a tensor moved): keyed again
    gone = weakref.ref(ts[1])
    del named, moved, ts
    gc.collect()
    assert gone() is None


async def test_connect_with_the_model_works_out_the_finite_check_so_the_first_push_does_not(qwen_receiver,
                                                                                             qwen_model, monkeypatch):
    from streamsync.plan import finite

    engine = qwen_receiver.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    await sync.connect(qwen_model)
    keyed: list[int] = []
    key = finite._key
    monkeypatch.setattr(finite, "_key", lambda ts, kernel: keyed.append(len(ts)) or key(ts, kernel))
    report = await sync.push(qwen_model)
    assert keyed == []  # the source's tensors known again by their list's identity
    assert await engine.checksums() == digests(list(qwen_model.state_dict().items()))
    # the trace says where the check's time went, in ms from the push's start: asked for, queued (from a thread:
    # the set is known, but CPU tensors are checked on the host as they are queued), its verdict asked for and
    # answered
    check = report.trace.meta["check"]
    assert check["queueing"] == "on host"
    times = [check[k] for k in ("asked", "queued", "verdict_asked", "answered")]
    assert 0 <= times[0] <= times[1] <= report.trace.meta["prepare_ms"] <= times[2] <= times[3], check
    assert times[3] <= report.seconds * 1e3
    await sync.close()


async def test_an_engine_with_the_round_only_takes_pushes_and_is_refused_what_it_cannot_do(receiver, mixed_model):
    """Abilities are types (`engines.abilities`): an engine that has the round and nothing else takes a push bit for
    bit (no plan check, no cache to reset, no round stats to ask), and `paused()` refuses it naming it and the
    ability, before any engine is touched."""
    from streamsync.engines.abilities import CachesPrefixes, KeepsDeltaBase, Pausable, ReadsBack
    from streamsync.engines.base import Engine

    inner = receiver.engine()

    class RoundOnly(Engine):
        name = "round-only"

        async def init_transfer(self, init_info):  # type: ignore[no-untyped-def]
            inner.owner = self.owner
            await inner.init_transfer(init_info)

        async def start_update(self) -> None:
            await inner.start_update()

        async def update(self, message) -> None:  # type: ignore[no-untyped-def]
            await inner.update(message)

        async def finish_update(self, version: int) -> None:
            await inner.finish_update(version)

        async def get_version(self) -> int | None:
            return await inner.get_version()

    engine = RoundOnly()
    assert isinstance(inner, Pausable | ReadsBack | KeepsDeltaBase)
    assert not isinstance(engine, Pausable | ReadsBack | KeepsDeltaBase | CachesPrefixes)
    sync = WeightSync([engine], chunk_bytes=1 << 16)
    report = await sync.push(mixed_model, version=3)
    assert report.cache_reset == {"round-only": True} and report.engine_rounds == []
    assert await inner.checksums() == digests(mixed_model.state_dict().items())
    with pytest.raises(PushError, match="pause: engine 'round-only' cannot pause generation"):
        async with sync.paused():
            pass
    assert (await engine.state()).version == 3
    await sync.close()
    await inner.close()


def test_what_a_transport_does_beyond_its_chunks_is_a_type_it_names():
    """Priming and the ranks' agreement are types asked for with isinstance, not methods every transport has: the
    one-copy transports prime, p2p agrees across ranks (and only it runs on every rank), p2p's receiving half
    abandons a failed round. A transport that says it runs on every rank without the agreement is refused when its
    class is made, naming both."""
    from streamsync.transports.base import Abandons, Primes, RanksAgree, Transport
    from streamsync.transports.collective import CollectiveReceiver, CollectiveTransport
    from streamsync.transports.cuda_ipc import CudaIpcTransport
    from streamsync.transports.p2p import P2pReceiver, P2pTransport
    from streamsync.transports.shm import ShmReceiver, ShmTransport

    assert [issubclass(t, Primes) for t in (ShmTransport, CudaIpcTransport, CollectiveTransport, P2pTransport)] == [
        True, True, False, False]
    assert [(t.every_rank, issubclass(t, RanksAgree)) for t in (ShmTransport, CollectiveTransport, P2pTransport)] == [
        (False, False), (False, False), (True, True)]
    assert [issubclass(r, Abandons) for r in (ShmReceiver, CollectiveReceiver, P2pReceiver)] == [False, False, True]
    assert not hasattr(Transport, "before_push") and not hasattr(Transport, "begin_prime")
    with pytest.raises(TypeError, match=r"EveryRank: every_rank=True but the transport is not RanksAgree"):
        class EveryRank(Transport):
            every_rank = True
