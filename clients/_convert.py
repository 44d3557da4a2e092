"""The one place where torch meets the client: values in, numpy out.

CUDA tensors are copied to pinned host memory with a non-blocking copy and one stream sync (a
pageable copy would stage through a bounce buffer and block twice). torch is never imported here:
a tensor can only exist if the caller imported torch already.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kvps.errors import InvalidRequest

__all__ = ["to_numpy"]


def to_numpy(value: Any, *, name: str = "value") -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            torch.cuda.current_stream(t.device).synchronize()
            t = host
        if t.dtype == torch.bfloat16:
            raise InvalidRequest(f"{name}: bfloat16 tensors are not supported yet; convert to float32")
        return t.resolve_conj().resolve_neg().numpy()
    if isinstance(value, (int, float, bool, list, tuple, np.generic)):
        return np.asarray(value)
    raise InvalidRequest(f"{name}: expected a numpy array or a torch tensor, got {type(value).__name__}")
