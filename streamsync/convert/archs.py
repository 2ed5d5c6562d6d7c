"""Per-architecture tables: Megatron-core parameter name pattern -> mapping -> HF name template(s).

Megatron names are *global*: `decoder.layers.{L}` is the global layer index (megatron-core numbers layers
per pipeline stage; the source renumbers them) and `{E}` the global expert index. HF names are checkpoint
names, the ones vLLM's `load_weights` takes (per-expert MoE tensors, not transformers-5's fused in-memory
`experts.gate_up_proj`).

Both the local layer spec (`get_gpt_layer_local_spec`) and Transformer-Engine names are listed: TE fuses the
pre-attention and pre-MLP norms into linear_qkv / linear_fc1 (`layer_norm_weight`) and names grouped-GEMM
experts `experts.linear_fc1.weight{E}`. Where two Megatron names give the same HF name, the first listed is
the one the HF -> Megatron direction produces when it has no model to ask.
"""

from __future__ import annotations

from .mappings import QKV, ROW, Cast, GatedMLP, Mapping, Rename, Vocab

_M = "decoder.layers.{L}."
_H = "model.layers.{L}."


def _embeddings(tied: bool) -> list[Mapping]:
    return [
        Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        Cast("decoder.final_layernorm.weight", "model.norm.weight"),
        # Tied: the last pipeline stage keeps a copy of the embedding as output_layer; it is loaded from
        # the embedding and never sent (HF keeps one tensor).
        Vocab("output_layer.weight", "model.embed_tokens.weight", send=False) if tied
        else Vocab("output_layer.weight", "lm_head.weight"),
    ]


def _attention(*, qk_norm: bool, qkv_bias: bool) -> list[Mapping]:
    t: list[Mapping] = [
        Cast(_M + "input_layernorm.weight", _H + "input_layernorm.weight"),
        QKV(_M + "self_attention.linear_qkv.weight", _H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight",
            _H + "self_attn.v_proj.weight"),
        Rename(_M + "self_attention.linear_proj.weight", _H + "self_attn.o_proj.weight", tp=ROW),
        Cast(_M + "self_attention.linear_qkv.layer_norm_weight", _H + "input_layernorm.weight"),  # TE fused
    ]
    if qkv_bias:
        t.append(QKV(_M + "self_attention.linear_qkv.bias", _H + "self_attn.q_proj.bias",
                     _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"))
    if qk_norm:
        t += [Cast(_M + "self_attention.q_layernorm.weight", _H + "self_attn.q_norm.weight"),
              Cast(_M + "self_attention.k_layernorm.weight", _H + "self_attn.k_norm.weight")]
    return t


def _dense_mlp() -> list[Mapping]:
    return [
        Cast(_M + "pre_mlp_layernorm.weight", _H + "post_attention_layernorm.weight"),
        GatedMLP(_M + "mlp.linear_fc1.weight", _H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
        Rename(_M + "mlp.linear_fc2.weight", _H + "mlp.down_proj.weight", tp=ROW),
        Cast(_M + "mlp.linear_fc1.layer_norm_weight", _H + "post_attention_layernorm.weight"),  # TE fused
    ]


def _moe_mlp() -> list[Mapping]:
    e = _H + "mlp.experts.{E}."
    return [
        Cast(_M + "pre_mlp_layernorm.weight", _H + "post_attention_layernorm.weight"),
        Rename(_M + "mlp.router.weight", _H + "mlp.gate.weight", tp=None),
        # SequentialMLP (local spec)
        GatedMLP(_M + "mlp.experts.local_experts.{E}.linear_fc1.weight", e + "gate_proj.weight", e + "up_proj.weight"),
        Rename(_M + "mlp.experts.local_experts.{E}.linear_fc2.weight", e + "down_proj.weight", tp=ROW),
        # TEGroupedMLP (TE spec with moe_grouped_gemm)
        GatedMLP(_M + "mlp.experts.linear_fc1.weight{E}", e + "gate_proj.weight", e + "up_proj.weight"),
        Rename(_M + "mlp.experts.linear_fc2.weight{E}", e + "down_proj.weight", tp=ROW),
    ]


def table(arch: str, *, tied: bool = False) -> list[Mapping]:
    """The mapping table of `arch` (a canonical name: see `streamsync.convert.ARCHS`)."""
    if arch == "llama":  # Llama 2/3, Mistral: no q/k norm, no qkv bias
        return _embeddings(tied) + _attention(qk_norm=False, qkv_bias=False) + _dense_mlp()
    if arch == "qwen2":
        return _embeddings(tied) + _attention(qk_norm=False, qkv_bias=True) + _dense_mlp()
    if arch == "qwen3":
        return _embeddings(tied) + _attention(qk_norm=True, qkv_bias=False) + _dense_mlp()
    if arch == "qwen3-moe":
        return _embeddings(tied) + _attention(qk_norm=True, qkv_bias=False) + _moe_mlp()
    raise KeyError(arch)


__all__ = ["table"]
