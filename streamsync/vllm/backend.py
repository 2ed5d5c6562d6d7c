"""The `streamsync` vLLM WeightTransferEngine: receives packed chunks over streamsync's transports.

Each round: `start_weight_update` arms vLLM's layerwise reload (needed on CPU, where Linear weights are
repacked into oneDNN copies and the parameters emptied; a plain load_weights would not reach the kernels);
`update_weights` maps one chunk (shared memory, CUDA IPC or a collective broadcast, chosen by init_info),
feeds zero-copy views to `model.load_weights`, and closes the chunk before returning, so the return is the
sender's acknowledgement; `finish_weight_update` finalizes the reload (kernels rebuilt from new weights).

Where vLLM keeps no weight version (0.25.x, `compat.native_weight_version()`), the backend keeps it: every
chunk carries its push's version, and the finish of a round that ended whole commits it (`weight_version`);
the sender marks a failed round with `set_weight_version("mixed:N")` before it ends the round, so that
finish commits nothing. The worker extension reads and sets it.

init_info and update_info are plain dicts wrapped as {"streamsync": {...}} so they cross vLLM's HTTP and
msgpack layers unchanged; streamsync validates them itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..checksum import tensor_digest
from ..plan.chunking import layer_index
from ..receiver.state import WeightReceiver
from . import compat


@dataclass
class StreamSyncInitInfo(WeightTransferInitInfo):
    streamsync: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.streamsync.get("transport"), str):
            raise ValueError(f"streamsync init_info needs a 'transport' name, got {self.streamsync!r:.200}")


@dataclass
class StreamSyncUpdateInfo(WeightTransferUpdateInfo):
    streamsync: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.streamsync.get("layout"), dict) or "handle" not in self.streamsync:
            raise ValueError("streamsync update_info needs 'layout' and 'handle'")


class StreamSyncWeightTransferEngine(WeightTransferEngine[StreamSyncInitInfo, StreamSyncUpdateInfo]):
    init_info_cls = StreamSyncInitInfo
    update_info_cls = StreamSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        compat.check_supported()  # the worker dies at load with the version found and the range
        super().__init__(config, vllm_config, device, model)
        install_reload_warning_filter(model)
        self.rx = WeightReceiver(device)
        self.record_digests = False
        self.received_digests: dict[str, str] = {}
        self._reloading = False
        #: the worker keeps the weight version (vLLM keeps none, or WORKER_VERSIONS_ENV asks for it)
        self.keeps_version = not compat.native_weight_version()
        self.weight_version = "default"  # vLLM's own initial version string
        self._round_version: str | None = None  # the version the open round's chunks carry

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """vLLM 0.25.x declares this trainer-side entry point on every backend class (a class without it cannot
        be built). streamsync's sending side is a `WeightSync`, which plans, packs and streams the chunks."""
        raise NotImplementedError(
            "the streamsync backend is pushed to through streamsync.WeightSync (sync = WeightSync(engines=["
            "VllmEngine(llm)]); await sync.push(model)), not through WeightTransferEngine.trainer_send_weights")

    def set_weight_version(self, version: str) -> None:
        """Set the worker's version now (a failed round's "mixed:N" mark, or a client's explicit version); the
        open round, if any, then commits nothing at its finish."""
        self.weight_version = str(version)
        self._round_version = None

    def init_transfer_engine(self, init_info: StreamSyncInitInfo) -> None:
        info = dict(init_info.streamsync)
        self.record_digests = bool(info.pop("record_digests", False))
        info.pop("owner", None)  # vLLM guards its rounds itself; updates carry the owner (see start)
        self.rx.init(info)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._reloading:  # a previous round failed half-way; its buffered layers are dropped
            self._finalize()
        if self.rx.updating:  # vLLM ended that round (an update raised): it is over here too
            self.rx.abort()
        # vLLM refuses a start while a round is active, so a second WeightSync cannot open one; the round's
        # first update claims it for its sender's owner id and updates of another owner are refused.
        self.rx.start()
        self.received_digests = {}
        self._round_version = None
        with compat.vllm_config_set(self.vllm_config):
            initialize_layerwise_reload(self.model)
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator unconditionally, which raises on a CPU-only host.
        info = self.parse_update_info(update_info)
        if info.streamsync.get("version") is not None:
            self._round_version = str(info.streamsync["version"])
        with compat.vllm_config_set(self.vllm_config):
            self.receive_weights(info)
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: StreamSyncUpdateInfo) -> None:
        hold = set(update_info.streamsync.get("hold") or ())

        def keep(name: str) -> bool:
            # Layerwise reload buffers a layer's tensors until the layer is complete, and defers some layers
            # to finalize (embeddings and lm_head whose vocabulary vLLM pads); the chunk buffer is reused
            # before that. Copy out the tensors of layers split across chunks (`hold`) and the tensors
            # outside decoder layers (embeddings, final norm, lm_head: a small share of the bytes).
            return name in hold or layer_index(name) is None

        def load(weights: Any) -> None:
            weights = ((n, t.clone() if keep(n) else t) for n, t in weights)
            if self.record_digests:
                weights = list(weights)
                self.received_digests.update((n, tensor_digest(t)) for n, t in weights)
            with compat.mtp_check_disabled():
                self.model.load_weights(weights)  # type: ignore[operator]  # nn.Module attribute

        self.rx.update(update_info.streamsync, load)

    def finish_weight_update(self) -> None:
        self._finalize()
        self.rx.finish(None)
        if self.keeps_version and self._round_version is not None and not self.rx.dirty:
            self.weight_version = self._round_version  # the round ended whole (a cut-short one stays dirty)
        self._round_version = None

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._reloading = False
        with compat.vllm_config_set(self.vllm_config):
            finalize_layerwise_reload(self.model, self.model_config)
            refresh_shared_kernels(self.model)

    def shutdown(self) -> None:
        self.rx.close()


def refresh_shared_kernels(model: torch.nn.Module) -> list[str]:
    """Rebuild what a module derives from a Parameter it shares with another module (a tied lm_head).

    Layerwise reload processes a module only when weights arrive for it. A tied lm_head gets none: its
    Parameter is the embedding's, whose data the embedding's reload overwrote, and reload puts that same
    Parameter back, but the head's own weight processing is never re-run. On CPU that processing packs the
    weight into a oneDNN copy that the output matmul uses, so the engine kept generating with the old head.
    Unquantized embedding/head processing is a pure function of the weight (re-running it is safe); a
    quantized tied head would need its scales reloaded and is refused loudly instead of served stale.
    Returns the names of the modules refreshed.
    """
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, mod))
    refreshed: list[str] = []
    for mods in owners.values():
        if len(mods) < 2:
            continue
        for mod_name, mod in mods:
            method = getattr(mod, "quant_method", None)
            if method is None or mod_name in refreshed:
                continue
            kind = type(method).__name__
            if kind == "UnquantizedLinearMethod":  # its CPU processing empties the weight: not re-runnable
                continue
            if not kind.startswith("Unquantized"):
                raise RuntimeError(f"module {mod_name!r} shares its weight with another module and is quantized "
                                   f"({kind}): streamsync cannot rebuild its kernel after a push")
            method.process_weights_after_loading(mod)
            refreshed.append(mod_name)
    return refreshed


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
