"""The receiver process for tests and benchmarks: `ReceiverProcess(..., fused=True)` serves the vLLM-style
fused stand-in (`streamsync.testing.fused.FusedModel`) instead of plain parameters."""

from __future__ import annotations

from typing import Any

from ..receiver.process import ReceiverProcess as _ReceiverProcess

FUSED = "streamsync.testing.fused:receiver_module"
SLICED = "streamsync.testing.sliced:sliced_module"


class ReceiverProcess(_ReceiverProcess):
    """`fused`: the vLLM-style fused stand-in; `holds` ((HF name, box) pairs): one worker of a sharded engine
    holding those slices (`streamsync.testing.sliced`)."""

    def __init__(self, specs_path: str, *, fused: bool = False, holds: Any = None, **kwargs: Any) -> None:
        if holds is not None:
            from .sliced import module_args

            kwargs.update(module=SLICED, module_args=module_args(holds))
        super().__init__(specs_path, module=FUSED if fused else kwargs.pop("module", None), **kwargs)
