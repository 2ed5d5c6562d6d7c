"""CUDA IPC handles as plain data: export on the sender, validation on the receiver."""

from __future__ import annotations

import base64
import binascii
import functools
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...errors import TransportError, ValidationError

if TYPE_CHECKING:
    pass


_TOKEN = re.compile(r"^[0-9a-f]{8,64}$")

UUID_RE = re.compile(r"^[0-9A-Za-z-]{1,80}$")

# torch names its IPC reference-counter files "/torch_{pid}_{random}_{n}": accept nothing else, so a crafted
# handle cannot point the receiver's counter update at another process's shared memory.
_REF_COUNTER = re.compile(rb"^/torch_-?[0-9]{1,20}_-?[0-9]{1,20}_-?[0-9]{1,20}$")

_MAX_INT = 1 << 50

#: this Python process, as the sender names it in init_info: a receiver that finds its own id here runs in the
#: trainer's process, where CUDA IPC cannot open the memory it would map (pids may repeat across containers)
PROCESS_ID = secrets.token_hex(8)


def refuse_same_process(init_info: dict[str, Any]) -> None:
    """A clear error, at connect, for an engine worker in the trainer's own process."""
    if init_info.get("process") == PROCESS_ID:
        raise TransportError(
            "cuda_ipc: the engine's worker runs in the trainer's own process (vLLM with "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0, or the external_launcher executor), and CUDA IPC cannot open "
            "memory of its own process; run the engine core in its own process (vLLM's default)")


@functools.lru_cache(maxsize=64)
def gpu_uuid(index: int) -> str:
    """Physical identity of a local device: the same string in every process on the host."""
    return str(torch.cuda.get_device_properties(index).uuid)


@functools.lru_cache(maxsize=64)
def local_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`."""
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise TransportError(f"GPU {uuid} is not visible in this process (CUDA IPC needs sender and receiver "
                         "on the same GPU)")


def export_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """The IPC arguments of a flat uint8 CUDA buffer, as plain data."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_cuda:
        raise ValidationError("only flat uint8 CUDA buffers are exported")
    fn, args = reduce_tensor(tensor)
    if fn is not rebuild_cuda_tensor:
        raise TransportError(f"reduce_tensor gave {fn!r}, expected rebuild_cuda_tensor")
    (_cls, size, _stride, tensor_offset, _storage_cls, _dtype, device, handle, storage_size, storage_offset,
     _requires_grad, ref_counter, ref_counter_offset, event, event_sync) = args
    return {
        "gpu": gpu_uuid(int(device)),
        "size": int(size[0]),
        "tensor_offset": int(tensor_offset),
        "handle": base64.b64encode(handle).decode(),
        "storage_size": int(storage_size),
        "storage_offset": int(storage_offset),
        "ref_counter": base64.b64encode(ref_counter).decode(),
        "ref_counter_offset": int(ref_counter_offset),
        "event": base64.b64encode(event if event is not None else b"").decode(),
        "event_sync": bool(event_sync),
    }


# ---------------------------------------------------------------------------------------------- receiver


@dataclass(frozen=True)
class IpcHandle:
    """A validated handle. Everything a remote peer sent has been type- and range-checked."""

    token: str
    nbytes: int
    live: tuple[str, ...] | None
    gpu: str
    size: int
    tensor_offset: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool
    release_event: bytes | None
    ready_event: bytes | None


def _int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if type(v) is not int or not 0 <= v < _MAX_INT:
        raise ValidationError(f"cuda_ipc handle field {key!r} must be a non-negative int, got {v!r:.80}")
    return v


def _b64(d: dict[str, Any], key: str, max_len: int) -> bytes:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > 4 * max_len:
        raise ValidationError(f"cuda_ipc handle field {key!r} must be a base64 string, got {v!r:.80}")
    try:
        raw = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError(f"cuda_ipc handle field {key!r} is not valid base64") from None
    if len(raw) > max_len:
        raise ValidationError(f"cuda_ipc handle field {key!r} holds {len(raw)} bytes, at most {max_len}")
    return raw


def parse_handle(h: object) -> IpcHandle:
    """Validate a handle received as plain data (JSON); raise ValidationError on anything unexpected."""
    if not isinstance(h, dict) or not isinstance(h.get("ipc"), dict):
        raise ValidationError(f"cuda_ipc handle must be {{token, nbytes, ipc, live}}, got {h!r:.200}")
    ipc: dict[str, Any] = h["ipc"]
    token = h.get("token")
    if not isinstance(token, str) or not _TOKEN.match(token):
        raise ValidationError(f"cuda_ipc handle token must be a hex string, got {token!r:.80}")
    live = h.get("live")
    if live is not None:
        if not isinstance(live, list) or len(live) > 1024 or not all(
                isinstance(t, str) and _TOKEN.match(t) for t in live):
            raise ValidationError("cuda_ipc handle 'live' must be a list of hex tokens")
        live = tuple(live)
    gpu = ipc.get("gpu")
    if not isinstance(gpu, str) or not UUID_RE.match(gpu):
        raise ValidationError(f"cuda_ipc handle gpu must be a device UUID, got {gpu!r:.80}")
    ref_counter = _b64(ipc, "ref_counter", 256)
    if not _REF_COUNTER.match(ref_counter):
        raise ValidationError("cuda_ipc handle ref_counter is not a shared-memory file name")
    event_sync = ipc.get("event_sync")
    if not isinstance(event_sync, bool):
        raise ValidationError("cuda_ipc handle event_sync must be a bool")
    events: dict[str, bytes | None] = {}
    for key in ("release_event", "ready_event"):
        ev = events[key] = _b64(ipc, key, 512) if key in ipc else None
        if ev is not None and len(ev) != 64:  # sizeof(cudaIpcEventHandle_t)
            raise ValidationError(f"cuda_ipc handle {key} must be a 64-byte CUDA IPC event handle")
    out = IpcHandle(
        token=token, nbytes=_int(h, "nbytes"), live=live, gpu=gpu, size=_int(ipc, "size"),
        tensor_offset=_int(ipc, "tensor_offset"), handle=_b64(ipc, "handle", 512),
        storage_size=_int(ipc, "storage_size"), storage_offset=_int(ipc, "storage_offset"),
        ref_counter=ref_counter, ref_counter_offset=_int(ipc, "ref_counter_offset"),
        event=_b64(ipc, "event", 512), event_sync=event_sync, release_event=events["release_event"],
        ready_event=events["ready_event"],
    )
    if not out.handle or out.size == 0:
        raise ValidationError("cuda_ipc handle names an empty buffer")
    if out.tensor_offset + out.size > out.storage_size:
        raise ValidationError(f"cuda_ipc buffer [{out.tensor_offset}, +{out.size}) exceeds its storage of "
                              f"{out.storage_size} bytes")
    if out.nbytes > out.size:
        raise ValidationError(f"cuda_ipc chunk of {out.nbytes} bytes exceeds its {out.size}-byte buffer")
    if out.event_sync and not out.event:
        raise ValidationError("cuda_ipc handle asks for an event sync but carries no event")
    return out


def live_tokens(h: dict[str, Any]) -> tuple[str, ...] | None:
    live = h.get("live")
    if live is None:
        return None
    if not isinstance(live, list) or len(live) > 1024 or not all(isinstance(t, str) and _TOKEN.match(t) for t in live):
        raise ValidationError("cuda_ipc handle 'live' must be a list of hex tokens")
    return tuple(live)
