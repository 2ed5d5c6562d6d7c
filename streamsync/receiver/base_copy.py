"""`BaseCopy`: the tensors a receiver last loaded, kept as the base that delta chunks apply onto.

A sender that pushes deltas marks every chunk of a push (the message's `delta` field, docs/delta.md):

    {"chunks": n, "keep": true, "bytes": b,          a full push: keep a copy of every tensor loaded (b bytes
     "engine_base": "auto" | "host"}                  in all; where, below)
    {"chunks": n, "base": [version, push id],         a delta: per HF tensor its encoding and pieces, applied
     "entries": [[name, dtype, shape, part, enc,      onto the copy, then handed to the loader whole
                  changed, digest], ...]}

Rules. A delta applies only onto the exact push it was computed against: `held`, the (version, push id) of the
last round that carried every chunk of its push, must equal the delta's `base`, or the chunk is refused
(`DeltaRefused`) before anything of it is applied. A round that changed the copy and did not carry its whole
push (a failed or cancelled one) leaves no base, so the next delta is refused and the sender pushes in full.
Each tensor made from a delta is checked against the sender's digest of it before the loader sees it. A push
without the field (its sender pushes no deltas) drops the copy and its memory.

The loader gets whole HF tensors either way, as from a full push: the copy's own tensors (valid until the
next round changes them).

In place. Where the loader holds a tensor exactly as it is sent (`Loader.direct`: the same dtype and row-major
bytes in one contiguous tensor of its own, which only loads of that name change; a vLLM worker's unquantized
tensors on the fast path where the engine holds them whole, a plain module's parameters), the loader's tensor is
the base: a full push keeps no copy of it, only its digest (`wsum64` on a GPU, blake3 on the host); a delta is
decoded straight into it, after that digest was found unchanged (a reload from disk, or a wake from sleep that
dropped the weights, refuses the delta before any byte of the chunk is written), and checked against the sender's
digest after. Such tensors are not handed to the loader again: they are where it would copy them.

Where the copy lives. A receiver on a GPU (a vLLM worker) keeps it on that GPU where the GPU has room for it and
2 GiB (or 5 % of the GPU) more when a full push starts ("engine_base": "auto", the default), so a delta is decoded
and checked there and the loader copies device to device; otherwise, and always with "engine_base": "host" (which
a sender beside its engines sends), in host memory. `where` says which.

A sharded push (transport "p2p", `"sharded": true` in the field) keeps each box of an HF tensor this worker
receives (`keep_box`, `patch_box`): the worker's slice of the model, not the whole of it; its pieces' entries
come in each sending rank's header (`delta.codec.parse_header`), not in the message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..delta.codec import HOST_DIGEST, PIECES, DeltaRefused, Row, check_digest, decode_into, digest
from ..errors import ValidationError
from ..pack import dtype_from_name
from ..plan.shards import Box

Entry = tuple[str, torch.dtype, tuple[int, ...], tuple[int, int] | None, str, int, str]
#: the loader's own tensor that holds a name exactly as sent, or None (`Loader.direct`)
Direct = Callable[[str], "torch.Tensor | None"]


def parse_delta(update_info: Mapping[str, Any]) -> dict[str, Any] | None:
    """An update's `delta` field, checked (None: a push without deltas)."""
    d = update_info.get("delta")
    if d is None:
        return None
    if not isinstance(d, dict) or type(d.get("chunks")) is not int or d["chunks"] < 1:
        raise ValidationError(f"malformed delta field {d!r:.200}: needs 'chunks' >= 1")
    if d.get("keep") is True:
        return d
    base = d.get("base")
    if not (isinstance(base, list) and len(base) == 2 and type(base[0]) is int and isinstance(base[1], str)):
        raise ValidationError(f"malformed delta base {base!r:.80}: needs [version, push id]")
    if d.get("sharded") is not True and not isinstance(d.get("entries"), list):
        raise ValidationError("malformed delta field: no 'entries' list")
    return d


