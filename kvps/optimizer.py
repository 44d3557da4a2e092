"""Optimizers the shard applies to pushed gradients, following ``torch.optim``'s formulas.

Each optimizer is a frozen dataclass (its hyper-parameters) with a pure ``step``:
``step(value, grad, state, step) -> (new_value, new_state)``. It never mutates its inputs and
returns new arrays, because dense blocks are immutable (readers hold references without a lock).

Determinism is the point (every replica must end bit-identical, DESIGN §3):

- scalar coefficients (learning-rate schedules, bias corrections) are computed in Python floats,
  or float64 arrays for per-row step counts — elementwise IEEE ops give the same bits either way;
- powers ``beta ** step`` use binary exponentiation with plain multiplications rather than
  ``pow``, whose last bit may differ between libm builds;
- square roots are correctly rounded everywhere (``math.sqrt`` / ``np.sqrt``);
- the array work is element-wise numpy ops in a fixed order, in the value's dtype, with the
  coefficient cast to that dtype first (as torch casts its scalar ``alpha``/``value`` arguments).

``step`` is the 1-based number of this update: an ``int`` for a dense block, or an int64 array of
shape ``(n,)`` for table rows (each row counts its own steps); the coefficients then broadcast over
the row dimension, and each row gets exactly the bits a dense block with that step count would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

import numpy as np

from kvps.errors import InvalidRequest

__all__ = ["Adagrad", "Adam", "Add", "Optimizer", "SGD", "optimizer_from_dict", "optimizer_to_dict"]

State = dict[str, np.ndarray]
Step = Union[int, np.ndarray]  # int, or (n,) int64 per-row step counts
Coef = Union[float, np.ndarray]  # Python float, or (n,) float64 per-row coefficients


# ---- validation -----------------------------------------------------------------------------------

def _number(obj: Any, name: str, *, low: float = 0.0, below: float | None = None) -> None:
    """Normalise field ``name`` to a finite float in [low, below) (or [low, inf))."""
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{type(obj).__name__}.{name} must be a number", field=name)
    value = float(value)
    if not math.isfinite(value) or value < low or (below is not None and value >= below):
        bound = f"[{low}, {below})" if below is not None else f">= {low}"
        raise InvalidRequest(f"{type(obj).__name__}.{name} must be finite and {bound}", field=name)
    object.__setattr__(obj, name, value)  # frozen: store the normalised float


def _flag(obj: Any, name: str) -> None:
    if not isinstance(getattr(obj, name), bool):
        raise InvalidRequest(f"{type(obj).__name__}.{name} must be a bool", field=name)


# ---- deterministic scalar helpers --------------------------------------------------------------

def _ipow(base: float, n: int) -> float:
    """base ** n (n >= 0) by binary exponentiation: only IEEE multiplications, identical everywhere."""
    result = 1.0
    while n > 0:
        if n & 1:
            result *= base
        base *= base
        n >>= 1
    return result


def _pow(base: float, step: Step) -> Coef:
    if isinstance(step, np.ndarray):
        uniq, inverse = np.unique(step, return_inverse=True)  # few distinct counts per push
        table = np.array([_ipow(base, int(s)) for s in uniq], dtype=np.float64)  # (u,)
        return table[inverse.reshape(-1)]  # (n,) float64
    return _ipow(base, int(step))


def _sqrt(x: Coef) -> Coef:
    return np.sqrt(x) if isinstance(x, np.ndarray) else math.sqrt(x)


def _coef(x: Coef, value: np.ndarray) -> Any:
    """Cast a coefficient to the value's dtype; per-row ones become (n, 1, ...) to broadcast."""
    if isinstance(x, np.ndarray):
        return x.astype(value.dtype).reshape(x.shape + (1,) * (value.ndim - 1))
    return value.dtype.type(x)


def _first(step: Step, value: np.ndarray) -> Any:
    """True where this is the first step: a bool, or an (n, 1, ...) mask for rows."""
    if isinstance(step, np.ndarray):
        return (step == 1).reshape(step.shape + (1,) * (value.ndim - 1))
    return step == 1


# ---- optimizers ---------------------------------------------------------------------------------

class Optimizer:
    """Base: ``name`` (ClassVar), ``state_names()``, ``init_state(value)``, ``step(...)``."""

    name: ClassVar[str]

    def state_names(self) -> tuple[str, ...]:
        return ()

    def init_state(self, value: np.ndarray) -> State:
        return {}

    def step(self, value: np.ndarray, grad: np.ndarray, state: State,
             step: Step) -> tuple[np.ndarray, State]:
        raise NotImplementedError


@dataclass(frozen=True)
class Add(Optimizer):
    """value += grad: the raw incremental update (no state)."""

    name: ClassVar[str] = "add"

    def step(self, value, grad, state, step):
        return value + grad, {}


