"""Reductions: sum, max, mse — with a documented, fixed summation order.

The canonical tree
------------------
``sum(x, axis, deterministic=True)`` (the default) flattens the reduced axes in
row-major order into one index space ``0 … n-1`` (its size depends only on the
global shape) and adds level by level, adjacent pairs first::

    level 1: (x0+x1), (x2+x3), (x4+x5), …     an odd last node passes up unchanged
    level 2: ((x0+x1)+(x2+x3)), …
    …until one node is left.

This is the pairwise tree over ``n`` leaves padded to the next power of two with
absent leaves (an absent operand leaves the other unchanged). A contiguous block
of ``2**k`` leaves starting at a multiple of ``2**k`` is a complete subtree, which
is what lets a sharded reduction compute each shard's subtree locally and the top
of the tree across devices with the same bits (``tessera_jax.sharding``).

Cost: ``ceil(log2 n)`` levels of strided adds, ``n-1`` additions in all, the same
count as any summation; XLA fuses the levels. 8- and 16-bit floats accumulate in
f32 and round once at the end. Integer sums are exact in any order and use XLA's
reduction. ``deterministic=False`` uses XLA's reduction (order unspecified).

``fixed_point_sum`` sums values in ``[0, 2)`` (softmax probabilities) exactly in integer
digit columns: the same bits in any order, so it can be XLA's own fused reduction.

``max`` is exact in any order. ``mse`` is ``sum((pred - target)**2) / size`` on
the same tree.
"""

from __future__ import annotations

import builtins
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tessera_jax.numerics.checks import axes_arg, bool_arg
from tessera_jax.primitives._core import (
    Operator,
    ad,
    as_array,
    batching,
    check_dtype,
    compute_dtype,
    explicit_sharding,
    is_float,
    not_mapped,
    unshard_axes,
    zero_tangent,
)

_NUMERIC = (jnp.number,)


def rounded(x: jax.Array) -> jax.Array:
    """``x`` with its rounding fixed: no multiply that produces ``x`` is contracted into
    an add that consumes it (an FMA, rounded once instead of twice).

    XLA (CPU and GPU) lets LLVM contract a multiply into an add whenever both land in
    one fused loop with nothing between them, and what lies between them can depend on
    the program around the op: a select whose condition is a compile-time constant in
    one program (a 1-trip loop inlined) and a loop-carried value in another is folded
    away in the first only. A select between ``x`` and NaN (taken only for a NaN) is
    never folded, so every program rounds ``x`` before using it.
    """
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return jnp.where(x == x, x, jnp.asarray(jnp.nan, x.dtype))


def _leaves(x: jax.Array) -> jax.Array:
    """``x`` as leaves that no multiply can be contracted into (``rounded``).

    Whether a producing multiply fuses into the tree's first-level adds depends on the
    program around the sum (one device vs a sharded mesh).
    """
    return rounded(x)


