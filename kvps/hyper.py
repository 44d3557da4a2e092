"""Hyper-parameter schedules: which optimizer fields may change during training, and how.

A learning-rate schedule (``torch.optim.lr_scheduler``) changes ``lr`` — and ``OneCycleLR`` also
``momentum`` or Adam's ``betas`` — while the optimizer runs on the shard leaders. A key keeps the
optimizer it was created with (its *definition*: creating it again with the same definition stays
a no-op) plus *overrides* of the schedulable fields, stamped with the worker step that set them.
An update stamped with an older step than the key's is ignored: with asynchronous workers the
schedule follows the most advanced one and never moves back when a slow worker catches up.

Only fields that leave the optimizer's state arrays unchanged are schedulable: SGD's momentum may
change but not between zero and non-zero (that adds or drops the momentum buffer, and a table's
step counts: ``Optimizer.uses_step``), and Adagrad's ``initial_accumulator_value`` is not
schedulable (rows created later would start differently).
Pure: no I/O, no clock.
"""
from __future__ import annotations

import math
from typing import Any

from kvps.errors import InvalidRequest
from kvps.optimizer import Optimizer, optimizer_from_dict

__all__ = ["HyperTable", "SCHEDULABLE", "check_values", "retuned"]

# optimizer name -> the fields a schedule may change
SCHEDULABLE: dict[str, tuple[str, ...]] = {
    "add": (),
    "adagrad": ("lr", "lr_decay", "weight_decay", "eps"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "ftrl": ("alpha", "beta", "l1", "l2"),
    "rowwise_adagrad": ("lr", "eps"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay"),
}
_NAMES = frozenset(n for names in SCHEDULABLE.values() for n in names)
MAX_VALUES = 16  # more fields than any optimizer has: a bound on what a command may carry


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"hyper-parameter {name!r} must be a finite number", field=name)
    return float(value)


def check_values(values: Any) -> dict[str, Any]:
    """``values`` normalised (floats; ``betas`` a list of two floats), or ``InvalidRequest``.
    Structure only: whether the key's optimizer has these fields is ``retuned``'s business."""
    if not isinstance(values, dict) or not 0 < len(values) <= MAX_VALUES:
        raise InvalidRequest("hyper-parameters must be a non-empty object", field="values")
    out: dict[str, Any] = {}
    for name in sorted(values):
        if name not in _NAMES:
            raise InvalidRequest(f"{name!r} is not a schedulable hyper-parameter; schedulable: "
                                 f"{', '.join(sorted(_NAMES))}", field=name)
        value = values[name]
        if name == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise InvalidRequest("betas must be a pair of numbers", field=name)
            out[name] = [_number(b, name) for b in value]
        else:
            out[name] = _number(value, name)
    return out


def retuned(definition: dict[str, Any], overrides: dict[str, Any],
            values: dict[str, Any]) -> tuple[dict[str, Any], Optimizer]:
    """The overrides after applying ``values`` on top of ``overrides``, and the optimizer they
    make from ``definition`` (the key's creation-time optimizer dict). ``InvalidRequest`` when a
    field is not schedulable for this optimizer, a value is out of range, or the change would
    alter the optimizer's state arrays."""
    name = definition.get("name")
    allowed = SCHEDULABLE.get(name, ()) if isinstance(name, str) else ()
    foreign = sorted(set(values) - set(allowed))
    if foreign:
        can = ", ".join(allowed) or "nothing"
        raise InvalidRequest(f"optimizer {name!r} cannot schedule {', '.join(foreign)} (it can "
                             f"schedule: {can})", field=foreign[0])
    merged = {**overrides, **check_values(values)}
    optimizer = optimizer_from_dict({**definition, **merged})  # range checks, one message per field
    defined = optimizer_from_dict(definition)
    if optimizer.state_names() != defined.state_names() or optimizer.uses_step() != defined.uses_step():
        raise InvalidRequest(f"{sorted(values)} would change the {name} state arrays (SGD momentum "
                             "cannot move between zero and non-zero during training)",
                             field=sorted(values)[0])
    return merged, optimizer


class HyperTable:
    """The schedule overrides of one shard's keys: ``{key: {"step", "values"}}``. Applying an
    override sets the entry's live ``optimizer`` (entries are ``DenseKey`` or ``Table``: anything
    with ``optimizer_dict`` and ``optimizer``); their ``optimizer_dict`` stays the definition."""

    def __init__(self) -> None:
        self.keys: dict[str, dict[str, Any]] = {}

    def check(self, key: str, entry: Any, values: dict[str, Any]) -> None:
        have = self.keys.get(key)
        retuned(entry.optimizer_dict, have["values"] if have else {}, values)

    def update(self, key: str, entry: Any, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Apply ``values`` as of ``step`` (raises before changing anything). The result says
        whether it applied, and the key's step and overrides after it."""
        have = self.keys.get(key)
        if have is not None and step < have["step"]:
            return {"applied": False, "step": have["step"], "values": dict(have["values"])}
        merged, entry.optimizer = retuned(entry.optimizer_dict, have["values"] if have else {}, values)
        self.keys[key] = {"step": step, "values": merged}
        return {"applied": True, "step": step, "values": dict(merged)}

    def info(self, key: str) -> dict[str, Any] | None:
        have = self.keys.get(key)
        return None if have is None else {"step": have["step"], "values": dict(have["values"])}

    def drop(self, key: str) -> None:
        self.keys.pop(key, None)

    def to_json(self) -> dict[str, Any]:
        return {k: self.keys[k] for k in sorted(self.keys)}

    def load_json(self, data: dict[str, Any], entries: dict[str, Any]) -> None:
        """Overrides from ``to_json``, applied to ``entries`` (KeyError/InvalidRequest if bad)."""
        for key, have in data.items():
            self.update(key, entries[key], int(have["step"]), have["values"])
