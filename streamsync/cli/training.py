"""The demo's training step, also run by `streamsync run` pipelines whose HF checkpoint trains (`update =
"train"`): one real AdamW step on a text, computed by a transformers model and, for a megatron trainer, imported
into its shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _named_parameters(trainer: Any) -> list[tuple[str, torch.nn.Parameter]]:
    chunks = trainer if isinstance(trainer, list) else [trainer]
    return [(f"{i}.{n}", p) for i, c in enumerate(chunks) for n, p in c.named_parameters()]


def hf_twin(trainer: Any, model_dir: Path) -> torch.nn.Module:
    """The transformers model the training steps run on: the trainer itself, or for a megatron trainer a twin
    holding the same weights (a megatron-core forward needs CUDA). Kept across steps, so they accumulate."""
    if isinstance(trainer, torch.nn.Module):
        return trainer
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)


def training_step(trainer: Any, hf: torch.nn.Module, tokenizer: Any, text: str, lr: float) -> float:
    """One real AdamW step on `text`, computed by `hf` (see hf_twin) and, for a megatron trainer, imported
    into its shards through the HF -> Megatron converter. Returns the mean absolute weight change."""
    named = _named_parameters(trainer)
    before = {n: p.detach().clone() for n, p in named}
    hf.train()
    hf.zero_grad(set_to_none=True)
    ids = torch.tensor([tokenizer.encode(text)])
    opt = torch.optim.AdamW(hf.parameters(), lr=lr)
    hf(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    hf.eval()
    if hf is not trainer:
        from ..models.megatron import load_hf_weights

        load_hf_weights(trainer, hf.state_dict())
    with torch.no_grad():
        deltas = [(p.detach().float() - before[n].float()).abs().mean() for n, p in named]
    return float(torch.stack(deltas).mean())
