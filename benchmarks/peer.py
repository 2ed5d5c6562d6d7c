"""streamsync against vLLM's own weight-transfer backends: the same trainer into the same vLLM on the same GPU, in
one run, beside the one-copy floor measured in that run.

Per case (`--cases`, default 8b,moe; the shapes of `benchmarks.cuda.SHAPES`), one trainer: an HF-named bf16
module on the engine's GPU (`benchmarks.cuda.build_module`), which both sides read as it is (vLLM's backends
take HF-named tensors; no conversion on either side). An engine runs one weight-transfer backend, so each side
gets its own engine, started the same way from the same checkpoint (random weights, `load_format="dummy"`) and
stopped before the next starts:

  streamsync   `WeightSync([VllmEngine(llm)])` with the library's defaults (the finite check on, the prefix
               cache reset), `await sync.push(trainer)`.
  ipc          vLLM's `IPCWeightTransferEngine.trainer_send_weights`, unpacked: one CUDA IPC handle per tensor,
               all in one update call; `start_weight_update` before, `finish_weight_update` and
               `reset_prefix_cache` after (the engine reloads layer by layer, vLLM's own path).
  ipc-packed   the same backend with `packed=True`: tensors copied into vLLM's 1 GiB buffers, one update call per
               buffer.
  nccl         vLLM's NCCL backend needs the trainer on another GPU than the engine: run only where two GPUs are
               visible; otherwise its row says so.

The handles travel as vLLM's HTTP mode sends them (pickled, `VLLM_ALLOW_INSECURE_SERIALIZATION=1` in the ipc
engine only), through `LLM.update_weights` in this process. Each side: a first push, `--warmup` pushes not
counted, then `--repeat` steady pushes (every weight changed before each); the wall clock covers the whole
update. After each side's last push, every engine parameter is compared with the trainer's bit for bit (device
digests; routed experts stacked as vLLM's FusedMoE holds them).

The vLLM side is written against vLLM 0.25's trainer API (`IPCTrainerSendWeightsArgs`, the GPU machine's vLLM);
later vLLMs moved it (`weight_transfer.clients`), and there its rows name the import that failed.

    python -m benchmarks.peer --json OUT.json [--cases 8b,moe] [--repeat 5]

Prints a table of times and ratios to the floor and to streamsync's push; the JSON carries the commit, vLLM's
version and the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import faulthandler
import os
import pickle
import queue
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch

import benchmarks.cuda as bc
from benchmarks.report import commit, write_json
from benchmarks.vllm_gpu import _bit_exact, _engine_args, _host_cpu, _timeline
from streamsync.report import GiB

SIDES = ("streamsync", "ipc", "ipc-packed", "nccl")

# `kill -USR1 PID` prints every thread's stack, here and in the engine core: a spawned process runs this module
# again as __mp_main__, so the handler is in vLLM's engine-core process too (`_where`)
faulthandler.register(signal.SIGUSR1, all_threads=True)



async def _bounded(what: str, fn: Callable[[], Any], seconds: float) -> Any:
    """`fn` (blocking vLLM calls) in a thread, given up after `seconds` with an error naming `what`: a stalled
    side costs its row, not the run."""
    try:
        with anyio.fail_after(seconds):
            return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
    except TimeoutError:
        raise TimeoutError(f"{what} did not return within {seconds:.0f} s") from None


def _where(llm: Any) -> None:
    """After a call gave up: every stack here and in the engine core, and the state of vLLM's client (a call
    waits forever on its future once the client's output thread died, core_client.py:808-836)."""
    faulthandler.dump_traceback(all_threads=True)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None:
        return
    thread = getattr(core, "output_queue_thread", None)
    res = getattr(core, "resources", None)
    bc.log(f"  vLLM client: output thread alive {thread is not None and thread.is_alive()}, engine_dead "
           f"{getattr(res, 'engine_dead', None)}, utility calls waiting {len(getattr(core, 'utility_results', {}))}")
    q = getattr(core, "outputs_queue", None)
    while q is not None and not q.empty():
        item = q.get_nowait()
        if isinstance(item, BaseException):
            bc.log(f"  vLLM client's output thread died of: {type(item).__name__}: {item}")
    for proc in getattr(getattr(res, "engine_manager", None), "processes", []):
        if proc.is_alive():
            bc.log(f"  engine core pid {proc.pid}: its stacks follow (SIGUSR1)")
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(2)


