"""`python -m benchmarks --device cuda`: a colocated GPU push measured against the copy floor, in one run.

Trainer: a megatron-core GPTModel (TP=1, bf16) with Qwen3-8B shapes, pushed with `WeightSync.push(model)`
(MegatronSource: Megatron -> HF conversion). Receiver: another process on the same GPU holding vLLM-style
fused parameters (`streamsync.testing.fused.FusedModel`: qkv_proj, gate_up_proj, stacked experts), loading through
`WeightReceiver` + `load_weights`, the code path of the vLLM backend. Transport: CUDA IPC.

Measured, for each model:
  floor      one pack copy plus one unpack copy of the model's bytes at the device-to-device copy rate
             measured in this run (bytes read + written): 2 x 2 x bytes / rate
  push       `PushReport.seconds` (start_update .. finish_update): median of `--repeat` pushes after
             `--warmup` of each configuration, the configurations interleaved: window 4 and window 1 with
             release events (the default), and "serial": window 1 with the plain protocol, where each chunk
             is packed, copied out and acknowledged, both sides waiting for their copies on the host, before
             the next chunk starts (also window 4 with the plain protocol)
  peak       the trainer's peak extra device memory in a push (max allocated minus allocated before the
             first push: the send-buffer pool and conversion temporaries)
  bit_exact  after changing every weight and pushing, the receiver's tensors (HF views of its fused
             parameters) checksum equal to the trainer's HF export, on the device
Also a Qwen3-MoE shape (Qwen3-30B-A3B's layer shapes, 12 of its 48 layers: ~16 GB).

    python -m benchmarks.cuda --json OUT.json [--models 8b,moe] [--repeat 7] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import torch

from benchmarks.report import ref_counts, write_json
from streamsync.checksum import device_digests
from streamsync.pack import dtype_name
from streamsync.report import GiB, MiB
from streamsync.sync import WeightSync
from streamsync.testing.receiver import ReceiverProcess
from streamsync.transports.cuda_ipc import CudaIpcTransport

# Trainer shapes, described like megatron_utils.TinyModel (which also builds the megatron-core model).
SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(label="Qwen3-8B", arch="qwen3", vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8,
               head_dim=128, ffn=12288),
    "moe": dict(label="Qwen3-30B-A3B layers x12 (MoE, 128 experts)", arch="qwen3-moe", vocab=151936, hidden=2048,
                layers=12, heads=32, kv_heads=4, head_dim=128, ffn=6144, experts=128, moe_ffn=768),
    # Small shapes for a CPU smoke run of this script (`--smoke`: shared memory instead of CUDA IPC).
    "tiny": dict(label="tiny Qwen3", arch="qwen3", vocab=1024, hidden=128, layers=4, heads=4, kv_heads=2,
                 head_dim=32, ffn=256),
    "tiny-moe": dict(label="tiny Qwen3-MoE", arch="qwen3-moe", vocab=1024, hidden=128, layers=2, heads=4,
                     kv_heads=2, head_dim=32, ffn=256, experts=8, moe_ffn=64),
}
_DEV = torch.device("cuda")  # "cpu" in a smoke run


def _cuda() -> bool:
    return _DEV.type == "cuda"


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if _cuda() else 0


def _reset_peak() -> None:
    if _cuda():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if _cuda() else 0


def _free_cached() -> None:
    if _cuda():
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def _transport(one_copy: bool = True, ipc: str = "driver", ref_bytes: int | None = None) -> Any:
    """A fresh transport for one path: CUDA IPC, or shared memory in a CPU smoke run (the same paths).
    `ref_bytes`: referenced bytes per chunk (None: the transport's default)."""
    refs = {} if ref_bytes is None else {"ref_bytes": ref_bytes}
    if _cuda():
        return CudaIpcTransport(one_copy=one_copy, ipc=ipc, **refs)
    from streamsync.transports.shm import ShmTransport

    return ShmTransport(one_copy=one_copy, **refs)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- the floor


def copy_rate(nbytes: int = 4 * GiB, repeat: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (median of `repeat`)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=_DEV)
    dst = torch.empty_like(src)
    times = []
    for i in range(3 + repeat):
        if _cuda():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            dt = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            dt = time.perf_counter() - t0
        if i >= 3:
            times.append(dt)
    assert torch.equal(dst[:1 << 20], src[:1 << 20])
    del src, dst
    _free_cached()
    return 2 * nbytes / statistics.median(times)


def measured_two_copies(tensors: list[torch.Tensor], repeat: int = 3) -> float:
    """Seconds to copy every tensor into one flat buffer and back out (the floor, as plain copy_ calls)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(total, dtype=torch.uint8, device=_DEV)
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(flat[off:off + n].view(t.dtype).view(t.shape))
        off += n
    times = []
    for i in range(1 + repeat):
        _sync()
        t0 = time.perf_counter()
        for v, t in zip(views, tensors, strict=True):
            v.copy_(t)
        for v, t in zip(views, tensors, strict=True):
            t.copy_(v)  # the same bytes go back: the model is unchanged
        _sync()
        if i:
            times.append(time.perf_counter() - t0)
    del views, flat
    _free_cached()
    return statistics.median(times)


# --------------------------------------------------------------------------------------------- trainers


_dist_ready = False


def _init_megatron() -> None:
    global _dist_ready
    if _dist_ready:
        return
    import torch.distributed as dist
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from streamsync.models.megatron import init_parallel
    from streamsync.testing.megatron import free_port

    if not dist.is_initialized():
        dist.init_process_group("nccl" if _cuda() else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    init_parallel(1, 1, 1)
    if _cuda():
        model_parallel_cuda_manual_seed(1234)
    _dist_ready = True


def build_megatron(shape: dict[str, Any], ddp: bool = False) -> torch.nn.Module:
    """A megatron-core GPTModel (local layer spec, TP=1, bf16) initialized on the GPU. `ddp`: wrapped as a
    Megatron trainer runs it with the distributed optimizer (`DistributedDataParallel`,
    `use_distributed_optimizer=True`): its parameters become views of a few contiguous buffers (the
    optimizer all-gathers into them), so a one-copy push exports and maps a few storages, not one per
    parameter."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from streamsync.models.megatron import TinyModel

    _init_megatron()
    tiny = TinyModel(**{k: v for k, v in shape.items() if k != "label"})
    cfg = tiny.transformer_config(use_cpu_initialization=not _cuda(), perform_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=tiny.padded_vocab(1), max_sequence_length=4096, pre_process=True,
                     post_process=True, share_embeddings_and_output_weights=False, position_embedding_type="rope")
    model = model.to(_DEV)
    if ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    return model


def build_module(shape: dict[str, Any]) -> torch.nn.Module:
    """Fallback trainer: an HF-named module of the same shapes (ModuleSource, no conversion)."""
    from streamsync.models.megatron import TinyModel
    from streamsync.models.synthetic import StateModule

    tiny = TinyModel(**{k: v for k, v in shape.items() if k != "label"})
    model = StateModule(tiny.hf_specs(), fill="none", device=_DEV)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def _perturb(model: torch.nn.Module, step: int) -> None:
    """What a training step does: every floating parameter changes (on the device)."""
    torch.manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn_like(p), alpha=1e-3)
    _sync()


