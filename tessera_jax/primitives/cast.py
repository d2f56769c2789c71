"""``cast(x, dtype_or_policy, key=None)``: conversion to a ts dtype or a policy's storage.

Round to nearest even by default; stochastic rounding (unbiased) when a PRNG
``key`` is given, which a policy with ``@ts.stochastic_round`` requires. The
noise is drawn outside the primitive and passed in as an operand, so the
primitive itself is a pure function of its inputs (same key, same bits).

Derivatives are straight-through: the tangent is cast to the output dtype
(stochastic rounding is treated as unbiased noise, as in mixed-precision
training); the cotangent is cast back to the input dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.numerics.checks import dtype_arg, key_arg
from tessera_jax.numerics.dtypes import DType, as_policy, round_to_grid
from tessera_jax.primitives._core import (
    Operator,
    ad,
    as_array,
    batching,
    move_bdim_to_front,
    not_mapped,
    zero_tangent,
)


def _out_aval(x, target: DType):
    return x.update(dtype=target.container, weak_type=False)


def _float_out(target: DType) -> bool:
    return bool(jnp.issubdtype(target.container, jnp.inexact))


cast_op = Operator(
    "cast",
    reference=lambda x, *, target: round_to_grid(x, target),
    abstract_eval=lambda x, *, target: _out_aval(x, target),
)

stochastic_cast_op = Operator(
    "stochastic_cast",
    reference=lambda x, u, *, target: round_to_grid(x, target, u),
    abstract_eval=lambda x, u, *, target: _out_aval(x, target),
)


def _tangent_out(t, y, target: DType):
    """The output tangent of either cast: the input tangent cast straight through."""
    if type(t) is ad.Zero or not _float_out(target):
        return zero_tangent(y)
    return cast_op.bind(t, target=target)


def _cast_jvp(primals, tangents, *, target):
    (x,), (t,) = primals, tangents
    y = cast_op.bind(x, target=target)
    return y, _tangent_out(t, y, target)


def _cast_transpose(ct, x, *, target):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return [ct.astype(x.aval.dtype)]


def _stochastic_cast_jvp(primals, tangents, *, target):
    (x, u), (t, _) = primals, tangents
    y = stochastic_cast_op.bind(x, u, target=target)
    return y, _tangent_out(t, y, target)


ad.primitive_jvps[cast_op.prim] = _cast_jvp
ad.primitive_transposes[cast_op.prim] = _cast_transpose
ad.primitive_jvps[stochastic_cast_op.prim] = _stochastic_cast_jvp
batching.primitive_batchers[cast_op.prim] = lambda a, d, **p: (cast_op.bind(*a, **p), d[0])


def _stochastic_cast_batcher(args, dims, *, target):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
    x, u = (move_bdim_to_front(a, d, size) for a, d in zip(args, dims))
    return stochastic_cast_op.bind(x, u, target=target), 0


batching.primitive_batchers[stochastic_cast_op.prim] = _stochastic_cast_batcher


def cast(x: jax.Array, dtype_or_policy: Any, key: jax.Array | None = None) -> jax.Array:
    """Converts ``x`` to a ts dtype, a numpy dtype, a dtype name or a policy's storage.

    Arguments:
      x: a real array (complex → real casts are refused: they would drop the
        imaginary part silently).
      dtype_or_policy: ``ts.bf16``, ``jnp.float16``, ``"fp8_e4m3"``,
        ``ts.bf16 @ ts.accum(ts.f32) @ ts.stochastic_round``, a precision policy…
      key: a PRNG key; when given, rounding is stochastic and unbiased. Required
        by policies with ``ts.stochastic_round``.
    Returns:
      An array in the target's container dtype; values lie on the target's grid
      (fp6 values are held in an fp8 e4m3 container). For formats without
      infinities (e4m3, fp6) out-of-range values and ±inf saturate to ±max;
      formats with infinities round out-of-range values to ±inf (stochastic
      rounding saturates finite ones at ±max). NaN stays NaN in float formats
      and becomes 0 in integer ones.
    """
    x = as_array("cast", "x", x)
    target = dtype_arg("cast", "dtype_or_policy", dtype_or_policy)
    policy = as_policy(dtype_or_policy)
    key = key_arg("cast", key)
    x_complex = jnp.issubdtype(x.dtype, jnp.complexfloating)
    if x_complex and not jnp.issubdtype(target.container, jnp.complexfloating):
        raise TypeError(f"cast: x.dtype={x.dtype} is complex but the target {target!r} is real")
    if key is None:
        if policy.stochastic_round:
            raise ValueError(
                f"cast: the policy {policy!r} rounds stochastically; pass key=jax.random.key(...)"
            )
        return cast_op.bind(x, target=target)
    if x_complex or target.container == np.dtype(np.float64):
        raise TypeError(f"cast: stochastic rounding from {x.dtype} to {target!r} is not supported")
    u = jax.random.uniform(key, x.shape, jnp.float32)
    return stochastic_cast_op.bind(x, u, target=target)