def pairwise_tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sums ``axis`` of ``x`` on the canonical pairwise tree (module docstring).

    Any axis gives the same tree (and bits); reducing in place avoids moving the axis,
    which costs a transpose pass when the operand is not fused (the all-reduce's
    received chunks, stacked along axis 0).
    """
    axis = axis % x.ndim
    # One leaf has no add to guard: its select would only join the consumer's fused loop,
    # and change how XLA vectorises that loop's own sums, in the programs that have it
    # (a one-part all-reduce) and not in the others.
    if x.shape[axis] > 1:
        x = _leaves(x)
    while x.shape[axis] > 1:
        n = x.shape[axis]
        even = n - n % 2
        pairs = lax.slice_in_dim(x, 0, even, 2, axis) + lax.slice_in_dim(x, 1, even, 2, axis)
        x = (
            lax.concatenate([pairs, lax.slice_in_dim(x, n - 1, n, 1, axis)], axis)
            if n % 2
            else pairs
        )
    if x.shape[axis] == 0:
        return jnp.zeros(x.shape[:axis] + x.shape[axis + 1 :], x.dtype)
    return lax.index_in_dim(x, 0, axis, keepdims=False)


# XLA's CPU backend splits a long reduction into a reduce-window of 32 and a reduce, and
# fuses neither with the digits' producer, so each digit column was written out as a whole
# int32 array first. Summed in two stages of at most _CPU_LANES each (an optimisation
# barrier keeps XLA from merging them back into one long reduction), the digits and both
# stages fuse into one loop over ``x``. Integer sums are exact: the same bits either way
# (benchmarks/archive/reference-cpu-probe.txt).
_CPU_LANES = 32


def _digit_sum(d: jax.Array, lanes: int | None) -> jax.Array:
    """The exact int32 sum of ``d``'s last axis (kept): one reduction, or with ``lanes``
    one of each run of ``lanes`` digits (zero-padded) and then of those."""
    if lanes is None or d.shape[-1] <= lanes:
        return jnp.sum(d, axis=-1, keepdims=True, dtype=jnp.int32)
    d = jnp.pad(d, [(0, 0)] * (d.ndim - 1) + [(0, -d.shape[-1] % lanes)])
    d = jnp.sum(d.reshape(*d.shape[:-1], d.shape[-1] // lanes, lanes), axis=-1, dtype=jnp.int32)
    return jnp.sum(lax.optimization_barrier(d), axis=-1, keepdims=True, dtype=jnp.int32)


def _fixed_point_sum(x: jax.Array, lanes: int | None) -> jax.Array:
    n = x.shape[-1]
    width = 30 - builtins.max(n, 1).bit_length()  # n values below 2 sum below 2**31 digits
    words = -(-(jnp.finfo(x.dtype).nmant + 1 + n.bit_length()) // width)
    rest, columns = x, []
    for _ in range(words):
        rest = rest * float(2**width)  # exact: a power of two
        digit = jnp.floor(rest)
        rest = rest - digit  # exact: the fraction of a float
        columns.append(_digit_sum(digit.astype(jnp.int32), lanes))
    total = jnp.zeros((*x.shape[:-1], 1), x.dtype)
    for i in reversed(range(words)):  # smallest first; a power-of-two scale is exact
        total = total + columns[i].astype(x.dtype) * float(2.0 ** (-width * (i + 1)))
    return total


def fixed_point_sum(x: jax.Array) -> jax.Array:
    """Sums the last axis (kept) of ``x``, whose values lie in ``[0, 2)``, in fixed point:
    the same bits for any order of the adds, so XLA may reduce in whatever order it likes.

    Each value is cut into ``words`` integer digits of ``width`` bits (``x ≈ Σ_i w_i ·
    2^{-width·(i+1)}``; the cuts are exact float operations), each digit column is summed
    in int32 — exact, hence order-free: ``width`` is chosen so that ``n`` digits cannot
    overflow — and the columns are combined in a fixed order in ``x``'s dtype. ``words``
    keeps the truncation below ``2^{-(nmant+1)}`` summed over the row: below a quarter ulp
    of any row sum of at least 1 (softmax normalisers are), and plain rounding after it.

    It is a reduction XLA runs as such (one read of ``x`` per sum, fused with its
    producer), where the canonical tree is a fused loop of strided slices: the softmax
    normaliser of flash attention's reference on a GPU. On the CPU the digit columns are
    summed in two stages (:data:`_CPU_LANES`), which XLA's CPU backend fuses.
    """
    return lax.platform_dependent(
        x,
        cpu=functools.partial(_fixed_point_sum, lanes=_CPU_LANES),
        default=functools.partial(_fixed_point_sum, lanes=None),
    )


def canonical_sum(x: jax.Array, axes: tuple[int, ...], keepdims: bool) -> jax.Array:
    """``x`` summed over ``axes`` on the canonical tree, accumulating in the compute dtype."""
    x = unshard_axes(x, axes)
    keep = [a for a in range(x.ndim) if a not in axes]
    xt = jnp.transpose(x, keep + list(axes)).astype(compute_dtype(x.dtype))
    n = math.prod(x.shape[a] for a in axes)
    out = pairwise_tree_sum(xt.reshape(*[x.shape[a] for a in keep], n))
    if keepdims:
        out = out.reshape([1 if a in axes else x.shape[a] for a in range(x.ndim)])
    return out.astype(x.dtype)


def _reduced_shape(shape, axes, keepdims):
    return tuple(1 if a in axes else d for a, d in enumerate(shape) if keepdims or a not in axes)


def _expand_back(ct: jax.Array, like: jax.Array, axes: tuple[int, ...], keepdims: bool):
    """Broadcasts a reduction's cotangent back to the type (shape, sharding) of ``like``."""
    if not keepdims:
        ct = jnp.expand_dims(ct, axes)
    aval = jax.typeof(like) if isinstance(like, jax.Array) else like
    return jnp.broadcast_to(ct, aval.shape, out_sharding=explicit_sharding(aval))


def _shift_axes(axes, bdim):
    return tuple(a + (a >= bdim) for a in axes)


def _reduction_batcher(op: Operator):
    def rule(args, dims, *, axes, keepdims, **params):
        (x,), (d,) = args, dims
        axes = _shift_axes(axes, d)
        out_dim = d if keepdims else d - builtins.sum(a < d for a in axes)
        return op.bind(x, axes=axes, keepdims=keepdims, **params), out_dim

    batching.primitive_batchers[op.prim] = rule


# --- sum ----------------------------------------------------------------------------------


def _sum_ref(x, *, axes, keepdims, deterministic):
    if deterministic and is_float(x.dtype):
        return canonical_sum(x, axes, keepdims)
    acc = compute_dtype(x.dtype)
    return jnp.sum(x.astype(acc), axis=axes, keepdims=keepdims).astype(x.dtype)


sum_op = Operator(
    "sum",
    reference=_sum_ref,
    abstract_eval=lambda x, *, axes, keepdims, **_: x.update(
        shape=_reduced_shape(x.shape, axes, keepdims)
    ),
)


def _sum_transpose(ct, x, *, axes, keepdims, deterministic):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return [_expand_back(ct, x.aval, axes, keepdims)]


ad.deflinear2(sum_op.prim, _sum_transpose)
_reduction_batcher(sum_op)


