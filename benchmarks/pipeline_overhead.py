"""Host cost of the pipeline itself per chunk, with nothing to move.

A push of 20 chunks of 20 tiny tensors through a transport and an engine that do nothing: what is left of
the push is the five stages' own host work (queues, credits, spans, messages), printed per push and per chunk
(median of 50 pushes). `--profile` adds a cProfile of 20 more pushes.

    python -m benchmarks.pipeline_overhead [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import anyio
import torch

os.environ.setdefault("STREAMSYNC_LOG", "warning")

from streamsync.engines.base import Engine
from streamsync.message import UpdateMessage
from streamsync.models.synthetic import StateModule
from streamsync.pack import Layout
from streamsync.plan.chunk import ChunkPlan
from streamsync.sync import WeightSync
from streamsync.transports.base import SendBuffer, Transport


class NullTransport(Transport):
    """Allocates an empty buffer per chunk and copies nothing."""

    name: ClassVar[str] = "null"
    reaches: ClassVar[Literal["cpu", "cuda", "remote"]] = "cpu"

    def allocate(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor]) -> SendBuffer:
        return SendBuffer(chunk.index, chunk.nbytes, torch.empty(0, dtype=torch.uint8), {})

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        pass

    def free(self, buf: SendBuffer) -> None:
        pass


class NullEngine(Engine):
    """Acknowledges every call at once."""

    name, device = "null", "cpu"

    async def init_transfer(self, init_info: dict[str, Any]) -> None: ...
    async def start_update(self) -> None: ...
    async def update(self, message: UpdateMessage | Mapping[str, Any]) -> None: ...
    async def finish_update(self, version: int) -> None: ...

    async def get_version(self) -> int | None:
        return None


async def run(profile: bool) -> None:
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
    if profile:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(20):
                await sync.push(model)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    await sync.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="store_true", help="also profile 20 pushes (cProfile)")
    anyio.run(run, ap.parse_args(argv).profile)


if __name__ == "__main__":
    main()
