"""The receiving side, shared by the vLLM backend and the plain receiver process.

`WeightReceiver` turns an `update_info` (plain data: layout + transport handle) into (name, tensor) views
and feeds them to a loader: the vLLM model protocol `load_weights(iterable)` or `ModuleLoader`, which copies
into a plain module's parameters. It closes the chunk's handle before returning, so returning from the
update call is the acknowledgement the sender waits for.

Tensors larger than the sender's chunk budget arrive as row parts in consecutive chunks; the receiver copies
each part into a staging tensor and hands the loader the whole tensor once its last row arrived (so every
receiver, vLLM's included, loads whole tensors, bit for bit what the sender holds).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ValidationError
from .pack import Layout, TensorMeta, dtype_name, fits
from .transports.base import Receiver, make_receiver

Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


class UnknownLayout(ValidationError):
    """An update named its layout by key only, and this receiver has not seen (or no longer keeps) that key.
    Clients that strip known layouts resend the update with its layout."""


@dataclass
class _Staged:
    tensor: torch.Tensor
    rows: int = 0  # rows filled so far


class RoundOwned(ValidationError):
    """A call of one WeightSync met a round another WeightSync has open on this receiver."""


class WeightReceiver:
    """Four-phase receiving state machine: init -> (start -> update* -> finish)*.

    `version` is the last version finished; it only moves in `finish`. A round that failed half-way leaves
    `dirty` True (its weights are partly new) until the next finished round: `clean_version` is then None.

    Ownership: `start(owner=...)` ties the round to one WeightSync; updates, finish and abort that carry
    another owner are refused (RoundOwned), and so is another owner's `start` or `init` while the round is
    open, so two syncs never mix their models under one version. A round nobody touched for longer than
    the `stale_after` seconds its owner declared (its own timeout: that owner's push has failed by then)
    is abandoned and may be taken over, so a crashed trainer never locks a receiver.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.transport: Receiver | None = None
        self.version: int | None = None
        self.updating = False
        self.dirty = False
        self.chunks = 0
        self.bytes = 0
        self._layouts: dict[str, Layout] = {}
        self._open_sized = True
        self._staged: dict[str, _Staged] = {}  # tensors split across chunks, being reassembled
        self.owner: str | None = None
        self.stale_after: float | None = None
        self._touched = 0.0

    @property
    def clean_version(self) -> int | None:
        """The version held whole: None from a round's first applied chunk until a round finishes."""
        return None if self.dirty else self.version

    @property
    def idle_s(self) -> float:
        """Seconds since the open round's owner was last heard from."""
        return time.monotonic() - self._touched

    def _owned_by_other(self, owner: str | None) -> bool:
        """An open, fresh round of another owner (a round opened without an owner is anyone's)."""
        if not self.updating or self.owner is None or owner == self.owner:
            return False
        stale = self.stale_after is not None and time.monotonic() - self._touched > self.stale_after
        return not stale

    def _check_owner(self, owner: str | None, what: str) -> None:
        if owner is not None and self.owner is not None and owner != self.owner:
            raise RoundOwned(f"{what} refused: the open round belongs to another WeightSync "
                             f"(owner {self.owner[:8]}, this call's owner {owner[:8]})")
        self._touched = time.monotonic()

    def init(self, init_info: dict[str, Any], owner: str | None = None) -> None:
        if owner is not None and self._owned_by_other(owner):
            raise RoundOwned(f"init refused: a round of another WeightSync (owner {self.owner[:8]}) is open")
        if self.transport is not None:
            self.transport.close()
        self.transport = make_receiver(init_info, self.device)
        # Receivers registered before `open` took the layout's size keep working.
        self._open_sized = "nbytes" in inspect.signature(self.transport.open).parameters

    def start(self, owner: str | None = None, stale_after: float | None = None) -> None:
        if self._owned_by_other(owner):
            raise RoundOwned(f"start refused: a round of another WeightSync (owner {self.owner[:8]}) is open; "
                             "one receiver takes one sync's pushes at a time")
        if self.updating and self.transport is not None:
            self.transport.end_round()  # the previous round failed half-way: drop what it mapped
        self.updating = True
        self.owner, self.stale_after = owner, stale_after
        self._touched = time.monotonic()
        self.chunks = self.bytes = 0
        self._staged.clear()

    def update(self, update_info: dict[str, Any], load: Loader) -> int:
        if not self.updating:
            raise ValidationError("update outside a round: call start_update first")
        owner = update_info.get("owner")
        if self.owner is None and self.chunks == 0 and isinstance(owner, str):
            self.owner = owner  # a start that carries no owner (vLLM's): the round's first chunk claims it
        self._check_owner(owner, "update")
        if self.transport is None:
            raise ValidationError("update before init: call init_transfer first")
        layout = self._layout(update_info)
        with (self.transport.open(update_info, layout.nbytes) if self._open_sized
              else self.transport.open(update_info)) as buf:
            if buf.numel() < layout.nbytes:
                raise ValidationError(f"chunk buffer holds {buf.numel()} bytes, layout needs {layout.nbytes}")
            refs = self.transport.ref_views(update_info)
            self.dirty = True
            views = self.transport.views(buf, layout)
            metas: tuple[TensorMeta, ...] = layout.metas
            if refs:  # tensors sent by reference (one copy): after the packed ones
                if not getattr(getattr(load, "__self__", load), "accepts_blocked", False):
                    refs = [(m, t if t.shape == m.shape else t.reshape(m.shape)) for m, t in refs]
                views = [*views, *((m.name, t) for m, t in refs)]
                metas = (*metas, *(m for m, _ in refs))
            if any(m.part is not None for m in metas):
                views = self._assemble(views, metas)
            load(views)
            del buf
        nbytes = layout.nbytes + sum(m.nbytes for m, _ in refs)
        self.chunks += 1
        self.bytes += nbytes
        return nbytes

    def _layout(self, update_info: dict[str, Any]) -> Layout:
        """Parse and validate a chunk's layout once; later pushes of the same plan send the same key and the
        receiver reuses what it validated (the key only selects, it is never trusted for bounds)."""
        key = update_info.get("layout_key")
        layout = self._layouts.get(key) if isinstance(key, str) else None
        if layout is None:
            if update_info.get("layout") is None and isinstance(key, str):
                raise UnknownLayout(f"layout {key} is not known here: send the update with its layout")
            layout = Layout.from_json(update_info.get("layout"))  # type: ignore[arg-type]
            if isinstance(key, str):
                if len(self._layouts) >= 4096:
                    self._layouts.clear()
                self._layouts[key] = layout
        return layout

    def _assemble(self, views: Iterable[tuple[str, torch.Tensor]],
                  metas: Iterable[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors as they are, parts copied into their tensor's staging copy; a tensor is yielded when
        its last row arrived. Parts must come in row order (the sender plans them so)."""
        for (name, t), m in zip(views, metas, strict=True):
            if m.part is None:
                yield name, t
                continue
            row0, rows = m.part
            if t.shape != m.shape:  # a blocked reference: its rows in HF shape
                t = t.reshape(m.shape)
            staged = self._staged.get(name)
            if staged is None:
                staged = self._staged[name] = _Staged(torch.empty((rows, *t.shape[1:]), dtype=t.dtype,
                                                                  device=t.device))
            if row0 != staged.rows or tuple(staged.tensor.shape) != (rows, *t.shape[1:]):
                raise ValidationError(f"tensor {name!r}: part at row {row0} of {rows} does not continue the "
                                      f"{staged.rows} rows received")
            staged.tensor[row0:row0 + t.shape[0]].copy_(t)
            staged.rows += t.shape[0]
            if staged.rows == rows:
                del self._staged[name]
                yield name, staged.tensor

    def finish(self, version: int | None, owner: str | None = None) -> None:
        """End the round. `version` may be None where the engine keeps its own (vLLM does)."""
        if not self.updating:
            raise ValidationError("finish outside a round: call start_update first")
        self._check_owner(owner, "finish")
        if self._staged:
            # A tensor split across chunks is half-loaded: this round was cut short (vLLM ends an aborted round
            # with finish). End it as an abort: the version stays, and `dirty` too if a chunk was applied.
            self.abort(owner)
            return
        self.updating = False
        self.dirty = False
        self.version = None if version is None else int(version)
        if self.transport is not None:
            self.transport.end_round()

    def abort(self, owner: str | None = None) -> None:
        """End a failed round: the version stays; `dirty` stays True if any chunk was applied."""
        if self.updating:
            self._check_owner(owner, "abort")
        if self.updating and self.transport is not None:
            self.transport.end_round()
        self.updating = False
        self._staged.clear()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


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

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        loaded = []
        with torch.no_grad():
            for name, src in _checked(weights, self.targets):
                dst = self.targets[name]
                (dst if dst.shape == src.shape else dst.view(src.shape)).copy_(src)
                loaded.append(name)
        return loaded


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
