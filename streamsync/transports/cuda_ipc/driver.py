"""CUDA IPC of whole trainer storages through the CUDA driver, without PyTorch's per-share bookkeeping.

PyTorch's `reduce_tensor` / `rebuild_cuda_tensor` share a storage with an interprocess event and a slot in a
reference-counter file per share, so that a block freed by its producer waits in limbo until every consumer let
go. A one-copy push shares hundreds of long-lived trainer storages once each and keeps them alive itself (the
sender holds each exported storage until the export is dropped, `RefSender`), so it needs none of that: here an
export is `cuIpcGetMemHandle` of the storage's allocation and its offset in it, and a map is
`cuIpcOpenMemHandle` (one per allocation, shared by the storages in it) wrapped as a tensor through
`__cuda_array_interface__`. The receiver checks an export's bounds against the allocation it mapped, not
against what the sender says. Measured on one H200 (8B shape, 146 storages): see docs/benchmarks/README.md.

Where the driver cannot be loaded or refuses (memory from an allocator without IPC support), callers fall back
to PyTorch's sharing.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import TransportError, ValidationError

_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * _HANDLE_BYTES)]


@functools.cache
def _driver() -> Any:
    """libcuda with the five entry points used here, their argument types declared; None where absent."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    ptr, size = ctypes.c_uint64, ctypes.c_size_t
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ptr]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ptr), _IpcHandle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ptr]
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ptr), ctypes.POINTER(size), ptr]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ptr]
    for f in (lib.cuIpcGetMemHandle, lib.cuIpcOpenMemHandle_v2, lib.cuIpcCloseMemHandle,
              lib.cuMemGetAddressRange_v2, lib.cuGetErrorName, lib.cuPointerGetAttribute):
        f.restype = ctypes.c_int
    return lib


def available() -> bool:
    return torch.cuda.is_available() and _driver() is not None


def _check(code: int, what: str) -> None:
    if code != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(code, ctypes.byref(name))
        raise TransportError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({code})")


def _range(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation holding device address `ptr`."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    return base.value, size.value


_BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_BUFFER_ID: unique per allocation within the process


def buffer_id(ptr: int) -> int:
    """The driver's id of the allocation holding `ptr`: a new allocation at a reused address gets a new one."""
    out = ctypes.c_uint64()
    _check(_driver().cuPointerGetAttribute(ctypes.byref(out), _BUFFER_ID, ptr), "cuPointerGetAttribute")
    return out.value


@dataclass
class Held:
    """What the sender holds while a driver export lives: the storage (so its memory stays allocated) and the
    id of the allocation the export names."""

    storage: torch.UntypedStorage
    buffer: int


def export_storage(t: torch.Tensor, gpu: str) -> tuple[dict[str, Any], Held]:
    """The export data of the storage `t` lies on (plain data), and what the caller holds for as long as the
    export lives (the memory must not go back to the allocator while a receiver may map it)."""
    if _driver() is None:
        raise TransportError("libcuda.so.1 is not loadable here")
    st = t.untyped_storage()
    ptr = st.data_ptr()
    with torch.cuda.device(t.device):
        base, alloc = _range(ptr)
        handle = _IpcHandle()
        _check(_driver().cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        held = Held(st, buffer_id(ptr))
    return {"driver": 1, "gpu": gpu, "handle": base64.b64encode(bytes(handle)).decode(), "offset": ptr - base,
            "size": st.nbytes(), "alloc": alloc}, held


class _Allocation:
    """One opened allocation of another process; closed when the last tensor over it goes."""

    def __init__(self, key: bytes, ptr: int, size: int, device: int) -> None:
        self.key, self.ptr, self.size, self.device = key, ptr, size, device

    def __del__(self) -> None:
        try:
            # Copies queued out of this memory finish first (the receiver synchronizes before it lets a mapping
            # go; this is for a tensor that outlived it, e.g. a cached view).
            torch.cuda.current_stream(self.device).synchronize()
            _driver().cuIpcCloseMemHandle(self.ptr)
        except Exception:  # interpreter shutdown: the process exit unmaps anyway
            pass


class _Span:
    """A byte range of an opened allocation, as `__cuda_array_interface__` for `torch.as_tensor`; the tensor
    keeps this object (and so the allocation) alive."""

    def __init__(self, alloc: _Allocation, offset: int, size: int) -> None:
        self.alloc = alloc
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (alloc.ptr + offset, False),
                                         "strides": None, "version": 3}


_open: weakref.WeakValueDictionary[bytes, _Allocation] = weakref.WeakValueDictionary()  # handle -> open allocation
_lock = threading.Lock()


def map_storage(raw: dict[str, Any], device: int, token: str) -> torch.Tensor:
    """A flat uint8 tensor over the storage an export names, after checking it lies inside the allocation this
    process mapped. An allocation already open here is shared (the driver maps each once per process)."""
    handle = raw.get("handle")
    offset, size = raw.get("offset"), raw.get("size")
    if not isinstance(handle, str) or type(offset) is not int or type(size) is not int or offset < 0 or size <= 0:
        raise ValidationError(f"cuda_ipc storage {token}: malformed driver export {str(raw)[:200]}")
    try:
        key = base64.b64decode(handle, validate=True)
    except ValueError:
        raise ValidationError(f"cuda_ipc storage {token}: handle is not base64") from None
    if len(key) != _HANDLE_BYTES:
        raise ValidationError(f"cuda_ipc storage {token}: handle of {len(key)} bytes, expected {_HANDLE_BYTES}")
    if _driver() is None:
        raise TransportError("libcuda.so.1 is not loadable here")
    with _lock, torch.cuda.device(device):
        alloc = _open.get(key)
        if alloc is None:
            ptr = ctypes.c_uint64()
            h = _IpcHandle.from_buffer_copy(key)  # all 64 bytes (the field's own getter stops at a NUL)
            _check(_driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS),
                   f"cuIpcOpenMemHandle of storage {token}")
            base, mapped = _range(ptr.value)
            alloc = _Allocation(key, ptr.value, mapped - (ptr.value - base), device)
            _open[key] = alloc
        if offset + size > alloc.size:
            raise ValidationError(f"cuda_ipc storage {token} [{offset}, +{size}) exceeds the {alloc.size}-byte "
                                  "allocation its handle maps")
        return torch.as_tensor(_Span(alloc, offset, size), device=torch.device("cuda", device))
