"""Per-architecture tables: Megatron-core parameter name pattern -> mapping -> HF name template(s).

Megatron names are *global*: `decoder.layers.{L}` is the global layer index (megatron-core numbers layers
per pipeline stage; the source renumbers them) and `{E}` the global expert index. HF names are checkpoint
names, the ones vLLM's `load_weights` takes (per-expert MoE tensors, not transformers-5's fused in-memory
`experts.gate_up_proj`).

Both the local layer spec (`get_gpt_layer_local_spec`) and Transformer-Engine names are listed: TE fuses the
pre-attention and pre-MLP norms into linear_qkv / linear_fc1 (`layer_norm_weight`) and names grouped-GEMM
experts `experts.linear_fc1.weight{E}`. Where two Megatron names give the same HF name, the first listed is
the one the HF -> Megatron direction produces when it has no model to ask.

A table lists every tensor a family *may* have; a model uses the entries its names match (DeepSeek-V3's first
`first_k_dense_replace` layers match the dense MLP entries, the others the MoE ones; MLA without a query low rank
has `linear_q_proj`, with one `linear_q_down_proj` / `linear_q_up_proj`). MTP layers (Megatron's
`mtp.layers.{m}`, named here by their global layer index `{L}` = num_layers + m, as HF checkpoints number them)
hold a decoder layer under `transformer_layer.` (megatron-core 0.16) or `mtp_model_layer.` (later releases).
MiMo's checkpoints hold them apart, as `model.mtp_layers.{M}` with `{M}` = L - num_layers (the converter is told
num_layers).
"""

from __future__ import annotations

from .mappings import (
    COLUMN,
    QKV,
    ROW,
    Buffer,
    Cast,
    FusedGatedMLP,
    GatedMLP,
    Mapping,
    Rename,
    SwappedHalves,
    Vocab,
)

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


