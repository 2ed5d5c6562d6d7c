"""The receiver process for tests and benchmarks: `ReceiverProcess(..., fused=True)` serves the vLLM-style
fused stand-in (`streamsync.testing.fused.FusedModel`) instead of plain parameters."""

from __future__ import annotations

from typing import Any

from ..receiver.process import ReceiverProcess as _ReceiverProcess

FUSED = "streamsync.testing.fused:receiver_module"


class ReceiverProcess(_ReceiverProcess):
    def __init__(self, specs_path: str, *, fused: bool = False, **kwargs: Any) -> None:
        super().__init__(specs_path, module=FUSED if fused else None, **kwargs)
