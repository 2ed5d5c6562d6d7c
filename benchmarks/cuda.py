"""One GPU: a colocated push measured against the copy floor, in one run.

Trainer: a megatron-core GPTModel (TP=1, bf16, local layer spec) on the GPU, with Qwen3-8B shapes (`--models
8b`) or a Qwen3-MoE shape (`moe`: Qwen3-30B-A3B's layer shapes, 12 of its 48 layers), pushed with
`WeightSync.push(model)` (MegatronSource: Megatron -> HF conversion). `NAME+ddp` wraps it in Megatron's
DistributedDataParallel with the distributed optimizer (its parameters are views of a few flat buffers);
`NAME:MIB` sets the entry's chunk size. Receiver: another process on the same GPU holding vLLM-style fused
parameters (`streamsync.testing.fused.FusedModel`: qkv_proj, gate_up_proj, stacked experts), loading through
`WeightReceiver` + `load_weights`, the code path of the vLLM backend. Transport: CUDA IPC.

Data paths (`--paths`, the first is the default; see --help): one_copy, packed, engine_layout, and variants of
how the receiver loads (`:plain`, `:copies`) and how storages are shared (`:torchipc`). Each path's steady
pushes run in a block, on a WeightSync and transport of its own, into the one receiver.

Measured, for each model and path:
  floor      one pack copy plus one unpack copy of the model's bytes at the device-to-device copy rate
             measured in this run (bytes read + written): 2 x 2 x bytes / rate
  push       `PushReport.seconds` (start_update .. finish_update): median of `--repeat` pushes at window 4 and
             at window 1, interleaved, after `--warmup` rounds of both
  peak       the trainer's peak extra device memory in a push (max allocated minus what it held before any
             sync existed: the send-buffer pool and conversion temporaries)
  bit_exact  after changing every weight and pushing (at window 4, then at window 1), the receiver's tensors
             (HF views of its fused parameters) checksum equal to the trainer's HF export, on the device
  cold       a fresh sync's connect(), first push and second push; the default path and its `:copies` /
             `:torchipc` variants over `--cold-repeat` fresh syncs (medians), the others once
  busy       where a steady window-4 push spends its time: the sender's stage busy times, the receiver's host
             time per op and per part of an update, the push's one-copy counts (from its trace)
  sweeps     window 4 over chunk budgets (`--sweep-mib`, the first packed path) and over referenced bytes per
             chunk (`--ref-sweep-mib`, a one-copy default path), a fresh sync per point
Also: the latencies of one chunk's control path (an RPC, a thread hop, an event wait, a copy launch), the
NaN/inf scan a default push adds (the pushes here run without it), and the trainer alone (the pipeline with no
engine). `--trace-dir` keeps traces of the first model's first pushes and of one push per configuration.

`--smoke` runs the script on CPU (shared memory instead of CUDA IPC, the one-copy paths left out; use the tiny
shapes), to check its code paths where no GPU is. `python -m benchmarks --device cuda` runs it with its
defaults where one GPU is visible.

    python -m benchmarks.cuda --json OUT.json [--models 8b,moe] [--paths one_copy,packed:plain] [--repeat 7]
        [--trace-dir DIR]
    python -m benchmarks.cuda --smoke --models tiny,tiny-moe --repeat 2 --json OUT.json
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import anyio
import torch

from benchmarks.report import ref_counts, write_json
from streamsync.checksum import device_digests
from streamsync.engines.receiver import ReceiverEngine
from streamsync.pack import dtype_name
from streamsync.report import GiB, MiB, PushReport
from streamsync.sources.base import Source
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
    # Moonlight-16B-A3B (DeepSeek-V3 architecture: MLA without a query low rank, the first layer dense, then 64
    # routed experts beside 2 shared ones, the router's expert bias), 12 of its 27 layers: trainer and engine
    # fit one 80 GB GPU side by side.
    "moonlight": dict(label="Moonlight-16B-A3B layers x12 (MLA, MoE 64 experts + 2 shared)", arch="deepseek-v3",
                      vocab=163840, hidden=2048, layers=12, heads=16, kv_heads=16, head_dim=192, ffn=11264,
                      experts=64, moe_ffn=1408, shared_ffn=2816, first_dense=1, q_lora=0, kv_lora=512,
                      rope_dim=64, nope_dim=128, v_dim=128),
    "tiny-mla": dict(label="tiny DeepSeek-V3", arch="deepseek-v3", vocab=1024, hidden=128, layers=2, heads=4,
                     kv_heads=4, head_dim=96, ffn=256, experts=8, moe_ffn=64, shared_ffn=64, first_dense=1,
                     q_lora=0, kv_lora=512, rope_dim=64, nope_dim=32, v_dim=32),
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


def _init_dist() -> None:
    """This process as the one rank of a process group (NCCL on a GPU, gloo elsewhere)."""
    import torch.distributed as dist

    from streamsync.testing.megatron import free_port

    if not dist.is_initialized():
        dist.init_process_group("nccl" if _cuda() else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))


def _init_megatron() -> None:
    global _dist_ready
    if _dist_ready:
        return
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from streamsync.models.megatron import init_parallel

    _init_dist()
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
    if tiny.arch not in ("qwen3", "qwen3-moe"):  # MLA and dense-then-MoE layers: the block spec's builder
        from streamsync.models.megatron import build_model

        (built,) = build_model(tiny, use_cpu_initialization=not _cuda(), perform_initialization=True)
        return _wrap(built.to(_DEV), ddp)
    cfg = tiny.transformer_config(use_cpu_initialization=not _cuda(), perform_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=tiny.padded_vocab(1), max_sequence_length=4096, pre_process=True,
                     post_process=True, share_embeddings_and_output_weights=False, position_embedding_type="rope")
    return _wrap(model.to(_DEV), ddp)


def _wrap(model: torch.nn.Module, ddp: bool) -> torch.nn.Module:
    if ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        cfg: Any = model.config
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


def build_fsdp2(shape: dict[str, Any]) -> torch.nn.Module:
    """The HF-named module of `build_module` sharded by FSDP2 (`fully_shard`, one unit per decoder layer and
    one for the rest) over this process's one rank: its parameters are DTensors, which a push gathers
    (`ModuleSource`: each tensor's `full_tensor`, then packed) instead of sending them by reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init_dist()
    model = build_module(shape)
    mesh = init_device_mesh(_DEV.type, (1,))
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers.children() if layers is not None else ():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
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


async def latency_probe(engine: ReceiverEngine) -> dict[str, float]:
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


# --------------------------------------------------------------------------------------------- receiver figures


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


def _timeline(what: str, report: PushReport) -> None:
    """A push's spans in time order (ms from its start): what waits on what."""
    tr = report.trace
    if tr is None or len(tr.spans) > 400:
        return
    log(f"  {what}, timeline (ms, stage:chunk start-end): " + " ".join(
        f"{sp.stage}{'@' + sp.receiver if sp.receiver else ''}:{sp.chunk} {sp.start * 1e3:.1f}-{sp.end * 1e3:.1f}"
        for sp in sorted(tr.spans, key=lambda sp: sp.start)) + f" | end {(tr.wall or 0) * 1e3:.1f}")


def _busy_text(busy: dict[str, list[float]]) -> str:
    return ", ".join(f"{op} {ms:.1f} ({calls:g} calls)" for op, (calls, ms) in busy.items())


# --------------------------------------------------------------------------------------------- one model


def path_of(path: str) -> str:
    """The data path of a `--paths` entry, without its variants: "one_copy:plain" -> "one_copy"."""
    return path.split(":")[0]


@dataclass
class Trainer:
    """One `--models` entry, built: the model and what a push of it carries."""

    key: str  # its SHAPES key
    label: str
    kind: str  # the trainer built: "megatron", "module" or "module (fallback)"
    model: torch.nn.Module
    chunk: int  # chunk_bytes of every push (but the chunk-size sweep's)
    source: Source
    specs: list[tuple[str, str, list[int]]]  # the HF tensors a push sends: (name, dtype, shape)
    nbytes: int
    chunks: int
    max_chunk: int


@dataclass
class Floor:
    """What the pushes are measured against (seconds)."""

    floor: float  # one pack plus one unpack copy of every byte at the measured copy rate
    two_copies: float  # the same, as plain copy_ calls on the trainer's parameters
    check_finite: float  # the NaN/inf scan a default push adds (the pushes here run without it)
    alone: list[float]  # window-4 pushes with no engine (gather, convert, pack), the first one included


def build_trainer(entry: str, args: argparse.Namespace) -> Trainer:
    """The trainer of a `--models` entry ("8b:2048": 2048 MiB chunks; "8b+ddp": wrapped in Megatron's DDP), on
    the device, and its chunk plan. A megatron trainer that fails to build falls back to an HF-named module."""
    key, _, mib = entry.partition(":")
    key, ddp = key.removesuffix("+ddp"), key.endswith("+ddp")
    shape = dict(SHAPES[key])
    if ddp:
        shape["label"] += " (Megatron DDP, distributed optimizer)"
    chunk = int(float(mib or args.gpu_chunk_mib) * MiB)
    log(f"{shape['label']}: building the trainer ({args.trainer}) ...")
    t0 = time.perf_counter()
    kind = args.trainer
    try:
        model = build_megatron(shape, ddp=ddp) if kind == "megatron" else build_module(shape)
    except Exception:
        if kind != "megatron" or ddp:
            raise
        log("megatron trainer failed; falling back to an HF-named module:\n" + traceback.format_exc())
        kind, model = "module (fallback)", build_module(shape)
    _sync()
    log(f"  built in {time.perf_counter() - t0:.1f}s")
    source, plans = WeightSync([], chunk_bytes=chunk).plan(model)
    t = Trainer(key, shape["label"], kind, model, chunk, source,
                [(s.name, dtype_name(s.dtype), list(s.shape)) for p in plans for s in p.specs],
                sum(s.nbytes for p in plans for s in p.specs), len(plans), max(p.nbytes for p in plans))
    log(f"  {type(source).__name__}: {len(t.specs)} HF tensors, {t.nbytes / 1e9:.2f} GB in {t.chunks} chunks "
        f"(largest {t.max_chunk / 1e9:.2f} GB)")
    return t


async def measure_floor(t: Trainer, rate: float, one_copy: bool) -> Floor:
    """The copy floor at `rate`, the same copies made by plain copy_ calls, the NaN/inf scan the pushes leave
    out, and the trainer alone (on the default path's transport: `one_copy`)."""
    floor = 2 * 2 * t.nbytes / rate
    log(f"  copy floor {floor * 1e3:.2f} ms")
    two_copies = measured_two_copies([p.detach() for p in t.model.parameters()])
    log(f"  two plain copies of the trainer's parameters: {two_copies * 1e3:.2f} ms")
    check_finite = _check_finite_seconds(t.source)
    log(f"  check_finite scan (on by default, off in the pushes below): {check_finite * 1e3:.2f} ms")
    alone = await _trainer_alone(t, one_copy)
    return Floor(floor, two_copies, check_finite, alone)


def _check_finite_seconds(source: Source) -> float:
    """The NaN/inf scan a default push adds (`streamsync.plan.finite`, one sync), median of 3 after one.
    The pushes here run with check_finite=False, so they compare with the copy floor."""
    from streamsync.plan.finite import nonfinite

    scans = []
    for _ in range(4):
        t0 = time.perf_counter()
        nonfinite(list(source.local_tensors()))
        _sync()
        scans.append(time.perf_counter() - t0)
    return statistics.median(scans[1:])


async def _trainer_alone(t: Trainer, one_copy: bool) -> list[float]:
    """Four window-4 pushes through the pipeline with no engine: gather, convert, pack; nothing is sent."""
    alone = WeightSync([], transport=_transport(one_copy=one_copy), chunk_bytes=t.chunk, check_finite=False)
    times = [(await alone.push(t.model, max_inflight=4)).seconds for _ in range(1 + 3)]
    await alone.close()
    _free_cached()
    return times


class Bench:
    """One trainer pushing into one receiver process: a sync of its own per path, one version count across
    them, the receiver's counters. `base`: the trainer's device memory before any sync existed (the model),
    which the peak extra memory is measured against: the pool counts, and buffers of an earlier sync that a
    receiver still maps (freed once it lets go)."""

    #: the steady configurations: their windows, interleaved so that drifts of the machine hit both alike
    CONFIGS: ClassVar[dict[str, int]] = {"w4": 4, "w1": 1}

    def __init__(self, t: Trainer, floor: Floor, engine: ReceiverEngine, args: argparse.Namespace, base: int,
                 trace_dir: Path | None) -> None:
        self.t, self.floor, self.engine, self.args, self.base, self.trace_dir = t, floor, engine, args, base, trace_dir
        self.version = 0

    def next_version(self) -> int:
        self.version += 1
        return self.version

    async def rx_busy(self) -> dict[str, list[float]]:
        """The receiver's host time per op so far, and per part of an update ("update.open", ...)."""
        st = await self.engine.call("status")
        busy = st.get("busy_ms") or {}
        calls = busy.get("update", [0, 0.0])[0]
        return {**busy, **{f"update.{k}": [calls, ms] for k, ms in (st.get("update_split_ms") or {}).items()}}

    async def receiver_graphs(self, path: str) -> None:
        """How the receiver loads on `path`. ":plain": every tensor with its own call each push, as a vLLM engine
        does; ":copies": captured loads record PyTorch's copies instead of the segment copy kernel."""
        await self.engine.call("capture", on=":plain" not in path, kernel=":copies" not in path)

    def new_sync(self, path: str, *, chunk_bytes: int | None = None, ref_bytes: int | None = None) -> WeightSync:
        """A fresh sync and transport for `path`, both set up for it when made (nothing pooled, planned,
        exported or mapped). ":torchipc": trainer storages shared through PyTorch's reduce/rebuild instead of
        the CUDA driver."""
        transport = _transport(one_copy=path_of(path) == "one_copy", ref_bytes=ref_bytes,
                               ipc="torch" if ":torchipc" in path else "driver")
        sync = WeightSync([self.engine], transport=transport, chunk_bytes=chunk_bytes or self.t.chunk, timeout=600,
                          check_finite=False, engine_layout=path_of(path) != "packed",
                          reuse_plan=os.environ.get("STREAMSYNC_REUSE_PLAN", "1") == "1")
        sync.version = self.version
        return sync

    async def push(self, sync: WeightSync, window: int) -> tuple[float, int, PushReport]:
        """One push: its seconds, the trainer's peak extra device memory in it, its report."""
        _reset_peak()
        report = await sync.push(self.t.model, max_inflight=window, version=self.next_version())
        return report.seconds, _peak() - self.base, report

    async def bit_exact(self, sync: WeightSync, step: int, *windows: int) -> tuple[bool, list[str], PushReport]:
        """Every weight changes, then a push at each window; after each, the receiver's checksums (on the
        device) must match the trainer's HF export. Returns (exact, mismatched names, the last report)."""
        mismatched: list[str] = []
        n, report = 0, None
        for i, w in enumerate(windows):
            _perturb(self.t.model, step + i)
            _, _, report = await self.push(sync, w)
            got = await self.engine.checksums(device=True)
            want = await _trainer_digests(sync, self.t.model)
            n = len(want)
            mismatched += sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        assert report is not None
        return not mismatched and n == len(self.t.specs), mismatched, report

    # -- cold pushes -------------------------------------------------------------------------------------

    async def cold_pushes(self, paths: list[str]) -> dict[str, dict[str, Any]]:
        """Per path, a fresh sync's connect(), first push and second push; the default (first) path and its
        ":copies" / ":torchipc" variants `--cold-repeat` times, interleaved (their connect and push figures are
        medians over those syncs, each in `runs`), the other paths once."""
        again = [p for p in paths if p.replace(":copies", "").replace(":torchipc", "") == paths[0]]
        cold_runs = [(p, i) for i in range(self.args.cold_repeat) for p in again]
        cold_runs += [(p, 0) for p in paths if p not in again]
        cold: dict[str, dict[str, Any]] = {}
        for path, rep in cold_runs:
            runs = cold.get(path, {}).get("runs", [])
            cold[path] = await self.cold_push(path, rep)
            runs.append({k: cold[path][k] for k in ("connect_ms", "first_push_ms", "second_push_ms")})
            cold[path]["runs"] = runs
            if len(runs) > 1:  # the first also met a fresh receiver
                for k in ("connect_ms", "first_push_ms", "second_push_ms"):
                    cold[path][k] = statistics.median(r[k] for r in runs)
        return cold

    async def cold_push(self, path: str, rep: int) -> dict[str, Any]:
        """One fresh sync on `path`: connect, a first push (traced into `--trace-dir`), a second push; the
        receiver's host time over connect and the first push, and the sender's side of its calls."""
        await self.receiver_graphs(path)
        sync = self.new_sync(path)
        b0 = await self.rx_busy()
        _sync()
        t0 = time.perf_counter()
        await sync.connect()
        t1 = time.perf_counter()
        # The update split's transport counters (map_storages) are the new receiver transport's: from here.
        b0.update({k: v for k, v in (await self.rx_busy()).items() if k.startswith("update.")})
        t1b = time.perf_counter()
        if self.trace_dir:
            sync.trace_dir = self.trace_dir / f"first-push-{path}"
        rpc0 = {k: list(v) for k, v in self.engine.rpc_seconds.items()}
        r1 = await sync.push(self.t.model, version=self.next_version())
        t2 = time.perf_counter() - (t1b - t1)
        sync.trace_dir = None
        # The sender's side of the first push's calls: [calls, request to reply ms, of it encoding + writing ms]
        zero = [0, 0.0, 0.0]
        rpc = {op: [v[0] - rpc0.get(op, zero)[0], (v[1] - rpc0.get(op, zero)[1]) * 1e3,
                    (v[2] - rpc0.get(op, zero)[2]) * 1e3] for op, v in self.engine.rpc_seconds.items()}
        first_rx = busy_since(b0, await self.rx_busy())
        r2 = await sync.push(self.t.model, version=self.next_version())
        out = {"connect_ms": (t1 - t0) * 1e3, "first_push_ms": r1.seconds * 1e3,
               "first_push_wall_ms": (t2 - t1) * 1e3, "second_push_ms": r2.seconds * 1e3,
               "first_push_stage_busy_ms": {k: v * 1e3 for k, v in r1.stage_seconds.items()},
               "exports": ref_counts(r1), "connect_and_first_push_receiver_busy_ms": first_rx,
               "first_push_sender_rpc_ms": rpc}
        log(f"  cold {path} (fresh sync {rep + 1}): connect {out['connect_ms']:.1f} ms, "
            f"first push {r1.seconds * 1e3:.1f} ms, second {r2.seconds * 1e3:.1f} ms; first push busy (ms): "
            + ", ".join(f"{k} {v:.1f}" for k, v in out["first_push_stage_busy_ms"].items())
            + "; receiver, connect and first push (ms): " + _busy_text(first_rx)
            + "; sender exports: " + str(out["exports"])
            + "; sender's update calls (calls, request to reply ms, of it writing ms): "
            + str({k: [round(x, 1) for x in v] for k, v in rpc.items() if v[0]}))
        _timeline(f"cold {path}: first push", r1)
        await sync.close()
        del sync
        _free_cached()
        return out

    # -- steady pushes -----------------------------------------------------------------------------------

    async def steady(self, pi: int, path: str) -> dict[str, Any]:
        """One path's block of steady pushes on a sync of its own: first pushes (the pool grows to the window;
        their peaks are the memory figures), `--warmup` rounds, `--repeat` rounds of every configuration in
        rotating order, where a window-4 push spends its time, one traced push per configuration, and
        bit-exactness. Paths run in blocks: switching drops the other's pool and mappings, which no steady
        push pays."""
        sync = self.new_sync(path)
        await sync.connect()
        await self.receiver_graphs(path)
        _, peak1, _ = await self.push(sync, 1)
        _, peak4_first, _ = await self.push(sync, 4)
        log(f"  [{path}] first pushes done; peak extra: window 1 {peak1 / 1e9:.2f} GB, "
            f"window 4 {peak4_first / 1e9:.2f} GB")
        for _ in range(self.args.warmup):
            for w in self.CONFIGS.values():
                await self.push(sync, w)
        times, reports, peaks4 = await self._timed(sync)
        if self.args.profile and pi == 0:
            await self._sender_profile(sync)
        tx_busy, rx_busy, last = await self._where_time_goes(sync, path)
        if self.trace_dir:  # one traced push of each configuration, for the record
            sync.trace_dir = self.trace_dir / path
            for w in self.CONFIGS.values():
                await self.push(sync, w)
            sync.trace_dir = None
        med = {k: statistics.median(v) for k, v in times.items()}
        log(f"  [{path}] window 4: {med['w4'] * 1e3:.2f} ms, window 1: {med['w1'] * 1e3:.2f} ms, "
            f"floor {self.floor.floor * 1e3:.2f} ms")
        exact, mismatched, final = await self.bit_exact(sync, 99 + 10 * pi, 4, 1)
        log(f"  [{path}] bit-exact: {exact} ({len(self.t.specs)} tensors compared)")
        out = {"med": med, "times": times, "reports": reports, "peak4": max(peaks4), "peak1": peak1,
               "exact": exact, "mismatched": mismatched, "final": final, "ref_stats": ref_counts(last),
               "receiver_graphs": (await self.engine.call("status")).get("graphs"),
               "tx_busy": tx_busy, "rx_busy": rx_busy}
        await sync.close()
        return out

    async def _timed(self, sync: WeightSync) -> tuple[dict[str, list[float]], dict[str, list[PushReport]],
                                                       list[int]]:
        """`--repeat` rounds of every configuration, rotating which goes first: (seconds and reports per
        configuration, the window-4 pushes' peaks)."""
        names = list(self.CONFIGS)
        times: dict[str, list[float]] = {k: [] for k in names}
        reports: dict[str, list[PushReport]] = {k: [] for k in names}
        peaks4: list[int] = []  # steady pushes (the first ones may still see an earlier pool in limbo)
        for r in range(self.args.repeat):
            for k in names[r % len(names):] + names[:r % len(names)]:
                s, peak, report = await self.push(sync, self.CONFIGS[k])
                times[k].append(s)
                reports[k].append(report)
                if self.CONFIGS[k] == 4:
                    peaks4.append(peak)
        return times, reports, peaks4

    async def _sender_profile(self, sync: WeightSync) -> None:
        """Where the sender's host time goes in `--profile` window-4 pushes (cProfile, printed)."""
        import cProfile
        import io
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(self.args.profile):
                await self.push(sync, 4)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        log(f"  sender profile, {self.args.profile} window-4 pushes (cProfile slows it down):\n{text.getvalue()}")

    async def _where_time_goes(self, sync: WeightSync, path: str) -> tuple[dict[str, float],
                                                                          dict[str, list[float]], PushReport]:
        """Three window-4 pushes: the sender's stage busy ms (medians), the receiver's host time per op per push
        (from its line read to its reply written), and the last push's report."""
        b0 = await self.rx_busy()
        split = [await self.push(sync, 4) for _ in range(3)]
        rx = busy_since(b0, await self.rx_busy(), 3)
        tx = {k: statistics.median(r[2].stage_seconds[k] for r in split) * 1e3 for k in split[0][2].stage_seconds}
        log(f"  [{path}] window-4 push {statistics.median(r[0] for r in split) * 1e3:.2f} ms; sender busy (ms): "
            + ", ".join(f"{k} {v:.1f}" for k, v in tx.items()) + "; receiver busy per push (ms): " + _busy_text(rx))
        _timeline(f"[{path}] one window-4 push", split[-1][2])
        return tx, rx, split[-1][2]

    # -- sweeps ------------------------------------------------------------------------------------------

    async def sweeps(self, paths: list[str]) -> list[dict[str, Any]]:
        """Window 4 over a range of budgets, a fresh sync per point: the first packed path's chunk budget
        (`--sweep-mib`), and the default path's budget of referenced bytes per chunk when it is one copy
        (`--ref-sweep-mib`; its packed budget stays the chunk size)."""
        packed = [p for p in paths if path_of(p) == "packed"][:1]
        points = [(p, "chunk_bytes", m) for m in self.args.sweep_mib for p in packed]
        points += [(paths[0], "ref_bytes", m) for m in self.args.ref_sweep_mib if path_of(paths[0]) == "one_copy"]
        return [await self.sweep_point(path, knob, mib) for path, knob, mib in points]

    async def sweep_point(self, path: str, knob: str, mib: float) -> dict[str, Any]:
        """Two pushes to warm up, then the median of three, at window 4 with `knob` at `mib` MiB."""
        await self.receiver_graphs(path)
        sync = self.new_sync(path, **{knob: int(mib * MiB)})
        await sync.connect()
        await self.push(sync, 4)
        await self.push(sync, 4)
        ts = [(await self.push(sync, 4))[0] for _ in range(3)]
        point = {knob: int(mib * MiB), "chunk_bytes": sync.chunk_bytes, "path": path,
                 "push_ms_window4": statistics.median(ts) * 1e3, "chunks": len(sync.plan(self.t.model)[1])}
        log(f"  sweep ({path}): {knob} {mib:g} MiB -> {point['push_ms_window4']:.2f} ms ({point['chunks']} chunks)")
        await sync.close()
        return point


def _print_receiver_profile(profile: Path) -> None:
    """The receiver process's cProfile over the whole run (written when it exits)."""
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(str(profile), stream=text).sort_stats("tottime").print_stats(25)
    log(f"  receiver profile, whole run:\n{text.getvalue()}")


def model_result(t: Trainer, floor: Floor, cold: dict[str, dict[str, Any]], by_path: dict[str, dict[str, Any]],
                 sweep: list[dict[str, Any]], probe_us: dict[str, float], rate: float,
                 args: argparse.Namespace) -> dict[str, Any]:
    """One model's result: a row per path, and the default (first) path's figures at the top level."""
    main = by_path[next(iter(by_path))]
    med, times, reports = main["med"], main["times"], main["reports"]
    t1, t4 = med["w1"], med["w4"]
    med4 = reports["w4"][sorted(range(len(times["w4"])), key=lambda i: times["w4"][i])[len(times["w4"]) // 2]]
    exact = all(b["exact"] for b in by_path.values())
    result = {
        "model": f"{t.label} shape, bf16",
        "trainer": "megatron-core GPTModel (TP=1, local spec) via MegatronSource" if t.kind == "megatron"
        else t.kind,
        "source": type(t.source).__name__,
        "receiver": "FusedModel (qkv_proj, gate_up_proj, stacked experts) in another process, same GPU",
        "transport": "cuda_ipc" if _cuda() else "shm",
        "path": next(iter(by_path)),
        "rows": [_row(t, floor, path, b, cold.get(path, {})) for path, b in by_path.items()],
        "cold": cold,
        "bytes": t.nbytes,
        "check_finite_ms": round(floor.check_finite * 1e3, 3),
        "tensors": len(t.specs),
        "chunks": t.chunks,
        "chunk_bytes": t.chunk,
        "max_chunk_bytes": t.max_chunk,
        "copy_rate_gbps": rate / 1e9,
        "floor_ms": floor.floor * 1e3,
        "two_plain_copies_ms": floor.two_copies * 1e3,
        "trainer_alone_ms_window4": statistics.median(floor.alone[1:]) * 1e3,
        "push_ms_window1": t1 * 1e3,
        "push_ms_window4": t4 * 1e3,
        "push_ms_all": {p: {k: [x * 1e3 for x in v] for k, v in b["times"].items()} for p, b in by_path.items()},
        "window4_over_floor": t4 / floor.floor,
        "speedup_window4_vs_1": t1 / t4,
        "stage_busy_ms_window4": {k: v * 1e3 for k, v in med4.stage_seconds.items()},
        "peak_extra_bytes": main["peak4"],
        "peak_extra_bytes_window1": main["peak1"],
        "peak_bound_bytes": int(4 * max(t.chunk, t.max_chunk) * 1.1),
        "bit_exact": exact,
        "mismatched": [m for b in by_path.values() for m in b["mismatched"]][:10],
        "final_push_ms": main["final"].seconds * 1e3,
        "sweep_window4": sweep,
        "configs": {k: {"window": w} for k, w in Bench.CONFIGS.items()},
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


def _row(t: Trainer, floor: Floor, path: str, b: dict[str, Any], cold: dict[str, Any]) -> dict[str, Any]:
    """The table row of one path."""
    return {"model": t.label, "path": path, "bytes": t.nbytes, "chunk_bytes": t.chunk, "floor_ms": floor.floor * 1e3,
            "push_ms_window4": b["med"]["w4"] * 1e3, "push_ms_window1": b["med"]["w1"] * 1e3,
            "window4_over_floor": b["med"]["w4"] / floor.floor, "peak_extra_bytes": b["peak4"],
            "bit_exact": b["exact"], "connect_ms": cold.get("connect_ms"), "first_push_ms": cold.get("first_push_ms"),
            "second_push_ms": cold.get("second_push_ms"), "ref_stats": b["ref_stats"],
            "receiver_replays_graphs": ":plain" not in path, "receiver_graph_stats": b["receiver_graphs"],
            "sender_busy_ms_window4": b["tx_busy"], "receiver_busy_ms_window4": b["rx_busy"]}


async def _bench_model(entry: str, args: argparse.Namespace, rate: float, work: Path) -> dict[str, Any]:
    """One `--models` entry: build it, measure its floor, start a receiver process, then its cold pushes, the
    latencies of one chunk's control path, the steady pushes of every path and the sweeps."""
    t = build_trainer(entry, args)
    paths = [p for p in args.paths if _cuda() or not p.startswith("one_copy")]  # one copy: CUDA IPC only
    floor = await measure_floor(t, rate, one_copy=path_of(paths[0]) == "one_copy")
    _free_cached()
    base = _allocated()
    specs_path = work / f"{t.key}.json"
    specs_path.write_text(json.dumps(t.specs))
    log("  starting the receiver process (fused parameters, same GPU) ...")
    rx_profile = work / f"{t.key}-receiver.prof"
    if args.profile:
        os.environ["STREAMSYNC_RECEIVER_PROFILE"] = str(rx_profile)
    trace_dir = args.trace_dir if entry == args.models[0] else None  # traces of the first entry only
    with ReceiverProcess(str(specs_path), device=_DEV.type, fused=True, start_timeout=600, name=f"rx-{t.key}") as rp:
        bench = Bench(t, floor, rp.engine(timeout=600), args, base, trace_dir)
        cold = await bench.cold_pushes(paths)
        probe_us = await latency_probe(bench.engine)
        log(f"  latencies (us): {', '.join(f'{k} {v:.0f}' for k, v in probe_us.items())}")
        _free_cached()
        by_path = {path: await bench.steady(pi, path) for pi, path in enumerate(paths)}
        sweep = await bench.sweeps(paths)
    os.environ.pop("STREAMSYNC_RECEIVER_PROFILE", None)
    if args.profile and rx_profile.exists():
        _print_receiver_profile(rx_profile)
    return model_result(t, floor, cold, by_path, sweep, probe_us, rate, args)


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
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    os.environ.setdefault("STREAMSYNC_LOG", "warning")
    t0 = time.perf_counter()
    result = anyio.run(_main, args)
    result["wall_s"] = time.perf_counter() - t0
    write_json(args.json, result)


if __name__ == "__main__":
    main()
