"""Megatron <-> HF conversion as pure functions: no process groups, no megatron import, fast."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from streamsync.checksum import digests
from streamsync.convert import Dims, canonical_arch, check_config, detect_arch, get_converter
from streamsync.convert.mappings import (
    COLUMN,
    GATED,
    QKV,
    ROW,
    FusedGatedMLP,
    GatedMLP,
    Vocab,
    tp_merge,
    tp_split,
)
from streamsync.errors import ValidationError
from streamsync.models.megatron import TinyModel

MODELS = {
    "qwen3": TinyModel("qwen3", vocab=101),
    "qwen2": TinyModel("qwen2", vocab=101),
    "llama": TinyModel("llama", vocab=128, heads=8, kv_heads=8, head_dim=8),
    "qwen3-moe": TinyModel("qwen3-moe", vocab=101, experts=4),
    "qwen2-tied": TinyModel("qwen2", vocab=99, tie=True),
    "deepseek-v3": TinyModel("deepseek-v3", vocab=101, layers=3, experts=4, shared_ffn=32, first_dense=1, q_lora=32),
    "deepseek-v3 no q low rank": TinyModel("deepseek-v3", vocab=101, experts=4, shared_ffn=32, first_dense=1),
    "glm4": TinyModel("glm4", vocab=101),
    "glm4-moe": TinyModel("glm4-moe", vocab=101, layers=3, experts=4, shared_ffn=32, first_dense=1),
    "glm4-moe no q/k norm": TinyModel("glm4-moe", vocab=101, experts=4, shared_ffn=32, first_dense=1, qk_norm=False),
    "deepseek-v3 mtp": TinyModel("deepseek-v3", vocab=101, experts=4, shared_ffn=32, first_dense=1, q_lora=32, mtp=1),
    "mimo": TinyModel("mimo", vocab=101, mtp=1),
}


def dims_of(m: TinyModel) -> Dims:
    return Dims(m.heads, m.kv_heads, m.head_dim, m.vocab)


def shard_all(conv, full: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """What each of `tp` ranks holds (experts: expert-TP = TP here), by the table's TP layouts."""
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, t in full.items():
        for r, shard in enumerate(tp_split(t, conv.resolve(name).mapping.tp, tp)):
            ranks[r][name] = shard.clone()
    return ranks


