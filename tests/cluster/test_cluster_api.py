"""The client API against one real 3-node cluster (real processes, sockets, pysyncobj)."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import kvps_client as kc
from conftest import module_cluster
from kvps.placement import block_shard, row_shards
from kvps.service.http import PeerClient

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "api", shards=3)


def run(coro):
    return asyncio.run(coro)


def client(cluster, **kw) -> kc.Client:
    return kc.Client(cluster.endpoints, token=cluster.token, seed=0, **kw)


def test_quick_start_example(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create("qs/w", np.zeros((2048, 1024), np.float32), optimizer=kc.SGD(lr=0.5))
            await ps.push({"qs/w": np.ones((2048, 1024), np.float32)})
            return (await ps.pull(["qs/w"]))["qs/w"]
    w = run(main())
    assert w.shape == (2048, 1024)
    assert np.all(w == -0.5)


def test_concurrent_pushes_equal_sequential_reference(cluster):
    """Three clients push concurrently; the result equals applying every push in sequence.
    Integer-valued gradients and lr=0.5 keep every float32 operation exact, so the order in which
    the leader merged them cannot matter and the comparison can be exact."""
    rng = np.random.default_rng(7)
    shape = (600, 700)  # ~1.6 MiB: two blocks, spread over shards
    init = rng.integers(-50, 50, size=shape).astype(np.float32)
    grads = {c: [rng.integers(-3, 4, size=shape).astype(np.float32) for _ in range(6)] for c in range(3)}

    async def worker(c):
        async with client(cluster) as ps:
            for g in grads[c]:
                await ps.push({"conc/w": g})

    async def main():
        async with client(cluster) as ps:
            await ps.create("conc/w", init, optimizer=kc.SGD(lr=0.5))
            await asyncio.gather(*(worker(c) for c in range(3)))
            value, version = await ps.get("conc/w")
            return value, version

    value, version = run(main())
    expected = init.copy()
    for c in range(3):
        for g in grads[c]:
            expected -= np.float32(0.5) * g
    np.testing.assert_array_equal(value, expected)
    assert version == 18


def test_incremental_pull_skips_unchanged_blocks(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create("inc/w", np.zeros((1024, 512), np.float32))  # 2 MiB: 2 blocks
            await ps.pull(["inc/w"])
            before = ps.stats.bytes_received
            again = (await ps.pull(["inc/w"]))["inc/w"]
            unchanged = ps.stats.bytes_received - before
            await ps.push({"inc/w": np.ones((1024, 512), np.float32)})
            after = (await ps.pull(["inc/w"]))["inc/w"]
            return again, unchanged, after
    again, unchanged, after = run(main())
    assert np.all(again == 0) and np.all(after == 1)
    assert unchanged < 4096  # versions only, no block bytes


def test_torch_tensors_in_numpy_out(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create("torch/b", torch.arange(10, dtype=torch.float32), optimizer=kc.SGD(lr=1.0))
            await ps.push({"torch/b": torch.ones(10)})
            return (await ps.pull("torch/b"))["torch/b"]
    np.testing.assert_array_equal(run(main()), np.arange(10, dtype=np.float32) - 1)


def test_pull_into_the_callers_arrays_and_tensors(cluster):
    rng = np.random.default_rng(21)
    w = rng.standard_normal((1024, 768)).astype(np.float32)  # 3 MiB: blocks on several shards
    b = rng.standard_normal(7).astype(np.float32)

    async def main():
        async with client(cluster) as ps:
            await ps.create("into/w", w)
            await ps.create("into/b", b)
            mine, tensor = np.zeros_like(w), torch.zeros(7)
            got = await ps.pull(["into/w", "into/b"], out={"into/w": mine, "into/b": tensor})
            assert got["into/w"] is mine and got["into/b"] is tensor
            np.testing.assert_array_equal(mine, w)
            np.testing.assert_array_equal(tensor.numpy(), b)
            await ps.push({"into/w": np.ones_like(w)})
            await ps.pull("into/w", out={"into/w": mine})  # only the changed blocks cross; all land
            np.testing.assert_array_equal(mine, w + 1)
            fresh = (await ps.pull("into/w"))["into/w"]
            assert fresh is not mine and np.array_equal(fresh, mine)
            # targets that cannot take the value are refused before anything is written
            wrong, fits = np.full((1024, 767), 5, np.float32), np.zeros(7, np.float32)
            with pytest.raises(kc.ShapeMismatch):
                await ps.pull(["into/w", "into/b"], out={"into/b": fits, "into/w": wrong})
            assert np.all(wrong == 5) and not fits.any()
            frozen = np.zeros_like(w)
            frozen.flags.writeable = False
            for bad in ({"into/w": frozen}, {"into/w": torch.zeros((1024, 768), dtype=torch.bfloat16)},
                        {"into/w": [0.0]}, {"elsewhere": np.zeros(3)}):
                with pytest.raises(kc.InvalidRequest):
                    await ps.pull("into/w", out=bad)
            assert not frozen.any()
    run(main())


def test_errors_are_typed_and_change_nothing(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create("err/w", np.zeros((4, 4), np.float32))
            with pytest.raises(kc.ShapeMismatch):
                await ps.push({"err/w": np.zeros((4, 5), np.float32)})
            with pytest.raises(kc.ShapeMismatch):
                await ps.push({"err/w": np.zeros((4, 4), np.float64)})
            with pytest.raises(kc.NotFound):
                await ps.push({"err/missing": np.zeros(3, np.float32)})
            with pytest.raises(kc.InvalidRequest):
                await ps.push({"err/w": np.full((4, 4), np.nan, np.float32)})
            with pytest.raises(kc.KeyExists):
                await ps.create("err/w", np.zeros((4, 3), np.float32))
            return await ps.get("err/w")
    value, version = run(main())
    assert version == 0 and np.all(value == 0)


def test_create_many_small_and_big_keys_in_few_requests(cluster):
    """``create_many``: one request per shard for many small keys (plus the chunks of a key too
    big for one request); each key holds its value; pulling them all learns their layouts in
    one request per shard; a refused key stops no other and is raised after; a retried batch
    is a no-op."""
    rng = np.random.default_rng(11)
    small = {f"many/k{i}": rng.standard_normal(8).astype(np.float32) for i in range(600)}
    big = rng.standard_normal((600, 1024)).astype(np.float32)  # 2.4 MiB: several blocks

    async def main():
        async with client(cluster, timeout=60) as ps:
            before = ps.stats.requests
            await ps.create_many({**small, "many/big": big}, optimizer=kc.SGD(lr=1.0))
            create_requests = ps.stats.requests - before
            await ps.create_many(small, optimizer=kc.SGD(lr=1.0))  # the same again: a no-op
            await ps.create("many/other", np.zeros(3, np.float32))
            with pytest.raises(kc.KeyExists):  # another definition of one key; the rest is created
                await ps.create_many({"many/other": np.zeros(4, np.float32), "many/new": np.ones(2, np.float32)})
        async with client(cluster, timeout=60) as ps:
            before = ps.stats.requests
            got = await ps.pull([*small, "many/big", "many/new"])
            pull_requests = ps.stats.requests - before
            await ps.push({k: np.ones(8, np.float32) for k in small})
            after = await ps.pull(list(small))
        return create_requests, pull_requests, got, after

    create_requests, pull_requests, got, after = run(main())
    shards = cluster.cfg.shards
    assert create_requests <= 3 * shards, create_requests  # not one per key
    assert pull_requests <= 2 * shards, pull_requests  # the layouts, then the blocks: per shard
    assert all(np.array_equal(got[k], v) for k, v in small.items())
    assert np.array_equal(got["many/big"], big) and np.array_equal(got["many/new"], np.ones(2, np.float32))
    assert all(np.array_equal(after[k], v - 1) for k, v in small.items())  # pushed once each


def test_bad_token_is_unauthorized(cluster):
    async def main():
        async with kc.Client(cluster.endpoints, token="wrong", seed=0) as ps:
            await ps.keys()
    with pytest.raises(kc.Unauthorized):
        run(main())


def test_compare_and_set_get_delete_keys(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create("cas/r", np.zeros(4, np.float32))
            v = await ps.set("cas/r", np.full(4, 1, np.float32), expected_version=0)
            assert v == 1
            with pytest.raises(kc.VersionConflict):
                await ps.set("cas/r", np.full(4, 2, np.float32), expected_version=0)
            value, version = await ps.get("cas/r")
            assert version == 1 and np.all(value == 1)
            names = [k["key"] for k in await ps.keys()]
            assert "cas/r" in names
            await ps.delete("cas/r")
            assert "cas/r" not in [k["key"] for k in await ps.keys()]
            with pytest.raises(kc.NotFound):
                await ps.pull("cas/r")
    run(main())


def test_embedding_rows(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create_table("emb/t", dim=8, optimizer=kc.SGD(lr=1.0),
                                  init=kc.Normal(std=0.1, seed=3))
            ids = np.array([5, 17, 5, 10_000_000_000], np.int64)
            before = await ps.pull_rows("emb/t", ids)
            again = await ps.pull_rows("emb/t", ids)
            grads = np.ones((4, 8), np.float32)
            await ps.push_rows("emb/t", ids, grads)
            after = await ps.pull_rows("emb/t", ids)
            return before, again, after
    before, again, after = run(main())
    np.testing.assert_array_equal(before, again)          # untouched rows are deterministic
    np.testing.assert_array_equal(before[0], before[2])   # duplicate ids: the same row
    assert np.std(before) > 0.01
    # id 5 appeared twice in the push: its gradients were summed
    np.testing.assert_allclose(after[0], before[0] - 2, rtol=1e-6)
    np.testing.assert_allclose(after[1], before[1] - 1, rtol=1e-6)


def test_follower_read_with_min_version(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create("fr/w", np.zeros(16, np.float32))
            version = (await ps.push({"fr/w": np.ones(16, np.float32)}))["fr/w"]
            value = (await ps.pull("fr/w", consistency="follower", min_version=version))["fr/w"]
            lin = (await ps.pull("fr/w", consistency="linearizable"))["fr/w"]
            return value, lin
    value, lin = run(main())
    assert np.all(value == 1) and np.all(lin == 1)


async def _push_blocks(ps: kc.Client, key: str, blocks: dict[int, np.ndarray]) -> dict[str, int]:
    """A push that reaches only the shards of ``blocks`` (as one whose other requests failed)."""
    shards = ps.cluster_map.shards
    requests = [(block_shard(key, b, shards), {"dense": [{"key": key, "block": b, "array": 0}]}, [g])
                for b, g in blocks.items()]
    return await ps._push_requests(requests)


def test_follower_read_after_a_push_to_some_shards_completes(cluster):
    """Blocks on different shards reach different versions (a push that reached one shard only);
    the version the next push returns is the highest shard's. A follower read with it completes
    promptly on every replica, not only where a block reached that version."""
    key = "fr/partial"

    async def main():
        async with client(cluster, timeout=10) as ps:
            await ps.create(key, np.zeros((6, 4), np.float32), block_bytes=16)  # 6 blocks of 1 row
            shards = ps.cluster_map.shards
            by_shard = {}
            for b in range(6):
                by_shard.setdefault(block_shard(key, b, shards), []).append(b)
            assert len(by_shard) >= 2, by_shard  # the key spans shards
            first = by_shard[min(by_shard)][0]
            await _push_blocks(ps, key, {first: np.full((1, 4), 5, np.float32)})
            await _push_blocks(ps, key, {first: np.full((1, 4), 5, np.float32)})
            version = (await ps.push({key: np.ones((6, 4), np.float32)}))[key]
            assert version == 3
            expected = np.ones((6, 4), np.float32)
            expected[first] += 10
            async with PeerClient(token=cluster.token) as peer:  # every replica, followers included
                for shard, blocks in by_shard.items():
                    for url in ps.cluster_map.replicas[shard]:
                        started = time.monotonic()
                        meta = await peer.rpc(url, "pull", {"consistency": "follower", "dense": [
                            {"key": key, "blocks": blocks, "have": [None] * len(blocks), "min_version": version}]})
                        assert time.monotonic() - started < 5, url
                        assert ("short" in meta) == (first not in blocks), (url, meta)
            timings = []
            for _ in range(4):  # routes start at a random replica: leaders and followers
                started = time.monotonic()
                value = (await ps.pull(key, consistency="follower", min_version=version))[key]
                timings.append(time.monotonic() - started)
                np.testing.assert_array_equal(value, expected)
            return timings
    timings = run(main())
    assert max(timings) < 5, timings


def test_follower_read_of_a_version_never_issued_fails_at_once(cluster):
    """A min_version above every shard's version would never be reached: a typed error at once,
    not Unavailable retried until the client's timeout."""
    async def main():
        async with client(cluster, timeout=30) as ps:
            await ps.create("fr/never", np.zeros((6, 4), np.float32), block_bytes=16)
            version = (await ps.push({"fr/never": np.ones((6, 4), np.float32)}))["fr/never"]
            await ps.create("fr/never1", np.zeros(4, np.float32))
            version1 = (await ps.push({"fr/never1": np.ones(4, np.float32)}))["fr/never1"]
            errors, timings = [], []
            for key, v in [("fr/never", version), ("fr/never1", version1)]:
                started = time.monotonic()
                with pytest.raises(kc.VersionNotIssued) as err:
                    await ps.pull(key, consistency="follower", min_version=v + 100)
                timings.append(time.monotonic() - started)
                errors.append(err.value)
            return version, version1, errors, timings
    version, version1, errors, timings = run(main())
    assert max(timings) < 5, timings
    assert [(e.key, e.min_version, e.latest) for e in errors] == [
        ("fr/never", version + 100, version), ("fr/never1", version1 + 100, version1)]
    assert isinstance(errors[0], kc.RejectedError)


