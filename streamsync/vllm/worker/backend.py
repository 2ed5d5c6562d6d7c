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

from ...checksum import tensor_digest
from ...plan.chunking import layer_index
from ...receiver import kernels
from ...receiver.loaders import FunctionLoader
from ...receiver.state import WeightReceiver
from ...transports.refs import ReferenceViews
from .. import compat
from .checkpoint import engine_weights, mtp_layers
from .draft import Draft
from .fastpath import CapturedLoads, FastPath, FastRound, chunk_parts, learn_ahead, relayout_reloaded_experts
from .reload import RELOAD_LOGGER as RELOAD_LOGGER  # also named here, beside the backend that installs it
from .reload import ExpectedReloadMisses as ExpectedReloadMisses
from .reload import (
    hold_kv_b,
    install_reload_warning_filter,
    refresh,
    refresh_shared_kernels,
    released_kv_b,
    shared_kernel_modules,
)
from .stats import RoundLog


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
        #: the checkpoint's MTP layers (`checkpoint.mtp_layers`): not loaded, unless the worker runs an MTP draft
        #: model (`attach_draft`), into which they then go
        self.draft = Draft(mtp_layers(self.model_config.hf_config))
        self._expert_layers: set[int] = set()  # layers whose experts the round reloaded layerwise
        self.record_digests = False
        self.received_digests: dict[str, str] = {}
        self.fast_path = True  # received tensors straight into the engine's (`fastpath`), else layerwise reload
        self.fast = FastPath(model)
        self.graphs = CapturedLoads()  # chunks of COPY modules only, replayed as CUDA graphs
        self._replayed0 = 0
        self.log = RoundLog(torch.device(device))
        self.last_round: dict[str, Any] | None = None
        self._round: FastRound | None = None
        self._armed = False  # layerwise reload armed for (some of) the model this round
        self._reloading = False
        self._traced, self._traced_ahead = False, False  # ahead: `prime` traced the plan again since the last round
        self._shared: tuple[object, list[tuple[str, torch.nn.Module]]] | None = None
        # path (and the fast tensors graphs replayed) -> [tensors, bytes]
        self._counts: dict[str, list[int]] = {k: [0, 0] for k in ("fast", "layerwise", "replayed", "in_place")}
        #: the worker keeps the weight version (vLLM keeps none, or WORKER_VERSIONS_ENV asks for it)
        self.keeps_version = not compat.native_weight_version()
        self.weight_version = "default"  # vLLM's own initial version string
        self._round_version: str | None = None  # the version the open round's chunks carry
        self._initialized = False  # init_weight_transfer_engine was called

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """vLLM 0.25.x's trainer-side entry point on the backend class: push `iterator`'s (name, tensor) pairs
        through streamsync (`streamsync.vllm.trainer.native.send_weights`: `trainer_args` is a BlockingWeightSync, or
        {"sync": one} or {"engines": [...]})."""
        from ..trainer.native import send_weights

        send_weights(iterator, trainer_args)

    def set_weight_version(self, version: str) -> None:
        """Set the worker's version now (a failed round's "mixed:N" mark, or a client's explicit version); the
        open round, if any, then commits nothing at its finish."""
        self.weight_version = str(version)
        self._round_version = None

    def init_transfer_engine(self, init_info: StreamSyncInitInfo) -> None:
        self._initialized = True
        info = dict(init_info.streamsync)
        self.record_digests = bool(info.pop("record_digests", False))
        self.fast_path = bool(info.pop("fast_path", True))
        info.pop("owner", None)  # vLLM guards its rounds itself; updates carry the owner (see start)
        self.rx.init(info)
        self.graphs.clear()  # captured from what the receiver it replaces had mapped
        if self.fast_path:  # trace where each tensor goes now, while connecting, not in the first push
            self.fast.known(self._checkpoint())
            plan, _ = self.fast.ensure()
            if plan is not None and self.device.type == "cuda":  # fp8 modules learned before the first push
                with compat.vllm_config_set(self.vllm_config):
                    learn_ahead(plan)
            if self.device.type == "cuda" and kernels.available():
                try:  # compile the captured loads' copy kernel now (a second or so, once per machine)
                    kernels.warm(self.device)
                except Exception as e:  # no working kernel here: captured loads record PyTorch's copies
                    self.graphs.kernel = False
                    logging.getLogger(__name__).warning("streamsync: the segment copy kernel is unavailable (%s); "
                                                        "captured loads record PyTorch's copies", e)

    def _checkpoint(self) -> dict[str, tuple[str, list[int]]] | None:
        return engine_weights(self.model_config, self.model)  # the main model's: the fast path's

    def attach_draft(self, draft: torch.nn.Module | None) -> None:
        """The worker's MTP draft model (`draft.draft_model`; the worker extension finds it): a push's MTP layers
        are loaded into it, through vLLM's layerwise reload of its own modules (`Draft.load`)."""
        self.draft.attach(draft, self.model_config, self.model)

    def fused_layout(self) -> dict[str, list[Any]]:
        """The fused tensors this worker takes (`Fused.fused_layout`): none without the fast path."""
        return self.fast.fused_layout() if self.fast_path else {}

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if not self._initialized:
            raise RuntimeError("streamsync: start_weight_update before init_weight_transfer_engine: initialize the "
                               "weight transfer first (the trainer's connect does)")
        if self._reloading:  # a previous round failed half-way; its buffered layers are dropped
            self.last_round = self._report(self._end_round())
        if self.rx.updating:  # vLLM ended that round (an update raised): it is over here too
            self.rx.abort()
        # vLLM refuses a start while a round is active, so a second WeightSync cannot open one; the round's
        # first update claims it for its sender's owner id and updates of another owner are refused.
        self.rx.start()
        self.received_digests = {}
        self._round_version = None
        self._counts = {k: [0, 0] for k in ("fast", "layerwise", "replayed", "in_place")}
        self._expert_layers = set()  # layers whose experts this round reloaded layerwise
        self.draft.begin_round()
        self._replayed0 = self.graphs.replayed
        self.log.begin()
        with self.log.phase("map"):
            plan, traced = self.fast.ensure() if self.fast_path else (None, False)
        if traced:
            self.graphs.clear()  # captured against the plan traced before
        self._traced, self._traced_ahead = traced or self._traced_ahead, False
        with self.log.phase("arm"), compat.vllm_config_set(self.vllm_config):
            if plan is None:
                hold_kv_b(self.model)
                initialize_layerwise_reload(self.model)
            if plan is not None and plan.arm:
                hold_kv_b(self.model, plan.arm)
            for mod in plan.arm if plan is not None else ():
                initialize_layerwise_reload(mod)  # arms it and its children, which the plan keeps layerwise too
        self._armed = plan is None or bool(plan.arm)
        self._round = FastRound(plan) if plan is not None else None
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator unconditionally, which raises on a CPU-only host.
        info = self.parse_update_info(update_info)
        if info.streamsync.get("version") is not None:
            self._round_version = str(info.streamsync["version"])
        with compat.vllm_config_set(self.vllm_config):
            self.receive_weights(info)
        # A transport that orders on the device (CUDA IPC: the chunk's ready and release events; the round's
        # finish synchronizes before the version is reported) needs no wait here: it would only keep the next
        # chunk's call from overlapping this one's copies. Other transports' buffers are reused once it returns.
        transport = self.rx.transport
        if self.device.type != "cpu" and (transport is None or not transport.orders_on_device):
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: StreamSyncUpdateInfo) -> None:
        info = update_info.streamsync
        hold = set(info.get("hold") or ())
        chunk = info.get("chunk")
        chunk = chunk if isinstance(chunk, int) else None
        # Where this worker knows every tensor's HF shape, blocked views (Q of megatron's interleaved QKV, sent by
        # reference) come as they are: the fast path copies them straight into the engine's tensors, and only the
        # layerwise rest is reshaped (`_hf`). Otherwise the receiver reshapes them all.
        blocked = self._takes_blocked()

        def keep(name: str) -> bool:
            # Layerwise reload buffers a layer's tensors until the layer is complete, and defers some layers
            # to finalize (embeddings and lm_head whose vocabulary vLLM pads); the chunk buffer is reused
            # before that. Copy out the tensors of layers split across chunks (`hold`) and the tensors
            # outside decoder layers (embeddings, final norm, lm_head: a small share of the bytes).
            return name in hold or layer_index(name) is None

        def load(weights: Any) -> None:
            weights = weights if isinstance(weights, list) else list(weights)
            weights, mtp = self.draft.split(weights)  # an MTP layer's tensors: into the draft model, if any
            if mtp:
                mtp = [(n, self._hf(n, t)) for n, t in mtp]
                if self.record_digests:
                    self.received_digests.update((n, tensor_digest(t)) for n, t in mtp)
                self._count("layerwise", [t for _, t in mtp])
                with self.log.phase("load", chunk):
                    self.draft.load([(n, t.clone() if keep(n) else t) for n, t in mtp], self.model, self.vllm_config)
            if self.record_digests:
                self.received_digests.update((n, tensor_digest(self._hf(n, t))) for n, t in weights)
            rnd = self._round
            on_gpu = rnd is not None and self.device.type == "cuda"
            slow: list[tuple[str, torch.Tensor]] = []
            # taken as they are, a chunk's references are its reference set's views, as the receiver made them
            # for this update: their serial number pins them
            serial = self._refs_serial(info) if on_gpu and blocked else None
            parts = chunk_parts(info, self.rx.joined_split, weights, serial) if on_gpu else [(None, weights)]
            for key, part in parts:
                slow += load_part(rnd, key, part)
            if slow:
                with self.log.phase("load", chunk):
                    self._load_layerwise([(n, t.clone() if keep(n) else t) for n, t in slow])

        def load_part(rnd: FastRound | None, key: tuple | None, weights: list[tuple[str, torch.Tensor]]
                      ) -> list[tuple[str, torch.Tensor]]:
            """Load what goes straight into the engine's tensors (a captured graph's replay where one is ready);
            return the rest, for layerwise reload."""
            if rnd is not None and key is not None:
                with self.log.phase("map", chunk):
                    ready = self.graphs.ready(key, rnd, weights)
                if ready is not None:  # the part's tensors loaded by the graph's one launch
                    with self.log.phase("load", chunk):
                        n, nbytes = self.graphs.replay(ready, rnd)
                    self._counts["fast"][0] += n
                    self._counts["fast"][1] += nbytes
                    self._counts["replayed"][0] += n
                    if not ready.rest:
                        return []
                    weights, key = [weights[k] for k in ready.rest], None  # split modules', loaded plainly
            with self.log.phase("map", chunk):
                fast: list[Any]
                if rnd is None:
                    self.fast.learn(weights)
                    fast, slow = [], weights
                else:
                    fast, slow = rnd.split(weights)
                self._count("fast", [t for _, t in fast])
                self._count("layerwise", [t for _, t in slow])
                slow = self.fast.unfuse([(n, self._hf(n, t)) for n, t in slow])
            if rnd is not None and fast:
                with self.log.phase("load", chunk) as load_phase:
                    graphed = not slow and key is not None and self.graphs.load(key, rnd, fast)
                    if not graphed:
                        # each rebuilt module processed once complete (its own phase, cut out of the load's)
                        fast_round = rnd

                        def process(modules: list[int]) -> None:
                            with load_phase.paused(), self.log.phase("process", chunk):
                                fast_round.process(modules)

                        rnd.load(fast, process)
            return slow

        self.rx.update(update_info.streamsync, (_TakesBlocked if blocked else FunctionLoader)(load, self._direct))
        placed = self.rx.base.placed  # tensors a delta was decoded into in place: on the fast path, not loaded
        if placed:
            self._count("fast", [t for _, t in placed])
            self._count("in_place", [t for _, t in placed])
            if self.record_digests:
                self.received_digests.update((n, tensor_digest(t)) for n, t in placed)

    def _direct(self, name: str) -> torch.Tensor | None:
        """The live tensor that holds `name` whole and as it is (`Loader.direct`, `FastRound.in_place`)."""
        shape = self.fast.shape(name)
        return self._round.in_place(name, shape) if self._round is not None and shape is not None else None

    def prime(self, info: dict[str, Any]) -> bool:
        """A chunk's references ahead of its first push (`Primable.prime`): the receiver maps their storages and
        keeps their views (`WeightReceiver.prime`); where every one of them goes straight into the engine's own
        tensors on a GPU, their copies are captured as the graph the chunk's pushes replay (`chunk_parts`), so a
        first push runs like a later one. Loads nothing. False where this worker does not take them (a round is
        open: the push then carries the references)."""
        refs = None if self._reloading else self.rx.prime(info)
        if refs is None:
            return False
        # the references are mapped; without a fast path on a GPU, or with parts (staged into a copy before they
        # load), there is nothing to capture: loads run as on any first push
        if not (self.fast_path and self.fast.specs is not None and self.device.type == "cuda") or any(
                m.part is not None for m, _ in refs):
            return True
        plan, traced = self.fast.ensure()
        if plan is None:
            return True
        if traced:
            self.graphs.clear()  # captured against the plan traced before
            self._traced_ahead = True  # reported by the next round
        rnd = FastRound(plan)
        fast, slow = rnd.split([(m.name, t) for m, t in refs])
        rid = info.get("handle", {}).get("refs_id")
        if fast and not slow and isinstance(rid, str):  # keyed as `receive_weights` keys the set's pushes
            self.graphs.prime(("refs", rid, self._refs_serial(info) if self._takes_blocked() else None), rnd, fast)
        return True

    def _takes_blocked(self) -> bool:
        return self.fast.specs is not None and (self.draft.model is None or self.draft.shapes is not None)

    def _refs_serial(self, info: dict[str, Any]) -> int | None:
        """The serial number of the views the receiver made for this chunk's reference set
        (`ReferenceViews.serial`); None where it has none."""
        handle = info.get("handle")
        refs = getattr(self.rx.transport, "refs", None)
        if not isinstance(handle, dict) or not isinstance(refs, ReferenceViews):
            return None
        return refs.serial(handle.get("refs_id"))

    def _hf(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` in its HF shape: a blocked view reshaped (a copy where its strides allow no view)."""
        shape = self.fast.shape(name) or self.draft.shape(name)
        if shape is None or tuple(t.shape) == shape:
            return t
        return t.reshape(shape)

    def _load_layerwise(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._expert_layers.update(i for n, _ in weights if ".experts." in n and (i := layer_index(n)) is not None)
        with compat.mtp_check_disabled():
            self.model.load_weights(weights)  # type: ignore[operator]  # nn.Module attribute

    def finish_weight_update(self) -> None:
        with self.log.phase("finish"):
            rnd = self._end_round()
        self.last_round = self._report(rnd)
        self.rx.finish(None)
        if self.keeps_version and self._round_version is not None and not self.rx.dirty:
            self.weight_version = self._round_version  # the round ended whole (a cut-short one stays dirty)
        self._round_version = None

    def _end_round(self) -> FastRound | None:
        """Finish what the round left: modules a failed round did not complete keep their old weights; layerwise
        reload is finalized where it was armed; kernels derived from a shared tensor are rebuilt."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._reloading = False
        rnd, self._round = self._round, None
        left = rnd.drop() if rnd is not None else []
        if left:
            logging.getLogger(__name__).warning("streamsync: %d module(s) not completely received keep their old "
                                                "weights: %s", len(left), ", ".join(left[:5]))
        with compat.vllm_config_set(self.vllm_config):
            plan = rnd.plan if rnd is not None else None
            if self._armed:
                finalize_layerwise_reload(self.model, self.model_config)
                relayout_reloaded_experts(self.model, self._expert_layers)
            self._armed = False
            self.draft.finish(self.model_config)  # after the main model's, which owns what they share
            for mod in plan.derive if plan is not None else ():
                if not released_kv_b(mod):  # (AMX MLA) a kv_b_proj this round did not fill: derived as it was
                    mod.process_weights_after_loading(self.model_config.dtype)  # type: ignore[operator]
            if plan is None:
                refresh_shared_kernels(self.model)
            else:  # the modules to refresh are found once per plan (a walk over every module)
                if self._shared is None or self._shared[0] is not plan:
                    self._shared = (plan, shared_kernel_modules(self.model))
                refresh(self._shared[1])
        return rnd

    def _report(self, rnd: FastRound | None) -> dict[str, Any]:
        """The round as plain data for the sender (`streamsync.vllm.worker.stats`, `report.EngineRound`)."""
        fast, slow = self._counts["fast"][0], self._counts["layerwise"][0]
        return self.log.report(
            path="fast" if fast and not slow else "layerwise" if slow and not fast else "mixed" if fast else "none",
            fast_tensors=fast, layerwise_tensors=slow, fast_bytes=self._counts["fast"][1],
            layerwise_bytes=self._counts["layerwise"][1],
            rebuilt_modules=rnd.rebuilt + len(rnd.plan.derive) if rnd is not None else 0,
            direct_modules=rnd.direct if rnd else 0, sourced_modules=rnd.sourced if rnd else 0,
            sourced_copied_bytes=rnd.copied if rnd else 0, traced=self._traced, fast_path=self.fast_path,
            replayed_chunks=self.graphs.replayed - self._replayed0, replayed_tensors=self._counts["replayed"][0],
            draft_tensors=self.draft.tensors, in_place_tensors=self._counts["in_place"][0])

    def _count(self, path: str, tensors: list[torch.Tensor]) -> None:
        c = self._counts[path]
        c[0] += len(tensors)
        c[1] += sum(t.numel() * t.element_size() for t in tensors)

    def shutdown(self) -> None:
        """The trainer's connection is released: a round needs `init_transfer_engine` again."""
        self.rx.close()
        self._initialized = False


class _TakesBlocked(FunctionLoader):
    """The worker's load where it knows every tensor's HF shape: it takes blocked views (module doc of
    `receiver.loaders`)."""

    accepts_blocked = True
