"""Remote transport: broadcasts over a dedicated process group, one per tensor or one per packed chunk.

The group holds the sending rank (rank 0) and every engine worker (ranks 1..N). It is made by a stateless
rendezvous: the sender hosts a `TCPStore` (listening on `master_addr` only), every side builds a
`ProcessGroupNCCL` / `ProcessGroupGloo` object directly on a prefixed view of it. No `init_process_group`, so
neither the trainer's default group nor vLLM's is touched, and a trainer may hold several such groups (one
per `WeightSync`).

NCCL moves CUDA buffers between GPUs and nodes; gloo is the same code for CPU buffers (and also accepts
CUDA tensors, staging them through host memory). NCCL cannot put two ranks on one GPU.

Per chunk, `send` starts every engine's update call and the sender's broadcasts together: an engine's
update enters the matching broadcasts, loads what it must, and returns. Broadcasts are issued in chunk order
on every rank (the send stage is sequential); each handle carries a sequence number so a receiver that got
out of step refuses before it enters a collective, and the protocol, which the receiver checks:

* "direct" (opt-in, `protocol="direct"`): one broadcast per tensor of the chunk's layout (tensors of no bytes
  have none), in layout order, all of a chunk's in one NCCL group (`ncclGroupStart`/`End` through the backend's
  coalescing: one launch). The sender broadcasts a tensor from the trainer's memory when it is on the group's
  device, contiguous and of the layout's dtype; the others (strided views, casts) are first copied into a
  scratch buffer of their size. The receiver posts the same broadcasts, each into the tensor's destination
  where its loader names one (`receiver.Destinations`: a parameter, or a row slice of a fused one) and into
  its slot of a receive buffer otherwise (then the loader copies it, as vLLM's `load_weights` needs). Both
  sides derive the ops from the layout alone, so they agree on count, order and sizes. No copy on either
  side where nothing needs one: the copies used to overlap the broadcasts and slow them (SMs and HBM).
  Small tensors (norms, biases) get a broadcast each too: inside one group they cost a work element of the
  one launch, not a launch, and batching them would need the copies this protocol removes.
  Measured on two H200s it was slower than "chunk" (53.7-80.0 vs 48.9-50.8 ms for the Qwen3-8B shape, 1 GiB chunks;
  docs/benchmarks), hence not the default.
* "chunk" (the default): the chunk is packed into one pool buffer and broadcast once into a receive buffer;
  the loader copies every tensor out. A chunk packed before from the same addresses into the same pool
  buffer replays its pack as one captured CUDA graph. With plain copies, launching a dense chunk's copies
  cost the sender's event loop 1.2-1.6 ms, and the engines' replies waited behind it: 64.2 ms for the
  Qwen3-8B shape on two H200s, against 50.8 ms captured and 44.5 ms for a raw broadcast of the same bytes
  (docs/benchmarks).

With NCCL nothing waits on a host for a copy or a broadcast in the middle of a push; streams wait on events:

  direct    sender    pack stream:  [producer] copies of strided/cast tensors into scratch -> ready(i)
                      comm stream:  [ready(i)] group of broadcasts i -> sent(i)       (from a worker thread)
            receiver  recv stream:  [free(slot) if any tensor is staged; the engine's stream if any goes into
                                    a parameter] group of broadcasts i -> got(i)
                      load stream:  [got(i)] copies of the staged tensors -> free(slot)  (the update returns)
  chunk     sender    pack stream:  [sent(i-w) of this buffer] pack i -> ready(i)
                      comm stream:  [ready(i)] broadcast i -> sent(i)
            receiver  recv stream:  [free(slot)] broadcast i into slot i % 2 -> got(i)
                      load stream:  [got(i)] copies into the parameters -> free(slot)
  both      send(i) returns when every engine acknowledged and broadcast i-1 finished (the last chunk: i, so
            the trainer may change its weights once the push returned); every tensor a broadcast reads is
            marked used by the comm stream, so a failed push that drops it frees nothing still read.
            end of round: waits (bounded) for the receive and load streams before the new version is reported

So the next chunk's pack and the receiver's loads of the previous one overlap broadcast i, and the receiver
posts the next broadcast into its second buffer while it still unpacks the previous one. A direct receive
writes live parameters from the receive stream: the round is marked dirty before it is posted (a push that
fails after that leaves the engine reporting mixed weights), and the engine's stream waits for it. gloo (and
`ordering="host"`) keeps the plain protocol: each side waits for its broadcasts in a thread; the receiver
loads, then acknowledges.

Nothing waits forever: the rendezvous, every collective and every acknowledgement have the group timeout,
and the sender's blocking calls run in worker threads that a failed push abandons. NCCL groups are built
with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator on a timeout, keep the process): torch's
default takes the whole process down when a collective times out, i.e. a frozen receiver would kill the
trainer. A push that fails in the middle of a broadcast leaves the group unusable: later pushes raise until
the transport connects again (`WeightSync.close()` then a push or `connect()`). `close()` aborts the group
(`abort`, not `shutdown`: NCCL's graceful finalize waits for peers that may be dead, frozen or gone) in a
daemon thread and returns within `close_timeout` whatever the peers do."""

from .group import BACKENDS
from .receiver import CollectiveReceiver
from .sender import PROTOCOLS, CollectiveTransport

__all__ = ["BACKENDS", "PROTOCOLS", "CollectiveReceiver", "CollectiveTransport"]