def sum(
    x: jax.Array,
    axis: int | Sequence[int] | None = None,
    keepdims: bool = False,
    *,
    deterministic: bool = True,
) -> jax.Array:
    """Sum over ``axis`` (all axes if None) on the canonical pairwise tree.

    Arguments:
      x: a numeric array.
      axis: an int, a sequence of ints or None.
      keepdims: keep reduced axes with size 1.
      deterministic: True (default) fixes the summation order (module docstring);
        False lets XLA choose.
    Returns:
      An array of ``x.dtype``.
    """
    x = as_array("sum", "x", x)
    check_dtype("sum", "x", x, _NUMERIC)
    axes = axes_arg("sum", axis, x.ndim)
    keepdims = bool_arg("sum", "keepdims", keepdims)
    deterministic = bool_arg("sum", "deterministic", deterministic)
    return sum_op.bind(x, axes=axes, keepdims=keepdims, deterministic=deterministic)


# --- max ----------------------------------------------------------------------------------

max_op = Operator(
    "max",
    reference=lambda x, *, axes, keepdims: jnp.max(x, axis=axes, keepdims=keepdims),
    abstract_eval=lambda x, *, axes, keepdims: x.update(
        shape=_reduced_shape(x.shape, axes, keepdims)
    ),
)


def _max_jvp(primals, tangents, *, axes, keepdims):
    (x,), (t,) = primals, tangents
    y = max_op.bind(x, axes=axes, keepdims=keepdims)
    if type(t) is ad.Zero:
        return y, zero_tangent(y)
    # Ties share the derivative equally (as jax.numpy.max does).
    hit = (x == _expand_back(y, x, axes, keepdims)).astype(t.dtype)
    count = sum(hit, axis=axes, keepdims=keepdims)
    return y, sum(t * hit, axis=axes, keepdims=keepdims) / count


ad.primitive_jvps[max_op.prim] = _max_jvp
_reduction_batcher(max_op)


def max(x: jax.Array, axis: int | Sequence[int] | None = None, keepdims: bool = False):
    """Maximum over ``axis`` (all if None). Gradient split equally between ties."""
    x = as_array("max", "x", x)
    check_dtype("max", "x", x, _NUMERIC)
    axes = axes_arg("max", axis, x.ndim)
    keepdims = bool_arg("max", "keepdims", keepdims)
    if builtins.any(x.shape[a] == 0 for a in axes):
        raise ValueError(
            f"max: cannot reduce a zero-size axis of x.shape={x.shape} over axis={axes} "
            "(the maximum of no elements is undefined)"
        )
    return max_op.bind(x, axes=axes, keepdims=keepdims)


# --- mse ----------------------------------------------------------------------------------


def _mse_ref(pred, target):
    acc = compute_dtype(pred.dtype)
    d = pred.astype(acc) - target.astype(acc)
    total = canonical_sum(d * d, tuple(range(d.ndim)), False)
    return (total / np.asarray(d.size, acc)).astype(pred.dtype)


mse_op = Operator(
    "mse",
    reference=_mse_ref,
    abstract_eval=lambda pred, target: pred.update(shape=()),
)


def _mse_jvp(primals, tangents):
    pred, target = primals
    tp, tt = (ad.instantiate_zeros(t) for t in tangents)
    y = mse_op.bind(pred, target)
    d = pred - target
    scale = np.asarray(2.0 / builtins.max(d.size, 1), d.dtype)
    return y, sum(d * (tp - tt)) * scale


ad.primitive_jvps[mse_op.prim] = _mse_jvp


def _mse_batcher(args, dims):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
    pred, target = (
        jnp.moveaxis(a, d, 0) if d is not not_mapped else jnp.broadcast_to(a, (size, *a.shape))
        for a, d in zip(args, dims)
    )
    # Per example: the same tree over that example's elements as mse_op on one slice.
    d = pred.astype(compute_dtype(pred.dtype)) - target.astype(compute_dtype(pred.dtype))
    flat = (d * d).reshape(size, math.prod(d.shape[1:]))  # (not -1: size may be 0)
    total = sum_op.bind(flat, axes=(1,), keepdims=False, deterministic=True)
    return (total / np.asarray(flat.shape[1], total.dtype)).astype(pred.dtype), 0


batching.primitive_batchers[mse_op.prim] = _mse_batcher


def mse(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over all elements: ``sum((pred - target)**2) / pred.size``.

    The sum runs on the canonical tree in f32 for 8-/16-bit inputs. Shapes and
    dtypes must match exactly (no broadcasting).
    """
    pred = as_array("mse", "pred", pred)
    target = as_array("mse", "target", target)
    check_dtype("mse", "pred", pred, (jnp.floating,))
    if pred.shape != target.shape:
        raise ValueError(f"mse: pred.shape={pred.shape} must equal target.shape={target.shape}")
    if pred.dtype != target.dtype:
        raise TypeError(f"mse: pred.dtype={pred.dtype} must equal target.dtype={target.dtype}")
    if pred.size == 0:
        raise ValueError(f"mse: pred.shape={pred.shape} has no elements")
    return mse_op.bind(pred, target)
