"""``SyncClient``: the same calls as ``Client``, blocking, for ordinary synchronous training loops.

It runs a private event loop in a daemon thread and submits each call to it, so it works from
any thread (including inside a program that has its own event loop elsewhere).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any

from ._client import Client
from ._convert import host_values

__all__ = ["SyncClient"]


class SyncClient:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._client = Client(*args, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvps-client", daemon=True)
        self._started = False

    def _run(self, coro: Coroutine) -> Any:
        return self._submit(coro).result()

    def _submit(self, coro: Coroutine) -> "concurrent.futures.Future":
        """Start ``coro`` on the client's loop and return at once (a background pull)."""
        if not self._started:
            coro.close()
            raise RuntimeError("SyncClient is not open: use `with SyncClient(...)` or .open()")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def open(self) -> "SyncClient":
        self._thread.start()
        self._started = True
        self._run(self._client.open())
        return self

    def close(self) -> None:
        if not self._started:
            return
        try:
            self._run(self._client.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            self._started = False

    def __enter__(self) -> "SyncClient":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self):
        return self._client.stats

    @property
    def client_id(self) -> str:
        return self._client.client_id

    # Values are converted here, in the caller's thread (after its current CUDA stream's work),
    # so the client's loop never waits on a GPU.
    def create(self, key, value, **kw): return self._run(self._client.create(key, host_values(value), **kw))
    def create_many(self, values, **kw): return self._run(self._client.create_many(host_values(values), **kw))
    def create_table(self, key, dim, **kw): return self._run(self._client.create_table(key, dim, **kw))
    def delete(self, key): return self._run(self._client.delete(key))
    def describe(self, key, **kw): return self._run(self._client.describe(key, **kw))
    def keys(self): return self._run(self._client.keys())
    def push(self, grads): return self._run(self._client.push(host_values(grads)))
    def pull(self, keys, **kw): return self._run(self._client.pull(keys, **kw))
    def get(self, key, **kw): return self._run(self._client.get(key, **kw))
    def set(self, key, value, **kw): return self._run(self._client.set(key, host_values(value), **kw))
    def pull_rows(self, key, ids, **kw): return self._run(self._client.pull_rows(key, host_values(ids), **kw))
    def push_rows(self, key, ids, grads):
        return self._run(self._client.push_rows(key, host_values(ids), host_values(grads)))
    def clock_tick(self, job, worker, step, **kw): return self._run(self._client.clock_tick(job, worker, step, **kw))
    def clocks(self, job): return self._run(self._client.clocks(job))
    def set_hyperparams(self, key, values, **kw): return self._run(self._client.set_hyperparams(key, values, **kw))
