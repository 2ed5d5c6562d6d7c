"""Host cost of the pipeline itself per chunk: a push of 20 chunks of 20 tiny tensors through a transport
and an engine that do nothing. `python -m benchmarks.pipeline_overhead [--profile]`."""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import anyio
import torch

os.environ.setdefault("STREAMSYNC_LOG", "warning")

from streamsync.engines.base import Engine
from streamsync.models.synthetic import StateModule
from streamsync.sync import WeightSync
from streamsync.transports.base import SendBuffer, Transport


class NullTransport(Transport):
    name = "null"

    def allocate(self, chunk: Any, push_id: str) -> SendBuffer:
        return SendBuffer(chunk.index, chunk.nbytes, torch.empty(0, dtype=torch.uint8), {})

    async def pack(self, buf: SendBuffer, layout: Any, tensors: Any) -> None:
        pass

    def free(self, buf: SendBuffer) -> None:
        pass


class NullEngine(Engine):
    name, device = "null", "cpu"

    async def init_transfer(self, init_info: dict[str, Any]) -> None: ...
    async def start_update(self) -> None: ...
    async def update(self, update_info: dict[str, Any]) -> None: ...
    async def finish_update(self, version: int) -> None: ...

    async def get_version(self) -> int | None:
        return None


async def main() -> None:
    model = StateModule([(f"model.layers.{i}.p{j}.weight", "float32", [4]) for i in range(20) for j in range(20)])
    # one layer (20 tensors, each counted at its 256-byte aligned slot) per chunk
    sync = WeightSync([NullEngine()], transport=NullTransport(), chunk_bytes=20 * 256)
    chunks = 0
    for _ in range(5):
        chunks = (await sync.push(model)).chunks
    ts = []
    for _ in range(50):
        t0 = time.perf_counter()
        await sync.push(model)
        ts.append(time.perf_counter() - t0)
    med = statistics.median(ts)
    print(f"{chunks} chunks: push {med * 1e3:.2f} ms, {med / chunks * 1e6:.0f} us per chunk (median of 50)")
    if "--profile" in sys.argv:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(20):
                await sync.push(model)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    anyio.run(main)