class _Calls:
    """Every call into one vLLM engine, its start included, in one daemon thread, in order (as the library's
    `_Caller`): a call that never returns neither runs beside the next one nor keeps the process from exiting
    (an abandoned anyio worker thread is not a daemon). Each call is logged before and after; one that
    passes its time shows every stack (`_where`) and makes the calls after it fail at once."""

    def __init__(self, name: str) -> None:
        self.llm: Any = None
        self.stuck: str | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, fut = self._queue.get()
            if fn is None:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)

    async def __call__(self, what: str, fn: Callable[[], Any], seconds: float) -> Any:
        if self.stuck is not None:
            raise RuntimeError(f"{what} not tried: {self.stuck} never returned")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        bc.log(f"    -> {what}")
        t0 = time.perf_counter()
        self._queue.put((fn, fut))
        try:
            with anyio.fail_after(seconds):
                out = await asyncio.wrap_future(fut)
        except TimeoutError:
            self.stuck = what
            bc.log(f"    !! {what}: no return in {seconds:.0f} s")
            _where(self.llm)
            raise TimeoutError(f"{what} did not return within {seconds:.0f} s") from None
        bc.log(f"    <- {what} ({time.perf_counter() - t0:.3f} s)")
        return out

    def close(self) -> None:
        self._queue.put((None, None))


async def _timed(side: str, pushes: int, trainer: torch.nn.Module, push: Callable[[], Any], seconds: float,
                 run: Callable[..., Any] = _bounded) -> list[float]:
    """Seconds of each push, timed in the thread that makes its calls."""
    out = []
    for i in range(pushes):
        bc._perturb(trainer, i)

        def one() -> float:
            t0 = time.perf_counter()
            push()
            return time.perf_counter() - t0

        out.append(await run(f"{side} push {i}", one, seconds))
        bc.log(f"  {side} push {i}: {out[-1] * 1e3:.1f} ms")
    return out


async def _streamsync(ckpt: str, trainer: torch.nn.Module, args: argparse.Namespace, shape: dict[str, Any]
                      ) -> dict[str, Any]:
    import vllm

    from streamsync.engines.vllm import VllmEngine
    from streamsync.sync import WeightSync
    from streamsync.testing.vllm import stop_llm

    llm = vllm.LLM(model=ckpt, **_engine_args(args, dummy=True))
    engine = VllmEngine(llm, name="streamsync", timeout=600)
    sync = WeightSync([engine], timeout=600)
    times: list[float] = []
    try:
        await sync.connect(trainer)
        for i in range(1 + args.warmup + args.repeat):
            bc._perturb(trainer, i)
            t0 = time.perf_counter()
            report = await sync.push(trainer)
            times.append(time.perf_counter() - t0)
        exact = await _bit_exact(engine, trainer, "module", shape)
    finally:
        await sync.close()
        stop_llm(llm)
        del llm
        bc._free_cached()
    return {"times": times, "bit_exact": exact, "paths": sorted(map(str, set(report.engine_paths.values()))),
            "last_push": {"stage_ms": {k: round(v * 1e3, 3) for k, v in report.stage_seconds.items()},
                          "timeline": _timeline(report)}}


def _ray_for_import() -> None:
    """vLLM 0.25's `ipc_engine` module imports ray at its top, in the trainer and in the engine's workers, and uses
    it only for `send_mode="ray"`, which this benchmark does not take. Where ray is not installed (the GPU
    machine), a module named ray that refuses every use stands in, for this process and the engine processes
    it starts."""
    try:
        import ray  # noqa: F401
        return
    except ImportError:
        pass
    where = Path(tempfile.mkdtemp(prefix="streamsync-peer-ray-"))
    (where / "ray").mkdir()
    (where / "ray" / "__init__.py").write_text(
        '"""Stand-in: ray is not installed here."""\n\n'
        "def __getattr__(name):\n"
        "    raise AttributeError(f'ray is not installed (ray.{name} was asked for)')\n")
    sys.path.insert(0, str(where))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))


