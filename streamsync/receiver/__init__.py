"""The receiving side, shared by the vLLM backend and the plain receiver process.

`WeightReceiver` turns an `update_info` (plain data: layout + transport handle) into (name, tensor) views
and feeds them to a loader: the vLLM model protocol `load_weights(iterable)` or `ModuleLoader`, which copies
into a plain module's parameters. It closes the chunk's handle before returning, so returning from the
update call is the acknowledgement the sender waits for.

Tensors larger than the sender's chunk budget arrive as row parts in consecutive chunks; the receiver copies
each part into a staging tensor and hands the loader the whole tensor once its last row arrived (so every
receiver, vLLM's included, loads whole tensors, bit for bit what the sender holds).

Direct receives: a transport whose `open` takes `targets` (the collective transport's direct protocol) can
write tensors straight into the loader's parameters. A loader that can name them has
`destinations(specs) -> [tensor or None]` (`Destinations`); those tensors are not handed to the loader again,
and parts of a split tensor go into their rows of its destination."""

from .loaders import ModuleLoader, as_destination
from .state import Destinations, Loader, RoundOwned, UnknownLayout, WeightReceiver

__all__ = ["Destinations", "Loader", "ModuleLoader", "RoundOwned", "UnknownLayout", "WeightReceiver", "as_destination"]
