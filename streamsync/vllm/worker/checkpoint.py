"""What a worker's model was loaded from, read without loading it: the checkpoint's tensor names, dtypes and shapes
(the safetensors headers), and the layers vLLM's main model does not load (MTP), which go to the engine's MTP draft
model where it runs MTP speculative decoding. The worker's backend checks a push against these, and its extension
answers them to the sender."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...plan.chunking import layer_index

_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def checkpoint_weights(model_dir: str | Path, dtype: torch.dtype, tied: bool = False,
                       kept: Mapping[str, torch.dtype] | None = None) -> dict[str, tuple[str, list[int]]] | None:
    """HF name -> (dtype name, shape) of every tensor in the checkpoint the engine loaded, read from the
    safetensors headers (no tensor data): exactly the names and shapes its loader accepts. Floating tensors
    are expected in the engine's dtype (`dtype`), as a push must send them, except float32 ones the engine also
    holds in float32 under the checkpoint's own name (`kept`: a router's `e_score_correction_bias`, which
    checkpoints and vLLM keep in float32 whatever the model's dtype): those in float32. A tied head is not
    expected (it is the embedding). None when the checkpoint is not a local folder of safetensors (nothing to
    check)."""
    from safetensors import safe_open

    from ...pack import dtype_name

    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    out: dict[str, tuple[str, list[int]]] = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = sf.get_slice(name)
                dt = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dt is None:
                    return None  # a dtype streamsync does not carry: do not guess
                if dt in ("bfloat16", "float16", "float32", "float64"):  # the loader casts these to the engine's
                    dt = dtype_name((kept or {}).get(name, dtype) if dt == "float32" else dtype)
                out[name] = (dt, list(sl.get_shape()))
    if tied:
        out.pop("lm_head.weight", None)
    return out


def engine_weights(model_config: Any, model: torch.nn.Module, draft: torch.nn.Module | None = None
                   ) -> dict[str, tuple[str, list[int]]] | None:
    """`checkpoint_weights` of the checkpoint a worker's model was loaded from, with the float32 tensors that model
    keeps under their checkpoint names. The MTP layers' tensors are left out, unless the worker runs an MTP draft
    model (`draft`): then those it loads are in, less the copies of the main model's tensors it shares
    (`MtpLayers.shared`)."""
    mc = model_config
    tied = bool(getattr(mc.hf_config, "tie_word_embeddings", False))
    kept = {n: p.dtype for n, p in model.named_parameters() if p.dtype == torch.float32 != mc.dtype}
    if draft is not None:
        kept.update((checkpoint_name(n), p.dtype) for n, p in draft.named_parameters()
                    if p.dtype == torch.float32 != mc.dtype)
    found = checkpoint_weights(mc.model, mc.dtype, tied, kept)
    if found is None:
        return None
    mtp = mtp_layers(mc.hf_config)
    if draft is None:
        return {n: v for n, v in found.items() if n not in mtp}
    return {n: v for n, v in found.items() if n not in mtp.shared}


@dataclass(frozen=True, slots=True)
class MtpLayers:
    """The checkpoint's MTP layers, which vLLM's main model skips as it loads: they belong to its MTP draft model.
    DeepSeek-V3 and GLM-4.5 number them after the decoder layers (`model.layers.{num_hidden_layers + i}.`, the
    `layers`); MiMo holds them apart (`model.mtp_layers.{i}.`: `prefix`). `name in mtp` says whether a checkpoint
    tensor is an MTP layer's."""

    layers: range = range(0)
    prefix: str = ""

    def __bool__(self) -> bool:
        return len(self.layers) > 0

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or not self:
            return False
        return name.startswith(self.prefix) if self.prefix else layer_index(name) in self.layers

    @property
    def shared(self) -> frozenset[str]:
        """The MTP layers' checkpoint tensors that vLLM's MTP draft models do not hold themselves: DeepSeek-V3's
        copies of the embedding and the output layer, for which the draft computes with the main model's (vLLM's
        proposer shares them whatever the checkpoint holds). MiMo's layers hold no such copies."""
        if self.prefix:
            return frozenset()
        return frozenset(f"model.layers.{i}.{t}" for i in self.layers
                         for t in ("embed_tokens.weight", "shared_head.head.weight"))


#: HF architectures whose checkpoints hold their MTP layers apart, under this prefix
_APART = {"MiMoForCausalLM": "model.mtp_layers."}


def mtp_layers(hf_config: Any) -> MtpLayers:
    """The checkpoint's MTP layers (`MtpLayers`), from its config's `num_nextn_predict_layers`."""
    n = getattr(hf_config, "num_hidden_layers", None) or 0
    extra = getattr(hf_config, "num_nextn_predict_layers", None) or 0
    archs = getattr(hf_config, "architectures", None) or ()
    return MtpLayers(range(n, n + extra) if n else range(0), _APART.get(archs[0], "") if archs else "")


#: why a push does not load an MTP layer's tensors
MTP_DECLINED = ("an MTP layer: vLLM's main model skips it, and the engine runs no MTP speculative decoding (no draft "
                "model to load it into)")
#: why a push does not load an MTP layer's copies of the embedding and output layer
MTP_SHARED = ("an MTP layer's copy of the embedding or output layer: the engine's MTP draft model computes with the "
              "main model's (vLLM shares them), which the push's main-model tensors update")


def checkpoint_name(draft_name: str) -> str:
    """A draft model's parameter name as the checkpoint names it: vLLM's MTP models hold an MTP layer's decoder
    layer as `mtp_block` (`model.layers.61.mtp_block.mlp.gate.e_score_correction_bias` is the checkpoint's
    `model.layers.61.mlp.gate.e_score_correction_bias`)."""
    return draft_name.replace(".mtp_block.", ".", 1)
