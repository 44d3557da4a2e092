"""Optimizers the shard applies to pushed gradients, following ``torch.optim``'s formulas.

Each optimizer is a frozen dataclass (its hyper-parameters) with a pure ``step``:
``step(value, grad, state, step) -> (new_value, new_state)``. It never mutates its inputs and
returns new arrays, because dense blocks are immutable (readers hold references without a lock).
Past the house's ~450 lines on purpose: the six optimizers share the deterministic helpers at
the top (powers, square roots, clipping), and split apart they would each import all of them.

Determinism is the point (every replica must end bit-identical, DESIGN §3):

- scalar coefficients (learning-rate schedules, bias corrections) are computed in Python floats,
  or float64 arrays for per-row step counts — elementwise IEEE ops give the same bits either way;
- powers ``beta ** step`` use binary exponentiation with plain multiplications rather than
  ``pow``, whose last bit may differ between libm builds;
- square roots are correctly rounded everywhere (``math.sqrt`` / ``np.sqrt``);
- the array work is element-wise numpy ops in a fixed order, in the value's dtype, with the
  coefficient cast to that dtype first (as torch casts its scalar ``alpha``/``value`` arguments).

Every optimizer takes ``clip_norm`` (0: off): the gradient is scaled to at most that L2 norm
before the update, as ``torch.nn.utils.clip_grad_norm_`` does (coefficient
``clip_norm / (norm + 1e-6)`` when the norm exceeds it). The norm is per *row* for table rows and
per *block* for dense keys: a key's blocks may live on different shards and each block steps in
its own apply, so a per-key norm would need a cross-shard reduction the state machine cannot do.
Sums of squares are taken in float64 (a float32 square is exact there) column by column, in a
fixed order, and a block's row sums are added with ``math.fsum`` (correctly rounded): the same
bits on every replica, whatever SIMD the CPU has.

``step`` is the 1-based number of this update: an ``int`` for a dense block, or an int64 array of
shape ``(n,)`` for table rows (each row counts its own steps); the coefficients then broadcast over
the row dimension, and each row gets exactly the bits a dense block with that step count would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Union

import numpy as np

from kvps.errors import InvalidRequest

__all__ = ["Adagrad", "Adam", "Add", "FTRL", "Optimizer", "RowWiseAdagrad", "SGD", "clipped",
           "fitted_state", "normalized_optimizer", "optimizer_from_dict", "optimizer_to_dict"]

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

def _rows2d(x: np.ndarray) -> np.ndarray:
    """``x`` as (rows, cols): the first axis is the row (a 1-d block: one element per row). The
    columns are named, not ``-1``: a push whose rows were all left out by admission has none."""
    return x.reshape(len(x), math.prod(x.shape[1:])) if x.ndim else x.reshape(1, 1)


def _row_sumsq(x: np.ndarray) -> np.ndarray:
    """(rows,) float64 sums of squares, column by column in a fixed order."""
    x2 = _rows2d(x)
    total = np.zeros(len(x2), dtype=np.float64)
    for j in range(x2.shape[1]):
        col = x2[:, j].astype(np.float64)
        total = total + col * col
    return total


def _clip(grad: np.ndarray, clip_norm: float, per_row: bool) -> np.ndarray:
    """``grad`` scaled to L2 norm <= clip_norm, per row (tables) or over the whole block."""
    sumsq = _row_sumsq(grad)
    if per_row:
        norm = np.sqrt(sumsq)  # (n,) float64
        coef = np.where(norm > clip_norm, clip_norm / (norm + 1e-6), 1.0)
        if not (coef < 1.0).any():
            return grad
        return grad * _coef(coef, grad)
    norm = math.sqrt(math.fsum(sumsq.tolist()))
    if norm <= clip_norm:
        return grad
    return grad * grad.dtype.type(clip_norm / (norm + 1e-6))


class Optimizer:
    """Base: ``name`` (ClassVar), ``state_names()``, ``state_shape(shape)``, ``init_state(value)``,
    ``step(...)``. Subclasses write ``_update`` (and have a ``clip_norm`` field); ``step`` clips,
    then updates."""

    name: ClassVar[str]
    fills_out: ClassVar[bool] = False  # writes the new value into ``step``'s ``out``
    clip_norm: float

    def state_names(self) -> tuple[str, ...]:
        return ()

    def state_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each state array for a value of ``shape``: the value's own, unless the
        optimizer keeps one number per row (the first axis), when the other axes are 1."""
        return shape

    def uses_step(self) -> bool:
        """Does ``step`` change what ``step()`` computes, for this optimizer and every schedule of
        it (``kvps.hyper``)? A table keeps a step count per row only when it does."""
        return True

    def init_state(self, value: np.ndarray) -> State:
        return {}

    def step(self, value: np.ndarray, grad: np.ndarray, state: State,
             step: Step, out: np.ndarray | None = None) -> tuple[np.ndarray, State]:
        """``out``: a writable array of ``value``'s shape and dtype, aliasing none of the inputs,
        that the optimizer may write the new value into (Add, SGD, Adagrad do) instead of a new
        array; the same bits either way."""
        if self.clip_norm:
            grad = _clip(grad, self.clip_norm, per_row=isinstance(step, np.ndarray))
        if out is not None and (out.shape != np.shape(value) or out.dtype != value.dtype):
            out = None
        return self._update(value, grad, state, step, out)

    def _update(self, value: np.ndarray, grad: np.ndarray, state: State,
                step: Step, out: np.ndarray | None) -> tuple[np.ndarray, State]:
        raise NotImplementedError

    def _check_clip(self) -> None:
        _number(self, "clip_norm")


