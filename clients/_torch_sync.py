"""``SyncPSModule``: the blocking twin of ``PSModule``."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ._sync import SyncClient
from ._torch_copy import current_streams
from ._torch_env import TorchrunEnv
from ._torch_module import PSModule

__all__ = ["SyncPSModule"]


class SyncPSModule:
    """``PSModule`` for ordinary (blocking) loops on a ``SyncClient``. The hooks start pushes on
    the client's event-loop thread, so ``overlap=True`` overlaps a plain ``loss.backward()``.
    The caller's current CUDA streams are read here, in the caller's thread."""

    def __init__(self, module: nn.Module, client: SyncClient, **options: Any) -> None:
        self._sync = client
        self._owned_client = False
        self.inner = PSModule(module, client._client, **options)
        self.inner._loop = client._loop

    client = property(lambda self: self._sync)
    module = property(lambda self: self.inner.module)
    keys = property(lambda self: self.inner.keys)
    clock = property(lambda self: self.inner.clock)
    steps = property(lambda self: self.inner.steps)
    optimizer = property(lambda self: self.inner.optimizer)

    @classmethod
    def from_env(cls, module: nn.Module, endpoints: Any = None, *, token: str | None = None,
                 client_options: dict[str, Any] | None = None, environ: Mapping[str, str] | None = None,
                 **options: Any) -> "SyncPSModule":
        """``PSModule.from_env`` for a blocking loop (the client is a ``SyncClient`` it owns)."""
        env = TorchrunEnv.read(environ)
        env.place(module)
        client = SyncClient(endpoints, token, **(client_options or {})).open()
        try:
            pm = cls(module, client, **env.module_options(options))
        except BaseException:
            client.close()
            raise
        pm._owned_client = True
        return pm

    def pull(self) -> None:
        self._sync._run(self.inner._pull(current_streams(self.inner.devices())))

    def push(self, extra: dict[str, Any] | None = None) -> dict[str, int]:
        return self._sync._run(self.inner._push(extra, current_streams(self.inner.devices())))

    def close(self) -> None:
        try:
            self._sync._run(self.inner.close())
        finally:
            if self._owned_client:
                self._sync.close()
