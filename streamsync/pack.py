"""Packed chunk layout: one contiguous uint8 buffer plus a table of (name, dtype, shape, offset).

Every transport moves this one format. Offsets are aligned (256 bytes by default) so that each tensor's
view has the alignment any dtype or CUDA copy kernel wants. The metadata is plain JSON-able data: it
travels over HTTP and sockets and is validated on the receiving side, never unpickled.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from .errors import ValidationError

ALIGN = 256

# Every dtype a model checkpoint uses; names are stable strings so metadata is plain data.
_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
              "uint16", "uint32", "uint64", "complex64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValidationError(f"dtype {dtype} is not supported by the packed format") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValidationError(f"unknown dtype name {name!r} in chunk metadata") from None


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a tensor will be once converted: its HF name, dtype and shape. Known before bytes move.

    `part`: this spec is rows [row0, row0 + shape[0]) of a tensor of `rows` rows (`part = (row0, rows)`),
    for tensors larger than a chunk, split across consecutive chunks; receivers reassemble them."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    part: tuple[int, int] | None = None

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (the shape itself unless this is a part)."""
        return self.shape if self.part is None else (self.part[1], *self.shape[1:])

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Where one tensor (or one part of a split tensor: `part = (row0, rows)`, see TensorSpec) sits in a
    packed buffer. JSON: [name, dtype, shape, offset, nbytes] plus [row0, rows] for a part."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    part: tuple[int, int] | None = None

    def to_json(self) -> list:
        out = [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]
        return out if self.part is None else [*out, list(self.part)]

    @classmethod
    def from_json(cls, obj: Sequence) -> TensorMeta:
        try:
            if len(obj) not in (5, 6):
                raise ValueError(f"{len(obj)} fields")
            name, dtype, shape, offset, nbytes = obj[:5]
            part = None
            if len(obj) == 6:
                row0, rows = obj[5]
                part = (int(row0), int(rows))
            meta = cls(str(name), str(dtype), tuple(int(d) for d in shape), int(offset), int(nbytes), part)
        except (TypeError, ValueError) as e:
            raise ValidationError(f"malformed tensor metadata {obj!r:.200}: {e}") from None
        dtype_from_name(meta.dtype)
        if any(d < 0 for d in meta.shape) or meta.nbytes < 0 or meta.offset < 0:
            raise ValidationError(f"tensor {meta.name!r}: negative shape, size or offset in chunk metadata")
        if part is not None and (not meta.shape or part[0] < 0 or part[0] + meta.shape[0] > part[1]):
            raise ValidationError(f"tensor {meta.name!r}: part {list(part)} of shape {list(meta.shape)} does not "
                                  "lie inside the whole tensor's rows")
        return meta


@dataclass(frozen=True, slots=True)
class Layout:
    """The full packed layout of one chunk: tensor table and total size."""

    metas: tuple[TensorMeta, ...]
    nbytes: int
    _hash: int = field(default=0, init=False, compare=False, repr=False)

    def __reduce__(self) -> tuple:  # the cached hash must not travel: it depends on the process's hash seed
        return (Layout, (self.metas, self.nbytes))

    def __hash__(self) -> int:  # layouts key per-buffer view caches: hash hundreds of metas once, not per chunk
        h = self._hash
        if not h:
            h = hash((self.metas, self.nbytes)) or 1
            object.__setattr__(self, "_hash", h)
        return h

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes, "tensors": [m.to_json() for m in self.metas]}

    @classmethod
    def from_json(cls, obj: dict) -> Layout:
        if not isinstance(obj, dict) or "tensors" not in obj or "nbytes" not in obj:
            raise ValidationError(f"malformed chunk layout: expected {{'nbytes', 'tensors'}}, got {obj!r:.200}")
        layout = cls(tuple(TensorMeta.from_json(t) for t in obj["tensors"]), int(obj["nbytes"]))
        layout.check()
        return layout

    def check(self) -> None:
        """Every tensor lies inside the buffer, aligned, with a byte count matching dtype and shape."""
        for m in self.metas:
            expect = TensorSpec(m.name, dtype_from_name(m.dtype), m.shape).nbytes
            if m.nbytes != expect:
                raise ValidationError(f"tensor {m.name!r}: {m.nbytes} bytes declared, {expect} expected")
            if m.offset < 0 or m.offset + m.nbytes > self.nbytes:
                raise ValidationError(f"tensor {m.name!r} lies outside the {self.nbytes}-byte buffer")
            elem = dtype_from_name(m.dtype).itemsize
            if m.offset % max(elem, 1):
                raise ValidationError(f"tensor {m.name!r} offset {m.offset} misaligned for {m.dtype}")


