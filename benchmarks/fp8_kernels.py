"""The sourced fp8 kernels (`streamsync.vllm.worker.quant.quantize_sourced`) alone, on one GPU, against the copy
of the same bf16 bytes: half a Qwen3-8B's linear weights (18 layers' QKV, O, gate/up and down, 6.9 GB of bf16 in
one buffer, as a chunk brings them) quantized into fp8 weights of their own.

Rows: the whole call (the table built on the host, then the two kernels); the kernels alone over a prebuilt table
with 16-byte accesses and without; the amax kernel alone; building the table alone (host); torch's passes (the
reference arithmetic). Each the median of 10 after one not counted, synchronized around each call.

    python -m benchmarks.fp8_kernels --json fp8-kernels.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import commit, median_ms, write_json
from streamsync.vllm.worker import quant

#: an 8B layer's linear weights (rows, cols): QKV, O, gate and up, down
LAYER = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))


def _median_ms(fn: Callable[[], Any], n: int = 10) -> float:
    return median_ms(fn, n, torch.cuda.synchronize)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = list(LAYER) * args.layers
    total = sum(a * b for a, b in shapes)
    buf = torch.randn(total, dtype=torch.bfloat16, device=dev) * 0.02
    pieces, scales, off = [], [], 0
    for j, (a, b) in enumerate(shapes):
        pieces.append((buf[off:off + a * b].view(a, b), torch.empty(a, b, dtype=torch.float8_e4m3fn, device=dev), j))
        scales.append(torch.empty(1, dtype=torch.float32, device=dev))
        off += a * b
    built = quant.sourced_table(pieces)
    assert built is not None
    rows, aligned, longest = built
    table = torch.from_numpy(rows).pin_memory()
    src0, dst0 = pieces[0][0], pieces[0][1]

    def kernels(aligned: bool) -> Callable[[], Any]:
        return lambda: quant.launch_sourced(src0, dst0, table, aligned, longest, len(scales))

    def amax_only() -> None:
        amax = torch.zeros(len(scales), dtype=torch.float32, device=dev)
        quant._sourced_kernels()[0][(len(rows), -(-longest // quant._TILE))](
            src0, table.to(dev, non_blocking=True), amax, TILE=quant._TILE, BLOCK=quant._TBLOCK, ALIGNED=aligned,
            SALIGN=8)

    copy_dst = torch.empty_like(buf)
    t0 = time.perf_counter()
    for _ in range(10):
        quant.sourced_table(pieces)
    result: dict[str, Any] = {
        "commit": commit(), "machine": torch.cuda.get_device_name(dev), "weights": len(shapes),
        "bf16_bytes": total * 2, "table_rows": len(rows), "aligned": aligned,
        "copy_bf16_ms": _median_ms(lambda: copy_dst.copy_(buf)),
        "quantize_sourced_ms": _median_ms(lambda: quant.quantize_sourced(pieces, scales)),
        "kernels_16_byte_ms": _median_ms(kernels(True)),
        "kernels_element_ms": _median_ms(kernels(False)),
        "amax_kernel_ms": _median_ms(amax_only),
        "table_host_ms": (time.perf_counter() - t0) / 10 * 1e3,
        "torch_passes_ms": _median_ms(lambda: quant.quantize_sourced(pieces, scales, kernel=False), n=3),
    }
    assert not quant._broken, quant._broken
    gb = total * 2 / 1e9
    print(f"{len(shapes)} weights, {gb:.2f} GB of bf16, {len(rows)} table rows")
    print(f"{'what':<34}{'ms':>8}{'x the bf16 copy':>18}")
    for key, label in (("copy_bf16_ms", "copy of the bf16 bytes"), ("quantize_sourced_ms", "quantize_sourced (all)"),
                       ("kernels_16_byte_ms", "kernels, 16-byte accesses"),
                       ("kernels_element_ms", "kernels, element accesses"), ("amax_kernel_ms", "amax kernel alone"),
                       ("table_host_ms", "table on the host"), ("torch_passes_ms", "torch's passes")):
        print(f"{label:<34}{result[key]:>8.2f}{result[key] / result['copy_bf16_ms']:>17.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
