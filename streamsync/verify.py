"""Checks that an engine holds the trainer's weights: bit-exact digests and a reference model's logprobs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass
class GenerationCheck:
    tokens_equal: bool
    max_logprob_diff: float
    mismatches: list[int]  # steps where the engine's token is not the reference's argmax beyond tolerance

    @property
    def ok(self) -> bool:
        return not self.mismatches


def reference_logprobs(model: torch.nn.Module, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """Log-softmax (float32) of a transformers causal LM at each generated position, teacher-forced."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def compare_generation(ref_logprobs: torch.Tensor, engine_tokens: Sequence[int],
                       engine_logprobs: Sequence[float], tol: float) -> GenerationCheck:
    """The engine's greedy token must be the reference's argmax, unless the reference's top two are within
    `tol` (then either is a correct greedy choice); its logprob must match the reference's within `tol`."""
    mism, worst = [], 0.0
    for t, (tok, lp) in enumerate(zip(engine_tokens, engine_logprobs, strict=True)):
        row = ref_logprobs[t]
        worst = max(worst, abs(float(row[tok]) - lp))
        if float(row.max()) - float(row[tok]) > tol or abs(float(row[tok]) - lp) > tol:
            mism.append(t)
    top = ref_logprobs.argmax(-1).tolist()
    return GenerationCheck(top == list(engine_tokens), worst, mism)


def load_reference(model_dir: str, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A transformers model from `model_dir`'s config holding exactly `state`'s tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    missing, unexpected = ref.load_state_dict(dict(state), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"reference does not match the state: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return ref
