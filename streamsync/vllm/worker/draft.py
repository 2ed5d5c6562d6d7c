"""A worker's MTP draft model, as a push's round sees it (vLLM's MTP speculative decoding: `DeepSeekMTP`,
`Glm4MoeMTP`, `MiMoMTP`, ...). The round's MTP-layer tensors (`checkpoint.MtpLayers`) go into it through vLLM's
layerwise reload of its own modules, armed at its first tensor and finalized after the main model's (which owns
the embedding and output layer the draft computes with). docs/decisions/mtp-layers-into-the-draft-model.md says
why."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...plan.chunking import layer_index
from .. import compat
from .checkpoint import MtpLayers, engine_weights
from .fastpath import relayout_reloaded_experts
from .reload import hold_kv_b

Weights = list[tuple[str, torch.Tensor]]


def draft_model(runner: Any) -> torch.nn.Module | None:
    """The MTP draft model of a worker's model runner (vLLM's MTP speculative decoding: `DeepSeekMTP`,
    `Glm4MoeMTP`, `MiMoMTP`, ...), or None: no speculative decoding, or a draft of another kind (EAGLE, a separate draft
    model), whose weights are not the trainer's MTP layers."""
    get = getattr(runner, "get_draft_model", None)
    # vLLM 0.32: get_draft_model(); 0.25.x: the V1 runner's drafter, the V2 runner's speculator
    proposer = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    model = get() if callable(get) else getattr(proposer, "model", None)
    unwrap = getattr(model, "unwrap", None)  # a CUDA-graph wrapper (vLLM's own `get_draft_model` unwraps it)
    if not isinstance(model, torch.nn.Module) and callable(unwrap):
        model = unwrap()
    if not isinstance(model, torch.nn.Module) or not type(model).__name__.endswith("MTP"):
        return None
    return model


def own_modules(draft: torch.nn.Module, main: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest submodules of `draft` that hold no tensor of `main` (the modules an MTP draft model shares with
    its main model, its embedding and output layer, left out): what a round arms for reload in the draft."""
    shared = {id(t) for t in (*main.parameters(), *main.buffers())}
    out: list[torch.nn.Module] = []

    def walk(mod: torch.nn.Module) -> None:
        if not any(id(t) in shared for t in (*mod.parameters(), *mod.buffers())):
            out.append(mod)
            return
        for child in mod.children():
            walk(child)

    walk(draft)
    return out


class Draft:
    """The MTP draft model a worker's backend loads a round's MTP layers into (`attach`: the worker extension finds
    it), and what the round did to it."""

    def __init__(self, mtp: MtpLayers) -> None:
        self.mtp = mtp
        self.model: torch.nn.Module | None = None
        #: the MTP tensors' HF shapes, so blocked views of them are reshaped before the draft's loader; None where
        #: the checkpoint does not say (the worker then takes no blocked views)
        self.shapes: dict[str, tuple[int, ...]] | None = None
        self.armed = False  # layerwise reload armed for the draft's own modules this round
        self.tensors = 0  # tensors loaded into it this round
        self._experts: set[int] = set()  # layers whose experts this round reloaded

    def attach(self, draft: torch.nn.Module | None, model_config: Any, main: torch.nn.Module) -> None:
        if draft is self.model:
            return
        if self.armed:
            raise RuntimeError("streamsync: the MTP draft model changed during a weight update")
        held = engine_weights(model_config, main, draft) if draft is not None else None
        self.shapes = None if held is None else {n: tuple(s) for n, (_, s) in held.items() if n in self.mtp}
        self.model = draft

    def split(self, weights: Sequence[tuple[str, torch.Tensor]]) -> tuple[Weights, Weights]:
        """(the main model's tensors, the MTP layers' tensors the draft loads: its copies of the main model's
        embedding and output layer left out, and none without a draft: the sender reports them not loaded)."""
        if not self.mtp:
            return list(weights), []
        main = [(n, t) for n, t in weights if n not in self.mtp]
        if self.model is None:
            return main, []
        return main, [(n, t) for n, t in weights if n in self.mtp and n not in self.mtp.shared]

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name) if self.shapes is not None else None

    def begin_round(self) -> None:
        self.tensors = 0
        self._experts = set()

    def load(self, weights: Weights, main: torch.nn.Module, vllm_config: Any) -> None:
        """An MTP layer's tensors, into the draft through vLLM's layerwise reload (its own loader names them, and
        processes each module once complete: packed CPU linears, MLA's absorbed matrices). Only the draft's own
        modules are armed: it computes with the main model's embedding and output layer."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        draft = self.model
        if draft is None or not weights:
            return
        if not self.armed:
            with compat.vllm_config_set(vllm_config):
                armed = own_modules(draft, main)
                hold_kv_b(draft, armed)
                for mod in armed:
                    initialize_layerwise_reload(mod)
            self.armed = True
        self._experts.update(i for n, _ in weights if ".experts." in n and (i := layer_index(n)) is not None)
        self.tensors += len(weights)
        with compat.mtp_check_disabled():
            draft.load_weights(weights)  # type: ignore[operator]  # nn.Module attribute

    def finish(self, model_config: Any) -> None:
        """Finalize the round's reload of the draft (after the main model's, which owns what they share)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.armed and self.model is not None:
            finalize_layerwise_reload(self.model, model_config)
            relayout_reloaded_experts(self.model, self._experts)
        self.armed = False
