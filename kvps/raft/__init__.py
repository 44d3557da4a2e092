"""The Raft layer: the only package that imports pysyncobj (pinned to 0.3.17).

* ``transport`` -- authenticated, size-capped peer connections (HMAC challenge-response on the
  cluster secret, protocol-5 pickles read with an Unpickler that refuses every global).
* ``group`` -- ``ShardGroup``, the one ``SyncObj`` subclass, with one ``@replicated`` method.
* ``bridge`` -- pysyncobj callbacks to asyncio futures, ``FAIL_REASON`` to kvps errors.
* ``snapshot_file`` -- our log-compaction snapshot format.
* ``journal`` -- our Raft journal (checksummed, crash-safe, explicit fsync policy), installed in
  place of pysyncobj's ``FileJournal``.

``tests/test_raft_pin.py`` fails first when a pysyncobj upgrade moves an internal we rely on.
"""
from kvps.raft.bridge import FAIL_REASON_ERRORS, error_for, propose
from kvps.raft.group import COMMAND_TOO_LARGE, GROUP_STOPPED, ShardGroup
from kvps.raft.transport import make_transport_class

__all__ = [
    "COMMAND_TOO_LARGE",
    "FAIL_REASON_ERRORS",
    "GROUP_STOPPED",
    "ShardGroup",
    "error_for",
    "make_transport_class",
    "propose",
]
