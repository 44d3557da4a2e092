"""kvps_client.torch on GPUs (tests/gpu/check.sh runs this file; skipped without CUDA).

What the CPU cannot show: copies ordered after the caller's *current* stream (a non-default one
here, with the default stream kept busy so a copy queued there would come too late), gradients
copied only once the stream that computes them is done, one pinned pool reused every step, AMP
(autocast + GradScaler on CUDA) skipping overflowing steps, bf16 models, sparse embedding
gradients on the GPU, kvps Embedding lookups of GPU ids, and a model split over two GPUs that
creates no CUDA context on a GPU it does not use. Each training test compares with the same steps
run by plain torch on the same device."""
from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import kvps_client as kc
from conftest import ROOT, module_cluster
from kvps_client.torch import Embedding, PSModule, SyncPSModule

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False here)"),
]
LR = 0.1
BUSY = 200_000_000  # cycles of torch.cuda._sleep: tens of ms of a busy stream


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "cuda", shards=2)


@pytest.fixture(autouse=True)
def exact_matmuls():
    # TF32 would make runs differ from their references by more than float32 rounding.
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def sync_client(cluster) -> kc.SyncClient:
    return kc.SyncClient(cluster.endpoints, token=cluster.token, seed=0)


def _data(seed: int, n: int = 4, device: str = "cuda", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 16, generator=g).to(device, dtype), torch.randint(0, 4, (32,), generator=g).to(device))
            for _ in range(n)]


def _model(device: str = "cuda", dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(device, dtype)


def _reference(model: nn.Module, data) -> nn.Module:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _same(model: nn.Module, ref: nn.Module, atol: float = 1e-5) -> None:
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p.float(), q.float(), rtol=1e-4, atol=atol)


# ---- streams ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
def test_training_on_a_non_default_stream_while_the_default_stream_is_busy(cluster, overlap):
    """A copy queued on the default stream (or on the client's thread's) would run after the
    busy kernel, long after the caller's stream has read the parameters or pushed the grads."""
    model, data = _model(), _data(1)
    ref = _reference(model, data)
    side = torch.cuda.Stream()
    with sync_client(cluster) as ps, torch.cuda.stream(side):
        pm = SyncPSModule(model, ps, prefix=f"stream{int(overlap)}/", optimizer=kc.SGD(lr=LR), overlap=overlap)
        for x, y in data:
            torch.cuda.default_stream().wait_stream(side)
            with torch.cuda.stream(torch.cuda.default_stream()):
                torch.cuda._sleep(BUSY)  # the default stream is busy for a while
            pm.pull()
            torch.cuda._sleep(BUSY // 4)  # the gradients come late on the caller's stream
            nn.functional.cross_entropy(model(x), y).backward()
            pm.push()
        pm.pull()
        pm.close()
    _same(model, ref)


def test_the_pinned_pool_is_allocated_once_and_reused(cluster):
    model, data = _model(), _data(2, n=3)
    with sync_client(cluster) as ps:
        pm = SyncPSModule(model, ps, prefix="pool/", optimizer=kc.SGD(lr=LR))
        pools = []
        for x, y in data:
            pm.pull()
            nn.functional.cross_entropy(model(x), y).backward()
            pm.push()
            pools.append(pm.inner._copier._pool)
        pm.close()
    assert all(p is pools[0] for p in pools) and pools[0].is_pinned()
    assert pools[0].numel() >= sum(p.numel() * 4 for p in model.parameters())


def test_async_wrapper_backward_runs_on_the_callers_stream(cluster):
    model, data = _model(), _data(3)
    ref = _reference(model, data)

    async def main():
        side = torch.cuda.Stream()
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=0) as ps:
            pm = PSModule(model, ps, prefix="cuda-a/", optimizer=kc.SGD(lr=LR), overlap=True)
            with torch.cuda.stream(side):
                for x, y in data:
                    await pm.pull()
                    await pm.backward(nn.functional.cross_entropy(model(x), y))
                    await pm.push()
                await pm.pull()
            await pm.close()
    asyncio.run(main())
    _same(model, ref)


# ---- AMP and bf16 ---------------------------------------------------------------------------------

def test_autocast_and_grad_scaler_skip_an_overflowing_step(cluster):
    model, data = _model(), _data(4, n=5)
    ref = copy.deepcopy(model)
    opt, ref_scaler = torch.optim.SGD(ref.parameters(), lr=LR), torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ref(x), y) * (float("inf") if i == 2 else 1.0)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(opt)
        ref_scaler.update()
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    with sync_client(cluster) as ps:
        pm = SyncPSModule(model, ps, prefix="amp/", optimizer=kc.SGD(lr=LR), scaler=scaler, overlap=True)
        pushed = []
        for i, (x, y) in enumerate(data):
            pm.pull()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y) * (float("inf") if i == 2 else 1.0)
            scaler.scale(loss).backward()
            pushed.append(pm.push())
        pm.pull()
        pm.close()
    assert pushed[2] == {} and scaler.get_scale() == ref_scaler.get_scale()
    _same(model, ref, atol=1e-4)