def plan_layout(specs: Iterable[TensorSpec], align: int = ALIGN) -> Layout:
    """Assign aligned offsets to tensors in the given order."""
    metas = []
    offset = 0
    for s in specs:
        metas.append(TensorMeta(s.name, dtype_name(s.dtype), tuple(s.shape), offset, s.nbytes, s.part))
        offset = align_up(offset + s.nbytes, align)
    return Layout(tuple(metas), max(offset, align))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (bit-exact for every dtype, fp8 and bool included)."""
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).reshape(-1)


def pack_into(buffer: torch.Tensor, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
    """Copy tensors into `buffer` (uint8, at least layout.nbytes) at the layout's offsets.

    Non-contiguous tensors are copied through their strides directly into place: no staging copy. A
    floating tensor of another floating dtype than the layout's is cast by the copy (rounding as `.to`).
    Runs on the buffer's device; for CUDA buffers the copies are queued on the current stream.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValidationError("pack buffer must be a flat uint8 tensor")
    if buffer.numel() < layout.nbytes:
        raise ValidationError(f"pack buffer holds {buffer.numel()} bytes, layout needs {layout.nbytes}")
    if len(tensors) != len(layout.metas):
        raise ValidationError(f"{len(tensors)} tensors for a layout of {len(layout.metas)}")
    for meta, t in zip(layout.metas, tensors, strict=True):
        dtype = dtype_from_name(meta.dtype)
        if not castable(t.dtype, dtype) or (tuple(t.shape) != meta.shape and not fits(t, meta.shape)):
            raise ValidationError(
                f"tensor {meta.name!r} is {t.dtype}{tuple(t.shape)}, layout expects {meta.dtype}{meta.shape}"
            )
        dst = buffer[meta.offset : meta.offset + meta.nbytes]
        if t.dtype == dtype and t.is_contiguous():
            dst.copy_(byte_view(t), non_blocking=True)
        else:
            # Strided source (or a cast): view the destination bytes as the tensor, copy_ walks the strides.
            dst.view(dtype).view(t.shape).copy_(t, non_blocking=True)


def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """What pack accepts for a slot of `dst`: the same dtype, or floating to floating (cast while copying)."""
    return src == dst or (src.is_floating_point and dst.is_floating_point)


