"""Softmax and log-softmax over one axis.

Numerics: the input is cast to the compute dtype (f32 for 8- and 16-bit floats),
the row maximum is subtracted before ``exp`` (no overflow), the row is
normalised, and the result is rounded once to the input dtype.

Rows that are entirely ``-inf`` (a fully masked row) give zeros from
``softmax`` and ``-inf`` from ``log_softmax``, never NaN: the maximum of such a
row is replaced by 0 before subtracting and an empty normaliser by 1. Softmax's
gradient there is zero; log-softmax's is the cotangent itself (``δ − softmax``
with softmax = 0). A row containing ``+inf`` or NaN gives NaN, as in
``jax.nn.softmax``.

Adjoints: both operators have JVP rules written in jax.numpy on the primal
output (``dy = y·(dx − Σ y·dx)`` for softmax, ``dx − Σ softmax(x)·dx`` for
log-softmax), so reverse mode and derivatives of any order follow.

Kernels: ``softmax_op.add_kernel(Kernel(...))`` with
``fn(x, *, interpret, axis)``; ``axis`` is a non-negative int.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.primitives._core import (
    Operator,
    ad,
    as_array,
    batching,
    check_dtype,
    compute_dtype,
    normalize_axis,
)

_FLOATING = (jnp.floating,)


def _stable_exp(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(x - m, exp(x - m), Σ exp(x - m))`` with a fully ``-inf`` row's ``m`` set to 0."""
    m = jnp.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = jnp.where(m == -np.inf, jnp.zeros_like(m), m)
    shifted = x - m
    e = jnp.exp(shifted)
    return shifted, e, jnp.sum(e, axis=axis, keepdims=True)


def softmax_reference(x: jax.Array, *, axis: int) -> jax.Array:
    """The XLA lowering of ``ts_softmax`` (and the test oracle of its kernels)."""
    xc = x.astype(compute_dtype(x.dtype))
    _, e, s = _stable_exp(xc, axis)
    return (e / jnp.where(s == 0, jnp.ones_like(s), s)).astype(x.dtype)


def log_softmax_reference(x: jax.Array, *, axis: int) -> jax.Array:
    """The XLA lowering of ``ts_log_softmax``."""
    xc = x.astype(compute_dtype(x.dtype))
    shifted, _, s = _stable_exp(xc, axis)
    return (shifted - jnp.log(jnp.where(s == 0, jnp.ones_like(s), s))).astype(x.dtype)


softmax_op = Operator("softmax", reference=softmax_reference, abstract_eval=lambda x, **_: x)
log_softmax_op = Operator(
    "log_softmax", reference=log_softmax_reference, abstract_eval=lambda x, **_: x
)


def _softmax_jvp(primals, tangents, *, axis):
    (x,), (t,) = primals, tangents
    y = softmax_op.bind(x, axis=axis)
    c = compute_dtype(x.dtype)
    yc, tc = y.astype(c), ad.instantiate_zeros(t).astype(c)
    dy = yc * (tc - jnp.sum(yc * tc, axis=axis, keepdims=True))
    return y, dy.astype(y.dtype)


def _log_softmax_jvp(primals, tangents, *, axis):
    (x,), (t,) = primals, tangents
    y = log_softmax_op.bind(x, axis=axis)
    c = compute_dtype(x.dtype)
    # softmax(x) = exp(log_softmax(x)); a fully -inf row has exp(-inf) = 0 everywhere.
    p, tc = jnp.exp(y.astype(c)), ad.instantiate_zeros(t).astype(c)
    return y, (tc - jnp.sum(p * tc, axis=axis, keepdims=True)).astype(y.dtype)


def _axis_batcher(op: Operator):
    def rule(args, dims, *, axis):
        (x,), (d,) = args, dims
        return op.bind(x, axis=axis + (axis >= d)), d

    return rule


ad.primitive_jvps[softmax_op.prim] = _softmax_jvp
ad.primitive_jvps[log_softmax_op.prim] = _log_softmax_jvp
batching.primitive_batchers[softmax_op.prim] = _axis_batcher(softmax_op)
batching.primitive_batchers[log_softmax_op.prim] = _axis_batcher(log_softmax_op)


def _prepare(name: str, x, axis) -> tuple[jax.Array, int]:
    x = as_array(name, "x", x)
    check_dtype(name, "x", x, _FLOATING)
    if x.ndim == 0:
        raise ValueError(f"{name}: x must have at least one dimension, got a scalar")
    return x, normalize_axis(name, "axis", axis, x.ndim)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """``exp(x) / Σ exp(x)`` along ``axis``, max-subtracted.

    Arguments:
      x: a floating array of rank ≥ 1.
      axis: the axis to normalise over (any, negative counts from the end).
    Returns:
      An array of ``x``'s shape and dtype whose entries along ``axis`` sum to 1;
      a row that is entirely ``-inf`` gives zeros (with zero gradient). 8- and
      16-bit inputs are computed in f32 and rounded once.
    """
    x, axis = _prepare("softmax", x, axis)
    return softmax_op.bind(x, axis=axis)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """``x - log Σ exp(x)`` along ``axis``, max-subtracted.

    A row that is entirely ``-inf`` stays ``-inf`` (``log`` of softmax's zeros);
    its gradient is the cotangent (``δ − softmax`` with softmax = 0), never NaN.
    8- and 16-bit inputs are computed in f32 and rounded once.
    """
    x, axis = _prepare("log_softmax", x, axis)
    return log_softmax_op.bind(x, axis=axis)
