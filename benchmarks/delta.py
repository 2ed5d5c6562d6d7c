"""Delta pushes on real optimizer steps: how many bf16 elements an AdamW step changes, and what a delta push
sends and costs against a full one, remote and colocated, in one run.

Part 1 (`changed`): for each model and learning rate, a Qwen3 with float32 master weights (the trainer's),
served in bf16, takes `--steps` AdamW steps on random tokens; per step, the share of bf16 elements whose bits
changed (the first step separately: Adam's first update moves every weight by about lr).

Part 2 (`pushes`): the larger model at `--push-lr`. Each step is pushed by two syncs, one with delta=False and
one with delta=True, each into its own receiver process, over the collective transport (gloo: the remote path,
a process group as across hosts, here on loopback), over the p2p transport into an engine of two TP workers
(sharded: each worker receives and keeps only its slices, as a vLLM TP=2 engine lays them out) and over shared
memory (colocated); per path the median push time and bytes sent over the steps after the first (full) push,
the ratio, and the path `delta="auto"` picks. Receivers hold the served state (each TP worker its slices) bit
for bit after every push (checked by checksums at the end of each path).
The sender and each receiver use one intra-op thread (`--threads`), as benchmarks.cpu does: on a loaded
two-core machine two threads per process made torch's elementwise kernels tens of times slower.

    python -m benchmarks.delta [--steps 6] [--json docs/benchmarks/cpu-delta.json]

GPU paths (NCCL between two H200s, CUDA IPC, a vLLM engine on the H200) run the same code; this benchmark
runs on CPU only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from benchmarks.report import write_json
from streamsync.checksum import digests
from streamsync.models.tiny import make_tiny_qwen3
from streamsync.plan.vllm_layout import vllm_layout
from streamsync.report import MiB
from streamsync.sync import WeightSync
from streamsync.testing.receiver import ReceiverProcess
from streamsync.testing.sliced import WorkerGroup, expected_slices
from streamsync.testing.training import AdamTrainer
from streamsync.transports.collective import CollectiveTransport
from streamsync.transports.p2p import P2pTransport

LARGER = dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
              num_key_value_heads=8, head_dim=64, intermediate_size=3072, max_position_embeddings=512,
              tie_word_embeddings=False)
LRS = (1e-6, 1e-5, 1e-4)


def _trainer(model: str, lr: float, seed: int = 0) -> AdamTrainer:
    if model == "tiny":
        return AdamTrainer(make_tiny_qwen3(), lr=lr, seed=seed)
    from transformers import Qwen3Config

    return AdamTrainer(config=Qwen3Config(**LARGER), lr=lr, seed=seed, batch=1, seq=32)


def _bits(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16).clone() for n, t in state.items() if t.dtype == torch.bfloat16}


def changed_per_step(model: str, lr: float, steps: int) -> dict[str, Any]:
    tr = _trainer(model, lr)
    before = _bits(tr.served())
    elements = sum(t.numel() for t in before.values())
    fractions = []
    for _ in range(steps):
        tr.step()
        now = _bits(tr.served())
        fractions.append(sum(int((now[n] != before[n]).sum()) for n in now) / elements)
        before = now
    return {"model": model, "lr": lr, "elements": elements, "first_step": fractions[0],
            "later_steps_mean": statistics.mean(fractions[1:]) if len(fractions) > 1 else None,
            "per_step": fractions}


class _Engines:
    """Per mode ("full", "delta") the engine a path pushes into, and whether it holds the served state."""

    def __init__(self, specs: Path, tr: AdamTrainer, sharded: bool) -> None:
        self.specs, self.tr, self.sharded = specs, tr, sharded
        self.procs: dict[str, list[ReceiverProcess]] = {}
        if sharded:
            cfg = tr.model.config
            served = [(n, "bfloat16", tuple(t.shape)) for n, t in tr.served().items()]
            self.holds = vllm_layout(served, 2, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                                     head_dim=cfg.head_dim)

    def __enter__(self) -> _Engines:
        for mode in ("full", "delta"):
            if self.sharded:
                self.procs[mode] = [ReceiverProcess(str(self.specs), holds=h, name=f"rx-{mode}.w{w}", threads=1)
                                    for w, h in enumerate(self.holds)]
            else:
                self.procs[mode] = [ReceiverProcess(str(self.specs), name=f"rx-{mode}", threads=1)]
        return self

    def __exit__(self, *exc: object) -> None:
        for procs in self.procs.values():
            for p in procs:
                p.stop()

    def engine(self, mode: str) -> Any:
        procs = self.procs[mode]
        if not self.sharded:
            return procs[0].engine(timeout=300)
        return WorkerGroup([p.engine(timeout=300) for p in procs], f"tp2-{mode}")

    async def exact(self, engine: Any) -> bool:
        served = self.tr.served()
        if not self.sharded:
            return bool(await engine.checksums() == digests(served.items()))
        got = await engine.checksums()
        return all(got[w] == expected_slices(served, h) for w, h in enumerate(self.holds))

    async def base_bytes(self, engine: Any) -> int:
        members = engine.members if self.sharded else [engine]
        return sum([(await m.call("delta_base"))["bytes"] for m in members])


async def pushes(tr: AdamTrainer, steps: int, chunk_mib: int) -> dict[str, Any]:
    specs = tr.save_specs(Path(tempfile.mkdtemp(prefix="streamsync-delta-")) / "specs.json")
    bf16 = {"dtype": torch.bfloat16}
    paths = {"remote (gloo collective)": (lambda: CollectiveTransport("gloo", group_timeout=120), False),
             "remote sharded (p2p, TP2)": (lambda: P2pTransport("gloo", group_timeout=120), True),
             "colocated (shared memory)": (lambda: "shm", False)}
    out: dict[str, Any] = {}
    for path, (transport, sharded) in paths.items():
        with _Engines(specs, tr, sharded) as engines:
            auto = WeightSync([engines.engine("delta")], transport=transport(), delta="auto")
            await auto.connect()
            picks = auto.delta_on
            await auto.close()
            syncs = {mode: WeightSync([engines.engine(mode)], transport=transport(), chunk_bytes=chunk_mib * MiB,
                                      timeout=300, source_options=bf16, delta=mode == "delta")
                     for mode in ("full", "delta")}
            rows: dict[str, list[dict[str, Any]]] = {"full": [], "delta": []}
            for i in range(steps + 1):
                if i:
                    tr.step()
                for mode, sync in syncs.items():
                    r = await sync.push(tr.model)
                    d = r.delta
                    rows[mode].append({"seconds": r.seconds, "bytes": r.model_bytes,
                                       "wire_bytes": d.wire_bytes if d else r.bytes,
                                       "mode": d.mode if d else "full",
                                       "changed_fraction": d.changed_fraction if d else None,
                                       "encodings": d.encodings if d else None,
                                       "shadow_bytes": d.shadow_bytes if d else 0,
                                       "stage_seconds": r.stage_seconds})
            exact = {mode: await engines.exact(s.engines[0]) for mode, s in syncs.items()}
            base_bytes = await engines.base_bytes(syncs["delta"].engines[0])
            for s in syncs.values():
                await s.close()
        steady = {m: rows[m][1:] for m in rows}
        med = {m: statistics.median(x["seconds"] for x in steady[m]) for m in steady}
        wire = {m: statistics.median(x["wire_bytes"] for x in steady[m]) for m in steady}
        out[path] = {"auto_picks_delta": picks, "exact": exact, "full_ms": med["full"] * 1e3,
                     "delta_ms": med["delta"] * 1e3, "full_bytes": wire["full"], "delta_bytes": wire["delta"],
                     "delta_first_ms": rows["delta"][0]["seconds"] * 1e3,
                     "shadow_bytes": rows["delta"][-1]["shadow_bytes"], "receiver_base_bytes": base_bytes,
                     "rows": rows}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.delta", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per learning rate (and pushed per path)")
    ap.add_argument("--models", default="tiny,larger")
    ap.add_argument("--push-lr", type=float, default=1e-5)
    ap.add_argument("--push-model", default="larger")
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads here (each receiver has one)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    changed = [changed_per_step(m, lr, args.steps) for m in args.models.split(",") for lr in LRS]
    print("changed bf16 elements per AdamW step (fp32 master weights)")
    print(f"  {'model':8} {'params':>9} " + " ".join(f"{f'lr {lr:g}':>16}" for lr in LRS))
    for m in args.models.split(","):
        rows = [c for c in changed if c["model"] == m]
        cells = " ".join(f"{c['later_steps_mean']:8.2%} ({c['first_step']:4.0%})" for c in rows)
        print(f"  {m:8} {rows[0]['elements'] / 1e6:8.1f}M {cells}")
    print("  (mean over steps 2..N; the first step in parentheses)")
    tr = _trainer(args.push_model, args.push_lr)
    pushed = anyio.run(pushes, tr, args.steps, args.chunk_mib)
    print(f"\npushes of the {args.push_model} model, AdamW lr {args.push_lr:g}, median of {args.steps} steps")
    print(f"  {'path':28} {'full':>10} {'delta':>10} {'delta/full':>11} {'sent full':>10} {'sent delta':>11} "
          f"{'auto':>6} exact")
    for path, p in pushed.items():
        auto = "delta" if p["auto_picks_delta"] else "full"
        print(f"  {path:28} {p['full_ms']:8.1f}ms {p['delta_ms']:8.1f}ms {p['delta_ms'] / p['full_ms']:10.2f}x "
              f"{p['full_bytes'] / MiB:8.1f}Mi {p['delta_bytes'] / MiB:9.2f}Mi {auto:>6} {all(p['exact'].values())}")
    for path, p in pushed.items():
        print(f"  memory, {path}: sender shadow {p['shadow_bytes'] / MiB:.1f} MiB, receivers' base copies "
              f"{p['receiver_base_bytes'] / MiB:.1f} MiB (host, served dtype)")
    write_json(args.json, {"benchmark": "delta", "changed": changed, "push_model": args.push_model,
                           "push_lr": args.push_lr, "steps": args.steps, "chunk_mib": args.chunk_mib,
                           "pushes": pushed, "seconds": time.perf_counter() - t0,
                           "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
