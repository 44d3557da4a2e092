"""Opt-in lossy push codecs with client-side error feedback: fp16, bf16, top-k.

What a codec drops is kept in a residual per (key, block) and added to the next gradient of that
block, so nothing is lost for good: the sum of what was sent tracks the sum of the true
gradients within one step's quantisation error (tests check it). Bounds per step, for the value
that was sent relative to gradient + residual:
  fp16   relative error <= 2**-11 for normal numbers (|x| >= 6.1e-5 and <= 65504; larger overflows)
  bf16   relative error <= 2**-8 (round to nearest even)
  topk:f only the ceil(f * size) largest-magnitude entries are sent, exactly; the rest waits in
         the residual.
The residual assumes every push is eventually delivered (the client retries until its deadline).
The codecs themselves, with their decoders, are ``kvps.delta.lossy``.
"""
from __future__ import annotations

import math

import numpy as np

from kvps.delta.frame import Bf16
from kvps.delta.lossy import bf16_round, bf16_widen, topk_select
from kvps.errors import InvalidRequest

__all__ = ["LossyEncoder", "bf16_round", "bf16_widen"]


class LossyEncoder:
    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fraction = 0.0
        if spec.startswith("topk:"):
            try:
                self.fraction = float(spec[5:])
            except ValueError:
                self.fraction = -1.0
            if not 0 < self.fraction <= 1:
                raise InvalidRequest(f"top-k fraction must be in (0, 1]: {spec!r}")
            self.kind = "topk"
        elif spec in ("fp16", "bf16"):
            self.kind = spec
        else:
            raise InvalidRequest(f"push codec must be 'raw', 'fp16', 'bf16' or 'topk:F', not {spec!r}")
        self.residual: dict[tuple[str, int], np.ndarray] = {}

    def encode(self, key: str, block: int, grad: np.ndarray, *, rows: bool = False) -> tuple[dict, list]:
        """Meta fields and arrays for one gradient part; updates the residual."""
        if grad.dtype.kind != "f":
            raise InvalidRequest(f"{key!r}: lossy codecs need a floating-point gradient")
        if rows and self.kind == "topk":
            raise InvalidRequest("top-k is for dense keys; use fp16 or bf16 for table rows")
        g = grad + self.residual[(key, block)] if (key, block) in self.residual else grad.copy()
        if self.kind == "fp16":
            q = g.astype(np.float16)
            sent, fields, arrays = q.astype(g.dtype), {"encoding": "fp16"}, [q]
        elif self.kind == "bf16":
            q = bf16_round(g)
            sent, fields, arrays = bf16_widen(q).astype(g.dtype), {"encoding": "bf16"}, [Bf16(q)]
        else:
            flat = g.reshape(-1)
            k = max(1, math.ceil(self.fraction * flat.size)) if flat.size else 0
            idx, values = topk_select(flat, k)
            sent = np.zeros_like(flat)
            sent[idx] = values
            sent = sent.reshape(g.shape)
            fields, arrays = {"encoding": "topk"}, [values, idx]
        if not rows:  # table rows change ids every push: no per-row residual is kept
            self.residual[(key, block)] = g - sent
        return fields, arrays

    def forget(self, key: str) -> None:
        for kb in [kb for kb in self.residual if kb[0] == key]:
            del self.residual[kb]