def _entry(raw: object) -> Entry:
    try:
        f: Any = list(raw)  # type: ignore[call-overload]
        if len(f) != 7:
            raise ValueError(f"{len(f)} fields")
        part = f[3]
        out: Entry = (str(f[0]), dtype_from_name(str(f[1])), tuple(int(x) for x in f[2]),
                      None if part is None else (int(part[0]), int(part[1])), str(f[4]), int(f[5]), str(f[6]))
    except (TypeError, ValueError) as e:
        raise ValidationError(f"malformed delta entry {raw!r:.200}: {e}") from None
    if out[4] not in PIECES or out[5] < 0:
        raise ValidationError(f"delta entry {out[0]!r}: unknown encoding {out[4]!r:.20} or negative count")
    return out


#: free GPU memory a receiver leaves beside its copy: 2 GiB, or 5 % of the GPU where that is more
MARGIN = 2 << 30


class BaseCopy:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)  # the receiver's
        #: where the copy lives (the receiver's GPU or the host)
        self.on = torch.device("cpu")
        self.tensors: dict[str, torch.Tensor] = {}
        #: (version, push id) of the push the copy holds whole; None: no base
        self.held: tuple[int, str] | None = None
        self._round: tuple[int, str] | None = None
        self._chunks: int | None = None
        self._seen: set[int] = set()
        self._touched = False
        self._plain = False
        self._rows: dict[str, int] = {}  # rows of a split tensor patched so far this round
        #: a sharded push's boxes by (HF name, box)
        self.boxes: dict[tuple[str, Box], torch.Tensor] = {}
        self._kept: set[tuple[str, Box]] = set()  # boxes a full sharded push wrote this round
        #: names whose base is the loader's own tensor (in place): the digest of what it holds (`_fingerprint`), its
        #: bytes
        self.own: dict[str, tuple[str, int]] = {}
        #: (name, tensor) decoded in place by this chunk: loaded already, not handed to the loader
        self.placed: list[tuple[str, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        """Bytes of the copy (tensors kept in place take none)."""
        return sum(t.numel() * t.element_size() for t in (*self.tensors.values(), *self.boxes.values()))

    @property
    def in_place_bytes(self) -> int:
        """Bytes of the tensors whose base is the loader's own (no copy)."""
        return sum(n for _, n in self.own.values())

    @property
    def where(self) -> str:
        return "host" if self.on.type == "cpu" else str(self.on)

    def _place(self, delta: Mapping[str, Any]) -> None:
        """A full push of a delta sender starts: where its copy goes (see the module doc)."""
        need = delta.get("bytes")
        on = torch.device("cpu")
        if self.device.type == "cuda" and delta.get("engine_base", "auto") == "auto" and type(need) is int:
            held = self.nbytes if self.on == self.device else 0  # freed as the push replaces it
            free, total = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)  # cached
            if need + max(MARGIN, total // 20) <= free + held:
                on = self.device
        if on != self.on:
            self.tensors, self.boxes, self.held = {}, {}, None
            self.on = on

    def begin_round(self) -> None:
        self.placed = []
        self._round, self._chunks, self._seen = None, None, set()
        self._touched = self._plain = False
        self._rows = {}
        self._kept = set()

    def keep_box(self, name: str, box: Box, t: torch.Tensor) -> None:
        """A full sharded push: keep a copy of `box` of `name` as received (`t`, of the box's shape)."""
        self._touched = True
        key = (name, box)
        have = self.boxes.get(key)
        if have is None or have.dtype != t.dtype or have.shape != t.shape:
            have = self.boxes[key] = torch.empty(t.shape, dtype=t.dtype, device=self.on)
        have.copy_(t)
        self._kept.add(key)

    def check_box(self, name: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        """The kept `box` of `name`, refused (DeltaRefused) where none of that dtype is held."""
        have = self.boxes.get((name, box))
        if have is None or have.dtype != dtype or tuple(have.shape) != box.size:
            raise DeltaRefused(f"tensor {name!r}: no base of its box {box} ({dtype}) held here")
        return have

    def patch_box(self, name: str, box: Box, have: torch.Tensor, row: Row, pieces: Mapping[str, torch.Tensor],
                  *, verify: bool = True) -> torch.Tensor:
        """Apply one piece's delta onto its kept box `have` (from `check_box`); the box, checked against the
        sender's digest."""
        self._touched = True
        decode_into(have.view(-1), row.enc, row.changed, pieces)
        if verify and row.digest:
            check_digest(have, row.digest, f"{name}{list(box.start)}")
        return have

    def note(self, update_info: Mapping[str, Any], delta: dict[str, Any] | None) -> None:
        """A chunk of this round arrived (before it is applied); a delta chunk must name the base held here."""
        self.placed = []
        if delta is None:
            self._plain = True
            return
        push = (update_info.get("version"), update_info.get("push_id"))
        if type(push[0]) is not int or not isinstance(push[1], str):
            raise ValidationError("a delta-marked update needs an int version and a push_id")
        if self._round is not None and push != self._round:
            raise ValidationError(f"chunk of push {push[1]} in a round of push {self._round[1]}")
        if "base" in delta:
            base = (delta["base"][0], delta["base"][1])
            if base != self.held:
                have = "no base" if self.held is None else f"version {self.held[0]} (push {self.held[1]})"
                raise DeltaRefused(f"the delta applies onto version {base[0]} (push {base[1]}), this receiver "
                                   f"holds {have}")
        if delta.get("keep") is True and self._round is None:
            self._place(delta)
        self._round = (int(push[0]), str(push[1]))
        self._chunks = delta["chunks"]
        chunk = update_info.get("chunk")
        if type(chunk) is int:
            self._seen.add(chunk)

    def tee(self, weights: Iterable[tuple[str, torch.Tensor]], direct: Direct | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` (whole tensors of a full push), each copied into the base on its way to the loader, or,
        where the loader holds it in place (`direct`), its digest kept."""
        self._touched = True
        for name, t in weights:
            d = direct(name) if direct is not None else None
            if d is not None and _holds(d, t.dtype, tuple(t.shape)):
                self.tensors.pop(name, None)
                self.own[name] = (_fingerprint(t), t.numel() * t.element_size())  # what the loader holds then
                yield name, t
                continue
            self.own.pop(name, None)
            have = self.tensors.get(name)
            if have is None or have.dtype != t.dtype or have.shape != t.shape:
                have = self.tensors[name] = torch.empty(t.shape, dtype=t.dtype, device=self.on)
            have.copy_(t)
            yield name, t

    def apply(self, views: Iterable[tuple[str, torch.Tensor]], delta: dict[str, Any], *,
              verify: bool = True, direct: Direct | None = None) -> list[tuple[str, torch.Tensor]]:
        """Apply a delta chunk onto the copy, or in place where the loader's own tensor is the base (`direct`);
        the whole tensors it completes in the copy, for the loader (those made in place are in `placed`). Every
        entry and piece is checked, and every base in place found unchanged, before anything is written; each
        tensor's digest after it was patched."""
        it = iter(views)
        plan: list[tuple[Entry, dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]] = []
        for raw in delta["entries"]:
            e = _entry(raw)
            name, dtype, shape, part, enc = e[:5]
            pieces: dict[str, torch.Tensor] = {}
            for piece in PIECES[enc]:
                got = next(it, None)
                if got is None or got[0] != f"{name}#{piece}":
                    raise ValidationError(f"delta entry {name!r}: piece {piece!r} missing from the chunk")
                pieces[piece] = got[1].reshape(-1)
            full = shape if part is None else (part[1], *shape[1:])
            base = self.tensors.get(name)
            own = self._in_place(name, dtype, full, direct) if base is None else None
            base = own if own is not None else base
            if base is None or base.dtype != dtype or tuple(base.shape) != full:
                raise DeltaRefused(f"tensor {name!r}: no base of {dtype}{full} held here")
            if part is not None and (not shape or part[0] + shape[0] > part[1]):
                raise ValidationError(f"delta entry {name!r}: part {list(part)} outside the tensor")
            rows = base if part is None else base[part[0]:part[0] + shape[0]]
            plan.append((e, pieces, rows, own))
        if next(it, None) is not None:
            raise ValidationError("delta chunk carries pieces no entry names")
        out: list[tuple[str, torch.Tensor]] = []
        self._touched = True
        for (name, _, shape, part, enc, changed, dig), pieces, rows, own in plan:
            decode_into(rows.view(-1), enc, changed, pieces)
            if verify and dig:
                check_digest(rows.view(shape), dig, name)
            done = part is None
            if not done:
                rows_done = self._rows[name] = self._rows.get(name, 0) + shape[0]
                done = rows_done == part[1]  # type: ignore[index]
            if own is None:
                if done:
                    out.append((name, self.tensors[name]))
                continue
            if enc != "same":  # its fingerprint now: the sender's wsum64 where that checked the whole of it
                reuse = part is None and dig.startswith("wsum64:") and _algo(own) == "wsum64"
                now = dig if reuse else _fingerprint(own)
                self.own[name] = (now, own.numel() * own.element_size())
            if done:
                self.placed.append((name, own))
        return out

    def _in_place(self, name: str, dtype: torch.dtype, full: tuple[int, ...], direct: Direct | None
                  ) -> torch.Tensor | None:
        """The loader's own tensor of `name` in its HF shape, where it is the base (`own`); refused
        (DeltaRefused) where it no longer holds what it was last loaded with."""
        want = self.own.get(name, ("", 0))[0]
        d = direct(name) if direct is not None and want else None
        if d is None or not _holds(d, dtype, full):
            return None
        d = d.view(full)
        if self._rows.get(name, 0) == 0 and digest(d.view(-1), want.split(":", 1)[0]) != want:  # first part/whole
            raise DeltaRefused(f"tensor {name!r}: the engine's own copy is not what it was last loaded with (a "
                               "reload or a wake from sleep changed it), so the delta has no base there")
        return d

    def end_round(self, finished: bool) -> None:
        """The round ended (`finished`: not an abort). The copy holds the round's push only if every chunk of it
        arrived; a round that changed the copy otherwise leaves no base; one without deltas drops the copy."""
        if self._plain:
            self.tensors, self.boxes, self.held, self.own = {}, {}, None, {}
        elif finished and self._round is not None and self._chunks is not None and len(self._seen) == self._chunks:
            self.held = self._round
            if self._kept:  # a full sharded push: boxes of an older plan are no longer sent
                self.boxes = {k: v for k, v in self.boxes.items() if k in self._kept}
        elif self._touched:
            self.held = None
        self.begin_round()


def aliased(tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """Names whose tensor shares bytes with another's (tied weights): a delta decoded into one would change the
    other behind its digest, so neither is held in place."""
    spans = sorted((str(t.device), t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size(),
                    t.numel() * t.element_size(), name) for name, t in tensors.items() if t.numel())
    out: set[str] = set()
    end: int = -1
    last, dev = "", ""
    for device, start, n, name in spans:  # by device, then address: one device's overlaps are neighbours
        if device == dev and start < end:
            out.update((name, last))
        if device != dev or start + n > end:
            end, last, dev = start + n, name, device
    return out


def _algo(t: torch.Tensor) -> str:
    """The digest an in-place tensor is fingerprinted with: `wsum64` where it lives on a device (read there, one
    kernel), the host's hash on the host (blake3 reads 5-6 GB/s there, torch's wsum64 about 0.4)."""
    return "wsum64" if t.device.type != "cpu" else HOST_DIGEST


def _fingerprint(t: torch.Tensor) -> str:
    """Of its elements in row-major order, whatever its shape (a blocked view and its HF tensor agree)."""
    return digest(t.reshape(-1), _algo(t))


def _holds(d: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether the loader's tensor `d` can hold a tensor of `dtype` and `shape` as its own row-major bytes."""
    return d.dtype == dtype and d.is_contiguous() and d.numel() == math.prod(shape)