async def _trainer_digests(sync: WeightSync, model: torch.nn.Module) -> dict[str, str]:
    """Checksums of the HF export the trainer sends (its gather + convert, chunk by chunk)."""
    source, plans = sync.plan(model)
    out: dict[str, str] = {}
    for plan in plans:
        tensors = await source.convert(plan, await source.gather(plan))
        # converted tensors may be blocked views (QKV); the HF tensor is their row-major reshape
        out.update(device_digests((s.name, t.reshape(s.shape)) for s, t in zip(plan.specs, tensors, strict=True)))
    return out


# --------------------------------------------------------------------------------------------- latencies


async def latency_probe(engine: Any) -> dict[str, float]:
    """What one chunk's control path costs on this machine, in microseconds (medians)."""

    async def med(fn: Any, n: int) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            await fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    out = {"rpc_ping_us": await med(lambda: engine.call("ping"), 200),
           "thread_hop_us": await med(lambda: anyio.to_thread.run_sync(lambda: None), 200)}
    if _cuda():
        def event_wait() -> Any:
            e = torch.cuda.Event()
            e.record()
            return anyio.to_thread.run_sync(e.synchronize)

        out["event_wait_us"] = await med(event_wait, 200)
        x, y = torch.empty(4096, device=_DEV), torch.empty(4096, device=_DEV)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(1000):
            y.copy_(x)
        out["copy_launch_us"] = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    return out


# --------------------------------------------------------------------------------------------- one model


