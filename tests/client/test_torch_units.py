"""kvps_client.torch pieces that need no cluster: torchrun's variables, the store's value packing,
clipping, bf16 rounding of pulled values, conversions, and the GPU lookup of kvps Embedding (whose
logic is device-independent, so it is exercised here on CPU tensors)."""
from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvps_client as kc
from kvps.placement import DenseLayout
from kvps_client._convert import host_values, to_numpy
from kvps_client._torch_copy import Copier
from kvps_client._torch_module import _write_blocks
from kvps_client._torch_optim import clip_by_norm
from kvps_client._torch_rdzv import endpoints_of
from kvps_client._torch_store import _pack, _unpack
from kvps_client.torch import Embedding, KvpsStore, PSModule, TorchrunEnv


def test_torchrun_variables_are_read_and_checked():
    env = TorchrunEnv.read({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "j"})
    assert env == TorchrunEnv(2, 3, 1, "j")
    assert env.module_options({"prefix": "m/"}) == {"job": "torchrun-j", "worker": "rank-2", "workers": 3,
                                                    "prefix": "m/"}
    assert env.module_options({"job": "mine"})["job"] == "mine"  # explicit options win
    assert TorchrunEnv.read({"RANK": "0", "WORLD_SIZE": "1"}) == TorchrunEnv(0, 1, 0, "none")
    if not torch.cuda.is_available():
        assert env.device() == torch.device("cpu")
    for bad in ({}, {"RANK": "0"}, {"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "2", "WORLD_SIZE": "2"}):
        with pytest.raises(kc.InvalidRequest):
            TorchrunEnv.read(bad)


def test_from_env_outside_torchrun_says_so():
    import asyncio
    with pytest.raises(kc.InvalidRequest, match="torchrun"):
        asyncio.run(PSModule.from_env(torch.nn.Linear(2, 1), "http://127.0.0.1:1", environ={}))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_store_values_round_trip_through_float64_slots(value):
    slot = _pack(value, 2 + 50)
    assert slot.dtype == np.float64 and np.isfinite(slot).all()  # never refused as NaN/Inf
    assert _unpack(slot) == value
    assert _unpack(np.zeros(52)) is None  # absent


def test_store_arguments_are_checked_before_connecting():
    with pytest.raises(kc.InvalidRequest):
        KvpsStore("http://127.0.0.1:1", timeout=timedelta(0))
    with pytest.raises(kc.InvalidRequest):
        KvpsStore("http://127.0.0.1:1", max_value_bytes=0)


def test_rendezvous_endpoints():
    assert endpoints_of("h:1, https://g:2,") == ["http://h:1", "https://g:2"]


def test_clip_by_norm_is_clip_grad_norm_per_tensor():
    g = torch.Generator().manual_seed(0)
    for scale in (0.01, 10.0):  # below and above the limit
        grad = torch.randn(7, 5, generator=g) * scale
        ref = grad.clone()
        p = torch.nn.Parameter(torch.zeros(7, 5))
        p.grad = ref
        torch.nn.utils.clip_grad_norm_([p], 1.0)
        torch.testing.assert_close(clip_by_norm(grad, 1.0), p.grad, rtol=0, atol=1e-7)
    dense = torch.randn(6, 3, generator=g) * 5
    dense[2] = 0
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1, 3, 4, 5, 0]]), torch.cat([dense[[0, 1, 3, 4, 5]], dense[:1] * 0]),
                                     (6, 3), check_invariants=True)
    torch.testing.assert_close(clip_by_norm(sparse, 1.0).to_dense(), clip_by_norm(dense.clone(), 1.0))


def test_pulled_float32_blocks_round_into_bf16_parameters_as_torch_rounds():
    rng = np.random.default_rng(1)
    value = rng.standard_normal((10, 7)).astype(np.float32)
    value[0, :3] = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5]  # ties round to even
    layout = DenseLayout((10, 7), "float32", 4)
    dst = torch.empty(10, 7, dtype=torch.bfloat16)
    _write_blocks(dst, layout, [value[layout.block_slice(b)] for b in range(layout.n_blocks)])
    assert torch.equal(dst, torch.from_numpy(value).to(torch.bfloat16))


