"""Client routing, retry and exactly-once bookkeeping against an in-memory transport (no network)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

import kvps_client as kc
from kvps.delta import frame
from kvps.errors import InvalidRequest, NotLeader, Overloaded, Unauthorized

URLS = ["http://r0", "http://r1", "http://r2"]
CLUSTER = {
    "cluster": {"shards": 1, "replicas": 3, "block_bytes": 1 << 20, "max_push_bytes": 1 << 20},
    "nodes": [],
    "shards": [{"id": 0, "leader": None, "leader_url": None, "term": 1,
                "replicas": [{"node": i, "data_url": u} for i, u in enumerate(URLS)]}],
}
INFO = {"key": "w", "kind": "dense", "shape": [4], "dtype": "float32", "block_rows": 4,
        "optimizer": {"name": "add"}, "merge": "sum", "blocks": [0]}


class FakeShard:
    """Replica r2 leads; r0/r1 answer NotLeader (r0 with a hint, r1 without)."""

    def __init__(self, fail_pushes: int = 0, error=None):
        self.fail_pushes = fail_pushes
        self.error = error
        self.pushes: list[dict] = []

    async def __call__(self, method, url, body, headers):
        if url.endswith("/v1/cluster"):
            return 200, json.dumps(CLUSTER).encode()
        base, op = url.split("/v1/rpc/")
        if self.error is not None:
            return self.error.http_status, json.dumps(self.error.to_dict()).encode()
        if base != URLS[2]:
            hint = URLS[2] if base == URLS[0] else None
            err = NotLeader(0, leader_hint=hint)
            return err.http_status, json.dumps(err.to_dict()).encode()
        req = frame.decode(body)
        if op == "describe":
            return 200, frame.encode(frame.KIND_RESPONSE, {"info": INFO})
        if op == "push":
            self.pushes.append(req.meta)
            if self.fail_pushes:
                self.fail_pushes -= 1
                err = Overloaded("busy")
                return err.http_status, json.dumps(err.to_dict()).encode()
            return 200, frame.encode(frame.KIND_RESPONSE, {"versions": {"w": len(self.pushes)}})
        raise AssertionError(op)


async def no_sleep(_):
    await asyncio.sleep(0)


def make(handler, **kw) -> kc.Client:
    kw.setdefault("sleep", no_sleep)
    return kc.Client(["http://admin"], token="t", transport=kc.MockTransport(handler), seed=0, **kw)


def test_not_leader_hint_is_followed_and_remembered():
    fake = FakeShard()

    async def main():
        async with make(fake) as ps:
            await ps.push({"w": np.ones(4, np.float32)})
            first = list(ps._transport.requests)
            await ps.push({"w": np.ones(4, np.float32)})
            return first, ps._transport.requests[len(first):], ps.stats

    first, second, stats = asyncio.run(main())
    rpc = [url for _, url in first if "/v1/rpc/" in url]
    assert rpc[-1] == "http://r2/v1/rpc/push"
    for i, url in enumerate(rpc[:-1]):
        if url.startswith("http://r0"):                      # r0 hints at r2: followed at once
            assert rpc[i + 1].startswith("http://r2")
    assert stats.redirects == sum(not u.startswith("http://r2") for u in rpc)
    assert second == [("POST", "http://r2/v1/rpc/push")]     # the leader is remembered


def test_retryable_errors_are_retried_with_the_same_push_id():
    fake = FakeShard(fail_pushes=3)

    async def main():
        async with make(fake) as ps:
            return await ps.push({"w": np.ones(4, np.float32)}), ps.stats.retries

    versions, retries = asyncio.run(main())
    assert retries >= 3
    ids = {(m["client"], m["seq"]) for m in fake.pushes}
    assert len(fake.pushes) == 4 and len(ids) == 1            # four attempts, one push id
    assert versions == {"w": 4}


def test_floor_is_the_lowest_seq_still_waiting():
    fake = FakeShard()

    async def main():
        async with make(fake) as ps:
            for _ in range(3):
                await ps.push({"w": np.ones(4, np.float32)})

    asyncio.run(main())
    assert [(m["seq"], m["floor"]) for m in fake.pushes] == [(1, 1), (2, 2), (3, 3)]


def test_rejections_are_not_retried():
    fake = FakeShard(error=Unauthorized("bad token"))

    async def main():
        async with make(fake):
            pass

    # the map fetch succeeds (the fake serves /v1/cluster to anyone); describe is refused at once
    async def push():
        async with make(fake) as ps:
            await ps.push({"w": np.ones(4, np.float32)})

    asyncio.run(main())
    with pytest.raises(kc.Unauthorized):
        asyncio.run(push())


def test_deadline_turns_endless_retries_into_timeout():
    fake = FakeShard(fail_pushes=10**9)

    async def main():
        async with make(fake, timeout=0.2) as ps:
            await ps.push({"w": np.ones(4, np.float32)})

    with pytest.raises(kc.Timeout):
        asyncio.run(main())


def test_shape_checked_before_anything_is_sent():
    fake = FakeShard()

    async def main():
        async with make(fake) as ps:
            with pytest.raises(kc.ShapeMismatch):
                await ps.push({"w": np.ones(5, np.float32)})

    asyncio.run(main())
    assert fake.pushes == []


class Failover:
    """No replica knows a leader for the first ``blind`` requests (an election under way); then r0
    and r1 hint at r2, which serves. ``hint_loop``: r0 and r1 hint at each other forever."""

    def __init__(self, blind: int = 0, hint_loop: bool = False):
        self.blind = blind
        self.hint_loop = hint_loop
        self.log: list[str] = []

    async def __call__(self, method, url, body, headers):
        if url.endswith("/v1/cluster"):
            return 200, json.dumps(CLUSTER).encode()
        base, op = url.split("/v1/rpc/")
        self.log.append(base)
        if op == "describe" and base == URLS[2]:
            return 200, frame.encode(frame.KIND_RESPONSE, {"info": INFO})
        if self.hint_loop:
            err = NotLeader(0, leader_hint=URLS[1] if base == URLS[0] else URLS[0])
        elif self.blind > 0 or base != URLS[2]:
            self.blind -= 1
            err = NotLeader(0, leader_hint=URLS[2] if self.blind < 0 else None)
        else:
            return 200, frame.encode(frame.KIND_RESPONSE, {"versions": {"w": 1}})
        return err.http_status, json.dumps(err.to_dict()).encode()


def test_a_hint_late_in_a_call_is_followed_at_once():
    """After several back-offs (no leader known), the first fresh hint is followed without one more."""
    fake = Failover(blind=1)

    sleeps: list[int] = []

    async def sleep(_):
        sleeps.append(len(fake.log))

    async def main():
        async with make(fake, sleep=sleep) as ps:
            await ps.describe("w")  # layout known: the push below is the only call
            fake.blind, fake.log = 6, []
            sleeps.clear()
            await ps.push({"w": np.ones(4, np.float32)})
            return fake.log, sleeps

    log, sleeps = asyncio.run(main())
    assert log[-1] == URLS[2] and log[-2] != URLS[2]   # the hinted NotLeader, then the leader
    assert sleeps[-1] < len(log) - 1                   # no back-off between them
    assert len(sleeps) >= 5                            # it was late in the call


def test_hints_that_point_in_a_loop_are_followed_at_most_twice_per_back_off():
    fake = Failover(hint_loop=True)
    sleeps: list[int] = []

    async def sleep(_):
        sleeps.append(len(fake.log))
        await asyncio.sleep(0)

    async def main():
        async with kc.Client(["http://admin"], token="t", transport=kc.MockTransport(fake), seed=0,
                             sleep=sleep, timeout=0.2) as ps:
            ps.cluster_map.set_leader(0, URLS[0])
            await ps.push({"w": np.zeros(4, np.float32)})

    with pytest.raises(kc.Timeout):
        asyncio.run(main())
    requests_between = [b - a for a, b in zip([0, *sleeps], sleeps)]
    assert requests_between and max(requests_between) <= 3


def test_a_replica_that_refused_the_connection_is_not_asked_again_next():
    """The leader was killed: its port refuses connections, and a follower that has not noticed yet
    still hints at it. The client tries another replica next, not the dead one again."""
    log: list[str] = []

    async def handler(method, url, body, headers):
        if url.endswith("/v1/cluster"):
            return 200, json.dumps(CLUSTER).encode()
        base, op = url.split("/v1/rpc/")
        log.append(base)
        if base == URLS[2]:
            raise kc.ConnectError(url, "connection refused")  # what HttpTransport raises
        if base == URLS[0]:
            err = NotLeader(0, leader_hint=URLS[2])  # stale
            return err.http_status, json.dumps(err.to_dict()).encode()
        if op == "describe":
            return 200, frame.encode(frame.KIND_RESPONSE, {"info": INFO})
        return 200, frame.encode(frame.KIND_RESPONSE, {"versions": {"w": 1}})

    async def main():
        for seed in range(20):
            async with kc.Client(["http://admin"], token="t", transport=kc.MockTransport(handler),
                                 seed=seed, sleep=no_sleep, timeout=5) as ps:
                ps._infos["w"] = INFO
                ps.cluster_map.set_leader(0, URLS[2])
                log.clear()
                await ps.push({"w": np.ones(4, np.float32)})
                assert log[-1] == URLS[1]
                assert log.count(URLS[2]) <= 2 and all(a != b for a, b in zip(log, log[1:]) if a == URLS[2]), log

    asyncio.run(main())


@pytest.mark.parametrize("hosts, deltas, wanted", [
    (["127.0.0.1:7101", "127.0.0.2:7101", "[::1]:7101"], "auto", False),  # this host: raw is cheaper
    (["localhost:7101", "localhost:7102", "localhost:7103"], "auto", False),
    (["10.0.0.1:7101", "127.0.0.1:7101", "127.0.0.1:7102"], "auto", True),  # one remote replica
    (["ps-0.kvps:7101", "ps-1.kvps:7101", "ps-2.kvps:7101"], "auto", True),  # names: not resolved
    (["127.0.0.1:7101", "127.0.0.1:7102", "127.0.0.1:7103"], True, True),
    (["10.0.0.1:7101", "10.0.0.2:7101", "10.0.0.3:7101"], False, False),
])
def test_pulls_ask_for_xor_deltas_unless_every_replica_is_on_this_host(hosts, deltas, wanted):
    urls = [f"http://{h}" for h in hosts]
    cluster = {**CLUSTER, "shards": [{**CLUSTER["shards"][0], "leader_url": urls[0],
                                      "replicas": [{"node": i, "data_url": u} for i, u in enumerate(urls)]}]}
    asked: list[dict] = []

    async def handler(method, url, body, headers):
        if url.endswith("/v1/cluster"):
            return 200, json.dumps(cluster).encode()
        op = url.split("/v1/rpc/")[1]
        req = frame.decode(body)
        if op == "describe":
            return 200, frame.encode(frame.KIND_RESPONSE, {"info": INFO})
        asked.append(req.meta)
        return 200, frame.encode(frame.KIND_RESPONSE, {"blocks": [
            {"key": "w", "block": 0, "version": 1, "array": 0}]}, [np.zeros(4, np.float32)])

    async def main():
        async with make(handler, deltas=deltas) as ps:
            await ps.pull(["w"])

    asyncio.run(main())
    assert [m["delta"] for m in asked] == [wanted]


def test_deltas_setting_is_checked():
    with pytest.raises(kc.InvalidRequest):
        make(FakeShard(), deltas="sometimes")


class FiniteShard(FakeShard):
    """Like the server: a push whose (widened) gradient holds NaN or Inf is refused."""

    def __init__(self, fail_next: bool = False):
        super().__init__()
        self.fail_next = fail_next

    async def __call__(self, method, url, body, headers):
        if url.endswith("/v1/rpc/push") and url.startswith(URLS[2]):
            req = frame.decode(body)
            if self.fail_next or not all(np.isfinite(a.astype(np.float32)).all() for a in req.arrays):
                self.fail_next = False
                err = kc.InvalidRequest("gradient contains NaN or Inf")
                return err.http_status, json.dumps(err.to_dict()).encode()
        return await super().__call__(method, url, body, headers)


def test_fp16_push_of_a_value_beyond_its_range_is_sent_exactly_and_later_pushes_still_work():
    fake = FiniteShard()

    async def main():
        async with make(fake, push_codec="fp16") as ps:
            await ps.push({"w": np.array([1.0, 1e5, 1.0, 1.0], np.float32)})
            await ps.push({"w": np.ones(4, np.float32)})
            return ps._lossy.residual

    residual = asyncio.run(main())
    assert [d.get("encoding") for m in fake.pushes for d in m["dense"]] == [None, "fp16"]
    assert all(np.isfinite(r).all() for r in residual.values())


def test_lossy_residual_counts_only_once_the_push_is_acknowledged():
    fake = FiniteShard()
    g = np.full(4, 1.0 + 2**-13, np.float32)  # fp16 drops the 2**-13

    async def main():
        async with make(fake, push_codec="fp16") as ps:
            await ps.push({"w": g})
            kept = ps._lossy.residual[("w", 0)].copy()
            fake.fail_next = True
            with pytest.raises(kc.InvalidRequest):
                await ps.push({"w": g})
            return kept, ps._lossy.residual[("w", 0)]

    kept, after = asyncio.run(main())
    np.testing.assert_array_equal(after, kept)  # the refused push left the residual as it was


def test_a_pull_in_flight_survives_a_concurrent_create_of_its_key():
    """create() drops the key's cached blocks; a pull waiting for its reply meanwhile used to look
    its cache up again afterwards and fail with a KeyError (seen with KvpsStore's threads)."""
    release, pulling = asyncio.Event(), asyncio.Event()

    async def handler(method, url, body, headers):
        if url.endswith("/v1/cluster"):
            return 200, json.dumps(CLUSTER).encode()
        base, op = url.split("/v1/rpc/")
        if base != URLS[2]:
            err = NotLeader(0, leader_hint=URLS[2])
            return err.http_status, json.dumps(err.to_dict()).encode()
        if op == "describe":
            return 200, frame.encode(frame.KIND_RESPONSE, {"info": INFO})
        if op == "create_key":
            return 200, frame.encode(frame.KIND_RESPONSE, {"created": False})
        if op == "pull":
            pulling.set()
            await release.wait()  # the reply comes after the create
            meta = {"blocks": [{"key": "w", "block": 0, "version": 3, "array": 0}]}
            return 200, frame.encode(frame.KIND_RESPONSE, meta, [np.arange(4, dtype=np.float32)])
        raise AssertionError(op)

    async def main():
        async with make(handler) as ps:
            async def create_then_release():
                await pulling.wait()  # the pull is waiting for its reply
                await ps.create("w", np.zeros(4, np.float32))
                release.set()
            got, _ = await asyncio.gather(ps.get("w"), create_then_release())
            return got

    value, version = asyncio.run(main())
    assert value.tolist() == [0.0, 1.0, 2.0, 3.0] and version == 3


# ---- follower reads: whether any shard issued min_version is judged from the replies ----------

TWO_SHARDS = {
    "cluster": {"shards": 2, "replicas": 1, "block_bytes": 1 << 20, "max_push_bytes": 1 << 20},
    "nodes": [],
    "shards": [{"id": s, "leader": 0, "leader_url": f"http://s{s}", "term": 1,
                "replicas": [{"node": 0, "data_url": f"http://s{s}"}]} for s in range(2)],
}


class ShortShards:
    """Two shards, one replica each; ``versions[s]``: shard s's version of every key. A follower
    read reports the key short where that is below its min_version, as a replica does."""

    def __init__(self, versions: list[int]):
        self.versions = versions
        self.ops: list[tuple[int, str]] = []

    async def __call__(self, method, url, body, headers):
        if url.endswith("/v1/cluster"):
            return 200, json.dumps(TWO_SHARDS).encode()
        base, op = url.split("/v1/rpc/")
        shard = int(base[-1])
        self.ops.append((shard, op))
        req, version = frame.decode(body), self.versions[shard]
        info = {"key": "a", "kind": "dense", "shape": [2], "dtype": "float32", "block_rows": 1,
                "optimizer": {"name": "add"}, "merge": "sum", "version": version}
        if req.meta.get("key") == "t":
            info = {**info, "key": "t", "kind": "table", "dim": 2, "init": {"name": "zeros"}}
        if op == "describe":
            return 200, frame.encode(frame.KIND_RESPONSE, {"info": info})
        want = max([req.meta.get("min_version", 0), *(it.get("min_version", 0) for it in req.meta.get("dense", []))])
        short = {"short": {info["key"]: version}} if version < want else {}
        if op == "pull":
            (it,) = req.meta["dense"]
            blocks = [{"key": "a", "block": b, "version": version, "array": i} for i, b in enumerate(it["blocks"])]
            return 200, frame.encode(frame.KIND_RESPONSE, {"blocks": blocks, **short},
                                     [np.zeros(1, np.float32)] * len(blocks))
        if op == "pull_rows":
            n = len(req.arrays[0])
            return 200, frame.encode(frame.KIND_RESPONSE, {"rows": 0, "versions": 1, **short},
                                     [np.zeros((n, 2), np.float32), np.full(n, version, np.int64)])
        raise AssertionError(op)


def follower_read(fake: ShortShards, read):
    async def main():
        async with make(fake, row_cache=False) as ps:
            return await read(ps)
    return asyncio.run(main())


def test_a_version_one_shard_issued_is_read_from_every_shard():
    # key "a" has one block on each shard; table "t"'s rows 2 and 4 live on shard 0
    fake = ShortShards([3, 7])
    value = follower_read(fake, lambda ps: ps.pull("a", consistency="follower", min_version=7))
    assert value["a"].shape == (2,)
    rows = follower_read(fake, lambda ps: ps.pull_rows("t", [2, 4], consistency="follower", min_version=7))
    assert rows.shape == (2, 2)
    assert (1, "describe") in fake.ops  # shard 0 fell short: the shard not asked was


def test_a_version_no_shard_issued_is_refused():
    fake = ShortShards([3, 7])
    with pytest.raises(kc.VersionNotIssued) as err:
        follower_read(fake, lambda ps: ps.pull("a", consistency="follower", min_version=8))
    assert (err.value.key, err.value.min_version, err.value.latest) == ("a", 8, 7)
    with pytest.raises(kc.VersionNotIssued) as err:
        follower_read(fake, lambda ps: ps.pull_rows("t", [2, 4], consistency="follower", min_version=9))
    assert (err.value.key, err.value.min_version, err.value.latest) == ("t", 9, 7)
    assert kc.VersionNotIssued.__name__ in kc.__all__


def test_create_table_sends_the_lifecycle_and_capacity_errors_arrive_typed():
    """The lifecycle options travel to every shard, checked before anything is sent; a
    CapacityExceeded from the server is a typed, non-retried RejectedError with its fields."""
    sent: list[dict] = []

    async def handler(method, url, body, headers):
        if url.endswith("/v1/cluster"):
            return 200, json.dumps(CLUSTER).encode()
        meta = frame.decode(body).meta
        if url.endswith("/create_table"):
            sent.append(meta)
            return 200, frame.encode(frame.KIND_RESPONSE, {"created": True})
        err = kc.CapacityExceeded("e", 100, 200)
        return err.http_status, json.dumps(err.to_dict()).encode()

    async def main():
        async with make(handler) as ps:
            with pytest.raises(InvalidRequest):
                await ps.create_table("e", 2, max_rows=0)
            await ps.create_table("e", 2, max_rows=10, evict="lfu", ttl_s=5, admit=kc.CountAdmission(2))
            await ps.create_table("plain", 2)
            with pytest.raises(kc.CapacityExceeded) as caught:
                await ps.call(0, "push", {})
            return caught.value

    err = asyncio.run(main())
    n = CLUSTER["cluster"]["shards"]
    lifecycle = {"max_rows": 10, "shards": n, "evict": "lfu", "ttl_s": 5.0, "admit": {"name": "count", "min_count": 2}}
    assert [m.get("lifecycle") for m in sent] == [lifecycle] * n + [None] * n
    assert isinstance(err, kc.RejectedError) and (err.key, err.limit, err.needed) == ("e", 100, 200)
