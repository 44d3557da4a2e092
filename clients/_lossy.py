"""Opt-in lossy push codecs with client-side error feedback: fp16, bf16, top-k.

What a codec drops is kept in a residual per (key, block) and added to the next gradient of that
block, so nothing is lost for good: the sum of what was sent tracks the sum of the true
gradients within one step's quantisation error (tests check it). Bounds per step, for the value
that was sent relative to gradient + residual:
  fp16   relative error <= 2**-11 for normal numbers (|x| >= 6.1e-5); a block with a value
         beyond fp16's range (65504) is sent in its own dtype instead, exactly
  bf16   relative error <= 2**-8 (round to nearest even); a block that would round to inf is
         sent in its own dtype
  topk:f only the ceil(f * size) largest-magnitude entries are sent, exactly; the rest waits in
         the residual.
A residual is never non-finite: a gradient holding NaN or Inf is sent as it is (the server
refuses or skips it) and leaves no residual. The residual of a push is stored only once the push
is acknowledged (``commit``); encoding takes the block's residual out, and a push that fails
puts it back (``abandon``), so two pushes of one block in flight never both add it.
The codecs themselves, with their decoders, are ``kvps.delta.lossy``.
"""
from __future__ import annotations

import math

import numpy as np

from kvps.delta.frame import Bf16
from kvps.delta.lossy import bf16_round, bf16_widen, topk_select
from kvps.errors import InvalidRequest

__all__ = ["LossyEncoder", "Pending", "bf16_round", "bf16_widen"]

# (key, block, residual taken out by encode or None, residual to store on success or None)
Pending = tuple[str, int, "np.ndarray | None", "np.ndarray | None"]


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

    def encode(self, key: str, block: int, grad: np.ndarray, *,
               rows: bool = False) -> tuple[dict, list, Pending]:
        """Meta fields and arrays for one gradient part, and what ``commit`` / ``abandon`` do
        with the residual once the push is acknowledged / has failed."""
        if grad.dtype.kind != "f":
            raise InvalidRequest(f"{key!r}: lossy codecs need a floating-point gradient")
        if rows and self.kind == "topk":
            raise InvalidRequest("top-k is for dense keys; use fp16 or bf16 for table rows")
        old = None if rows else self.residual.pop((key, block), None)  # rows change ids every push
        g = grad + old if old is not None else grad
        if not bool(np.isfinite(g).all()):  # the user's NaN/Inf: refused upstream, no residual
            return {}, [g], (key, block, old, None)
        sent, fields, arrays = self._quantise(g)
        if not bool(np.isfinite(sent).all()):  # out of the codec's range: send this block exactly
            sent, fields, arrays = g, {}, [g]
        new = None if rows else g - sent
        return fields, arrays, (key, block, old, new)

    def _quantise(self, g: np.ndarray) -> tuple[np.ndarray, dict, list]:
        """(what the server will add, meta fields, arrays to send)."""
        if self.kind == "fp16":
            with np.errstate(over="ignore"):  # out-of-range values: caught by encode
                q = g.astype(np.float16)
            return q.astype(g.dtype), {"encoding": "fp16"}, [q]
        if self.kind == "bf16":
            q = bf16_round(g)
            return bf16_widen(q).astype(g.dtype), {"encoding": "bf16"}, [Bf16(q)]
        flat = g.reshape(-1)
        k = max(1, math.ceil(self.fraction * flat.size)) if flat.size else 0
        idx, values = topk_select(flat, k)
        sent = np.zeros_like(flat)
        sent[idx] = values
        return sent.reshape(g.shape), {"encoding": "topk"}, [values, idx]

    def commit(self, pending: list[Pending]) -> None:
        """The push was acknowledged: store what its codec dropped."""
        self._add([(k, b, new) for k, b, _, new in pending])

    def abandon(self, pending: list[Pending]) -> None:
        """The push failed: put back the residuals it took out."""
        self._add([(k, b, old) for k, b, old, _ in pending])

    def _add(self, parts: list) -> None:
        for key, block, arr in parts:
            if arr is not None:
                have = self.residual.get((key, block))
                self.residual[(key, block)] = arr if have is None else have + arr

    def forget(self, key: str) -> None:
        for kb in [kb for kb in self.residual if kb[0] == key]:
            del self.residual[kb]