def test_pull_rows_with_min_version(cluster):
    """``pull_rows`` takes min_version: rows pushed on one shard read back from any replica, rows of
    another shard (whose table version is lower) read promptly, a version never issued fails."""
    key = "fr/emb"

    async def main():
        async with client(cluster, timeout=30) as ps:
            await ps.create_table(key, dim=4)
            shards = ps.cluster_map.shards
            ids = np.arange(64, dtype=np.int64)
            where = row_shards(key, ids, shards)
            mine, other = ids[where == where[0]][:3], ids[where != where[0]][:3]
            versions = [await ps.push_rows(key, mine, np.ones((3, 4), np.float32)) for _ in range(3)]
            started = time.monotonic()
            pushed = await ps.pull_rows(key, mine, consistency="follower", min_version=versions[-1])
            untouched = await ps.pull_rows(key, other, consistency="follower", min_version=versions[-1])
            with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=1, row_cache=False) as sync:
                again = sync.pull_rows(key, mine, consistency="follower", min_version=versions[-1])
            elapsed = time.monotonic() - started
            with pytest.raises(kc.VersionNotIssued):
                await ps.pull_rows(key, other, consistency="follower", min_version=versions[-1] + 100)
            return versions, pushed, untouched, again, elapsed, time.monotonic() - started - elapsed
    versions, pushed, untouched, again, elapsed, refused = run(main())
    assert versions == [1, 2, 3]
    np.testing.assert_array_equal(pushed, np.full((3, 4), 3, np.float32))
    np.testing.assert_array_equal(again, pushed)
    np.testing.assert_array_equal(untouched, np.zeros((3, 4), np.float32))
    assert elapsed < 5 and refused < 5, (elapsed, refused)


def test_sync_client(cluster):
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0) as ps:
        ps.create("sync/w", np.zeros(3, np.float32), optimizer=kc.SGD(lr=0.1))
        ps.create_many({"sync/a": np.ones(2, np.float32), "sync/b": np.zeros(1, np.float32)})
        assert [ps.pull(["sync/a"])["sync/a"].tolist(), ps.describe("sync/b")["shape"]] == [[1, 1], [1]]
        ps.push({"sync/w": np.ones(3, np.float32)})
        np.testing.assert_allclose(ps.pull(["sync/w"])["sync/w"], -0.1)
        assert ps.stats.bytes_sent > 0


def test_reopening_a_client_is_refused(cluster):
    async def main():
        ps = client(cluster)
        async with ps:
            pass
        with pytest.raises(kc.InvalidRequest):
            await ps.open()
    run(main())