@pytest.mark.parametrize("key", sorted(MODELS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_megatron_hf_round_trip_is_bit_exact(key: str, tp: int) -> None:
    m = MODELS[key]
    hf = m.hf_state(seed=tp)
    conv = get_converter(m.arch, tied=m.tie, num_layers=m.layers)
    dims = dims_of(m)
    full = conv.to_megatron_state(hf, dims, padded_vocab=m.padded_vocab(tp))
    shards = shard_all(conv, full, tp)
    merged = {n: tp_merge([s[n] for s in shards], conv.resolve(n).mapping.tp) for n in full}
    back = conv.to_hf_state(merged, dims)
    # the source casts to the receiver's dtype (float32 norms -> bf16); bf16 -> fp32 -> bf16 is lossless
    assert digests((n, t.to(hf[n].dtype)) for n, t in back.items()) == digests(hf.items())


def test_megatron_names_are_those_of_the_local_layer_spec() -> None:
    m = MODELS["qwen3-moe"]
    full = get_converter(m.arch).to_megatron_state(m.hf_state(), dims_of(m))
    layer0 = sorted(n for n in full if n.startswith("decoder.layers.0."))
    assert layer0 == sorted(
        ["decoder.layers.0." + s for s in (
            "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight",
            "mlp.router.weight")]
        + [f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(4) for i in (1, 2)])
    assert {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"} <= set(full)


def test_qkv_is_grouped_per_query_group() -> None:
    heads, groups, hd, hidden = 8, 2, 4, 3
    dims = Dims(heads, groups, hd, 10)
    q = torch.arange(heads * hd * hidden, dtype=torch.float32).view(heads * hd, hidden)
    k = -torch.arange(1, groups * hd * hidden + 1, dtype=torch.float32).view(groups * hd, hidden)
    v = 1000 + torch.arange(groups * hd * hidden, dtype=torch.float32).view(groups * hd, hidden)
    fused = QKV("x", "q", "k", "v").to_megatron([q, k, v], dims)
    hpg = heads // groups
    expect = torch.cat([torch.cat([q[g * hpg * hd:(g + 1) * hpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]])
                        for g in range(groups)])
    assert torch.equal(fused, expect)
    # TP=2 splits whole query groups: rank 1 holds group 1 = [q heads 4..7; k_1; v_1]
    assert torch.equal(tp_split(fused, COLUMN, 2)[1], expect[(hpg + 2) * hd:])
    assert all(torch.equal(a, b) for a, b in zip(QKV("x", "q", "k", "v").to_hf(fused, dims), [q, k, v], strict=True))


def test_qkv_bias_round_trips() -> None:
    dims = Dims(4, 2, 3, 10)
    q, k, v = torch.randn(12), torch.randn(6), torch.randn(6)
    m = QKV("b", "q", "k", "v")
    assert m.hf_shapes((24,), dims) == [(12,), (6,), (6,)]
    assert all(torch.equal(a, b) for a, b in zip(m.to_hf(m.to_megatron([q, k, v], dims), dims), [q, k, v],
                                                   strict=True))


def test_gated_fc1_shard_is_gate_then_up_of_that_rank() -> None:
    gate, up = torch.arange(8.0).view(8, 1), 100 + torch.arange(8.0).view(8, 1)
    full = GatedMLP("fc1", "gate", "up").to_megatron([gate, up], Dims(1, 1, 1, 1))
    shards = tp_split(full, GATED, 2)
    assert torch.equal(shards[0], torch.cat([gate[:4], up[:4]]))
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    assert torch.equal(tp_merge(shards, GATED), full)


def test_row_parallel_splits_columns() -> None:
    t = torch.arange(24.0).view(4, 6)
    shards = tp_split(t, ROW, 3)
    assert [tuple(s.shape) for s in shards] == [(4, 2)] * 3
    assert torch.equal(tp_merge(shards, ROW), t)


def test_vocab_padding_is_zero_rows_and_dropped_again() -> None:
    emb = torch.randn(101, 8, dtype=torch.bfloat16)
    m = Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    dims = Dims(1, 1, 1, 101)
    padded = m.to_megatron([emb], dims, (112, 8))
    assert padded.shape == (112, 8) and not padded[101:].any()
    assert m.hf_shapes((112, 8), dims) == [(101, 8)]
    (back,) = m.to_hf(padded, dims)
    assert torch.equal(back, emb) and back.data_ptr() == padded.data_ptr()  # a view: no copy


def test_norms_become_float32_in_megatron_and_exact_back() -> None:
    m = MODELS["qwen3"]
    hf = m.hf_state()
    conv = get_converter("qwen3")
    full = conv.to_megatron_state(hf, dims_of(m))
    assert full["decoder.layers.1.self_attention.q_layernorm.weight"].dtype == torch.float32
    assert full["decoder.final_layernorm.weight"].dtype == torch.float32
    assert full["decoder.layers.1.mlp.linear_fc2.weight"].dtype == torch.bfloat16
    back = conv.to_hf_state(full, dims_of(m))
    assert torch.equal(back["model.norm.weight"].to(torch.bfloat16), hf["model.norm.weight"])


def test_tied_output_layer_is_filled_from_the_embedding_and_never_sent() -> None:
    m = MODELS["qwen2-tied"]
    hf = m.hf_state()
    conv = get_converter("qwen2", tied=True)
    dims = dims_of(m)
    out = conv.to_megatron("output_layer.weight", hf, dims, (104, m.hidden))
    assert torch.equal(out[: m.vocab], hf["model.embed_tokens.weight"])
    assert conv.resolve("output_layer.weight").mapping.send is False
    assert "lm_head.weight" not in conv.to_hf_state({"output_layer.weight": out}, dims)


def test_te_fused_norm_names_map_to_the_hf_norms() -> None:
    conv = get_converter("llama")
    assert conv.resolve("decoder.layers.7.self_attention.linear_qkv.layer_norm_weight").hf == (
        "model.layers.7.input_layernorm.weight",)
    assert conv.resolve("decoder.layers.7.mlp.linear_fc1.layer_norm_weight").hf == (
        "model.layers.7.post_attention_layernorm.weight",)


def test_expert_names_carry_layer_and_global_expert_index() -> None:
    conv = get_converter("qwen3-moe")
    r = conv.resolve("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight")
    assert (r.layer, r.expert) == (3, 5)
    assert r.hf == ("model.layers.3.mlp.experts.5.gate_proj.weight", "model.layers.3.mlp.experts.5.up_proj.weight")
    assert conv.resolve("decoder.layers.3.mlp.experts.linear_fc2.weight5").hf == (
        "model.layers.3.mlp.experts.5.down_proj.weight",)  # TE grouped-GEMM naming
    assert conv.resolve("decoder.layers.3.mlp.router.weight").hf == ("model.layers.3.mlp.gate.weight",)


def test_unknown_parameter_is_a_clear_error() -> None:
    with pytest.raises(ValidationError, match=r"no mapping for Megatron parameter 'decoder\.layers\.0\.mlp\.weird'"):
        get_converter("qwen3").resolve("decoder.layers.0.mlp.weird")
    with pytest.raises(ValidationError, match="no mapping produces HF tensor"):
        get_converter("llama").to_megatron_state({"model.layers.0.self_attn.q_norm.weight": torch.ones(2)},
                                                 Dims(1, 1, 2, 4))


def test_missing_hf_tensor_is_named() -> None:
    with pytest.raises(ValidationError, match=r"model.layers.0.self_attn.v_proj.weight"):
        get_converter("qwen3").to_megatron("decoder.layers.0.self_attention.linear_qkv.weight",
                                           {"model.layers.0.self_attn.q_proj.weight": torch.ones(4, 2),
                                            "model.layers.0.self_attn.k_proj.weight": torch.ones(2, 2)},
                                           Dims(2, 1, 2, 4))


@pytest.mark.parametrize(("config", "arch"), [
    (SimpleNamespace(num_moe_experts=8, qk_layernorm=True), "qwen3-moe"),
    (SimpleNamespace(num_moe_experts=None, qk_layernorm=True), "qwen3"),
    (SimpleNamespace(num_moe_experts=None, qk_layernorm=False, add_qkv_bias=True), "qwen2"),
    (SimpleNamespace(num_moe_experts=None, qk_layernorm=False, add_qkv_bias=False), "llama"),
    (SimpleNamespace(multi_latent_attention=True, num_moe_experts=8), "deepseek-v3"),
    (SimpleNamespace(num_moe_experts=8, moe_shared_expert_intermediate_size=64, add_qkv_bias=True), "glm4-moe"),
])
def test_arch_is_detected_from_the_megatron_config(config: object, arch: str) -> None:
    assert detect_arch(config) == arch


def test_hf_model_type_wins_and_aliases_resolve() -> None:
    assert detect_arch(SimpleNamespace(qk_layernorm=True), {"model_type": "mistral"}) == "llama"
    assert canonical_arch("Qwen3_MoE") == "qwen3-moe"
    with pytest.raises(ValidationError, match="unknown architecture"):
        get_converter("gpt2")


def test_the_new_families_resolve_by_their_hf_names() -> None:
    for name in ("deepseek_v3", "kimi_k2", "moonlight", "deepseek_v2"):
        assert canonical_arch(name) == "deepseek-v3"
    assert detect_arch(None, {"model_type": "glm4_moe"}) == "glm4-moe"
    assert detect_arch(None, {"model_type": "glm4"}) == "glm4"


def test_mla_projections_are_renames_with_their_tp_split() -> None:
    conv = get_converter("deepseek-v3")
    want = {
        "self_attention.linear_q_proj.weight": ("self_attn.q_proj.weight", COLUMN),
        "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight", COLUMN),
        "self_attention.q_layernorm.weight": ("self_attn.q_a_layernorm.weight", None),
        "self_attention.linear_q_up_proj.layer_norm_weight": ("self_attn.q_a_layernorm.weight", None),
        "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight", COLUMN),
        "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight", COLUMN),
        "self_attention.kv_layernorm.weight": ("self_attn.kv_a_layernorm.weight", None),
        "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight", COLUMN),
        "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", ROW),
        "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.down_proj.weight", ROW),
    }
    for meg, (hf, tp) in want.items():
        r = conv.resolve(f"decoder.layers.5.{meg}")
        assert r.hf == (f"model.layers.5.{hf}",) and r.mapping.tp == tp, (meg, r)
    shared = conv.resolve("decoder.layers.5.mlp.shared_experts.linear_fc1.weight")
    assert shared.hf == ("model.layers.5.mlp.shared_experts.gate_proj.weight",
                         "model.layers.5.mlp.shared_experts.up_proj.weight") and shared.mapping.tp == GATED


