"""Megatron-core helpers: HF -> Megatron loading, tiny CPU models, and a gloo process launcher.

* `load_hf_weights(model, hf_state)` fills a (sharded) megatron-core GPTModel with an HF state dict: each
  rank takes its TP / PP / EP shard. It is how tests build models holding known weights, and how an HF
  checkpoint is imported. `export_hf(model)` is the other way: the full HF state dict on rank 0, through
  the same gathers and conversions as a push.
* `TinyModel` describes a small model of one architecture: its HF checkpoint specs and the matching
  megatron-core `GPTModel` (local layer spec, `use_cpu_initialization`, bf16 parameters), built by
  `build_model` under the current `parallel_state`.
* `launch(fn, world_size, ...)` runs `fn` in that many processes joined by gloo, with timeouts everywhere;
  `run_cases` is the worker the multi-process tests use (build, load, push, compare). The processes are forked
  from a server process that imported torch and megatron-core once (`testing.forked`), not each started anew:
  a fresh interpreter spends about 5 s importing them, 20 s for a four-rank launch on two cores (spawned on a
  GPU machine).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import StreamSyncError
from ..models.megatron import TinyModel, build_model, export_hf, export_hf_async, init_parallel, load_hf_weights
from .forked import become

# ------------------------------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> Any:
    """Processes forked from the test helpers' fork server (`testing.forked`), or spawned where there is none.
    Each is given the launching process's environment and working directory (`_worker`)."""
    import torch.multiprocessing as mp

    from .forked import context

    return context() or mp.get_context("spawn")


