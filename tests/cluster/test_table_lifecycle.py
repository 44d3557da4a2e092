"""Table row lifecycle and the memory limit on one real 3-node cluster: a capped table stays at its
cap under a stream of distinct ids, a cached client pulls an evicted row again (its initializer),
every replica of every shard ends with the same state hash, and a push past server.memory_limit
fails with CapacityExceeded and changes nothing."""
from __future__ import annotations

import asyncio
import urllib.request

import numpy as np
import pytest

import kvps_client as kc
from conftest import module_cluster, wait_for
from kvps.config import ServerConfig
from kvps_chaos.elastic import replicas_agree

pytestmark = pytest.mark.cluster

DIM = 4
# float32 values + Adagrad's accumulator; uint32 id, version and step count, the last-push time and
# push count of a capped LFU table, the index entry (kvps.record)
ROW_BYTES = DIM * 4 * 2 + 4 + 4 + 4 + 8 + 8 + 8
LIMIT = 300 * ROW_BYTES  # per replica


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "lifecycle", shards=2,
                              server=ServerConfig(memory_limit=LIMIT))


def client(cluster) -> kc.Client:
    return kc.Client(cluster.endpoints, token=cluster.token, seed=0)


def test_capped_table_stays_at_its_cap_and_evicted_rows_read_as_init(cluster):
    init = kc.Normal(std=0.1, seed=3)

    async def main():
        async with client(cluster) as ps:
            await ps.create_table("lc/emb", DIM, optimizer=kc.Adagrad(lr=0.1), init=init,
                                  max_rows=40, evict="lfu")
            first = np.arange(10)
            await ps.push_rows("lc/emb", first, np.ones((10, DIM), np.float32))
            held = await ps.pull_rows("lc/emb", first)  # cached with their versions
            for b in range(1, 40):  # 10x max_rows distinct ids, each pushed once
                ids = np.arange(b * 10, (b + 1) * 10)
                await ps.push_rows("lc/emb", ids, np.ones((10, DIM), np.float32))
            again = await ps.pull_rows("lc/emb", first)
            info = {k["key"]: k for k in await ps.keys()}["lc/emb"]
            return held, again, info

    held, again, info = asyncio.run(main())
    fresh = np.stack([init.rows(np.array([i]), DIM, np.dtype("float32"))[0] for i in range(10)])
    assert not np.array_equal(held, fresh)  # they were trained ...
    assert np.array_equal(again, fresh)  # ... then evicted: the cache saw their versions move
    assert 0 < info["rows"] <= 40 and info["bytes"] == info["rows"] * ROW_BYTES
    assert info["lifecycle"]["max_rows"] == 40 and info["lifecycle"]["evict"] == "lfu"
    wait_for(lambda: replicas_agree(cluster), timeout=30, what="replicas agree")


def test_push_past_the_memory_limit_is_refused_and_changes_nothing(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create_table("lc/big", DIM, optimizer=kc.Adagrad(lr=0.1))
            pushed = 0
            with pytest.raises(kc.CapacityExceeded) as caught:
                for b in range(100):
                    ids = np.arange(b * 50, (b + 1) * 50)
                    await ps.push_rows("lc/big", ids, np.ones((50, DIM), np.float32))
                    pushed = (b + 1) * 50
            before = {k["key"]: k for k in await ps.keys()}["lc/big"]
            with pytest.raises(kc.CapacityExceeded):
                await ps.push_rows("lc/big", np.arange(10**6, 10**6 + 50), np.ones((50, DIM), np.float32))
            after = {k["key"]: k for k in await ps.keys()}["lc/big"]
            await ps.push_rows("lc/big", np.arange(10), np.ones((10, DIM), np.float32))  # stored rows still train
            return caught.value, pushed, before, after

    err, pushed, before, after = asyncio.run(main())
    assert isinstance(err, kc.RejectedError) and err.limit == LIMIT and err.needed > LIMIT
    assert pushed >= 300 and before["rows"] == after["rows"] and before["version"] == after["version"]
    wait_for(lambda: replicas_agree(cluster), timeout=30, what="replicas agree")
    text = urllib.request.urlopen(cluster.cfg.nodes[0].data_url(0) + "/metrics", timeout=5).read().decode()
    for name in ("kvps_table_rows{", "kvps_table_bytes{"):
        assert any(line.startswith(name) and 'table="lc/big"' in line for line in text.splitlines()), name
