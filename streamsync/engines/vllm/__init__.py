"""vLLM engine clients: in-process `vllm.LLM` / `vllm.AsyncLLM`, and `vllm serve` over HTTP.

All three speak the four phases with streamsync's plain-dict payloads wrapped as {"streamsync": ...},
which the `streamsync` backend (streamsync.vllm.worker.backend) unwraps in every worker. Versions are vLLM's
strings; streamsync's integer versions travel as their decimal string, and an engine a failed push left
holding part of version N's weights reports "mixed:N" (`state().mixed`; `get_version()` is then None).

One client serves vLLM 0.25.x and 0.32+. At connect (`locate`) each asks the engine's worker once what its
vLLM is (`vllm_info`): a version outside `streamsync.vllm.compat.SUPPORTED` is refused there, naming it; where
vLLM keeps the weight version (0.32+) the client commits and reads it through vLLM (`finish_weight_update(v)`,
`get_weight_version`), and where it keeps none (0.25.x) through the version the streamsync workers keep
(`streamsync_weight_version`, committed by the round's finish, marks set with `streamsync_set_weight_version`).

Every call is raced against a liveness check from its first second on: a killed engine core leaves vLLM's
pending call waiting forever, so without it a dead engine would be reported only at the timeout.
"""

from __future__ import annotations

from .http import VllmHttpEngine
from .inproc import AsyncVllmEngine, VllmEngine, _Caller
from .round import engine_kwargs, shutdown

__all__ = ["AsyncVllmEngine", "VllmEngine", "VllmHttpEngine", "_Caller", "engine_kwargs", "shutdown"]