def test_the_expert_bias_is_a_trained_buffer_sent_in_float32() -> None:
    for arch in ("deepseek-v3", "glm4-moe"):
        r = get_converter(arch).resolve("decoder.layers.3.mlp.router.expert_bias")
        assert r.hf == ("model.layers.3.mlp.gate.e_score_correction_bias",)
        assert r.mapping.buffer and r.mapping.hf_dtype == torch.float32 and r.mapping.tp is None
        bias = torch.randn(8)
        assert r.mapping.to_megatron([bias.to(torch.bfloat16)], Dims(1, 1, 1, 1)).dtype == torch.float32


def test_mtp_layers_are_named_by_their_hf_index_under_either_megatron_name() -> None:
    conv = get_converter("deepseek-v3")
    assert conv.resolve("mtp.layers.61.enorm.weight").hf == ("model.layers.61.enorm.weight",)
    assert conv.resolve("mtp.layers.61.hnorm.weight").hf == ("model.layers.61.hnorm.weight",)
    assert conv.resolve("mtp.layers.61.eh_proj.weight").mapping.tp == COLUMN
    assert conv.resolve("mtp.layers.61.final_layernorm.weight").hf == ("model.layers.61.shared_head.norm.weight",)
    for sub in ("transformer_layer", "mtp_model_layer"):
        r = conv.resolve(f"mtp.layers.61.{sub}.mlp.experts.local_experts.7.linear_fc2.weight")
        assert r.hf == ("model.layers.61.mlp.experts.7.down_proj.weight",) and r.layer == 61 and r.expert == 7