def _worker(rank: int, world_size: int, port: int, timeout: float, fn: Callable[..., Any], args: tuple,
            results: Any, backend: str = "gloo", env: Mapping[str, str] | None = None, cwd: str | None = None
            ) -> None:
    warnings.filterwarnings("ignore")
    become(env, cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
           collective_timeout: float = 60.0, backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` processes joined by gloo (or NCCL, rank r on GPU r);
    results by rank.

    `fn` must be importable (module level). Raises StreamSyncError with the workers' tracebacks if any
    failed, or after `timeout` seconds (the workers are killed). Collectives time out after
    `collective_timeout`, so a rank that dies cannot hang the others forever.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, collective_timeout, fn, args, results, backend,
                                               env, cwd), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StreamSyncError(f"workers did not finish within {timeout:.0f}s "
                                      f"({len(out)} of {world_size} reported)" + "".join(errors))
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check for workers that died without reporting
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and len(out) + len(errors) < world_size and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        raise StreamSyncError(f"worker(s) died: exit codes {[p.exitcode for p in procs]}"
                                              + "".join(errors)) from None
                continue
            if ok:
                out[rank] = value
            else:
                errors.append(f"\n--- rank {rank} ---\n{value}")
        if errors:
            raise StreamSyncError("worker(s) failed:" + "".join(errors))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)


# ------------------------------------------------------------------------------------------ test cases


@dataclass(frozen=True)
class Case:
    """One multi-process push: a tiny model under one parallel layout, into one receiver."""

    name: str
    model: TinyModel
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    seed: int = 0
    chunk_bytes: int = 32 << 10
    bucket_bytes: int | None = None  # MegatronSource(bucket_bytes=): 1 is one collective per parameter
    pushes: int = 1
    every_rank_sends: bool = False  # each rank pushes into its own receiver (`receivers[f"{name}@{rank}"]`)
    blocking: bool = False  # push through BlockingWeightSync from plain Python (no anyio.run) on every rank
    delta: bool = False  # WeightSync(delta=True); each step then changes about 1 % of the elements (`small_step`)
    engine_version: int = 0  # the version the sender's engine holds before the first push (others cannot know)


@dataclass
class CaseResult:
    name: str
    rank: int
    exact: bool | None = None            # sender only: receiver checksums == HF state's
    export_exact: bool | None = None     # sender only: export_hf(model) == HF state, bit for bit
    mismatched: list[str] = field(default_factory=list)
    collectives: list[int] = field(default_factory=list)   # per push
    setup_collectives: list[int] = field(default_factory=list)
    events: list[tuple[int, str, str]] = field(default_factory=list)  # of the first push
    chunks: int = 0
    params: int = 0                      # Megatron parameters in the plan
    tp_params: int = 0                   # of which split over TP / expert TP
    trace_collectives: int | None = None
    #: the first push's plan: per chunk, [global name, dtype, stage, expert, split over (expert-)TP] per key
    plan: list[list[tuple[str, str, int, bool, bool]]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    is_sender: bool = False
    delta_modes: list[str | None] = field(default_factory=list)  # per push: "full" / "delta" (None: deltas off)
    wire_bytes: list[int] = field(default_factory=list)          # per push, sender only
    versions: list[int] = field(default_factory=list)            # per push, as this rank's report says


def run_cases(rank: int, world_size: int, cases: Sequence[Case],
              receivers: Mapping[str, tuple[int, str]]) -> list[dict]:
    """Worker: for each case, set up parallel_state, build the model, load its HF weights, push (the sender into
    the receiver at `receivers[case.name]`, the other ranks with no engines; with `every_rank_sends` each rank
    into the receiver at `receivers[f"{case.name}@{rank}"]`; each a (port, secret)) and report (`CaseResult`
    dicts)."""
    import anyio
    import torch.distributed as dist

    from ..blocking import BlockingWeightSync
    from ..checksum import digests
    from ..engines.receiver import ReceiverEngine
    from ..report import PushReport
    from ..sources.megatron import MegatronSource
    from ..sync import WeightSync

    out = []
    for case in cases:
        init_parallel(case.tp, case.pp, case.ep, case.etp, case.vpp)
        model = build_model(case.model)
        hf = case.model.hf_state(seed=case.seed)
        load_hf_weights(model, hf)
        res = CaseResult(case.name, rank)
        if case.every_rank_sends:
            target = receivers.get(f"{case.name}@{rank}")
        else:
            target = receivers[case.name] if rank == 0 else None
        engines = ([ReceiverEngine("127.0.0.1", target[0], secret=target[1], timeout=60)]
                   if target is not None else [])
        options = {"hf_config": case.model.hf_config(), "bucket_bytes": case.bucket_bytes,
                   "every_rank_sends": case.every_rank_sends}

        def record(i: int, report: PushReport, source: MegatronSource, case: Case = case,
                   res: CaseResult = res) -> None:
            res.collectives.append(report.collectives)
            res.versions.append(report.version)
            res.delta_modes.append(report.delta.mode if report.delta is not None else None)
            res.wire_bytes.append(report.delta.wire_bytes if report.delta is not None else report.bytes)
            res.setup_collectives.append(source.setup_collectives)
            res.seconds.append(report.seconds)
            if i == 0:
                res.events = list(source.events)
                res.chunks = report.chunks
                res.params = len(source.sent)
                res.tp_params = sum(1 for x in source.table.values() if x.tp is not None)
                res.is_sender = source.is_sender
                assert report.trace is not None
                res.trace_collectives = report.trace.counts.get("collectives")
                res.plan = [[(k, str(source.table[k].dtype).removeprefix("torch."), source.table[k].stage,
                              source.table[k].expert, source.table[k].tp is not None) for k in p.keys]
                            for p in source.plan(case.chunk_bytes)]

        last = {"hf": hf}

        def step(i: int, case: Case = case, model: list = model, last: dict = last) -> dict[str, torch.Tensor]:
            """A training step: new weights, so a push that skipped a tensor would show (a delta case: about 1 %
            of every tensor's elements move, as an optimizer step moves bf16 weights)."""
            hf = (small_step(last["hf"], seed=case.seed + i) if case.delta
                  else case.model.hf_state(seed=case.seed + 1000 * i))
            load_hf_weights(model, hf)
            last["hf"] = hf
            return hf

        def check(got: dict[str, str], hf: dict[str, torch.Tensor], res: CaseResult = res) -> None:
            want = digests(hf.items())
            res.mismatched = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
            res.exact = not res.mismatched

        async def main(case: Case = case, model: list = model, hf: dict[str, torch.Tensor] = hf,
                       engines: list = engines, options: dict = options) -> dict[str, torch.Tensor]:
            sync = WeightSync(engines, chunk_bytes=case.chunk_bytes, timeout=60, source_options=options,
                              delta=case.delta)
            if engines and case.engine_version:  # the engine already holds this version: only its rank knows
                sync.version = case.engine_version
            for i in range(case.pushes):
                # first push: an explicit MegatronSource (to read its counters); later ones: the model itself,
                # as trainers call it (as_source -> MegatronSource, metadata from the cache)
                if i:
                    hf = step(i)
                source = MegatronSource(model, **options)
                record(i, await sync.push(source if i == 0 else model), source)
            if engines:
                check(await engines[0].checksums(), hf)
            await sync.close()
            return hf

        def blocking(case: Case = case, model: list = model, hf: dict[str, torch.Tensor] = hf,
                     engines: list = engines, options: dict = options) -> dict[str, torch.Tensor]:
            """The same pushes from a plain synchronous loop, as Megatron-style trainers are written."""
            with BlockingWeightSync(engines, chunk_bytes=case.chunk_bytes, timeout=60,
                                    source_options=options) as sync:
                for i in range(case.pushes):
                    if i:
                        hf = step(i)
                    source = MegatronSource(model, **options)
                    record(i, sync.push(source if i == 0 else model), source)
                if engines:
                    check(sync.call(engines[0].checksums), hf)
            return hf

        hf = blocking() if case.blocking else anyio.run(main)
        exported = export_hf(model, hf_config=case.model.hf_config())
        if exported is not None:
            res.export_exact = digests(exported.items()) == digests(hf.items())
        out.append(asdict(res))
        dist.barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return out


def small_step(hf: Mapping[str, torch.Tensor], seed: int, fraction: float = 0.01) -> dict[str, torch.Tensor]:
    """`hf` with about `fraction` of every floating tensor's elements scaled by 1.01 (a new bf16 value)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in hf.items():
        t = t.clone()
        if t.is_floating_point():
            m = torch.rand(t.shape, generator=gen) < fraction
            t[m] = (t[m].float() * 1.01 + 1e-3).to(t.dtype)
        out[n] = t
    return out


__all__ = ["Case", "CaseResult", "TinyModel", "build_model", "export_hf", "export_hf_async", "free_port",
           "init_parallel", "launch", "load_hf_weights", "run_cases"]


def ddp_one_copy_pushes(rank: int, world_size: int, tiny: TinyModel, port: int, secret: str, pushes: int = 3
                        ) -> dict[str, Any]:
    """A `launch` worker (GPU tests): `tiny` as a megatron-core GPTModel on this rank's GPU, wrapped in Megatron's
    DDP with the distributed optimizer (every parameter becomes a view of one contiguous buffer per dtype),
    pushed `pushes` times over CUDA IPC into the receiver at `port`, every weight changed between pushes.
    Returns the parameter and storage counts, the sender's exports and references, and per push whether the
    receiver's checksums equal the trainer's HF export."""
    import anyio
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from ..checksum import device_digests
    from ..engines.receiver import ReceiverEngine
    from ..sync import WeightSync
    from ..transports.cuda_ipc.sender import CudaIpcTransport

    init_parallel(tp=1)
    model = build_model(tiny)[0].cuda()
    load_hf_weights(model, tiny.hf_state(seed=3))
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                    model)
    params = list(model.parameters())
    out: dict[str, Any] = {"params": len(params), "storages": len({p.untyped_storage().data_ptr() for p in params}),
                           "exact": []}

    async def main() -> None:
        engine = ReceiverEngine("127.0.0.1", port, secret=secret, timeout=120)
        transport = CudaIpcTransport()
        sync = WeightSync([engine], transport=transport, chunk_bytes=1 << 20)
        counts: list[dict[str, int]] = []
        for step in range(pushes):
            if step:
                torch.manual_seed(step)
                with torch.no_grad():
                    for p in params:
                        p.add_(torch.randn_like(p), alpha=0.01)
            counts.append((await sync.push(model)).trace.counts)
            hf = await export_hf_async(model)
            assert hf is not None
            out["exact"].append(await engine.checksums(device=True) == device_digests(hf.items()))
        out["exports"] = sum(c.get("refs.exports", 0) for c in counts)
        out["referenced"] = sum(c.get("refs.referenced", 0) for c in counts)
        await sync.close()

    anyio.run(main)
    return out
