"""Workers' push rings: the layout (``kvps.delta.ring``), the client's ring (``kvps_client._ring``),
the node's reader (``kvps.service.ring``), and both ends on a real wire connection with a
stand-in dispatch; ``tests/cluster/test_shm_pushes.py`` runs them in a real cluster."""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvps_client as kc
from kvps.delta import ring
from kvps.errors import InvalidRequest, RequestTooLarge, RingUnavailable
from kvps.service.ring import Rings
from kvps_client._ring import PushRing, supported
from kvps_client._wire import WireTransport
from test_wire import TOKEN, Stand, _server

pytestmark = pytest.mark.skipif(not supported(), reason="push rings need memfd_create and file seals")


@pytest.fixture
def push_ring():
    r = PushRing(1 << 20)
    try:
        yield r
    finally:
        r.close()


def _desc(descriptor: bytes) -> ring.Descriptor:
    return ring.parse_descriptor(descriptor, max_body=1 << 30)


def test_descriptors_round_trip_and_are_checked():
    raw = ring.encode_descriptor(123, 7, b"n" * 16, 4096, 5000)
    assert ring.is_descriptor(raw) and not ring.is_descriptor(raw[:-1])
    assert not ring.is_descriptor(b"KVPF" + raw[4:])  # a frame's magic: an inline body
    d = _desc(raw)
    assert (d.pid, d.fd, d.nonce, d.offset, d.length) == (123, 7, b"n" * 16, 4096, 5000)
    with pytest.raises(RequestTooLarge):
        ring.parse_descriptor(raw, max_body=4999)
    for bad in (ring.encode_descriptor(123, 7, b"n" * 16, 0, 10),    # inside the header
                ring.encode_descriptor(123, 7, b"n" * 16, 4096, 0),  # empty
                ring.encode_descriptor(0, 7, b"n" * 16, 4096, 10),
                ring.DESCRIPTOR.pack(b"KVPR", 2, 1, 1, b"n" * 16, 4096, 10)):
        with pytest.raises(InvalidRequest):
            _desc(bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 24).map(lambda k: k * 1000 - k), st.integers(0, 99)),
                max_size=80))
