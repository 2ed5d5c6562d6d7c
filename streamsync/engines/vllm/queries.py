"""What a vLLM engine's workers are asked outside a round: digests of what they hold, their checkpoint's tensors,
their layout, their KV cache; every call one `collective_rpc` on every worker (`WorkerQueries.rpc`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import EngineError
from ...plan.shards import Box, EngineLayout, Need
from ...vllm.answers import WORKER_ERROR
from ..base import Declined

if TYPE_CHECKING:
    import torch

    from ...vllm.compat import VllmInfo


class WorkerQueries:
    """The read-side calls of a vLLM engine client; `_rpc` is the client's own way into `collective_rpc`."""

    name: str
    if TYPE_CHECKING:  # the client's own (`round.VllmClient`, `Engine`)
        async def vllm_info(self) -> VllmInfo: ...
        async def reset_cache(self) -> bool: ...

    async def weight_digests(self, device: bool = False) -> dict[str, str]:
        """What the engine computes with, per vLLM parameter (first worker). `device`: digests computed where
        each tensor lives (`checksum.device_digest`; compare with `expected_digests(..., digest=device_digest)`)."""
        return (await self.rpc("streamsync_weight_digests", *(["1"] if device else [])))[0]

    async def holds(self, hf: Mapping[str, torch.Tensor], tied: bool = False) -> bool | None:
        """Compares the worker's parameters (vLLM's fused names) with `hf` fused the same way."""
        from ...vllm.trainer.digests import expected_digests

        return await self.weight_digests() == expected_digests(hf, await self.packed_modules(), tied=tied)

    async def expected_weights(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """HF name -> (dtype, shape) of the checkpoint the engine loaded (first worker), or None when the
        engine was started from something other than a local safetensors folder."""
        got = (await self.rpc("streamsync_expected_weights"))[0]
        return None if got is None else {n: (d, tuple(s)) for n, (d, s) in got.items()}

    async def architectures(self) -> tuple[str, ...]:
        return (await self.vllm_info()).architectures

    async def declined_layers(self) -> Declined | None:
        """The checkpoint's MTP layers, which the workers' main model does not load (`checkpoint.mtp_layers`):
        declined, or optional where the workers run an MTP draft model (`StreamSyncWorkerExtension`)."""
        got = (await self.rpc("streamsync_declined_layers"))[0]
        start, stop = got["layers"]
        names = frozenset(str(n) for n in got.get("names") or ())
        optional = got.get("optional") or (0, 0)
        if stop <= start and not names and optional[1] <= optional[0]:
            return None
        return Declined(int(start), int(stop), str(got["reason"]), names, str(got.get("names_reason") or ""),
                        (int(optional[0]), int(optional[1])), str(got.get("prefix") or ""))

    async def draft_digests(self, device: bool = False) -> dict[str, str]:
        """Digests of the tensors of the engine's MTP draft model that are its own (not shared with the main model),
        by the draft's parameter names; {} where it runs none (first worker; `weight_digests` for `device`)."""
        return (await self.rpc("streamsync_draft_digests", *(["1"] if device else [])))[0]

    async def delta_base(self) -> tuple[int, str] | None:
        """The push every worker keeps as its delta base (None unless all keep the same one)."""
        held = {None if h is None else (int(h[0]), str(h[1])) for h in await self.rpc("streamsync_delta_base")}
        return held.pop() if len(held) == 1 else None

    async def clear_kv_cache(self) -> int:
        """Reset the prefix cache and zero the KV-cache memory of every worker; returns how many non-finite
        values it held. The recovery after weights holding NaN or inf were served (`check_finite=False`):
        requests served with them leave NaN in freed cache blocks, a block reused by a later request is read
        beyond its filled slots by the attention kernel (masked weight 0 x NaN = NaN), and the engine keeps
        answering NaN after good weights are back. Pause first (`sync.paused(mode="abort")` or "wait"): the
        memory of requests holding blocks would be wiped."""
        if not await self.reset_cache():
            raise EngineError(self.name, "cannot clear the KV cache while requests hold cache blocks: pause "
                              "with mode='abort' or 'wait' first")
        return sum(int(n) for n in await self.rpc("streamsync_zero_kv_cache"))

    async def packed_modules(self) -> dict[str, list[str]]:
        return (await self.rpc("streamsync_packed_modules"))[0]

    async def fused_layout(self) -> dict[str, Any] | None:
        """The tensors every worker takes as one (the fast path's fusions: `qkv_proj`, `gate_up_proj`, stacked
        experts), or None where they differ or there are none."""
        layouts = await self.rpc("streamsync_fused_layout")
        first = layouts[0] if layouts else None
        return first if first and all(x == first for x in layouts) else None

    async def layout(self) -> EngineLayout | None:
        """The part of each checkpoint tensor each worker reads, as its fast path traced vLLM's own loaders (TP
        slices: q/k/v and gate/up rows, o/down columns, its share of the padded vocabulary; replicated tensors
        whole on every worker); None where a worker has no trace (`fast_path=False`, or no local checkpoint)."""
        got = await self.rpc("streamsync_layout")
        if not got or any(g is None for g in got):
            return None
        self.workers = len(got)
        return EngineLayout(self.name, len(got), tuple(Need(self.name, w, str(n), Box.from_json(b))
                                                       for w, items in enumerate(got) for n, b in items))

    async def received_digests(self) -> dict[str, str]:
        return (await self.rpc("streamsync_received_digests"))[0]

    async def rpc(self, method: str, *args: Any, **kwargs: str) -> list[Any]:
        """`collective_rpc(method, args, kwargs)` on every worker of the engine: one result per worker (keyword
        arguments as strings: what vLLM's HTTP route passes). A worker that answered with an error in place of
        raising (`vllm.answers.answering`) fails the call here, naming it."""
        got = await self._rpc(method, *args, **kwargs)
        for i, x in enumerate(got if isinstance(got, list) else ()):
            if isinstance(x, dict) and WORKER_ERROR in x:
                raise EngineError(self.name, f"{method} failed in worker {i}: {x[WORKER_ERROR]}")
        return got

    async def _rpc(self, method: str, *args: Any, **kwargs: str) -> list[Any]:
        raise NotImplementedError
