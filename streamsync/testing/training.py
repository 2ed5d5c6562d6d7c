"""Real optimizer steps for tests and benchmarks of delta pushes: a transformers Qwen3 whose float32 parameters
are the trainer's master weights, trained by AdamW on random token sequences; engines hold it in bf16
(`WeightSync(source_options={"dtype": torch.bfloat16})` casts as it sends)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..models.synthetic import save_specs


class AdamTrainer:
    """`model_dir`: a checkpoint transformers loads (the tiny local Qwen3, `make_tiny_qwen3`), or `config`: a
    `Qwen3Config` to build a randomly initialised one from. Every `step()` is one forward, backward and AdamW
    step on `batch` random sequences of `seq` tokens, on `device`."""

    def __init__(self, model_dir: str | os.PathLike | None = None, *, config: Any = None, lr: float = 1e-5,
                 seed: int = 0, batch: int = 2, seq: int = 32, device: str | torch.device = "cpu") -> None:
        from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

        torch.manual_seed(seed)
        if model_dir is not None:
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        else:
            self.model = Qwen3ForCausalLM(config).to(torch.float32)
        self.device = torch.device(device)
        self.model.to(self.device).train()
        self.vocab = int(self.model.config.vocab_size)
        self.batch, self.seq = batch, seq
        self.gen = torch.Generator().manual_seed(seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.steps = 0

    def step(self) -> float:
        ids = torch.randint(0, self.vocab, (self.batch, self.seq), generator=self.gen).to(self.device)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return float(loss.detach())

    def served(self) -> dict[str, torch.Tensor]:
        """The state an engine holds: every tensor of the push, in bf16 (what `source_options` dtype sends)."""
        from ..sources.module import ModuleSource

        src = ModuleSource(self.model, dtype=torch.bfloat16)
        return {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in src.local_tensors()}

    def save_specs(self, path: str | Path) -> Path:
        """The served state's specs, for a receiver process holding it."""
        from ..pack import dtype_name

        return save_specs([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self.served().items()], path)
