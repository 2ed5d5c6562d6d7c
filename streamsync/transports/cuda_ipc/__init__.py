"""Colocated GPU transport: the trainer and the engine share a GPU; chunks move by CUDA IPC handles.

One handle per packed chunk, as plain JSON data, never a pickle: the sender takes the arguments that
`torch.multiprocessing.reductions.reduce_tensor` produces for its buffer (handle bytes as base64, sizes
and offsets as ints) and the receiver type-checks every field before it calls `rebuild_cuda_tensor`
itself, with the tensor and storage classes and the dtype fixed on its side. Handles are routed by the
GPU's UUID, so sender and receiver may number their devices differently (CUDA_VISIBLE_DEVICES).

Buffers come from a pool (at most the credit window of them, see `pool.py`), so in steady state no handle
is created or opened: the sender exports each buffer once per engine, the receiver opens each export once
and keeps the mapping, keyed by the buffer's token. Every handle lists the sender's live tokens; a receiver
drops mappings of buffers that are gone. That keeps torch's cross-process reference count exact (one
rebuild per export, one release per rebuild), so the sender's `torch.cuda.ipc_collect()` can free a
dropped buffer once no receiver maps it, and never earlier.

Ordering on the device (release="event", the default). Each buffer carries two interprocess CUDA events,
exported with its handle:
* ready: the sender records it on its pack stream after the chunk's copies; the receiver's stream waits on
  it before copying out. So the pack stage returns once the copies are queued, and the chunk's handle goes
  out while they run.
* release: the receiver records it on its stream after its copies out and returns from the update call
  without waiting for them. The release stage gives the buffer back to the pool, and the sender's pack
  stream waits on the release event before it packs into that buffer again.
So a buffer is never read before it is packed nor overwritten before every receiver has copied it out, yet
no host waits on a copy: packs, sends and the receivers' copies of different chunks overlap. The receiver's
`finish` (end_round) waits for its last copies before the new version is reported; the sender waits for
its last pack when the push ends. With release="sync", both sides also wait on the host (the sender for
each pack, the receiver for its copies before it returns): the plain protocol, where nothing of one chunk
overlaps the next at window 1 (benchmarks use it as the serial push). `release` may change between pushes:
the events go with every export either way, and each handle says whether the receiver must wait.

One copy (`one_copy=True`, the default). A converted tensor that is a plain view of a trainer parameter (TP=1
Megatron weights, HF modules, the Q/K/V and gate/up splits of fused weights) is not packed: the chunk's
handle names it as a *reference* (storage token, byte offset, shape, strides) and the receiver builds the
view on the trainer's storage, mapped by CUDA IPC once and kept across pushes, and copies from it straight
into its parameters. Only the rest (gathered or cast tensors, temporaries) is packed, into a buffer sized
for them, so the trainer's extra memory for referenced tensors is zero. Storages are the ones the source
lists as its own (`Source.local_tensors`), never conversion temporaries. Each side keeps a storage mapped
only while pushes use it: both drop the storages a successful push did not reference (the sender also drops
all of its exports after a failed push), so a parameter the trainer freed, resized or replaced between
pushes has a new address, gets a new export, and its old memory is freed once the receiver let go (torch
keeps an exported block out of reuse until then); a stale storage is never read. The ready event orders
the receiver's reads after the trainer's writes; the push returns after every receiver's `finish` waited
for its copies, so the trainer may change its weights right after.

Limitation: the exact reference count assumes one receiver process per engine (`ReceiverProcess`, a vLLM
engine with one worker). With several workers per engine sharing one export, the count may go below zero
and a dropped buffer is then only freed when the trainer exits; correctness is unaffected."""

from .handle import IpcHandle, export_handle, gpu_uuid, parse_handle
from .receiver import CudaIpcReceiver
from .sender import CudaIpcTransport

__all__ = ["CudaIpcReceiver", "CudaIpcTransport", "IpcHandle", "export_handle", "gpu_uuid", "parse_handle"]
