"""The worker extension at the path vLLM is given (`worker_extension_cls`, `streamsync.vllm.WORKER_EXTENSION`);
its code is the worker's (`worker/extension.py`)."""

from .worker.extension import StreamSyncWorkerExtension

__all__ = ["StreamSyncWorkerExtension"]
