"""The shared-memory mirror's writer (kvps.replica.mirror) and reader (kvps_client._shm): round trips, the seqlock under
a writer in another process, the lease and the writer's lock, dead slots, full files, the sweep."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, wait_for
from kvps.delta import mirror as layout
from kvps.replica import mirror as shm
from kvps_client._shm import MirrorReader

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory mirrors need x86-64 and /dev/shm")


@pytest.fixture
def writer():
    w = shm.MirrorWriter(data_bytes=1 << 20, slots=64)
    try:
        yield w
    finally:
        w.close()


def _reader(w: shm.MirrorWriter) -> shm.MirrorReader:
    return MirrorReader(str(w.path))


def test_published_blocks_read_back_bit_identical(writer):
    rng = np.random.default_rng(3)
    values = {(k, b): rng.standard_normal((7, 5)).astype(np.float32) for k in ("a", "b") for b in range(3)}
    places = {kb: writer.publish(kb[0], kb[1], 10 + kb[1], v) for kb, v in values.items()}
    r = _reader(writer)
    try:
        for kb, (slot, tag) in places.items():
            version, raw = r.read(slot, tag, values[kb].nbytes, None)
            assert version == 10 + kb[1]
            assert np.array_equal(raw.view(np.float32).reshape(7, 5), values[kb])
            assert r.read(slot, tag, values[kb].nbytes, version) == (version, None)  # held: no copy
        # a newer version lands in the same slot
        slot, tag = places[("a", 0)]
        assert writer.publish("a", 0, 11, values[("a", 0)] + 1) == (slot, tag)
        version, raw = r.read(slot, tag, values[("a", 0)].nbytes, 10)
        assert version == 11 and np.array_equal(raw.view(np.float32).reshape(7, 5), values[("a", 0)] + 1)
        # wrong tag or size: not that block
        assert r.read(slot, tag + 1, values[("a", 0)].nbytes, None) is None
        assert r.read(slot, tag, values[("a", 0)].nbytes - 4, None) is None
        assert r.read(10_000, tag, 4, None) is None
    finally:
        r.close()


def test_a_forgotten_key_reads_as_nobodys(writer):
    slot, tag = writer.publish("gone", 0, 1, np.ones(16, np.float32))
    kept = writer.publish("kept", 0, 1, np.ones(16, np.float32))
    r = _reader(writer)
    try:
        writer.forget_key("gone")
        assert r.read(slot, tag, 64, None) is None
        assert writer.slot("gone", 0) is None
        assert r.read(*kept, 64, None)[0] == 1
        # the key created again gets a new slot and tag
        again = writer.publish("gone", 0, 1, np.zeros(16, np.float32))
        assert again != (slot, tag) and r.read(*again, 64, None)[0] == 1
    finally:
        r.close()


def test_a_block_that_changes_size_leaves_nobody_at_its_old_place(writer):
    old = writer.publish("k", 0, 1, np.ones(16, np.float32))
    new = writer.publish("k", 0, 2, np.ones(8, np.float32))
    r = _reader(writer)
    try:
        assert new != old and r.read(*old, 64, None) is None and r.read(*new, 32, None)[0] == 2
    finally:
        r.close()


def test_a_full_mirror_says_so(writer):
    writer.publish("big", 0, 1, np.zeros(1 << 18, np.float32))  # the whole 1 MiB
    with pytest.raises(shm.MirrorFull):
        writer.publish("more", 0, 1, np.zeros(4, np.float32))
    small = shm.MirrorWriter(data_bytes=1 << 16, slots=2)
    try:
        small.publish("x", 0, 1, np.zeros(1, np.float32))
        small.publish("x", 1, 1, np.zeros(1, np.float32))
        with pytest.raises(shm.MirrorFull):
            small.publish("x", 2, 1, np.zeros(1, np.float32))
    finally:
        small.close()


def test_live_only_while_leased_and_not_closed(writer):
    r = _reader(writer)
    try:
        assert not r.live()  # never renewed
        writer.renew(shm.now_ns() + 10**10)
        assert r.live()
        writer.renew(shm.now_ns() - 1)
        assert not r.live()
        writer.renew(shm.now_ns() + 10**10)
        writer.close()
        assert not r.live()  # closed: for good, whatever the lease said
        assert not os.path.exists(writer.path)
    finally:
        r.close()


_WRITER = textwrap.dedent("""
    import select, sys
    import numpy as np
    from kvps.replica import mirror as shm
    w = shm.MirrorWriter(data_bytes=1 << 22, slots=4)
    n = int(sys.argv[1])  # 0: until told to stop
    block = np.zeros(1 << 18, np.uint32)  # 1 MiB: a copy takes long enough to be caught midway
    slot, tag = w.publish("k", 0, 0, block)
    w.renew(shm.now_ns() + 10**12)
    print(w.path, slot, tag, flush=True)
    sys.stdin.readline()  # the reader is ready
    v = 0
    while v < n or (n == 0 and not (v % 64 == 0 and select.select([sys.stdin], [], [], 0)[0])):
        v += 1
        block.fill(v)
        w.publish("k", 0, v, block)
    print(v, flush=True)
    sys.stdin.readline()  # hold the mirror (and its lock) until told