def test_conversions_widen_bf16_and_refuse_sparse_tensors_by_name():
    t = torch.tensor([1.5, -3.25, 1e30], dtype=torch.bfloat16)
    arr = to_numpy(t)
    assert arr.dtype == np.float32 and arr.tolist() == t.float().tolist()
    with pytest.raises(kc.InvalidRequest, match="push_rows"):
        to_numpy(torch.eye(3).to_sparse(), name="g")
    cpu = torch.ones(2)
    assert host_values({"a": cpu})["a"] is cpu  # only GPU tensors are converted there


def test_copier_refuses_devices_it_does_not_serve_and_fills_cpu_parameters():
    with pytest.raises(kc.InvalidRequest, match="meta"):
        Copier({}, [torch.device("meta")])
    copier = Copier({}, [torch.device("cpu")])
    p = torch.nn.Parameter(torch.zeros(3))
    copier.install([("p", p, lambda dst: dst.copy_(torch.arange(3.0)))], {})
    copier.close()
    assert p.tolist() == [0.0, 1.0, 2.0] and p.requires_grad


def _embedding_holding(ids: list[int]) -> Embedding:
    emb = Embedding(kc.Client("http://127.0.0.1:1"), "e", 2)  # never opened: rows set by hand
    emb._held_ids = np.array(ids, np.int64)
    emb._held_rows = np.arange(2 * len(ids), dtype=np.float32).reshape(-1, 2)
    return emb


def test_embedding_device_lookup_indexes_the_held_rows_and_marks_what_it_used():
    emb = _embedding_holding([3, 7, 9])
    out = emb._lookup_on_device(torch.tensor([[9, 3], [9, 9]]))
    assert out.tolist() == [[[4.0, 5.0], [0.0, 1.0]], [[4.0, 5.0], [4.0, 5.0]]]
    out.sum().backward()
    leaf = emb._pending[0]
    ids, grads = emb._gather(leaf, (leaf.rows.grad, None), (leaf.used_dev, None), (leaf.missing, None))
    assert ids.tolist() == [3, 9] and grads.tolist() == [[1.0, 1.0], [3.0, 3.0]]  # 7 was not used


def test_embedding_device_lookup_of_an_id_not_held_refuses_to_push():
    emb = _embedding_holding([3, 7])
    emb._lookup_on_device(torch.tensor([3, 8])).sum().backward()
    leaf = emb._pending[0]
    with pytest.raises(kc.InvalidRequest, match="not prefetched"):
        emb._gather(leaf, (leaf.rows.grad, None), (leaf.used_dev, None), (leaf.missing, None))


def test_embedding_in_asyncio_mode_refuses_ids_it_does_not_hold():
    emb = _embedding_holding([1])
    with pytest.raises(kc.InvalidRequest, match="prefetch"):
        emb(torch.tensor([1, 2]))


OWN_MODULES = ["kvps_client.torch", "kvps_client._torch_copy", "kvps_client._torch_embedding",
               "kvps_client._torch_env", "kvps_client._torch_module", "kvps_client._torch_optim",
               "kvps_client._torch_rdzv", "kvps_client._torch_sparse", "kvps_client._torch_store",
               "kvps_client._torch_sync", "kvps_client._convert", "kvps_client._lossy",
               "kvps_client._hyper", "kvps.hyper", "kvps.command"]


@pytest.mark.parametrize("name", OWN_MODULES)
def test_exported_names_are_sorted_and_complete(name):
    """Every public class and function a module defines is in its sorted ``__all__``."""
    import importlib
    import inspect
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__)
    defined = {n for n, obj in vars(module).items() if not n.startswith("_")
               and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module.__name__}
    assert defined <= set(module.__all__), sorted(defined - set(module.__all__))
    assert all(hasattr(module, n) for n in module.__all__)
