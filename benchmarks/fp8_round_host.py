"""The host time of a worker's load of one chunk into an fp8 engine's modules, both ways a module may take: quantized
from the pushed tensors where they lie (*sourced*: a piece per write, grouped per scale, the kernels' table built
from them) or copied into fresh bf16 tensors and quantized from those (*fresh*). Host work only: every tensor is
on PyTorch's meta device (no bytes), the copies and kernels are not run, and the sourced way builds its table
(`quant.sourced_table`) where it would launch its kernels. On a GPU this is the part of a load that runs before
and between the kernels, which a slow host makes the longest part.

Two chunks: 18 layers of a Qwen3-8B's linear layers (each a `Direct` module; megatron's QKV as three blocked
pieces), and 6 layers of a Qwen3-30B-A3B's experts (each an `Experts` module, 128 experts of gate, up and down).

    python -m benchmarks.fp8_round_host --json cpu-fp8-round-host.json
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import commit, median_ms, write_json
from streamsync.vllm.worker import quant
from streamsync.vllm.worker.fastpath.direct import Direct, Experts
from streamsync.vllm.worker.fastpath.plan import Plan, _Op, _Rebuilt
from streamsync.vllm.worker.fastpath.round import FastRound
from streamsync.vllm.worker.fastpath.trace import Write

F8, BF16, META = torch.float8_e4m3fn, torch.bfloat16, torch.device("meta")
Chunk = list[tuple[tuple[_Op, ...], torch.Tensor]]


def _plan(rebuilt: list[_Rebuilt], ops: dict[str, tuple[_Op, ...]]) -> Plan:
    return Plan(ops, {}, rebuilt, [], frozenset(), {}, {}, [], [], {}, frozenset(r.name for r in rebuilt))


def dense(layers: int, sourced: bool) -> tuple[Plan, Chunk]:
    rebuilt: list[_Rebuilt] = []
    ops: dict[str, tuple[_Op, ...]] = {}
    chunk: Chunk = []
    for layer in range(layers):
        for name, (a, b) in (("qkv", (6144, 4096)), ("o", (4096, 4096)), ("gate_up", (24576, 4096)),
                             ("down", (4096, 12288))):
            i = len(rebuilt)
            direct = Direct(torch.empty(a, b, dtype=F8, device=META), torch.empty((), device=META), ())
            fresh: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]] = {
                "weight": ((a, b), (b, 1), BF16, META)}
            rebuilt.append(_Rebuilt(f"{layer}.{name}", torch.nn.Module(), a * b, fresh=fresh, direct=direct,
                                    sourceable=sourced))
            if name == "qkv":  # megatron's interleaved QKV of 8 groups: Q, K and V as (groups, rows, cols) views
                inter = torch.empty(8, 768, b, dtype=BF16, device=META)
                for part, r0, g0, g1 in (("q", 0, 0, 512), ("k", 4096, 512, 640), ("v", 5120, 640, 768)):
                    op = _Op(None, i, "weight", Write(0, r0 * b, (8, g1 - g0, b), ((g1 - g0) * b, b, 1), 0), True)
                    ops[f"{layer}.{part}"] = (op,)
                    chunk.append(((op,), inter[:, g0:g1]))
            else:
                op = _Op(None, i, "weight", Write(0, 0, (a, b), (b, 1), 0), True)
                ops[f"{layer}.{name}"] = (op,)
                chunk.append(((op,), torch.empty(a, b, dtype=BF16, device=META)))
    return _plan(rebuilt, ops), chunk


def experts(layers: int, sourced: bool, e: int = 128, inter: int = 768, hidden: int = 2048) -> tuple[Plan, Chunk]:
    rebuilt: list[_Rebuilt] = []
    ops: dict[str, tuple[_Op, ...]] = {}
    chunk: Chunk = []
    per13, per2 = 2 * inter * hidden, hidden * inter
    for layer in range(layers):
        live: dict[str, torch.Tensor | None] = {
            "w13_weight": torch.empty(e, 2 * inter, hidden, dtype=F8, device=META),
            "w13_weight_scale": torch.empty(e, device=META),
            "w2_weight": torch.empty(e, hidden, inter, dtype=F8, device=META),
            "w2_weight_scale": torch.empty(e, device=META)}
        module = Experts.of(torch.nn.Module(), live)
        assert module is not None
        fresh = {n: (tuple(t.shape), tuple(t.stride()), BF16, META) for n, t in live.items()
                 if t is not None and t.dim() == 3}
        rebuilt.append(_Rebuilt(f"{layer}.experts", module.layer, e * 3 * inter * hidden, fresh=fresh,
                                direct=module, sourceable=sourced))
        for x in range(e):
            for name, tensor, w in (("gate", "w13_weight", Write(0, x * per13, (inter, hidden), (hidden, 1), 0)),
                                    ("up", "w13_weight", Write(0, x * per13 + inter * hidden, (inter, hidden),
                                                               (hidden, 1), 0)),
                                    ("down", "w2_weight", Write(1, x * per2, (hidden, inter), (inter, 1), 0))):
                op = _Op(None, layer, tensor, w, True)
                ops[f"{layer}.{x}.{name}"] = (op,)
                chunk.append(((op,), torch.empty(w.size, dtype=BF16, device=META)))
    return _plan(rebuilt, ops), chunk


@contextmanager
def host_only() -> Iterator[None]:
    """The kernels and copies left out: what a load runs on the host, on meta tensors."""
    from vllm import _custom_ops as ops

    def table_only(pieces: Any, scales: Any, kernel: bool = True, layouts: Any = None) -> None:
        if pieces:
            quant.sourced_table(pieces, layouts)

    saved = (quant.sourced_layout, quant.quantize_sourced, quant.rebuild_fp8_experts, quant.point_config_at_scales,
             torch._foreach_copy_, ops.scaled_fp8_quant)
    quant.sourced_layout = quant.layout  # meta tensors are no GPU's: take every piece as the GPU would
    quant.quantize_sourced = table_only
    quant.rebuild_fp8_experts = lambda layer, fresh, live: None
    quant.point_config_at_scales = lambda layer, live: None
    torch._foreach_copy_ = lambda *a, **k: None
    ops.scaled_fp8_quant = lambda w, s=None, output=None, **k: (output, torch.empty(1, device=w.device))
    try:
        yield
    finally:
        (quant.sourced_layout, quant.quantize_sourced, quant.rebuild_fp8_experts, quant.point_config_at_scales,
         torch._foreach_copy_, ops.scaled_fp8_quant) = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    with host_only():
        for case, build, layers in (("8B linear layers x18", dense, 18), ("30B-A3B experts x6", experts, 6)):
            row: dict[str, Any] = {"case": case}
            for way, sourced in (("sourced", True), ("fresh", False)):
                plan, chunk = build(layers, sourced)

                def load(plan: Plan = plan, chunk: Chunk = chunk, sourced: bool = sourced) -> None:
                    rnd = FastRound(plan)
                    rnd.load(chunk, process=None if sourced else rnd.process)
                    assert rnd.direct == len(plan.rebuilt) and rnd.sourced == (len(plan.rebuilt) if sourced else 0)

                row[f"{way}_ms"] = median_ms(load, args.repeat)
                row["writes"] = len(chunk)
            row["sourced_us_per_write"] = row["sourced_ms"] / row["writes"] * 1e3
            row["fresh_us_per_write"] = row["fresh_ms"] / row["writes"] * 1e3
            rows.append(row)
    print(f"{'chunk':<24}{'writes':>8}{'sourced ms':>12}{'fresh ms':>10}{'sourced / fresh':>17}")
    for r in rows:
        print(f"{r['case']:<24}{r['writes']:>8}{r['sourced_ms']:>12.2f}{r['fresh_ms']:>10.2f}"
              f"{r['sourced_ms'] / r['fresh_ms']:>16.2f}x")
    write_json(args.json, {"commit": commit(), "machine": "this project's CPU machine (2 cores)",
                           "repeat": args.repeat, "rows": rows})


if __name__ == "__main__":
    main()
