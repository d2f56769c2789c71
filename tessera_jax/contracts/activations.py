"""Activation formulas shared by the elementwise operators and matmul's fused epilogue.

One definition each, so the ``ts.gelu`` operator, the matmul reference epilogue and the
Pallas kernels' epilogues compute the same function.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)


_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = 0.044715


def _tanh_inner(x):
    """``tanh(√(2/π)·(x + 0.044715·x³))``, written once: the tanh form and its derivative
    then share the expression, which XLA computes once where both are in one program."""
    return jnp.tanh(_SQRT_2_OVER_PI * (x + _GELU_TANH_C * (x * x * x)))


def _cdf(x, erf):
    """``Φ(x) = (1 + erf(x/√2)) / 2`` without the halving (shared like ``_tanh_inner``)."""
    return 1 + erf(x * _INV_SQRT_2)


def gelu(x, *, approximate: bool, erf=lax.erf):
    """``x·Φ(x)`` in ``x``'s dtype (``approximate``: the tanh form). ``erf`` is a
    parameter because Mosaic GPU kernels cannot lower ``lax.erf``."""
    if approximate:
        return 0.5 * x * (1 + _tanh_inner(x))
    return 0.5 * x * _cdf(x, erf)


def gelu_derivative(x, *, approximate: bool, erf=lax.erf):
    """``d gelu / dx`` in ``x``'s dtype: ``Φ(x) + x·φ(x)``, or for the tanh form
    ``(1 + t)/2 + x·(1 - t²)·√(2/π)·(1 + 3·0.044715·x²)/2`` with ``t`` the tanh of
    :func:`gelu`'s (the same expression, so the two share it)."""
    if approximate:
        t = _tanh_inner(x)
        dt = _SQRT_2_OVER_PI * (1 + (3 * _GELU_TANH_C) * (x * x))
        return 0.5 * (1 + t) + 0.5 * x * ((1 - t * t) * dt)
    return 0.5 * _cdf(x, erf) + x * (jnp.exp(-0.5 * (x * x)) * _INV_SQRT_2PI)
