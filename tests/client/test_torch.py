"""kvps_client.torch against a real 3-node cluster: the module wrapper (asyncio and blocking), the
embedding layer, and pushes that overlap the backward pass. Each training test runs the same
steps through plain torch.optim.SGD and expects the same parameters."""
from __future__ import annotations

import asyncio
import copy
import threading

import numpy as np
import pytest
import torch
from torch import nn

import kvps_client as kc
from conftest import module_cluster
from kvps.delta import frame
from kvps_client.torch import Embedding, PSModule, SyncPSModule

pytestmark = pytest.mark.cluster
LR = 0.1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "torch", shards=3)


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(seed: int, n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(n)]


def reference(model: nn.Module, data) -> nn.Module:
    """The same steps with torch.optim.SGD in this process."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def client(cluster, **kw) -> kc.Client:
    return kc.Client(cluster.endpoints, token=cluster.token, seed=0, **kw)


def test_async_module_wrapper_trains_like_torch_sgd(cluster):
    model, data = mlp(0), batches(1)
    ref = reference(model, data)

    async def main():
        async with client(cluster) as ps:
            pm = PSModule(model, ps, prefix="async/", optimizer=kc.SGD(lr=LR))
            for x, y in data:
                await pm.pull()
                nn.functional.cross_entropy(model(x), y).backward()
                versions = await pm.push()
                assert all(p.grad is None for p in model.parameters())  # push clears the grads
            await pm.pull()
            await pm.close()
            return versions
    versions = asyncio.run(main())
    assert versions == {f"async/{n}": len(data) for n, _ in model.named_parameters()}
    assert_same_params(model, ref)


def test_sync_wrapper_creates_if_absent_and_a_second_worker_pulls_the_first_ones_values(cluster):
    first, second, data = mlp(0), mlp(99), batches(2, n=3)
    ref = reference(first, data)
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0) as ps:
        pm1 = SyncPSModule(first, ps, prefix="sync/", optimizer=kc.SGD(lr=LR))
        pm1.pull()
        pm2 = SyncPSModule(second, ps, prefix="sync/", optimizer=kc.SGD(lr=LR))
        pm2.pull()  # same definition: a no-op create, then the first worker's values
        assert_same_params(second, first)
        ps.create("sync/steps", np.zeros(1, np.float32))
        for x, y in data:
            pm1.pull()
            nn.functional.cross_entropy(first(x), y).backward()
            versions = pm1.push(extra={"sync/steps": np.ones(1, np.float32)})  # in the same call
        pm2.pull()
        steps = ps.pull("sync/steps")["sync/steps"]
    assert_same_params(second, ref)
    assert steps.tolist() == [len(data)] and versions["sync/steps"] == len(data)


class Gate(torch.autograd.Function):
    """Identity whose backward waits until ``event`` is set (or ``timeout`` passes) and records
    which. Placed after the first layer, it holds the backward pass before that layer's grads."""

    @staticmethod
    def forward(ctx, x, event, opened, timeout):
        ctx.event, ctx.opened, ctx.timeout = event, opened, timeout
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.opened.append(ctx.event.wait(ctx.timeout))
        return g, None, None, None


class GatedMLP(nn.Module):
    def __init__(self, event: threading.Event, opened: list) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.first, self.last = nn.Linear(8, 16), nn.Linear(16, 3)
        self.event, self.opened = event, opened

    def forward(self, x):
        return self.last(torch.relu(Gate.apply(self.first(x), self.event, self.opened, 20.0)))


class PushRecorder(kc.HttpTransport):
    """Notes the keys of every push request as it is sent, and sets ``event`` on the first push
    naming ``watch``."""

    def __init__(self, watch: str) -> None:
        super().__init__()
        self.watch, self.event, self.sent = watch, threading.Event(), []

    async def request(self, method, url, body, **kw):
        if url.endswith("/v1/rpc/push"):
            keys = [d["key"] for d in frame.decode(bytes(body)).meta.get("dense", [])]
            self.sent.append(keys)
            if self.watch in keys:
                self.event.set()
        return await super().request(method, url, body, **kw)


def _plain(model: GatedMLP) -> nn.Module:
    """The gated model without its gate (for the torch reference run)."""
    return nn.Sequential(copy.deepcopy(model.first), nn.ReLU(), copy.deepcopy(model.last))


def _check_overlap(model: GatedMLP, transport: PushRecorder, prefix: str) -> None:
    # The backward pass could only get past the gate because the last layer's push was already
    # on the wire; without the hooks it would have waited the full timeout and recorded False.
    assert model.opened == [True]
    first_push = transport.sent[0]
    assert first_push[0].startswith(prefix + "last."), transport.sent
    pushed = sorted(k for keys in transport.sent for k in keys)
    assert pushed == sorted(prefix + n for n, _ in model.named_parameters())  # each once


