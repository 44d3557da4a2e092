"""The client API against one real 3-node cluster (real processes, sockets, pysyncobj)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import kvps_client as kc
from conftest import module_cluster

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


def test_sync_client(cluster):
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0) as ps:
        ps.create("sync/w", np.zeros(3, np.float32), optimizer=kc.SGD(lr=0.1))
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
