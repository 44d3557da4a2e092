"""kvps_client.torch with CUDA tensors: gradients leave the GPU through pinned host buffers with
non-blocking copies, pulled values enter it the same way, and training matches a CPU reference.
Skipped without a CUDA device; written to finish in well under a minute on a GPU machine."""
from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch
from torch import nn

import kvps_client as kc
from conftest import module_cluster
from kvps_client.torch import Embedding, PSModule, SyncPSModule, _staged, _to_host

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False here)"),
]
LR = 0.1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "cuda", shards=2)


@pytest.fixture(autouse=True)
def exact_matmuls():
    # TF32 would make the GPU run differ from the CPU reference by more than float32 rounding.
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_staging_buffers_are_pinned_and_copies_asynchronous():
    grad = torch.randn(256, 64, device="cuda")
    host, event = _to_host(grad)
    assert host.device.type == "cpu" and host.is_pinned() and isinstance(event, torch.cuda.Event)
    event.synchronize()
    torch.testing.assert_close(host, grad.cpu())
    staged = _staged(np.arange(12, dtype=np.float32), torch.device("cuda"))
    assert staged.is_pinned()


def _data(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(n)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def _reference(model: nn.Module, data) -> nn.Module:
    model = copy.deepcopy(model).cpu()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _same(model: nn.Module, ref: nn.Module) -> None:
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_async_wrapper_on_a_cuda_module(cluster, overlap):
    model, data = _model().cuda(), _data(1)
    ref = _reference(model, data)

    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=0) as ps:
            pm = PSModule(model, ps, prefix=f"cuda-a{int(overlap)}/", optimizer=kc.SGD(lr=LR), overlap=overlap)
            for x, y in data:
                await pm.pull()
                await pm.backward(nn.functional.cross_entropy(model(x.cuda()), y.cuda()))
                await pm.push()
            await pm.pull()
    asyncio.run(main())
    torch.cuda.synchronize()
    _same(model, ref)


def test_sync_wrapper_with_overlap_on_a_cuda_module(cluster):
    model, data = _model().cuda(), _data(2)
    ref = _reference(model, data)
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0) as ps:
        pm = SyncPSModule(model, ps, prefix="cuda-s/", optimizer=kc.SGD(lr=LR), overlap=True)
        for x, y in data:
            pm.pull()
            nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()  # hooks on autograd's thread
            pm.push()
        pm.pull()
    torch.cuda.synchronize()
    _same(model, ref)


def test_embedding_rows_on_the_gpu(cluster):
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0) as ps:
        emb = Embedding(ps, "cuda-e/items", 8, optimizer=kc.SGD(lr=1.0), init=kc.Normal(std=0.1, seed=4)).cuda()
        ids = torch.tensor([[3, 7], [7, 9]], device="cuda")
        before = ps.pull_rows("cuda-e/items", np.array([3, 7, 9]))
        out = emb(ids)  # (2, 2, 8)
        assert out.device.type == "cuda" and out.shape == (2, 2, 8)
        out.sum().backward()
        emb.push()
        after = ps.pull_rows("cuda-e/items", np.array([3, 7, 9]))
    np.testing.assert_allclose(after, before - np.array([[1], [2], [1]]), rtol=1e-6)  # 7 appears twice
