"""A tiny Qwen3 made locally (no hub downloads): config, random bf16 weights and a word-level tokenizer.

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


def _make(cache: str | os.PathLike | None, seed: int, arch: str, cfg: dict[str, Any]) -> Path:
    key = hashlib.sha1(json.dumps([cfg, seed] if arch == "qwen3" else [arch, cfg, seed],
                                  sort_keys=True).encode()).hexdigest()[:10]
    out = Path(cache or default_cache()) / f"tiny-{arch.replace('_', '-')}-{key}"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[arch]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = config_cls(**{**cfg, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
                           "pad_token_id": 0})
    model: Any = model_cls(config)
    model = model.to(torch.bfloat16)
    with torch.no_grad():  # larger init than HF's default, so greedy decoding has clear winners
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
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