def fits(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """A converted tensor may come in a *blocked* shape: the same trailing dims, leading dims that multiply
    to the HF tensor's first (e.g. q as a (groups, rows per group, hidden) view of a fused QKV). Its
    row-major order is the HF tensor's, so packing writes the HF tensor without a reshape copy."""
    n = 1
    for d in shape:
        n *= d
    tail = shape[1:]
    return t.numel() == n and tuple(t.shape[t.dim() - len(tail):]) == tail


def unpack(buffer: torch.Tensor, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) views into `buffer`. No copy: the views alias the buffer."""
    for meta in layout.metas:
        raw = buffer[meta.offset : meta.offset + meta.nbytes]
        dtype = dtype_from_name(meta.dtype)
        yield meta.name, raw.view(dtype).view(meta.shape)


# Tensors below this size are copied in one batched call (`torch._foreach_copy_`): per-tensor launch and
# Python costs dominate for them (MoE experts, norms); larger ones get their own copy at full bandwidth.
# Only common float dtypes are batched (every backend's foreach kernels cover them); the rest copy one by one.
BATCH_BELOW = 16 << 20
BATCH_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


def coalesce(dsts: Sequence[torch.Tensor],
             srcs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The copies dst[i] <- src[i], with every run of pairs that continue each other on both sides (same
    storages, contiguous, same dtype) merged into one flat pair: fewer, larger copies. An MoE expert's gate and up
    projections are one block of the trainer's fc1 and one block of the engine's w13. Costs a few microseconds
    per pair: for copies captured once and replayed."""
    out_d: list[torch.Tensor] = []
    out_s: list[torch.Tensor] = []
    run: list[Any] | None = None  # [first dst, first src, elements, dst end address, src end address, members]

    def close() -> None:
        if run is None:
            return
        d0, s0, n = run[0], run[1], run[2]
        if run[5] == 1:
            out_d.append(d0)
            out_s.append(s0)
            return
        out_d.append(torch.empty(0, dtype=d0.dtype, device=d0.device).set_(
            d0.untyped_storage(), d0.storage_offset(), (n,), (1,)))
        out_s.append(torch.empty(0, dtype=s0.dtype, device=s0.device).set_(
            s0.untyped_storage(), s0.storage_offset(), (n,), (1,)))

    for d, s in zip(dsts, srcs, strict=True):
        flat = d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous()
        n = d.numel()
        if (run is not None and flat and run[6] and d.dtype == run[0].dtype and d.device == run[0].device
                and s.device == run[1].device and d.data_ptr() == run[3] and s.data_ptr() == run[4]
                and d.untyped_storage().data_ptr() == run[0].untyped_storage().data_ptr()
                and s.untyped_storage().data_ptr() == run[1].untyped_storage().data_ptr()):
            run[2] += n
            run[3] += n * d.element_size()
            run[4] += n * d.element_size()
            run[5] += 1
            continue
        close()
        run = [d, s, n, d.data_ptr() + n * d.element_size(), s.data_ptr() + n * s.element_size(), 1, flat]
    close()
    return out_d, out_s


def batched(t: torch.Tensor) -> bool:
    """Whether `t` goes into the batched copy (small, common float dtype)."""
    return t.dtype in BATCH_DTYPES and t.numel() * t.element_size() < BATCH_BELOW


# ------------------------------------------------------------------------------------ engine layouts


@dataclass(frozen=True, slots=True)
class Fusion:
    """A tensor an engine holds as one (vLLM's `qkv_proj`, `gate_up_proj`, FusedMoE's stacked `w13_weight`
    [E, 2I, H] and `w2_weight` [E, H, I]) whose bytes are its HF members laid end to end, in this order."""

    name: str
    members: tuple[str, ...]
    shape: tuple[int, ...]


def fusions_from_json(obj: object) -> dict[str, Fusion]:
    """An engine's fusions, sent as {fused name: [[member, ...], shape]}, keyed by their first member."""
    if not isinstance(obj, dict):
        raise ValidationError(f"fused layout must be a dict, got {type(obj).__name__}")
    out: dict[str, Fusion] = {}
    for name, v in obj.items():
        try:
            members, shape = v
            f = Fusion(str(name), tuple(str(m) for m in members), tuple(int(d) for d in shape))
        except (TypeError, ValueError) as e:
            raise ValidationError(f"fused tensor {name!r:.80}: malformed entry {v!r:.120}: {e}") from None
        if not f.members or any(d < 0 for d in f.shape):
            raise ValidationError(f"fused tensor {name!r:.80} has no members or a negative shape")
        out[f.members[0]] = f
    return out


def fuse_layout(layout: Layout, fusions: dict[str, Fusion]) -> Layout | None:
    """`layout` with every run of metas that is exactly a fusion's members, in order, of one dtype, whole (no
    parts) and end to end in the buffer, replaced by one meta of the fused tensor: the engine receives a layer
    as a few large tensors instead of hundreds. None when nothing fuses (the layout goes as it is)."""
    metas = layout.metas
    out: list[TensorMeta] = []
    i = fused = 0
    while i < len(metas):
        m = metas[i]
        f = fusions.get(m.name)
        k = len(f.members) if f is not None else 0
        run = metas[i:i + k]
        if (f is not None and len(run) == k and all(r.name == n for r, n in zip(run, f.members, strict=True))
                and all(r.part is None and r.dtype == m.dtype for r in run)
                and all(a.offset + a.nbytes == b.offset for a, b in pairwise(run))):
            nbytes = sum(r.nbytes for r in run)
            if TensorSpec(f.name, dtype_from_name(m.dtype), f.shape).nbytes == nbytes:
                out.append(TensorMeta(f.name, m.dtype, f.shape, m.offset, nbytes))
                i += k
                fused += 1
                continue
        out.append(m)
        i += 1
    return Layout(tuple(out), layout.nbytes) if fused else None
