"""Colocated CPU transport: shared-memory segments (memfd) mapped by sender and receivers.

Why memfd and a pool rather than a fresh named /dev/shm segment per chunk: creating and faulting in a new
tmpfs segment costs several times a memcpy of the same size, so a push would spend most of its time in the
kernel. Segments are therefore reused: the release stage gives a
segment back to a pool (never more segments than the credit window), and `keep_pool=True` keeps them
between pushes. A memfd has no name in /dev/shm and lives exactly as long as some process holds it, so
no segment can be left behind by a push, a failed push, a crashed receiver or a crashed trainer.

Receivers open a segment through `/proc/<sender pid>/fd/<fd>` (same host, same user), check that it is
exactly the memfd named with the handle's token and large enough, and keep the mapping while the token is live.

One copy (`one_copy=True`, opt-in; numbers and why in `ShmTransport`). A converted tensor that is a plain view of one
of the source's own CPU storages (`Source.local_addresses`) in the plan's dtype is not packed: the chunk's
handle names it by reference (storage token, byte offset, view shape, strides; `refs.py`) and the receiver
copies it straight out of the trainer's memory into its parameters. For that the trainer's storages must be
shared memory: before a push the sender moves every storage of the source that is not shared yet into shared
memory in place (`UntypedStorage.share_memory_()`: torch copies it into a fresh, unlinked `/dev/shm/torch_*`
file, maps it, and swaps the storage's memory, so every view and the Parameter stay valid; this happens once,
and is logged). A storage is exported as `{pid, fd, size, link}`: `fd` is the sender's own duplicate of the
file descriptor torch keeps for it (so the file, and that fd number, stay the same while the export lives),
`link` its `/proc/self/fd` target. The receiver checks that `/proc/<pid>/fd/<fd>` links to exactly `link` and
that `link` is one of torch's shared-memory files (a handle cannot point it at another file of the sender),
before and after it opens it, checks the size, and maps it read-only, once, kept while pushes use it.

Lifetimes: the sender holds each exported storage (and its fd) until its export is dropped: at the end of a
successful push that did not use it, after a failed push (all of them), at reconnect and close; receivers
drop the storages a round did not use. So a parameter the trainer replaced (`p.data = new`) or resized between
pushes has a new storage, a new address and a new export, and its old memory goes once both sides let go.
Each push the sender also checks that the file under every exported address is still the exported one (an
inode compare): a storage freed in place (`untyped_storage().resize_(0)`) whose address a new one took is never
read through the old export."""

from .receiver import ShmReceiver
from .segments import MEMFD_PREFIX
from .sender import ShmTransport

__all__ = ["MEMFD_PREFIX", "ShmReceiver", "ShmTransport"]
