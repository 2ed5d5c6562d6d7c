"""Sharded sending: every trainer rank sends the slices it holds straight to the engine workers that need them.

The group holds every trainer rank (ranks 0..T-1, as in the trainer's default group) and every engine worker
(ranks T.., engine by engine). Like the collective transport's, it is built by a stateless rendezvous on a
`TCPStore` that trainer rank 0 hosts on `master_addr`, never registered with torch.distributed, so neither
the trainer's default group nor vLLM's is touched. Every trainer rank takes part: `WeightSync.connect` and
`push` run this transport on ranks without engines too (`Transport.every_rank`), and trainer rank 0, which
holds the engines, broadcasts the rendezvous and the engines' layouts (`Sharded.layout`) to the others over
the default group.

A push is planned by `sources.sharded.ShardedSource` (`plan.shards.plan_transfers`): bucket i is chunk i of
every rank's pipeline. Per bucket, each rank packs its pieces (casting them to the engine's dtype) into one
buffer, one contiguous segment per destination worker, and sends each segment as one message (gloo / NCCL
point to point, tagged with the bucket's sequence number). Trainer rank 0 sends every engine its update for
the bucket at the same time: it names, per worker, which rank sends which pieces where (`recv`), and the
layout of the bucket's whole tensors. Each worker posts one receive per sending rank, copies the pieces into
a buffer laid out as those tensors, and loads them as any chunk (vLLM's `load_weights` narrows its own slice
out of each tensor; the rest of the buffer is never read). A send completes only once its receiver took it,
so each rank's extra memory is its window of packed buckets.

Colocated pairs (`ipc`): a worker on a trainer rank's own GPU, in a gloo group with the rank's buffers on CUDA
(`P2pTransport("gloo", device="cuda")`), gets a reference to the bytes in the rank's buffer instead of the bytes
(CUDA IPC; NCCL cannot join two processes of one GPU, and gloo would carry the bytes through host memory), reads
its pieces out of it on the GPU and answers once they are copied; other pairs of the same group send over gloo
from a host copy. A delta's messages always go over gloo.

Failures: every send and receive has the group timeout. A worker that dies fails the sends to it (and the
receives of its engine's other workers time out): the push fails on every rank within the timeout, naming
the worker on trainer ranks and the trainer rank on workers. At the next push every trainer rank agrees
(one small all-reduce on the default group) whether the group is intact, and all of them rebuild it when not.
"""

from .receiver import P2pReceiver
from .sender import P2pTransport

__all__ = ["P2pReceiver", "P2pTransport"]
