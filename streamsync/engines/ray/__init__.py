"""vLLM engines living in Ray actors: how RL stacks that outgrow one machine place their rollout engines.

Two halves, both thin, around the in-process engines of `streamsync.engines.vllm`:

* `StreamsyncEngineMixin` for the user's actor class. The actor builds its `vllm.LLM` / `AsyncLLM` as usual
  (with `engine_kwargs()`) and calls `self.streamsync_attach(llm)`; the mixin wraps it in a `VllmEngine` /
  `AsyncVllmEngine` and serves that engine's calls to the sender through one async actor method. So the
  four-phase protocol, the owner check, mixed-version marking and the engine-core liveness watch are the
  in-process engines' own, run inside the actor.
* `RayVllmEngine(actor_handle)` on the sender (the driver, or a trainer that is itself a Ray actor): an
  `Engine` whose every call is `actor.streamsync_call.remote(...)` awaited under the sync's timeout. A dead
  actor fails the call at once with an EngineError naming the engine ("engine actor died"), not at the
  timeout: Ray fails the pending call when it learns of the death.
* A plain vLLM actor works too, as vLLM's own Ray examples make it (`ray.remote(vllm.LLM).remote(model, ...,
  **engine_kwargs())`): `RayVllmEngine` then drives the `LLM`'s own methods (`init_weight_transfer_engine`,
  `start_weight_update`, `update_weights`, `finish_weight_update`, `collective_rpc`, `sleep`, `wake_up`,
  `reset_prefix_cache`) through `VllmEngine`'s code, each call one `actor.<method>.remote(...)`; where it runs
  is asked through Ray's `__ray_call__`. Only an `LLM` actor (an `AsyncLLM` needs an async actor of the user's).

Placement picks the transport (`transport="auto"`): before the transport is chosen `locate()` asks the actor
for its Ray node and GPUs. An actor on the sender's node (and, for GPU engines, its GPU) is reached through
shared memory or CUDA IPC; any other through the collective transport (gloo on CPU, NCCL on GPU), whose
rendezvous listens on the sender's node IP as Ray reports it. That group is streamsync's own (a TCPStore and
process-group objects, never `init_process_group`), so neither Ray's nor vLLM's groups are touched.

Ray is an optional dependency: `pip install streamsync[ray]`. Only asyncio event loops can await Ray's
object refs (so not trio); `BlockingWeightSync` and async Ray actors run asyncio.
"""

from .actor import StreamsyncEngineMixin, node_placement
from .driver import RayVllmEngine

__all__ = ["RayVllmEngine", "StreamsyncEngineMixin", "node_placement"]
