"""The binary data plane: ``kvps.delta.wire`` (format), ``kvps.service.wire`` (a node's wire port)
and ``kvps_client._wire`` (the client's side), on real sockets on 127.0.0.1 with a stand-in
dispatch; ``tests/cluster/test_wire_cluster.py`` runs them in a real cluster."""
from __future__ import annotations

import asyncio
import json
import socket
import struct
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import kvps_client as kc
from kvps.delta import wire
from kvps.errors import ConnectError, InvalidRequest, KvpsError, RequestTooLarge, Unauthorized
from kvps.service.auth import TokenStore
from kvps.service.connections import connection_series
from kvps.service.wire import WireServer
from kvps_client._wire import WireTransport

TOKEN, READER = "t0ken-admin", "t0ken-read"


# ---- the format ----------------------------------------------------------------------------------

def test_request_head_round_trips_and_names_are_checked():
    head = wire.request_head(1234, 7, 3, "pull_rows", "client-1.2_x")
    fixed = head[:wire.REQUEST.size]
    body_len, rid, shard, op_len, tag_len = wire.parse_request(fixed, max_body=4096)
    assert (body_len, rid, shard) == (1234, 7, 3)
    assert wire.split_names(head[wire.REQUEST.size:], op_len) == ("pull_rows", "client-1.2_x")
    assert tag_len == len("client-1.2_x")
    with pytest.raises(RequestTooLarge):
        wire.parse_request(fixed, max_body=1000)
    with pytest.raises(InvalidRequest):  # request id 0 is the hello's
        wire.parse_request(wire.REQUEST.pack(1, 0, 0, 4, 0), max_body=10)
    with pytest.raises(InvalidRequest):
        wire.parse_request(wire.REQUEST.pack(1, 1, 0, 0, 0), max_body=10)
    with pytest.raises(InvalidRequest):
        wire.split_names(b"PUSH", 4)
    with pytest.raises(InvalidRequest):
        wire.split_names(b"pushbad tag", 4)


def test_an_insane_tag_is_left_out_instead_of_refused():
    for tag in ("has space", "x" * 65, "naïve"):
        head = wire.request_head(0, 1, 0, "keys", tag)
        assert wire.parse_request(head[:wire.REQUEST.size], 10)[4] == 0


def test_hello_is_checked():
    hello = wire.encode_hello("abc")
    assert wire.parse_hello(hello[:wire.HELLO.size]) == 3 and hello.endswith(b"abc")
    with pytest.raises(InvalidRequest):
        wire.parse_hello(wire.HELLO.pack(b"HTTP", 1, 3))
    with pytest.raises(InvalidRequest):
        wire.parse_hello(wire.HELLO.pack(wire.MAGIC, 9, 3))


# ---- server and client on real sockets -----------------------------------------------------------

class Stand:
    """A dispatch that echoes: the answer is ``[op, shard, tag, len]`` as JSON then the body.
    ``gate``: an op name whose calls wait for ``release`` (to answer out of order)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, str, bytes]] = []
        self.release = asyncio.Event()
        self.gate = "slow"

    async def __call__(self, shard, op, authorization, body, tag):
        self.calls.append((shard, op, tag, bytes(body)))
        if op == self.gate:
            await self.release.wait()
        if op == "fail":
            raise InvalidRequest("refused on purpose", shard=shard)
        if op == "boom":
            raise RuntimeError("a bug")
        return [json.dumps([op, shard, tag, len(body)]).encode() + b"|", body]


def _tokens(tmp_path: Path) -> TokenStore:
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n{READER} read\n")
    return TokenStore(path)


async def _server(tmp_path: Path, dispatch, **kw) -> tuple[WireServer, int]:
    args = dict(tokens=_tokens(tmp_path), max_body=1 << 20, body_timeout=2.0, idle_timeout=30.0,
                per_peer=8)
    args.update(kw)
    server = WireServer(dispatch, **args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    await server.start("127.0.0.1", port)
    return server, port


async def until(cond, what: str, timeout: float = 5.0) -> None:
    """Yield to the loop until ``cond()`` holds (the node side runs on this same loop)."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0)


