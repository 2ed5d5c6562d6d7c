"""Megatron-core models from and to HF weights: `load_hf_weights`, `export_hf`, `TinyModel`, `build_model`."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..convert import Dims, canonical_arch, check_config, detect_arch, get_converter, tp_split
from ..errors import ValidationError
from ..sources.megatron import global_parameters, topology, unwrap_chunks
from .synthetic import Spec, StateModule

# ------------------------------------------------------------------------------------------ HF -> Megatron


def load_hf_weights(model: object, hf_state: Mapping[str, torch.Tensor], *, arch: str | None = None,
                    vocab_size: int | None = None) -> int:
    """Copy `hf_state` (full HF tensors, checkpoint names) into this rank's shards of `model`.

    Every parameter of the model must be found (ValidationError otherwise); the vocabulary is padded with
    zero rows to megatron's size; norms become float32 where megatron keeps them so. Issues no collective.
    Returns the number of parameters written.
    """
    chunks = unwrap_chunks(model)
    first = chunks[0]
    cfg = first.config
    tied = bool(getattr(first, "share_embeddings_and_output_weights", False))
    key = canonical_arch(arch) if arch else detect_arch(cfg, names=(n for n, _ in first.named_parameters()))
    check_config(key, cfg)
    conv = get_converter(key, tied=tied, num_layers=cfg.num_layers)
    vocab = vocab_size or hf_state["model.embed_tokens.weight"].shape[0]
    dims = Dims(cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels, vocab)
    coords, groups = topology(first)
    n = 0
    with torch.no_grad():
        for name, param, expert in global_parameters(chunks):
            p: Any = param  # megatron's partition_dim / partition_stride are attributes of its own
            size, rank = (groups.etp_size, coords.etp) if expert else (groups.tp_size, coords.tp)
            layout = None
            if size > 1 and getattr(p, "tensor_model_parallel", False):
                r = conv.resolve(name)
                if r.mapping.tp is None or (p.partition_dim, p.partition_stride) != (r.mapping.tp.dim,
                                                                                      r.mapping.tp.stride):
                    raise ValidationError(f"{name!r}: megatron splits dim {p.partition_dim} stride "
                                          f"{p.partition_stride}, the table says {r.mapping.tp}")
                layout = r.mapping.tp
            full_shape = list(p.shape)
            if layout is not None:
                full_shape[layout.dim] *= size
            full = conv.to_megatron(name, hf_state, dims, tuple(full_shape))
            shard = tp_split(full, layout, size)[rank]
            if tuple(shard.shape) != tuple(p.shape):
                raise ValidationError(f"{name!r}: HF gives a {tuple(shard.shape)} shard, megatron holds "
                                      f"{tuple(p.shape)}")
            p.data.copy_(shard)
            n += 1
    return n


async def export_hf_async(model: object, *, chunk_bytes: int = 256 << 20, device: torch.device | str | None = None,
                          **options: Any) -> dict[str, torch.Tensor] | None:
    """The full HF state dict of a (sharded) megatron model, through the same gathers and conversions as a push.

    Collective: every rank of the default group calls it. Returns the tensors (copies, on `device`: by default
    the model's; "cpu" keeps the export of a large model off a GPU that has no room for a second copy) on the
    sender, global rank 0, and None elsewhere. `options` go to MegatronSource (arch, dtype, hf_config,
    vocab_size, ...).
    """
    from ..sources.megatron import MegatronSource

    source = MegatronSource(model, **options)
    out: dict[str, torch.Tensor] = {}
    for plan in source.plan(chunk_bytes):
        gathered = await source.gather(plan)
        if source.is_sender:
            tensors = await source.convert(plan, gathered)
            out.update((s.name, t.reshape(s.shape).to(device or t.device, copy=True))
                       for s, t in zip(plan.specs, tensors, strict=True))
    return out if source.is_sender else None


def export_hf(model: object, **options: Any) -> dict[str, torch.Tensor] | None:
    """`export_hf_async` for code outside an event loop."""
    import functools

    import anyio

    return anyio.run(functools.partial(export_hf_async, model, **options))


# ------------------------------------------------------------------------------------------ tiny models


@dataclass(frozen=True)
class TinyModel:
    """A small model of one architecture, on both sides: HF checkpoint specs and a megatron GPTModel."""

    arch: str = "qwen3"
    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    experts: int = 0
    moe_ffn: int = 32
    tie: bool = False
    dtype: str = "bfloat16"
    # DeepSeek-V3 (MLA): query low rank (0: none, one q_proj), latent rank, rope / nope / value head dims
    q_lora: int = 0
    kv_lora: int = 32
    rope_dim: int = 8
    nope_dim: int = 16
    v_dim: int = 16
    # DeepSeek-V3 / GLM-4.5: the shared expert's width (0: none), leading dense layers, MTP layers, q/k norms
    shared_ffn: int = 0
    first_dense: int = 0
    mtp: int = 0
    qk_norm: bool = True

    @property
    def mla(self) -> bool:
        return canonical_arch(self.arch) == "deepseek-v3"

    def _layer_specs(self, i: int) -> list[Spec]:
        """The HF tensors of decoder layer `i` (an MTP layer's decoder layer too)."""
        arch = canonical_arch(self.arch)
        d, h, hd = self.dtype, self.hidden, self.head_dim
        p = f"model.layers.{i}."
        s: list[Spec] = [(p + "input_layernorm.weight", d, (h,))]
        if self.mla:
            a, qd = p + "self_attn.", self.nope_dim + self.rope_dim
            if self.q_lora:
                s += [(a + "q_a_proj.weight", d, (self.q_lora, h)), (a + "q_a_layernorm.weight", d, (self.q_lora,)),
                      (a + "q_b_proj.weight", d, (self.heads * qd, self.q_lora))]
            else:
                s.append((a + "q_proj.weight", d, (self.heads * qd, h)))
            s += [(a + "kv_a_proj_with_mqa.weight", d, (self.kv_lora + self.rope_dim, h)),
                  (a + "kv_a_layernorm.weight", d, (self.kv_lora,)),
                  (a + "kv_b_proj.weight", d, (self.heads * (self.nope_dim + self.v_dim), self.kv_lora)),
                  (a + "o_proj.weight", d, (h, self.heads * self.v_dim))]
        else:
            s += [(p + "self_attn.q_proj.weight", d, (self.heads * hd, h)),
                  (p + "self_attn.k_proj.weight", d, (self.kv_heads * hd, h)),
                  (p + "self_attn.v_proj.weight", d, (self.kv_heads * hd, h))]
            if arch in ("qwen2", "mimo", "glm4", "glm4-moe"):
                s += [(p + "self_attn.q_proj.bias", d, (self.heads * hd,)),
                      (p + "self_attn.k_proj.bias", d, (self.kv_heads * hd,)),
                      (p + "self_attn.v_proj.bias", d, (self.kv_heads * hd,))]
            if arch in ("qwen3", "qwen3-moe") or (arch == "glm4-moe" and self.qk_norm):
                s += [(p + "self_attn.q_norm.weight", d, (hd,)), (p + "self_attn.k_norm.weight", d, (hd,))]
            s.append((p + "self_attn.o_proj.weight", d, (h, self.heads * hd)))
        s.append((p + "post_attention_layernorm.weight", d, (h,)))
        if arch == "glm4":
            s += [(p + "post_self_attn_layernorm.weight", d, (h,)), (p + "post_mlp_layernorm.weight", d, (h,))]
        if self.experts and i >= self.first_dense:
            s.append((p + "mlp.gate.weight", d, (self.experts, h)))
            if self.shared_ffn:
                s.append((p + "mlp.gate.e_score_correction_bias", "float32", (self.experts,)))
            for e in range(self.experts):
                q = f"{p}mlp.experts.{e}."
                s += [(q + "gate_proj.weight", d, (self.moe_ffn, h)), (q + "up_proj.weight", d, (self.moe_ffn, h)),
                      (q + "down_proj.weight", d, (h, self.moe_ffn))]
            if self.shared_ffn:
                q = p + "mlp.shared_experts."
                s += [(q + "gate_proj.weight", d, (self.shared_ffn, h)),
                      (q + "up_proj.weight", d, (self.shared_ffn, h)),
                      (q + "down_proj.weight", d, (h, self.shared_ffn))]
        elif arch == "glm4":
            s += [(p + "mlp.gate_up_proj.weight", d, (2 * self.ffn, h)), (p + "mlp.down_proj.weight", d, (h, self.ffn))]
        else:
            s += [(p + "mlp.gate_proj.weight", d, (self.ffn, h)), (p + "mlp.up_proj.weight", d, (self.ffn, h)),
                  (p + "mlp.down_proj.weight", d, (h, self.ffn))]
        return s

    def hf_specs(self) -> list[Spec]:
        """HF checkpoint names, dtypes and shapes (per-expert MoE tensors, as vLLM loads them; an MTP layer's own
        tensors, not the copies of the embedding and output layer DeepSeek-V3 checkpoints also hold there)."""
        d, h = self.dtype, self.hidden
        s: list[Spec] = [("model.embed_tokens.weight", d, (self.vocab, h))]
        for i in range(self.layers):
            s += self._layer_specs(i)
        for i in range(self.layers, self.layers + self.mtp):
            p = f"model.layers.{i}."
            if canonical_arch(self.arch) == "mimo":  # MiMo holds its MTP layers apart, numbered from 0
                q = f"model.mtp_layers.{i - self.layers}."
                s += [(q + "token_layernorm.weight", d, (h,)), (q + "hidden_layernorm.weight", d, (h,)),
                      (q + "input_proj.weight", d, (h, 2 * h))]
                s += [(q + n[len(p):], dt, shape) for n, dt, shape in self._layer_specs(i)]
                s.append((q + "final_layernorm.weight", d, (h,)))
                continue
            s += [(p + "enorm.weight", d, (h,)), (p + "hnorm.weight", d, (h,)), (p + "eh_proj.weight", d, (h, 2 * h))]
            s += self._layer_specs(i)
            s.append((p + "shared_head.norm.weight", d, (h,)))
        s.append(("model.norm.weight", d, (h,)))
        if not self.tie:
            s.append(("lm_head.weight", d, (self.vocab, h)))
        return s

    def hf_state(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random HF weights, the same in every process for the same seed."""
        return dict(StateModule(self.hf_specs(), fill="random", seed=seed).state_dict())

    def hf_config(self) -> dict[str, Any]:
        """The HF config fields MegatronSource reads (`hf_config=` accepts a dict or a transformers config)."""
        model_type = {"llama": "llama", "qwen2": "qwen2", "mimo": "mimo", "qwen3": "qwen3", "qwen3-moe": "qwen3_moe",
                      "deepseek-v3": "deepseek_v3", "glm4": "glm4", "glm4-moe": "glm4_moe"}
        return {"model_type": model_type[canonical_arch(self.arch)], "vocab_size": self.vocab,
                "tie_word_embeddings": self.tie, "dtype": self.dtype}

    def padded_vocab(self, tp: int, divisible_by: int = 8) -> int:
        """Megatron's vocabulary: rounded up to a multiple of divisible_by x TP (as Megatron-LM pads it)."""
        m = divisible_by * tp
        return (self.vocab + m - 1) // m * m

    def transformer_config(self, **overrides: Any) -> Any:
        """The megatron-core TransformerConfig, with the parallel sizes of the current parallel_state."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

        arch = canonical_arch(self.arch)
        dtype = getattr(torch, self.dtype)
        kw: dict[str, Any] = dict(
            num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
            num_query_groups=self.kv_heads, kv_channels=self.head_dim, ffn_hidden_size=self.ffn,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, add_qkv_bias=arch in ("qwen2", "mimo", "glm4", "glm4-moe"),
            qk_layernorm=arch in ("qwen3", "qwen3-moe", "deepseek-v3") or (arch == "glm4-moe" and self.qk_norm),
            use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        )
        if self.experts:
            kw.update(num_moe_experts=self.experts, moe_ffn_hidden_size=self.moe_ffn, moe_router_topk=2,
                      moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")
        if self.shared_ffn:  # DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, a learned expert bias
            kw.update(moe_shared_expert_intermediate_size=self.shared_ffn, moe_router_enable_expert_bias=True,
                      moe_router_score_function="sigmoid")
        if self.first_dense:
            kw.update(moe_layer_freq=[0] * self.first_dense + [1] * (self.layers - self.first_dense))
        if self.mtp:
            kw.update(mtp_num_layers=self.mtp)
        if self.mla:
            kw.update(q_lora_rank=self.q_lora or None, kv_lora_rank=self.kv_lora, qk_head_dim=self.nope_dim,
                      qk_pos_emb_head_dim=self.rope_dim, v_head_dim=self.v_dim, rope_type="rope")
            kw.pop("kv_channels")
        kw.update(overrides)
        return (MLATransformerConfig if self.mla else TransformerConfig)(**kw)


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, vpp: int | None = None) -> None:
    """(Re)initialize megatron's parallel_state on the already-initialized default process group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, create_gloo_process_groups=False)


def build_model(tiny: TinyModel, *, divisible_by: int = 8, **config: Any) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline stage) under the current parallel_state.
    `config` overrides TransformerConfig fields (e.g. `use_cpu_initialization=False` to build on the GPU)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = tiny.transformer_config(**config)
    arch = canonical_arch(tiny.arch)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for v in range(vpp or 1):
        stage = v if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        spec: Any
        mtp_spec: Any = None
        if arch in ("deepseek-v3", "glm4", "glm4-moe", "mimo"):  # dense and MoE layers, MLA, MTP: the block spec
            spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm",
                                              vp_stage=stage)
            for layer in spec.layer_specs:
                _local_layer_spec(layer, arch)
            if cfg.mtp_num_layers and post:
                mtp_spec = get_gpt_mtp_block_spec(cfg, spec.layer_specs[-1], use_transformer_engine=False,
                                                  vp_stage=stage)
        else:
            spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                            qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
        # Tied embeddings over PP: megatron copies the embedding to the last stage with an all-reduce that
        # moves it to CUDA first. On CPU skip that; load_hf_weights fills both copies anyway.
        orig = LanguageModule._is_in_embd_group
        LanguageModule._is_in_embd_group = lambda self: False
        try:
            with _build_shims(cfg):
                chunks.append(GPTModel(cfg, spec, vocab_size=tiny.padded_vocab(cfg.tensor_model_parallel_size,
                                                                                divisible_by),
                                       max_sequence_length=256, pre_process=pre, post_process=post,
                                       share_embeddings_and_output_weights=tiny.tie, position_embedding_type="rope",
                                       vp_stage=stage, **({"mtp_block_spec": mtp_spec} if mtp_spec else {})))
        finally:
            LanguageModule._is_in_embd_group = orig
    return chunks


class _WeightlessCoreAttention(torch.nn.Module):
    """Stands in for the core attention of an MLA layer built without Transformer Engine: megatron-core's local
    `DotProductAttention` refuses MLA's `k_channels`, and the core attention holds no weights, so a model built
    for pushing its weights needs none (its forward is not run: megatron-core's asserts CUDA anyway)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


@functools.cache
def _glm4_layer(base: type) -> type:
    """`base` (megatron-core's TransformerLayer) with GLM-4's extra norms after attention and after the MLP, under
    the names mbridge's patched layer spec gives them. megatron-core has no such layer; its forward stays
    megatron's, so the weights are GLM-4's and the arithmetic is not (build it for pushing weights)."""
    def init(self: Any, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, config, submodules, *args, **kwargs)  # type: ignore[misc]  # base is a class
        from megatron.core.transformer.spec_utils import build_module

        for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
            setattr(self, name, build_module(submodules.input_layernorm, config=config,
                                             hidden_size=config.hidden_size, eps=config.layernorm_epsilon))

    return type("Glm4TransformerLayer", (base,), {"__init__": init})


def _local_layer_spec(layer: Any, arch: str) -> None:
    attention = layer.submodules.self_attention.submodules
    if arch == "deepseek-v3" and hasattr(attention, "core_attention"):
        attention.core_attention = _WeightlessCoreAttention
    if arch == "glm4":
        layer.module = _glm4_layer(layer.module)


@contextlib.contextmanager
def _build_shims(cfg: Any) -> Iterator[None]:
    """What megatron-core 0.16 needs to build MLA and expert-bias models with its local layer spec:
    `multi_latent_attention.HAVE_TE` is True whether or not Transformer Engine imports (so MLA would take TE's
    modules), and the MLA rotary embedding and the router's expert bias ask `torch.cuda.current_device()` for
    their device, also for a model built on the CPU (`use_cpu_initialization`)."""
    mla = bool(getattr(cfg, "multi_latent_attention", False))
    bias = bool(getattr(cfg, "moe_router_enable_expert_bias", False))
    if not (mla or bias):
        yield
        return
    import megatron.core.transformer.multi_latent_attention as mla_module

    have_te, current = mla_module.HAVE_TE, torch.cuda.current_device
    if mla:
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            mla_module.HAVE_TE = False
    if not torch.cuda.is_available() or getattr(cfg, "use_cpu_initialization", False):  # all of it on the CPU
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        mla_module.HAVE_TE, torch.cuda.current_device = have_te, current


# ------------------------------------------------------------------------------------------ from a checkpoint


def hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _tiny_from_config(cfg: dict[str, Any]) -> TinyModel:
    arch = {"qwen3": "qwen3", "qwen2": "qwen2", "mimo": "mimo", "llama": "llama", "mistral": "llama",
            "qwen3_moe": "qwen3-moe", "deepseek_v3": "deepseek-v3", "kimi_k2": "deepseek-v3", "glm4": "glm4",
            "glm4_moe": "glm4-moe"}.get(cfg["model_type"])
    if arch is None:
        raise ValueError(f"no megatron builder for model_type {cfg['model_type']!r}")
    moe: dict[str, Any] = {}
    if arch == "qwen3-moe":
        # the builder routes to 2 experts and makes every layer sparse, as the tiny MoE checkpoints are
        if cfg.get("num_experts_per_tok", 2) != 2 or cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step",
                                                                                          1) != 1:
            raise ValueError("megatron_from_hf builds Qwen3-MoE models with top-2 routing and every layer sparse; "
                             f"this config has num_experts_per_tok={cfg.get('num_experts_per_tok')}, "
                             f"mlp_only_layers={cfg.get('mlp_only_layers')}, "
                             f"decoder_sparse_step={cfg.get('decoder_sparse_step')}")
        # (newer transformers write Qwen3-MoE's expert count as num_local_experts)
        moe = dict(experts=cfg.get("num_experts") or cfg["num_local_experts"], moe_ffn=cfg["moe_intermediate_size"])
    if arch in ("deepseek-v3", "glm4-moe"):
        # n shared experts are one MLP n times as wide, in HF (`shared_experts.*`) and in megatron alike
        moe = dict(experts=cfg["n_routed_experts"], moe_ffn=cfg["moe_intermediate_size"],
                   shared_ffn=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                   first_dense=cfg.get("first_k_dense_replace") or 0, mtp=cfg.get("num_nextn_predict_layers") or 0)
    if arch == "deepseek-v3":
        moe.update(q_lora=cfg.get("q_lora_rank") or 0, kv_lora=cfg["kv_lora_rank"], rope_dim=cfg["qk_rope_head_dim"],
                   nope_dim=cfg["qk_nope_head_dim"], v_dim=cfg["v_head_dim"])
    if arch == "glm4-moe":
        moe.update(qk_norm=bool(cfg.get("use_qk_norm", False)))
    if arch == "mimo":
        moe = dict(mtp=cfg.get("num_nextn_predict_layers") or 0)
    heads = cfg["num_attention_heads"]
    return TinyModel(arch=arch, vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                     heads=heads, kv_heads=cfg.get("num_key_value_heads", heads),
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn=cfg["intermediate_size"],
                     tie=bool(cfg.get("tie_word_embeddings", False)), dtype="bfloat16", **moe)


def megatron_from_hf(model_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1) -> list[torch.nn.Module]:
    """A megatron-core trainer from a local HF checkpoint: a GPTModel shaped like `model_dir`'s config, this rank's
    shards holding its weights. The path a real trainer takes (build a GPTModel, import an HF checkpoint into its
    shards, push through MegatronSource).

    TP=PP=1 in a process without torch.distributed makes a world of one (gloo); `tp`/`pp` > 1 need the default
    group initialized on every rank of a world of tp x pp."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    if not dist.is_initialized():
        if tp * pp != 1:
            raise ValueError(f"megatron_from_hf(tp={tp}, pp={pp}) needs torch.distributed initialized on "
                             f"{tp * pp} ranks first")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port or rendezvous
    if dist.get_world_size() != tp * pp:
        raise ValueError(f"megatron_from_hf(tp={tp}, pp={pp}) needs a world of {tp * pp} ranks, this one has "
                         f"{dist.get_world_size()}")
    init_parallel(tp, pp)
    tiny = _tiny_from_config(hf_config(model_dir))
    model = build_model(tiny)
    load_hf_weights(model, load_file(str(Path(model_dir) / "model.safetensors")), arch=tiny.arch)
    return model