async def _ipc(ckpt: str, trainer: torch.nn.Module, args: argparse.Namespace, shape: dict[str, Any]
               ) -> dict[str, dict[str, Any]]:
    """Both ipc sides on one engine started with vLLM's `ipc` backend."""
    import vllm

    from streamsync.engines.vllm import VllmEngine
    from streamsync.testing.vllm import stop_llm

    kw = _engine_args(args, dummy=True)
    kw["weight_transfer_config"] = {"backend": "ipc"}
    env = dict(os.environ)
    _ray_for_import()
    # The pickled handles need VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the engine core (ipc_engine.py:188-194),
    # which then, env cached (core.py:237), attaches type info to every utility result it sends back
    # (serial_utils.py:212-219). This process's decoder refuses such a result unless the variable is set here
    # too, at decode time (serial_utils.py:367-374): the client's output thread dies of it and every later call
    # waits forever (core_client.py:831-832, 875-881). So it stays set until the engine is stopped.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    call = _Calls("peer-ipc-engine")
    out: dict[str, dict[str, Any]] = {}
    llm = None
    try:
        t0 = time.perf_counter()
        llm = call.llm = await call("the ipc engine's start", lambda: vllm.LLM(model=ckpt, **kw), 300)
        bc.log(f"  ipc engine up in {time.perf_counter() - t0:.1f} s")
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine

        await call("init_weight_transfer_engine", lambda: llm.init_weight_transfer_engine({"init_info": {}}),
                   args.call_timeout)

        def send(info: Any) -> None:
            fields = {"names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes,
                      "packed": info.packed,
                      "ipc_handles_pickled": base64.b64encode(pickle.dumps(info.ipc_handles)).decode()}
            if info.tensor_sizes is not None:
                fields["tensor_sizes"] = info.tensor_sizes
            llm.update_weights({"update_info": fields})

        for side, packed in (("ipc", False), ("ipc-packed", True)):
            # vLLM's packed buffers are 1 GiB unless told otherwise, and refuse a larger tensor (an 8B's embedding
            # is 1.24 GB): a user gives the largest tensor's size, as done here
            largest = max(p.numel() * p.element_size() for p in trainer.parameters())
            size = {"packed_buffer_size_bytes": max(1 << 30, largest)} if packed else {}
            targs = IPCTrainerSendWeightsArgs(send_mode=send, packed=packed, **size)

            def push(targs: IPCTrainerSendWeightsArgs = targs, side: str = side) -> None:
                for what, fn in (("start_weight_update", llm.start_weight_update),
                                 ("trainer_send_weights", lambda: IPCWeightTransferEngine.trainer_send_weights(
                                     ((n, p.detach()) for n, p in trainer.named_parameters()), targs)),
                                 ("finish_weight_update", llm.finish_weight_update),
                                 ("reset_prefix_cache", llm.reset_prefix_cache)):
                    if args.trace_calls:
                        bc.log(f"      {side}: {what}")
                    fn()

            try:
                times = await _timed(side, 1 + args.warmup + args.repeat, trainer, push, args.call_timeout, call)
                exact = await _bit_exact(VllmEngine(llm, name=side, timeout=600), trainer, "module", shape)
                out[side] = {"times": times, "bit_exact": exact}
            except Exception as e:  # one side failing leaves the other's row
                traceback.print_exc()
                out[side] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        call.close()
        if llm is not None:
            faulthandler.dump_traceback_later(120)  # a stop that hangs shows where
            try:
                stop_llm(llm)
            finally:
                faulthandler.cancel_dump_traceback_later()
        bc._free_cached()
        os.environ.clear()  # the next engine starts as the first did
        os.environ.update(env)
    return out


