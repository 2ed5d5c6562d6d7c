"""Megatron-core models from and to HF weights: `load_hf_weights`, `export_hf`, `TinyModel`, `build_model`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..convert import Dims, canonical_arch, detect_arch, get_converter, tp_split
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
    conv = get_converter(canonical_arch(arch) if arch else detect_arch(cfg), tied=tied)
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


async def export_hf_async(model: object, *, chunk_bytes: int = 256 << 20,
                          **options: Any) -> dict[str, torch.Tensor] | None:
    """The full HF state dict of a (sharded) megatron model, through the same gathers and conversions as a push.

    Collective: every rank of the default group calls it. Returns the tensors (copies, on the model's device)
    on the sender, global rank 0, and None elsewhere. `options` go to MegatronSource (arch, dtype,
    hf_config, vocab_size, ...).
    """
    from ..sources.megatron import MegatronSource

    source = MegatronSource(model, **options)
    out: dict[str, torch.Tensor] = {}
    for plan in source.plan(chunk_bytes):
        gathered = await source.gather(plan)
        if source.is_sender:
            tensors = await source.convert(plan, gathered)
            out.update((s.name, t.reshape(s.shape).clone()) for s, t in zip(plan.specs, tensors, strict=True))
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

    def hf_specs(self) -> list[Spec]:
        """HF checkpoint names, dtypes and shapes (per-expert MoE tensors, as vLLM loads them)."""
        arch = canonical_arch(self.arch)
        d, h, hd = self.dtype, self.hidden, self.head_dim
        s: list[Spec] = [("model.embed_tokens.weight", d, (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            s += [(p + "input_layernorm.weight", d, (h,)),
                  (p + "self_attn.q_proj.weight", d, (self.heads * hd, h)),
                  (p + "self_attn.k_proj.weight", d, (self.kv_heads * hd, h)),
                  (p + "self_attn.v_proj.weight", d, (self.kv_heads * hd, h))]
            if arch == "qwen2":
                s += [(p + "self_attn.q_proj.bias", d, (self.heads * hd,)),
                      (p + "self_attn.k_proj.bias", d, (self.kv_heads * hd,)),
                      (p + "self_attn.v_proj.bias", d, (self.kv_heads * hd,))]
            if arch in ("qwen3", "qwen3-moe"):
                s += [(p + "self_attn.q_norm.weight", d, (hd,)), (p + "self_attn.k_norm.weight", d, (hd,))]
            s += [(p + "self_attn.o_proj.weight", d, (h, self.heads * hd)),
                  (p + "post_attention_layernorm.weight", d, (h,))]
            if arch == "qwen3-moe":
                s.append((p + "mlp.gate.weight", d, (self.experts, h)))
                for e in range(self.experts):
                    q = f"{p}mlp.experts.{e}."
                    s += [(q + "gate_proj.weight", d, (self.moe_ffn, h)), (q + "up_proj.weight", d, (self.moe_ffn, h)),
                          (q + "down_proj.weight", d, (h, self.moe_ffn))]
            else:
                s += [(p + "mlp.gate_proj.weight", d, (self.ffn, h)), (p + "mlp.up_proj.weight", d, (self.ffn, h)),
                      (p + "mlp.down_proj.weight", d, (h, self.ffn))]
        s.append(("model.norm.weight", d, (h,)))
        if not self.tie:
            s.append(("lm_head.weight", d, (self.vocab, h)))
        return s

    def hf_state(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random HF weights, the same in every process for the same seed."""
        return dict(StateModule(self.hf_specs(), fill="random", seed=seed).state_dict())

    def hf_config(self) -> dict[str, Any]:
        """The HF config fields MegatronSource reads (`hf_config=` accepts a dict or a transformers config)."""
        model_type = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3-moe": "qwen3_moe"}
        return {"model_type": model_type[canonical_arch(self.arch)], "vocab_size": self.vocab,
                "tie_word_embeddings": self.tie, "dtype": self.dtype}

    def padded_vocab(self, tp: int, divisible_by: int = 8) -> int:
        """Megatron's vocabulary: rounded up to a multiple of divisible_by x TP (as Megatron-LM pads it)."""
        m = divisible_by * tp
        return (self.vocab + m - 1) // m * m

    def transformer_config(self, **overrides: Any) -> Any:
        """The megatron-core TransformerConfig, with the parallel sizes of the current parallel_state."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_config import TransformerConfig

        arch = canonical_arch(self.arch)
        dtype = getattr(torch, self.dtype)
        kw: dict[str, Any] = dict(
            num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
            num_query_groups=self.kv_heads, kv_channels=self.head_dim, ffn_hidden_size=self.ffn,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, add_qkv_bias=arch == "qwen2", qk_layernorm=arch in ("qwen3", "qwen3-moe"),
            use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        )
        if arch == "qwen3-moe":
            kw.update(num_moe_experts=self.experts, moe_ffn_hidden_size=self.moe_ffn, moe_router_topk=2,
                      moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")
        kw.update(overrides)
        return TransformerConfig(**kw)


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
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = tiny.transformer_config(**config)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for v in range(vpp or 1):
        stage = v if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        # Tied embeddings over PP: megatron copies the embedding to the last stage with an all-reduce that
        # moves it to CUDA first. On CPU skip that; load_hf_weights fills both copies anyway.
        orig = LanguageModule._is_in_embd_group
        LanguageModule._is_in_embd_group = lambda self: False
        try:
            chunks.append(GPTModel(cfg, spec, vocab_size=tiny.padded_vocab(cfg.tensor_model_parallel_size,
                                                                            divisible_by),
                                   max_sequence_length=256, pre_process=pre, post_process=post,
                                   share_embeddings_and_output_weights=tiny.tie, position_embedding_type="rope",
                                   vp_stage=stage))
        finally:
            LanguageModule._is_in_embd_group = orig
    return chunks


# ------------------------------------------------------------------------------------------ from a checkpoint


def hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _tiny_from_config(cfg: dict[str, Any]) -> TinyModel:
    arch = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "mistral": "llama",
            "qwen3_moe": "qwen3-moe"}.get(cfg["model_type"])
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
    load_hf_weights(model, load_file(str(Path(model_dir) / "model.safetensors")))
    return model