def _mla() -> list[Mapping]:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): the rows of every projection are laid out
    as HF's (per head [nope; rope] for q, [kv_lora_rank; rope] for kv_a, per head [k_nope; v] for kv_b), so each
    is a rename. The local spec splits the down projections over TP by rows (its forward gathers them); the TE
    spec keeps them whole (duplicated) and fuses the latent norms into the up projections."""
    a, h = _M + "self_attention.", _H + "self_attn."
    return [
        Cast(_M + "input_layernorm.weight", _H + "input_layernorm.weight"),
        Rename(a + "linear_q_proj.weight", h + "q_proj.weight", tp=COLUMN),  # no query low rank
        # vLLM keeps the down projections whole on every worker (ReplicatedLinear, fused as `fused_qkv_a_proj`)
        Rename(a + "linear_q_down_proj.weight", h + "q_a_proj.weight", tp=COLUMN, engine=None),
        Cast(a + "q_layernorm.weight", h + "q_a_layernorm.weight"),
        Cast(a + "linear_q_up_proj.layer_norm_weight", h + "q_a_layernorm.weight"),  # TE fused
        Rename(a + "linear_q_up_proj.weight", h + "q_b_proj.weight", tp=COLUMN),
        Rename(a + "linear_kv_down_proj.weight", h + "kv_a_proj_with_mqa.weight", tp=COLUMN, engine=None),
        Cast(a + "kv_layernorm.weight", h + "kv_a_layernorm.weight"),
        Cast(a + "linear_kv_up_proj.layer_norm_weight", h + "kv_a_layernorm.weight"),  # TE fused
        Rename(a + "linear_kv_up_proj.weight", h + "kv_b_proj.weight", tp=COLUMN),
        Rename(a + "linear_proj.weight", h + "o_proj.weight", tp=ROW),
    ]


def _dense_mlp(*, fused: bool = False) -> list[Mapping]:
    fc1 = (FusedGatedMLP(_M + "mlp.linear_fc1.weight", _H + "mlp.gate_up_proj.weight") if fused
           else GatedMLP(_M + "mlp.linear_fc1.weight", _H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"))
    return [
        Cast(_M + "pre_mlp_layernorm.weight", _H + "post_attention_layernorm.weight"),
        fc1,
        Rename(_M + "mlp.linear_fc2.weight", _H + "mlp.down_proj.weight", tp=ROW),
        Cast(_M + "mlp.linear_fc1.layer_norm_weight", _H + "post_attention_layernorm.weight"),  # TE fused
    ]


def _sandwich_norms() -> list[Mapping]:
    """GLM-4's norms after attention and after the MLP. megatron-core's TransformerLayer has no such modules; a
    GLM-4 layer adds them under these names (as mbridge's patched layer spec does)."""
    return [Cast(_M + "post_self_attn_layernorm.weight", _H + "post_self_attn_layernorm.weight"),
            Cast(_M + "post_mlp_layernorm.weight", _H + "post_mlp_layernorm.weight")]


def _shared_experts() -> list[Mapping]:
    """DeepSeek-V3 / GLM-4.5's always-on shared expert (no gate) and the router's learned expert bias (a float32
    buffer in megatron, `e_score_correction_bias` in HF)."""
    s = _H + "mlp.shared_experts."
    return [
        GatedMLP(_M + "mlp.shared_experts.linear_fc1.weight", s + "gate_proj.weight", s + "up_proj.weight"),
        Rename(_M + "mlp.shared_experts.linear_fc2.weight", s + "down_proj.weight", tp=ROW),
        Buffer(_M + "mlp.router.expert_bias", _H + "mlp.gate.e_score_correction_bias"),
    ]


def _mtp(layer: list[Mapping]) -> list[Mapping]:
    """MTP layers: their own norms and projection, then a decoder layer (`layer`: the family's layer entries)."""
    p = "mtp.layers.{L}."
    own: list[Mapping] = [
        Cast(p + "enorm.weight", _H + "enorm.weight"),
        Cast(p + "hnorm.weight", _H + "hnorm.weight"),
        # [enorm(embedding); hnorm(hidden)] -> hidden, in that order on both sides
        Rename(p + "eh_proj.weight", _H + "eh_proj.weight", tp=COLUMN, engine=None),  # vLLM: a plain nn.Linear
        Cast(p + "final_layernorm.weight", _H + "shared_head.norm.weight"),
    ]
    return own + [m.under(_M, p + sub) for sub in ("transformer_layer.", "mtp_model_layer.") for m in layer]


def _mimo_mtp(layer: list[Mapping]) -> list[Mapping]:
    """MiMo's MTP layers (`model.mtp_layers.{M}`): Megatron's MTP layer under MiMo's names, its input projection
    taking [hidden; embedding] where Megatron's takes [embedding; hidden]."""
    p, h = "mtp.layers.{L}.", "model.mtp_layers.{M}."
    own: list[Mapping] = [
        Cast(p + "enorm.weight", h + "token_layernorm.weight"),
        Cast(p + "hnorm.weight", h + "hidden_layernorm.weight"),
        SwappedHalves(p + "eh_proj.weight", h + "input_proj.weight", tp=COLUMN, engine=None),  # a plain nn.Linear
        Cast(p + "final_layernorm.weight", h + "final_layernorm.weight"),
    ]
    return own + [m.under(_M, p + sub, (_H, h)) for sub in ("transformer_layer.", "mtp_model_layer.") for m in layer]


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
    if arch == "mimo":  # MiMo: Qwen2 with MTP layers of its own naming
        layer = _attention(qk_norm=False, qkv_bias=True) + _dense_mlp()
        return _embeddings(tied) + layer + _mimo_mtp(layer)
    if arch == "qwen3":
        return _embeddings(tied) + _attention(qk_norm=True, qkv_bias=False) + _dense_mlp()
    if arch == "qwen3-moe":
        return _embeddings(tied) + _attention(qk_norm=True, qkv_bias=False) + _moe_mlp()
    if arch == "deepseek-v3":  # also Kimi-K2, Moonlight, DeepSeek-V2/R1: MLA, dense then MoE layers, MTP
        layer = _mla() + _dense_mlp() + _moe_mlp() + _shared_experts()
        return _embeddings(tied) + layer + _mtp(layer)
    if arch == "glm4":  # GLM-4 dense: q/k/v biases, sandwich norms, a fused gate_up_proj in the checkpoint
        return (_embeddings(tied) + _attention(qk_norm=False, qkv_bias=True) + _dense_mlp(fused=True)
                + _sandwich_norms())
    if arch == "glm4-moe":  # GLM-4.5 / 4.6 / 4.7: q/k/v biases, optional q/k norms, dense then MoE layers, MTP
        layer = _attention(qk_norm=True, qkv_bias=True) + _dense_mlp() + _moe_mlp() + _shared_experts()
        return _embeddings(tied) + layer + _mtp(layer)
    raise KeyError(arch)


#: buffers (not parameters) of a megatron-core model that training changes and a push carries, by name suffix
TRAINED_BUFFERS = ("mlp.router.expert_bias",)


__all__ = ["TRAINED_BUFFERS", "table"]
