"""Worker extension (`worker_extension_cls`): read back what a vLLM worker holds, for verification.

`streamsync_weight_digests()` hashes the weights the worker computes with, keyed by vLLM parameter name
(fused: `qkv_proj`, `gate_up_proj`). On CPU, vLLM moves Linear weights into packed oneDNN copies and
empties the parameter, so those are read back by probing the layer with an identity matrix: x = I gives
y = W^T exactly (each output element is one product 1*w, no rounding). The sender compares against its
own weights fused the same way (`expected_digests`).

Importing this module also registers the backend, a second route into worker processes besides the
entry point (extensions are imported before the worker is built).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..checksum import tensor_digest
from . import register

register()


def _probe_linear(mod: torch.nn.Module) -> torch.Tensor | None:
    n_in = getattr(mod, "input_size_per_partition", None) or getattr(mod, "input_size", None)
    dtype = getattr(mod, "params_dtype", None)
    if not n_in or dtype is None or not hasattr(mod, "quant_method"):
        return None
    eye = torch.eye(int(n_in), dtype=dtype)
    return mod.quant_method.apply(mod, eye, bias=None).t().contiguous()


def weight_digests(model: torch.nn.Module) -> dict[str, str]:
    out: dict[str, str] = {}
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{pname}" if mod_name else pname
                if p.numel() > 0:
                    rows = getattr(mod, "org_vocab_size", None)  # vLLM pads vocabularies: compare real rows
                    out[name] = tensor_digest(p[:rows] if rows and p.dim() and p.shape[0] > rows else p)
                elif pname == "weight":
                    w = _probe_linear(mod)
                    if w is not None:
                        out[name] = tensor_digest(w)
    return out


def expected_digests(hf: Mapping[str, torch.Tensor], packed: Mapping[str, list[str]]) -> dict[str, str]:
    """Digests of HF tensors fused the way vLLM stores them (e.g. q/k/v rows concatenated into qkv_proj)."""
    out: dict[str, str] = {}
    used: set[str] = set()
    for fused, parts in packed.items():
        for name in hf:
            if f".{parts[0]}." not in name:
                continue
            names = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            if all(n in hf for n in names):
                out[name.replace(f".{parts[0]}.", f".{fused}.")] = tensor_digest(torch.cat([hf[n] for n in names]))
                used.update(names)
    out.update((n, tensor_digest(t)) for n, t in hf.items() if n not in used)
    return out


class StreamSyncWorkerExtension:
    """Mixed into vLLM's worker class; methods run in each worker via collective_rpc."""

    def streamsync_weight_digests(self) -> dict[str, str]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return weight_digests(model)

    def streamsync_packed_modules(self) -> dict[str, list[str]]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()}

    def streamsync_received_digests(self) -> dict[str, str]:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "received_digests", {}) or {})

    def streamsync_round(self) -> dict[str, object]:
        """The backend's round: open, its owner (claimed by its first chunk) and seconds since it was last
        touched, so a client refused by vLLM's "already active" can tell an abandoned round from a live one."""
        rx = getattr(getattr(self, "weight_transfer_engine", None), "rx", None)
        if rx is None:
            return {"open": False}
        return {"open": bool(rx.updating), "owner": rx.owner, "idle_s": rx.idle_s}
