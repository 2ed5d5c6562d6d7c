"""streamsync: stream a trainer's weights into running inference engines.

    sync = WeightSync(engines=[...])
    await sync.connect()
    report = await sync.push(model, version=step)

From synchronous code: `BlockingWeightSync` (same arguments, blocking methods, one background loop).
"""

from .blocking import BlockingWeightSync
from .errors import EngineError, PushError, StreamSyncError, TransportError, ValidationError
from .report import ChunkDone, EngineRound, PushReport
from .sync import WeightSync

__all__ = ["BlockingWeightSync", "ChunkDone", "EngineError", "EngineRound", "PushError", "PushReport",
           "StreamSyncError", "TransportError", "ValidationError", "WeightSync"]
__version__ = "0.1.0"