def _answer(data: bytes | memoryview) -> tuple[list, bytes]:
    head, _, body = bytes(data).partition(b"|")
    return json.loads(head), body


def test_pipelined_requests_are_answered_as_they_finish(tmp_path):
    async def main():
        stand = Stand()
        server, port = await _server(tmp_path, stand)
        client = WireTransport(TOKEN)
        try:
            where = ("127.0.0.1", port, False)
            slow = asyncio.create_task(client.request(where, 1, "slow", kc.Body([b"first"]), timeout=5))
            await until(lambda: stand.calls, "the slow call running on the node")
            parts = [np.arange(1000, dtype=np.float32), np.ones(3, np.int64)]
            status, data = await client.request(where, 2, "push", kc.Body([b"head", *parts]),
                                                 timeout=5, tag="w-9")
            assert status == 200 and not slow.done()  # the second overtook the first
            meta, body = _answer(data)
            assert meta == ["push", 2, "w-9", 4 + 4000 + 24]
            assert body == b"head" + b"".join(p.tobytes() for p in parts)
            stand.release.set()
            status, data = await slow
            assert status == 200 and _answer(data) == (["slow", 1, _answer(data)[0][2], 5], b"first")
            assert len(client._conns) == 1 and server.requests == 2  # one connection for both
        finally:
            await client.close()
            await server.close()
    asyncio.run(main())


def test_errors_come_back_typed_and_the_connection_goes_on(tmp_path):
    async def main():
        server, port = await _server(tmp_path, Stand())
        client = WireTransport(TOKEN)
        try:
            where = ("127.0.0.1", port, False)
            status, data = await client.request(where, 0, "fail", kc.Body([b"x"]), timeout=5)
            assert status == 400 and json.loads(data)["error"] == "InvalidRequest"
            status, data = await client.request(where, 0, "boom", kc.Body([b"x"]), timeout=5)
            assert status == 500 and json.loads(data)["error"] == "KvpsError"
            status, _ = await client.request(where, 0, "keys", kc.Body([b"x"]), timeout=5)
            assert status == 200 and server.requests == 3
        finally:
            await client.close()
            await server.close()
    asyncio.run(main())


def test_a_bad_token_is_refused_at_the_hello(tmp_path):
    async def main():
        server, port = await _server(tmp_path, Stand())
        client = WireTransport("not-a-token")
        try:
            with pytest.raises(Unauthorized):
                await client.request(("127.0.0.1", port, False), 0, "keys", kc.Body([b"x"]), timeout=5)
            assert server.requests == 0
        finally:
            await client.close()
            await server.close()
    asyncio.run(main())


def test_the_role_is_checked_per_request_by_the_dispatch(tmp_path):
    """The server hands each request the connection's token; ``answer`` checks its role."""
    seen = []

    async def dispatch(shard, op, authorization, body, tag):
        seen.append(authorization)
        return [b"ok"]

    async def main():
        server, port = await _server(tmp_path, dispatch)
        client = WireTransport(READER)
        try:
            await client.request(("127.0.0.1", port, False), 0, "keys", kc.Body([b"x"]), timeout=5)
            assert seen == [f"Bearer {READER}"]
        finally:
            await client.close()
            await server.close()
    asyncio.run(main())


