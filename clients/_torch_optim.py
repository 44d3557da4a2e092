"""``PSOptimizer``: the torch-facing side of the optimizer that runs on the shard leaders.

It is a real ``torch.optim.Optimizer`` over the module's parameters, so the tools built for one
work unchanged: ``torch.optim.lr_scheduler`` schedulers write ``param_groups[i]["lr"]`` (and
``OneCycleLR`` ``momentum`` / ``betas``), which ``PSModule`` sends to the server, stamped with the
worker step, before the next gradients (``kvps.hyper``); ``torch.amp.GradScaler.step(optimizer)``
unscales the gradients in place, checks them for inf/NaN and calls ``step()`` only when they are
finite, which is how ``PSModule.push`` decides whether this step's gradients are pushed at all.
``step()`` itself updates nothing here (the server does): it marks the step as approved.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from kvps.errors import InvalidRequest
from kvps.hyper import SCHEDULABLE
from kvps.optimizer import Optimizer as Spec
from kvps.optimizer import optimizer_to_dict

__all__ = ["PSOptimizer", "clip_by_norm"]


def _defaults(spec: Spec) -> dict[str, Any]:
    """The spec's hyper-parameters as torch names them (``betas`` a tuple, as torch.optim.Adam)."""
    return {f.name: getattr(spec, f.name) for f in fields(spec)}  # type: ignore[arg-type]


class PSOptimizer(torch.optim.Optimizer):
    """Parameter groups over a ``PSModule``'s parameters, for schedulers and ``GradScaler``.

    ``spec`` is the kvps optimizer the keys were created with (``kc.SGD(lr=...)``, ...); each
    group starts with its fields. ``keys`` maps each parameter to its kvps key."""

    def __init__(self, params: list[torch.Tensor], spec: Spec, keys: dict[int, str]) -> None:
        self.spec = spec
        self.keys = keys
        self.approved = False
        super().__init__(params, _defaults(spec))
        self._sent = [self._schedulable(g) for g in self.param_groups]  # what the server has

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Approve this step's gradients for pushing (``GradScaler.step`` calls it only when they
        are finite). The update itself runs on the server, in ``PSModule.push``."""
        if closure is not None:
            raise InvalidRequest("PSOptimizer.step takes no closure: the optimizer runs on the server")
        self.approved = True

    def _schedulable(self, group: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name in SCHEDULABLE[self.spec.name]:
            value = group[name]
            out[name] = [float(v) for v in value] if name == "betas" else float(value)
        return out

    def changes(self) -> list[tuple[list[str], dict[str, Any]]]:
        """``(keys, changed values)`` for every group whose schedulable fields differ from what
        was last sent; ``mark_sent`` once they are applied."""
        out = []
        for group, sent in zip(self.param_groups, self._sent):
            now = self._schedulable(group)
            changed = {k: v for k, v in now.items() if v != sent.get(k)}
            if changed:
                out.append(([self.keys[id(p)] for p in group["params"]], changed))
        return out

    def mark_sent(self) -> None:
        self._sent = [self._schedulable(g) for g in self.param_groups]

    def describe(self) -> dict[str, Any]:
        return {"spec": optimizer_to_dict(self.spec), "groups": [self._schedulable(g) for g in self.param_groups]}


def clip_by_norm(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``grad`` scaled so that its 2-norm is at most ``max_norm``, as ``clip_grad_norm_`` does for
    one tensor (same formula, no host sync). Dense gradients are scaled in place; a sparse one is
    coalesced first (its norm is the norm of its coalesced values) and the coalesced copy
    returned."""
    if grad.is_sparse:
        grad = grad.coalesce()
        values = grad.values()
    else:
        values = grad
    norm = torch.linalg.vector_norm(values, 2.0)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    values.mul_(coef)
    return grad
