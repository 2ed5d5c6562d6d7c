"""Remote transport: broadcasts of packed chunks over a dedicated process group.

The group holds the sending rank (rank 0) and every engine worker (ranks 1..N). It is made by a stateless
rendezvous: the sender hosts a `TCPStore` (listening on `master_addr` only), every side builds a
`ProcessGroupNCCL` / `ProcessGroupGloo` object directly on a prefixed view of it. No `init_process_group`, so
neither the trainer's default group nor vLLM's is touched, and a trainer may hold several such groups (one
per `WeightSync`).

NCCL moves CUDA buffers between GPUs and nodes; gloo is the same code for CPU buffers (and also accepts
CUDA tensors, staging them through host memory). NCCL cannot put two ranks on one GPU.

Per chunk, `send` starts every engine's update call and the sender's broadcast together: an engine's update
enters the matching broadcast, loads what it must, and returns. The chunk is packed into one pool buffer
and broadcast once into a receive buffer; the loader copies every tensor out. A chunk packed before from the
same addresses into the same pool buffer replays its pack as one captured CUDA graph: with plain copies,
launching a dense chunk's copies cost the sender's event loop about a millisecond, and the engines' replies
waited behind it (docs/benchmarks/README.md, "Two GPUs"). Broadcasts are issued in chunk order on every rank
(the send stage is sequential); each handle carries a sequence number so a receiver that got out of step
refuses before it enters a collective.

With NCCL nothing waits on a host for a copy or a broadcast in the middle of a push; streams wait on events:

  sender    pack stream:  [sent(i-w) of this buffer] pack i -> ready(i)
            comm stream:  [ready(i)] broadcast i -> sent(i)
  receiver  recv stream:  [free(slot)] broadcast i into slot i % 2 -> got(i)
            load stream:  [got(i)] copies into the parameters -> free(slot)
  send(i) returns when every engine acknowledged and broadcast i-1 finished (the last chunk: i, so the
  trainer may change its weights once the push returned); every buffer a broadcast reads is marked used by
  the comm stream, so a failed push that drops it frees nothing still read. The end of a round waits
  (bounded) for the receive and load streams before the new version is reported.

So the next chunk's pack and the receiver's loads of the previous one overlap broadcast i, and the receiver
posts the next broadcast into its second buffer while it still unpacks the previous one. gloo (and a buffer
another transport packed, `order_on_host`) keeps the plain protocol: each side waits for its broadcast in a
thread; the receiver loads, then acknowledges.

Nothing waits forever: the rendezvous, every collective and every acknowledgement have the group timeout,
and the sender's blocking calls run in worker threads that a failed push abandons. NCCL groups are built
with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator on a timeout, keep the process): torch's
default takes the whole process down when a collective times out, i.e. a frozen receiver would kill the
trainer. A push that fails in the middle of a broadcast leaves the group unusable: later pushes raise until
the transport connects again (`WeightSync.close()` then a push or `connect()`). `close()` aborts the group
(`abort`, not `shutdown`: NCCL's graceful finalize waits for peers that may be dead, frozen or gone) in a
daemon thread and returns within `close_timeout` whatever the peers do.
"""

from .group import BACKENDS
from .receiver import CollectiveReceiver
from .sender import CollectiveTransport

__all__ = ["BACKENDS", "CollectiveReceiver", "CollectiveTransport"]
