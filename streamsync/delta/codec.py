"""Delta encodings of one tensor against a base of the same dtype and shape, and the digest that checks them.

Rules. Values are absolute: a delta carries the new bits at each changed position, never an XOR or a difference,
so applying it twice, or onto a base that already holds some of its values, gives the same tensor. Changes are
found on integer views of the bits, never with float `==` (which calls -0.0 and +0.0 equal and NaN unequal to
itself). Per tensor the smallest of these is sent (sizes as packed: every piece starts on a 256-byte boundary):

    same    nothing changed                                      0 bytes
    idx16   blocked 16-bit positions: an int32 count per block   4 n/65536 + (2 + v) k
            of 65,536 elements, each changed element's position
            in its block (int16), then its value
    mask    one bit per element, then the changed values         n/8 + v k
    full    every element                                        v n

for n elements of v bytes of which k changed. idx16 beats mask below a density of 1/16, and mask beats full up
to 1 - 1/(8 v) (94 % for bf16), so a delta is never larger than the tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ValidationError
from ..pack import align_up, dtype_name
from .wsum import BLOCK, wsum64

ENCODINGS = ("same", "idx16", "mask", "full")
#: the packed pieces of each encoding, in wire order
PIECES: dict[str, tuple[str, ...]] = {"same": (), "idx16": ("counts", "pos", "val"), "mask": ("mask", "val"),
                                      "full": ("val",)}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaRefused(ValidationError):
    """A receiver refuses a delta: it does not hold the base the delta was computed against, or the tensor it
    made does not match the sender's digest. The message starts with "delta refused" (the marker a sender finds
    in an engine's error text, whatever process raised it); the sync then pushes every byte."""

    def __init__(self, why: str) -> None:
        super().__init__(f"delta refused: {why}")


MARKER = "delta refused"


