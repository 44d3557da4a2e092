"""Initial values of embedding-table rows: a pure function of (seed, row id, column).

Rows are created lazily, so an untouched row must read the same on every replica, before and
after a restart, and across library versions (DESIGN §3). We therefore never use numpy's Generator
streams (whose algorithms may change) or numpy's transcendental ufuncs (``np.log`` / ``np.cos``
dispatch to SIMD kernels whose last bits differ between CPUs and numpy releases). Instead:

- a counter-based hash: splitmix64 over uint64 (wrapping integer arithmetic, exact everywhere);
- uniform numbers from the top 53 bits of a hash;
- normal numbers by Box–Muller, with ``log`` and ``cos`` evaluated by fixed polynomials built
  only from +, -, *, / and ``frexp``/``ldexp`` — IEEE operations that round identically on every
  platform. They are accurate to a few ulp of float64, far below float32 resolution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from kvps.errors import InvalidRequest

__all__ = [
    "Constant", "Initializer", "Normal", "Uniform", "Zeros", "initializer_from_dict",
    "initializer_to_dict", "splitmix64", "stable_cos_2pi", "stable_log",
]

_U64 = np.uint64
_GAMMA = _U64(0x9E3779B97F4A7C15)
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_FLOAT_DTYPES = ("float16", "float32", "float64")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 output function of ``x + gamma`` (uint64 array in, uint64 array out)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GAMMA
        z = (z ^ (z >> _U64(30))) * _M1
        z = (z ^ (z >> _U64(27))) * _M2
        return z ^ (z >> _U64(31))


def _hash(seed: int, ids: np.ndarray, dim: int, stream: int) -> np.ndarray:
    """(n, dim) uint64: an independent hash for every (seed, stream, id, column)."""
    base = splitmix64(np.array([seed], dtype=np.uint64) ^ _U64(stream))  # (1,)
    per_row = splitmix64(base + ids.astype(np.int64).view(np.uint64))  # (n,)
    cols = np.arange(dim, dtype=np.uint64)  # (dim,)
    with np.errstate(over="ignore"):
        return splitmix64(per_row[:, None] ^ (cols * _GAMMA)[None, :])  # (n, dim)


def _unit(h: np.ndarray) -> np.ndarray:
    """[0, 1) float64 from the top 53 bits."""
    return (h >> _U64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


# ---- platform-stable log and cos ---------------------------------------------------------------

_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that e * _LN2_HI is exact for |e| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_ATANH_TERMS = tuple(1.0 / (2 * k + 1) for k in range(12))  # 1, 1/3, 1/5, ...
_COS_TERMS = tuple((-1) ** k / math.factorial(2 * k) for k in range(10))  # x^0 .. x^18
_SIN_TERMS = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(10))  # x^1 .. x^19


def _poly(x2: np.ndarray, coefs: tuple[float, ...]) -> np.ndarray:
    acc = np.full_like(x2, coefs[-1])
    for c in reversed(coefs[:-1]):  # Horner, a fixed order
        acc = acc * x2 + c
    return acc


def stable_log(x: np.ndarray) -> np.ndarray:
    """Natural log of positive finite float64: log m + e ln 2 with m in [sqrt(1/2), sqrt(2))."""
    m, e = np.frexp(x)  # x = m * 2**e, m in [0.5, 1): exact
    small = m < 0.7071067811865476
    m = np.where(small, m * 2.0, m)  # exact
    e = (e - small).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)  # |s| < 0.172: log m = 2 atanh(s)
    log_m = 2.0 * s * _poly(s * s, _ATANH_TERMS)
    return e * _LN2_HI + (log_m + e * _LN2_LO)


def stable_cos_2pi(u: np.ndarray) -> np.ndarray:
    """cos(2 pi u) for float64 u in [0, 1): quadrant reduction (exact) + Taylor on [-pi/4, pi/4]."""
    r = u * 4.0  # exact
    q = np.floor(r + 0.5)
    x = (r - q) * (math.pi / 2)  # (r - q) is exact; |x| <= pi/4
    x2 = x * x
    cos_x = _poly(x2, _COS_TERMS)
    sin_x = x * _poly(x2, _SIN_TERMS)
    quadrant = q.astype(np.int64) % 4
    return np.choose(quadrant, [cos_x, -sin_x, -cos_x, sin_x])


# ---- initializers -----------------------------------------------------------------------------

def _check_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.name not in _FLOAT_DTYPES:
        raise InvalidRequest(f"table dtype must be one of {_FLOAT_DTYPES}, got {dt}", field="dtype")
    return dt


def _finite(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequest(f"{type(obj).__name__}.{name} must be a finite number", field=name)
        object.__setattr__(obj, name, float(value))


def _seed(obj: Any) -> None:
    seed = obj.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise InvalidRequest(f"{type(obj).__name__}.seed must be an int in [0, 2**64)", field="seed")


class Initializer:
    name: ClassVar[str]

    def rows(self, ids: np.ndarray, dim: int, dtype: Any) -> np.ndarray:
        """(len(ids), dim) values of rows ``ids`` (int64) in ``dtype``."""
        dt = _check_dtype(dtype)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # (n,)
        return self._values(ids, int(dim)).astype(dt)  # (n, dim)

    def _values(self, ids: np.ndarray, dim: int) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class Zeros(Initializer):
    name: ClassVar[str] = "zeros"

    def _values(self, ids, dim):
        return np.zeros((len(ids), dim), dtype=np.float64)


@dataclass(frozen=True)
class Constant(Initializer):
    name: ClassVar[str] = "constant"
    value: float = 0.0

    def __post_init__(self) -> None:
        _finite(self, "value")

    def _values(self, ids, dim):
        return np.full((len(ids), dim), self.value, dtype=np.float64)


@dataclass(frozen=True)
class Normal(Initializer):
    name: ClassVar[str] = "normal"
    mean: float = 0.0
    std: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _finite(self, "mean", "std")
        _seed(self)
        if self.std < 0:
            raise InvalidRequest("Normal.std must be >= 0", field="std")

    def _values(self, ids, dim):
        # Box-Muller: u1 in (0, 1] so the log is finite; u2 in [0, 1).
        u1 = 1.0 - _unit(_hash(self.seed, ids, dim, 0))  # (n, dim) float64
        u2 = _unit(_hash(self.seed, ids, dim, 1))  # (n, dim) float64
        z = np.sqrt(-2.0 * stable_log(u1)) * stable_cos_2pi(u2)  # (n, dim) float64
        return self.mean + self.std * z


@dataclass(frozen=True)
class Uniform(Initializer):
    name: ClassVar[str] = "uniform"
    low: float = -0.05
    high: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        _finite(self, "low", "high")
        _seed(self)
        if self.high < self.low:
            raise InvalidRequest("Uniform.high must be >= low", field="high")

    def _values(self, ids, dim):
        u = _unit(_hash(self.seed, ids, dim, 0))  # (n, dim) float64 in [0, 1)
        return self.low + (self.high - self.low) * u


_BY_NAME: dict[str, type[Initializer]] = {cls.name: cls for cls in (Zeros, Constant, Normal, Uniform)}


def initializer_to_dict(init: Initializer) -> dict[str, Any]:
    return {"name": init.name, **{f.name: getattr(init, f.name) for f in fields(init)}}  # type: ignore[arg-type]


def initializer_from_dict(data: Any) -> Initializer:
    """The initializer ``data`` describes; ``InvalidRequest`` on anything else."""
    if not isinstance(data, dict):
        raise InvalidRequest("init must be an object with a 'name'", field="init")
    name = data.get("name")
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidRequest(f"unknown initializer {data.get('name')!r}", field="init")
    params = {k: v for k, v in data.items() if k != "name"}
    unknown = sorted(set(params) - {f.name for f in fields(cls)})  # type: ignore[arg-type]
    if unknown:
        raise InvalidRequest(f"unknown {cls.name} parameter(s): {', '.join(unknown)}", field="init")
    return cls(**params)