async def _bench_model(entry: str, args: argparse.Namespace, rate: float, work: Path) -> dict[str, Any]:
    key, _, mib = entry.partition(":")  # "8b:2048": the 8B shape with 2048 MiB chunks
    key, ddp = key.removesuffix("+ddp"), key.endswith("+ddp")  # "8b+ddp": the trainer wrapped in Megatron's DDP
    shape = dict(SHAPES[key])
    if ddp:
        shape["label"] += " (Megatron DDP, distributed optimizer)"
    chunk = int(float(mib or args.gpu_chunk_mib) * MiB)
    trace_dir = args.trace_dir if entry == args.models[0] else None  # traces of the first entry only
    log(f"{shape['label']}: building the trainer ({args.trainer}) ...")
    t0 = time.perf_counter()
    trainer = args.trainer
    try:
        model = build_megatron(shape, ddp=ddp) if trainer == "megatron" else build_module(shape)
    except Exception:
        if trainer != "megatron" or ddp:
            raise
        log("megatron trainer failed; falling back to an HF-named module:\n" + traceback.format_exc())
        trainer, model = "module (fallback)", build_module(shape)
    _sync()
    log(f"  built in {time.perf_counter() - t0:.1f}s")

    probe = WeightSync([], chunk_bytes=chunk)
    source, plans = probe.plan(model)
    specs = [(s.name, dtype_name(s.dtype), list(s.shape)) for p in plans for s in p.specs]
    nbytes = sum(s.nbytes for p in plans for s in p.specs)
    max_chunk = max(p.nbytes for p in plans)
    floor_s = 2 * 2 * nbytes / rate
    log(f"  {type(source).__name__}: {len(specs)} HF tensors, {nbytes / 1e9:.2f} GB in {len(plans)} chunks "
        f"(largest {max_chunk / 1e9:.2f} GB); copy floor {floor_s * 1e3:.2f} ms")
    two_copies = measured_two_copies([p.detach() for p in model.parameters()])
    log(f"  two plain copies of the trainer's parameters: {two_copies * 1e3:.2f} ms")
    # The pushes below run with check_finite=False, so they compare with the copy floor and earlier runs;
    # the NaN/inf scan a default push adds (one float32 sum per tensor, one sync) is measured on its own.
    from streamsync.plan.check import nonfinite

    scans = []
    for _ in range(4):
        t_scan = time.perf_counter()
        nonfinite(list(source.local_tensors()))
        _sync()
        scans.append(time.perf_counter() - t_scan)
    check_finite_s = statistics.median(scans[1:])
    log(f"  check_finite scan (on by default, off in the pushes below): {check_finite_s * 1e3:.2f} ms")

    # The trainer alone: the pipeline with no engine (gather, convert, pack; nothing is sent), on the default
    # (first) path's transport.
    paths = [p for p in args.paths if _cuda() or not p.startswith("one_copy")]  # one copy: CUDA IPC only
    alone = WeightSync([], transport=_transport(one_copy=paths[0].split(":")[0] == "one_copy"), chunk_bytes=chunk,
                       check_finite=False)
    alone_times = []
    for _ in range(1 + 3):
        alone_times.append((await alone.push(model, max_inflight=4)).seconds)
    await alone.close()
    _free_cached()

    _free_cached()
    model_base = _allocated()
    specs_path = work / f"{key}.json"
    specs_path.write_text(json.dumps(specs))
    result: dict[str, Any] = {}
    log("  starting the receiver process (fused parameters, same GPU) ...")
    rx_profile = work / f"{key}-receiver.prof"
    if args.profile:
        os.environ["STREAMSYNC_RECEIVER_PROFILE"] = str(rx_profile)
    with ReceiverProcess(str(specs_path), device=_DEV.type, fused=True, start_timeout=600, name=f"rx-{key}") as rp:
        engine = rp.engine(timeout=600)
        version = 0

        def next_version() -> int:
            nonlocal version
            version += 1
            return version

        # Cold: a fresh transport and WeightSync (no pool, no plan, nothing exported or mapped), connect() and
        # the first push, then a second push; per path, the default (first) path first.
        cold: dict[str, dict[str, Any]] = {}
        def path_of(path: str) -> str:
            return path.split(":")[0]

        async def rx_busy() -> dict[str, list[float]]:
            st = await engine.call("status")
            busy = st.get("busy_ms") or {}
            calls = busy.get("update", [0, 0.0])[0]
            return {**busy, **{f"update.{k}": [calls, ms] for k, ms in (st.get("update_split_ms") or {}).items()}}

        async def receiver_graphs(path: str) -> None:
            # ":plain": the receiver loads every tensor with its own call each push, as a vLLM engine does
            # ":copies": captured loads record PyTorch's copies instead of the segment copy kernel
            await engine.call("capture", on=":plain" not in path, kernel=":copies" not in path)

        # The default path (and its ":copies" / ":torchipc" variants) several times, interleaved; the others once.
        again = [p for p in paths if p.replace(":copies", "").replace(":torchipc", "") == paths[0]]
        cold_runs = [(p, i) for i in range(args.cold_repeat) for p in again]
        cold_runs += [(p, 0) for p in paths if p not in again]
        for path, rep in cold_runs:
            await receiver_graphs(path)
            # ":torchipc": trainer storages shared through PyTorch's reduce/rebuild instead of the CUDA driver
            t_cold = _transport(one_copy=path_of(path) == "one_copy", ipc="torch" if ":torchipc" in path else "driver")
            s_cold = WeightSync([engine], transport=t_cold, chunk_bytes=chunk, timeout=600, check_finite=False,
                                engine_layout=path_of(path) != "packed")
            s_cold.version = version
            b0 = await rx_busy()
            _sync()
            t0 = time.perf_counter()
            await s_cold.connect()
            t1 = time.perf_counter()
            # The update split's transport counters (map_storages) are the new receiver transport's: from here.
            b0.update({k: v for k, v in (await rx_busy()).items() if k.startswith("update.")})
            t1b = time.perf_counter()
            if trace_dir:
                s_cold.trace_dir = Path(trace_dir) / f"first-push-{path}"
            rpc0 = {k: list(v) for k, v in engine.rpc_seconds.items()}
            r1 = await s_cold.push(model, version=next_version())
            t2 = time.perf_counter() - (t1b - t1)
            s_cold.trace_dir = None
            # The sender's side of the first push's update calls: request to reply, and encoding + writing
            rpc = {op: [v[0] - rpc0.get(op, [0, 0, 0])[0], (v[1] - rpc0.get(op, [0, 0, 0])[1]) * 1e3,
                        (v[2] - rpc0.get(op, [0, 0, 0])[2]) * 1e3] for op, v in engine.rpc_seconds.items()}
            first_rx = busy_since(b0, await rx_busy())
            r2 = await s_cold.push(model, version=next_version())
            runs = cold.get(path, {}).get("runs", [])
            runs.append({"connect_ms": (t1 - t0) * 1e3, "first_push_ms": r1.seconds * 1e3,
                         "second_push_ms": r2.seconds * 1e3})
            cold[path] = {"connect_ms": (t1 - t0) * 1e3, "first_push_ms": r1.seconds * 1e3,
                          "first_push_wall_ms": (t2 - t1) * 1e3, "second_push_ms": r2.seconds * 1e3,
                          "first_push_stage_busy_ms": {k: v * 1e3 for k, v in r1.stage_seconds.items()},
                          "exports": ref_counts(r1),
                          "connect_and_first_push_receiver_busy_ms": first_rx,
                          "first_push_sender_rpc_ms": rpc, "runs": runs}
            if len(runs) > 1:  # the reported values: medians over fresh syncs (the first also met a fresh receiver)
                for k in ("connect_ms", "first_push_ms", "second_push_ms"):
                    cold[path][k] = statistics.median(r[k] for r in runs)
            log(f"  cold {path} (fresh sync {rep + 1}): connect {(t1 - t0) * 1e3:.1f} ms, "
                f"first push {r1.seconds * 1e3:.1f} ms, "
                f"second {r2.seconds * 1e3:.1f} ms; first push busy (ms): " + ", ".join(
                    f"{k} {v:.1f}" for k, v in cold[path]["first_push_stage_busy_ms"].items())
                + "; receiver, connect and first push (ms): " + _busy_text(first_rx)
                + "; sender exports: " + str(cold[path]["exports"])
                + "; sender's update calls (calls, request to reply ms, of it writing ms): "
                + str({k: [round(x, 1) for x in v] for k, v in rpc.items() if v[0]}))
            _timeline(f"cold {path}: first push", r1)
            await s_cold.close()
            del s_cold, t_cold
            _free_cached()

        probe_us = await latency_probe(engine)
        log(f"  latencies (us): {', '.join(f'{k} {v:.0f}' for k, v in probe_us.items())}")
        _free_cached()
        # The trainer's extra memory is measured against what it held before any sync existed (the model):
        # the pool counts, and buffers of an earlier sync that a receiver still maps (freed once it lets go).
        base = model_base

        def new_sync(path: str, chunk_bytes: int = chunk, ref_bytes: int | None = None) -> WeightSync:
            """A sync of its own for `path` (its transport and engine layout are set when it is made)."""
            s = WeightSync([engine], transport=_transport(one_copy=path_of(path) == "one_copy", ref_bytes=ref_bytes),
                           chunk_bytes=chunk_bytes, timeout=600, check_finite=False,
                           engine_layout=path_of(path) != "packed",
                           reuse_plan=os.environ.get("STREAMSYNC_REUSE_PLAN", "1") == "1")
            s.version = version
            return s

        sync: WeightSync

        async def push(window: int) -> tuple[float, int, Any]:
            _reset_peak()
            report = await sync.push(model, max_inflight=window, version=next_version())
            return report.seconds, _peak() - base, report

        async def bit_exact(step: int, *windows: int) -> tuple[bool, list[str], Any]:
            """Every weight changes, then a push at each window; the receiver's checksums match the export."""
            mismatched: list[str] = []
            n, report = 0, None
            for i, w in enumerate(windows):
                _perturb(model, step + i)
                _, _, report = await push(w)
                got = await engine.checksums(device=True)
                want = await _trainer_digests(sync, model)
                n = len(want)
                mismatched += sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
            return not mismatched and n == len(specs), mismatched, report

        # Two windows, interleaved so that drifts of the machine hit both alike. Paths (one copy, packed) run
        # in blocks, each with a sync and transport of its own: switching drops the other's pool and
        # mappings, which no steady push pays.
        configs = {"w4": 4, "w1": 1}
        by_path: dict[str, dict[str, Any]] = {}
        for pi, path in enumerate(paths):
            sync = new_sync(path)
            await sync.connect()
            await receiver_graphs(path)
            # First pushes: the pool grows to the window (1, then 4); their peaks are the memory figures.
            _, peak1, _ = await push(1)
            _, peak4_first, _ = await push(4)
            log(f"  [{path}] first pushes done; peak extra: window 1 {peak1 / 1e9:.2f} GB, "
                f"window 4 {peak4_first / 1e9:.2f} GB")
            for _ in range(args.warmup):
                for w in configs.values():
                    await push(w)
            times: dict[str, list[float]] = {k: [] for k in configs}
            peaks4: list[int] = []  # steady pushes (the first ones may still see an earlier pool in limbo)
            reports: dict[str, list[Any]] = {k: [] for k in configs}
            names = list(configs)
            for r in range(args.repeat):
                for k in names[r % len(names):] + names[:r % len(names)]:  # rotate which goes first
                    s, peak, report = await push(configs[k])
                    times[k].append(s)
                    reports[k].append(report)
                    if configs[k] == 4:
                        peaks4.append(peak)
            if args.profile and pi == 0:  # where the sender's host time goes, in window-4 pushes
                import cProfile
                import io
                import pstats

                with cProfile.Profile() as prof:
                    for _ in range(args.profile):
                        await push(4)
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                log(f"  sender profile, {args.profile} window-4 pushes (cProfile slows it down):\n{text.getvalue()}")
            # Where a steady window-4 push spends its time: the sender's stage busy times and the receiver's
            # host time per op (from its line read to its reply written).
            b0 = await rx_busy()
            split = [await push(4) for _ in range(3)]
            rx_split = busy_since(b0, await rx_busy(), 3)
            tx_busy = {k: statistics.median(r[2].stage_seconds[k] for r in split) * 1e3
                       for k in split[0][2].stage_seconds}
            log(f"  [{path}] window-4 push {statistics.median(r[0] for r in split) * 1e3:.2f} ms; sender busy (ms): "
                + ", ".join(f"{k} {v:.1f}" for k, v in tx_busy.items()) + "; receiver busy per push (ms): "
                + _busy_text(rx_split))
            _timeline(f"[{path}] one window-4 push", split[-1][2])
            if trace_dir:  # one traced push of each configuration, for the record
                sync.trace_dir = Path(trace_dir) / path
                for w in configs.values():
                    await push(w)
                sync.trace_dir = None
            med = {k: statistics.median(v) for k, v in times.items()}
            log(f"  [{path}] window 4: {med['w4'] * 1e3:.2f} ms, window 1: {med['w1'] * 1e3:.2f} ms, " + "".join(
                f"{k}: {v * 1e3:.2f} ms, " for k, v in med.items() if k not in ("w1", "w4"))
                + f"floor {floor_s * 1e3:.2f} ms")
            # Bit-exactness: every weight changes, one more push, compare checksums on the device; and once
            # more at window 1.
            exact, mismatched, final = await bit_exact(99 + 10 * pi, 4, 1)
            log(f"  [{path}] bit-exact: {exact} ({len(specs)} tensors compared)")
            by_path[path] = {"med": med, "times": times, "reports": reports, "peak4": max(peaks4), "peak1": peak1,
                             "exact": exact, "mismatched": mismatched, "final": final,
                             "ref_stats": ref_counts(split[-1][2]),
                             "receiver_graphs": (await engine.call("status")).get("graphs"),
                             "tx_busy": tx_busy, "rx_busy": rx_split}
            await sync.close()

        # Chunk-size sweep at window 4 (fresh pool per size): the packed path's chunk budget, and the one-copy
        # path's budget of referenced bytes per chunk (its packed budget stays `chunk`).
        sweep = []
        packed = [p for p in paths if path_of(p) == "packed"][:1]
        sweeps = [(p, "chunk_bytes", m) for m in args.sweep_mib for p in packed]
        sweeps += [(paths[0], "ref_bytes", m) for m in args.ref_sweep_mib if path_of(paths[0]) == "one_copy"]
        for path, knob, mib in sweeps:
            await receiver_graphs(path)
            if knob == "chunk_bytes":
                sync = new_sync(path, chunk_bytes=int(mib * MiB))
            else:
                sync = new_sync(path, ref_bytes=int(mib * MiB))
            await sync.connect()
            await push(4)
            await push(4)
            ts = [(await push(4))[0] for _ in range(3)]
            sweep.append({knob: int(mib * MiB), "chunk_bytes": sync.chunk_bytes, "path": path,
                          "push_ms_window4": statistics.median(ts) * 1e3, "chunks": len(sync.plan(model)[1])})
            log(f"  sweep ({path}): {knob} {mib:g} MiB -> {sweep[-1]['push_ms_window4']:.2f} ms "
                f"({sweep[-1]['chunks']} chunks)")
            await sync.close()

    os.environ.pop("STREAMSYNC_RECEIVER_PROFILE", None)
    if args.profile and rx_profile.exists():
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(str(rx_profile), stream=text).sort_stats("tottime").print_stats(25)
        log(f"  receiver profile, whole run:\n{text.getvalue()}")
    main = by_path[paths[0]]
    med, times, reports = main["med"], main["times"], main["reports"]
    t1, t4 = med["w1"], med["w4"]
    med4 = reports["w4"][sorted(range(len(times["w4"])), key=lambda i: times["w4"][i])[len(times["w4"]) // 2]]
    exact = all(b["exact"] for b in by_path.values())
    rows = []
    for path, b in by_path.items():
        rows.append({"model": shape["label"], "path": path, "bytes": nbytes, "chunk_bytes": chunk,
                     "floor_ms": floor_s * 1e3, "push_ms_window4": b["med"]["w4"] * 1e3,
                     "push_ms_window1": b["med"]["w1"] * 1e3,
                     "window4_over_floor": b["med"]["w4"] / floor_s, "peak_extra_bytes": b["peak4"],
                     "bit_exact": b["exact"], "connect_ms": cold.get(path, {}).get("connect_ms"),
                     "first_push_ms": cold.get(path, {}).get("first_push_ms"),
                     "second_push_ms": cold.get(path, {}).get("second_push_ms"), "ref_stats": b["ref_stats"],
                     "receiver_replays_graphs": ":plain" not in path,
                     "receiver_graph_stats": b["receiver_graphs"], "sender_busy_ms_window4": b["tx_busy"],
                     "receiver_busy_ms_window4": b["rx_busy"]})
    result = {
        "model": f"{shape['label']} shape, bf16",
        "trainer": "megatron-core GPTModel (TP=1, local spec) via MegatronSource" if trainer == "megatron"
        else trainer,
        "source": type(source).__name__,
        "receiver": "FusedModel (qkv_proj, gate_up_proj, stacked experts) in another process, same GPU",
        "transport": "cuda_ipc" if _cuda() else "shm",
        "path": paths[0],
        "rows": rows,
        "cold": cold,
        "bytes": nbytes,
        "check_finite_ms": round(check_finite_s * 1e3, 3),
        "tensors": len(specs),
        "chunks": len(plans),
        "chunk_bytes": chunk,
        "max_chunk_bytes": max_chunk,
        "copy_rate_gbps": rate / 1e9,
        "floor_ms": floor_s * 1e3,
        "two_plain_copies_ms": two_copies * 1e3,
        "trainer_alone_ms_window4": statistics.median(alone_times[1:]) * 1e3,
        "push_ms_window1": t1 * 1e3,
        "push_ms_window4": t4 * 1e3,
        "push_ms_all": {p: {k: [x * 1e3 for x in v] for k, v in b["times"].items()} for p, b in by_path.items()},
        "window4_over_floor": t4 / floor_s,
        "speedup_window4_vs_1": t1 / t4,
        "stage_busy_ms_window4": {k: v * 1e3 for k, v in med4.stage_seconds.items()},
        "peak_extra_bytes": main["peak4"],
        "peak_extra_bytes_window1": main["peak1"],
        "peak_bound_bytes": int(4 * max(chunk, max_chunk) * 1.1),
        "bit_exact": exact,
        "mismatched": [m for b in by_path.values() for m in b["mismatched"]][:10],
        "final_push_ms": main["final"].seconds * 1e3,
        "sweep_window4": sweep,
        "configs": {k: {"window": w} for k, w in configs.items()},
        "latency_us": probe_us,
        "repeat": args.repeat,
        "warmup": args.warmup,
    }
    result["checks"] = {
        "window4_within_1.5x_floor": result["window4_over_floor"] <= 1.5,
        "window4_at_or_below_floor": result["window4_over_floor"] <= 1.0,
        "window4_at_least_1.6x_faster_than_window1": t1 / t4 >= 1.6,
        "peak_within_window_x_chunk_plus_10pct": result["peak_extra_bytes"] <= result["peak_bound_bytes"],
        "bit_exact": exact,
    }
    return result


# --------------------------------------------------------------------------------------------- entry


def _table(results: list[dict[str, Any]]) -> str:
    rows = [("model", "path", "GB", "chunk MiB", "floor ms", "w1 ms", "w4 ms", "w4/floor",
             "peak GB", "connect ms", "1st push ms", "2nd push ms", "exact")]

    def ms(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "-"

    for r in results:
        for row in r["rows"]:
            rows.append((r["model"][:32], row["path"], f"{row['bytes'] / 1e9:.2f}", f"{row['chunk_bytes'] / MiB:g}",
                         ms(row["floor_ms"]), ms(row["push_ms_window1"]),
                         ms(row["push_ms_window4"]), f"{row['window4_over_floor']:.2f}x",
                         f"{row['peak_extra_bytes'] / 1e9:.2f}", ms(row["connect_ms"]), ms(row["first_push_ms"]),
                         ms(row["second_push_ms"]), str(row["bit_exact"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    global _DEV
    if args.smoke:
        _DEV = torch.device("cpu")
        name = "cpu (smoke run)"
    elif not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks --device cuda: no CUDA device")
    else:
        props = torch.cuda.get_device_properties(0)
        name = props.name
        log(f"device {props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")
    rate = copy_rate(64 * MiB if args.smoke else 4 * GiB)
    log(f"device-to-device copy: {rate / 1e12:.2f} TB/s (read + written)")
    work = Path(tempfile.mkdtemp(prefix="streamsync-bench-cuda-"))
    results = []
    failed = {}
    for key in args.models:
        try:
            results.append(await _bench_model(key, args, rate, work))
        except Exception:  # the other models still run, and the failure is in the log and the JSON
            failed[key] = traceback.format_exc()
            log(f"{key}: FAILED\n{failed[key]}")
        _free_cached()  # the model just benchmarked is gone: give its memory back before the next
    if not results:
        raise SystemExit("every model failed")
    out = dict(results[0])
    out["failed"] = failed
    out["others"] = results[1:]
    out["environment"] = {"gpu": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                          "copy_rate_gbps": rate / 1e9, "date": time.strftime("%Y-%m-%d")}
    print()
    print(_table(results))
    return out


def busy_since(b0: dict[str, list[float]], b1: dict[str, list[float]], n: int = 1) -> dict[str, list[float]]:
    """A receiver's host time per op between two `status` answers (`busy_ms`), per push over `n` pushes:
    {op: [calls, ms]}."""
    out = {}
    for op, (c, ms) in b1.items():
        c0, ms0 = b0.get(op, [0, 0.0])
        if ms < ms0:  # the counter started over (a transport's own, made afresh at each connect)
            c0, ms0 = 0, 0.0
        if op != "status" and c > c0:
            out[op] = [(c - c0) / n, (ms - ms0) / n]
    return out


def _timeline(what: str, report: Any) -> None:
    """A push's spans in time order (ms from its start): what waits on what."""
    tr = report.trace
    if tr is None or len(tr.spans) > 400:
        return
    log(f"  {what}, timeline (ms, stage:chunk start-end): " + " ".join(
        f"{sp.stage}{'@' + sp.receiver if sp.receiver else ''}:{sp.chunk} {sp.start * 1e3:.1f}-{sp.end * 1e3:.1f}"
        for sp in sorted(tr.spans, key=lambda sp: sp.start)) + f" | end {(tr.wall or 0) * 1e3:.1f}")


def _busy_text(busy: dict[str, list[float]]) -> str:
    return ", ".join(f"{op} {ms:.1f} ({calls:g} calls)" for op, (calls, ms) in busy.items())


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--models", type=lambda s: s.split(","), default=["8b", "8b:2048", "moe"],
                    help="of: " + ",".join(SHAPES) + "; NAME:MIB sets that entry's chunk size; NAME+ddp wraps the "
                    "megatron trainer in Megatron's DistributedDataParallel (distributed optimizer)")
    ap.add_argument("--trainer", choices=["megatron", "module"], default="megatron")
    ap.add_argument("--gpu-chunk-mib", type=float, default=1024)
    ap.add_argument("--sweep-mib", type=lambda s: [float(x) for x in s.split(",") if x], default=[512, 2048, 4096])
    ap.add_argument("--ref-sweep-mib", type=lambda s: [float(x) for x in s.split(",") if x],
                    default=[1024, 2048, 8192, 16384], help="one-copy path: referenced bytes per chunk to sweep")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--trace-dir", type=Path)
    ap.add_argument("--paths", type=lambda s: s.split(","),
                    default=["one_copy", "one_copy:plain", "packed:plain", "engine_layout", "engine_layout:plain"],
                    help="data paths to measure, the first is the default: one_copy (tensors that are views of "
                    "trainer storages go by CUDA IPC reference; the rest packed, in the engine's layout), packed "
                    "(every tensor packed, HF names), engine_layout (every tensor packed; runs that make up one of "
                    "the receiver's fused tensors go as that tensor). ':plain': the receiver loads every tensor "
                    "with a call of its own each push, as vLLM does (by default it replays a repeated chunk's "
                    "copies as a captured CUDA graph); ':copies': the receiver's captured loads "
                    "record PyTorch's copies, not one segment copy kernel (streamsync.kernels); ':torchipc': "
                    "one copy shares trainer storages through PyTorch's CUDA IPC, not the CUDA driver's "
                    "(streamsync.transports.cuda_ipc.driver)")
    ap.add_argument("--cold-repeat", type=int, default=3, help="fresh syncs (connect, first and second push) for "
                    "the default path and its ':copies' / ':torchipc' variants, interleaved; the table gives their "
                    "medians, the log each (the first also meets a receiver that never loaded)")
    ap.add_argument("--profile", type=int, default=0, help="profile this many window-4 pushes on the sender "
                    "(cProfile) and print where its host time goes")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run of this script (use --models tiny,tiny-moe)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Entry from `python -m benchmarks --device cuda` (its --json/--repeat/--warmup apply; the rest default)."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    ns = defaults.parse_args([])
    for k, v in vars(args).items():
        if k in ("json", "repeat", "warmup") or k in vars(ns):
            setattr(ns, k, v)
    t0 = time.perf_counter()
    result = anyio.run(_main, ns)
    result["wall_s"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    os.environ.setdefault("STREAMSYNC_LOG", "warning")
    t0 = time.perf_counter()
    result = anyio.run(_main, args)
    result["wall_s"] = time.perf_counter() - t0
    write_json(args.json, result)


if __name__ == "__main__":
    main()
