"""Elementwise operators: relu, gelu, tanh, exp, sqrt, abs, round.

Each is a primitive whose JVP is ``t · f'(x)`` with ``f'`` written in ts
operators and jax.numpy (gelu's: the formula of ``contracts/activations.py``), so
derivatives of any order exist. 8- and 16-bit inputs are computed in f32 and rounded
once to the input dtype, and so are their derivatives.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from tessera_jax.contracts.activations import gelu as gelu_formula
from tessera_jax.contracts.activations import gelu_derivative
from tessera_jax.primitives._core import (
    Operator,
    ad,
    as_array,
    batching,
    check_dtype,
    compute_dtype,
    zero_tangent,
)

_INEXACT = (jnp.floating, jnp.complexfloating)
_FLOATING = (jnp.floating,)


def _in_compute(f: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    def ref(x, **params):
        return f(x.astype(compute_dtype(x.dtype)), **params).astype(x.dtype)

    return ref


def _unary(
    name: str,
    ref: Callable[..., jax.Array],
    deriv: Callable[..., jax.Array] | None,
    kinds=_FLOATING,
) -> tuple[Operator, Callable[..., jax.Array]]:
    """An elementwise operator; ``deriv(x, y, **params)`` is dy/dx (None: zero)."""
    op = Operator(name, reference=_in_compute(ref), abstract_eval=lambda x, **_: x)

    def jvp(primals, tangents, **params):
        (x,), (t,) = primals, tangents
        y = op.bind(x, **params)
        if deriv is None or type(t) is ad.Zero:
            return y, zero_tangent(y)
        return y, t * deriv(x, y, **params).astype(t.dtype)

    ad.primitive_jvps[op.prim] = jvp
    batching.primitive_batchers[op.prim] = lambda args, dims, **p: (op.bind(*args, **p), dims[0])

    def public(x, **params):
        x = as_array(name, "x", x)
        check_dtype(name, "x", x, kinds)
        return op.bind(x, **params)

    public.__name__ = name
    return op, public


relu_op, _relu = _unary("relu", lambda x: jnp.maximum(x, 0), lambda x, y: (x > 0).astype(x.dtype))
tanh_op, _tanh = _unary("tanh", jnp.tanh, lambda x, y: 1 - y * y, kinds=_INEXACT)
exp_op, _exp = _unary("exp", jnp.exp, lambda x, y: y, kinds=_INEXACT)
sqrt_op, _sqrt = _unary("sqrt", jnp.sqrt, lambda x, y: 0.5 / y, kinds=_INEXACT)
abs_op, _abs = _unary("abs", jnp.abs, lambda x, y: jnp.sign(x))
round_op, _round = _unary("round", jnp.round, None)


def _gelu_deriv(x, y, *, approximate):
    """The contract's derivative formula in the compute dtype, rounded once: for 16-bit
    inputs each operation would otherwise round to 16 bits (XLA keeps those roundings),
    and the formula shares gelu's expression (its tanh or erf) with the forward."""
    del y
    xc = x.astype(compute_dtype(x.dtype))
    return gelu_derivative(xc, approximate=approximate).astype(x.dtype)


gelu_op, _gelu = _unary("gelu", gelu_formula, _gelu_deriv)


def relu(x: jax.Array) -> jax.Array:
    """``max(x, 0)`` elementwise. Derivative at 0 is 0."""
    return _relu(x)


def gelu(x: jax.Array, approximate: bool = False) -> jax.Array:
    """Gaussian error linear unit: ``x·Φ(x)``; ``approximate=True`` uses the tanh form."""
    if not isinstance(approximate, bool):
        raise TypeError(f"gelu: approximate={approximate!r} must be a bool")
    return _gelu(x, approximate=approximate)


def tanh(x: jax.Array) -> jax.Array:
    """Hyperbolic tangent elementwise."""
    return _tanh(x)


def exp(x: jax.Array) -> jax.Array:
    """``e**x`` elementwise."""
    return _exp(x)


def sqrt(x: jax.Array) -> jax.Array:
    """Square root elementwise (NaN for negative inputs, as IEEE)."""
    return _sqrt(x)


def abs(x: jax.Array) -> jax.Array:
    """``|x|`` elementwise; derivative ``sign(x)``."""
    return _abs(x)


def round(x: jax.Array) -> jax.Array:
    """Round half to even; derivative zero."""
    return _round(x)
