"""What a vLLM engine's parameters should hash to after a push: the pushed HF tensors fused the way vLLM stores
them, digested by the engine's own digest (`checksum.tensor_digest` or `checksum.device_digest`). Used on the
trainer side (an engine client's `holds`, tests, benchmarks) and compared with the worker's
`StreamSyncWorkerExtension.streamsync_weight_digests`; it imports nothing of vLLM."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import torch

from ...checksum import tensor_digest

_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def expected_digests(hf: Mapping[str, torch.Tensor], packed: Mapping[str, list[str]],
                     tied: bool = False, digest: Callable[[torch.Tensor], str] = tensor_digest,
                     engine_names: Iterable[str] = ()) -> dict[str, str]:
    """Digests of HF tensors fused the way vLLM stores them (e.g. q/k/v rows concatenated into qkv_proj, routed
    experts stacked into `w13_weight` / `w2_weight` as an unquantized FusedMoE holds them on the GPU), by the same
    `digest` as the engine's (`weight_digests`). `engine_names`: the engine's parameter names, where its stacked
    experts sit below the checkpoint's `experts` module (a runner's `routed_experts` child in some vLLM releases)."""
    out: dict[str, str] = {}
    used: set[str] = set()
    # routed experts, stacked as FusedMoE holds them unquantized: w13 = [gate; up] per expert, w2 = down
    experts: dict[str, dict[str, dict[int, str]]] = {}
    for name in hf:
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m["layer"], {}).setdefault(m["proj"], {})[int(m["e"])] = name
    names = sorted(engine_names)
    for layer, projs in experts.items():
        ids = sorted(projs.get("down_proj", {}))
        if not ids or any(sorted(projs.get(k, {})) != ids for k in ("gate_proj", "up_proj")):
            continue
        w13, w2 = (next((n for n in names if n.startswith(f"{layer}.") and n.endswith(f".{w}")), f"{layer}.{w}")
                   for w in ("w13_weight", "w2_weight"))
        out[w13] = digest(torch.stack(
            [torch.cat([hf[projs["gate_proj"][e]], hf[projs["up_proj"][e]]]) for e in ids]))
        out[w2] = digest(torch.stack([hf[projs["down_proj"][e]] for e in ids]))
        used.update(n for v in projs.values() for n in v.values())
    for fused, parts in packed.items():
        for name in hf:
            if f".{parts[0]}." not in name or name in used:
                continue
            names = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            if all(n in hf for n in names):
                out[name.replace(f".{parts[0]}.", f".{fused}.")] = digest(torch.cat([hf[n] for n in names]))
                used.update(names)
    out.update((n, digest(t)) for n, t in hf.items() if n not in used)
    if tied and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        # An HF export of a tied model may carry the embedding only; the engine's head computes with it.
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
