"""The one place where torch meets the client: values in, numpy out.

CPU tensors become numpy views (bfloat16 is widened to float32: numpy has no bfloat16, and the
server keeps bf16 models' values in float32, exactly as mixed-precision training keeps master
weights). CUDA tensors are copied to pinned host memory on a side stream that first waits for the
caller's current stream (so the copy sees every kernel the caller queued before it, whatever
stream the caller runs on), and the copy's end is a *blocking* CUDA event: the waiting thread
sleeps in the driver instead of spinning a core.

``Client`` calls ``to_host`` at its entry points, which waits for those events in a worker thread,
so the event loop never waits on a GPU; ``SyncClient`` converts in the caller's thread before it
hands a call to its loop. torch is never imported here: a tensor can only exist if the caller
imported torch already.
"""
from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvps.errors import InvalidRequest, ShapeMismatch

__all__ = ["check_shape", "device_to_host", "host_values", "to_host", "to_numpy", "writable_view"]


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_cuda(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor) and value.device.type == "cuda"


def to_numpy(value: Any, *, name: str = "value") -> np.ndarray:
    """``value`` as a numpy array. A CUDA tensor is copied here and this thread waits for the
    copy: callers on an event loop use ``to_host`` instead."""
    if isinstance(value, np.ndarray):
        return value
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        t = _dense(value.detach(), name)
        if t.device.type == "cuda":
            host, event = device_to_host(t)
            _wait(event, t.device)
            t = host
        return _cpu_numpy(t, name)
    if isinstance(value, (int, float, bool, list, tuple, np.generic)):
        return np.asarray(value)
    raise InvalidRequest(f"{name}: expected a numpy array or a torch tensor, got {type(value).__name__}")


def _dense(t: Any, name: str) -> Any:
    if t.layout != _torch().strided:
        raise InvalidRequest(f"{name}: a sparse gradient is a set of rows: push it with push_rows "
                             "(PSModule does this for nn.Embedding(sparse=True))")
    return t


def _cpu_numpy(t: Any, name: str) -> np.ndarray:
    torch = _torch()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()  # exact: a bfloat16 is the top half of a float32
    return t.resolve_conj().resolve_neg().numpy()


def writable_view(value: Any, *, name: str = "value") -> np.ndarray:
    """``value`` (a numpy array or a CPU tensor) as a numpy array sharing its memory, to write into;
    ``InvalidRequest`` for anything that cannot be written in place (a read-only array, a CUDA or
    bfloat16 tensor: pull those into a host array and copy, as ``PSModule`` does)."""
    if isinstance(value, np.ndarray):
        if not value.flags.writeable:
            raise InvalidRequest(f"{name}: the array to pull into is read-only", key=name)
        return value
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.layout != torch.strided or value.dtype == torch.bfloat16:
            raise InvalidRequest(f"{name}: pull writes into numpy arrays and strided CPU tensors numpy can "
                                 f"view, not a {value.dtype} tensor on {value.device}", key=name)
        try:
            return value.detach().numpy()
        except RuntimeError as exc:  # a conjugate or negative view, say
            raise InvalidRequest(f"{name}: cannot pull into this tensor in place: {exc}", key=name) from None
    raise InvalidRequest(f"{name}: expected a numpy array or a torch tensor to pull into, got "
                         f"{type(value).__name__}", key=name)


def device_to_host(t: Any) -> tuple[Any, Any]:
    """Start copying CUDA tensor ``t`` into fresh pinned host memory: ``(host, event)``, the
    event (blocking) marks the end of the copy."""
    torch = _torch()
    with torch.cuda.device(t.device):  # t's context for everything below, never GPU 0's
        side = torch.cuda.Stream(t.device)  # from torch's per-device pool: no allocation
        side.wait_stream(torch.cuda.current_stream(t.device))  # after the kernels that produce t
        with torch.cuda.stream(side):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        t.record_stream(side)  # the caller may free t before the copy has run
        event = torch.cuda.Event(blocking=True)
        event.record(side)
    return host, event


def _wait(event: Any, device: Any) -> None:
    # With the event's device current: a thread without one would create a context on GPU 0.
    with _torch().cuda.device(device):
        event.synchronize()


def host_values(values: Any, *, name: str = "value") -> Any:
    """``values`` (one value or a mapping of them) with every CUDA tensor replaced by a numpy
    array; waits in this thread. Anything else is left for ``to_numpy`` to convert."""
    if isinstance(values, Mapping):
        return {k: to_numpy(v, name=str(k)) if _is_cuda(v) else v for k, v in values.items()}
    return to_numpy(values, name=name) if _is_cuda(values) else values


async def to_host(values: Any, *, name: str = "value") -> Any:
    """``host_values`` for a coroutine: the copies are queued now (in the caller's thread, after
    its current stream's work) and their events are waited for in a worker thread."""
    items = values.items() if isinstance(values, Mapping) else [(None, values)]
    started = {k: (v.device, *device_to_host(_dense(v.detach(), str(k if k is not None else name))))
               for k, v in items if _is_cuda(v)}
    if not started:
        return values
    await asyncio.to_thread(lambda: [_wait(event, dev) for dev, _, event in started.values()])
    host = {k: _cpu_numpy(h, str(k if k is not None else name)) for k, (_, h, _) in started.items()}
    if not isinstance(values, Mapping):
        return host[None]
    return {k: host.get(k, v) for k, v in values.items()}


def check_shape(key: str, arr: np.ndarray, shape: tuple, dtype: str) -> None:
    """Refuse ``arr`` on the client when the server would: another shape or dtype than ``key``'s."""
    if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
        raise ShapeMismatch(key, {"shape": list(shape), "dtype": str(dtype)},
                            {"shape": list(arr.shape), "dtype": arr.dtype.name})
