"""The receiving side, shared by the vLLM backend and the plain receiver process: the state machine every
receiver runs (`WeightReceiver`, state.py), the loaders it hands tensors to (loaders.py), the captured-load
copy kernel (kernels.py), and the receiver process (protocol.py, server.py, process.py)."""

from .loaders import FunctionLoader, Loader, LoadingModule, ModuleLoader
from .state import ReceiverStats, RoundOwned, UnknownLayout, WeightReceiver

__all__ = ["FunctionLoader", "Loader", "LoadingModule", "ModuleLoader", "ReceiverStats", "RoundOwned", "UnknownLayout",
           "WeightReceiver"]
