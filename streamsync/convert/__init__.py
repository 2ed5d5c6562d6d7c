"""Megatron-core <-> HF conversion: one registry of declarative per-architecture tables.

    conv = get_converter("qwen3")                       # or detect_arch(megatron_config)
    r = conv.resolve("decoder.layers.3.self_attention.linear_qkv.weight")
    r.hf                                                # ('model.layers.3.self_attn.q_proj.weight', ...)
    q, k, v = r.mapping.to_hf(full_qkv, dims)
    full_qkv = conv.to_megatron(r.megatron, hf_state, dims)

Names on the Megatron side are global (layer and expert indices of the whole model); tensors are full
(tensor-parallel shards merged: see `mappings.tp_merge`). Process groups are the source's business.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass

import torch

from ..errors import ValidationError
from . import archs as models
from .archs import TRAINED_BUFFERS
from .mappings import Dims, Mapping, Vocab, tp_merge, tp_split

ARCHS = ("llama", "qwen2", "mimo", "qwen3", "qwen3-moe", "deepseek-v3", "glm4", "glm4-moe")
_ALIASES = {
    "llama": "llama", "mistral": "llama",
    "qwen2": "qwen2",
    "mimo": "mimo",
    "qwen3": "qwen3",
    "qwen3-moe": "qwen3-moe", "qwen3_moe": "qwen3-moe",
    # DeepSeek-V2 lacks the expert bias and MTP, a subset of V3's table; Kimi-K2 and Moonlight are V3 models
    "deepseek-v3": "deepseek-v3", "deepseek_v3": "deepseek-v3", "deepseek-v2": "deepseek-v3",
    "deepseek_v2": "deepseek-v3", "kimi_k2": "deepseek-v3", "kimi-k2": "deepseek-v3", "moonlight": "deepseek-v3",
    "glm4": "glm4",
    "glm4-moe": "glm4-moe", "glm4_moe": "glm4-moe",
}
#: HF `architectures` each family serves as (what an engine's model class must be)
HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "MistralForCausalLM"), "qwen2": ("Qwen2ForCausalLM",),
    "mimo": ("MiMoForCausalLM", "Qwen2ForCausalLM"),  # MiMo's main model is Qwen2's: either trainer pushes it
    "qwen3": ("Qwen3ForCausalLM",), "qwen3-moe": ("Qwen3MoeForCausalLM",),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "KimiK2ForCausalLM"),
    "glm4": ("Glm4ForCausalLM",), "glm4-moe": ("Glm4MoeForCausalLM",),
}
_MOE = ("qwen3-moe", "deepseek-v3", "glm4-moe")


def same_family(a: Iterable[str], b: Iterable[str]) -> bool:
    """Whether two lists of HF model classes share a family (`HF_ARCHITECTURES`: a Mistral trainer serves a
    Llama engine); classes of no known family match only themselves."""
    def family(names: Iterable[str]) -> set[str]:
        out = set()
        for n in names:
            out |= {c for classes in HF_ARCHITECTURES.values() if n in classes for c in classes} or {n}
        return out

    return bool(family(a) & family(b))
_MTP = ("deepseek-v3", "glm4-moe", "mimo")


def canonical_arch(name: str) -> str:
    """'Qwen3_MoE', 'qwen3-moe', 'mistral', ... -> a key of the registry; ValidationError if unknown."""
    key = name.strip().lower()
    if key not in _ALIASES:
        raise ValidationError(f"unknown architecture {name!r}: known are {sorted(_ALIASES)}")
    return _ALIASES[key]


def detect_arch(config: object = None, hf_config: object = None, names: Iterable[str] = ()) -> str:
    """The architecture of a model, from its HF config's `model_type` where given, else from the megatron
    TransformerConfig: multi-latent attention -> deepseek-v3, MoE experts with shared experts and qkv bias ->
    glm4-moe, other MoE -> qwen3-moe, q/k layernorm -> qwen3, qkv bias with MTP layers -> mimo, qkv bias -> qwen2,
    else llama. GLM-4 dense looks like qwen2 to megatron's config; its layers' sandwich norms among the parameter
    `names` tell it apart."""
    model_type = getattr(hf_config, "model_type", None) or (
        hf_config.get("model_type") if isinstance(hf_config, dict) else None)
    if model_type:
        return canonical_arch(str(model_type))
    if config is None:
        raise ValidationError("cannot detect the architecture: pass arch= or hf_config=")
    if getattr(config, "multi_latent_attention", False):
        return "deepseek-v3"
    if any(".post_self_attn_layernorm." in n for n in names):
        return "glm4"
    if getattr(config, "num_moe_experts", None) and getattr(config, "moe_shared_expert_intermediate_size", None) \
            and getattr(config, "add_qkv_bias", False):
        return "glm4-moe"
    if getattr(config, "num_moe_experts", None):
        return "qwen3-moe"
    if getattr(config, "qk_layernorm", False):
        return "qwen3"
    if getattr(config, "add_qkv_bias", False):
        return "mimo" if getattr(config, "mtp_num_layers", None) else "qwen2"
    return "llama"


def check_config(arch: str, config: object) -> None:
    """Refuse, naming the option, a megatron-core TransformerConfig whose weights mean something the table of
    `arch` does not map (the push would otherwise send tensors an engine computes differently with, or fail
    later on a missing tensor)."""
    def has(field: str) -> object:
        return getattr(config, field, None)

    problems = []
    if has("add_bias_linear"):
        problems.append("add_bias_linear=True (biases on every linear layer: no HF family here has them)")
    if has("moe_shared_expert_gate"):
        problems.append("moe_shared_expert_gate=True (a gated shared expert, Qwen2-MoE's: not mapped)")
    mla = bool(has("multi_latent_attention"))
    if mla != (arch == "deepseek-v3"):
        problems.append(f"multi_latent_attention={mla} (the {arch} table maps "
                        f"{'MLA' if arch == 'deepseek-v3' else 'grouped-query'} attention)")
    if mla and has("q_lora_rank") and not has("qk_layernorm"):
        problems.append("qk_layernorm=False with a query low rank (the checkpoint holds q_a_layernorm and "
                        "kv_a_layernorm, which megatron builds only with qk_layernorm=True)")
    if has("num_moe_experts") and arch not in _MOE:
        problems.append(f"num_moe_experts={has('num_moe_experts')} (the {arch} table is dense; MoE tables: {_MOE})")
    if has("moe_router_enable_expert_bias") and arch == "qwen3-moe":
        problems.append("moe_router_enable_expert_bias=True (Qwen3-MoE checkpoints hold no expert bias)")
    if has("moe_shared_expert_intermediate_size") and arch == "qwen3-moe":
        problems.append("moe_shared_expert_intermediate_size set (Qwen3-MoE has no shared experts)")
    if has("mtp_num_layers") and arch not in _MTP:
        problems.append(f"mtp_num_layers={has('mtp_num_layers')} (MTP layers are mapped for {_MTP})")
    if problems:
        raise ValidationError(f"megatron config does not match the {arch} table: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class Resolved:
    """A Megatron parameter matched against a table: its mapping and concrete names."""

    mapping: Mapping
    megatron: str
    hf: tuple[str, ...]
    layer: int | None
    expert: int | None


def _compile(pattern: str) -> re.Pattern[str]:
    rx = re.escape(pattern)
    for key in "LEM":
        rx = rx.replace(rf"\{{{key}\}}", rf"(?P<{key}>\d+)")
    return re.compile(rx + r"\Z")


class Converter:
    """The table of one architecture, compiled. Stateless: safe to share. `num_layers`: the model's decoder
    layers, which number MTP layers where a checkpoint counts them apart (`{M}` = L - num_layers: MiMo's)."""

    def __init__(self, arch: str, mappings: Iterable[Mapping], num_layers: int | None = None) -> None:
        self.arch = arch
        self.mappings = list(mappings)
        self.num_layers = num_layers
        self._fwd = [(_compile(m.megatron), m) for m in self.mappings]
        self._rev = [(_compile(h), m) for m in self.mappings for h in m.hf]

    def _names(self, m: Mapping, groups: dict[str, str]) -> tuple[str, tuple[str, ...], int | None, int | None]:
        layer = int(groups["L"]) if "L" in groups else None
        expert = int(groups["E"]) if "E" in groups else None
        mtp = None
        if "{M}" in m.megatron + "".join(m.hf):  # an MTP layer numbered apart: {M} = L - num_layers (MiMo's)
            if self.num_layers is None:
                raise ValidationError(f"{self.arch}: {m.megatron!r} numbers its MTP layers after the decoder "
                                      "layers: get_converter(..., num_layers=) needs the model's num_layers")
            layer = layer if layer is not None else int(groups["M"]) + self.num_layers
            mtp = layer - self.num_layers
            if mtp < 0:
                raise ValidationError(f"{self.arch}: MTP layer {layer} is not after the model's "
                                      f"{self.num_layers} decoder layers")
        fmt = {"L": layer, "E": expert, "M": mtp}
        return m.megatron.format(**fmt), tuple(h.format(**fmt) for h in m.hf), layer, expert

    def find(self, megatron_name: str) -> Resolved | None:
        for rx, m in self._fwd:
            hit = rx.match(megatron_name)
            if hit:
                meg, hf, layer, expert = self._names(m, hit.groupdict())
                return Resolved(m, meg, hf, layer, expert)
        return None

    def resolve(self, megatron_name: str) -> Resolved:
        r = self.find(megatron_name)
        if r is None:
            raise ValidationError(f"{self.arch}: no mapping for Megatron parameter {megatron_name!r}")
        return r

    def find_hf(self, hf_name: str) -> Resolved | None:
        """The first mapping (table order) that produces `hf_name`: HF -> Megatron without a model."""
        for rx, m in self._rev:
            hit = rx.match(hf_name)
            if hit:
                meg, hf, layer, expert = self._names(m, hit.groupdict())
                return Resolved(m, meg, hf, layer, expert)
        return None

    # -- whole tensors -------------------------------------------------------------------------------------

    def to_hf(self, megatron_name: str, full: torch.Tensor, dims: Dims) -> list[tuple[str, torch.Tensor]]:
        r = self.resolve(megatron_name)
        return list(zip(r.hf, r.mapping.to_hf(full, dims), strict=True))

    def to_megatron(self, megatron_name: str, hf_state: MappingABC[str, torch.Tensor], dims: Dims,
                    shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The full Megatron tensor `megatron_name` (global name) made from the HF tensors it maps from."""
        r = self.resolve(megatron_name)
        missing = [h for h in r.hf if h not in hf_state]
        if missing:
            raise ValidationError(f"{megatron_name!r} needs HF tensor(s) {missing}, absent from the HF state")
        return r.mapping.to_megatron([hf_state[h] for h in r.hf], dims, shape)

    def to_hf_state(self, megatron_state: MappingABC[str, torch.Tensor], dims: Dims) -> dict[str, torch.Tensor]:
        """Full Megatron state (global names) -> HF state. Reverse-only entries (tied output layer) are dropped."""
        out: dict[str, torch.Tensor] = {}
        for name, t in megatron_state.items():
            r = self.resolve(name)
            if r.mapping.send:
                out.update(zip(r.hf, r.mapping.to_hf(t, dims), strict=True))
        return out

    def to_megatron_state(self, hf_state: MappingABC[str, torch.Tensor], dims: Dims, *,
                          padded_vocab: int | None = None) -> dict[str, torch.Tensor]:
        """HF state -> full Megatron state (global names, local-spec naming), vocab padded to `padded_vocab`."""
        out: dict[str, torch.Tensor] = {}
        for h in hf_state:
            r = self.find_hf(h)
            if r is None:
                raise ValidationError(f"{self.arch}: no mapping produces HF tensor {h!r}")
            if r.megatron in out:
                continue
            shape = None
            if padded_vocab is not None and isinstance(r.mapping, Vocab):
                shape = (padded_vocab, *hf_state[h].shape[1:])
            out[r.megatron] = self.to_megatron(r.megatron, hf_state, dims, shape)
        return out


def get_converter(arch: str, *, tied: bool = False, num_layers: int | None = None) -> Converter:
    """The converter of `arch` (a name of `ARCHS` or an alias: 'mistral', 'qwen3_moe', 'kimi_k2', 'glm4_moe',
    ...); `tied`: the model shares its embedding with the output layer (HF `tie_word_embeddings`); `num_layers`:
    the model's decoder layers (MiMo's MTP layers are numbered after them)."""
    key = canonical_arch(arch)
    return Converter(key, models.table(key, tied=tied), num_layers)


__all__ = ["ARCHS", "HF_ARCHITECTURES", "TRAINED_BUFFERS", "Converter", "Dims", "Resolved", "canonical_arch",
           "check_config", "detect_arch", "get_converter", "same_family", "tp_merge", "tp_split"]
