"""The CUDA IPC transport: handles and references validated (no GPU needed), then pushes into a receiver
process on the same GPU (marked `gpu`: skipped where CUDA is absent): packed, one copy, captured loads."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
import torch

from streamsync import PushError, WeightSync
from streamsync.checksum import device_digests, digests
from streamsync.engines.receiver import ReceiverEngine
from streamsync.errors import ValidationError
from streamsync.models.synthetic import StateModule, mixed_specs, qwen3_specs, save_specs
from streamsync.testing import faults
from streamsync.testing.gpu import gpu
from streamsync.testing.gpu import perturb as _perturb
from streamsync.testing.receiver import ReceiverProcess
from streamsync.transports.cuda_ipc import CudaIpcTransport, parse_handle
from streamsync.transports.refs import reference_view

CHUNK = 1 << 20


# ------------------------------------------------------------------------------- handle validation (CPU)


def _handle() -> dict[str, Any]:
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    return {"token": "0123456789abcdef", "nbytes": 1000, "live": ["0123456789abcdef"], "ipc": {
        "gpu": "GPU-8f1c2f3e-0000-1111-2222-333344445555", "size": 4096, "tensor_offset": 0,
        "handle": b64(b"\x01" * 64), "storage_size": 4096, "storage_offset": 0,
        "ref_counter": b64(b"/torch_123_456_7"), "ref_counter_offset": 3, "event": b64(b"\x02" * 64),
        "event_sync": True}}


def test_a_well_formed_ipc_handle_parses():
    h = parse_handle(_handle())
    assert h.nbytes == 1000 and h.size == 4096 and h.handle == b"\x01" * 64 and h.event_sync is True


@pytest.mark.parametrize("path, value", [
    (("token",), "../../etc"), (("nbytes",), 5000), (("nbytes",), -1), (("nbytes",), True), (("nbytes",), "1"),
    (("live",), ["x"]), (("ipc", "gpu"), "GPU; rm -rf"), (("ipc", "handle"), "not base64!"),
    (("ipc", "handle"), base64.b64encode(b"\x00" * 4000).decode()), (("ipc", "ref_counter"), "Li4vZXRj"),
    (("ipc", "tensor_offset"), 1), (("ipc", "event_sync"), 1), (("ipc", "size"), 0), (("ipc",), "pickle"),
])
def test_malformed_ipc_handles_are_refused_before_anything_is_opened(path, value):
    h = copy.deepcopy(_handle())
    d = h
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    with pytest.raises(ValidationError):
        parse_handle(h)


def test_per_buffer_caches_start_over_but_keep_exports_when_they_grow_too_large():
    from streamsync.transports.pool import PoolBuffer

    pb = PoolBuffer(torch.empty(0, dtype=torch.uint8), 0, "0123456789abcdef")
    pb.exports[0] = {"export of": "engine 0"}
    for i in range(600):
        pb.cache[("graph", i)] = False
    assert pb.exports[0] == {"export of": "engine 0"}
    assert len(pb.cache) <= 512 and pb.cache[("graph", 599)] is False


def _ref(name="q", dtype="bfloat16", hf=(8, 4), offset=0, shape=(8, 4), stride=(4, 1), part=None) -> list:
    ref = [name, dtype, list(hf), "0123456789abcdef", offset, list(shape), list(stride)]
    return [*ref, list(part)] if part else ref


def test_a_reference_is_a_view_of_the_mapped_storage_in_hf_or_blocked_shape():
    storage = torch.arange(2 * 6 * 4, dtype=torch.bfloat16).view(torch.uint8)  # a fused [2 groups x 6 rows, 4]
    meta, t = reference_view(_ref(hf=(2, 4), offset=8 * 2, shape=(2, 4)), storage)
    assert meta.name == "q" and meta.shape == (2, 4) and t.data_ptr() == storage.data_ptr() + 16
    assert torch.equal(t, torch.arange(8, 16, dtype=torch.bfloat16).view(2, 4))
    # Q of an interleaved QKV: 4 of every 6 rows. No HF-shaped view exists: the blocked view comes back.
    meta, t = reference_view(_ref(hf=(8, 4), shape=(2, 4, 4), stride=(24, 4, 1)), storage)
    assert t.shape == (2, 4, 4) and meta.shape == (8, 4)
    fused = torch.arange(48, dtype=torch.bfloat16).view(2, 6, 4)
    assert torch.equal(t.reshape(8, 4), fused[:, :4].reshape(8, 4))


@pytest.mark.parametrize("nbytes", [96, 95])  # 95: no bf16 view of the whole storage, each view is a slice
def test_views_through_the_typed_storage_cache_are_the_views_made_without_it(nbytes):
    storage = torch.arange(48, dtype=torch.bfloat16).view(torch.uint8)[:nbytes]
    typed: dict = {}
    for ref in (_ref(hf=(2, 4), offset=8 * 2, shape=(2, 4)), _ref(hf=(8, 4), shape=(2, 4, 4), stride=(24, 4, 1)),
                _ref(dtype="float16", hf=(4, 4), offset=32, shape=(4, 4))):
        (m1, a), (m2, b) = reference_view(ref, storage), reference_view(ref, storage, typed=typed)
        assert m1 == m2 and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    assert set(typed) == {torch.bfloat16, torch.float16}
    assert all((v is None) == (nbytes % 2 == 1) for v in typed.values())
    with pytest.raises(ValidationError, match="outside"):  # the cache changes nothing about the bounds
        reference_view(_ref(offset=64), storage, typed=typed)


@pytest.mark.parametrize("ref, why", [
    (_ref(offset=200), "outside"),                                      # past the storage's end
    (_ref(offset=1), "misaligned"),                                     # not on an element boundary
    (_ref(shape=(8, 4), stride=(8, 1)), "outside"),                     # strides reach past the end
    (_ref(hf=(4, 4)), "blocked form"),                                  # element counts differ
    (_ref(shape=(4, 8), stride=(8, 1)), "blocked form"),                # trailing dims differ
    (_ref(stride=(4,)), "strides"),                                     # strides do not match the shape
    (_ref(stride=(-4, 1)), "non-negative"),                             # negative strides
    (_ref(dtype="nope"), "unknown dtype"),
    (_ref(part=(6, 8)), "part"),                                        # rows outside the whole tensor
])
def test_malformed_references_are_refused_before_a_view_is_made(ref, why):
    with pytest.raises(ValidationError, match=why):
        reference_view(ref, torch.zeros(64, dtype=torch.uint8))


_DRIVER_EXPORT = {"driver": 1, "gpu": "GPU-00000000-0000-0000-0000-000000000000",
                  "handle": base64.b64encode(bytes(64)).decode(), "offset": 0, "size": 4096, "alloc": 4096}


@pytest.mark.parametrize(("field", "value"), [
    ("handle", "not base64!"), ("handle", base64.b64encode(bytes(8)).decode()), ("offset", -1), ("size", 0),
    ("size", "4096"), ("handle", None)])
def test_malformed_driver_exports_are_refused_before_the_driver_is_asked(field, value):
    from streamsync.transports.cuda_ipc import driver as cuda_driver

    with pytest.raises(ValidationError):
        cuda_driver.map_storage({**_DRIVER_EXPORT, field: value}, 0, "ab12cd34")


def test_a_driver_handle_keeps_all_64_bytes_nuls_included():
    from streamsync.transports.cuda_ipc.driver import _IpcHandle

    raw = bytes([0, 7, 0, 255]) * 16
    assert bytes(_IpcHandle.from_buffer_copy(raw)) == raw


def test_the_ipc_mechanism_is_checked():
    with pytest.raises(ValidationError, match="ipc must be"):
        CudaIpcTransport(ipc="nccl")



@gpu
async def test_ipc_round_trip_is_bit_exact_and_reuses_buffers(cuda_mixed):
    model, rp = cuda_mixed
    engine = rp.engine()
    sync = WeightSync([engine], chunk_bytes=2048)  # auto: CUDA engine -> cuda_ipc, one copy
    report = await sync.push(model)
    # Every tensor is a view of the model's own storages: referenced, in one chunk (referenced bytes take no
    # buffer; their per-chunk budget is the transport's ref_bytes, 4 GiB)
    # (zero-size tensors have no storage to refer to: packed)
    assert sync.transport.name == "cuda_ipc" and report.chunks == 1
    assert report.trace.counts["refs.referenced"] >= len(mixed_specs()) - 2
    assert await engine.checksums() == digests(model.state_dict().items())
    _perturb(model, 1)
    await sync.push(model, max_inflight=1)
    assert await engine.checksums() == digests(model.state_dict().items())
    assert sync.transport.pool.buffers <= 4
    await sync.close()


@gpu
async def test_ipc_into_fused_receiver_and_buffers_are_freed_after_receivers_let_go(tmp_path):
    specs = qwen3_specs(vocab=4096, hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule(specs, fill="random", seed=3, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CudaIpcTransport(ref_bytes=CHUNK), chunk_bytes=CHUNK)
        for window in (4, 1, 4):
            _perturb(model, window)
            report = await sync.push(model, max_inflight=window)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items())
        assert report.trace.counts["refs.referenced"] > 0  # one copy: the pool holds only what is packed
        await sync.close()
    torch.cuda.ipc_collect()  # the receiver unmapped at shutdown: the pool's memory comes back
    assert torch.cuda.memory_allocated() <= base + (64 << 10)


@gpu
async def test_a_tied_fused_receivers_head_is_the_pushed_embedding_on_the_gpu(tmp_path):
    """On CUDA vLLM's tied head multiplies by the embedding's Parameter itself (no packed copy): the fused
    stand-in holds it the same way, and after each push its head equals the new embedding."""
    specs = qwen3_specs(vocab=4096, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=768,
                        tie=True)
    model = StateModule(specs, fill="random", seed=4, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "t.json")), device="cuda", fused=True, tie=True) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CudaIpcTransport(), chunk_bytes=CHUNK)
        for step in (1, 2):
            _perturb(model, step)
            await sync.push(model)
            got = await engine.checksums(device=True)
            want = device_digests([("lm_head.weight", model.state_dict()["model.embed_tokens.weight"])])
            assert got["lm_head.weight"] == want["lm_head.weight"]
        await sync.close()


@gpu
async def test_float32_weights_are_cast_to_the_receivers_dtype_by_the_pack_copy(tmp_path):
    # The source hands over float32 tensors for bfloat16 slots (cast=False); the IPC pack casts them while
    # copying, small ones in the batched path too. The receiver's bits must be exactly `.to(bfloat16)`'s.
    specs = qwen3_specs(vocab=4096, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    fp32 = [(n, "float32", s) for n, _, s in specs]
    model = StateModule(fp32, fill="random", seed=5, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CudaIpcTransport(), chunk_bytes=CHUNK,
                          source_options={"dtype": torch.bfloat16})
        for window in (4, 1):
            _perturb(model, window)
            await sync.push(model, max_inflight=window)
            want = device_digests((n, t.to(torch.bfloat16)) for n, t in model.state_dict().items())
            assert await engine.checksums(device=True) == want
        await sync.close()


@gpu
async def test_captured_packs_carry_every_new_weight_and_new_addresses_fall_back_to_copies(tmp_path):
    # Window 1: every chunk goes through the one pooled buffer, so push 1 packs plainly, push 2 captures each
    # chunk's pack as a graph, push 3 replays them. Every push changes every weight; the receiver must get
    # each push's bits. Then parameters move (`param.data = ...`): new addresses, plain copies, still exact.
    specs = qwen3_specs(vocab=4096, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule([(n, "float32" if "norm" in n else d, s) for n, d, s in specs], fill="random", seed=6,
                        device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        transport = CudaIpcTransport(one_copy=False)  # every tensor packed: the captures are what is tested
        sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK // 4, max_inflight=1,
                          source_options={"dtype": torch.bfloat16})

        async def push_and_check(step: int) -> Any:
            _perturb(model, step)
            report = await sync.push(model)
            want = device_digests((n, t.to(torch.bfloat16)) for n, t in model.state_dict().items())
            assert await engine.checksums(device=True) == want, f"push {step}"
            return report

        def graphs(report: Any) -> tuple[int, int]:  # (packs captured, packs replayed) in that push
            c = report.trace.counts
            return c.get("pack_graphs_captured", 0), c.get("pack_graphs_replayed", 0)

        report = await push_and_check(1)
        assert graphs(report) == (0, 0)
        assert graphs(await push_and_check(2)) == (report.chunks, report.chunks)  # captured, then replayed
        assert graphs(await push_and_check(3)) == (0, report.chunks)
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
        assert graphs(await push_and_check(4))[1] == 0  # new addresses: plain copies
        await sync.close()


@pytest.mark.parametrize("one_copy", [False, True])
@gpu
async def test_a_buffer_is_not_repacked_before_a_slow_receiver_copied_it_out(tmp_path, one_copy):
    # The receiver acknowledges as soon as its copies are queued, behind ~5 ms of other GPU work per chunk;
    # the sender reuses each of its 2 buffers many times. Only the release events keep the bits right.
    specs = qwen3_specs(vocab=4096, hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule(specs, fill="random", seed=4, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True,
                         gpu_delay_ms=5) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CudaIpcTransport(one_copy=one_copy, ref_bytes=CHUNK // 2),
                          chunk_bytes=CHUNK // 2, max_inflight=2)
        for step in range(2):
            _perturb(model, 10 + step)
            report = await sync.push(model)
            assert report.chunks > 8
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items())
        assert sync.transport.pool.buffers <= 2
        await sync.close()


@gpu
async def test_a_receiver_does_not_read_a_chunk_before_its_pack_ran(tmp_path):
    # The trainer's stream is busy (~20 ms) when the push starts, so every pack runs late on the device;
    # with release events the handles go out at once and only the ready events hold the receiver back.
    specs = qwen3_specs(vocab=4096, hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule(specs, fill="random", seed=6, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CudaIpcTransport(ref_bytes=CHUNK), chunk_bytes=CHUNK)
        for step in range(2):
            _perturb(model, 20 + step)
            torch.cuda._sleep(int(40e6))
            await sync.push(model)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items())
        await sync.close()


# ------------------------------------------------------------------------------- one copy (CUDA IPC references)


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@gpu
async def test_one_copy_sends_views_by_reference_packs_the_rest_and_the_trainer_holds_no_copy(tmp_path):
    # bf16 weights are views of the trainer's storages: referenced. float32 norms cast to bf16 are packed.
    specs = qwen3_specs(vocab=4096, hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule([(n, "float32" if "norm" in n else d, s) for n, d, s in specs], fill="random", seed=11,
                        device="cuda")
    packed = _nbytes(t for n, t in model.state_dict().items() if "norm" in n) // 2  # as bf16
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        transport = CudaIpcTransport()
        sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK, source_options={"dtype": torch.bfloat16})
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        peaks, reports = [], []
        for step in range(3):
            _perturb(model, 30 + step)
            torch.cuda.reset_peak_memory_stats()
            reports.append(await sync.push(model))
            peaks.append(torch.cuda.max_memory_allocated() - base)
            want = device_digests((n, t.to(torch.bfloat16)) for n, t in model.state_dict().items())
            assert await engine.checksums(device=True) == want, f"push {step}"
        assert reports[-1].chunks == 1  # the packed norms fit one chunk's budget; referenced bytes fill their own
        counts = [r.trace.counts for r in reports]
        refs = sum(c.get("refs.referenced", 0) for c in counts)
        n_packed = sum(c.get("refs.packed", 0) for c in counts)
        items = [s.name for p in sync.plan(model)[1] for s in p.specs]  # split tensors: one item per part
        assert refs == 3 * sum(1 for n in items if "norm" not in n) and n_packed == 3 * (len(items) - refs // 3)
        # Exports: one per storage, made on the first push only.
        exports = [c.get("refs.exports", 0) for c in counts]
        assert exports == [sum(1 for n in model.state_dict() if "norm" not in n), 0, 0]
        # The trainer's extra memory is the packed norms' buffers, not the model.
        assert max(peaks) <= 4 * max(packed, 4096) + (1 << 20) < _nbytes(model.parameters()) // 4, peaks
        await sync.close()


@pytest.mark.parametrize("ipc", ["driver", "torch"])
@gpu
async def test_one_copy_never_reads_a_replaced_or_resized_storage(tmp_path, ipc):
    # Between pushes the trainer replaces some parameters' storages (param.data = ...), frees others'
    # (resize to 0, FSDP-style, then new memory); the old addresses must never be read, nor kept mapped.
    # Storages shared through the CUDA driver (the default) or PyTorch's IPC.
    specs = qwen3_specs(vocab=4096, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule(specs, fill="random", seed=12, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        transport = CudaIpcTransport(ref_bytes=CHUNK, ipc=ipc)
        sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK)
        await sync.push(model)
        assert all((ex.data.get("driver") == 1) == (ipc == "driver") for ex in transport.refs.exports())
        params = list(model.parameters())
        n_storages = len(list(transport.refs.exports()))
        for step in range(3):
            with torch.no_grad():
                for i, p in enumerate(params):
                    if i % 3 == 0:
                        p.data = p.data.clone() + 1  # new storage, new values
                    elif i % 3 == 1:
                        new = p.data.clone() * 2
                        p.data.untyped_storage().resize_(0)  # the old memory goes back to the allocator
                        p.data = new
            torch.cuda.empty_cache()
            junk = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda")  # reuse freed memory
            _perturb(model, 40 + step)
            await sync.push(model)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), step
            del junk
            # Storages no push uses any more are dropped on both sides: the count stays the model's.
            assert len(list(transport.refs.exports())) == n_storages
        await sync.close()


@gpu
async def test_one_copy_never_reads_freed_memory_behind_a_storage_resized_back_to_its_address(tmp_path):
    # FSDP-style offload with the cache emptied: a parameter's own storage is resized to nothing, the allocator
    # gives its segment back to the driver, and the storage is resized back; the new memory can land at the old
    # address. The driver export of the old allocation must not be used (the receiver would read freed memory).
    specs = qwen3_specs(vocab=4096, hidden=512, layers=2, heads=8, kv_heads=2, head_dim=64, intermediate=2048)
    model = StateModule(specs, fill="random", seed=14, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        transport = CudaIpcTransport(ref_bytes=CHUNK * 8)
        sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK * 8)
        await sync.push(model)
        big = [p for p in model.parameters() if p.numel() * p.element_size() >= (2 << 20)]
        assert big
        for step in range(3):
            same = 0
            with torch.no_grad():
                for p in big:
                    saved, addr = p.detach().clone(), p.data_ptr()
                    p.untyped_storage().resize_(0)
                    torch.cuda.empty_cache()
                    p.untyped_storage().resize_(saved.numel() * saved.element_size())
                    p.copy_(saved + 1)
                    same += p.data_ptr() == addr
            _perturb(model, 60 + step)
            await sync.push(model)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), (step, same)
        await sync.close()


@gpu
async def test_one_copy_push_returns_after_the_receiver_copied_so_the_trainer_may_write_at_once(tmp_path):
    # The receiver's GPU is slow (queued work before every copy); the trainer changes every weight right
    # after each push returns. The receiver must hold what was pushed, not what came after.
    specs = qwen3_specs(vocab=4096, hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule(specs, fill="random", seed=13, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True,
                         gpu_delay_ms=3) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CudaIpcTransport(ref_bytes=CHUNK // 2), chunk_bytes=CHUNK // 2)
        for step in range(2):
            _perturb(model, 50 + step)
            pushed = device_digests(model.state_dict().items())
            await sync.push(model)
            _perturb(model, 60 + step)  # at once, on the trainer's stream
            assert await engine.checksums(device=True) == pushed
        await sync.close()


@gpu
async def test_one_copy_after_a_failed_push_exports_again_and_is_exact(tmp_path):
    specs = qwen3_specs(vocab=4096, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule(specs, fill="random", seed=14, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        transport = CudaIpcTransport(ref_bytes=CHUNK // 2)
        sync = WeightSync([engine], transport=transport, chunk_bytes=CHUNK // 2)

        async def exact() -> bool:
            return await engine.checksums(device=True) == device_digests(model.state_dict().items())

        await faults.one_copy_failed_push(sync, transport, model, _perturb, exact)
        await sync.close()


@pytest.mark.parametrize("one_copy", [True, False])
@gpu
async def test_the_receiver_replays_a_repeated_chunks_copies_as_a_graph_and_stays_exact(tmp_path, one_copy):
    # Push 1 loads plainly, push 2 captures every chunk's load, later pushes replay them; every push changes
    # every weight and the receiver's GPU is slow. Then the parameters move: new
    # references, new captures, still exact, and the old captures are dropped once unused for a few rounds.
    # (Chunks holding a split tensor are never captured: their load is stateful.)
    specs = qwen3_specs(vocab=2048, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule(specs, fill="random", seed=15, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True,
                         gpu_delay_ms=2) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CudaIpcTransport(one_copy=one_copy, ref_bytes=CHUNK),
                          chunk_bytes=CHUNK)
        for step in range(4):
            _perturb(model, 80 + step)
            report = await sync.push(model)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), step
        graphs = (await engine.call("status"))["graphs"]
        # (which pooled buffer a chunk lands in can vary with timing: a new one is a new capture)
        assert report.chunks > 1 and graphs["captured"] >= report.chunks and graphs["replayed"] >= report.chunks
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
        for step in range(7):
            _perturb(model, 90 + step)
            await sync.push(model)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), step
        graphs = (await engine.call("status"))["graphs"]
        if one_copy:  # new references, new captures: those of the first addresses are gone
            assert graphs["held"] < graphs["captured"], graphs
        await sync.close()


@gpu
async def test_moe_experts_by_reference_replay_coalesced_copies_and_stay_exact(tmp_path):
    # Each expert's gate and up projections are two halves of one trainer tensor (megatron's fc1) and land as
    # two halves of one w13 slice: a captured load copies each pair as one block. Exact at every push, also
    # after the trainer moved its parameters (new references, new captures).
    from streamsync.models.megatron import TinyModel

    specs = TinyModel(arch="qwen3-moe", vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                      ffn=128, experts=8, moe_ffn=32).hf_specs()
    model = StateModule(specs, fill="random", seed=21, device="cuda")

    def fuse_fc1() -> None:
        with torch.no_grad():
            for name, gate in list(model.named_parameters()):
                if ".experts." in name and name.endswith("gate_proj.weight"):
                    up = model.get_parameter(name.replace("gate_proj", "up_proj"))
                    fc1 = torch.cat([gate, up])
                    gate.data, up.data = fc1[:gate.shape[0]], fc1[gate.shape[0]:]

    fuse_fc1()
    with ReceiverProcess(str(save_specs(specs, tmp_path / "moe.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        transport = CudaIpcTransport()
        sync = WeightSync([engine], transport=transport)
        for step in range(4):
            _perturb(model, 110 + step)
            report = await sync.push(model)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), step
        graphs = (await engine.call("status"))["graphs"]
        assert graphs["captured"] >= 1 and graphs["replayed"] >= 1
        assert report.trace.counts["refs.referenced"] > 0
        fuse_fc1()  # new storages for every expert
        for step in range(3):
            _perturb(model, 120 + step)
            await sync.push(model)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), step
        await sync.close()



@gpu
async def test_a_captured_load_does_not_keep_the_senders_buffers_alive_after_the_receiver_let_go(tmp_path):
    # Packed chunks, captured by the receiver (one segment copy kernel each) and replayed on later pushes. Once
    # a new sync connects, the receiver drops the old mappings, and the old pool's memory must come back: a
    # graph holds addresses, and nothing the receiver keeps for it may hold a mapped buffer.
    specs = qwen3_specs(vocab=2048, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule(specs, fill="random", seed=19, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        sync = WeightSync([engine], transport=CudaIpcTransport(one_copy=False), chunk_bytes=CHUNK)
        for step in range(3):
            _perturb(model, 140 + step)
            await sync.push(model)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items())
        assert (await engine.call("status"))["graphs"]["replayed"] >= 1
        await sync.close()
        again = WeightSync([rp.engine()], transport=CudaIpcTransport(one_copy=False), chunk_bytes=CHUNK)
        await again.connect()  # the receiver's new transport: the old one's mappings are dropped
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() <= base + (64 << 10)
        await again.close()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch-copies"])
@gpu
async def test_captured_loads_with_and_without_the_copy_kernel_stay_exact(tmp_path, kernel):
    # The receiver's captured loads record one segment copy kernel (default) or PyTorch's copies; each push
    # changes every weight, one copy and packed parts alike, into the fused receiver.
    specs = qwen3_specs(vocab=2048, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=768)
    model = StateModule(specs, fill="random", seed=17, device="cuda")
    with ReceiverProcess(str(save_specs(specs, tmp_path / "q.json")), device="cuda", fused=True) as rp:
        engine = rp.engine()
        await engine.call("capture", on=True, kernel=kernel)
        sync = WeightSync([engine], transport=CudaIpcTransport(ref_bytes=CHUNK), chunk_bytes=CHUNK)
        for step in range(4):
            _perturb(model, 130 + step)
            await sync.push(model)
            assert await engine.checksums(device=True) == device_digests(model.state_dict().items()), step
        graphs = (await engine.call("status"))["graphs"]
        assert graphs["captured"] >= 1 and graphs["replayed"] >= 1
        await sync.close()


class _Tamper(ReceiverEngine):
    async def update(self, message: Any) -> None:
        info = copy.deepcopy(message.wire())
        info["handle"]["ipc"]["gpu"] = "GPU-00000000-0000-0000-0000-000000000000"
        await super().update(info)


@gpu
async def test_a_handle_for_another_gpu_is_refused(cuda_mixed):
    model, rp = cuda_mixed
    engine = _Tamper("127.0.0.1", rp.port, secret=rp.secret, name="tamper", device="cuda")
    sync = WeightSync([engine], chunk_bytes=2048)
    with pytest.raises(PushError, match="not visible"):
        await sync.push(model)
    await sync.close()


def test_a_p2p_ipc_reference_round_trips_and_a_malformed_one_is_refused():
    """The reference a trainer rank sends a worker on its GPU (p2p, module ipc): what it names comes back, and
    a message that is not one is refused naming the rank."""
    from streamsync.errors import TransportError, ValidationError
    from streamsync.transports.p2p.ipc import MSG_BYTES, decode_ref, encode_ref

    export = {"driver": 1, "gpu": "GPU-x", "handle": "a" * 88, "offset": 512, "size": 1 << 20, "alloc": 2 << 20}
    msg = encode_ref(export, 4096, 1000)
    assert msg.dtype == torch.uint8 and msg.numel() == MSG_BYTES
    assert decode_ref(msg, 3) == (export, 4096, 1000)
    broken = encode_ref(export, 0, 1).index_fill_(0, torch.tensor([9]), 0)  # a byte of its JSON gone
    for bad in (torch.zeros(MSG_BYTES, dtype=torch.uint8), broken):
        with pytest.raises(ValidationError, match="trainer rank 3"):
            decode_ref(bad, 3)
    with pytest.raises(TransportError, match="exceeds"):
        encode_ref({"pad": "x" * MSG_BYTES}, 0, 1)


def test_p2p_pairs_learn_each_others_gpu_from_the_store():
    """Each side publishes its GPU before it joins the group and reads the others' after; a CPU device has none,
    so only pairs on one GPU send references."""
    from datetime import timedelta

    import torch.distributed as dist

    from streamsync.transports.p2p.ipc import colocated, gpu_of, publish_gpu, read_gpus

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    assert gpu_of(torch.device("cpu")) == ""
    for rank, uuid in enumerate(["GPU-a", "", "GPU-a", "GPU-b"]):
        publish_gpu(store, "g", rank, uuid)
    assert read_gpus(store, "g", range(1, 4)) == {1: "", 2: "GPU-a", 3: "GPU-b"}
    # one GPU, two processes: by reference; the same process (CUDA IPC cannot open its own export), another GPU,
    # or a CPU side: over the wire
    assert colocated("GPU-a/p1", "GPU-a/p2")
    assert not colocated("GPU-a/p1", "GPU-a/p1") and not colocated("GPU-a/p1", "GPU-b/p2")
    assert not colocated("", "GPU-a/p2") and not colocated("GPU-a/p1", "")
