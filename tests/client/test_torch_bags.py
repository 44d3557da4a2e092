"""EmbeddingBagCollection against torch.nn.EmbeddingBag with the same weights, on a real 3-shard
cluster: forward equal, the pushed row gradients equal torch's, a step's ids pulled once per table
(features sharing a table deduplicated), and a training loop that prefetches the next batch
during the current step ends where plain torch SGD ends. Every draw is seeded (SEED)."""
from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch
from torch import nn

import kvps_client as kc
from conftest import module_cluster
from kvps_client.torch import EmbeddingBagCollection, SyncPSModule

pytestmark = pytest.mark.cluster
SEED, USERS, ITEMS, DIM, LR, SHARDS = 11, 20, 30, 4, 0.5, 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "bags", shards=SHARDS)


def specs(prefix: str, lr: float = LR) -> dict:
    table = {"dim": DIM, "optimizer": kc.SGD(lr=lr), "init": kc.Normal(std=0.3, seed=SEED)}
    return {"user": {**table, "table": prefix + "users"}, "item": {**table, "table": prefix + "items"},
            "hist": {**table, "table": prefix + "items"}}


def make_batch(g: torch.Generator, bags: int = 6) -> dict:
    """{feature: (ids, offsets)}; bag lengths 0..4, so some bags are empty."""
    out = {}
    for feature, n in (("user", USERS), ("item", ITEMS), ("hist", ITEMS)):
        lengths = torch.randint(0, 5, (bags,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        out[feature] = (torch.randint(0, n, (int(lengths.sum()),), generator=g), offsets)
    return out


class TorchBags(nn.Module):
    """The reference: one nn.EmbeddingBag per table, features sharing one as in the collection."""

    def __init__(self, users: np.ndarray, items: np.ndarray, mode: str) -> None:
        super().__init__()
        self.users = nn.EmbeddingBag.from_pretrained(torch.from_numpy(users.copy()), freeze=False, mode=mode)
        self.items = nn.EmbeddingBag.from_pretrained(torch.from_numpy(items.copy()), freeze=False, mode=mode)

    def forward(self, batch):
        return {f: (self.users if f == "user" else self.items)(ids, offsets) for f, (ids, offsets) in batch.items()}


def weighted_sum(out: dict, g_seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(g_seed)
    return sum((out[f] * torch.randn(out[f].shape, generator=g)).sum() for f in sorted(out))


def _tables(ps, prefix):
    for name in ("users", "items"):
        ps.create_table(prefix + name, DIM, optimizer=kc.SGD(lr=LR), init=kc.Normal(std=0.3, seed=SEED))
    return (ps.pull_rows(prefix + "users", np.arange(USERS)), ps.pull_rows(prefix + "items", np.arange(ITEMS)))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_forward_and_pushed_gradient_equal_torch_embedding_bag(cluster, mode):
    prefix = f"bags-{mode}/"
    batch = make_batch(torch.Generator().manual_seed(SEED))
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0) as ps:
        users, items = _tables(ps, prefix)
        pulls = []
        real = ps._client.pull_rows

        async def recording(key, ids, **kw):
            pulls.append((key, np.asarray(ids).copy()))
            return await real(key, ids, **kw)
        ps._client.pull_rows = recording
        ebc = EmbeddingBagCollection(ps, specs(prefix), mode=mode)
        ref = TorchBags(users, items, mode)
        out, want = ebc(batch), ref(batch)
        for f in batch:
            torch.testing.assert_close(out[f], want[f], rtol=1e-6, atol=1e-6, msg=f"seed={SEED} {f}")
        weighted_sum(out, SEED).backward()
        weighted_sum(want, SEED).backward()
        ebc.push()
        del ps._client.pull_rows
        users_after = ps.pull_rows(prefix + "users", np.arange(USERS))
        items_after = ps.pull_rows(prefix + "items", np.arange(ITEMS))
    np.testing.assert_allclose(users_after, users - LR * ref.users.weight.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(items_after, items - LR * ref.items.weight.grad.numpy(), rtol=1e-5, atol=1e-6)
    # one pull per table for the whole step: item and hist ids together, each id once
    assert sorted(k for k, _ in pulls) == [prefix + "items", prefix + "users"], pulls
    got = dict(pulls)
    assert got[prefix + "items"].tolist() == np.unique(np.concatenate(
        [batch["item"][0].numpy(), batch["hist"][0].numpy()])).tolist()


class Ctr(nn.Module):
    def __init__(self, bags: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.bags, self.head = bags, nn.Linear(3 * DIM, 1)

    def forward(self, batch):
        out = self.bags(batch)
        return self.head(torch.cat([out["user"], out["item"], out["hist"]], dim=1)).squeeze(1)


def test_prefetching_training_loop_ends_where_torch_sgd_ends(cluster):
    """The next batch is pulled during the current step; rows the step pushes are pulled again,
    so the result is exactly plain SGD's (ids overlap from batch to batch: 20-30 rows)."""
    prefix = "bags-train/"
    g = torch.Generator().manual_seed(SEED + 1)
    data = [(make_batch(g), torch.rand(6, generator=g)) for _ in range(5)]
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0) as ps:
        users, items = _tables(ps, prefix)
        model = Ctr(EmbeddingBagCollection(ps, specs(prefix), mode="mean"))
        ref = copy.deepcopy(Ctr(TorchBags(users, items, "mean")))
        pm = SyncPSModule(model, ps, prefix=prefix, optimizer=kc.SGD(lr=LR))
        opt = torch.optim.SGD(ref.parameters(), lr=LR)
        model.bags.prefetch(data[0][0])
        for t, (batch, y) in enumerate(data):
            pm.pull()
            loss = nn.functional.binary_cross_entropy_with_logits(model(batch), y)
            if t + 1 < len(data):
                model.bags.prefetch(data[t + 1][0])  # overlaps this step's backward and push
            loss.backward()
            pm.push()
            opt.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(ref(batch), y).backward()
            opt.step()
        pm.pull()
        users_after = ps.pull_rows(prefix + "users", np.arange(USERS))
        items_after = ps.pull_rows(prefix + "items", np.arange(ITEMS))
    np.testing.assert_allclose(users_after, ref.bags.users.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(items_after, ref.bags.items.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head.weight, ref.head.weight, rtol=1e-5, atol=1e-6)


def test_asyncio_client_prefetch_then_wait(cluster):
    prefix = "bags-async/"
    batch = make_batch(torch.Generator().manual_seed(SEED + 2))

    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=0) as ps:
            ebc = EmbeddingBagCollection(ps, specs(prefix), mode="sum")
            ebc.prefetch(batch)  # creates the tables, pulls in the background
            with pytest.raises(kc.InvalidRequest):
                ebc(batch)  # the prefetch is not waited for yet
            await ebc.wait()
            out = ebc(batch)
            users = await ps.pull_rows(prefix + "users", np.arange(USERS))
            items = await ps.pull_rows(prefix + "items", np.arange(ITEMS))
            ref = TorchBags(users, items, "sum")
            weighted_sum(out, 3).backward()
            await ebc.push()
            want = ref(batch)
            weighted_sum(want, 3).backward()
            after = await ps.pull_rows(prefix + "items", np.arange(ITEMS))
            return out, want, items - LR * ref.items.weight.grad.numpy(), after
    out, want, items_want, items_after = asyncio.run(main())
    for f in out:
        torch.testing.assert_close(out[f], want[f], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(items_after, items_want, rtol=1e-5, atol=1e-6)


def test_a_table_spec_with_lifecycle_options_creates_a_capped_table(cluster):
    """``max_rows``/``evict``/``clip_norm`` in a spec reach ``create_table``: the server keeps at most
    the cap (per shard, ceil(cap / shards)), and a pushed row past it evicts the least recent."""
    prefix, cap = "bags-capped/", 6
    table = {"dim": DIM, "optimizer": kc.SGD(lr=LR), "init": kc.Normal(std=0.3, seed=SEED),
             "max_rows": cap, "evict": "lru", "clip_norm": 10.0}
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0) as ps:
        ebc = EmbeddingBagCollection(ps, {"item": {**table, "table": prefix + "items"}}, mode="sum")
        for step in range(4):  # 4 x 8 distinct ids, one bag each
            ids = torch.arange(step * 8, (step + 1) * 8)
            ebc({"item": (ids, torch.arange(8))})["item"].sum().backward()
            ebc.push()
        info = next(i for i in ps.keys() if i["key"] == prefix + "items")
        assert info["rows"] <= SHARDS * -(-cap // SHARDS), info  # 32 pushed, the cap kept
        assert info["rows"] >= cap - SHARDS, info
        init = kc.Normal(std=0.3, seed=SEED).rows(np.arange(8), DIM, np.float32)  # the first 8: evicted
        np.testing.assert_allclose(ps.pull_rows(prefix + "items", np.arange(8)), init, rtol=1e-6)
