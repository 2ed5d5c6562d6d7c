"""streamsync: stream a trainer's weights into running inference engines.

    sync = WeightSync(engines=[...])
    await sync.connect()
    report = await sync.push(model, version=step)
"""

from .errors import EngineError, PushError, StreamSyncError, TransportError, ValidationError
from .sync import PushReport, WeightSync

__all__ = ["EngineError", "PushError", "PushReport", "StreamSyncError", "TransportError", "ValidationError",
           "WeightSync"]
__version__ = "0.1.0"
