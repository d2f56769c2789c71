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

Adjoints: both operators' JVPs are maps of the primal output ``y``, linear in
the tangent, bound as primitives (``dy = y·(dx − Σ y·dx)``, ``ts_softmax_bwd``, for
softmax; ``dx − Σ softmax(x)·dx``, ``ts_log_softmax_tangent``, for log-softmax)
whose transposes are ``ts_softmax_bwd`` and ``ts_log_softmax_bwd``: reverse mode
saves only ``y`` and reads ``(y, ct)`` once. Their references are jax.numpy, through
which derivatives of any order go.

Kernels (``pallas_kernels/norms_gpu.py``, registered at the bottom): ``fn(spec, x,
*, interpret)`` and, for the backward, ``fn(spec, y, ct, *, interpret)``; ``spec``
holds ``axis``, a non-negative int (the kernels take the last axis), and
``differentiated``, True where the JVP rule bound the forward: a backward follows, and
``auto`` mode takes the forward kernel only beside the backward kernel
(``norms_gpu.ForwardPreference``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.pallas_kernels import norms_gpu as _gpu
from tessera_jax.pallas_kernels import norms_mgpu as _mgpu
from tessera_jax.primitives._core import (
    Kernel,
    Operator,
    ad,
    as_array,
    batching,
    check_dtype,
    compute_dtype,
    move_bdim_to_front,
    normalize_axis,
    not_mapped,
)

_FLOATING = (jnp.floating,)


def _stable_exp(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(x - m, exp(x - m), Σ exp(x - m))`` with a fully ``-inf`` row's exponentials 0 and
    its empty sum a positive number, so that softmax gives zeros there and log-softmax
    ``-inf``: two forms with the same values.

    On GPUs the maximum is reduced from the dtype's lowest finite value (a fully ``-inf``
    row's is then finite) and the sum is floored at the smallest normal number (any other
    row's is at least 1): no select between a reduction and its broadcast, so XLA's GPU
    compiler fuses the row into one Triton normalization kernel, as it does
    ``jax.nn.softmax``; selects there split the row into several passes over ``x``
    (benchmarks/archive/norm-references-h200.txt). On the CPU the selects stay: they keep
    XLA's CPU backend from fusing the whole row into one loop at some batch sizes only, so
    a row rounds the same in a batch of 16 to 8192 rows
    (benchmarks/archive/log-softmax-cpu-fusion-probe.txt; docs/DISTRIBUTION.md).
    """
    forms = (_stable_exp_selects, _stable_exp_floors)
    cpu, default = (functools.partial(f, axis=axis) for f in forms)
    return jax.lax.platform_dependent(x, cpu=cpu, default=default)


def _stable_exp_floors(x: jax.Array, *, axis: int):
    info = jnp.finfo(x.dtype)
    m = jnp.max(x, axis=axis, keepdims=True, initial=info.min)
    shifted = x - m
    e = jnp.exp(shifted)
    s = jnp.maximum(jnp.sum(e, axis=axis, keepdims=True), np.asarray(info.tiny, x.dtype))
    return shifted, e, s


def _stable_exp_selects(x: jax.Array, *, axis: int):
    m = jnp.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = jnp.where(m == -np.inf, jnp.zeros_like(m), m)
    shifted = x - m
    e = jnp.exp(shifted)
    s = jnp.sum(e, axis=axis, keepdims=True)
    return shifted, e, jnp.where(s == 0, jnp.ones_like(s), s)


def softmax_reference(x: jax.Array, *, axis: int, differentiated: bool = False) -> jax.Array:
    """The XLA lowering of ``ts_softmax`` (and the test oracle of its kernels)."""
    del differentiated  # (auto mode's kernel choice)
    xc = x.astype(compute_dtype(x.dtype))
    _, e, s = _stable_exp(xc, axis)
    return (e / s).astype(x.dtype)


def log_softmax_reference(x: jax.Array, *, axis: int, differentiated: bool = False) -> jax.Array:
    """The XLA lowering of ``ts_log_softmax``."""
    del differentiated  # (auto mode's kernel choice)
    xc = x.astype(compute_dtype(x.dtype))
    shifted, _, s = _stable_exp(xc, axis)
    return (shifted - jnp.log(s)).astype(x.dtype)


softmax_op = Operator("softmax", reference=softmax_reference, abstract_eval=lambda x, **_: x)
log_softmax_op = Operator(
    "log_softmax", reference=log_softmax_reference, abstract_eval=lambda x, **_: x
)


# --- the adjoints ------------------------------------------------------------------------
# Both tangent maps are linear in the tangent and read only the primal output ``y``:
# softmax's ``g ↦ y·(g − Σ y·g)`` is its own transpose (``ts_softmax_bwd``); log-softmax's
# tangent ``t ↦ t − Σ p·t`` (``ts_log_softmax_tangent``, p = exp(y)) and its transpose
# ``g ↦ g − p·Σ g`` (``ts_log_softmax_bwd``) transpose into each other. Reverse mode thus
# saves only ``y`` and runs one primitive (a kernel) over ``(y, ct)``.


def softmax_bwd_reference(y: jax.Array, g: jax.Array, *, axis: int) -> jax.Array:
    """``y·(g − Σ y·g)`` along ``axis`` in the compute dtype: softmax's JVP and VJP."""
    c = compute_dtype(y.dtype)
    yc, gc = y.astype(c), g.astype(c)
    return (yc * (gc - jnp.sum(yc * gc, axis=axis, keepdims=True))).astype(y.dtype)


def log_softmax_tangent_reference(y: jax.Array, t: jax.Array, *, axis: int) -> jax.Array:
    """``t − Σ softmax·t``: log-softmax's JVP (a fully -inf row has softmax = 0)."""
    c = compute_dtype(y.dtype)
    p, tc = jnp.exp(y.astype(c)), t.astype(c)
    return (tc - jnp.sum(p * tc, axis=axis, keepdims=True)).astype(y.dtype)


def log_softmax_bwd_reference(y: jax.Array, g: jax.Array, *, axis: int) -> jax.Array:
    """``g − softmax·Σ g``: log-softmax's VJP."""
    c = compute_dtype(y.dtype)
    p, gc = jnp.exp(y.astype(c)), g.astype(c)
    return (gc - p * jnp.sum(gc, axis=axis, keepdims=True)).astype(y.dtype)


softmax_bwd_op = Operator(
    "softmax_bwd", reference=softmax_bwd_reference, abstract_eval=lambda y, g, **_: y
)
log_softmax_tangent_op = Operator(
    "log_softmax_tangent",
    reference=log_softmax_tangent_reference,
    abstract_eval=lambda y, t, **_: y,
)
log_softmax_bwd_op = Operator(
    "log_softmax_bwd", reference=log_softmax_bwd_reference, abstract_eval=lambda y, g, **_: y
)


def _softmax_jvp(primals, tangents, *, axis, differentiated=False):
    del differentiated
    (x,), (t,) = primals, tangents
    y = softmax_op.bind(x, axis=axis, differentiated=True)
    return y, softmax_bwd_op.bind(y, ad.instantiate_zeros(t), axis=axis)


def _log_softmax_jvp(primals, tangents, *, axis, differentiated=False):
    del differentiated
    (x,), (t,) = primals, tangents
    y = log_softmax_op.bind(x, axis=axis, differentiated=True)
    return y, log_softmax_tangent_op.bind(y, ad.instantiate_zeros(t), axis=axis)


def _transpose_into(op: Operator):
    """The transpose of a map linear in its second operand: ``op`` applied to the cotangent."""

    def rule(ct, y, g, *, axis):
        if type(ct) is ad.Zero or not ad.is_undefined_primal(g):
            return [None, None]
        return [None, op.bind(y, ct, axis=axis)]

    return rule


def _jvp_via_reference(op: Operator):
    """The JVP of an adjoint primitive: its jax.numpy reference's (higher orders)."""

    def rule(primals, tangents, *, axis):
        tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
        return jax.jvp(functools.partial(op.reference, axis=axis), tuple(primals), tangents)

    return rule


def _axis_batcher(op: Operator):
    def rule(args, dims, *, axis, **params):
        (x,), (d,) = args, dims
        return op.bind(x, axis=axis + (axis >= d), **params), d

    return rule


def _pair_batcher(op: Operator):
    """vmap of an adjoint primitive ``(y, g)``: both operands with the batch dim in front."""

    def rule(args, dims, *, axis):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
        y, g = (move_bdim_to_front(a, d, size) for a, d in zip(args, dims))
        return op.bind(y, g, axis=axis + 1), 0

    return rule


ad.primitive_jvps[softmax_op.prim] = _softmax_jvp
ad.primitive_jvps[log_softmax_op.prim] = _log_softmax_jvp
batching.primitive_batchers[softmax_op.prim] = _axis_batcher(softmax_op)
batching.primitive_batchers[log_softmax_op.prim] = _axis_batcher(log_softmax_op)
ad.primitive_transposes[softmax_bwd_op.prim] = _transpose_into(softmax_bwd_op)
ad.primitive_transposes[log_softmax_tangent_op.prim] = _transpose_into(log_softmax_bwd_op)
ad.primitive_transposes[log_softmax_bwd_op.prim] = _transpose_into(log_softmax_tangent_op)
for _op in (softmax_bwd_op, log_softmax_tangent_op, log_softmax_bwd_op):
    ad.primitive_jvps[_op.prim] = _jvp_via_reference(_op)
    batching.primitive_batchers[_op.prim] = _pair_batcher(_op)


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


# --- kernels ------------------------------------------------------------------------------
# Row-wise Pallas kernels over the last axis, forward and backward; where a backward follows,
# ``auto`` mode takes an operator's forward and backward kernels together, where the pair
# measured faster than XLA (norms_gpu.prefer; a forward alone: norms_gpu.prefer_softmax).
softmax_op.add_kernel(Kernel.from_module("pallas_rows", _gpu, _gpu.softmax, _gpu.prefer_softmax))
log_softmax_op.add_kernel(
    Kernel.from_module("pallas_rows", _gpu, _gpu.log_softmax, _gpu.prefer_softmax)
)
softmax_bwd_op.add_kernel(Kernel.from_module("pallas_rows", _gpu, _gpu.softmax_bwd))
log_softmax_bwd_op.add_kernel(Kernel.from_module("pallas_rows", _gpu, _gpu.log_softmax_bwd))
# Their Mosaic GPU ports (named as the operators), which run where those cannot (a jax
# without Pallas' Triton backend).
for _op in (softmax_op, log_softmax_op, softmax_bwd_op, log_softmax_bwd_op):
    _op.add_kernel(
        Kernel.from_module("mosaic_rows", _mgpu, getattr(_mgpu, _op.name), _mgpu.PREFER[_op.name])
    )
