"""A request body travels as the frame's parts, never joined in the client (``kc.Body``)."""
from __future__ import annotations

import asyncio
import json

import numpy as np

import kvps_client as kc
from kvps.delta import frame
from kvps_client._transport import _PartsPayload

N = 1 << 16  # float32s: 256 KiB, past the size small gradients are packed (copied) at
CLUSTER = {
    "cluster": {"shards": 1, "replicas": 1, "block_bytes": 1 << 20, "max_push_bytes": 1 << 20},
    "nodes": [],
    "shards": [{"id": 0, "leader": "http://r0", "leader_url": "http://r0", "term": 1,
                "replicas": [{"node": 0, "data_url": "http://r0"}]}],
}
INFO = {"key": "w", "kind": "dense", "shape": [N], "dtype": "float32", "block_rows": N,
        "optimizer": {"name": "add"}, "merge": "sum", "blocks": [0]}


class Recording(kc.MockTransport):
    """Keeps every request's body as the transport was given it; the first push is refused
    (retryable), so the call sends its body twice."""

    def __init__(self) -> None:
        super().__init__(self._answer)
        self.bodies: list = []
        self.refused = False

    async def request(self, method, url, body, **kw):
        if url.endswith("/v1/rpc/push"):
            self.bodies.append(body)
        return await super().request(method, url, body, **kw)

    async def _answer(self, method, url, body, headers):
        if url.endswith("/v1/cluster"):
            return 200, json.dumps(CLUSTER).encode()
        if url.endswith("/describe"):
            return 200, frame.encode(frame.KIND_RESPONSE, {"info": INFO})
        if not self.refused:
            self.refused = True
            err = kc.Overloaded("busy")
            return err.http_status, json.dumps(err.to_dict()).encode()
        return 200, frame.encode(frame.KIND_RESPONSE, {"versions": {"w": 1}})


async def no_sleep(_):  # the client's back-off, skipped
    return None


def test_a_push_body_is_views_of_the_gradient_and_its_retry_resends_the_same_body():
    grad = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    transport = Recording()

    async def main():
        async with kc.Client(["http://r0"], token="t", transport=transport, seed=0, sleep=no_sleep) as ps:
            await ps.push({"w": grad})

    asyncio.run(main())
    first, retry = transport.bodies
    assert retry is first                          # encoded once per call
    assert isinstance(first, kc.Body) and len(first) == sum(len(p) for p in first.parts)
    assert any(np.shares_memory(np.frombuffer(p, np.uint8), grad) for p in first.parts)
    sent = frame.decode(bytes(first))              # what the replica receives
    (item,) = sent.meta["dense"]
    assert np.array_equal(sent.arrays[item["array"]], grad)


class Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    async def write(self, chunk) -> None:
        self.out += chunk


def test_the_payload_writes_every_part_in_order_and_stops_at_a_shorter_length():
    body = kc.Body([b"head", np.arange(5, dtype=np.int32), memoryview(b"tail")])
    joined = b"head" + np.arange(5, dtype=np.int32).tobytes() + b"tail"
    assert bytes(body) == joined and len(body) == len(joined)

    async def write(length):
        w = Writer()
        payload = _PartsPayload(body)
        assert payload.size == len(joined)
        if length is None:
            await payload.write(w)
        else:
            await payload.write_with_length(w, length)
        return bytes(w.out)

    assert asyncio.run(write(None)) == joined
    for length in (0, 3, 4, 10, len(joined)):
        assert asyncio.run(write(length)) == joined[:length]
