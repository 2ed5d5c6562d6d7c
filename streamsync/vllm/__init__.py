"""streamsync inside vLLM: the `streamsync` weight-transfer backend and a worker extension.

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every process (frontend, engine
core, each worker), so `weight_transfer_config={"backend": "streamsync"}` resolves everywhere. It only
records a lazy import path; nothing of streamsync's backend is imported until a worker builds it.
"""

from __future__ import annotations

BACKEND = "streamsync"
WORKER_EXTENSION = "streamsync.vllm.extension.StreamSyncWorkerExtension"


def register() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight transfer: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:  # registering twice raises in vLLM
        WeightTransferEngineFactory.register_engine(BACKEND, "streamsync.vllm.backend",
                                                    "StreamSyncWeightTransferEngine")
