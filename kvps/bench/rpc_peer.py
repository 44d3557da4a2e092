"""The PyTorch RPC peer: an unreplicated parameter server, the pattern of PyTorch's RPC tutorial.

One server process (rank 0, ``"ps"``) holds the model as torch tensors behind one lock; workers
(ranks 1..n) call ``rpc_sync("ps", get_params)`` (the server clones every tensor under the lock) and
``rpc_sync("ps", push_grads, (grads,))`` (the server applies ``p -= LR * g`` under the lock).
Every process is ``spawn``-ed with ``torch.set_num_threads(1)`` (2 cores: intra-op threads only
fight each other). TensorPipe picks its shared-memory / CMA channels on one host, so this peer
moves bytes without sockets — and keeps one copy: a server crash loses the model.

RPC entry points must be importable module-level functions, so the server's state is one
module-level object that exists only in the server process (set by ``_server_main``).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Callable

from kvps.bench.harness import StepWindow, Window, worker_loop
from kvps.bench.workload import LR, Model

__all__ = ["get_params", "push_grads", "rpc_missing_reason", "rpc_worker", "start_rpc_server"]

_STATE: _ParameterServer | None = None  # only ever set inside the server process


def rpc_missing_reason() -> str | None:
    try:
        from torch.distributed import rpc
    except ImportError as exc:
        return f"torch.distributed.rpc is not available: {exc}"
    if not rpc.is_available():
        return "this torch build has no RPC support"
    return None


class _ParameterServer:
    def __init__(self, model: Model) -> None:
        import torch

        self.lock = threading.Lock()
        self.params = [torch.from_numpy(v) for v in model.values()]  # tensors × (numel,) float32

    def get(self) -> list:
        with self.lock:
            return [p.clone() for p in self.params]

    def push(self, grads: list) -> None:
        with self.lock:
            for p, g in zip(self.params, grads):
                p.add_(g, alpha=-LR)


def _state() -> _ParameterServer:
    if _STATE is None:
        raise RuntimeError("RPC entry points run in the parameter-server process only")
    return _STATE


def get_params() -> list:
    return _state().get()


def push_grads(grads: list) -> None:
    _state().push(grads)


def _init(name: str, rank: int, world: int, port: int) -> None:
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    from torch.distributed import rpc

    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=120,
                                           init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)


def _server_main(port: int, world: int, model: Model) -> None:
    global _STATE
    _STATE = _ParameterServer(model)
    from torch.distributed import rpc

    _init("ps", 0, world, port)
    rpc.shutdown()  # graceful: returns once every worker has shut down too


def start_rpc_server(port: int, workers: int, model: Model) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=_server_main, args=(port, workers + 1, model),
                                           daemon=True)
    proc.start()
    return proc


def rpc_worker(rank: int, port: int, workers: int, model: Model) -> Callable[[Window], StepWindow]:
    import torch
    from torch.distributed import rpc

    _init(f"w{rank}", rank + 1, workers + 1, port)
    grads = [torch.from_numpy(g) for g in model.grads(rank)]
    rpc.rpc_sync("ps", get_params)  # first call: connections and channels

    def step() -> None:
        params = rpc.rpc_sync("ps", get_params)
        del params
        rpc.rpc_sync("ps", push_grads, args=(grads,))

    def run(window: Window) -> StepWindow:
        out = StepWindow()
        try:
            worker_loop(step, window, out)
        finally:
            rpc.shutdown()
        return out

    return run
