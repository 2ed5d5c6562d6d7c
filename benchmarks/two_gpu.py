"""Two GPUs: NCCL pushes against a raw NCCL broadcast, and TP=2 megatron trainers.

Cases (`--cases`; each guarded: one failing does not stop the others, its row then carries `error`):

  remote-tp1   A megatron-core GPTModel with Qwen3-8B shapes, TP=1 on GPU 0, pushed with
               CollectiveTransport("nccl") into a receiver process on GPU 1 that holds vLLM-style fused
               parameters (each chunk is packed, broadcast once, and copied out by the receiver). Timed,
               interleaved: window 4, window 1, and window 4 packing with plain copies instead of the captured
               CUDA graph. Also the receiver's host time per push, bit-exactness on the device after each
               configuration, one traced window-4 push (`--trace`), and window 4 at every `--sweep-mib` chunk
               size. Against `raw_broadcast_ms`: plain torch.distributed NCCL broadcasts of the same byte count
               between two other processes (GPU 0 -> GPU 1, in pieces of the chunk size, two buffers
               alternating, async), measured in the same run.
  tp2-dense    A megatron-core trainer with TP=2 over both GPUs (one process per GPU, NCCL default group),
  tp2-moe      Qwen3-8B widths (12 layers) / Qwen3-30B-A3B widths (6 layers, 128 experts, EP=2, expert TP 1):
               * gathers: coalesced against per-parameter all-gathers (push time, gather busy time,
                 collectives), pushing remotely as below;
               * remote: rank 0 broadcasts over NCCL to a receiver on GPU 1, rank 1 takes part in the gathers;
               * colocated: every rank sends by CUDA IPC to a receiver on its own GPU after one set of gathers
                 (MegatronSource(every_rank_sends=True)); bit-exact on both receivers.
               Weights: a seeded HF state made on rank 0's GPU and broadcast to rank 1, loaded into the shards
               with load_hf_weights; receivers are checked against that state's device checksums.

NVLink multicast stays off in every process started from here (NCCL_NVLS_ENABLE=0 and its kin). `--smoke`
runs every case on CPU (gloo instead of NCCL, shared memory instead of CUDA IPC, tiny shapes), so the code
paths can be checked where no GPU is. `python -m benchmarks --device cuda` runs the default cases where two
GPUs are visible.

    python -m benchmarks.two_gpu --json OUT.json [--cases remote-tp1,tp2-dense,tp2-moe] [--trace TRACE.json]
    python -m benchmarks.two_gpu --smoke --json OUT.json
    python -m benchmarks.two_gpu --merge A.json B.json --json OUT.json     # the rows of several runs in one file
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import torch

from benchmarks.report import pack_graphs, write_json
from streamsync.report import MiB, PushReport

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Shapes (TinyModel fields). The smoke ones keep every code path (GQA, q/k norms, MoE, EP) at toy sizes.
DENSE_TP2 = dict(arch="qwen3", vocab=151936, hidden=4096, layers=12, heads=32, kv_heads=8, head_dim=128, ffn=12288)
MOE_TP2 = dict(arch="qwen3-moe", vocab=151936, hidden=2048, layers=6, heads=32, kv_heads=4, head_dim=128, ffn=6144,
               experts=128, moe_ffn=768)
SMOKE_DENSE = dict(arch="qwen3", vocab=1024, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=256)
SMOKE_MOE = dict(arch="qwen3-moe", vocab=1024, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=256,
                 experts=8, moe_ffn=64)
LABELS = {"tp2-dense": "Qwen3-8B widths x12 layers", "tp2-moe": "Qwen3-30B-A3B widths x6 layers (128 experts)"}


def log(msg: str) -> None:
    print(f"[2gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timeline(report: Any) -> dict[str, float]:
    """Where a push's wall time went, from its trace (ms from the push's start): until the first chunk's send
    began (start_update, the first gather, convert and pack launch), the sends, and what followed the last one
    (finish_update, which waits for the receiver's last copies)."""
    sends = [s for s in report.trace.stage_spans() if s.stage == "send"]  # not the per-engine send spans
    if not sends:
        return {}
    first, last = min(s.start for s in sends), max(s.end for s in sends)
    return {"before_first_send_ms": first * 1e3, "sends_ms": (last - first) * 1e3,
            "after_last_send_ms": report.seconds * 1e3 - last * 1e3,
            "send_ms_per_chunk": (last - first) * 1e3 / len(sends)}


class Setup:
    """Devices and backends of this run: two GPUs, or the CPU smoke stand-ins."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.dev = ["cpu", "cpu"] if smoke else ["cuda:0", "cuda:1"]
        self.backend = "gloo" if smoke else "nccl"
        self.rx_device = ["cpu", "cpu"] if smoke else ["cuda:0", "cuda:1"]

    def sync(self) -> None:
        if not self.smoke:
            torch.cuda.synchronize()

    def colocated_transport(self, device: str) -> Any:
        if self.smoke:
            from streamsync.transports.shm import ShmTransport

            return ShmTransport()
        from streamsync.transports.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(device=device)


# --------------------------------------------------------------------------------------------- raw broadcast


def _raw_worker(rank: int, world: int, nbytes: int, chunks: list[int], repeat: int, smoke: bool) -> dict[int, float]:
    """Plain torch.distributed broadcasts of `nbytes` from rank 0 in pieces of each chunk size (two buffers
    alternating, async), timed on rank 0 from a barrier to the last piece's completion."""
    import torch.distributed as dist

    dev = torch.device("cpu" if smoke else f"cuda:{rank}")
    out: dict[int, float] = {}
    for chunk in chunks:
        bufs = [torch.empty(chunk, dtype=torch.uint8, device=dev) for _ in range(2)]
        sizes = [min(chunk, nbytes - off) for off in range(0, nbytes, chunk)]
        times = []
        for i in range(2 + repeat):
            dist.barrier()
            if not smoke:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            works = [dist.broadcast(bufs[j % 2][:n], src=0, async_op=True) for j, n in enumerate(sizes)]
            for w in works:
                w.wait()
            if not smoke:
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[chunk] = _med(times) * 1e3
        del bufs
        if not smoke:
            torch.cuda.empty_cache()
    return out


def raw_broadcast_ms(setup: Setup, nbytes: int, chunks: list[int], repeat: int = 5) -> dict[int, float]:
    from streamsync.testing.megatron import launch

    return launch(_raw_worker, 2, nbytes, chunks, repeat, setup.smoke, timeout=240, collective_timeout=120,
                  backend=setup.backend)[0]


# --------------------------------------------------------------------------------------------- remote, TP=1


class RemoteBench:
    """remote-tp1: a TP=1 megatron trainer on GPU 0 pushing over NCCL into a receiver process on GPU 1."""

    #: the timed configurations: (window, captured pack), interleaved; "w4_uncaptured" packs with plain copies
    #: each push (no captured CUDA graph): what the capture gains
    CONFIGS: ClassVar[dict[str, tuple[int, bool]]] = {"w4": (4, True), "w1": (1, True), "w4_uncaptured": (4, False)}

    def __init__(self, setup: Setup, args: argparse.Namespace) -> None:
        self.setup, self.args = setup, args
        self.chunk = int(args.chunk_mib * MiB)

    def build(self) -> None:
        """The trainer (megatron-core GPTModel, TP=1) on the first device, and what a push of it carries."""
        from benchmarks import cuda as one
        from streamsync.pack import dtype_name
        from streamsync.sync import WeightSync

        one._DEV = torch.device(self.setup.dev[0])
        shape = one.SHAPES["tiny" if self.setup.smoke else "8b"]
        self.label = f"{shape['label']} (megatron-core TP=1, GPU 0 -> GPU 1)"
        log(f"remote-tp1: building {shape['label']} (megatron-core, TP=1) on {self.setup.dev[0]} ...")
        self.model = one.build_megatron(shape)
        self.setup.sync()
        _, plans = WeightSync([], chunk_bytes=self.chunk).plan(self.model)
        self.chunks = len(plans)
        self.specs = [(s.name, dtype_name(s.dtype), list(s.shape)) for p in plans for s in p.specs]
        self.nbytes = sum(s.nbytes for p in plans for s in p.specs)

    async def run(self) -> list[dict[str, Any]]:
        """Every measurement of the case, one row for the default chunk size and one per other sweep size."""
        from streamsync.sync import WeightSync
        from streamsync.testing.receiver import ReceiverProcess
        from streamsync.transports.collective import CollectiveTransport

        self.build()
        sizes = sorted({int(m * MiB) for m in self.args.sweep_mib} | {self.chunk})
        log(f"  {len(self.specs)} HF tensors, {self.nbytes / 1e9:.2f} GB; raw NCCL broadcast of the same bytes ...")
        self.raw = raw_broadcast_ms(self.setup, self.nbytes, sizes)
        log("  raw: " + ", ".join(f"{c // MiB} MiB {ms:.2f} ms" for c, ms in self.raw.items()))
        work = Path(tempfile.mkdtemp(prefix="streamsync-2gpu-"))
        (work / "specs.json").write_text(json.dumps(self.specs))
        with ReceiverProcess(str(work / "specs.json"), device=self.setup.rx_device[1], fused=True, start_timeout=600,
                             name="rx-gpu1") as rp:
            self.engine = rp.engine(timeout=600)
            self.transport = CollectiveTransport(self.setup.backend, device=self.setup.dev[0], group_timeout=120)
            self.sync = WeightSync([self.engine], transport=self.transport, chunk_bytes=self.chunk, timeout=600)
            await self.sync.connect()
            for _ in range(self.args.warmup):
                for window, graphs in self.CONFIGS.values():
                    await self.push(window, graphs)
            times, stages, lines, graph_counts = await self.timed()
            rx = await self.receiver_busy()
            trace_summary = await self.traced(work / "trace")
            exact = await self.bit_exact()
            rows = [self.row(times, stages, lines, graph_counts, rx, trace_summary, exact)]
            rows += [await self.sweep_point(c) for c in sizes if c != self.chunk]
            t0 = time.monotonic()
            await self.sync.close()
            log(f"  close: {time.monotonic() - t0:.2f} s")
        return rows

    async def push(self, window: int, graphs: bool = True) -> PushReport:
        self.transport.graphs = graphs
        return await self.sync.push(self.model, max_inflight=window)

    async def timed(self) -> tuple[dict[str, list[float]], list[dict[str, float]], list[dict[str, float]],
                                   list[dict[str, int]]]:
        """`--repeat` rounds of every configuration, rotating which goes first; before each timed push one
        untimed push of the same configuration (the first push after a change of window or of the captured
        pack pays for the other's buffers and graphs). Returns the seconds per configuration and, of the
        window-4 captured pushes, their stage busy times, timelines and pack-graph counts."""
        names = list(self.CONFIGS)
        times: dict[str, list[float]] = {k: [] for k in names}
        stages: list[dict[str, float]] = []
        lines: list[dict[str, float]] = []
        graph_counts: list[dict[str, int]] = []
        for r in range(self.args.repeat):
            for k in names[r % len(names):] + names[:r % len(names)]:
                await self.push(*self.CONFIGS[k])
                rep = await self.push(*self.CONFIGS[k])
                times[k].append(rep.seconds)
                if k == "w4":
                    stages.append(rep.stage_seconds)
                    lines.append(timeline(rep))
                    graph_counts.append(pack_graphs(rep))
        med = {k: _med(v) for k, v in times.items()}
        raw = self.raw[self.chunk]
        log(f"  chunk {self.chunk // MiB} MiB: window 4 {med['w4'] * 1e3:.2f} ms, window 1 {med['w1'] * 1e3:.2f} ms, "
            f"raw {raw:.2f} ms -> {raw / (med['w4'] * 1e3):.0%} of raw")
        t4u = med["w4_uncaptured"] * 1e3
        log(f"  window 4 without the captured pack: {t4u:.2f} ms ({raw / t4u:.0%} of raw)")
        return times, stages, lines, graph_counts

    async def receiver_busy(self) -> dict[str, list[float]]:
        """The receiver's host time per op per window-4 push (its status counters around three of them)."""
        from benchmarks import cuda as one

        async def counters() -> dict[str, list[float]]:
            st = await self.engine.call("status")
            busy = st.get("busy_ms") or {}
            calls = busy.get("update", [0, 0.0])[0]
            return {**busy, **{f"update.{k}": [calls, ms] for k, ms in (st.get("update_split_ms") or {}).items()}}

        await self.push(4)
        b0 = await counters()
        for _ in range(3):
            await self.push(4)
        rx = one.busy_since(b0, await counters(), 3)
        log(f"  window 4, receiver busy per push (ms): {one._busy_text(rx)}")
        return rx

    async def traced(self, tdir: Path) -> str | None:
        """With `--trace`: one traced window-4 push, its trace copied there; its summary."""
        from streamsync.trace import viewer

        if not self.args.trace:
            return None
        self.sync.trace_dir = tdir
        rep = await self.push(4)
        self.sync.trace_dir = None
        if not rep.trace_path:
            return None
        Path(self.args.trace).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(rep.trace_path, self.args.trace)
        summary = viewer.summary(Path(rep.trace_path))
        log(f"  trace of a window-4 push ({rep.seconds * 1e3:.2f} ms) -> {self.args.trace}\n{summary}")
        return summary

    async def bit_exact(self) -> bool:
        """Every weight changes, then a push of each configuration; after each the receiver's checksums (on
        the device) must match the trainer's HF export."""
        exact = True
        for step, (name, cfg) in enumerate(self.CONFIGS.items(), start=101):
            exact = await self.exact_after(step, *cfg, what=name) and exact
        log(f"  bit-exact: {exact}")
        return exact

    async def exact_after(self, step: int, window: int, graphs: bool = True, what: str = "") -> bool:
        from benchmarks import cuda as one

        one._perturb(self.model, step)
        await self.push(window, graphs)
        got = await self.engine.checksums(device=True)
        want = await one._trainer_digests(self.sync, self.model)
        bad = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
        if bad:
            log(f"  {what or f'window {window}'}: {len(bad)} tensors differ, e.g. {bad[:3]}")
        return not bad and len(want) == len(self.specs)

    def row(self, times: dict[str, list[float]], stages: list[dict[str, float]], lines: list[dict[str, float]],
            graph_counts: list[dict[str, int]], rx: dict[str, list[float]], trace_summary: str | None,
            exact: bool) -> dict[str, Any]:
        """The row of the default chunk size."""
        med = {k: _med(v) for k, v in times.items()}
        stage_ms = {k: _med([s.get(k, 0.0) for s in stages]) * 1e3 for k in (stages[0] if stages else {})}
        line_ms = {k: _med([x[k] for x in lines if k in x]) for k in (lines[0] if lines else {})}
        log(f"  window 4, medians: stage busy {json.dumps({k: round(v, 2) for k, v in stage_ms.items()})}; "
            f"timeline {json.dumps({k: round(v, 2) for k, v in line_ms.items()})}")
        t4, t1, raw = med["w4"], med["w1"], self.raw[self.chunk]
        return {
            "case": "remote-tp1", "model": self.label, "bytes": self.nbytes, "chunk_bytes": self.chunk,
            "chunks": self.chunks, "push_ms_window4": t4 * 1e3, "push_ms_window1": t1 * 1e3, "raw_broadcast_ms": raw,
            "fraction_of_raw_window4": raw / (t4 * 1e3), "window4_over_raw": t4 * 1e3 / raw,
            "fraction_of_raw_window1": raw / (t1 * 1e3), "bit_exact": exact, "stage_busy_ms_window4": stage_ms,
            "timeline_ms_window4": line_ms, "push_ms_window4_uncaptured_pack": med["w4_uncaptured"] * 1e3,
            "pack_graphs_window4": graph_counts[-1] if graph_counts else None, "receiver_busy_ms_per_push": rx,
            "push_ms_all": {k: [x * 1e3 for x in v] for k, v in times.items()}, "trace_summary": trace_summary,
        }

    async def sweep_point(self, size: int) -> dict[str, Any]:
        """Window 4 at another chunk size (the pool starts over), against the raw broadcast in pieces of that
        size; bit-exact after one more push. A size that fails keeps the rest (its row carries `error`)."""
        self.sync.chunk_bytes = size
        self.transport.pool.release()
        try:
            for _ in range(self.args.warmup):
                await self.push(4)
            ts = [(await self.push(4)).seconds for _ in range(self.args.repeat)]
            n_chunks = len(self.sync.plan(self.model)[1])
            ok = await self.exact_after(200 + size // MiB, 4)
        except Exception as e:
            log(f"  sweep chunk {size // MiB} MiB failed:\n{traceback.format_exc()}")
            return {"case": "remote-tp1", "chunk_bytes": size, "error": f"{type(e).__name__}: {e}"}
        t4, raw = _med(ts) * 1e3, self.raw[size]
        log(f"  sweep chunk {size // MiB} MiB ({n_chunks} chunks): window 4 {t4:.2f} ms, raw {raw:.2f} ms -> "
            f"{raw / t4:.0%} of raw, bit-exact {ok}")
        return {"case": "remote-tp1", "model": self.label, "bytes": self.nbytes, "chunk_bytes": size,
                "chunks": n_chunks, "push_ms_window4": t4, "push_ms_window1": None, "raw_broadcast_ms": raw,
                "fraction_of_raw_window4": raw / t4, "window4_over_raw": t4 / raw, "bit_exact": ok}


async def remote_tp1(setup: Setup, args: argparse.Namespace) -> list[dict[str, Any]]:
    return await RemoteBench(setup, args).run()


# --------------------------------------------------------------------------------------------- TP=2 trainers


def _hf_state(tiny: Any, rank: int, device: str, smoke: bool) -> dict[str, torch.Tensor]:
    """A seeded HF state, the same on both ranks: made on rank 0 (on its GPU) and broadcast to rank 1."""
    import torch.distributed as dist

    from streamsync.pack import dtype_from_name

    if smoke:
        return tiny.hf_state(seed=5)
    gen = torch.Generator(device=device).manual_seed(5)
    out = {}
    for name, dt, shape in tiny.hf_specs():
        t = torch.empty(shape, dtype=dtype_from_name(dt), device=device)
        if rank == 0:
            t.normal_(0, 0.02, generator=gen)
        dist.broadcast(t, src=0)
        out[name] = t
    torch.cuda.synchronize()
    return out


def _tp2_worker(rank: int, world: int, key: str, shape: dict[str, Any], ports: dict[str, tuple[int, str]],
                args: argparse.Namespace) -> dict[str, Any]:
    """One rank of a TP=2 case: build and load its shards, then the remote pushes and the colocated ones."""
    import anyio

    from streamsync.models.megatron import TinyModel

    setup = Setup(args.smoke)
    tiny = TinyModel(**shape)
    t0 = time.perf_counter()
    model, want = _tp2_build(rank, setup, tiny)
    out: dict[str, Any] = {"rank": rank, "build_s": time.perf_counter() - t0}

    async def main() -> None:
        out["remote"] = await _tp2_remote(rank, setup, model, tiny, want, ports, args)
        out["colocated"] = await _tp2_colocated(rank, setup, model, tiny, want, ports, args)

    anyio.run(main)
    return out


def _tp2_build(rank: int, setup: Setup, tiny: Any) -> tuple[list[torch.nn.Module], dict[str, str]]:
    """This rank's shards of a megatron-core model (TP=2; EP=2 and expert TP 1 for an MoE) on its device,
    loaded from the seeded HF state; and that state's device checksums (what receivers must hold)."""
    from streamsync.checksum import device_digests
    from streamsync.models.megatron import build_model, init_parallel, load_hf_weights

    dev = setup.dev[rank]
    moe = tiny.experts > 0
    init_parallel(tp=2, ep=2 if moe else 1, etp=1 if moe else None)
    if not setup.smoke:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    # perform_initialization stays on: megatron marks TP parameters (partition_dim) only when it initializes.
    model = build_model(tiny, use_cpu_initialization=setup.smoke)
    if not setup.smoke:
        model = [m.to(dev) for m in model]
    hf = _hf_state(tiny, rank, dev, setup.smoke)
    load_hf_weights(model, hf)
    want = device_digests(hf.items())
    del hf
    if not setup.smoke:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return model, want


async def _tp2_remote(rank: int, setup: Setup, model: list[torch.nn.Module], tiny: Any, want: dict[str, str],
                      ports: dict[str, tuple[int, str]], args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0 pushes to the receiver on GPU 1 over NCCL, rank 1 only gathers: coalesced against per-parameter
    all-gathers (`bucket_bytes=1`) at window 4, in alternating order, and the coalesced push at window 1."""
    from streamsync.engines.receiver import ReceiverEngine
    from streamsync.sources.megatron import MegatronSource
    from streamsync.sync import WeightSync
    from streamsync.transports.collective import CollectiveTransport

    engines = [ReceiverEngine("127.0.0.1", ports["remote"][0], secret=ports["remote"][1], timeout=600,
                              name="rx-remote", device=setup.rx_device[1])] if rank == 0 else []
    transport = CollectiveTransport(setup.backend, device=setup.dev[0], group_timeout=120) if rank == 0 else None
    sync = WeightSync(engines, transport=transport, chunk_bytes=int(args.chunk_mib * MiB), timeout=600)
    await sync.connect()
    options = {"hf_config": tiny.hf_config()}
    sources = {m: MegatronSource(model, bucket_bytes=None if m == "coalesced" else 1, **options)
               for m in ("coalesced", "per_parameter")}
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in sources}
    exact = True

    async def push(mode: str, window: int) -> dict[str, float]:
        rep = await sync.push(sources[mode], max_inflight=window)
        return {"s": rep.seconds, "gather_s": rep.stage_seconds.get("gather", 0.0),
                "collectives": rep.collectives, "chunks": rep.chunks, "bytes": rep.bytes}

    for mode in sources:
        await push(mode, 4)
        if engines:
            exact = exact and await engines[0].checksums(device=True) == want
    w1: list[float] = []
    for r in range(args.repeat):
        order = list(sources) if r % 2 == 0 else list(reversed(sources))
        for mode in order:
            runs[mode].append(await push(mode, 4))
        w1.append((await push("coalesced", 1))["s"])
    await sync.close()
    return {"runs": runs, "window1_s": w1, "exact": exact if engines else None}


async def _tp2_colocated(rank: int, setup: Setup, model: list[torch.nn.Module], tiny: Any, want: dict[str, str],
                         ports: dict[str, tuple[int, str]], args: argparse.Namespace) -> dict[str, Any]:
    """Every rank pushes by CUDA IPC to the receiver on its own GPU, after one set of gathers
    (`every_rank_sends=True`): window 4 and 1 alternating; bit-exact after the first push and the last."""
    from streamsync.engines.receiver import ReceiverEngine
    from streamsync.sources.megatron import MegatronSource
    from streamsync.sync import WeightSync

    mine = ReceiverEngine("127.0.0.1", ports[f"colocated{rank}"][0], secret=ports[f"colocated{rank}"][1],
                          timeout=600, name=f"rx-colocated{rank}", device=setup.rx_device[rank])
    sync = WeightSync([mine], transport=setup.colocated_transport(setup.dev[rank]),
                      chunk_bytes=int(args.chunk_mib * MiB), timeout=600)
    source = MegatronSource(model, every_rank_sends=True, hf_config=tiny.hf_config())
    first = await sync.push(source)
    exact = await mine.checksums(device=True) == want
    times: dict[int, list[float]] = {4: [], 1: []}
    for _ in range(args.warmup):
        await sync.push(source, max_inflight=4)
    for r in range(args.repeat):
        for w in ((4, 1) if r % 2 == 0 else (1, 4)):
            times[w].append((await sync.push(source, max_inflight=w)).seconds)
    exact = exact and await mine.checksums(device=True) == want
    await sync.close()
    return {"times": {str(k): v for k, v in times.items()}, "exact": exact, "collectives": first.collectives,
            "chunks": first.chunks, "bytes": first.bytes}


def tp2(setup: Setup, key: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from streamsync.models.megatron import TinyModel
    from streamsync.models.synthetic import save_specs
    from streamsync.testing.megatron import launch
    from streamsync.testing.receiver import ReceiverProcess

    shape = (SMOKE_MOE if key == "tp2-moe" else SMOKE_DENSE) if setup.smoke else (
        MOE_TP2 if key == "tp2-moe" else DENSE_TP2)
    tiny = TinyModel(**shape)
    label = LABELS[key] + (" (smoke: tiny)" if setup.smoke else "")
    work = Path(tempfile.mkdtemp(prefix=f"streamsync-{key}-"))
    specs = save_specs(tiny.hf_specs(), work / "specs.json")
    log(f"{key}: {label}; receivers: colocated on {setup.rx_device[0]} and {setup.rx_device[1]}, "
        f"remote on {setup.rx_device[1]}; launching 2 ranks ({setup.backend}) ...")
    where = {"colocated0": setup.rx_device[0], "colocated1": setup.rx_device[1], "remote": setup.rx_device[1]}

    def start(k: str) -> ReceiverProcess:
        return ReceiverProcess(str(specs), device=where[k], fused=True, start_timeout=600, name=f"rx-{k}")

    futures: dict[str, Any] = {}
    try:
        with ThreadPoolExecutor(len(where)) as pool:  # started together: each allocates a whole model
            futures = {k: pool.submit(start, k) for k in where}
        rx = {k: f.result() for k, f in futures.items()}
        ranks = launch(_tp2_worker, 2, key, shape, {k: (r.port, r.secret) for k, r in rx.items()}, args,
                       timeout=args.tp2_timeout, collective_timeout=300, backend=setup.backend)
    finally:
        for f in futures.values():
            if f.exception() is None:
                f.result().stop()
    r0 = ranks[0]
    log(f"  built and loaded in {r0['build_s']:.1f} s")
    runs = r0["remote"]["runs"]
    med = {m: {k: _med([x[k] for x in v]) for k in ("s", "gather_s", "collectives")} for m, v in runs.items()}
    nbytes = runs["coalesced"][0]["bytes"] if runs["coalesced"] else None
    chunks = runs["coalesced"][0]["chunks"] if runs["coalesced"] else None
    rows = [{
        "case": f"{key}-gathers", "model": label, "bytes": nbytes, "chunk_bytes": int(args.chunk_mib * MiB),
        "chunks": chunks, "coalesced_ms": med["coalesced"]["s"] * 1e3,
        "per_parameter_ms": med["per_parameter"]["s"] * 1e3,
        "gather_busy_ms": {m: v["gather_s"] * 1e3 for m, v in med.items()},
        "collectives": {m: int(v["collectives"]) for m, v in med.items()},
        "collectives_rank1": {m: int(_med([x["collectives"] for x in v]))
                              for m, v in ranks[1]["remote"]["runs"].items()},
        "bit_exact": r0["remote"]["exact"],
    }, {
        "case": f"{key}-remote", "model": label + ", TP=2 trainer, rank 0 -> receiver on GPU 1 (NCCL)",
        "bytes": nbytes, "chunk_bytes": int(args.chunk_mib * MiB), "chunks": chunks,
        "push_ms_window4": med["coalesced"]["s"] * 1e3, "push_ms_window1": _med(r0["remote"]["window1_s"]) * 1e3,
        "bit_exact": r0["remote"]["exact"],
    }]
    col = [r["colocated"] for r in ranks]
    rows.append({
        "case": f"{key}-colocated", "model": label + ", TP=2 trainer, each rank -> receiver on its GPU (CUDA IPC)",
        "bytes": col[0]["bytes"], "chunk_bytes": int(args.chunk_mib * MiB), "chunks": col[0]["chunks"],
        "push_ms_window4": _med(col[0]["times"]["4"]) * 1e3, "push_ms_window1": _med(col[0]["times"]["1"]) * 1e3,
        "push_ms_window4_rank1": _med(col[1]["times"]["4"]) * 1e3, "collectives": col[0]["collectives"],
        "bit_exact": all(c["exact"] for c in col), "bit_exact_per_rank": [c["exact"] for c in col],
    })
    for row in rows:
        log("  " + json.dumps({k: v for k, v in row.items() if k != "model"}))
    return rows


# --------------------------------------------------------------------------------------------- entry


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, dict):
        return "/".join(_fmt(x, 1) for x in v.values())
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("case", "case"), ("GB", "bytes"), ("chunk MiB", "chunk_bytes"),
            ("w4 ms", "push_ms_window4"), ("w1 ms", "push_ms_window1"),
            ("w4 uncaptured ms", "push_ms_window4_uncaptured_pack"), ("raw ms", "raw_broadcast_ms"),
            ("raw/w4", "fraction_of_raw_window4"), ("raw/w1", "fraction_of_raw_window1"),
            ("coalesced ms", "coalesced_ms"), ("per-param ms", "per_parameter_ms"),
            ("gather busy c/p ms", "gather_busy_ms"), ("collectives c/p", "collectives"), ("exact", "bit_exact")]
    out = [[c for c, _ in cols]]
    for r in rows:
        if "error" in r:
            out.append([r.get("case", "?"), "ERROR: " + str(r["error"])[:100]] + [""] * (len(cols) - 2))
            continue
        cells = []
        for _, k in cols:
            v = r.get(k)
            if k == "bytes" and v is not None:
                v = v / 1e9
            elif k == "chunk_bytes" and v is not None:
                v = f"{v / MiB:g}"
            cells.append(_fmt(v))
        out.append(cells)
    widths = [max(len(row[i]) for row in out) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    for k, v in NVLS_OFF.items():  # every process started from here inherits these
        os.environ.setdefault(k, v)
    os.environ.setdefault("STREAMSYNC_LOG", "warning")
    setup = Setup(args.smoke)
    if not setup.smoke and torch.cuda.device_count() < 2:
        raise SystemExit("two-GPU benchmark: fewer than two CUDA devices visible")
    env = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
           "cuda": torch.version.cuda, "smoke": setup.smoke}
    if not setup.smoke:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    log(f"environment: {env}")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for case in args.cases:
        try:
            if case == "remote-tp1":
                import anyio

                rows += anyio.run(remote_tp1, setup, args)
            elif case in ("tp2-dense", "tp2-moe"):
                rows += tp2(setup, case, args)
            else:
                raise ValueError(f"unknown case {case!r}")
        except Exception as e:  # one case failing keeps the others
            log(f"case {case} FAILED:\n{traceback.format_exc()}")
            rows.append({"case": case, "error": f"{type(e).__name__}: {e}"})
        if not setup.smoke:  # the case's memory back before the next one starts processes on these GPUs
            torch.cuda.empty_cache()
        if args.json:  # write as we go: a later case that hangs and is killed keeps the earlier rows
            _write(args.json, rows, env, t0)
    print()
    print(table(rows), flush=True)
    return {"rows": rows, "environment": env, "wall_s": time.perf_counter() - t0}


def run_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """Entry from `python -m benchmarks --device cuda` (its --repeat/--warmup apply; the rest default)."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ns = ap.parse_args([])
    ns.repeat = max(args.repeat, 5)
    ns.warmup = args.warmup
    ns.json = None
    return run(ns)


def _write(path: Path, rows: list[dict[str, Any]], env: dict[str, Any], t0: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, "environment": env, "wall_s": time.perf_counter() - t0}, indent=2))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cases", type=lambda s: [c for c in s.split(",") if c],
                    default=["remote-tp1", "tp2-dense", "tp2-moe"])
    ap.add_argument("--chunk-mib", type=float, default=1024)
    ap.add_argument("--sweep-mib", type=lambda s: [float(x) for x in s.split(",") if x], default=[256, 512, 2048])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--trace", type=Path, help="copy the trace of one window-4 remote push here")
    ap.add_argument("--tp2-timeout", type=float, default=420)
    ap.add_argument("--smoke", action="store_true", help="every case on CPU (gloo, shared memory, tiny shapes)")


def merge(paths: list[Path]) -> dict[str, Any]:
    """The rows of several runs (e.g. one machine call per case) in one result, in the order given."""
    parts = [json.loads(p.read_text()) for p in paths]
    return {"rows": [r for p in parts for r in p["rows"]], "environment": parts[0]["environment"],
            "runs": [{"file": str(path), "environment": p["environment"], "wall_s": p.get("wall_s")}
                     for path, p in zip(paths, parts, strict=True)]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.two_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the rows here (as each case ends)")
    ap.add_argument("--merge", type=Path, nargs="+", help="instead of running: merge these result files into --json "
                    "and print the table")
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.merge:
        result = merge(args.merge)
        print(table(result["rows"]))
    else:
        result = run(args)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