@dataclass(frozen=True)
class Add(Optimizer):
    """value += grad: the raw incremental update (no state)."""

    name: ClassVar[str] = "add"
    fills_out: ClassVar[bool] = True
    clip_norm: float = 0.0  # max L2 norm of a row's / block's gradient; 0: no clipping

    def __post_init__(self) -> None:
        self._check_clip()

    def uses_step(self):
        return False

    def _update(self, value, grad, state, step, out):
        return np.add(value, grad, out=out), {}


@dataclass(frozen=True)
class SGD(Optimizer):
    """torch.optim.SGD: weight decay, momentum (buffer = grad on the first step), nesterov."""

    name: ClassVar[str] = "sgd"
    fills_out: ClassVar[bool] = True
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for f in ("lr", "momentum", "dampening", "weight_decay", "clip_norm"):
            _number(self, f)
        _flag(self, "nesterov")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidRequest("SGD nesterov needs momentum > 0 and dampening 0", field="nesterov")

    def state_names(self):
        return ("momentum_buffer",) if self.momentum else ()

    def init_state(self, value):
        return {"momentum_buffer": np.zeros_like(value)} if self.momentum else {}

    def uses_step(self):
        return bool(self.momentum)  # the buffer starts as the first gradient; no schedule toggles it

    def _update(self, value, grad, state, step, out):
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
        delta = np.multiply(g, _coef(-self.lr, value), out=out)
        if not isinstance(delta, np.ndarray) or delta.shape != np.shape(value):  # 0-d: a scalar
            return value + delta, new_state
        return np.add(value, delta, out=delta), new_state


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """torch.optim.Adagrad: clr = lr / (1 + (step - 1) * lr_decay)."""

    name: ClassVar[str] = "adagrad"
    fills_out: ClassVar[bool] = True
    lr: float = 0.01
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for f in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "clip_norm"):
            _number(self, f)

    def state_names(self):
        return ("sum",)

    def init_state(self, value):
        return {"sum": np.full_like(value, self.initial_accumulator_value)}

    def uses_step(self):
        return True  # lr_decay reads it, and a schedule may set lr_decay on a key created without

    def _update(self, value, grad, state, step, out):
        g = grad
        if self.weight_decay:
            g = g + _coef(self.weight_decay, value) * value
        clr = self.lr / (1 + (step - 1) * self.lr_decay)  # float, or (n,) float64
        total = state["sum"] + g * g  # torch: sum.addcmul_(g, g, value=1)
        std = np.sqrt(total) + _coef(self.eps, value)
        # torch addcdiv: param + (value * t1) / t2
        if out is None or np.ndim(clr):  # (per-row coefficients broadcast: rows of a table)
            return value + (_coef(-clr, value) * g) / std, {"sum": total}
        step_ = np.divide(np.multiply(_coef(-clr, value), g, out=out), std, out=out)
        return np.add(value, step_, out=out), {"sum": total}