def test_mimos_mtp_layers_are_numbered_apart_and_its_input_projection_takes_the_hidden_state_first() -> None:
    """MiMo holds MTP layer m as `model.mtp_layers.{m}` (Megatron: `mtp.layers.{num_layers + m}`, as the source
    names them); its input_proj computes from [hidden; embedding], Megatron's eh_proj from [embedding; hidden]."""
    conv = get_converter("mimo", num_layers=36)
    assert conv.resolve("mtp.layers.36.enorm.weight").hf == ("model.mtp_layers.0.token_layernorm.weight",)
    assert conv.resolve("mtp.layers.36.hnorm.weight").hf == ("model.mtp_layers.0.hidden_layernorm.weight",)
    assert conv.resolve("mtp.layers.36.final_layernorm.weight").hf == ("model.mtp_layers.0.final_layernorm.weight",)
    for sub in ("transformer_layer", "mtp_model_layer"):
        r = conv.resolve(f"mtp.layers.36.{sub}.self_attention.linear_qkv.bias")
        assert r.hf == tuple(f"model.mtp_layers.0.self_attn.{x}_proj.bias" for x in "qkv") and r.layer == 36
    assert conv.find_hf("model.mtp_layers.0.mlp.down_proj.weight").megatron == (
        "mtp.layers.36.transformer_layer.mlp.linear_fc2.weight")
    assert conv.resolve("decoder.layers.35.self_attention.linear_qkv.bias").hf[0] == (
        "model.layers.35.self_attn.q_proj.bias")
    r = conv.resolve("mtp.layers.36.eh_proj.weight")
    assert r.hf == ("model.mtp_layers.0.input_proj.weight",) and r.mapping.tp == COLUMN
    # megatron-core's MTP layer: eh_proj(cat((decoder_input, hidden_states), -1)); vLLM's MiMo MTP layer:
    # input_proj(cat([previous_hidden_states, inputs_embeds], -1)). The same inputs must give the same output.
    # (integer values: exact sums in any order)
    w, emb, hidden = (torch.randint(-9, 9, shape).double() for shape in ((4, 8), (3, 4), (3, 4)))
    (hf,) = r.mapping.to_hf(w, Dims(1, 1, 1, 1))
    assert torch.equal(torch.cat([hidden, emb], -1) @ hf.T, torch.cat([emb, hidden], -1) @ w.T)
    assert torch.equal(r.mapping.to_megatron([hf], Dims(1, 1, 1, 1)), w)
    with pytest.raises(ValidationError, match="num_layers"):
        get_converter("mimo").resolve("mtp.layers.36.eh_proj.weight")
    with pytest.raises(ValidationError, match="MTP layer 3 is not after"):
        conv.resolve("mtp.layers.3.eh_proj.weight")
    assert detect_arch(SimpleNamespace(add_qkv_bias=True, mtp_num_layers=1)) == "mimo"
    assert detect_arch(None, {"model_type": "mimo"}) == "mimo"
    check_config("mimo", SimpleNamespace(add_qkv_bias=True, mtp_num_layers=1))


