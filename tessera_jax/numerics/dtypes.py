"""Tessera dtypes and the policies composed from them with ``@``.

``ts.bf16 @ ts.accum(ts.f32) @ ts.stochastic_round`` reads "stored in bf16,
accumulated in f32, rounded stochastically when cast to storage". A ``DType``
and a ``Policy`` both expose ``.dtype`` (the numpy dtype an array of them has),
so either can be passed wherever jax.numpy takes a dtype.

fp6 (e3m2) has no XLA array type on every backend: its values live on the fp6
grid inside an fp8 e4m3 container, which represents every fp6 value exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tessera_jax.primitives._core import is_float


@dataclasses.dataclass(frozen=True)
class DType:
    """A Tessera scalar type.

    Attributes:
      name: the Tessera name (``"bf16"``).
      container: the numpy dtype arrays of this type have.
      grid: the numeric format values are rounded to (differs from ``container``
        only for formats XLA cannot store, e.g. fp6).
    """

    name: str
    container: np.dtype
    grid: np.dtype

    @property
    def dtype(self) -> np.dtype:
        return self.container

    @property
    def is_float(self) -> bool:
        return is_float(self.container)

    @property
    def bits(self) -> int:
        return 6 if self.grid == np.dtype(ml_dtypes.float6_e3m2fn) else self.grid.itemsize * 8

    def __matmul__(self, other: Any) -> Policy:
        return Policy(storage=self) @ other

    def __rmatmul__(self, other: Any) -> Policy:
        # ``ts.accum(ts.f32) @ ts.bf16``: Python's own message would not say the order.
        raise TypeError(
            f"policy composition: cannot apply {self!r} to {other!r}; a policy starts with its "
            f"storage dtype: {self!r} @ ts.accum(...) @ ts.stochastic_round @ ts.loss_scale(...)"
        )

    def __repr__(self) -> str:
        return f"ts.{self.name}"


def _dt(name: str, container: Any, grid: Any = None) -> DType:
    container = np.dtype(container)
    return DType(name, container, np.dtype(grid) if grid is not None else container)


f64 = _dt("f64", np.float64)
f32 = _dt("f32", np.float32)
f16 = _dt("f16", np.float16)
bf16 = _dt("bf16", jnp.bfloat16)
fp8_e4m3 = _dt("fp8_e4m3", jnp.float8_e4m3fn)
fp8_e5m2 = _dt("fp8_e5m2", jnp.float8_e5m2)
fp6_e3m2 = _dt("fp6_e3m2", jnp.float8_e4m3fn, ml_dtypes.float6_e3m2fn)
int8 = _dt("int8", np.int8)
int32 = _dt("int32", np.int32)
complex64 = _dt("complex64", np.complex64)

# The two fp8 containers: the formats fp8 products (tensor cores, scaled matmul) take.
FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))

ALL_DTYPES = {
    d.name: d for d in (f64, f32, f16, bf16, fp8_e4m3, fp8_e5m2, fp6_e3m2, int8, int32, complex64)
}
_ALIASES = {
    "fp6": "fp6_e3m2",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "fp32": "f32",
    "fp16": "f16",
    "e4m3": "fp8_e4m3",
    "e5m2": "fp8_e5m2",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}


@dataclasses.dataclass(frozen=True)
class Accum:
    """``ts.accum(ts.f32)``: the dtype reductions and matmuls accumulate in."""

    dtype: DType


@dataclasses.dataclass(frozen=True)
class LossScale:
    """``ts.loss_scale(128.0)``: scale the loss by ``scale`` before differentiating."""

    scale: float

    def __post_init__(self):
        ok = isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)
        if not (ok and np.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"loss_scale: scale={self.scale!r} must be a positive finite number")


@dataclasses.dataclass(frozen=True)
class _StochasticRound:
    def __repr__(self) -> str:
        return "ts.stochastic_round"


stochastic_round = _StochasticRound()


def accum(dtype: Any) -> Accum:
    """``ts.accum(ts.f32)``: the accumulation part of a policy (``ts.bf16 @ ts.accum(ts.f32)``)."""
    if dtype is None:
        raise TypeError("accum: dtype=None must be a ts dtype, a numpy dtype or a dtype name")
    try:
        return Accum(as_tdtype(dtype))
    except TypeError as e:
        raise TypeError(f"accum: {dtype=!r}: {e}") from None


def loss_scale(scale: float) -> LossScale:
    """``ts.loss_scale(s)``: a policy's static loss scale, a positive finite number."""
    if isinstance(scale, (bool, np.bool_)) or not isinstance(
        scale, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"loss_scale: {scale=!r} must be a positive finite number")
    return LossScale(float(scale))