def test_places_never_overlap_a_held_one_and_keep_their_bytes(ops):
    """Random places and out-of-order releases against a model: every held place keeps the bytes
    written into it, lies inside the ring past its header, and a body that fits nowhere is None."""
    r = PushRing(1 << 16)  # a few places at once: the ring wraps often
    try:
        held = {}  # offset -> (place, bytes written)
        for n, (do_place, length, pick) in enumerate(ops):
            if do_place or not held:
                data = np.full(length, n % 251, np.uint8)
                got = r.place([data[: length // 2], data[length // 2:]])
                if got is None:
                    continue
                d = _desc(got[0])
                assert d.length == length and ring.HEADER <= d.offset and d.offset + length <= r.size
                for off, (place, old) in held.items():
                    assert d.offset + length <= off or off + len(old) <= d.offset, "overlaps a held place"
                held[d.offset] = (got[1], data)
            else:
                off = sorted(held)[pick % len(held)]
                r.release(held.pop(off)[0])
            for off, (_, data) in held.items():
                assert np.array_equal(r._bytes[off:off + len(data)], data)
        for place, _ in list(held.values()):
            r.release(place)
        assert r.in_use == 0 and r.place([b"x" * (r.size - ring.HEADER)]) is not None  # all of it free again
    finally:
        r.close()


def test_the_node_copies_a_body_out_before_it_is_read(push_ring):
    body = np.random.default_rng(5).integers(0, 255, 200_000, dtype=np.uint8)
    descriptor, place = push_ring.place([body])
    rings = Rings()
    try:
        copy = rings.copy(_desc(descriptor), lambda n: np.empty(n, np.uint8))
        assert np.array_equal(copy, body)
        push_ring._bytes[ring.HEADER:] = 0xAB  # the worker writes over its ring afterwards
        assert np.array_equal(copy, body), "the node's copy changed with the worker's ring"
        assert rings.copied == 1 and rings.copied_bytes == body.nbytes
        for peer in ("10.0.0.7", "192.168.1.2", "::2"):  # rings are read for clients on this host only
            with pytest.raises(RingUnavailable):
                rings.body(descriptor, peer=peer, max_body=1 << 20, take=np.empty)
        again = rings.body(descriptor, peer="127.0.0.1", max_body=1 << 20, take=np.empty)
        assert np.array_equal(again, np.full_like(body, 0xAB))
        d = _desc(descriptor)
        with pytest.raises(InvalidRequest):  # past the ring's end
            rings.copy(ring.Descriptor((d.pid, d.fd, d.nonce, push_ring.size - 10, 11)), np.empty)
    finally:
        rings.close()


def test_rings_that_are_not_the_senders_are_refused(push_ring, tmp_path):
    """A wrong nonce, a memfd that is not sealed, a plain file, a FIFO (opened without waiting),
    a descriptor number that is not open: ``RingUnavailable``, and nothing is read."""
    rings = Rings()
    good = _desc(push_ring.place([b"y" * 100])[0])
    pid = os.getpid()

    def refused(fd: int, nonce: bytes = good.nonce) -> None:
        with pytest.raises(RingUnavailable):
            rings.copy(ring.Descriptor((pid, fd, nonce, ring.HEADER, 10)), np.empty)

    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 1 << 16)
    with mmap.mmap(unsealed, 1 << 16) as m:  # the right header, but it could shrink under a reader
        m[:len(ring.MAGIC) + 16] = ring.MAGIC + good.nonce
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
    os.write(plain, ring.MAGIC + good.nonce + b"\0" * 100)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fifo_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        refused(good.fd, b"w" * 16)
        refused(unsealed)
        refused(plain)
        refused(fifo_fd)
        refused(4000)  # not open
        assert fcntl.fcntl(push_ring.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        assert rings.copied == 0
    finally:
        for fd in (unsealed, plain, fifo_fd):
            os.close(fd)
        rings.close()


@contextlib.asynccontextmanager
async def _ring_stand(tmp_path, ring_bytes: int, **server_kw):
    """A wire server with the echoing stand-in dispatch and a ring client on loopback:
    ``(stand, server, client, where)``, both closed afterwards."""
    stand = Stand()
    server, port = await _server(tmp_path, stand, **server_kw)
    client = WireTransport(TOKEN, ring=True, ring_bytes=ring_bytes)
    try:
        yield stand, server, client, ("127.0.0.1", port, False)
    finally:
        await client.close()
        await server.close()


def test_bodies_travel_through_the_ring_and_small_ones_inline(tmp_path):
    async def main():
        async with _ring_stand(tmp_path, 4 << 20, max_body=8 << 20) as (stand, server, client, where):
            big = np.arange(300_000, dtype=np.float32)
            status, data = await client.request(where, 1, "push", kc.Body([b"head", big]), timeout=5)
            assert status == 200 and stand.calls[-1][3] == b"head" + big.tobytes()
            assert client.ring_requests == 1 and client.ring_bytes_sent == 4 + big.nbytes
            assert client._ring.in_use == 0, "the answered request's place was not freed"
            parents = client._ring
            parents.pid = 1  # as a forked child sees its parent's ring: it makes its own
            await client.request(where, 1, "push", kc.Body([big]), timeout=5)
            assert client._ring is not parents and client.ring_requests == 2
            parents.close()
            await client.request(where, 1, "push", kc.Body([b"small"]), timeout=5)
            assert client.ring_requests == 2 and stand.calls[-1][3] == b"small"
            # more than the ring holds at once: the rest inline, all answered right
            bodies = [np.full(400_000, i, np.float32) for i in range(6)]
            answers = await asyncio.gather(*(client.request(where, 0, "push", kc.Body([b]), timeout=5)
                                             for b in bodies))
            assert all(s == 200 for s, _ in answers)
            assert sorted(c[3] for c in stand.calls[-6:]) == sorted(b.tobytes() for b in bodies)
            assert client.ring_inline >= 1 and client.ring_requests >= 3
    asyncio.run(main())


def test_a_node_that_cannot_read_the_ring_gets_bodies_inline(tmp_path):
    async def main():
        async with _ring_stand(tmp_path, 1 << 20) as (stand, server, client, where):
            body = np.ones(100_000, np.float32)
            await client.request(where, 0, "push", kc.Body([body]), timeout=5)  # makes the ring
            client._ring._bytes[len(ring.MAGIC)] ^= 0xFF  # its nonce no longer matches
            client._ring._bytes[len(ring.MAGIC) + 1] ^= 0xFF
            server_side = next(iter(server.connections))
            server_side.rings.close()  # (the node forgets the mapping it has)
            status, _ = await client.request(where, 0, "push", kc.Body([body * 2]), timeout=5)
            assert status == 200 and stand.calls[-1][3] == (body * 2).tobytes()  # resent inline
            assert where in client._no_ring
            sent = client.ring_requests
            await client.request(where, 0, "push", kc.Body([body * 3]), timeout=5)
            assert client.ring_requests == sent and stand.calls[-1][3] == (body * 3).tobytes()
    asyncio.run(main())


def test_a_request_without_an_answer_gives_its_ring_up(tmp_path):
    """The node may still read a place whose request got no answer: the ring is never written
    again; the next body goes through a fresh one."""
    async def main():
        async with _ring_stand(tmp_path, 1 << 20) as (stand, server, client, where):
            body = np.ones(100_000, np.float32)
            with pytest.raises(kc.ConnectError):  # the "slow" op is held until released
                await client.request(where, 0, "slow", kc.Body([body]), timeout=0.5)
            assert client.rings_abandoned == 1 and client._ring is None
            stand.release.set()
            status, _ = await client.request(where, 0, "push", kc.Body([body * 5]), timeout=5)
            assert status == 200 and stand.calls[-1][3] == (body * 5).tobytes()
            assert client._ring is not None and client.ring_requests == 2
    asyncio.run(main())