def test_glm4s_fused_gate_up_shard_holds_each_half_of_that_rank() -> None:
    conv = get_converter("glm4")
    r = conv.resolve("decoder.layers.0.mlp.linear_fc1.weight")
    assert isinstance(r.mapping, FusedGatedMLP) and r.hf == ("model.layers.0.mlp.gate_up_proj.weight",)
    full = torch.arange(8 * 3).reshape(8, 3)  # gate rows 0-3, up rows 4-7
    for rank, shard in enumerate(tp_split(full, r.mapping.tp, 2)):
        parts = r.mapping.shard_parts(tuple(shard.shape), Dims(1, 1, 1, 1), 2, rank)
        assert [(p.hf, p.box.start[0], p.box.size[0]) for p in parts] == [(0, 2 * rank, 2), (0, 4 + 2 * rank, 2)]
        for p in parts:  # the shard's rows are the full tensor's rows the box names
            assert torch.equal(shard[p.local.start[0]:p.local.start[0] + p.local.size[0]],
                               full[p.box.start[0]:p.box.start[0] + p.box.size[0]])
    assert [n for n, _, _ in TinyModel("glm4").hf_specs() if "post_" in n and "layers.0." in n] == [
        "model.layers.0.post_attention_layernorm.weight", "model.layers.0.post_self_attn_layernorm.weight",
        "model.layers.0.post_mlp_layernorm.weight"]