def test_a_bf16_model_on_the_gpu(cluster):
    model, data = _model(dtype=torch.bfloat16), _data(5, dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    master = [p.detach().float().clone() for p in ref.parameters()]
    for x, y in data:
        with torch.no_grad():
            for p, m in zip(ref.parameters(), master):
                p.copy_(m)
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x).float(), y).backward()
        for p, m in zip(ref.parameters(), master):
            m.add_(p.grad.float() * np.float32(-LR))
    with torch.no_grad():
        for p, m in zip(ref.parameters(), master):
            p.copy_(m)
    with sync_client(cluster) as ps:
        pm = SyncPSModule(model, ps, prefix="bf16/", optimizer=kc.SGD(lr=LR))
        for x, y in data:
            pm.pull()
            nn.functional.cross_entropy(model(x).float(), y).backward()
            pm.push()
        pm.pull()
        pm.close()
    _same(model, ref, atol=4e-3)  # one bf16 step at 1.0: the exact agreement is shown on the CPU


# ---- embeddings ---------------------------------------------------------------------------------

class SparseRec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.emb = nn.Embedding(100, 8, sparse=True)
        self.out = nn.Linear(8, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1)).squeeze(1)


def test_sparse_embedding_gradients_on_the_gpu(cluster):
    g = torch.Generator().manual_seed(7)
    data = [(torch.randint(0, 30, (16, 4), generator=g).cuda(), torch.randn(16, generator=g).cuda()) for _ in range(4)]
    model = SparseRec().cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for ids, target in data:
        opt.zero_grad()
        nn.functional.mse_loss(ref(ids), target).backward()
        opt.step()
    with sync_client(cluster) as ps:
        pm = SyncPSModule(model, ps, prefix="sparse-gpu/", optimizer=kc.SGD(lr=LR), overlap=True)
        for ids, target in data:
            pm.pull()
            nn.functional.mse_loss(model(ids), target).backward()
            pm.push()
        pm.pull()
        pm.close()
    _same(model, ref)


def test_kvps_embedding_looks_gpu_ids_up_on_the_gpu(cluster):
    with sync_client(cluster) as ps:
        emb = Embedding(ps, "cuda-e/items", 8, optimizer=kc.SGD(lr=1.0), init=kc.Normal(std=0.1, seed=4)).cuda()
        before = ps.pull_rows("cuda-e/items", np.array([3, 7, 9]))
        ids = torch.tensor([[3, 7], [7, 9]], device="cuda")
        out = emb(ids)  # nothing held: the ids are copied to the host and the rows pulled
        assert out.device.type == "cuda" and out.shape == (2, 2, 8)
        out.sum().backward()
        emb.push()
        mid = ps.pull_rows("cuda-e/items", np.array([3, 7, 9]))
        emb.prefetch(np.array([3, 7, 9]))
        emb(ids).sum().backward()  # held: looked up on the GPU
        emb.push()
        after = ps.pull_rows("cuda-e/items", np.array([3, 7, 9]))
        emb.prefetch(np.array([3]))
        emb(torch.tensor([3, 4], device="cuda")).sum().backward()  # 4 was not prefetched
        with pytest.raises(kc.InvalidRequest, match="not prefetched"):
            emb.push()
    np.testing.assert_allclose(mid, before - np.array([[1], [2], [1]]), rtol=1e-6)  # 7 twice
    np.testing.assert_allclose(after, mid - np.array([[1], [2], [1]]), rtol=1e-6)


# ---- two GPUs -----------------------------------------------------------------------------------

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@TWO_GPUS
def test_a_model_split_over_two_gpus(cluster):
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(16, 32).to("cuda:0"), nn.Linear(32, 4).to("cuda:1")

        def forward(self, x):
            return self.b(torch.relu(self.a(x.to("cuda:0"))).to("cuda:1"))

    model, data = Split(), _data(8, device="cuda:1")
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    with sync_client(cluster) as ps:
        pm = SyncPSModule(model, ps, prefix="split/", optimizer=kc.SGD(lr=LR), overlap=True)
        for x, y in data:
            pm.pull()
            nn.functional.cross_entropy(model(x), y).backward()
            pm.push()
        pm.pull()
        pm.close()
    _same(model, ref)


@TWO_GPUS
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi")
def test_a_module_on_gpu_1_creates_no_context_on_gpu_0(cluster, tmp_path):
    """Every thread that touches CUDA for the module has its device set: nothing lands on GPU 0."""
    script = tmp_path / "gpu1.py"
    script.write_text(f"""
import json, sys, torch
from torch import nn
import kvps_client as kc
from kvps_client.torch import SyncPSModule
torch.cuda.set_device(1)
model = nn.Linear(16, 4).to("cuda:1")
with kc.SyncClient({cluster.endpoints!r}, token={cluster.token!r}) as ps:
    pm = SyncPSModule(model, ps, prefix="gpu1/", optimizer=kc.SGD(lr=0.1), overlap=True)
    for _ in range(3):
        pm.pull()
        model(torch.randn(8, 16, device="cuda:1")).sum().backward()
        pm.push()
    pm.close()
    torch.cuda.synchronize(1)
    print(json.dumps({{"pid": __import__("os").getpid()}}), flush=True)
    sys.stdin.readline()  # hold the contexts while the test looks
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pid = json.loads(proc.stdout.readline())["pid"]
        uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True).stdout
        gpu0 = next(line.split(",")[1].strip() for line in uuids.splitlines() if line.startswith("0,"))
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout
        on_gpu0 = [line for line in apps.splitlines() if line.startswith(f"{pid},") and gpu0 in line]
        assert on_gpu0 == [], apps
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
