"""The shared-memory mirror of a shard leader's dense blocks, for workers on the same host: its
file layout (the writer is ``kvps.replica.mirror``, the reader ``kvps_client._shm``).

A leader that a same-host client asks for it keeps a file in ``/dev/shm`` with a copy of every
dense block it has published, each in a *slot*: a directory entry (a sequence number, the block's
version, a tag naming the allocation, the block's offset and size) and the bytes. A pull on that
host reads the slots it knows (the TCP reply named them) instead of asking the leader: when the
version it holds is current, nothing is copied; otherwise one copy out of the file.

Writers and readers never lock each other out (a seqlock per slot): the writer makes the slot's
sequence odd, writes the bytes and the version, and makes it even again; a reader takes the
sequence, reads, and keeps what it read only if the sequence is the same even number after. The
writer is the leader's apply (the bytes of a committed entry are published before its push is
acknowledged, so a worker reads its own writes) and its pull path, both under the shard state's
lock. This relies on stores and loads not being reordered with each other (x86-64's memory
model, and numpy's copies are calls the interpreter makes in order): ``seqlock_safe`` is false on
other machines, and clients there pull over TCP.

A mirror is only good while its writer leads and serves: the header holds a *lease*, a
``CLOCK_MONOTONIC`` deadline (one clock for every process on a host) that the leader renews as it
ticks and serves, a fraction of the shortest election timeout ahead, so no other replica can have
been elected and have committed anything while a reader still trusts it. The writer holds an
exclusive ``flock`` on the file for the mirror's life: a reader whose shared ``flock`` succeeds
knows the writer died (a killed leader's successor may win in ~0.1 s, inside the lease). A leader
that steps down closes its mirror (lease 0, ``closed`` set, file unlinked); a new leadership
starts a new file, so no slot outlives the term whose state it copied.

The file is readable by its owner only (mode 0600): the same user as the server, as its journal.
Files of writers that died are removed by the next writer that starts (``kvps.replica.mirror.sweep``).
"""
from __future__ import annotations

__all__ = ["ALIGN", "HEADER_BYTES", "H_CLOSED", "H_DATA_BYTES", "H_DATA_OFFSET", "H_LAYOUT", "H_MAGIC",
           "H_SLOTS", "H_UNTIL", "LAYOUT", "MAGIC", "PREFIX", "READ_TRIES", "SHM_DIR", "SLOT_WORDS",
           "S_NBYTES", "S_OFFSET", "S_SEQ", "S_TAG", "S_VERSION", "align", "is_mirror_path", "seqlock_safe"]

SHM_DIR = "/dev/shm"
PREFIX = "kvps-mirror-"
MAGIC = 0x6B7670736D697272  # "kvpsmirr"
LAYOUT = 1
HEADER_BYTES = 4096  # then the slot directory, then the blocks' bytes
SLOT_WORDS = 6  # int64 words per slot: seq, version, tag, offset, nbytes, spare
ALIGN = 64
# header words (uint64)
H_MAGIC, H_LAYOUT, H_UNTIL, H_CLOSED, H_SLOTS, H_DATA_OFFSET, H_DATA_BYTES = range(7)
# slot words
S_SEQ, S_VERSION, S_TAG, S_OFFSET, S_NBYTES = range(5)
READ_TRIES = 32  # reads of a slot that a write overlapped, before giving up (TCP then)


def seqlock_safe(machine: str) -> bool:
    """Whether stores and loads keep their order on ``machine`` (``platform.machine()``), as the
    seqlock needs without fences: x86-64."""
    return machine.lower() in ("x86_64", "amd64")


def is_mirror_path(path: str) -> bool:
    """A file directly in ``SHM_DIR`` named like a mirror (what a reader agrees to open)."""
    head, _, name = path.rpartition("/")
    return head == SHM_DIR and name.startswith(PREFIX) and "/" not in name and name not in (".", "..")


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