def test_async_overlap_hooks_push_during_backward(cluster):
    transport = PushRecorder("ovl-a/last.weight")
    model = GatedMLP(transport.event, [])
    x, y = batches(4, n=1)[0]
    ref = reference(_plain(model), [(x, y)])

    async def main():
        async with client(cluster, transport=transport) as ps:
            pm = PSModule(model, ps, prefix="ovl-a/", optimizer=kc.SGD(lr=LR), overlap=True)
            await pm.pull()
            transport.sent.clear()
            await pm.backward(nn.functional.cross_entropy(model(x), y))
            await pm.push()
            await pm.pull()
    asyncio.run(main())
    _check_overlap(model, transport, "ovl-a/")
    assert_same_params(model, ref)


def test_sync_overlap_hooks_push_during_plain_backward(cluster):
    transport = PushRecorder("ovl-s/last.weight")
    model = GatedMLP(transport.event, [])
    x, y = batches(5, n=1)[0]
    ref = reference(_plain(model), [(x, y)])
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0, transport=transport) as ps:
        pm = SyncPSModule(model, ps, prefix="ovl-s/", optimizer=kc.SGD(lr=LR), overlap=True)
        pm.pull()
        transport.sent.clear()
        nn.functional.cross_entropy(model(x), y).backward()  # an ordinary backward call
        versions = pm.push()
        pm.pull()
    _check_overlap(model, transport, "ovl-s/")
    assert set(versions.values()) == {1}
    assert_same_params(model, ref)


class Recommender(nn.Module):
    """Bags of item ids -> mean of their kvps embedding rows -> a linear score."""

    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.emb, self.out = emb, nn.Linear(4, 1)

    def forward(self, ids):  # ids (batch, bag)
        return self.out(self.emb(ids).mean(dim=1)).squeeze(1)  # (batch,)


ITEMS = 50


def rec_batches(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, ITEMS, (16, 3), generator=g), torch.randn(16, generator=g)) for _ in range(n)]


def rec_reference(rows: np.ndarray, data) -> Recommender:
    model = Recommender(nn.Embedding(ITEMS, 4))
    with torch.no_grad():
        model.emb.weight.copy_(torch.from_numpy(rows))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for ids, target in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(ids), target).backward()
        opt.step()
    return model


def _check_rec(rows_after: np.ndarray, model: Recommender, ref: Recommender) -> None:
    np.testing.assert_allclose(rows_after, ref.emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.out.weight, ref.out.weight, rtol=1e-5, atol=1e-6)


def test_embedding_layer_in_a_sync_training_loop(cluster):
    data = rec_batches(6)
    all_ids = np.arange(ITEMS, dtype=np.int64)
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0) as ps:
        emb = Embedding(ps, "emb-s/items", 4, optimizer=kc.SGD(lr=LR), init=kc.Normal(std=0.1, seed=1))
        model = Recommender(emb)
        pm = SyncPSModule(model, ps, prefix="emb-s/", optimizer=kc.SGD(lr=LR))
        assert list(pm.keys) == ["out.weight", "out.bias"]  # rows are not dense keys
        with torch.no_grad():
            model(torch.from_numpy(all_ids).view(1, -1))  # creates the table; no grad, no push
        rows_before = ps.pull_rows("emb-s/items", all_ids)
        for ids, target in data:
            pm.pull()
            nn.functional.mse_loss(model(ids), target).backward()
            versions = pm.push()
        pm.pull()
        rows_after = ps.pull_rows("emb-s/items", all_ids)
    assert versions["emb-s/items"] >= 2  # a popular row was pushed by several steps
    _check_rec(rows_after, model, rec_reference(rows_before, data))


def test_embedding_layer_in_an_asyncio_training_loop(cluster):
    data = rec_batches(7)
    all_ids = np.arange(ITEMS, dtype=np.int64)

    async def main():
        async with client(cluster) as ps:
            emb = Embedding(ps, "emb-a/items", 4, optimizer=kc.SGD(lr=LR), init=kc.Normal(std=0.1, seed=2))
            model = Recommender(emb)
            pm = PSModule(model, ps, prefix="emb-a/", optimizer=kc.SGD(lr=LR), overlap=True)
            with pytest.raises(kc.InvalidRequest):
                model(data[0][0])  # an asyncio client cannot pull inside forward
            await emb.prefetch(all_ids)  # creates the table
            rows_before = await ps.pull_rows("emb-a/items", all_ids)
            for ids, target in data:
                await pm.pull()
                await emb.prefetch(ids)
                await pm.backward(nn.functional.mse_loss(model(ids), target))
                await pm.push()
            await pm.pull()
            return model, rows_before, await ps.pull_rows("emb-a/items", all_ids)
    model, rows_before, rows_after = asyncio.run(main())
    _check_rec(rows_after, model, rec_reference(rows_before, data))
