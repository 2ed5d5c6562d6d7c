"""Multi-process sharded pushes (`transport="p2p"`) for the tests: trainer ranks under gloo (`megatron.launch`),
engines of sliced receiver processes (`testing.sliced`) started by the test.

`ShardedCase` names a trainer (megatron-core TP/PP/EP, FSDP2 over every rank, or a plain module on every
rank) and the engines' layouts; `start_engines` starts their worker processes; `run_sharded` is the
`launch` worker: build, push `pushes` times with new weights before each, and on rank 0 compare every
worker's slices with the trainer's HF state after each push.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..models.megatron import TinyModel
from ..models.synthetic import StateModule, save_specs
from ..plan.shards import Box
from .receiver import ReceiverProcess
from .sliced import vllm_layout


@dataclass(frozen=True)
class EngineShape:
    """An engine of `tp` workers laid out as vLLM lays out a Qwen/Llama model (experts over the workers with
    `expert_parallel`)."""

    name: str
    tp: int = 2
    expert_parallel: bool = False


@dataclass(frozen=True)
class ShardedCase:
    name: str
    model: TinyModel
    trainer: str = "megatron"  # "megatron", "fsdp2" (every rank one shard of every tensor), "fsdp1", "module"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    engines: tuple[EngineShape, ...] = (EngineShape("e0"),)
    pushes: int = 3
    chunk_bytes: int = 64 << 10
    timeout: float = 60.0
    #: kill this engine's worker (engine index, worker) while the last push runs
    kill: tuple[int, int] | None = None
    #: delta pushes (`WeightSync(delta=True)`); each step then changes about 1 % of the elements
    delta: bool = False
    #: before this push, trainer rank 0's shadow takes the new values of one piece the step changed: its delta
    #: misses them, the worker's box then fails the sender's digest, and the push goes in full on every rank
    corrupt: int | None = None


@dataclass
class ShardedResult:
    rank: int
    exact: list[bool] = field(default_factory=list)     # rank 0: every worker bit-exact after each push
    mismatched: list[str] = field(default_factory=list)
    sent_bytes: dict[int, int] = field(default_factory=dict)  # the plan's bytes per sending rank
    sent_pieces: int = 0  # the plan's pieces this rank sends
    peak_bytes: list[int] = field(default_factory=list)       # this rank's extra memory, per push
    paths: list[str] = field(default_factory=list)
    senders: int = 0
    versions: list[int | None] = field(default_factory=list)
    error: str | None = None
    seconds: list[float] = field(default_factory=list)
    delta_modes: list[str | None] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)  # this rank's bytes on the wire, per push
    #: per push, the bytes this rank's transport moved (through the group and by IPC reference; whole
    #: segments, so the alignment gaps between a destination's pieces count too)
    moved_bytes: list[int] = field(default_factory=list)
    why_full: list[str | None] = field(default_factory=list)
    fallback: list[bool] = field(default_factory=list)
    shadow_bytes: int = 0
    cpu_seconds: list[float] = field(default_factory=list)  # this rank's CPU time (every thread), per push
    #: per push, the report's seconds: the rounds and the pipeline, after the checks and the ranks' agreement
    pipeline_seconds: list[float] = field(default_factory=list)
    #: rank 0: each worker's CPU time per push, by "engine.wN" (read from /proc; empty where it cannot be read)
    worker_cpu_seconds: dict[str, list[float]] = field(default_factory=dict)


def layouts(case: ShardedCase) -> list[list[list[tuple[str, Box]]]]:
    """Per engine, per worker, the (HF name, box) pairs it holds."""
    m = case.model
    return [vllm_layout(m.hf_specs(), e.tp, heads=m.heads, kv_heads=m.kv_heads, head_dim=m.head_dim,
                        expert_parallel=e.expert_parallel) for e in case.engines]


@contextmanager
def start_engines(case: ShardedCase, work: Path) -> Iterator[list[list[ReceiverProcess]]]:
    """The worker processes of every engine of `case`."""
    specs = save_specs(case.model.hf_specs(), work / f"{case.name}.json")
    procs: list[list[ReceiverProcess]] = []
    try:
        for e, per_worker in zip(case.engines, layouts(case), strict=True):
            procs.append([ReceiverProcess(str(specs), holds=holds, name=f"{e.name}.w{w}", threads=1)
                          for w, holds in enumerate(per_worker)])
        yield procs
    finally:
        for group in procs:
            for p in group:
                p.stop()


def endpoints(procs: Sequence[Sequence[ReceiverProcess]]) -> list[list[tuple[int, str, int]]]:
    """(port, secret, pid) of every worker, engine by engine: what the trainer ranks are given."""
    return [[(p.port, p.secret, p.pid) for p in group] for group in procs]


def _build(case: ShardedCase, seed: int) -> tuple[object, Any]:
    """This rank's trainer model holding the HF weights of `seed`, and a function that loads other ones."""
    import torch.distributed as dist

    hf = case.model.hf_state(seed=seed)
    if case.trainer == "megatron":
        from ..models.megatron import build_model, init_parallel, load_hf_weights

        init_parallel(case.tp, case.pp, case.ep)
        model = build_model(case.model)
        load_hf_weights(model, hf)
        return model, lambda state: load_hf_weights(model, state)
    module = StateModule(case.model.hf_specs(), fill="zeros")
    module.load_state_dict(hf)
    if case.trainer == "module":
        def load(state: dict[str, torch.Tensor]) -> None:
            module.load_state_dict(state)
        return module, load
    if case.trainer == "fsdp1":  # flat parameters, one shard of the flattened layer per rank
        from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

        wrapped = FullyShardedDataParallel(module, device_id=torch.device("cpu"), use_orig_params=True)

        def load_fsdp1(state: dict[str, torch.Tensor]) -> None:
            with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT):
                wrapped.load_state_dict(state)
        return wrapped, load_fsdp1
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in module.model.layers.children():  # type: ignore[union-attr, operator]
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)

    def load_sharded(state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        with torch.no_grad():
            for name, p in module.named_parameters():
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                local = p.to_local()
                if local.numel():
                    local.copy_(Box(tuple(offset), tuple(shape)).view(state[name]))
    return module, load_sharded


def run_sharded(rank: int, world_size: int, case: ShardedCase,
                workers: Sequence[Sequence[tuple[int, str, int]]]) -> dict[str, Any]:
    """`launch` worker (module doc)."""
    import anyio

    from ..engines.receiver import ReceiverEngine
    from ..sync import WeightSync
    from ..transports.p2p import P2pTransport
    from .megatron import small_step
    from .sliced import WorkerGroup, expected_slices

    res = ShardedResult(rank)
    model, load = _build(case, seed=0)
    hf = case.model.hf_state(seed=0)
    lays = layouts(case)
    options = {"hf_config": case.model.hf_config()} if case.trainer == "megatron" else {}

    async def main() -> None:
        nonlocal hf
        engines = []
        if rank == 0:
            engines = [WorkerGroup([ReceiverEngine("127.0.0.1", port, secret=secret, name=f"{e.name}.w{w}",
                                                   timeout=case.timeout)
                                    for w, (port, secret, _) in enumerate(workers[i])], e.name)
                       for i, e in enumerate(case.engines)]
        sync = WeightSync(engines, transport=P2pTransport(), chunk_bytes=case.chunk_bytes, timeout=case.timeout,
                          source_options=options, delta=case.delta)
        try:
            for i in range(case.pushes):
                if i:
                    hf = small_step(hf, seed=100 + i) if case.delta else case.model.hf_state(seed=i)
                    load(hf)
                if case.corrupt == i and rank == 0:
                    _corrupt(sync.shadow, hf)
                if case.kill is not None and i == case.pushes - 1 and rank == 0:
                    e, w = case.kill
                    os.kill(workers[e][w][2], signal.SIGKILL)
                if world_size > 1:  # every rank starts the push together: rank 0's checks of the last one are not
                    import torch.distributed as dist  # counted in the others' push times

                    await anyio.to_thread.run_sync(dist.barrier)
                before = _worker_cpu(case, workers) if rank == 0 else {}
                c0, t0 = time.process_time(), time.perf_counter()
                report = await sync.push(model)
                res.seconds.append(time.perf_counter() - t0)
                res.cpu_seconds.append(time.process_time() - c0)
                res.pipeline_seconds.append(report.seconds)
                for key, s in _worker_cpu(case, workers).items() if rank == 0 else ():
                    if key in before:
                        res.worker_cpu_seconds.setdefault(key, []).append(s - before[key])
                res.peak_bytes.append(report.peak_bytes_inflight)
                counts = report.trace.counts if report.trace is not None else {}
                res.moved_bytes.append(int(counts.get("group_bytes", 0) + counts.get("ipc_bytes", 0)))
                res.paths.append(report.path)
                res.senders = report.senders
                if report.delta is not None:
                    res.delta_modes.append(report.delta.mode)
                    res.wire_bytes.append(report.delta.wire_bytes)
                    res.why_full.append(report.delta.why_full)
                    res.fallback.append(report.delta.fallback)
                    res.shadow_bytes = report.delta.shadow_bytes
                res.versions.append(report.version)
                if i == 0:
                    from ..sources.sharded import ShardedSource

                    source = sync.plan(model)[0]
                    assert isinstance(source, ShardedSource)
                    res.sent_bytes = dict(source.plan_.sent_bytes)
                    res.sent_pieces = sum(1 for p in source.plan_.pieces if p.src == rank)
                if rank == 0:
                    ok = True
                    for g, per_worker in zip(engines, lays, strict=True):
                        got = await g.checksums()
                        for w, holds in enumerate(per_worker):
                            want = expected_slices(hf, holds)
                            bad = sorted(n for n in set(got[w]) | set(want) if got[w].get(n) != want.get(n))
                            res.mismatched += [f"{g.name}.w{w}:{n}" for n in bad]
                            ok = ok and not bad
                    res.exact.append(ok)
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
        finally:
            with anyio.CancelScope(shield=True):
                await sync.close()

    anyio.run(main)
    return asdict(res)


def _worker_cpu(case: ShardedCase, workers: Sequence[Sequence[tuple[int, str, int]]]) -> dict[str, float]:
    """CPU seconds (user and system, every thread) each worker process has used so far, from /proc."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for e, group in zip(case.engines, workers, strict=True):
        for w, (_, _, pid) in enumerate(group):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[f"{e.name}.w{w}"] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def _corrupt(shadow: Any, hf: Mapping[str, torch.Tensor]) -> None:
    """Give `shadow` (a PieceShadow) the new value of `hf` at the first element the step changed in a piece that
    has other changes (the piece's delta then misses that one)."""
    from ..delta.codec import bits

    for (name, box, _, _), t in shadow.tensors.items():
        new = box.view(hf[name]).to(t.dtype).contiguous().view(-1)
        flat = t.view(-1)
        diff = (bits(new) != bits(flat)).nonzero().view(-1)
        if diff.numel() > 1:
            flat[int(diff[0])] = new[int(diff[0])]
            return
    raise AssertionError("the step changed no piece this rank sends")


def run_fsdp_single_sender(rank: int, world_size: int, model: TinyModel, port: int, secret: str,
                           pushes: int = 3, trainer: str = "fsdp2") -> dict[str, Any]:
    """`launch` worker: an FSDP2 (or FSDP1: `trainer`) model over every rank pushed through a single sender
    (global rank 0, the default transport) into one plain receiver; the other ranks take part in the gathers.
    Rank 0 returns whether the receiver held the HF state bit for bit after each push."""
    import anyio

    from ..checksum import digests
    from ..engines.receiver import ReceiverEngine
    from ..sync import WeightSync

    case = ShardedCase("fsdp-single", model, trainer=trainer)
    module, load = _build(case, seed=0)
    exact: list[bool] = []

    async def main() -> None:
        engines = [ReceiverEngine("127.0.0.1", port, secret=secret, timeout=60)] if rank == 0 else []
        async with WeightSync(engines, chunk_bytes=32 << 10, timeout=60) as sync:
            for i in range(pushes):
                hf = model.hf_state(seed=i)
                load(hf)
                await sync.push(module)
                if engines:
                    exact.append(await engines[0].checksums() == digests(hf.items()))

    anyio.run(main)
    return {"rank": rank, "exact": exact}


def run_megatron_into_vllm(rank: int, world_size: int, model_dir: str, url: str, out: str, tp: int = 2,
                           pushes: int = 3, prompt: Sequence[int] = (), timeout: float = 120.0) -> dict[str, Any]:
    """`launch` worker: a megatron-core model of TP=`tp` (built from `model_dir`) on every rank pushes through
    `transport="p2p"` into the vLLM server at `url` (rank 0 holds the engine); before each push every rank moves
    its shards (a stand-in optimizer step). After each push rank 0 reads every vLLM worker's weight digests, then
    has the workers load the trainer's HF export from disk (vLLM's own `reload_weights`) and reads them again,
    with greedy tokens on `prompt` both times."""
    import anyio

    from ..engines.vllm import VllmHttpEngine
    from ..models.megatron import export_hf_async, hf_config, megatron_from_hf
    from ..sources.sharded import ShardedSource
    from ..sync import WeightSync
    from ..transports.p2p import P2pTransport
    from ..verify import save_checkpoint
    from .gpu import perturb

    model = megatron_from_hf(model_dir, tp=tp, pp=world_size // tp)
    cfg = hf_config(model_dir)
    res: dict[str, Any] = {"rank": rank, "paths": [], "senders": [], "sent_bytes": {}, "peak_bytes": [],
                           "pushed": [], "loaded": [], "tokens_pushed": [], "tokens_loaded": [], "engine_paths": []}

    async def main() -> None:
        engine = VllmHttpEngine(url, name="tp2", timeout=timeout) if rank == 0 else None
        sync = WeightSync([engine] if engine else [], transport=P2pTransport(), chunk_bytes=256 << 10,
                          timeout=timeout, source_options={"hf_config": cfg})
        try:
            for step in range(1, pushes + 1):
                for chunk in model:
                    perturb(chunk, step)
                report = await sync.push(model)
                res["paths"].append(report.path)
                res["senders"].append(report.senders)
                res["peak_bytes"].append(report.peak_bytes_inflight)
                if step == 1:
                    source = sync.plan(model)[0]
                    assert isinstance(source, ShardedSource)
                    res["sent_bytes"] = dict(source.plan_.sent_bytes)
                state = await export_hf_async(model, dtype=torch.bfloat16, hf_config=cfg)  # every rank takes part
                if engine is None:
                    continue
                assert state is not None
                res["engine_paths"].append(report.engine_paths)
                res["pushed"].append(await engine.rpc("streamsync_weight_digests"))
                res["tokens_pushed"].append((await engine.greedy(prompt, 12))[0])
                ckpt = save_checkpoint(state, like=model_dir, out=Path(out) / f"step{step}", dtype=torch.bfloat16)
                await engine.rpc("reload_weights", weights_path=str(ckpt))
                await engine.reset_cache()  # no KV cached with the pushed weights serves the next request
                res["loaded"].append(await engine.rpc("streamsync_weight_digests"))
                res["tokens_loaded"].append((await engine.greedy(prompt, 12))[0])
        finally:
            with anyio.CancelScope(shield=True):
                await sync.close()
                if engine is not None:
                    await engine.close()

    anyio.run(main)
    return res


__all__ = ["EngineShape", "ShardedCase", "ShardedResult", "endpoints", "layouts", "run_fsdp_single_sender",
           "run_megatron_into_vllm", "run_sharded", "start_engines"]