def refused(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from, is a receiver's DeltaRefused."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if MARKER in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width (a view: compares bit patterns)."""
    try:
        return t.view(_INT[t.element_size()])
    except KeyError:
        raise ValidationError(f"no delta encoding for elements of {t.element_size()} bytes ({t.dtype})") from None


def sizes(n: int, k: int, v: int) -> dict[str, int]:
    """Packed bytes of each encoding for n elements of v bytes of which k changed."""
    return {"same": 0 if k == 0 else 1 << 62,
            "idx16": align_up(4 * -(-n // BLOCK)) + align_up(2 * k) + align_up(v * k),
            "mask": align_up(-(-n // 8)) + align_up(v * k),
            "full": align_up(v * n)}


@dataclass
class Encoded:
    """One tensor's delta: its encoding, how many elements changed, and the pieces to pack (flat tensors)."""

    enc: str
    changed: int
    pieces: list[torch.Tensor]
    #: the changed positions (int64), for the caller's own copy of the base (idx16 only)
    positions: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(align_up(p.numel() * p.element_size()) for p in self.pieces)


def encode(new: torch.Tensor, base: torch.Tensor) -> Encoded:
    """The smallest encoding of flat `new` against flat `base` (same dtype, numel and device)."""
    if new.dtype != base.dtype or new.numel() != base.numel() or new.dim() != 1 or base.dim() != 1:
        raise ValidationError(f"delta of {new.dtype}{tuple(new.shape)} against {base.dtype}{tuple(base.shape)}")
    changed = bits(new) != bits(base)
    k = int(torch.count_nonzero(changed))  # a bool tensor's .sum() is several times slower
    n = new.numel()
    cost = sizes(n, k, new.element_size())
    enc = min(ENCODINGS, key=lambda e: (cost[e], e != "full"))  # a tie goes to full: nothing to decode
    if enc == "same":
        return Encoded("same", 0, [])
    if enc == "full":
        return Encoded("full", k, [new])
    if enc == "mask":
        return Encoded("mask", k, [pack_bits(changed), _select(new, changed)])
    idx = positions(changed)
    counts = torch.bincount(idx >> 16, minlength=-(-n // BLOCK)).to(torch.int32)
    return Encoded("idx16", k, [counts, low16(idx), new[idx]], positions=idx)


def low16(idx: torch.Tensor) -> torch.Tensor:
    """Positions (int64) within their block of BLOCK elements, as int16's bits (0..65535)."""
    low = idx & 0xFFFF
    return (low - ((low >> 15) << 16)).to(torch.int16)


# On the host, numpy's bit packing, boolean selection and nonzero are C loops over the bytes, several times
# faster than the same through torch's elementwise ops on one thread (a delta push's host work is a pass or two
# over every byte of the model); a tensor elsewhere goes through torch.


def _select(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`t[mask]` (flat, same numel)."""
    if t.device.type == "cpu" and mask.device.type == "cpu":
        return torch.from_numpy(bits(t).numpy()[mask.numpy()]).view(t.dtype)
    return t[mask]


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The positions (int64) where a flat bool tensor is True, in order."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))
    return mask.nonzero().view(-1)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as bytes, element i in bit i % 8 of byte i // 8."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    n = mask.numel()
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, (-n) % 8)).view(-1, 8)
    return (m << torch.arange(8, dtype=torch.uint8, device=m.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(np.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()


def decode_into(flat: torch.Tensor, enc: str, changed: int, pieces: Mapping[str, torch.Tensor]) -> None:
    """Apply one tensor's delta onto `flat` (its base, patched in place). Refuses (ValidationError) pieces whose
    sizes, counts or positions do not fit the tensor, before it writes anything."""
    n = flat.numel()
    want = PIECES.get(enc)
    if want is None:
        raise ValidationError(f"unknown delta encoding {enc!r:.40}")
    if set(pieces) != set(want):
        raise ValidationError(f"delta {enc} needs pieces {list(want)}, got {sorted(pieces)}")
    if enc == "same":
        return
    val = pieces["val"].to(flat.device)
    if val.dtype != flat.dtype:
        raise ValidationError(f"delta values are {val.dtype}, the tensor {flat.dtype}")
    if enc == "full":
        if val.numel() != n:
            raise ValidationError(f"full delta of {val.numel()} elements for a tensor of {n}")
        flat.copy_(val)
        return
    if val.numel() != changed:
        raise ValidationError(f"delta says {changed} changed elements, carries {val.numel()} values")
    if enc == "mask":
        packed = pieces["mask"].to(flat.device)
        if packed.dtype != torch.uint8 or packed.numel() != -(-n // 8):
            raise ValidationError(f"delta mask of {packed.numel()} bytes for {n} elements")
        mask = unpack_bits(packed, n)
        marked = int(torch.count_nonzero(mask))
        if marked != changed:
            raise ValidationError(f"delta mask marks {marked} elements, says {changed}")
        bits(flat).masked_scatter_(mask, bits(val))  # on the bits: fp8 has no scatter of its own
        return
    counts, pos = pieces["counts"].to(flat.device), pieces["pos"].to(flat.device)
    blocks = -(-n // BLOCK)
    if counts.dtype != torch.int32 or counts.numel() != blocks or pos.dtype != torch.int16 or pos.numel() != changed:
        raise ValidationError(f"delta idx16 pieces do not fit {n} elements with {changed} changed")
    if not changed:
        return
    c = counts.to(torch.int64)
    low, total = (int(x) for x in torch.stack([c.min(), c.sum()]).tolist())  # one sync for both
    if low < 0 or total != changed:
        raise ValidationError(f"delta idx16 block counts sum to {total} (least {low}), says {changed}")
    idx = torch.repeat_interleave(torch.arange(blocks, dtype=torch.int64, device=flat.device) * BLOCK, c,
                                  output_size=changed) + (pos.to(torch.int64) & 0xFFFF)
    top = int(idx.max())  # a position past the end would be an asynchronous error on a GPU: checked first
    if top >= n:
        raise ValidationError(f"delta position {top} outside a tensor of {n} elements")
    bits(flat).index_copy_(0, idx, bits(val))


# ---------------------------------------------------------------------------------------------- digests

try:
    import blake3 as _b3  # vLLM brings it: ~4x faster than blake2b here

    _blake3: Any = _b3.blake3
except ImportError:  # pragma: no cover - hashlib's blake2b instead
    _blake3 = None

#: the digest computed on the host by default
HOST_DIGEST = "blake3" if _blake3 is not None else "blake2b"


def digest(t: torch.Tensor, algo: str | None = None) -> str:
    """"algo:hex" of a tensor's dtype, shape and bytes (host copy for a device tensor). blake3 where it is
    installed, else hashlib's blake2b; a receiver checks with the algorithm the digest names. "wsum64"
    (`delta.wsum`, what a chunked shadow digests with) is computed where the tensor lives and covers its bytes
    only: the receiver checks dtype and shape itself."""
    algo = algo or HOST_DIGEST
    h: Any
    if algo == "wsum64":
        return f"wsum64:{wsum64(t):016x}"
    if algo == "blake3":
        if _blake3 is None:
            raise DeltaRefused("the digest is blake3, which is not installed here")
        h = _blake3()
    elif algo == "blake2b":
        h = hashlib.blake2b(digest_size=16)
    else:
        raise DeltaRefused(f"unknown digest algorithm {algo!r:.20}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    h.update(f"{dtype_name(t.dtype)}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return f"{algo}:{h.hexdigest()}"


# ------------------------------------------------------------------------------------ sharded headers
# A sharded push's sender tells each worker how each of its pieces is encoded in a header of HEADER int64 per
# piece, sent ahead of the pieces: [encoding, changed, elements, element size, digest algorithm, digest as
# 4 x 8 bytes].

HEADER = 9
_ALGOS = ("", "blake3", "blake2b", "wsum64")


def pack_header(rows: list[tuple[str, int, int, int, str]]) -> torch.Tensor:
    """(encoding, changed, elements, element size, digest or "") per piece, as the int64 header a worker
    receives."""
    out = torch.zeros(len(rows), HEADER, dtype=torch.int64)
    for i, (enc, changed, n, size, dig) in enumerate(rows):
        algo, _, hexed = dig.partition(":")
        raw = bytes.fromhex(hexed).ljust(32, b"\0")
        out[i, :5] = torch.tensor([ENCODINGS.index(enc), changed, n, size, _ALGOS.index(algo)])
        out[i, 5:] = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    return out.view(-1)


@dataclass(frozen=True)
class Row:
    """One piece's line of a received header."""

    enc: str
    changed: int
    numel: int
    itemsize: int
    digest: str  # "" unchecked

    def pieces(self) -> list[tuple[str, torch.dtype, int]]:
        """(piece, dtype, elements) of each packed piece, in wire order (`encode`'s pieces); values as integers
        of the element's width (the receiver views them as its dtype)."""
        n, k = self.numel, self.changed
        sizes_ = {"counts": (torch.int32, -(-n // BLOCK)), "pos": (torch.int16, k),
                  "mask": (torch.uint8, -(-n // 8)), "val": (_INT[self.itemsize], n if self.enc == "full" else k)}
        return [(p, *sizes_[p]) for p in PIECES[self.enc]]


def parse_header(header: torch.Tensor, numels: list[int]) -> list[Row]:
    """A received header, checked against the elements of the pieces the plan says it describes. Refuses
    (ValidationError) a header that does not fit them."""
    h = header.view(torch.int64).view(-1, HEADER).tolist()
    if len(h) != len(numels):
        raise ValidationError(f"delta header of {len(h)} pieces for {len(numels)}")
    out = []
    for (enc, changed, n, size, algo, *dig), want in zip(h, numels, strict=True):
        if (not (0 <= enc < len(ENCODINGS) and 0 <= algo < len(_ALGOS)) or n != want or not 0 <= changed <= n
                or size not in _INT or (ENCODINGS[enc] == "same") != (changed == 0)):
            raise ValidationError(f"malformed delta header row {[enc, changed, n, size, algo]} for a piece of "
                                  f"{want} elements")
        raw = torch.tensor(dig, dtype=torch.int64).numpy().tobytes()
        width = {"blake3": 32, "blake2b": 16, "wsum64": 8}.get(_ALGOS[algo], 0)
        out.append(Row(ENCODINGS[enc], changed, n, size, f"{_ALGOS[algo]}:{raw[:width].hex()}" if algo else ""))
    return out


def check_digest(t: torch.Tensor, want: str, name: str) -> None:
    """Raise DeltaRefused unless `t` has digest `want`."""
    algo = want.split(":", 1)[0] if isinstance(want, str) else ""
    if digest(t, algo) != want:
        raise DeltaRefused(f"tensor {name!r} made from the delta does not match the sender's digest (the base "
                           "held here differs from the sender's)")
