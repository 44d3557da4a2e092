"""The Raft peer transport under attack: nothing is unpickled before authentication, no global is
ever unpickled, frame caps hold before allocation, wrong secrets and replays never connect. At the
end, its pure pieces alone (wire format, handshake, replication patches), without sockets.

A live 3-group cluster on 127.0.0.1; attackers are plain sockets speaking the wire format from
``kvps/raft/wire.py``'s module docstring.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
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
from kvps.raft.handshake import (
    AUTHENTICATED,
    AWAIT_HELLO,
    TCP_CONNECTING,
    Handshake,
    HandshakeRejected,
)
from kvps.raft.replication import AppendPipeline, rebase_append
from kvps.raft.wire import (
    FRAME_HEADER,
    HANDSHAKE_FRAME_CAP,
    HELLO_MAGIC,
    KEEPALIVE_FRAME,
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


# ---- the pure pieces: wire format, handshake, replication patches (no sockets) ---------------------

PURE_PEER_MODULES = ["kvps.raft.wire", "kvps.raft.handshake", "kvps.raft.replication"]


@pytest.mark.parametrize("name", PURE_PEER_MODULES)
def test_pure_peer_modules_import_no_socket_thread_or_pysyncobj(name):
    """In a fresh interpreter: the package's own __init__ must not drag them in either."""
    forbidden = ["pysyncobj", "socket", "threading", "selectors", "asyncio"]
    code = (f"import importlib, sys; importlib.import_module({name!r}); "
            f"print(sorted(m for m in {forbidden!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"{name} pulls in {proc.stdout.strip()}"


def test_the_import_check_would_notice():
    code = "import sys, kvps.raft.transport; print('socket' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "True", proc.stderr


def test_wire_refuses_inconsistent_bodies():
    body = b"".join(bytes(p) for p in encode_message({"entries": [(b"e" * 20000, 1, 1)]}))
    assert decode_message(memoryview(body))["entries"][0][0] == b"e" * 20000
    with pytest.raises(ValueError, match="add up"):
        decode_message(memoryview(body[:-1]))  # an out-of-band buffer cut short
    with pytest.raises(ValueError, match="layout"):
        decode_message(memoryview(struct.pack("<IH", 0, 5000)))  # more buffers than allowed
    assert FRAME_HEADER.unpack(KEEPALIVE_FRAME) == (0,)
    assert len(HELLO_MAGIC) + 1 + NONCE_BYTES <= HANDSHAKE_FRAME_CAP


def run_handshake(client: Handshake, server: Handshake) -> None:
    challenge = server.receive(client.hello())
    response = client.receive(challenge)
    assert client.authenticated and not server.authenticated  # the client checked the server first
    assert server.receive(response) == b""


def test_handshake_authenticates_both_sides():
    client = Handshake(SECRET, CONTEXT.encode(), incoming=False)
    server = Handshake(SECRET, CONTEXT.encode(), incoming=True)
    assert (client.phase, server.phase) == (TCP_CONNECTING, AWAIT_HELLO)
    run_handshake(client, server)
    assert client.phase == server.phase == AUTHENTICATED


@pytest.mark.parametrize("secret,context", [(b"another-secret-0123456789abcdef0123", CONTEXT),
                                            (SECRET, "test/shard=8")])
def test_handshake_with_another_secret_or_context_fails_on_both_sides(secret, context):
    server = Handshake(SECRET, CONTEXT.encode(), incoming=True)
    client = Handshake(secret, context.encode(), incoming=False)
    challenge = server.receive(client.hello())
    with pytest.raises(HandshakeRejected, match="server failed authentication"):
        client.receive(challenge)
    forged = handshake_mac(secret, context.encode(), b"client", b"n" * NONCE_BYTES, challenge[:NONCE_BYTES])
    with pytest.raises(HandshakeRejected, match="client failed authentication"):
        server.receive(forged)


def test_handshake_refuses_replays_reflections_and_bad_frames():
    nonces = iter([b"c" * NONCE_BYTES, b"s" * NONCE_BYTES, b"t" * NONCE_BYTES])
    take = lambda n: next(nonces)  # noqa: E731 - a recorded exchange, then a new server nonce
    first_client = Handshake(SECRET, b"ctx", incoming=False, nonce=take)
    first_server = Handshake(SECRET, b"ctx", incoming=True, nonce=take)
    hello = first_client.hello()
    response = first_client.receive(first_server.receive(hello))
    replayed = Handshake(SECRET, b"ctx", incoming=True, nonce=take)
    challenge = replayed.receive(hello)  # a fresh server nonce ...
    with pytest.raises(HandshakeRejected, match="replay"):
        replayed.receive(response)  # ... so the recorded response no longer checks
    reflected = Handshake(SECRET, b"ctx", incoming=True)
    challenge = reflected.receive(Handshake(SECRET, b"ctx", incoming=False).hello())
    with pytest.raises(HandshakeRejected, match="client failed"):
        reflected.receive(challenge[NONCE_BYTES:])  # the server's own MAC as the client's
    for frame, reason in ((b"HELLO", "bad hello"),
                          (HELLO_MAGIC + bytes((PROTOCOL_VERSION + 1,)) + bytes(NONCE_BYTES),
                           "unsupported protocol version")):
        with pytest.raises(HandshakeRejected, match=reason):
            Handshake(SECRET, b"ctx", incoming=True).receive(frame)
    client = Handshake(SECRET, b"ctx", incoming=False)
    with pytest.raises(HandshakeRejected, match="before the connection"):
        client.receive(b"x")
    client.hello()
    with pytest.raises(HandshakeRejected, match="bad challenge"):
        client.receive(b"short")


def log_of(*terms: int, first: int = 1) -> list[tuple[bytes, int, int]]:
    return [(b"e%d" % i, first + i, t) for i, t in enumerate(terms)]


def append(prev: int, prev_term: int, term: int, entries: list) -> dict:
    return {"type": "append_entries", "term": term, "commit_index": 0, "prevLogIdx": prev,
            "prevLogTerm": prev_term, "entries": entries}


def test_rebase_keeps_entries_a_stale_append_would_truncate():
    log = log_of(1, 2, 2, 2)  # indexes 1..4, our last entry is of the leader's term 2
    stale = append(2, 2, 2, log[2:3] + [(b"e5", 5, 2)])  # re-sends 3, adds 5
    rebased = rebase_append(log, stale)
    assert rebased["prevLogIdx"] == 4 and rebased["prevLogTerm"] == 2
    assert rebased["entries"] == [(b"e5", 5, 2)]


def test_rebase_leaves_conflicts_other_terms_and_snapshots_to_syncobj():
    log = log_of(1, 2, 2, 2)
    unchanged = [
        append(2, 2, 2, [(b"x", 3, 1)]),  # a real conflict: Raft truncates
        append(2, 1, 2, []),  # prevLogTerm mismatch: SyncObj answers with a reset
        append(2, 2, 3, []),  # our last entry is not of the sender's term
        append(4, 2, 2, []),  # nothing to keep: at our end already
        {**append(2, 2, 2, []), "serialized": (b"", True, False)},
    ]
    unchanged.append(append(0, 0, 2, []))
    for message in unchanged:
        assert rebase_append(log if message["prevLogIdx"] else [], message) is message


def test_append_pipeline_restores_next_index_and_defers_on_a_full_queue():
    pipeline = AppendPipeline(queue_cap=100)
    sent = append(3, 2, 2, log_of(2, 2, first=4))  # entries 4 and 5 in flight
    assert not pipeline.must_defer("n", sent, lambda: 100)
    pipeline.after_send("n", sent, True)
    behind = {"type": "next_node_idx", "next_node_idx": 5, "reset": False, "success": True}
    assert pipeline.after_reply("n", behind, True, 2) == {
        "type": "next_node_idx", "next_node_idx": 6, "reset": True, "success": False}
    assert pipeline.after_reply("n", behind, True, 3) is None  # another term
    assert pipeline.after_reply("n", behind, False, 2) is None  # no longer leading
    pipeline.after_reply("n", {**behind, "reset": True}, True, 2)  # a real reset: forgotten
    assert pipeline.after_reply("n", behind, True, 2) is None
    assert pipeline.must_defer("n", sent, lambda: 101)
    assert not pipeline.must_defer("n", append(3, 2, 2, []), lambda: 101)  # heartbeats still go


def _connected_pair(max_frame: int = 8 << 20):
    """Two authenticated PeerConnections on 127.0.0.1 and the poller they run on."""
    from pysyncobj.poller import createPoller

    from kvps.raft.connection import PeerConnection
    from kvps.raft.peer_settings import PeerSettings, TransportStats

    settings = PeerSettings(b"s" * 32, b"ctx", max_frame, 0, TransportStats())
    poller = createPoller("auto")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    outgoing = PeerConnection(settings, poller, 5.0, None, peer="incoming")
    outgoing.connect("127.0.0.1", server.getsockname()[1])
    sock, _ = server.accept()
    server.close()
    sock.setblocking(False)
    incoming = PeerConnection(settings, poller, 5.0, None, sock=sock, peer="outgoing")
    return poller, outgoing, incoming


def test_a_received_entry_is_never_in_a_buffer_that_is_reused():
    """Entries of a large frame stay views of that frame's own buffer (no copy on a follower);
    entries parsed out of the reused staging buffer are copies. Every entry held while more
    traffic arrives keeps its bytes: were a staging buffer's entries views, the next frames
    would overwrite them (checked with entries of 16-200 KiB, the out-of-band sizes that fit
    the 256 KiB staging buffer)."""
    poller, outgoing, incoming = _connected_pair()
    got: list = []
    incoming.setOnMessageReceivedCallback(got.append)
    try:
        from pysyncobj.tcp_connection import CONNECTION_STATE
        wait_for(lambda: (poller.poll(0.01), incoming._handshake.authenticated
                          and outgoing.state == CONNECTION_STATE.CONNECTED)[1], 10, "the handshake")
        sent = []
        for round_ in range(6):
            fill = bytes([65 + round_])  # every round's entries hold other bytes
            big = {"type": "append_entries", "entries": [(fill * 300_000, 2 * round_, 1),
                                                        (fill * 123_457, 2 * round_ + 1, 1)]}
            small = {"type": "append_entries", "entries": [(fill * 20_000 + bytes([round_]), 9, 1)]}
            for message in (big, small, small):
                outgoing.send(message)
                sent.append(message)
            wait_for(lambda: (poller.poll(0.01), len(got) == len(sent))[1], 10, "the messages")
        for message, received in zip(sent, got):
            for (want, _, _), (have, _, _) in zip(message["entries"], received["entries"]):
                assert bytes(have) == want  # still, after every later frame
        kinds = {(len(m["entries"]), type(r["entries"][0][0]).__name__) for m, r in zip(sent, got)}
        assert kinds == {(2, "memoryview"), (1, "bytes")}, kinds
        views = [r["entries"][0][0] for r in got if len(r["entries"]) == 2]
        assert all(v.readonly for v in views)
        # a view sent on (this follower become leader) travels out of band, as bytes do
        again = decode_message(memoryview(b"".join(bytes(p) for p in encode_message(got[0]))))
        assert again["entries"][0][0] == sent[0]["entries"][0][0]
    finally:
        outgoing.disconnect()
        incoming.disconnect()
