"""The shared-memory receiving half (inside an engine worker)."""

from __future__ import annotations

import hmac
import mmap
import os
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from ...errors import TransportError, ValidationError
from ...pack import TensorMeta
from ..base import Receiver
from ..refs import ReferenceViews
from .segments import MAP_FLAGS, MAX_INT, MEMFD_PREFIX, TORCH_SHM_LINK, close_map


def _field(raw: dict[str, Any], key: str, low: int) -> int:
    v = raw.get(key)
    if type(v) is not int or not low <= v < MAX_INT:
        raise ValidationError(f"shm storage export field {key!r} must be an int >= {low}, got {v!r:.80}")
    return v


class ShmReceiver(Receiver):
    name: ClassVar[str] = "shm"

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cpu") -> None:
        super().__init__(init_info, device)
        self._maps: dict[tuple[int, int, str], mmap.mmap] = {}
        self._used: set[tuple[int, int, str]] = set()
        self.refs = ReferenceViews(self.name, self._map_storage)

    def ref_views(self, update_info: dict[str, Any], in_round: bool = True) -> list[tuple[TensorMeta, torch.Tensor]]:
        return self.refs.views(update_info, in_round)

    def stats(self) -> dict[str, float]:
        return {"map_storages": self.refs.map_seconds}

    def _map_storage(self, token: str, raw: dict[str, Any]) -> torch.Tensor:
        """Map a trainer storage read-only, after checking the export names one of torch's shared-memory
        files and that `/proc/<pid>/fd/<fd>` is exactly that file (before and after opening it)."""
        if not isinstance(raw, dict):
            raise ValidationError(f"shm storage export must be {{pid, fd, size, link}}, got {raw!r:.200}")
        pid, fd, size = _field(raw, "pid", 1), _field(raw, "fd", 0), _field(raw, "size", 1)
        link = raw.get("link")
        if not isinstance(link, str) or not TORCH_SHM_LINK.match(link):
            raise ValidationError(f"shm storage export link {link!r:.80} is not one of torch's shared-memory files")
        path = f"/proc/{pid}/fd/{fd}"

        def same(target: str, where: str) -> None:
            if not hmac.compare_digest(target.encode(), link.encode()):
                raise ValidationError(f"{where} is not the trainer storage this export names (link mismatch)")

        try:
            same(os.readlink(path), path)
            f = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise TransportError(f"trainer storage {path} is gone (sender exited?)") from None
        except PermissionError as e:
            raise TransportError(f"cannot open {path}: {e} (sender and receiver must share host and user)") from e
        try:
            same(os.readlink(f"/proc/self/fd/{f}"), path)  # what was opened, not what the link said a moment ago
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode) or st.st_size < size:
                raise ValidationError(f"trainer storage {path} holds {st.st_size} bytes, its export says {size}")
            mm = mmap.mmap(f, size, flags=MAP_FLAGS, prot=mmap.PROT_READ)
        except OSError as e:
            raise TransportError(f"cannot map trainer storage {path}: {e}") from e
        finally:
            os.close(f)
        with warnings.catch_warnings():  # read-only on purpose: a loader can never write the trainer's weights
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mm, dtype=torch.uint8, count=size)

    def _map(self, pid: int, fd: int, token: str, nbytes: int) -> mmap.mmap:
        path = f"/proc/{pid}/fd/{fd}"
        try:  # the handle must name a streamsync segment with this token, not any file the sender has open
            target = os.readlink(path)
        except FileNotFoundError:
            raise TransportError(f"shared-memory segment {path} is gone (sender exited?)") from None
        except PermissionError as e:
            raise TransportError(f"cannot open {path}: {e} (sender and receiver must share host and user)") from e
        # Exact match (a prefix test let one right character pass), and the real name stays out of the error:
        # it holds the segment's token, which is what proves a handle came from the sender.
        if not hmac.compare_digest(target.encode(), f"/memfd:{MEMFD_PREFIX}{token} (deleted)".encode()):
            raise ValidationError(f"{path} is not the streamsync segment this handle names (token mismatch)")
        try:
            f = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise TransportError(f"shared-memory segment {path} is gone (sender exited?)") from None
        except PermissionError as e:
            raise TransportError(f"cannot open {path}: {e} (sender and receiver must share host and user)") from e
        try:
            size = os.fstat(f).st_size
            if size < nbytes:
                raise TransportError(f"segment {path} holds {size} bytes, handle says {nbytes}")
            return mmap.mmap(f, nbytes, flags=MAP_FLAGS)
        finally:
            os.close(f)

    @contextmanager
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> Iterator[torch.Tensor]:
        """The chunk's segment (the whole segment: `nbytes`, the layout's size, is checked by the caller)."""
        h = update_info.get("handle")
        try:
            key = (int(h["pid"]), int(h["fd"]), str(h["token"]))  # type: ignore[index]
            size = int(h["nbytes"])  # type: ignore[index]
            if size <= 0 or key[0] <= 0 or key[1] < 0 or not key[2].isalnum():
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise ValidationError(f"shm handle must be {{pid, fd, token, nbytes}}, got {h!r:.200}") from None
        mm = self._maps.get(key)
        if mm is None or len(mm) < size:
            mm = self._maps[key] = self._map(key[0], key[1], key[2], size)
        self._used.add(key)
        yield torch.frombuffer(mm, dtype=torch.uint8, count=size)

    def end_round(self) -> None:
        """Keep mappings this round used (the sender's pool reuses them next round); drop the rest. Trainer
        storages this round did not reference are unmapped once their views are gone."""
        for key in [k for k in self._maps if k not in self._used]:
            close_map(self._maps.pop(key))
        self._used.clear()
        self.refs.end_round()

    def close(self) -> None:
        for mm in self._maps.values():
            close_map(mm)
        self._maps.clear()
        self.refs.clear()
