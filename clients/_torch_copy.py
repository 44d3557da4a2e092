"""Moving a module's values between the host and its devices, correctly and off the event loop.

Stream rules (torch's "CUDA semantics" notes): every copy runs on the module's own copy stream of
the device, which first waits for the stream the values were produced on or will be used on (the
*caller's* current stream, captured in the caller's thread: the client's loop thread and pool
threads have their own, default, streams). After a host-to-device copy the caller's stream waits
for the copy stream, so the caller's next kernels see the new values; a tensor the copy stream
uses is ``record_stream``-ed there, so the caching allocator does not hand its memory out while
the copy may still read it. A copy's end is a *blocking* CUDA event (the waiting thread sleeps in
the driver; a default event spins a core), waited for in the module's one worker thread, which
has the device set (a thread without one would create a context on GPU 0).

Pinned memory: one buffer per module, sized to the model (a region per parameter; a sparse
embedding's region also holds its row ids), allocated once and reused every step, so a model's
worth of page-locked memory stays pinned, not a new buffer per gradient per step. Before the host
writes a region again it waits for the last device copy that read the pool.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvps.errors import InvalidRequest

__all__ = ["Copier", "PinnedBuffer", "Staged", "current_streams", "host_array", "wait_event"]

_ALIGN = 64  # region offsets: aligned for every dtype, and for DMA


def current_streams(devices: Iterable[torch.device]) -> dict[torch.device, Any]:
    """The calling thread's current stream on each CUDA device (what the caller's work runs on)."""
    return {d: torch.cuda.current_stream(d) for d in devices if d.type == "cuda"}


def wait_event(event: Any, device: torch.device) -> None:
    with torch.cuda.device(device):
        event.synchronize()


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy: a view, except bfloat16, widened (exactly) to a float32 copy."""
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.detach().numpy()


@dataclass
class Staged:
    """A value on its way to the host: ``host`` is valid once ``event`` (None: already) is done."""

    host: torch.Tensor
    event: Any = None
    device: torch.device | None = None

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            wait_event(self.event, self.device)
        return self.host


class PinnedBuffer:
    """A growing pinned host buffer, reused: for values whose size changes every step (embedding
    rows). ``take`` waits until the last device copy that used it is done."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._last: tuple[Any, torch.device] | None = None

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._last is not None:
            wait_event(*self._last)
            self._last = None
        if self._buf is None or self._buf.numel() < nbytes:
            size = max(nbytes, 2 * (0 if self._buf is None else self._buf.numel()), 4096)
            with torch.cuda.device(device):  # pinning needs a context: the device's, not GPU 0's
                self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return self._buf

    def used_until(self, event: Any, device: torch.device) -> None:
        self._last = (event, device)


class Copier:
    """The copies of one module: its worker thread, copy streams and pinned pool.

    ``sizes``: bytes of staging per name (parameters on a GPU). ``devices``: every device the
    module's parameters live on."""

    def __init__(self, sizes: dict[str, int], devices: Iterable[torch.device]) -> None:
        devices = set(devices)
        self.devices = frozenset(devices)
        bad = sorted(str(d) for d in devices if d.type not in ("cpu", "cuda"))
        if bad:
            raise InvalidRequest(f"parameters on {', '.join(bad)}: kvps serves CPU and CUDA tensors")
        self.cuda = sorted((d for d in devices if d.type == "cuda"), key=lambda d: d.index or 0)
        first = self.cuda[0] if self.cuda else None
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvps-copy",
            initializer=(lambda: torch.cuda.set_device(first)) if first is not None else None)
        self._streams = {d: torch.cuda.Stream(d) for d in self.cuda}
        self._regions: dict[str, tuple[int, int]] = {}
        total = 0
        for name, nbytes in sizes.items():
            self._regions[name] = (total, nbytes)
            total += -(-nbytes // _ALIGN) * _ALIGN
        self._pool = None
        if self.cuda and total:
            with torch.cuda.device(first):  # pinning needs a context: the module's, not GPU 0's
                self._pool = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        self._reads: dict[torch.device, Any] = {}  # the last host-to-device copy out of the pool

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` in the worker thread (awaitable from the running loop)."""
        return asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        for device, event in list(self._reads.items()):
            wait_event(event, device)  # the pool must outlive the copies that read it
        self._thread.shutdown(wait=True)

    def region(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """A view of ``name``'s pinned region (from ``offset`` bytes) as ``shape`` ``dtype``."""
        start, nbytes = self._regions[name]
        size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        if self._pool is None or offset + size > nbytes:
            raise InvalidRequest(f"{name}: {size} bytes do not fit its staging region of {nbytes}")
        raw = self._pool[start + offset:start + offset + size]
        return raw.view(dtype).view(shape)

    def stream(self, device: torch.device) -> Any:
        return self._streams[device]

    # ---- host -> device (pull) --------------------------------------------------------------

    def install(self, items: list[tuple[str, torch.Tensor, Callable[[torch.Tensor], None]]],
                caller: dict[torch.device, Any]) -> None:
        """Worker thread: ``fill(dst)`` writes each parameter's new value into ``dst`` (the
        parameter itself on the CPU, its pinned region for a GPU), then the GPU copies run on
        the copy streams after the caller's queued work, and the caller's streams wait for them."""
        for device in list(self._reads):
            wait_event(self._reads.pop(device), device)  # the pool is ours to write again
        on_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, param, fill in items:
            if param.device.type == "cpu":
                fill(param.detach())
                continue
            staging = self.region(name, tuple(param.shape), param.dtype)
            fill(staging)
            on_device.setdefault(param.device, []).append((param, staging))
        for device, pairs in on_device.items():
            self._reads[device] = self._to_device(device, pairs, caller[device])

    def _to_device(self, device: torch.device, pairs: list, caller: Any) -> Any:
        copy = self._streams[device]
        with torch.cuda.device(device):
            copy.wait_stream(caller)  # not before the caller's queued kernels are done with them
            with torch.cuda.stream(copy):
                for param, staging in pairs:
                    param.detach().copy_(staging, non_blocking=True)
            for param, _ in pairs:
                param.record_stream(copy)
            event = torch.cuda.Event(blocking=True)
            event.record(copy)
            caller.wait_stream(copy)  # the caller's next kernels see the new values
        return event

    # ---- device -> host (push) --------------------------------------------------------------

    def to_host(self, name: str, value: torch.Tensor, producer: Any, offset: int = 0) -> Staged:
        """Start copying ``value`` into ``name``'s region (from ``offset``) once ``producer``
        (the stream it is computed on) has computed it. A CPU value is its own host copy."""
        if value.device.type == "cpu":
            return Staged(value)
        device = value.device
        host = self.region(name, tuple(value.shape), value.dtype, offset)
        copy = self._streams[device]
        with torch.cuda.device(device):
            copy.wait_stream(producer)
            with torch.cuda.stream(copy):
                host.copy_(value, non_blocking=True)
            value.record_stream(copy)  # the caller may drop value before the copy has run
            event = torch.cuda.Event(blocking=True)
            event.record(copy)
        return Staged(host, event, device)