@dataclass(frozen=True)
class Adam(Optimizer):
    """torch.optim.Adam; ``decoupled=True`` is torch.optim.AdamW (v *= 1 - lr * wd first)."""

    name: ClassVar[str] = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False
    clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for f in ("lr", "eps", "weight_decay", "clip_norm"):
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

    def _update(self, value, grad, state, step, out):
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


@dataclass(frozen=True)
class RowWiseAdagrad(Optimizer):
    """Row-wise Adagrad, as FBGEMM's / TorchRec's ``EXACT_ROWWISE_ADAGRAD``: one accumulator per
    row, grown by the mean over the row of the squared gradient; the row moves by
    ``-lr * g / (sqrt(acc) + eps)``. The accumulator is stored once per row, shaped
    ``(rows, 1, ...)`` (``state_shape``), which is the optimizer's whole point next to Adagrad: a
    table of dim 64 keeps 4 bytes of state per row, not 256. ``step`` also takes the per-element
    arrays older snapshots held (every column the same): it reads their first column."""

    name: ClassVar[str] = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    initial_accumulator: float = 0.0
    clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for f in ("lr", "eps", "initial_accumulator", "clip_norm"):
            _number(self, f)

    def state_names(self):
        return ("sum",)

    def state_shape(self, shape):
        return shape[:1] + (1,) * (len(shape) - 1)

    def init_state(self, value):
        return {"sum": np.full(self.state_shape(value.shape), self.initial_accumulator, dtype=value.dtype)}

    def uses_step(self):
        return False

    def _update(self, value, grad, state, step, out):
        g2 = _rows2d(grad)  # (rows, cols)
        sq = g2[:, 0] * g2[:, 0]  # (rows,) in the value's dtype, columns added in order
        for j in range(1, g2.shape[1]):
            sq = sq + g2[:, j] * g2[:, j]
        mean = sq / value.dtype.type(g2.shape[1])  # (rows,)
        acc = _rows2d(state["sum"])[:, 0] + mean  # (rows,) one accumulator per row
        mult = _coef(-self.lr, value) / (np.sqrt(acc) + _coef(self.eps, value))  # (rows,)
        new_value = value + mult.reshape(mult.shape + (1,) * (value.ndim - 1)) * grad
        return new_value, {"sum": acc.astype(value.dtype, copy=False).reshape(self.state_shape(value.shape))}


@dataclass(frozen=True)
class FTRL(Optimizer):
    """FTRL-Proximal, per coordinate (McMahan et al. 2013, Algorithm 1): state ``z`` and ``n``;
    ``sigma = (sqrt(n + g^2) - sqrt(n)) / alpha``, ``z += g - sigma * w``, ``n += g^2``, then
    ``w = 0`` where ``|z| <= l1``, else ``-(z - sign(z) l1) / ((beta + sqrt(n)) / alpha + l2)``.
    The stored value is that closed form: an initial value only enters through the first
    ``sigma * w`` term (as in TensorFlow's FTRL)."""

    name: ClassVar[str] = "ftrl"
    alpha: float = 0.05
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for f in ("alpha", "beta", "l1", "l2", "clip_norm"):
            _number(self, f)
        if self.alpha <= 0:
            raise InvalidRequest("FTRL.alpha must be > 0", field="alpha")

    def state_names(self):
        return ("z", "n")

    def init_state(self, value):
        return {"z": np.zeros_like(value), "n": np.zeros_like(value)}

    def uses_step(self):
        return False

    def _update(self, value, grad, state, step, out):
        alpha = _coef(self.alpha, value)
        n_old = state["n"]
        n_new = n_old + grad * grad
        sigma = (np.sqrt(n_new) - np.sqrt(n_old)) / alpha
        z = state["z"] + grad - sigma * value
        l1 = _coef(self.l1, value)
        denom = (_coef(self.beta, value) + np.sqrt(n_new)) / alpha + _coef(self.l2, value)
        shrunk = -(z - np.sign(z) * l1) / denom
        new_value = np.where(np.abs(z) <= l1, value.dtype.type(0), shrunk).astype(value.dtype, copy=False)
        return new_value, {"z": z, "n": n_new}