@dataclass(frozen=True)
class SGD(Optimizer):
    """torch.optim.SGD: weight decay, momentum (buffer = grad on the first step), nesterov."""

    name: ClassVar[str] = "sgd"
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for f in ("lr", "momentum", "dampening", "weight_decay"):
            _number(self, f)
        _flag(self, "nesterov")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidRequest("SGD nesterov needs momentum > 0 and dampening 0", field="nesterov")

    def state_names(self):
        return ("momentum_buffer",) if self.momentum else ()

    def init_state(self, value):
        return {"momentum_buffer": np.zeros_like(value)} if self.momentum else {}

    def step(self, value, grad, state, step):
        g = grad
        if self.weight_decay:
            g = g + _coef(self.weight_decay, value) * value  # torch: grad.add(param, alpha=wd)
        new_state = {}
        if self.momentum:
            m = _coef(self.momentum, value)
            buf = state["momentum_buffer"] * m + _coef(1.0 - self.dampening, value) * g
            buf = np.where(_first(step, value), g, buf)  # torch: buf = clone(grad) on step 1
            new_state["momentum_buffer"] = buf
            g = g + m * buf if self.nesterov else buf
        # torch: param.add_(g, alpha=-lr). value + (coef * g), computed in one new array: the
        # same two roundings as the expression, one temporary fewer per block.
        out = np.multiply(g, _coef(-self.lr, value))
        if not isinstance(out, np.ndarray) or out.shape != np.shape(value):  # 0-d: a scalar
            return value + out, new_state
        return np.add(value, out, out=out), new_state


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """torch.optim.Adagrad: clr = lr / (1 + (step - 1) * lr_decay)."""

    name: ClassVar[str] = "adagrad"
    lr: float = 0.01
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10

    def __post_init__(self) -> None:
        for f in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            _number(self, f)

    def state_names(self):
        return ("sum",)

    def init_state(self, value):
        return {"sum": np.full_like(value, self.initial_accumulator_value)}

    def step(self, value, grad, state, step):
        g = grad
        if self.weight_decay:
            g = g + _coef(self.weight_decay, value) * value
        clr = self.lr / (1 + (step - 1) * self.lr_decay)  # float, or (n,) float64
        total = state["sum"] + g * g  # torch: sum.addcmul_(g, g, value=1)
        std = np.sqrt(total) + _coef(self.eps, value)
        # torch addcdiv: param + (value * t1) / t2
        return value + (_coef(-clr, value) * g) / std, {"sum": total}


@dataclass(frozen=True)
class Adam(Optimizer):
    """torch.optim.Adam; ``decoupled=True`` is torch.optim.AdamW (v *= 1 - lr * wd first)."""

    name: ClassVar[str] = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    def __post_init__(self) -> None:
        for f in ("lr", "eps", "weight_decay"):
            _number(self, f)
        _flag(self, "decoupled")
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise InvalidRequest("Adam.betas must be a pair of numbers", field="betas")
        pair = []
        for b in betas:
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
                raise InvalidRequest("Adam.betas must be in [0, 1)", field="betas")
            pair.append(float(b))
        object.__setattr__(self, "betas", tuple(pair))

    def state_names(self):
        return ("exp_avg", "exp_avg_sq")

    def init_state(self, value):
        return {"exp_avg": np.zeros_like(value), "exp_avg_sq": np.zeros_like(value)}

    def step(self, value, grad, state, step):
        beta1, beta2 = self.betas
        g = grad
        if self.weight_decay:
            if self.decoupled:
                value = value * _coef(1.0 - self.lr * self.weight_decay, value)
            else:
                g = g + _coef(self.weight_decay, value) * value
        exp_avg = _lerp(state["exp_avg"], g, 1.0 - beta1)
        exp_avg_sq = state["exp_avg_sq"] * _coef(beta2, value) + (_coef(1.0 - beta2, value) * g) * g
        bias1 = 1.0 - _pow(beta1, step)
        bias2_sqrt = _sqrt(1.0 - _pow(beta2, step))
        step_size = self.lr / bias1
        denom = np.sqrt(exp_avg_sq) / _coef(bias2_sqrt, value) + _coef(self.eps, value)
        new_value = value + (_coef(-step_size, value) * exp_avg) / denom
        return new_value, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _lerp(start: np.ndarray, end: np.ndarray, weight: float) -> np.ndarray:
    """torch.lerp's formula (two branches keep it exact at both ends)."""
    w = _coef(weight, start)
    if abs(weight) < 0.5:
        return start + w * (end - start)
    return end - (end - start) * _coef(1.0 - weight, start)


_BY_NAME: dict[str, type[Optimizer]] = {cls.name: cls for cls in (Add, SGD, Adagrad, Adam)}


def optimizer_to_dict(opt: Optimizer) -> dict[str, Any]:
    """``{"name": ..., **params}``, JSON-safe (betas as a list)."""
    out: dict[str, Any] = {"name": opt.name}
    for f in fields(opt):  # type: ignore[arg-type]
        value = getattr(opt, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def optimizer_from_dict(data: Any) -> Optimizer:
    """The optimizer ``data`` describes; ``InvalidRequest`` on anything else."""
    if not isinstance(data, dict):
        raise InvalidRequest("optimizer must be an object with a 'name'", field="optimizer")
    name = data.get("name")
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidRequest(f"unknown optimizer {data.get('name')!r}", field="optimizer")
    params = {k: v for k, v in data.items() if k != "name"}
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(params) - known)
    if unknown:
        raise InvalidRequest(f"unknown {cls.name} parameter(s): {', '.join(unknown)}", field="optimizer")
    try:
        return cls(**params)
    except TypeError as exc:  # a missing required parameter (SGD's lr)
        raise InvalidRequest(f"bad {cls.name} parameters: {exc}", field="optimizer") from exc
