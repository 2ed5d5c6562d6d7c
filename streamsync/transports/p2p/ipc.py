"""Pieces between a trainer rank and an engine worker on the same GPU: by CUDA IPC, not over the wire.

Two processes on one GPU cannot share an NCCL communicator, and gloo would carry the bytes through host memory
twice. A colocated pair (a worker on a trainer rank's GPU in another process, in a group of `backend="gloo"`
with the rank's buffers on CUDA) instead exchanges small messages over the group: the rank sends a reference to
the bytes in its send buffer (`cuda_ipc.driver.export_storage`, made once per pool buffer), the worker reads its
pieces straight out of the mapped buffer as it assembles the chunk on the GPU and answers with one byte once they
are copied, and only then does the rank's send complete, so the buffer is never reused while the worker reads
it. Each side publishes its GPU and process in the group's store at connect (`publish_gpu` / `read_gpus`); a
rank whose allocator's memory the driver cannot export (e.g. expandable segments) publishes none, and its pairs
go over gloo.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ...errors import TransportError, ValidationError

#: a reference message's size: a length, then the JSON of (export, byte offset, bytes)
MSG_BYTES = 1024


def gpu_of(device: torch.device, probe: bool = False) -> str:
    """This process's identity for pairs on one GPU: the physical GPU of `device` and this process ("" for a
    CPU device, or where CUDA IPC cannot run here). `probe`: also export a fresh buffer of the allocator the
    sender's buffers come from, and answer "" where the driver refuses it (e.g. expandable segments)."""
    if device.type != "cuda":
        return ""
    from ..cuda_ipc.driver import available, export_storage
    from ..cuda_ipc.handle import PROCESS_ID, gpu_uuid

    if not available():
        return ""
    gpu = gpu_uuid(device.index if device.index is not None else torch.cuda.current_device())
    if probe:
        try:
            export_storage(torch.empty(1 << 20, dtype=torch.uint8, device=device), gpu)
        except TransportError:
            return ""
    return f"{gpu}/{PROCESS_ID}"


def colocated(mine: str, other: str) -> bool:
    """Whether a peer that published `other` shares this process's GPU from another process (CUDA IPC cannot
    open memory of the process that exported it)."""
    if not mine or not other:
        return False
    gpu, _, process = mine.partition("/")
    their_gpu, _, their_process = other.partition("/")
    return gpu == their_gpu and process != their_process


def _key(group: str, rank: int) -> str:
    return f"{group}/gpu/{rank}"


def publish_gpu(store: Any, group: str, rank: int, gpu: str) -> None:
    store.set(_key(group, rank), gpu)


def read_gpus(store: Any, group: str, ranks: range) -> dict[int, str]:
    """Every rank's published identity (each rank publishes before it joins the group, so after the group's
    first collective every key is there)."""
    return {r: store.get(_key(group, r)).decode() for r in ranks}


def encode_ref(export: dict[str, Any], at: int, nbytes: int) -> torch.Tensor:
    """The reference message for bytes [at, at + nbytes) of the exported storage."""
    body = json.dumps({"export": export, "at": at, "n": nbytes}).encode()
    if len(body) + 4 > MSG_BYTES:
        raise TransportError(f"p2p IPC reference of {len(body)} bytes exceeds {MSG_BYTES}")
    msg = torch.zeros(MSG_BYTES, dtype=torch.uint8)
    msg[:4] = torch.tensor(list(len(body).to_bytes(4, "little")), dtype=torch.uint8)
    msg[4:4 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return msg


def decode_ref(msg: torch.Tensor, src: int) -> tuple[dict[str, Any], int, int]:
    """(export, byte offset, bytes) of a reference message from trainer rank `src`, checked for shape."""
    raw = bytes(msg.numpy())
    n = int.from_bytes(raw[:4], "little")
    try:
        if not 0 < n <= MSG_BYTES - 4:
            raise ValueError(f"length {n}")
        d = json.loads(raw[4:4 + n])
        export, at, nbytes = d["export"], d["at"], d["n"]
        if not (isinstance(export, dict) and type(at) is int and type(nbytes) is int and at >= 0 and nbytes > 0):
            raise ValueError("fields")
    except (ValueError, KeyError, TypeError) as e:
        raise ValidationError(f"p2p IPC reference from trainer rank {src} is malformed: {e}") from None
    return export, at, nbytes