async def _raw(port: int, data: bytes, *, token: str = TOKEN, read: int = 2) -> list[tuple[int, int, bytes]]:
    """Send the hello, then ``data``; the first ``read`` answers (id, status, body), fewer if the
    node closes the connection first."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(wire.encode_hello(token) + data)
    out = []
    try:
        for _ in range(read):
            length, rid, status = wire.RESPONSE.unpack(await reader.readexactly(wire.RESPONSE.size))
            out.append((rid, status, await reader.readexactly(length)))
    except asyncio.IncompleteReadError:
        pass
    writer.close()
    return out


def test_hostile_bytes_get_a_typed_answer_and_the_node_keeps_serving(tmp_path):
    async def main():
        stand = Stand()
        server, port = await _server(tmp_path, stand, max_body=1000)
        try:
            # a body past the limit: refused from its header, never read, connection closed
            answers = await _raw(port, wire.request_head(5000, 5, 0, "push") + b"z" * 100)
            assert [(r, s) for r, s, _ in answers] == [(0, 200), (5, 413)]
            assert json.loads(answers[1][2])["error"] == "RequestTooLarge"
            # a malformed op name
            answers = await _raw(port, wire.REQUEST.pack(1, 6, 0, 4, 0) + b"PU$H" + b"z")
            assert answers[1][:2] == (6, 400)
            # not our protocol at all (an HTTP request)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            length, rid, status = wire.RESPONSE.unpack(await reader.readexactly(wire.RESPONSE.size))
            assert (rid, status) == (0, 400)
            assert json.loads(await reader.readexactly(length))["error"] == "InvalidRequest"
            writer.close()
            assert stand.calls == []  # nothing reached a replica
            # and the server still serves
            answers = await _raw(port, wire.request_head(3, 9, 4, "keys", "ok") + b"abc")
            assert answers[1][:2] == (9, 200) and stand.calls == [(4, "keys", "ok", b"abc")]
        finally:
            await server.close()
    asyncio.run(main())


def test_a_body_that_never_arrives_times_out(tmp_path):
    async def main():
        stand = Stand()
        server, port = await _server(tmp_path, stand, body_timeout=0.3)
        try:
            answers = await _raw(port, wire.request_head(100, 3, 0, "push") + b"only-part")
            assert [(r, s) for r, s, _ in answers] == [(0, 200), (3, 504)]
            assert stand.calls == []
        finally:
            await server.close()
    asyncio.run(main())


def _series_value(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name, {"node": "4", "server": "wire"})


def test_connections_per_peer_are_capped_and_counted(tmp_path):
    registry = CollectorRegistry()

    async def main():
        server, port = await _server(tmp_path, Stand(), per_peer=2,
                                     series=connection_series(registry, 4, "wire"))
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        try:
            await until(lambda: _series_value(registry, "kvps_connections_open") == 2, "two open")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            length, rid, status = wire.RESPONSE.unpack(await reader.readexactly(wire.RESPONSE.size))
            assert (rid, status) == (0, 429)
            assert json.loads(await reader.readexactly(length))["error"] == "Overloaded"
            assert await reader.read() == b""  # and closed
            writer.close()
            assert _series_value(registry, "kvps_connections_refused_total") == 1
            assert _series_value(registry, "kvps_connections_open") == 2  # the refused one never counted
        finally:
            for _, writer in held:
                writer.close()
            await until(lambda: _series_value(registry, "kvps_connections_open") == 0, "all closed")
            await server.close()
    asyncio.run(main())


def test_an_idle_connection_is_closed_and_counted(tmp_path):
    registry = CollectorRegistry()

    async def main():
        server, port = await _server(tmp_path, Stand(), idle_timeout=0.2,
                                     series=connection_series(registry, 4, "wire"))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(wire.encode_hello(TOKEN))
            length, _, status = wire.RESPONSE.unpack(await reader.readexactly(wire.RESPONSE.size))
            assert status == 200
            await reader.readexactly(length)
            assert await reader.read() == b""  # closed by the server once idle_timeout passed
            writer.close()
            await until(lambda: _series_value(registry, "kvps_connections_open") == 0, "closed")
            assert _series_value(registry, "kvps_connections_idle_closed_total") == 1
            assert _series_value(registry, "kvps_connections_refused_total") == 0
        finally:
            await server.close()
    asyncio.run(main())


def test_a_lost_connection_fails_pending_calls_and_the_next_call_reconnects(tmp_path):
    async def main():
        stand = Stand()
        server, port = await _server(tmp_path, stand)
        client = WireTransport(TOKEN)
        where = ("127.0.0.1", port, False)
        try:
            pending = asyncio.create_task(client.request(where, 0, "slow", kc.Body([b"x"]), timeout=5))
            await until(lambda: stand.calls, "the slow call running on the node")
            for conn in list(server.connections):  # the node drops the connection
                conn.transport.abort()
            with pytest.raises(ConnectError):
                await pending
            status, _ = await client.request(where, 0, "keys", kc.Body([b"y"]), timeout=5)
            assert status == 200
        finally:
            stand.release.set()
            await client.close()
            await server.close()
    asyncio.run(main())


def test_no_answer_in_time_is_a_connect_error(tmp_path):
    async def main():
        stand = Stand()
        server, port = await _server(tmp_path, stand)
        client = WireTransport(TOKEN)
        try:
            with pytest.raises(ConnectError):
                await client.request(("127.0.0.1", port, False), 0, "slow", kc.Body([b"x"]), timeout=0.2)
            closed = socket.socket()
            closed.bind(("127.0.0.1", 0))
            dead = closed.getsockname()[1]
            closed.close()
            with pytest.raises(ConnectError):  # nobody listens
                await client.request(("127.0.0.1", dead, False), 0, "keys", kc.Body([b"x"]), timeout=2)
        finally:
            stand.release.set()
            await client.close()
            await server.close()
    asyncio.run(main())


def test_a_connection_stops_reading_while_max_inflight_requests_run(tmp_path):
    async def main():
        stand = Stand()
        server, port = await _server(tmp_path, stand, max_inflight=2)
        client = WireTransport(TOKEN)
        where = ("127.0.0.1", port, False)
        try:
            slow = [asyncio.create_task(client.request(where, 0, "slow", kc.Body([b"x"]), timeout=5))
                    for _ in range(2)]
            await until(lambda: len(stand.calls) == 2, "two slow calls running")
            third = asyncio.create_task(client.request(where, 0, "keys", kc.Body([b"x"]), timeout=5))
            for _ in range(50):  # the node does not read the third while two run
                await asyncio.sleep(0)
            assert len(stand.calls) == 2 and not third.done()
            stand.release.set()
            assert [s for s, _ in await asyncio.gather(*slow, third)] == [200, 200, 200]
            assert len(stand.calls) == 3
        finally:
            stand.release.set()
            await client.close()
            await server.close()
    asyncio.run(main())


def test_the_error_json_decodes_to_the_kvps_error():
    from kvps_client._sender import error_from_response
    err = error_from_response(413, json.dumps(RequestTooLarge("too big", limit=1).to_dict()).encode())
    assert isinstance(err, RequestTooLarge) and isinstance(err, KvpsError)
    assert struct.calcsize("<IQHBB") == wire.REQUEST.size


def test_a_plain_bytes_body_is_sent_whole(tmp_path):
    """``Sender.send_once`` takes bytes too (the snapshot coordinator sends its own frames); the
    head must announce exactly what follows or every later request on the connection is lost."""
    async def main():
        stand = Stand()
        server, port = await _server(tmp_path, stand)
        client = WireTransport(TOKEN)
        where = ("127.0.0.1", port, False)
        try:
            for body in (b"plain-bytes", kc.Body([b"a", b"bc"]), bytearray(b"xyz")):
                status, data = await client.request(where, 1, "keys", body, timeout=5)
                assert status == 200 and _answer(data)[1] == bytes(body)
            assert len(client._conns) == 1
        finally:
            await client.close()
            await server.close()
    asyncio.run(main())


def test_large_answers_arrive_whole_into_read_only_buffers_of_their_own(tmp_path):
    """Bodies past the sockets' buffers (the client pauses writing, the answer arrives in many
    reads), pipelined: each answer lands in its own buffer, handed over as a read-only view."""
    async def main():
        server, port = await _server(tmp_path, Stand(), max_body=64 << 20)
        client = WireTransport(TOKEN)
        where = ("127.0.0.1", port, False)
        rng = np.random.default_rng(11)
        bodies = [rng.integers(0, 255, n, dtype=np.uint8) for n in (9 << 20, 1, 3 << 20 | 5)]
        try:
            answers = await asyncio.gather(*(client.request(where, 0, "pull", kc.Body([b]), timeout=30)
                                             for b in bodies))
            for body, (status, data) in zip(bodies, answers):
                assert status == 200 and isinstance(data, memoryview) and data.readonly
                assert _answer(data)[1] == body.tobytes()
            status, data = await client.request(where, 0, "fail", kc.Body([b"x"]), timeout=5)
            assert status == 400 and isinstance(data, bytes)  # an error's JSON: plain bytes
        finally:
            await client.close()
            await server.close()
    asyncio.run(main())


def test_answers_go_out_from_their_parts_in_order_and_a_reader_gone_mid_answer_is_dropped(tmp_path):
    """On plain TCP the node sends answers with sendmsg straight from their parts, never through
    the transport's buffer (which would copy what the socket does not take at once), in the
    order they are ready; a client that closes while megabytes are still queued for it is
    dropped and the node goes on serving."""
    async def main():
        server, port = await _server(tmp_path, Stand(), max_body=64 << 20)
        client = WireTransport(TOKEN)
        where = ("127.0.0.1", port, False)
        rng = np.random.default_rng(5)
        try:
            await client.request(where, 0, "keys", kc.Body([b"hi"]), timeout=5)
            copied = []
            for conn in server.connections:  # from here on, nothing may go through the transport
                conn.transport.write = copied.append
            bodies = [rng.integers(0, 255, n, dtype=np.uint8) for n in (12 << 20, 7, 5 << 20)]
            answers = await asyncio.gather(*(client.request(where, 0, "pull", kc.Body([b]), timeout=30)
                                             for b in bodies))
            assert [_answer(d)[1] for _, d in answers] == [b.tobytes() for b in bodies]
            assert copied == []
            # a raw client asks for 24 MiB twice, reads 1 KiB and goes away
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            big = bytes(24 << 20)
            writer.write(wire.encode_hello(TOKEN))
            for rid in (1, 2):
                writer.write(wire.request_head(len(big), rid, 0, "pull", "gone") + big)
            await reader.readexactly(wire.RESPONSE.size + 4)  # the hello's answer ...
            await reader.readexactly(1024)  # ... and the start of the first
            writer.transport.abort()
            await until(lambda: len(server.connections) == 1, "the gone client's connection dropped",
                        timeout=10)
            status, data = await client.request(where, 0, "keys", kc.Body([b"still"]), timeout=5)
            assert status == 200 and _answer(data)[1] == b"still"
        finally:
            await client.close()
            await server.close()
    asyncio.run(main())


def test_request_bodies_land_in_recycled_buffers_and_a_kept_body_is_never_written_over(tmp_path):
    """The node receives each body into a buffer reused once nothing refers to it (kvps.buffers):
    a body a request kept (as a log entry keeps its gradients) stays as it arrived."""
    kept: dict = {}

    async def dispatch(shard, op, authorization, body, tag):
        if op == "keep":
            kept["body"], kept["bytes"] = body, bytes(body)
        return [bytes(body[:1])]

    async def main():
        server, port = await _server(tmp_path, dispatch, max_body=4 << 20)
        client = WireTransport(TOKEN)
        where = ("127.0.0.1", port, False)
        try:
            for i, op in enumerate(["keep", "push", "push", "push", "push", "push"]):
                body = kc.Body([np.full(1 << 20, 0x11 * (i + 1), np.uint8)])
                status, data = await client.request(where, 1, op, body, timeout=5)
                assert status == 200 and bytes(data) == bytes([(0x11 * (i + 1)) & 0xFF])
            assert server.buffers.reused >= 4, (server.buffers.reused, server.buffers.allocated)
            assert bytes(kept["body"]) == kept["bytes"] == b"\x11" * (1 << 20)
        finally:
            await client.close()
            await server.close()
    asyncio.run(main())
