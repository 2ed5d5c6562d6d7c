"""The delta codec on one device, in GB of model per second: encode (`delta.chunked.ChunkShadow`: the diff
against the shadow, each tensor's encoding, the shadow's update and every changed tensor's wsum64 digest) and
decode (`delta.codec.decode_into` of each tensor's pieces onto a base copy, then its digest checked, as a
receiver does), for a model shape at several densities of changed bf16 elements, beside the device's copy rate
(bytes read + written) measured in the same run.

The trainer is an HF-named bf16 module of the shape (`benchmarks.cuda.build_module`) on the device, chunked in
push order by `--chunk-gib` (a tensor larger than that is a chunk of its own). A step changes about `density` of
every tensor's elements (one bit of each, at random positions). Per density, `--repeat` steps; each step's chunks
are encoded and decoded one after the other (one chunk's pieces alive at a time), each phase timed with a device
sync around it; after each step the base equals the trainer bit for bit (checked). Memory: the model three
times (trainer, shadow, base) plus one chunk's staging and pieces.

    python -m benchmarks.delta_codec --json OUT.json [--shape 8b] [--densities 0.02,0.1,0.5] [--repeat 3]
    python -m benchmarks.delta_codec --shape tiny                  # any machine: the code path, CPU rates

Prints a table (per density: encode and decode GB/s, their times against the one-copy floor, bytes on the wire
against the model) and writes JSON with the commit and device.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import benchmarks.cuda as bc
from benchmarks.report import commit, write_json
from streamsync.delta.chunked import ChunkShadow
from streamsync.delta.codec import PIECES, check_digest, decode_into
from streamsync.pack import TensorSpec
from streamsync.plan.chunk import ChunkPlan
from streamsync.report import GiB


def _sync() -> None:
    if bc._cuda():
        torch.cuda.synchronize()


def _chunks(named: list[tuple[str, torch.Tensor]], budget: int) -> list[list[tuple[str, torch.Tensor]]]:
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and used + n > budget:
            out.append([])
            used = 0
        out[-1].append((name, t))
        used += n
    return out


def _step(tensors: list[torch.Tensor], density: float, seed: int) -> None:
    """About `density` of each tensor's elements get one bit flipped (their bits change; the value stays near)."""
    gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        w = t.view(torch.int16).view(-1)
        m = torch.rand(w.numel(), generator=gen, device=w.device) < density
        w.bitwise_xor_(m.to(torch.int16))


