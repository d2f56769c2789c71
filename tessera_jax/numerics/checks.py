"""Argument checks shared by the public functions of the numerics operators.

Each turns a bad argument into a ``TypeError``/``ValueError`` that names the
function, the argument, the value and what is allowed, before anything is traced
(so the user never sees a NumPy, MLIR or jax-internal message). They complement
:mod:`tessera_jax.primitives._core`'s ``as_array``/``normalize_axes`` (``axes_arg``
screens the latter's input first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.numerics.dtypes import DType, as_tdtype
from tessera_jax.primitives._core import normalize_axes

__all__ = ["axes_arg", "bool_arg", "dtype_arg", "int_arg", "key_arg"]


def int_arg(op: str, arg: str, v: Any) -> int:
    """``v`` as an int; bools, floats and the rest are a TypeError."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{op}: {arg}={v!r} must be an int")
    return int(v)


def axes_arg(op: str, axis: Any, ndim: int) -> tuple[int, ...]:
    """``axis`` (None = all, an int, or a sequence of ints) as a sorted tuple of axes."""
    if axis is not None and not isinstance(axis, (int, np.integer)):
        if not isinstance(axis, Sequence) or isinstance(axis, str):
            raise TypeError(f"{op}: {axis=!r} must be None, an int or a sequence of ints")
        for a in axis:
            int_arg(op, "axis", a)
    elif axis is not None:
        int_arg(op, "axis", axis)
    return normalize_axes(op, axis, ndim)


def bool_arg(op: str, arg: str, v: Any) -> bool:
    """``v`` as a bool; anything else (0/1, None, strings) is a TypeError."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{op}: {arg}={v!r} must be a bool")
    return bool(v)


def dtype_arg(op: str, arg: str, v: Any) -> DType:
    """``v`` (a ts dtype, policy, numpy dtype or name) as a ts dtype, or a TypeError."""
    if v is None:
        raise TypeError(f"{op}: {arg}=None must be a dtype, a ts dtype or a policy")
    try:
        return as_tdtype(v)
    except TypeError as e:
        raise TypeError(f"{op}: {arg}={v!r}: {e}") from None


def key_arg(op: str, key: Any) -> jax.Array | None:
    """``key`` as a PRNG key (a typed key or a raw ``uint32[2]``), or a TypeError."""
    if key is None:
        return None
    if isinstance(key, (jax.Array, np.ndarray)):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return key
        if key.dtype == np.uint32 and key.shape == (2,):
            return key
        what = f"an array of shape {key.shape} and dtype {key.dtype}"
    else:
        what = f"a {type(key).__name__}"
    raise TypeError(
        f"{op}: key must be one PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), "
        f"got {what}"
    )