_BY_NAME: dict[str, type[Optimizer]] = {
    cls.name: cls for cls in (Add, SGD, Adagrad, Adam, RowWiseAdagrad, FTRL)}


def fitted_state(opt: Optimizer, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A state array of ``opt`` for a value of ``shape``, read from a snapshot, in the shape
    ``opt`` keeps (``state_shape``). Row-wise accumulators written per element, broadcast over
    the row (snapshots from before they were kept per row), become their first column once every
    column is checked to hold the same bits; any other shape is a ``ValueError``."""
    want = opt.state_shape(shape)
    if arr.shape == want:
        return arr
    if arr.shape != shape or want != shape[:1] + (1,) * (len(shape) - 1):
        raise ValueError(f"{opt.name} state of shape {arr.shape}, want {want}")
    first = arr[(slice(None),) + (slice(0, 1),) * (len(shape) - 1)]  # (rows, 1, ...)
    bits = np.dtype(f"u{arr.dtype.itemsize}")  # compared as bits: a NaN equals itself
    if not (arr.view(bits) == first.view(bits)).all():
        raise ValueError(f"{opt.name} state differs along a row")
    return np.ascontiguousarray(first)


def clipped(opt: Optimizer, clip_norm: float | None) -> Optimizer:
    """``opt`` with ``clip_norm`` set (None: ``opt`` unchanged)."""
    return opt if clip_norm is None else replace(opt, clip_norm=clip_norm)  # type: ignore[type-var]


def optimizer_to_dict(opt: Optimizer) -> dict[str, Any]:
    """``{"name": ..., **params}``, JSON-safe (betas as a list; ``clip_norm`` only when set)."""
    out: dict[str, Any] = {"name": opt.name}
    for f in fields(opt):  # type: ignore[arg-type]
        value = getattr(opt, f.name)
        if f.name == "clip_norm" and not value:
            continue  # off: left out, so specs and snapshots written before it read the same
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# Optimizers are frozen, so one instance serves every key created with the same definition: a
# create of 10,000 keys validated the same dict 30,000 times (a third of its apply). The key is
# the dict's repr, which tells 1, 1.0 and True apart, so a cached optimizer always turns back
# into the very dict it came from (snapshots, and so state hashes, depend on it).
_FROM_DICT: dict[str, Optimizer] = {}
_FROM_DICT_MAX = 256


def optimizer_from_dict(data: Any) -> Optimizer:
    """The optimizer ``data`` describes; ``InvalidRequest`` on anything else."""
    key = _definition_key(data)
    opt = _FROM_DICT.get(key) if key is not None else None
    if opt is None:
        opt = _optimizer_from_dict(data)
        if key is not None:
            if len(_FROM_DICT) >= _FROM_DICT_MAX:
                _FROM_DICT.clear()
            _FROM_DICT[key] = opt
    return opt


_NORMALIZED: dict[str, dict[str, Any]] = {}


def normalized_optimizer(data: Any) -> dict[str, Any]:
    """``optimizer_to_dict(optimizer_from_dict(data))`` (a new dict each call)."""
    key = _definition_key(data)
    out = _NORMALIZED.get(key) if key is not None else None
    if out is None:
        out = optimizer_to_dict(optimizer_from_dict(data))
        if key is not None:
            if len(_NORMALIZED) >= _FROM_DICT_MAX:
                _NORMALIZED.clear()
            _NORMALIZED[key] = out
    return {k: list(v) if isinstance(v, list) else v for k, v in out.items()}


def _definition_key(data: Any) -> str | None:
    if type(data) is not dict:
        return None
    try:
        return repr(sorted(data.items()))
    except TypeError:  # keys that do not sort: not cached
        return None


def _optimizer_from_dict(data: Any) -> Optimizer:
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
