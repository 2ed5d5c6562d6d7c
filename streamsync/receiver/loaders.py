"""Loaders: what a receiver hands each chunk's tensors to (a plain module's parameters)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from ..errors import ValidationError
from ..pack import TensorSpec, dtype_name, fits
from . import kernels


class ModuleLoader:
    """Copy received tensors into a plain module's parameters and buffers, by exact name.

    Unknown names, shape or dtype mismatches raise before anything of the tensor is copied.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.targets = {n: t.detach() for n, t in module.state_dict(keep_vars=True).items()}

    def expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in self.targets.items()}

    #: takes a tensor in a blocked shape of its parameter's (see `pack.fits`): copies it in row-major order
    accepts_blocked = True
    #: a load is copies into the module's tensors and nothing else: WeightReceiver may replay it as a graph
    capturable = True

    def destinations(self, specs: Sequence[TensorSpec]) -> list[torch.Tensor | None]:
        """The parameter each HF tensor loads into, where it is contiguous (`Destinations`); names this module
        does not hold get None (the load then raises as usual)."""
        return [as_destination(self.targets.get(s.name), s) for s in specs]

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        loaded = []
        with torch.no_grad():
            for name, src in _checked(weights, self.targets):
                dst = self.targets[name]
                (dst if dst.shape == src.shape else dst.view(src.shape)).copy_(src)
                loaded.append(name)
        return loaded

    def prepare_load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Callable[[], None]:
        """The copies of `self(weights)`, checked now and queued by each call of the result as one kernel where
        they are runs of contiguous bytes (`kernels.SegmentCopy`); for a captured load (`WeightReceiver._load`)."""
        pairs = [(self.targets[n], s) for n, s in _checked(weights, self.targets)]
        dsts = [d if d.shape == s.shape else d.view(s.shape) for d, s in pairs]
        return kernels.SegmentCopy(dsts, [s for _, s in pairs])


def as_destination(t: torch.Tensor | None, spec: TensorSpec) -> torch.Tensor | None:
    """`t` if a direct receive may write `spec` into it: contiguous, of exactly its dtype and shape."""
    if t is None or not t.is_contiguous() or t.dtype != spec.dtype or tuple(t.shape) != tuple(spec.shape):
        return None
    return t


def _checked(weights: Iterable[tuple[str, torch.Tensor]],
             targets: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, src in weights:
        dst = targets.get(name)
        if dst is None:
            raise ValidationError(f"receiver has no parameter {name!r}")
        if (dst.shape != src.shape and not (dst.is_contiguous() and fits(src, tuple(dst.shape)))) \
                or dst.dtype != src.dtype:
            raise ValidationError(f"parameter {name!r}: received {src.dtype}{tuple(src.shape)}, "
                                  f"receiver holds {dst.dtype}{tuple(dst.shape)}")
        yield name, src
