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


def gelu(x, *, approximate: bool, erf=lax.erf):
    """``x·Φ(x)`` in ``x``'s dtype (``approximate``: the tanh form). ``erf`` is a
    parameter because Mosaic GPU kernels cannot lower ``lax.erf``."""
    if approximate:
        return 0.5 * x * (1 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))))
    return 0.5 * x * (1 + erf(x * _INV_SQRT_2))
