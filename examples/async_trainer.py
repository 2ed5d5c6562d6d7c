"""An async training loop that pushes its weights after every step into a receiver process.

    .venv/bin/python examples/async_trainer.py

No vLLM needed: the receiver is streamsync's plain receiver process (the same receiving code as the vLLM
backend). Swap `ReceiverProcess(...).engine()` for `VllmHttpEngine(url)` to feed a `vllm serve` engine.
"""

from __future__ import annotations

import tempfile

import anyio
import torch

from streamsync import WeightSync
from streamsync.checksum import digests
from streamsync.models.synthetic import StateModule, qwen3_specs, save_specs
from streamsync.receiver.process import ReceiverProcess


async def train_step(model: torch.nn.Module, step: int) -> None:
    """Stands in for forward/backward/optimizer: every weight moves a little."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 1e-3)
    await anyio.sleep(0)  # a real trainer would await its data loader here


async def main() -> None:
    specs = qwen3_specs(vocab=8192, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536)
    model = StateModule(specs, fill="random")
    with tempfile.TemporaryDirectory() as tmp, ReceiverProcess(save_specs(specs, f"{tmp}/model.json")) as rx:
        engine = rx.engine()
        async with WeightSync([engine], chunk_bytes=8 << 20, trace_dir=f"{tmp}/traces") as sync:
            for step in range(1, 4):
                await train_step(model, step)
                report = await sync.push(model, version=step)
                print(f"step {step}: {report.summary()}")
            same = await engine.checksums() == digests(model.state_dict().items())
            print(f"receiver at version {await engine.get_version()}, bit-exact: {same}")


if __name__ == "__main__":
    anyio.run(main)