def run(args: argparse.Namespace) -> dict[str, Any]:
    bc._DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(bc.SHAPES[args.shape])
    trainer = bc.build_module(shape)
    named = [(n, p.data) for n, p in trainer.named_parameters()]
    model_bytes = sum(t.numel() * t.element_size() for _, t in named)
    rate = bc.copy_rate(nbytes=min(4 * GiB, model_bytes))
    floor = 2 * model_bytes / rate
    bc.log(f"{shape['label']} on {bc._DEV}: {model_bytes / 1e9:.2f} GB; copy rate {rate / 1e9:.0f} GB/s "
           f"(read + written); one-copy floor {floor * 1e3:.2f} ms")
    chunks = _chunks(named, int(args.chunk_gib * GiB))
    plans = [ChunkPlan(i, tuple(TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in c), tuple(n for n, _ in c))
             for i, c in enumerate(chunks)]
    shadows = [ChunkShadow(p, bc._DEV) for p in plans]
    for sh, c in zip(shadows, chunks, strict=True):
        sh.seed([t for _, t in c])
    base = [[t.clone() for _, t in c] for c in chunks]  # what a receiver holds
    shadow_bytes = sum(s.nbytes for s in shadows)
    bc.log(f"{len(chunks)} chunks; shadow {shadow_bytes / 1e9:.2f} GB")
    rows = []
    seed = 0
    for density in [args.densities[0], *args.densities]:  # the first run warms up (not counted)
        warm = not rows and seed == 0
        enc_s, dec_s, wires, changed = [], [], [], []
        for _ in range(1 if warm else args.repeat):
            seed += 1
            _step([t for _, t in named], density, seed)
            _sync()
            e_t = d_t = 0.0
            wire = ch = 0
            encs: dict[str, int] = {}
            for sh, c, b in zip(shadows, chunks, base, strict=True):
                t0 = time.perf_counter()
                out = sh.encode([t for _, t in c], verify=True)
                _sync()
                t1 = time.perf_counter()
                for (e, dig), (name, _), held in zip(out, c, b, strict=True):
                    decode_into(held.view(-1), e.enc, e.changed, dict(zip(PIECES[e.enc], e.pieces, strict=True)))
                    check_digest(held, dig, name)
                _sync()
                t2 = time.perf_counter()
                e_t += t1 - t0
                d_t += t2 - t1
                wire += sum(e.nbytes for e, _ in out)
                ch += sum(e.changed for e, _ in out)
                for e, _ in out:
                    encs[e.enc] = encs.get(e.enc, 0) + 1
                del out
            for (_, t), held in zip((x for c in chunks for x in c), (x for b in base for x in b), strict=True):
                if not torch.equal(t.view(torch.int16), held.view(torch.int16)):
                    raise SystemExit("the decoded base differs from the trainer: the codec is not exact")
            enc_s.append(e_t)
            dec_s.append(d_t)
            wires.append(wire)
            changed.append(ch / (model_bytes // 2))
        if warm:
            bc.log(f"warm-up at {density:.0%}: encode {enc_s[0] * 1e3:.1f} ms, decode {dec_s[0] * 1e3:.1f} ms")
            continue
        e, d = statistics.median(enc_s), statistics.median(dec_s)
        row = {"density": density, "changed": statistics.median(changed), "encode_ms": e * 1e3,
               "decode_ms": d * 1e3, "encode_GBps": model_bytes / e / 1e9, "decode_GBps": model_bytes / d / 1e9,
               "encode_over_floor": e / floor, "decode_over_floor": d / floor,
               "wire_over_model": statistics.median(wires) / model_bytes, "encodings": encs}
        rows.append(row)
        bc.log(f"{density:.0%}: encode {row['encode_ms']:.1f} ms ({row['encode_GBps']:.3g} GB/s), decode "
               f"{row['decode_ms']:.1f} ms ({row['decode_GBps']:.3g} GB/s), wire {row['wire_over_model']:.1%} of "
               f"the model, exact")
    return {"commit": commit(), "device": torch.cuda.get_device_name() if bc._cuda() else "cpu",
            "torch": torch.__version__, "shape": args.shape, "label": shape["label"], "model_bytes": model_bytes,
            "chunks": len(chunks), "shadow_bytes": shadow_bytes, "copy_rate_Bps": rate,
            "one_copy_floor_ms": floor * 1e3, "repeat": args.repeat, "rows": rows}


def table(result: dict[str, Any]) -> str:
    head = ["changed", "encode ms", "encode GB/s", "enc/floor", "decode ms", "decode GB/s", "dec/floor", "wire/model"]
    lines = [head] + [[f"{r['changed']:.1%}", f"{r['encode_ms']:.1f}", f"{r['encode_GBps']:.3g}",
                       f"{r['encode_over_floor']:.2f}x", f"{r['decode_ms']:.1f}", f"{r['decode_GBps']:.3g}",
                       f"{r['decode_over_floor']:.2f}x", f"{r['wire_over_model']:.1%}"] for r in result["rows"]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return (f"{result['label']} on {result['device']}, one-copy floor {result['one_copy_floor_ms']:.2f} ms\n"
            + "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.delta_codec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--shape", default="8b", choices=sorted(bc.SHAPES))
    ap.add_argument("--densities", type=lambda s: [float(x) for x in s.split(",")], default=[0.02, 0.1, 0.5])
    ap.add_argument("--repeat", type=int, default=3, help="steps measured per density (median)")
    ap.add_argument("--chunk-gib", type=float, default=1.0, help="chunk budget (the library's default on a GPU)")
    args = ap.parse_args(argv)
    result = run(args)
    print("\n" + table(result))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
