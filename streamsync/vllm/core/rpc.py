"""A round's end in one call into the engine core: the workers' finish, vLLM's version, the prefix-cache reset.

A push ends with up to three calls into the engine: the workers' finish (`streamsync_finish_update`, a
`collective_rpc`), vLLM's weight version (0.32+: its `finish_weight_update(version)` makes a second call for
it) and the scheduler's prefix-cache reset. Each crosses from the client into the engine-core process and back
(1.1-2.4 ms on the H200, more than the work itself), and both later calls have to wait for the finish anyway:
KV computed with the old weights must not be reused once the new ones are in place.

`install()` wraps `EngineCore.collective_rpc` in the engine-core process (the `vllm.general_plugins` entry point
runs there). After the workers answered a `streamsync_finish_update`, or a `streamsync_update` that ends the
round, it does in the same call what the arguments ask: `VERSION` + v sets vLLM's weight version to v (where
vLLM keeps one: what its own finish does), `RESET` runs vLLM's own `reset_prefix_cache()`. It adds to each
worker's round stats what it did (`weight_version`, `cache_reset`) and to the first worker's a `cache_reset`
phase timed where it ran. Every other call is vLLM's. Where the wrapper is not installed the workers ignore
the arguments and their answers carry neither field: the client then makes those calls itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..answers import failed
from ..patches import wrap_method

#: the argument of `streamsync_finish_update` that asks the engine core to reset the prefix cache after it
RESET = "reset_prefix_cache"
#: the prefix of the argument that gives the engine core the version to set once the workers finished (where
#: vLLM keeps the weight version: what its own `finish_weight_update(version)` does with a second call)
VERSION = "version="
#: the extension's calls that can end a round: its finish, and an update that ends the round with its chunk
ENDS = ("streamsync_finish_update", "streamsync_update")


def install() -> bool:
    """Wrap `EngineCore.collective_rpc` (idempotent); False where vLLM has no such engine core."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
            out = orig(self, method, timeout, args, kwargs)
            if method not in ENDS or failed(out):  # a worker failed the round's end: nothing more is done for it
                return out
            args = tuple(args or ())
            version = next((a[len(VERSION):] for a in args if isinstance(a, str) and a.startswith(VERSION)), None)
            answers = [x for x in out if isinstance(x, dict)]
            if version is not None and hasattr(self, "set_weight_version"):  # vLLM keeps it (0.32+): as its finish
                self.set_weight_version(version)
                for x in answers:
                    x["weight_version"] = version
            if RESET not in args:
                return out
            t0 = time.time()
            done = bool(self.reset_prefix_cache())
            span = ["cache_reset", None, t0, time.time()]
            for x in answers:
                x["cache_reset"] = done
            if answers:  # the engine's one reset, drawn once (with the first worker's phases)
                answers[0].setdefault("phases", []).append(span)
            return out
        return collective_rpc

    return wrap_method(EngineCore, "collective_rpc", make)