""")


def _spawn_writer(n: int) -> tuple[subprocess.Popen, str, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    path, slot, tag = proc.stdout.readline().split()
    return proc, path, int(slot), int(tag)


def test_a_reader_never_keeps_a_block_torn_by_a_concurrent_write():
    """A writer in another process publishes 1 MiB versions (every element = the version) until
    the reader has kept 20 different ones: every one kept is whole."""
    proc, path, slot, tag = _spawn_writer(0)
    r = MirrorReader(path)
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        seen, retried = set(), 0
        deadline = time.monotonic() + 60
        while len(seen) < 20:
            assert time.monotonic() < deadline, f"kept only versions {sorted(seen)} ({retried} retried)"
            got = r.read(slot, tag, 1 << 20, None)
            if got is None:  # a write kept overlapping the read
                retried += 1
                continue
            version, raw = got
            values = raw.view(np.uint32)
            # every element written by the same publish, and that publish's version
            assert values[0] == values[-1] == version and (values == version).all(), version
            seen.add(version)
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        last = int(proc.stdout.readline())
        assert r.read(slot, tag, 1 << 20, None)[0] == last  # the writer's last version, whole
        assert r.live()  # the writer still holds its lock and its lease
    finally:
        r.close()
        proc.kill()
        proc.wait()
        shm.sweep()


def test_a_killed_writers_mirror_is_not_live_and_is_swept():
    proc, path, slot, tag = _spawn_writer(1)
    r = MirrorReader(path)
    try:
        assert r.live()  # leased for 1000 s, and the writer holds its lock
        live = shm.MirrorWriter(data_bytes=1 << 16, slots=2)  # a live writer's file stays
        try:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            wait_for(lambda: not r.live(), 5, "the killed writer's mirror to read as dead")
            assert os.path.exists(path)
            assert shm.sweep() >= 1
            assert not os.path.exists(path) and os.path.exists(live.path)
            assert r.read(slot, tag, 1 << 20, None)[0] == 0  # a mapped reader keeps its pages
        finally:
            live.close()
    finally:
        r.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_readers_refuse_files_that_are_not_mirrors(tmp_path):
    with pytest.raises(ValueError):
        MirrorReader(str(tmp_path / "kvps-mirror-x"))
    with pytest.raises(ValueError):
        MirrorReader("/dev/shm/../etc/passwd")
    bogus = Path(layout.SHM_DIR) / f"{layout.PREFIX}test-{os.getpid()}"
    bogus.write_bytes(b"\0" * layout.HEADER_BYTES)
    try:
        with pytest.raises(ValueError):
            MirrorReader(str(bogus))
    finally:
        bogus.unlink()


def test_the_host_keeps_the_blocks_a_client_read_current_and_no_others():
    """Apply order: each new version of a mirrored block is in the mirror when its push applies;
    a block no same-host client pulled takes no room; a deleted key's slots read as nobody's; a
    restored state closes the mirror."""
    from kvps.command import CreateKey, DeleteKey, DenseDelta, Push, PushId
    from kvps.replica.history import BlockHistory
    from kvps.replica.host import StateHost
    from kvps.shard import ShardState

    host = StateHost(ShardState(0), history=BlockHistory, perform=lambda e: None)
    for key in ("read", "unread"):
        host.apply(CreateKey(key, (4, 3), "float32", 2, {"name": "add"}, "sum",
                             ((0, np.zeros((2, 3), np.float32)), (1, np.zeros((2, 3), np.float32)))))
    mirror = host.open_mirror(lambda: shm.MirrorWriter(data_bytes=1 << 16, slots=16))
    try:
        current, places = host.read_mirrored("read", [0, 1])  # a same-host pull of "read"
        r = MirrorReader(str(mirror.path))
        try:
            for seq in range(1, 4):
                host.apply(Push(1.0, (PushId("c", seq, seq, ("read", "unread")),), tuple(
                    DenseDelta(k, b, np.full((2, 3), seq, np.float32), 1)
                    for k in ("read", "unread") for b in (0, 1)), ()))
                for b, (slot, tag) in enumerate(places):
                    version, raw = r.read(slot, tag, 24, None)
                    assert version == host.lookup(lambda s: s.read_blocks("read", [b]))[0][0]
                    assert (raw.view(np.float32) == sum(range(1, seq + 1))).all()
            assert mirror.slot("unread", 0) is None and mirror.slot("unread", 1) is None
            host.apply(DeleteKey("read"))
            assert all(r.read(slot, tag, 24, None) is None for slot, tag in places)
            host.replace(ShardState(0))  # a snapshot installed: the mirror copied another state
            assert host.mirror is None and mirror.closed
        finally:
            r.close()
    finally:
        host.close_mirror()
