"""Incremental, compressed pulls and lossy pushes through a real cluster."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvps_client as kc
from conftest import module_cluster
from kvps.config import ServerConfig

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "delta", shards=2, server=ServerConfig(delta_depth=2))


def client(cluster, **kw) -> kc.Client:
    kw.setdefault("deltas", True)  # the default, "auto", turns them off on loopback
    kw.setdefault("shm", False)  # deltas travel over TCP: not from the leaders' mirrors on this host
    return kc.Client(cluster.endpoints, token=cluster.token, seed=0, **kw)


def test_delta_pulls_are_bit_exact_and_smaller(cluster):
    rng = np.random.default_rng(1)
    w0 = (rng.standard_normal((512, 1024)) * 0.05).astype(np.float32)   # 2 MiB: 2 blocks

    async def main():
        async with client(cluster) as a, client(cluster, deltas=False) as ref:
            await a.create("d/w", w0, optimizer=kc.SGD(lr=1e-3))
            await a.pull("d/w")
            sizes = []
            for step in range(5):
                await a.push({"d/w": (rng.standard_normal(w0.shape) * 0.1).astype(np.float32)})
                before = a.stats.bytes_received
                got = (await a.pull("d/w"))["d/w"]
                sizes.append(a.stats.bytes_received - before)
                want = (await ref.pull("d/w"))["d/w"]
                assert got.tobytes() == want.tobytes(), f"step {step}: delta pull differs"
            return sizes

    sizes = asyncio.run(main())
    assert max(sizes) < 0.8 * 512 * 1024 * 4, sizes    # every pull moved a compressed delta


def test_version_out_of_history_falls_back_to_the_full_block(cluster):
    async def main():
        async with client(cluster) as a, client(cluster) as b:
            await a.create("d/old", np.zeros((256, 256), np.float32))
            await b.pull("d/old")                       # b holds version 0
            for _ in range(4):                          # history keeps only the last 2 versions
                await a.push({"d/old": np.full((256, 256), 0.5, np.float32)})
            before = b.stats.bytes_received
            value = (await b.pull("d/old"))["d/old"]
            return value, b.stats.bytes_received - before
    value, nbytes = asyncio.run(main())
    assert np.all(value == 2.0) and nbytes >= 256 * 256 * 4  # a full block, still exact


def test_follower_read_with_min_version_uses_deltas(cluster):
    async def main():
        async with client(cluster) as a:
            await a.create("d/f", np.zeros((128, 128), np.float32))
            await a.pull("d/f")
            v = (await a.push({"d/f": np.ones((128, 128), np.float32)}))["d/f"]
            got = (await a.pull("d/f", consistency="follower", min_version=v))["d/f"]
            return got
    assert np.all(asyncio.run(main()) == 1)


def test_incremental_row_pull_moves_only_changed_rows(cluster):
    n, dim = 20_000, 16

    async def main():
        async with client(cluster) as a, client(cluster, row_cache=False) as ref:
            await a.create_table("d/emb", dim=dim, optimizer=kc.SGD(lr=1.0), init=kc.Normal(std=0.1, seed=4))
            ids = np.arange(n, dtype=np.int64)
            first = a.stats.bytes_received
            await a.pull_rows("d/emb", ids)
            full = a.stats.bytes_received - first
            touched = np.random.default_rng(2).choice(n, n // 100, replace=False)
            await a.push_rows("d/emb", touched, np.ones((len(touched), dim), np.float32))
            before = a.stats.bytes_received
            got = await a.pull_rows("d/emb", ids)
            incremental = a.stats.bytes_received - before
            want = await ref.pull_rows("d/emb", ids)
            return got, want, full, incremental

    got, want, full, incremental = asyncio.run(main())
    assert got.tobytes() == want.tobytes()
    assert incremental <= 0.02 * n * dim * 4, (full, incremental)   # <= 2 % of the table's bytes


@pytest.mark.parametrize("codec,tol", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8), ("topk:0.25", 0)])
def test_lossy_push_codecs_end_to_end(cluster, codec, tol):
    g = np.linspace(-4, 4, 4096, dtype=np.float32)

    async def main():
        async with client(cluster, push_codec=codec) as a:
            key = f"d/lossy-{codec}"
            await a.create(key, np.zeros(4096, np.float32), optimizer=kc.SGD(lr=1.0))
            await a.push({key: g})
            return (await a.pull(key))[key]

    value = asyncio.run(main())
    if codec.startswith("topk"):
        sent = -value
        assert np.count_nonzero(sent) == 1024                       # only the top quarter ...
        big = np.argsort(np.abs(g))[-1024:]
        np.testing.assert_array_equal(sent[big], g[big])             # ... and those exactly
    else:
        np.testing.assert_array_less(np.abs(-value - g), tol * np.abs(g) + 1e-30)
