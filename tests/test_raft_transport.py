"""The Raft peer transport under attack: nothing is unpickled before authentication, no global is
ever unpickled, frame caps hold before allocation, wrong secrets and replays never connect.

A live 3-group cluster on 127.0.0.1; attackers are plain sockets speaking the wire format from
``kvps/raft/transport.py``'s module docstring.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import threading
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
from conftest import free_ports, wait_for

from kvps.config import RaftConfig
from kvps.raft.group import ShardGroup
from kvps.raft.transport import (
    HELLO_MAGIC,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    decode_message,
    encode_message,
    handshake_mac,
)

SECRET = b"transport-test-secret-0123456789abcdef"
CONTEXT = "test/shard=7"
RAFT = RaftConfig(election_timeout_min=0.3, election_timeout_max=0.6, heartbeat_period=0.05,
                  leader_fallback_timeout=0.6, connection_timeout=1.5, connection_retry=0.1)
U32 = struct.Struct("<I")


class Evil:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Groups:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.addresses: list[str] = []
        self.groups: dict[str, ShardGroup] = {}
        self.applied: dict[str, list[bytes]] = {}

    def start(self, address: str, peers: list[str], secret: bytes = SECRET,
              context: str = CONTEXT) -> ShardGroup:
        applied = self.applied.setdefault(address, [])
        group = ShardGroup(
            self_address=address, peers=peers, raft=RAFT, secret=secret, context=context,
            journal_dir=self.root / address.replace(":", "_"),
            applier=lambda data: applied.append(bytes(data)) or len(applied),
            snapshot_state=lambda: b"", restore_state=lambda blob: None)
        self.groups[address] = group
        return group

    def stop_all(self) -> None:
        for address in list(self.groups):
            self.groups.pop(address).stop()

    def leader(self, among: list[str] | None = None) -> ShardGroup:
        def find():
            leaders = [g for a, g in self.groups.items() if g.is_leader() and (among is None or a in among)]
            return leaders[0] if len(leaders) == 1 else None
        return wait_for(find, what="a leader")

    def commit(self, data: bytes, among: list[str] | None = None, timeout: float = 20.0) -> None:
        """Commit ``data`` through the leader and wait until every member in ``among`` applied it."""
        among = among or list(self.groups)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = threading.Event()
            box: list[int] = []
            self.leader(among).propose(data, lambda r, e, box=box, done=done: (box.append(e), done.set()))
            if done.wait(timeout) and box[0] == 0:
                wait_for(lambda: all(data in self.applied[a] for a in among), what="replication")
                return
        raise AssertionError("could not commit")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    g = Groups(tmp_path_factory.mktemp("live"))
    g.addresses = [f"127.0.0.1:{p}" for p in free_ports(3)]
    try:
        for address in g.addresses:
            g.start(address, g.addresses)
        g.commit(b"warm-up")
        yield g
    finally:
        g.stop_all()


@pytest.fixture
def groups(tmp_path):
    g = Groups(tmp_path)
    try:
        yield g
    finally:
        g.stop_all()


# ---- a hand-written peer ---------------------------------------------------------------------

def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(U32.pack(len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = U32.unpack(recv_exact(sock, 4))
    return recv_exact(sock, n)


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True once the other side closed the connection (it may send nothing else first)."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def authenticate(sock: socket.socket, secret: bytes = SECRET, context: str = CONTEXT) -> tuple[bytes, bytes]:
    """Run the client side of the handshake; returns the two frames this side sent."""
    client_nonce = os.urandom(NONCE_BYTES)
    hello = HELLO_MAGIC + bytes((PROTOCOL_VERSION,)) + client_nonce
    send_frame(sock, hello)
    challenge = recv_frame(sock)
    server_nonce, server_mac = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
    assert server_mac == handshake_mac(secret, context.encode(), b"server", client_nonce, server_nonce)
    response = handshake_mac(secret, context.encode(), b"client", client_nonce, server_nonce)
    send_frame(sock, response)
    return hello, response


def pickled_frame_body(obj: Any, protocol: int = 5) -> bytes:
    payload = pickle.dumps(obj, protocol=protocol)
    return struct.pack("<IH", len(payload), 0) + payload


# ---- (a) unauthenticated code-execution attempts ----------------------------------------------

def test_control_the_stock_transport_executes_the_attack(tmp_path):
    """Control experiment: the payload used below really runs code on a stock pysyncobj node."""
    from pysyncobj import SyncObj, SyncObjConf

    marker = tmp_path / "MARKER"
    address = f"127.0.0.1:{free_ports(1)[0]}"
    stock = SyncObj(address, [], SyncObjConf(bindAddress=address))
    try:
        stock.waitBinded()
        data = zlib.compress(pickle.dumps(Evil(marker), protocol=2), 3)
        with connect(address) as sock:
            sock.sendall(struct.pack("i", len(data)) + data)
            wait_for(marker.exists, what="the stock node to run the attacker's command")
    finally:
        stock.destroy_synchronous()


def test_unauthenticated_pickles_are_never_executed(live, tmp_path, caplog):
    marker = tmp_path / "MARKER"
    stock = zlib.compress(pickle.dumps(Evil(marker), protocol=2), 3)
    attacks = [
        struct.pack("i", len(stock)) + stock,  # what stock pysyncobj peers send
        U32.pack(len(p := pickle.dumps(Evil(marker), protocol=5))) + p,  # raw protocol 5
        U32.pack(len(b := pickled_frame_body(Evil(marker)))) + b,  # our post-auth layout, no auth
    ]
    with caplog.at_level(logging.WARNING, logger="kvps.raft"):
        for address in live.addresses:
            for attack in attacks:
                with connect(address) as sock:
                    sock.sendall(attack)
                    assert closed_by_peer(sock), "the connection must be dropped"
        wait_for(lambda: sum("rejected" in r.getMessage() for r in caplog.records) >= 9,
                 what="one log line per rejection")
    assert not marker.exists()
    live.commit(b"after-unauthenticated-attacks")


# ---- (b) an authenticated peer still cannot unpickle globals -------------------------------------

def test_authenticated_peer_cannot_unpickle_globals(live, tmp_path, caplog):
    marker = tmp_path / "MARKER"
    with caplog.at_level(logging.WARNING, logger="kvps.raft"):
        for body in (pickled_frame_body(Evil(marker)),
                     pickled_frame_body({"type": "append_entries", "x": Evil(marker)}),
                     pickled_frame_body(Evil(marker), protocol=2)):
            with connect(live.addresses[0]) as sock:
                authenticate(sock)
                send_frame(sock, body)
                assert closed_by_peer(sock)
        wait_for(lambda: sum("refused" in r.getMessage() for r in caplog.records) >= 3,
                 what="refusals logged")
    assert not marker.exists()
    live.commit(b"after-authenticated-attack")


def test_restricted_decoder_roundtrips_raft_messages_and_refuses_globals(tmp_path):
    entry = os.urandom(1 << 20)
    message = {"type": "append_entries", "term": 3, "commit_index": 9, "prevLogIdx": 8,
               "prevLogTerm": 3, "entries": [(entry, 9, 3), (b"\x00small", 10, 3)],
               "serialized": (b"chunk" * 10000, True, False), "f": 1.5, "n": None}
    body = b"".join(bytes(part) for part in encode_message(message))
    assert len(body) < len(entry) + 60_000  # the entry travels once, out of band
    decoded = decode_message(memoryview(body))
    assert decoded == message
    assert type(decoded["entries"][0][0]) is bytes  # pysyncobj's journal needs bytes
    for hostile in (Evil(tmp_path / "M"), [os.system], {"k": eval}, (pickle.loads, b"")):
        with pytest.raises(pickle.UnpicklingError, match="refused"):
            decode_message(memoryview(pickled_frame_body(hostile)))
    with pytest.raises(ValueError):
        decode_message(memoryview(struct.pack("<IH", 10 ** 6, 0) + b"x"))
    assert not (tmp_path / "M").exists()


# ---- (c) frame caps are checked on the header, before allocating ----------------------------------

@pytest.mark.parametrize("authenticated", [False, True])
def test_huge_frame_header_disconnects_without_allocating(live, authenticated, caplog):
    tracemalloc.start()
    try:
        for announced in (2 ** 31, RAFT.max_frame_bytes + 1) if authenticated else (2 ** 31, 1025):
            with connect(live.addresses[1]) as sock:
                if authenticated:
                    authenticate(sock)
                tracemalloc.reset_peak()
                with caplog.at_level(logging.WARNING, logger="kvps.raft"):
                    sock.sendall(U32.pack(announced) + b"\x00" * 64)
                    assert closed_by_peer(sock)
                    wait_for(lambda a=announced: any(f"frame of {a} bytes exceeds" in r.getMessage()
                                                     for r in caplog.records), what="the cap's log line")
                _, peak = tracemalloc.get_traced_memory()
                assert peak < 16 * 2 ** 20, f"{peak} bytes allocated for a refused frame"
    finally:
        tracemalloc.stop()
    live.commit(b"after-huge-headers")


def test_silent_unauthenticated_connection_is_dropped(live):
    with connect(live.addresses[2]) as sock:
        started = time.monotonic()
        assert closed_by_peer(sock, timeout=RAFT.connection_timeout + 5)
        assert time.monotonic() - started >= RAFT.connection_timeout * 0.5


# ---- (d) a wrong secret or another shard's context never connects --------------------------------

@pytest.mark.parametrize("secret,context", [(b"another-secret-0123456789abcdef0123", CONTEXT),
                                            (SECRET, "test/shard=8")])
def test_wrong_secret_or_context_never_connects(groups, secret, context, caplog):
    addresses = [f"127.0.0.1:{p}" for p in free_ports(3)]
    good, bad = addresses[:2], addresses[2]
    with caplog.at_level(logging.WARNING, logger="kvps.raft"):
        for address in good:
            groups.start(address, addresses)
        intruder = groups.start(bad, addresses, secret=secret, context=context)
        groups.commit(b"good-only", among=good)
        wait_for(lambda: intruder.transport_stats()["rejected"] >= 1
                 and sum(groups.groups[a].transport_stats()["rejected"] for a in good) >= 1,
                 what="rejections on both sides")
    assert groups.applied[bad] == []
    assert intruder.status()["leader"] not in good
    assert intruder.connected_peers() == []
    assert all(bad not in groups.groups[a].connected_peers() for a in good)
    assert intruder.transport_stats()["frames_received"] == 0  # nothing was ever unpickled
    assert any("failed authentication" in r.getMessage() for r in caplog.records)


# ---- (e) replayed and reflected handshakes fail ---------------------------------------------------

def test_replayed_client_handshake_fails(live):
    with connect(live.addresses[0]) as sock:
        hello, response = authenticate(sock)
        send_frame(sock, b"".join(bytes(p) for p in encode_message(["status"])))
        status = pickle.loads(decode_body_payload(recv_frame(sock)))  # trusted here: TCPNode inside
        assert status["raft_term"] >= 1
    with connect(live.addresses[0]) as sock:
        send_frame(sock, hello)
        recv_frame(sock)  # a fresh challenge
        send_frame(sock, response)  # the recorded answer to the old one
        assert closed_by_peer(sock)


def test_reflected_server_mac_fails(live):
    with connect(live.addresses[0]) as sock:
        send_frame(sock, HELLO_MAGIC + bytes((PROTOCOL_VERSION,)) + os.urandom(NONCE_BYTES))
        challenge = recv_frame(sock)
        send_frame(sock, challenge[NONCE_BYTES:])  # the server's own MAC as the client's
        assert closed_by_peer(sock)


def test_group_rejects_a_server_that_cannot_prove_the_secret(groups, caplog):
    """The dialing side checks the server's MAC; a fake or replaying server gets nothing."""
    p1, p2 = free_ports(2)
    fake, real = sorted([f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"])  # the greater address dials
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(fake.rsplit(":", 1)[1])))
    listener.listen(4)
    listener.settimeout(10)
    try:
        with caplog.at_level(logging.WARNING, logger="kvps.raft"):
            groups.start(real, [real, fake])
            recorded = None
            for attempt in ("garbage", "replay"):
                conn, _ = listener.accept()
                with conn:
                    hello = recv_frame(conn)
                    assert hello.startswith(HELLO_MAGIC)
                    if attempt == "garbage":
                        challenge = os.urandom(2 * NONCE_BYTES)
                        # Record a genuine challenge for *another* client nonce to replay next.
                        with connect(real) as other:
                            send_frame(other, HELLO_MAGIC + bytes((PROTOCOL_VERSION,)) + os.urandom(NONCE_BYTES))
                            recorded = recv_frame(other)
                    else:
                        challenge = recorded
                    send_frame(conn, challenge)
                    assert closed_by_peer(conn), "the group must hang up"
            wait_for(lambda: sum("server failed authentication" in r.getMessage()
                                 for r in caplog.records) >= 2, what="two rejections")
        assert groups.groups[real].transport_stats()["frames_sent"] == 0
    finally:
        listener.close()


def decode_body_payload(body: bytes) -> bytes:
    npickle, nbuffers = struct.unpack_from("<IH", body)
    assert nbuffers == 0
    return body[6:6 + npickle]


# ---- membership commands travel the restricted transport ----------------------------------------

def test_membership_change_commits_through_the_restricted_transport(live):
    """addNodeToCluster pickles a TCPNode inside the command bytes; on the wire it is bytes only."""
    extra = f"127.0.0.1:{free_ports(1)[0]}"
    for change in ("add", "remove"):
        done = threading.Event()
        box: list[int] = []
        leader = live.leader()
        method = leader.addNodeToCluster if change == "add" else leader.removeNodeFromCluster
        method(extra, callback=lambda r, e, box=box, done=done: (box.append(e), done.set()))
        assert done.wait(20) and box == [0], box
        wait_for(lambda c=change: all((extra in {n.address for n in g.otherNodes}) == (c == "add")
                                      for g in live.groups.values()), what=f"membership {change}")
    live.commit(b"after-membership-changes")