async def run_case(case: str, args: argparse.Namespace, rate: float, work: Path) -> dict[str, Any]:
    from streamsync.testing.vllm import shaped_checkpoint

    shape = dict(bc.SHAPES[case])
    ckpt = shaped_checkpoint(work / case, names=True, **shape)
    trainer = bc.build_module(shape)
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    floor = 2 * nbytes / rate
    bc.log(f"{case}: {shape['label']}, {nbytes / 1e9:.2f} GB, one-copy floor {floor * 1e3:.2f} ms")
    sides: dict[str, dict[str, Any]] = {}
    try:
        sides["streamsync"] = await _streamsync(ckpt, trainer, args, shape)
    except Exception as e:
        traceback.print_exc()
        sides["streamsync"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        sides.update(await _ipc(ckpt, trainer, args, shape))
    except Exception as e:
        traceback.print_exc()
        sides["ipc"] = sides["ipc-packed"] = {"error": f"{type(e).__name__}: {e}"}
    sides["nccl"] = {"error": f"not run: needs the trainer and the engine on two GPUs, "
                              f"{torch.cuda.device_count()} visible"}
    for name, s in sides.items():
        if "times" in s:
            steady = s["times"][1 + args.warmup:]
            s["first_ms"] = s["times"][0] * 1e3
            s["steady_ms"] = statistics.median(steady) * 1e3
            s["over_floor"] = s["steady_ms"] / (floor * 1e3)
            bc.log(f"  {name}: first {s['first_ms']:.1f} ms, steady {s['steady_ms']:.1f} ms "
                   f"({s['over_floor']:.2f}x the floor), bit-exact {s['bit_exact']}")
    ours = sides["streamsync"].get("steady_ms")
    for s in sides.values():
        if ours and "steady_ms" in s:
            s["over_streamsync"] = s["steady_ms"] / ours
    del trainer
    bc._free_cached()
    return {"case": case, "label": shape["label"], "bytes": nbytes, "one_copy_floor_ms": floor * 1e3,
            "sides": sides}


def table(rows: list[dict[str, Any]]) -> str:
    head = ["case", "side", "first ms", "steady ms", "floor ms", "steady/floor", "vs streamsync", "bit-exact"]
    lines = [head]
    for r in rows:
        for name, s in r["sides"].items():
            if "steady_ms" not in s:
                lines.append([r["case"], name, "-", "-", f"{r['one_copy_floor_ms']:.2f}", "-", "-",
                              s.get("error", "")[:60]])
                continue
            lines.append([r["case"], name, f"{s['first_ms']:.1f}", f"{s['steady_ms']:.1f}",
                          f"{r['one_copy_floor_ms']:.2f}", f"{s['over_floor']:.2f}x",
                          f"{s.get('over_streamsync', 0):.2f}x", str(s["bit_exact"])])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines)


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks.peer needs a CUDA GPU (vLLM's ipc backend is CUDA IPC)")
    import vllm

    bc._DEV = torch.device("cuda")
    rate = bc.copy_rate(nbytes=4 * GiB)
    bc.log(f"vLLM {vllm.__version__}; device copy rate {rate / 1e12:.2f} TB/s (bytes read + written)")
    result: dict[str, Any] = {"commit": commit(), "machine": torch.cuda.get_device_name(), "host_cpu": _host_cpu(),
                              "vllm": vllm.__version__, "torch": torch.__version__, "copy_rate_Bps": rate,
                              "repeat": args.repeat, "trainer": "HF-named bf16 module on the engine's GPU",
                              "rows": []}
    with tempfile.TemporaryDirectory(prefix="streamsync-peer-") as tmp:
        for case in args.cases:
            try:
                row = await run_case(case, args, rate, Path(tmp))
            except Exception as e:
                traceback.print_exc()
                row = {"case": case, "error": f"{type(e).__name__}: {e}", "sides": {}, "one_copy_floor_ms": 0.0}
            result["rows"].append(row)
            write_json(args.json, result)
    print("\n" + table(result["rows"]))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--cases", type=lambda s: s.split(","), default=["8b", "moe"], help="of " + ",".join(bc.SHAPES))
    ap.add_argument("--repeat", type=int, default=5, help="steady pushes measured per side")
    ap.add_argument("--warmup", type=int, default=2, help="pushes after the first, not counted")
    ap.add_argument("--call-timeout", type=float, default=120.0,
                    help="seconds a vLLM-side call or push may take before its row is given up (engine start: 300)")
    ap.add_argument("--trace-calls", action="store_true",
                    help="log each vLLM call of every ipc push (their times then include the logging)")
    ap.add_argument("--engine-memory", type=float, default=0.35,
                    help="gpu_memory_utilization of each engine (the trainer shares the GPU)")
    anyio.run(_main, ap.parse_args(argv))


if __name__ == "__main__":
    main()
