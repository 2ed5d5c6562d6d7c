"""Model shapes for planning without weights: HF-config-like dicts of public architecture numbers, and the HF
checkpoint tensors (name, dtype, shape) they imply, as vLLM's `load_weights` takes them (per-expert MoE
tensors). Nothing here allocates a tensor, so a 1T-parameter shape is planned in well under a second.

`PRESETS` are the published configs' numbers (config.json of each model on the Hugging Face hub), bf16:

* qwen3-8b, qwen3-30b-a3b, qwen3-235b-a22b (`model_type` qwen3 / qwen3_moe: GQA attention with q/k norms);
* deepseek-v3, kimi-k2, moonlight-16b-a3b (`model_type` deepseek_v3: MLA attention, the first
  `first_k_dense_replace` layers dense, then routed experts plus shared experts and the router's float32 expert
  bias). MLA tensors are exact (q_a/q_b or q_proj, kv_a_proj_with_mqa, kv_b, o_proj and the low-rank norms); the
  multi-token-prediction layer is left out (vLLM's main model does not load it: a push reports it as not loaded),
  and the weights are counted as bf16 (the published DeepSeek-V3 and Kimi-K2 checkpoints are block-FP8);
* glm-4.5-air (`model_type` glm4_moe: GQA with q/k/v biases, the first layer dense, routed + shared experts).

`glm4` configs (GLM-4 dense: q/k/v biases, sandwich norms, a fused gate_up_proj) and `mimo` ones (MiMo: Qwen2's
layers; its MTP layers left out, as DeepSeek-V3's) plan from their config.json.
Every shape planned here is one `streamsync.convert` maps (tests/test_convert.py holds them to it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import ValidationError

Spec = tuple[str, str, tuple[int, ...]]

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"},
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"},
    "deepseek-v3": {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
        "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 129280, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "kimi-k2": {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 64,
        "num_key_value_heads": 64, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 384, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "moonlight-16b-a3b": {
        "model_type": "deepseek_v3", "num_hidden_layers": 27, "hidden_size": 2048, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 11264, "moe_intermediate_size": 1408,
        "n_routed_experts": 64, "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "glm-4.5-air": {
        "model_type": "glm4_moe", "num_hidden_layers": 46, "hidden_size": 4096, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "n_routed_experts": 128, "n_shared_experts": 1, "first_k_dense_replace": 1, "attention_bias": True,
        "use_qk_norm": False, "vocab_size": 151552, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}

_TYPES = ("llama", "qwen2", "mimo", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2", "glm4", "glm4_moe")


def load_shape(what: str) -> dict[str, Any]:
    """A preset's config (by name) or an HF config.json (by path)."""
    if what in PRESETS:
        return dict(PRESETS[what])
    path = Path(what)
    if not path.is_file():
        raise ValidationError(f"no model shape {what!r}: give an HF config.json path or one of {', '.join(PRESETS)}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValidationError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise ValidationError(f"{path}: a config must be a JSON object")
    return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg


class Shape:
    """The numbers of one config that the planner needs, checked."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = dict(cfg)
        self.type = str(cfg.get("model_type", ""))
        if self.type not in _TYPES:
            raise ValidationError(f"model_type {self.type!r} is not one the planner knows ({', '.join(_TYPES)})")
        self.mla = self.type in ("deepseek_v3", "kimi_k2")
        self.layers = self._int("num_hidden_layers")
        self.hidden = self._int("hidden_size")
        self.heads = self._int("num_attention_heads")
        self.kv_heads = self._int("num_key_value_heads", self.heads)
        self.head_dim = self._int("head_dim", self.hidden // self.heads)
        self.ffn = self._int("intermediate_size")
        self.vocab = self._int("vocab_size")
        self.tie = bool(cfg.get("tie_word_embeddings", False))
        self.dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        self.experts = self._int("num_experts", 0) or self._int("n_routed_experts", 0)
        self.moe_ffn = self._int("moe_intermediate_size", 0) if self.experts else 0
        self.shared = self._int("n_shared_experts", 0)
        self.first_dense = self._int("first_k_dense_replace", 0)
        dense_only = cfg.get("mlp_only_layers") or []
        self.dense_layers = {int(i) for i in dense_only} | set(range(min(self.first_dense, self.layers)))
        self.qkv_bias = self.type in ("qwen2", "mimo") or (self.type in ("glm4", "glm4_moe")
                                                 and bool(cfg.get("attention_bias", self.type == "glm4")))
        self.qk_norm = self.type in ("qwen3", "qwen3_moe") or (self.type == "glm4_moe"
                                                               and bool(cfg.get("use_qk_norm", False)))
        if self.mla:
            self.q_lora = self._int("q_lora_rank", 0) if cfg.get("q_lora_rank") is not None else 0
            self.kv_lora = self._int("kv_lora_rank")
            self.nope = self._int("qk_nope_head_dim")
            self.rope = self._int("qk_rope_head_dim")
            self.v_dim = self._int("v_head_dim")
            self.head_dim = self.v_dim  # o_proj's columns per head

    def _int(self, key: str, default: int | None = None) -> int:
        v = self.cfg.get(key, default)
        if type(v) is not int or v < 0:
            raise ValidationError(f"config key {key!r} must be a non-negative integer, got {v!r}")
        return v

    def kind(self, layer: int) -> str:
        """'moe' or 'dense': layers of one kind have the same tensors."""
        return "moe" if self.experts and layer not in self.dense_layers else "dense"

    def layer_specs(self, i: int) -> list[Spec]:
        d, h = self.dtype, self.hidden
        p = f"model.layers.{i}."
        s: list[Spec] = [(p + "input_layernorm.weight", d, (h,))]
        if self.mla:
            qk = self.nope + self.rope
            if self.q_lora:
                s += [(p + "self_attn.q_a_proj.weight", d, (self.q_lora, h)),
                      (p + "self_attn.q_a_layernorm.weight", d, (self.q_lora,)),
                      (p + "self_attn.q_b_proj.weight", d, (self.heads * qk, self.q_lora))]
            else:
                s.append((p + "self_attn.q_proj.weight", d, (self.heads * qk, h)))
            s += [(p + "self_attn.kv_a_proj_with_mqa.weight", d, (self.kv_lora + self.rope, h)),
                  (p + "self_attn.kv_a_layernorm.weight", d, (self.kv_lora,)),
                  (p + "self_attn.kv_b_proj.weight", d, (self.heads * (self.nope + self.v_dim), self.kv_lora)),
                  (p + "self_attn.o_proj.weight", d, (h, self.heads * self.v_dim))]
        else:
            hd = self.head_dim
            s += [(p + "self_attn.q_proj.weight", d, (self.heads * hd, h)),
                  (p + "self_attn.k_proj.weight", d, (self.kv_heads * hd, h)),
                  (p + "self_attn.v_proj.weight", d, (self.kv_heads * hd, h))]
            if self.qkv_bias:
                s += [(p + "self_attn.q_proj.bias", d, (self.heads * hd,)),
                      (p + "self_attn.k_proj.bias", d, (self.kv_heads * hd,)),
                      (p + "self_attn.v_proj.bias", d, (self.kv_heads * hd,))]
            if self.qk_norm:
                s += [(p + "self_attn.q_norm.weight", d, (hd,)), (p + "self_attn.k_norm.weight", d, (hd,))]
            s.append((p + "self_attn.o_proj.weight", d, (h, self.heads * hd)))
        s.append((p + "post_attention_layernorm.weight", d, (h,)))
        if self.type == "glm4":  # sandwich norms; the checkpoint fuses gate and up
            return [*s, (p + "post_self_attn_layernorm.weight", d, (h,)),
                    (p + "post_mlp_layernorm.weight", d, (h,)), (p + "mlp.gate_up_proj.weight", d, (2 * self.ffn, h)),
                    (p + "mlp.down_proj.weight", d, (h, self.ffn))]
        if self.kind(i) == "dense":
            return s + _mlp(p + "mlp.", d, h, self.ffn)
        s.append((p + "mlp.gate.weight", d, (self.experts, h)))
        if self.type in ("deepseek_v3", "kimi_k2", "glm4_moe"):  # the router's learned bias, float32 as vLLM keeps it
            s.append((p + "mlp.gate.e_score_correction_bias", "float32", (self.experts,)))
        if self.shared:
            s += _mlp(p + "mlp.shared_experts.", d, h, self.moe_ffn * self.shared)
        for e in range(self.experts):
            s += _mlp(f"{p}mlp.experts.{e}.", d, h, self.moe_ffn)
        return s

    def outer_specs(self) -> list[Spec]:
        """The tensors outside the decoder layers: embeddings, final norm, head."""
        d, h = self.dtype, self.hidden
        s: list[Spec] = [("model.embed_tokens.weight", d, (self.vocab, h)), ("model.norm.weight", d, (h,))]
        if not self.tie:
            s.append(("lm_head.weight", d, (self.vocab, h)))
        return s

    def specs(self, layers: Iterable[int] | None = None) -> list[Spec]:
        """The HF tensors of `layers` (every layer by default) and the outer ones."""
        out = self.outer_specs()
        for i in range(self.layers) if layers is None else layers:
            out += self.layer_specs(i)
        return out

    def parameters(self) -> int:
        """Elements in the whole checkpoint (every layer), counted from one layer of each kind."""
        import math

        per_kind: dict[str, int] = {}
        for i in range(self.layers):
            k = self.kind(i)
            if k not in per_kind:
                per_kind[k] = sum(math.prod(s) for _, _, s in self.layer_specs(i))
        total = sum(math.prod(s) for _, _, s in self.outer_specs())
        return total + sum(per_kind[self.kind(i)] for i in range(self.layers))


def _mlp(p: str, d: str, h: int, ffn: int) -> list[Spec]:
    return [(p + "gate_proj.weight", d, (ffn, h)), (p + "up_proj.weight", d, (ffn, h)),
            (p + "down_proj.weight", d, (h, ffn))]