@pytest.mark.parametrize(("arch", "config", "named"), [
    ("qwen3", SimpleNamespace(add_bias_linear=True), "add_bias_linear"),
    ("qwen3-moe", SimpleNamespace(num_moe_experts=8, moe_shared_expert_gate=True), "moe_shared_expert_gate"),
    ("qwen3", SimpleNamespace(multi_latent_attention=True), "multi_latent_attention"),
    ("deepseek-v3", SimpleNamespace(multi_latent_attention=False), "multi_latent_attention"),
    ("deepseek-v3", SimpleNamespace(multi_latent_attention=True, q_lora_rank=64, qk_layernorm=False), "qk_layernorm"),
    ("glm4", SimpleNamespace(num_moe_experts=8), "num_moe_experts"),
    ("qwen3-moe", SimpleNamespace(num_moe_experts=8, moe_router_enable_expert_bias=True),
     "moe_router_enable_expert_bias"),
    ("llama", SimpleNamespace(mtp_num_layers=1), "mtp_num_layers"),
])
def test_a_megatron_option_the_table_does_not_map_is_refused_by_name(arch: str, config: object, named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        check_config(arch, config)
    check_config("deepseek-v3", SimpleNamespace(multi_latent_attention=True, q_lora_rank=64, qk_layernorm=True,
                                                num_moe_experts=8, moe_router_enable_expert_bias=True,
                                                mtp_num_layers=1))


@pytest.mark.parametrize("model_type", ["qwen2", "deepseek_v3", "glm4", "glm4_moe"])
def test_the_tiny_specs_are_what_transformers_saves_for_that_family(model_type: str, tmp_path) -> None:
    """The test models' HF names, shapes and dtypes are those of the family's own transformers class, as
    `save_pretrained` writes them (per-expert tensors, the expert bias in float32): an independent reference."""
    from safetensors import safe_open

    from streamsync.models.megatron import _tiny_from_config, hf_config
    from streamsync.models.tiny import make_tiny

    model_dir = make_tiny(model_type, tmp_path)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        saved = {n: (str(f.get_slice(n).get_dtype()), tuple(f.get_slice(n).get_shape())) for n in f.keys()}  # noqa: SIM118
    short = {"bfloat16": "BF16", "float32": "F32"}
    specs = {n: (short[d], tuple(s)) for n, d, s in _tiny_from_config(hf_config(model_dir)).hf_specs()}
    assert specs == saved


def test_a_trainer_of_another_family_is_refused_and_one_of_the_same_family_is_not() -> None:
    from streamsync.convert import same_family
    from streamsync.plan.check import check_family

    assert same_family(["MistralForCausalLM"], ["LlamaForCausalLM"])
    assert same_family(["KimiK2ForCausalLM"], ["DeepseekV3ForCausalLM"])
    assert not same_family(["Glm4ForCausalLM"], ["Glm4MoeForCausalLM"])
    assert same_family(["Qwen2ForCausalLM"], ["MiMoForCausalLM"])  # MiMo's main model is Qwen2's
    assert not same_family(["MiMoForCausalLM"], ["Qwen3ForCausalLM"])
    check_family((), {"e": ("Qwen3ForCausalLM",)})  # a trainer that cannot say is not refused
    check_family(("Qwen3ForCausalLM",), {"e": ()})  # nor an engine that cannot
    with pytest.raises(ValidationError, match=r"engine 'e'.*Glm4MoeForCausalLM.*Qwen3MoeForCausalLM"):
        check_family(("Glm4MoeForCausalLM",), {"e": ("Qwen3MoeForCausalLM",)})


@pytest.mark.parametrize("preset", ["qwen3-8b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2", "moonlight-16b-a3b",
                                    "glm-4.5-air"])
def test_every_tensor_the_planner_names_is_one_a_converter_maps(preset: str) -> None:
    """`streamsync plan` plans only models a push can carry: each HF tensor of a preset (two layers of each kind)
    comes from a Megatron parameter of its family's table."""
    from streamsync.plan.shapes import PRESETS, Shape

    shape = Shape(PRESETS[preset])
    conv = get_converter(shape.type, tied=shape.tie)
    layers = sorted({*range(min(2, shape.layers)), shape.first_dense, shape.layers - 1})
    for name, _, _ in shape.specs(layers):
        assert conv.find_hf(name) is not None, (preset, name)


@pytest.mark.parametrize("model_type", ["qwen2", "deepseek_v3", "glm4", "glm4_moe"])
def test_the_planners_tensors_are_those_of_the_checkpoint(model_type: str, tmp_path) -> None:
    """The planner's shapes of a family (names, dtypes, shapes) are what its transformers class saves."""
    from streamsync.models.megatron import _tiny_from_config, hf_config
    from streamsync.models.tiny import make_tiny
    from streamsync.plan.shapes import Shape

    cfg = hf_config(make_tiny(model_type, tmp_path))
    assert sorted(Shape(cfg).specs()) == sorted(
        (n, d, tuple(s)) for n, d, s in _tiny_from_config(cfg).hf_specs())


def test_the_planner_plans_mimo_as_the_main_model_its_engine_loads(tmp_path) -> None:
    """A MiMo config.json plans Qwen2's layers: the checkpoint's tensors less its MTP layers (`model.mtp_layers`),
    which vLLM's main model does not load; every one of them is a tensor the mimo converter maps."""
    from safetensors import safe_open

    from streamsync.models.megatron import hf_config
    from streamsync.models.tiny import make_tiny
    from streamsync.plan.shapes import Shape
    from streamsync.testing.vllm import as_mimo, with_mtp_layer

    mimo = with_mtp_layer(as_mimo(make_tiny("qwen2", tmp_path), tmp_path / "mimo"), tmp_path / "mtp", seed=1)
    with safe_open(str(mimo / "model.safetensors"), "pt") as f:
        held = {n for n in f.keys() if not n.startswith("model.mtp_layers.")}  # noqa: SIM118
    cfg = hf_config(mimo)
    assert {n for n, _, _ in Shape(cfg).specs()} == held
    conv = get_converter("mimo", num_layers=cfg["num_hidden_layers"])
    assert all(conv.find_hf(n) is not None for n in held)