@dataclasses.dataclass(frozen=True)
class Policy:
    """A storage dtype with its numerics: accumulation, rounding, loss scale."""

    storage: DType
    accumulate: DType | None = None
    stochastic_round: bool = False
    loss_scale: float | None = None

    @property
    def dtype(self) -> np.dtype:
        return self.storage.container

    def __matmul__(self, other: Any) -> Policy:
        if isinstance(other, Accum):
            return dataclasses.replace(self, accumulate=other.dtype)
        if isinstance(other, _StochasticRound):
            return dataclasses.replace(self, stochastic_round=True)
        if isinstance(other, LossScale):
            return dataclasses.replace(self, loss_scale=other.scale)
        raise TypeError(
            f"policy composition: cannot apply {other!r} to {self!r}; expected ts.accum(...), "
            "ts.stochastic_round or ts.loss_scale(...)"
        )

    def __repr__(self) -> str:
        parts = [repr(self.storage)]
        if self.accumulate is not None:
            parts.append(f"ts.accum({self.accumulate!r})")
        if self.stochastic_round:
            parts.append("ts.stochastic_round")
        if self.loss_scale is not None:
            parts.append(f"ts.loss_scale({self.loss_scale})")
        return " @ ".join(parts)


def as_tdtype(x: Any) -> DType:
    """Any dtype spelling (ts dtype, policy, numpy/jnp dtype, string) → a ts ``DType``."""
    if isinstance(x, DType):
        return x
    if x is None:  # np.dtype(None) would silently mean float64
        raise TypeError("None is not a dtype, a ts dtype or a precision policy")
    if isinstance(x, Policy):
        return x.storage
    storage = getattr(x, "storage", None)
    if isinstance(storage, DType):  # a @precision_policy class or instance
        return storage
    if isinstance(x, str):
        key = _ALIASES.get(x, x)
        if key in ALL_DTYPES:
            return ALL_DTYPES[key]
        try:
            x = np.dtype(x)
        except TypeError:
            raise TypeError(
                f"unknown dtype {x!r}; expected one of {sorted(ALL_DTYPES)} or a numpy dtype name"
            ) from None
    try:
        npd = np.dtype(x)
    except TypeError:
        raise TypeError(f"{x!r} is not a dtype, a ts dtype or a precision policy") from None
    for d in ALL_DTYPES.values():
        if d.container == npd and d.grid == npd:
            return d
    return DType(str(npd), npd, npd)


def as_np_dtype(x: Any) -> np.dtype:
    """The numpy dtype arrays of ``x`` (a ts dtype, policy, string, …) are stored in."""
    return as_tdtype(x).container


def as_policy(x: Any) -> Policy:
    if isinstance(x, Policy):
        return x
    return Policy(storage=as_tdtype(x))


def _has_inf(grid: np.dtype) -> bool:
    """Whether a float format represents infinities (e4m3fn and fp6 do not)."""
    return bool(np.isinf(np.array(np.inf).astype(grid)))


def _format_params(grid: np.dtype) -> tuple[int, int, float]:
    fi = (
        ml_dtypes.finfo(grid)
        if grid not in (np.float32, np.float64, np.float16)
        else np.finfo(grid)
    )
    return int(fi.nmant), int(fi.minexp), float(fi.max)


def round_to_grid(x: jax.Array, target: DType, u: jax.Array | None = None) -> jax.Array:
    """Rounds ``x`` to ``target``'s grid and returns it in ``target``'s container.

    Without ``u``: round to nearest even (saturating at the largest finite value
    for formats without infinities). With ``u`` (uniform ``[0, 1)`` noise of
    ``x``'s shape): stochastic rounding, unbiased, ``E[round(x)] = x`` for every
    ``x`` inside the format's range. With ``ulp`` the grid spacing at ``|x|``, the
    result is ``floor(|x|/ulp + u)·ulp``: it rounds away from zero with
    probability equal to the fraction of an ulp that ``|x|`` lies above the grid
    point below it.
    """
    grid = target.grid
    if jnp.issubdtype(grid, jnp.integer):
        info = np.iinfo(grid)
        xf = x.astype(jnp.float32)
        r = jnp.round(xf) if u is None else jnp.floor(xf + u)
        return jnp.clip(r, info.min, info.max).astype(target.container)
    if not is_float(grid) or (u is None and grid == target.container and _has_inf(grid)):
        return x.astype(target.container)  # IEEE rounding; bool and complex targets
    nmant, minexp, fmax = _format_params(grid)
    if u is None and grid == target.container:
        # XLA's convert gives NaN for out-of-range values of a format without inf
        # (e4m3fn); clipping first saturates them (±inf too) and keeps NaN.
        xc = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        return jnp.clip(xc, -fmax, fmax).astype(target.container)
    xf = x.astype(jnp.float32)
    a = jnp.minimum(jnp.abs(xf), np.float32(fmax))
    _, e = jnp.frexp(a)  # a = m·2^e with m in [0.5, 1): the binade exponent is e-1
    e = jnp.maximum(e - 1, minexp)
    ulp = jnp.ldexp(jnp.ones_like(a), e - nmant)
    scaled = a / ulp  # exact: a power-of-two scaling
    q = jnp.round(scaled) if u is None else jnp.floor(scaled + u)
    r = jnp.minimum(q * ulp, np.float32(fmax))
    r = jnp.copysign(r, xf)
    # NaN stays NaN; ±inf stays ±inf in a format that has it (else it saturated above).
    keep = jnp.isnan(xf) | (jnp.isinf(xf) if _has_inf(grid) else False)
    r = jnp.where(keep, xf, r)
    return r.astype(target.container)
