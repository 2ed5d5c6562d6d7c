"""Loaders: what a receiver hands each chunk's tensors to.

A `Loader` declares what it can take and what a load is (`accepts_blocked`, `capturable`, `prepare_load`);
`WeightReceiver` reads those declarations, it never probes. Three kinds:

* `FunctionLoader` wraps a callable of the vLLM model protocol, `load_weights(iterable of (name, tensor))`:
  what the vLLM backend hands a worker's model (layerwise reload; nothing to capture).
* `ModuleLoader` copies into a plain module's parameters and buffers by exact name.
* A `LoadingModule` (a receiver's own model with a layout of its own, e.g. vLLM-style fused parameters) makes
  its loader itself (`loader()`), and says which tensors it fuses and what it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

from ..errors import ValidationError
from ..pack import dtype_name, fits
from ..plan.shards import Box
from . import kernels
from .base_copy import aliased

Weights = Iterable[tuple[str, torch.Tensor]]


class Loader(ABC):
    """Takes a chunk's (name, tensor) views and puts them where the receiver computes with them.

    The views are valid only during the call (they lie in a mapped chunk buffer or a trainer storage): a
    loader that must keep a tensor past it copies it."""

    #: takes a tensor in a blocked shape of its parameter's (`pack.fits`: the same row-major bytes, e.g. Q as a
    #: view of a fused QKV) and copies it in row-major order; otherwise the receiver reshapes it first
    accepts_blocked: ClassVar[bool] = False
    #: a load is copies into the loader's own tensors and nothing else, so a receiver may capture it once as a
    #: CUDA graph and replay it for later pushes of the same chunk from the same addresses
    capturable: ClassVar[bool] = False

    @abstractmethod
    def load(self, weights: Weights) -> object:
        """Load the tensors; raise before copying a tensor whose name, dtype or shape does not fit."""

    def prepare_load(self, weights: Weights) -> kernels.SegmentCopy | None:
        """The copies `load(weights)` would make, checked now and queued by each call of the result as one
        kernel where they are runs of contiguous bytes (`kernels.SegmentCopy`); what a capture records. None:
        capture `load` itself."""
        return None

    def expected(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """HF name -> (dtype name, shape) of what it loads, where it can say."""
        return None

    def direct(self, name: str) -> torch.Tensor | None:
        """The loader's own tensor that holds `name` exactly as it is loaded: the same dtype and row-major
        bytes, one contiguous tensor that its kernels read as it is and that nothing but loads of `name` write.
        A delta is then decoded into it in place (`receiver.base_copy`; what a chunk placed so is in the
        receiver's `base.placed`). None: `name` is only ever loaded."""
        return None


class FunctionLoader(Loader):
    """A callable of the vLLM model protocol (`model.load_weights`); `direct` as the worker that passes it says
    (`Loader.direct`)."""

    def __init__(self, fn: Callable[[Weights], Any], direct: Callable[[str], torch.Tensor | None] | None = None
                 ) -> None:
        self.fn = fn
        self._direct = direct

    def load(self, weights: Weights) -> object:
        return self.fn(weights)

    def direct(self, name: str) -> torch.Tensor | None:
        return self._direct(name) if self._direct is not None else None


class ModuleLoader(Loader):
    """Copy received tensors into a plain module's parameters and buffers, by exact name.

    Unknown names, shape or dtype mismatches raise before anything of the tensor is copied.
    """

    accepts_blocked = True
    capturable = True

    def __init__(self, module: torch.nn.Module) -> None:
        self.targets = {n: t.detach() for n, t in module.state_dict(keep_vars=True).items()}
        self._aliased: set[str] | None = None

    def expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in self.targets.items()}

    def direct(self, name: str) -> torch.Tensor | None:
        if self._aliased is None:
            self._aliased = aliased(self.targets)
        return None if name in self._aliased else self.targets.get(name)

    def load(self, weights: Weights) -> list[str]:
        loaded = []
        with torch.no_grad():
            for name, src in checked(weights, self.targets):
                dst = self.targets[name]
                (dst if dst.shape == src.shape else dst.view(src.shape)).copy_(src)
                loaded.append(name)
        return loaded

    def prepare_load(self, weights: Weights) -> kernels.SegmentCopy:
        pairs = [(self.targets[n], s) for n, s in checked(weights, self.targets)]
        dsts = [d if d.shape == s.shape else d.view(s.shape) for d, s in pairs]
        return kernels.SegmentCopy(dsts, [s for _, s in pairs])


class LoadingModule(torch.nn.Module):
    """A receiver's own model that makes its loader itself (the vLLM-style fused stand-in): the receiver
    process serves it through `loader()`, and its answers to the sender come from here."""

    def loader(self) -> Loader:
        raise NotImplementedError

    def fused_layout(self) -> dict[str, Any] | None:
        """Its fused tensors and their HF members (`Fused.fused_layout`), or None."""
        return None

    def layout(self) -> list[tuple[str, Box]] | None:
        """The boxes of HF tensors it holds (`Sharded.layout`, one worker's needs), or None: every tensor
        whole."""
        return None

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of everything it holds, as views into its own parameters (for checksums)."""
        return iter(self.state_dict().items())


def checked(weights: Weights, targets: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, each refused (ValidationError) unless `targets` holds that name with its dtype and shape (or
    a blocked form of it)."""
    for name, src in weights:
        dst = targets.get(name)
        if dst is None:
            raise ValidationError(f"receiver has no parameter {name!r}")
        if (dst.shape != src.shape and not (dst.is_contiguous() and fits(src, tuple(dst.shape)))) \
                or dst.dtype != src.dtype:
            raise ValidationError(f"parameter {name!r}: received {src.dtype}{tuple(src.shape)}, "
                                  f"receiver holds {dst.dtype}{tuple(dst.shape)}")
        yield name, src
