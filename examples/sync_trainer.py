"""A plain synchronous training loop (as Megatron-LM-style trainers are) pushing after every step.

    .venv/bin/python examples/sync_trainer.py

`BlockingWeightSync` runs one event loop in a background thread for its whole life; the loop below never
touches asyncio. No vLLM needed: the receiver is streamsync's plain receiver process. Swap
`rx.engine()` for `VllmHttpEngine(url)` to feed a `vllm serve` engine.
"""

from __future__ import annotations

import tempfile

import torch

from streamsync import BlockingWeightSync
from streamsync.checksum import digests
from streamsync.models.synthetic import StateModule, qwen3_specs, save_specs
from streamsync.receiver.process import ReceiverProcess


def train_step(model: torch.nn.Module) -> None:
    """Stands in for forward/backward/optimizer: every weight moves a little."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 1e-3)


def main() -> None:
    specs = qwen3_specs(vocab=8192, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536)
    model = StateModule(specs, fill="random")
    with tempfile.TemporaryDirectory() as tmp, ReceiverProcess(save_specs(specs, f"{tmp}/model.json")) as rx:
        engine = rx.engine()
        with BlockingWeightSync([engine], chunk_bytes=8 << 20) as sync:
            for step in range(1, 4):
                train_step(model)
                with sync.paused():  # engines serving requests: freeze them while the weights change
                    report = sync.push(model, version=step)
                print(f"step {step}: {report.summary()}")
            same = sync.call(engine.checksums) == digests(model.state_dict().items())
            print(f"receiver at version {sync.call(engine.get_version)}, bit-exact: {same}")


if __name__ == "__main__":
    main()
