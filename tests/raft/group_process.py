"""One ``ShardGroup`` in a process of its own, for tests that stop, pause or kill a replica's
process (``kill -9``, ``SIGSTOP``/``SIGCONT``), which an in-process group cannot stand for.

Run as ``python group_process.py '<json>'`` (keys: address, peers, journal_dir, secret_hex,
raft: RaftConfig fields). It prints one JSON status line per 20 ms on stdout (role, term,
leader, commit and applied index, and what the group's ``status()`` says of pre-votes), and
exits when its stdin closes. ``GroupProcess`` is the parent's handle on it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_STATUS_PERIOD = 0.02


class GroupProcess:
    """A child process running one group; ``status`` is its latest status line (or None)."""

    def __init__(self, *, address: str, peers: list[str], journal_dir: Path, secret: bytes,
                 raft: Any) -> None:
        spec = {"address": address, "peers": peers, "journal_dir": str(journal_dir),
                "secret_hex": secret.hex(), "raft": dataclasses.asdict(raft)}
        self.address = address
        self.status: dict[str, Any] | None = None
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.status = json.loads(line)
            except ValueError:
                continue

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """Always ends the process (resumed first, in case the test left it stopped)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)


def _main(spec: dict[str, Any]) -> None:
    from kvps.config import RaftConfig
    from kvps.raft.group import ShardGroup

    applied: list[int] = []
    group = ShardGroup(
        self_address=spec["address"], peers=spec["peers"], raft=RaftConfig(**spec["raft"]),
        secret=bytes.fromhex(spec["secret_hex"]), context="test/shard=0",
        journal_dir=Path(spec["journal_dir"]), applier=lambda data: applied.append(len(data)),
        snapshot_state=lambda: b"", restore_state=lambda data: None)
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    try:
        while not closed.wait(_STATUS_PERIOD):
            st = group.status()
            line = {k: st.get(k) for k in ("role", "term", "leader", "commit_index",
                                           "applied_index", "pre_votes")}
            line["t"] = time.monotonic()
            print(json.dumps(line), flush=True)
    finally:
        group.stop()


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
