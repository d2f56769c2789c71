"""Normalisations over the last axis: rmsnorm, rmsnorm_safe, layernorm.

With ``D = x.shape[-1]``, ``mean`` over the last axis and ``r = 1/sqrt(· + eps)``::

    rmsnorm:    y = x · r(mean(x²)) · weight
    layernorm:  y = (x − mean(x)) · r(mean((x − mean(x))²)) · weight + bias

Numerics: statistics (means, variance, ``r``) are computed in f32 for 8- and
16-bit inputs (in the input dtype otherwise) and the output is rounded once to
``x.dtype``. ``weight``/``bias`` may have another floating dtype than ``x`` (f32
parameters with bf16 activations); they are applied in the compute dtype.

Two primitives, ``ts_rmsnorm`` and ``ts_layernorm``: operands ``(x, [weight],
[bias])`` with static ``eps``, ``has_weight`` (and ``has_bias``). The public
functions take ``weight``/``bias`` of shape ``(D,)``; the primitives accept any
shape that broadcasts against ``x`` with last dimension ``D`` (what the batching
rules produce for a vmapped weight). ``rmsnorm`` and ``rmsnorm_safe`` share
``ts_rmsnorm``, which guards ``mean(x²) + eps == 0`` (an all-zero row with
``eps=0``): ``r`` is 0 there, so the row's output and gradients are 0.

Non-finite rows: a row holding a NaN or ±inf comes out all NaN (never zeros); a
finite row whose squares overflow the compute dtype is normalised exactly, by
taking its statistics on the row scaled by a power of two (see ``_normalise``).

Adjoints: JVP rules with explicit formulas in jax.numpy (``x̂ = x·r``)::

    rmsnorm:    dy = w·r·(dx − x̂·mean(x̂·dx)) + x̂·dw
    layernorm:  dy = w·r·(dc − x̂·mean(x̂·dc)) + x̂·dw + db,   dc = dx − mean(dx)

bound as ``ts_<op>_tangent(x, [w], tx, [tw], [tb])``, a primitive linear in the
tangents, whose transpose (reverse mode) binds ``ts_<op>_bwd(x, [w], ct) -> (dx,
[dw], [db])``: the backward reads x and the cotangent once and recomputes the
statistics, so reverse mode saves only x and the parameters. The references of
both are the formulas above in jax.numpy, through which derivatives of any
order and vmap of these adjoint primitives go.

Kernels (``pallas_kernels/norms_gpu.py``, registered at the bottom): ``fn(spec,
x, [weight], [bias], *, interpret)`` for the forward and ``fn(spec, x, [weight],
ct, *, interpret)`` for the backward, ``spec`` the frozen bind parameters; their
``supports`` declines weights that are not ``(D,)`` (a vmapped weight). ``ts_rmsnorm`` and
``ts_layernorm`` bound by their JVP rules carry ``differentiated=True``: a backward
follows, and ``auto`` mode takes the forward kernel only beside the backward kernel
(``norms_gpu.ForwardPreference``).
"""

from __future__ import annotations

import functools
import math

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
    explicit_sharding,
    move_bdim_to_front,
    not_mapped,
)

_FLOATING = (jnp.floating,)


def _like_x(p: jax.Array, x: jax.Array, c) -> jax.Array:
    """A weight/bias (or its tangent) in dtype ``c`` with ``x``'s rank (explicit rank promotion)."""
    return p.astype(c).reshape((1,) * (x.ndim - p.ndim) + p.shape)


def _mean(x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=-1, keepdims=True)


def _rsqrt_guarded(s: jax.Array) -> jax.Array:
    """``1/sqrt(s)``, and 0 where ``s == 0`` (the inner where keeps every derivative finite).

    Only an exact zero is guarded: a NaN ``s`` (a NaN in the row) stays NaN, so the
    whole row comes out NaN instead of zeros.
    """
    zero = s == 0
    return jnp.where(zero, jnp.zeros_like(s), jax.lax.rsqrt(jnp.where(zero, jnp.ones_like(s), s)))


# A power of two that brings any finite f32 row's squares into range (|x|·2⁻¹⁰⁰ < 2.7e8)
# while keeping the row's largest element normal.
_OVERFLOW_SCALE = 2.0**-100


def _normalise(v: jax.Array, eps: float, guard_zero: bool) -> tuple[jax.Array, jax.Array]:
    """``(v·r, r)`` with ``r = 1/sqrt(mean(v²) + eps)`` over the last axis.

    When ``mean(v²)`` overflows (elements above ~1.8e19 in f32), the mean square is taken
    of ``v·c`` with ``c = 2⁻¹⁰⁰`` (exact) and ``v·r = (v·rs)·c`` with ``rs = 1/sqrt(mean((v·c)²)
    + eps·c²)``: in range, where ``v·0`` would give a plausible 0. Scaling by ``c`` rather
    than dividing by the row maximum keeps every intermediate normal (a subnormal
    reciprocal is flushed to zero on CPUs and GPUs). A row holding ±inf (or NaN) gives NaN.

    Two forms with the same bits: on the CPU the second mean square is of ``v`` times the
    row's scale (1, or ``c`` where the first overflowed), and one select picks the output;
    XLA's CPU backend ran the other form, both mean squares of every row and a select for
    each of ``v·r`` and ``r``, slower in the forward (benchmarks/archive/norms-cpu-probe.txt).
    Elsewhere the two mean squares stay independent, so that one fused reduction may read
    ``v`` once for both.
    """
    rsqrt = _rsqrt_guarded if guard_zero else jax.lax.rsqrt
    forms = (_normalise_row_scale, _normalise_select)
    cpu, default = (functools.partial(f, eps=eps, rsqrt=rsqrt) for f in forms)
    return jax.lax.platform_dependent(v, cpu=cpu, default=default)


def _normalise_select(v: jax.Array, *, eps: float, rsqrt) -> tuple[jax.Array, jax.Array]:
    s = _mean(v * v) + eps
    big = jnp.isinf(s)
    c = np.asarray(_OVERFLOW_SCALE, v.dtype)
    vc = v * c
    sc = _mean(vc * vc) + eps * c * c  # inf only for a row holding ±inf: make it NaN
    sc = jnp.where(jnp.isinf(sc), jnp.full_like(sc, jnp.nan), sc)
    rs = rsqrt(jnp.where(big, sc, jnp.ones_like(s)))
    r = rsqrt(jnp.where(big, jnp.ones_like(s), s))
    return jnp.where(big, (v * rs) * c, v * r), jnp.where(big, rs * c, r)


def _normalise_row_scale(v: jax.Array, *, eps: float, rsqrt) -> tuple[jax.Array, jax.Array]:
    s = _mean(v * v) + eps
    big = jnp.isinf(s)
    c = np.asarray(_OVERFLOW_SCALE, v.dtype)
    cs = jnp.where(big, c, np.asarray(1.0, v.dtype))
    vc = v * cs  # v itself where cs = 1, so sc = s there
    sc = _mean(vc * vc) + eps * cs * cs
    sc = jnp.where(jnp.isinf(sc), jnp.full_like(sc, jnp.nan), sc)
    rs = rsqrt(sc)
    return jnp.where(big, (v * rs) * c, v * rs), rs * cs


def _rms_stats(xc: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """``(x̂, r)`` of rmsnorm for ``xc`` in the compute dtype."""
    return _normalise(xc, eps, guard_zero=True)


def _ln_stats(xc: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """``(x̂, r)`` of layernorm for ``xc`` in the compute dtype (two-pass variance)."""
    return _normalise(xc - _mean(xc), eps, guard_zero=False)


def _split(rest, has_weight: bool, has_bias: bool):
    rest = list(rest)
    w = rest.pop(0) if has_weight else None
    b = rest.pop(0) if has_bias else None
    return w, b


def _nonzero(t) -> bool:
    """Whether a tangent (None for an absent operand) is not a symbolic zero."""
    return t is not None and type(t) is not ad.Zero


def _total(terms: list[jax.Array], x: jax.Array, c) -> jax.Array:
    """The sum of the JVP's tangent terms (zeros if every tangent was symbolic zero)."""
    return sum(terms[1:], terms[0]) if terms else jnp.zeros(x.shape, c)


def _affine(xhat, x, w, b, c):
    y = xhat if w is None else xhat * _like_x(w, x, c)
    return y if b is None else y + _like_x(b, x, c)


# --- rmsnorm ------------------------------------------------------------------------------


def rmsnorm_reference(x, *rest, eps, has_weight, differentiated=False):
    """The XLA lowering of ``ts_rmsnorm`` (and the test oracle of its kernels)."""
    del differentiated  # (auto mode's kernel choice)
    c = compute_dtype(x.dtype)
    w, _ = _split(rest, has_weight, False)
    xhat, _ = _rms_stats(x.astype(c), eps)
    return _affine(xhat, x, w, None, c).astype(x.dtype)


rmsnorm_op = Operator("rmsnorm", reference=rmsnorm_reference, abstract_eval=lambda x, *_, **__: x)


def _rmsnorm_jvp(primals, tangents, *, eps, has_weight, differentiated=False):
    del differentiated
    x, *rest = primals
    tx, *trest = tangents
    w, _ = _split(rest, has_weight, False)
    tw, _ = _split(trest, has_weight, False)
    y = rmsnorm_op.bind(*primals, eps=eps, has_weight=has_weight, differentiated=True)
    if not _nonzero(tx):  # x is not differentiated: only x̂·tw, in jax.numpy
        return y, _param_tangents(x, _rms_stats, eps, tw, None, y.dtype)
    params = [w] if has_weight else []
    tparams = [ad.instantiate_zeros(tw)] if has_weight else []
    ty = rmsnorm_tangent_op.bind(x, *params, tx, *tparams, eps=eps, has_weight=has_weight)
    return y, ty


def _param_tangents(x, stats, eps, tw, tb, dtype):
    """``x̂·tw + tb`` (the terms of the weight and bias tangents) in ``dtype``."""
    c = compute_dtype(x.dtype)
    terms = []
    if _nonzero(tw):
        terms.append(stats(x.astype(c), eps)[0] * _like_x(tw, x, c))
    if _nonzero(tb):
        terms.append(jnp.broadcast_to(_like_x(tb, x, c), x.shape))
    return _total(terms, x, c).astype(dtype)


ad.primitive_jvps[rmsnorm_op.prim] = _rmsnorm_jvp


# --- layernorm ----------------------------------------------------------------------------


def layernorm_reference(x, *rest, eps, has_weight, has_bias, differentiated=False):
    """The XLA lowering of ``ts_layernorm`` (and the test oracle of its kernels)."""
    del differentiated  # (auto mode's kernel choice)
    c = compute_dtype(x.dtype)
    w, b = _split(rest, has_weight, has_bias)
    xhat, _ = _ln_stats(x.astype(c), eps)
    return _affine(xhat, x, w, b, c).astype(x.dtype)


layernorm_op = Operator(
    "layernorm", reference=layernorm_reference, abstract_eval=lambda x, *_, **__: x
)


def _layernorm_jvp(primals, tangents, *, eps, has_weight, has_bias, differentiated=False):
    del differentiated
    x, *rest = primals
    tx, *trest = tangents
    w, _ = _split(rest, has_weight, has_bias)
    tw, tb = _split(trest, has_weight, has_bias)
    y = layernorm_op.bind(
        *primals, eps=eps, has_weight=has_weight, has_bias=has_bias, differentiated=True
    )
    if not _nonzero(tx):  # x is not differentiated: only x̂·tw + tb, in jax.numpy
        return y, _param_tangents(x, _ln_stats, eps, tw, tb, y.dtype)
    params = [w] if has_weight else []
    tparams = [ad.instantiate_zeros(t) for t, h in ((tw, has_weight), (tb, has_bias)) if h]
    ty = layernorm_tangent_op.bind(
        x, *params, tx, *tparams, eps=eps, has_weight=has_weight, has_bias=has_bias
    )
    return y, ty


ad.primitive_jvps[layernorm_op.prim] = _layernorm_jvp


# --- the adjoints: tangent and backward primitives -----------------------------------------
# The JVP of ``ts_rmsnorm`` / ``ts_layernorm`` is ``ts_<op>_tangent(x, [w], tx, [tw], [tb])``,
# linear in the tangents; its transpose binds ``ts_<op>_bwd(x, [w], ct) -> (dx, [dw], [db])``,
# which reads x and the cotangent once and recomputes the statistics (the kernels do it in one
# pass), so reverse mode saves only x and w. Both primitives' references are the formulas
# above in jax.numpy; their own JVPs and batching go through those references, which keeps
# derivatives of any order and vmap exact.


def _reduce_to(v: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``v`` summed over the dimensions along which a parameter of ``shape`` broadcasts."""
    full = (1,) * (v.ndim - len(shape)) + tuple(shape)
    axes = tuple(i for i, (p, n) in enumerate(zip(full, v.shape)) if p == 1 and n != 1)
    return jnp.sum(v, axis=axes).reshape(shape)


def _split_tangent(rest, has_weight: bool, has_bias: bool):
    """``(w, tx, tw, tb)`` from a tangent primitive's operands after x."""
    rest = list(rest)
    w = rest.pop(0) if has_weight else None
    tx = rest.pop(0)
    tw, tb = _split(rest, has_weight, has_bias)
    return w, tx, tw, tb


def _tangent_reference(stats, centre: bool):
    def reference(x, *rest, eps, has_weight, has_bias=False):
        w, tx, tw, tb = _split_tangent(rest, has_weight, has_bias)
        c = compute_dtype(x.dtype)
        xhat, r = stats(x.astype(c), eps)
        txc = tx.astype(c)
        if centre:
            txc = txc - _mean(txc)
        d = r * (txc - xhat * _mean(xhat * txc))
        terms = [d if w is None else d * _like_x(w, x, c)]
        if tw is not None:
            terms.append(xhat * _like_x(tw, x, c))
        if tb is not None:
            terms.append(jnp.broadcast_to(_like_x(tb, x, c), x.shape))
        return _total(terms, x, c).astype(x.dtype)

    return reference


def _bwd_reference(stats, centre: bool):
    def reference(x, *rest, eps, has_weight, weight_grad_shape, bias_grad_shape=None):
        *w, ct = rest
        w = w[0] if has_weight else None
        c = compute_dtype(x.dtype)
        xhat, r = stats(x.astype(c), eps)
        ctc = ct.astype(c)
        g = ctc if w is None else ctc * _like_x(w, x, c)
        u = g - xhat * _mean(xhat * g)
        if centre:  # the transpose of the centring x − mean(x)
            u = u - _mean(u)
        outs = [(r * u).astype(x.dtype)]
        if weight_grad_shape is not None:
            outs.append(_reduce_to(ctc * xhat, weight_grad_shape))
        if bias_grad_shape is not None:
            outs.append(_reduce_to(ctc, bias_grad_shape))
        return outs

    return reference


def _bwd_abstract_eval(x, *_, weight_grad_shape, bias_grad_shape=None, **__):
    c = compute_dtype(x.dtype)
    shapes = [s for s in (weight_grad_shape, bias_grad_shape) if s is not None]
    return [x, *(jax.core.ShapedArray(s, c) for s in shapes)]


rmsnorm_tangent_reference = _tangent_reference(_rms_stats, centre=False)
rmsnorm_bwd_reference = _bwd_reference(_rms_stats, centre=False)
layernorm_tangent_reference = _tangent_reference(_ln_stats, centre=True)
layernorm_bwd_reference = _bwd_reference(_ln_stats, centre=True)

rmsnorm_tangent_op = Operator(
    "rmsnorm_tangent", reference=rmsnorm_tangent_reference, abstract_eval=lambda x, *_, **__: x
)
layernorm_tangent_op = Operator(
    "layernorm_tangent",
    reference=layernorm_tangent_reference,
    abstract_eval=lambda x, *_, **__: x,
)
rmsnorm_bwd_op = Operator(
    "rmsnorm_bwd",
    reference=rmsnorm_bwd_reference,
    abstract_eval=_bwd_abstract_eval,
    multiple_results=True,
)
layernorm_bwd_op = Operator(
    "layernorm_bwd",
    reference=layernorm_bwd_reference,
    abstract_eval=_bwd_abstract_eval,
    multiple_results=True,
)


def _tangent_transpose(bwd_op: Operator):
    """``ct ↦ (dx, [dw], [db])`` for the tangents that are being transposed."""

    def rule(ct, x, *rest, eps, has_weight, has_bias=False):
        w, tx, tw, tb = _split_tangent(rest, has_weight, has_bias)
        lin = [tx] + [t for t, h in ((tw, has_weight), (tb, has_bias)) if h]
        nonlin = [None] * (1 + has_weight)
        if type(ct) is ad.Zero:
            return [*nonlin, *(None for _ in lin)]
        want_w = has_weight and ad.is_undefined_primal(tw)
        want_b = has_bias and ad.is_undefined_primal(tb)
        params = dict(
            eps=eps, has_weight=has_weight, weight_grad_shape=tw.aval.shape if want_w else None
        )
        if bwd_op is layernorm_bwd_op:
            params["bias_grad_shape"] = tb.aval.shape if want_b else None
        dx, *grads = bwd_op.bind(x, *([w] if has_weight else []), ct, **params)
        out = [dx if ad.is_undefined_primal(tx) else None]
        for t, h, want in ((tw, has_weight, want_w), (tb, has_bias, want_b)):
            if h:
                out.append(_as_cotangent(grads.pop(0), t.aval) if want else None)
        return [*nonlin, *out]

    return rule


def _as_cotangent(g: jax.Array, aval) -> jax.Array:
    """A parameter's f32 gradient as the cotangent of ``aval``: its dtype and, on a mesh
    with Explicit axes, its sharding (the column sums keep x's sharding of D)."""
    g = g.astype(aval.dtype)
    want = explicit_sharding(aval)
    return g if want is None or jax.typeof(g).sharding == want else jax.sharding.reshard(g, want)


def _jvp_via_reference(op: Operator):
    """The JVP of a tangent/backward primitive: its jax.numpy reference's (higher orders)."""

    def rule(primals, tangents, **params):
        tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
        return jax.jvp(functools.partial(op.reference, **params), tuple(primals), tangents)

    return rule


def _batch_via_reference(op: Operator):
    """vmap of a tangent/backward primitive: its reference, vmapped."""

    def rule(args, dims, **params):
        out = jax.vmap(functools.partial(op.reference, **params), in_axes=dims)(*args)
        return out, ([0] * len(out) if op.prim.multiple_results else 0)

    return rule


ad.primitive_transposes[rmsnorm_tangent_op.prim] = _tangent_transpose(rmsnorm_bwd_op)
ad.primitive_transposes[layernorm_tangent_op.prim] = _tangent_transpose(layernorm_bwd_op)
for _op in (rmsnorm_tangent_op, layernorm_tangent_op, rmsnorm_bwd_op, layernorm_bwd_op):
    ad.primitive_jvps[_op.prim] = _jvp_via_reference(_op)
    batching.primitive_batchers[_op.prim] = _batch_via_reference(_op)


# --- batching -----------------------------------------------------------------------------


def _norm_batcher(op: Operator):
    """vmap over any operand: x's batch dim goes first; a batched weight/bias becomes
    ``(N, 1, …, 1, D)``, which the primitive broadcasts against x."""

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
        x = move_bdim_to_front(args[0], dims[0], size)
        rest = []
        for p, d in zip(args[1:], dims[1:]):
            if d is not_mapped:
                rest.append(p)
            else:
                p = jnp.moveaxis(p, d, 0)
                rest.append(p.reshape((size,) + (1,) * (x.ndim - p.ndim) + p.shape[1:]))
        return op.bind(x, *rest, **params), 0

    return rule


batching.primitive_batchers[rmsnorm_op.prim] = _norm_batcher(rmsnorm_op)
batching.primitive_batchers[layernorm_op.prim] = _norm_batcher(layernorm_op)


# --- public functions ---------------------------------------------------------------------


def _check_eps(name: str, eps, *, allow_zero: bool) -> float:
    ok = isinstance(eps, (int, float, np.integer, np.floating)) and not isinstance(eps, bool)
    if not ok:
        raise TypeError(f"{name}: eps={eps!r} must be a Python float")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0 or (eps == 0 and not allow_zero):
        need = "a finite float ≥ 0" if allow_zero else "a finite float > 0"
        raise ValueError(f"{name}: eps={eps} must be {need}")
    return eps


def _check_x(name: str, x) -> jax.Array:
    x = as_array(name, "x", x)
    check_dtype(name, "x", x, _FLOATING)
    if x.ndim == 0:
        raise ValueError(f"{name}: x must have at least one dimension, got a scalar")
    return x


def _check_param(name: str, arg: str, p, x: jax.Array) -> jax.Array | None:
    if p is None:
        return None
    p = as_array(name, arg, p)
    check_dtype(name, arg, p, _FLOATING)
    if p.shape != x.shape[-1:]:
        raise ValueError(
            f"{name}: {arg}.shape={p.shape} must be (D,) = {x.shape[-1:]}, the last dimension "
            f"of x.shape={x.shape}"
        )
    return p


def _rms(name, x, weight, eps, allow_zero_eps):
    x = _check_x(name, x)
    weight = _check_param(name, "weight", weight, x)
    eps = _check_eps(name, eps, allow_zero=allow_zero_eps)
    operands = (x,) if weight is None else (x, weight)
    return rmsnorm_op.bind(*operands, eps=eps, has_weight=weight is not None)


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Root-mean-square normalisation over the last axis: ``x / sqrt(mean(x²) + eps) · weight``.

    Arguments:
      x: a floating array ``(..., D)``.
      weight: the scale, shape ``(D,)``, any floating dtype.
      eps: a finite float > 0 added to the mean square.
    Returns:
      An array of ``x``'s shape and dtype. Statistics in f32 for 8-/16-bit inputs.
    """
    if weight is None:
        raise TypeError("rmsnorm: weight is required (use rmsnorm_safe for no weight)")
    return _rms("rmsnorm", x, weight, eps, False)


def rmsnorm_safe(x: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """rmsnorm with an optional ``weight`` that is safe on all-zero rows for any ``eps ≥ 0``.

    Statistics are always at least f32. A row whose ``mean(x²) + eps`` is 0 (an
    all-zero row with ``eps=0``) gives zeros with zero gradients instead of NaN;
    with ``eps > 0`` this is ``rmsnorm`` exactly (the same ``ts_rmsnorm`` primitive).

    Arguments:
      x: a floating array ``(..., D)``.
      weight: None (no scale) or the scale, shape ``(D,)``.
      eps: a finite float ≥ 0.
    """
    return _rms("rmsnorm_safe", x, weight, eps, True)


def layernorm(
    x: jax.Array,
    weight: jax.Array | None,
    bias: jax.Array | None,
    eps: float = 1e-5,
) -> jax.Array:
    """Layer normalisation over the last axis: ``(x − μ) / sqrt(σ² + eps) · weight + bias``.

    Arguments:
      x: a floating array ``(..., D)``.
      weight: the scale, shape ``(D,)``, or None for none.
      bias: the shift, shape ``(D,)``, or None for none.
      eps: a finite float > 0 added to the variance.
    Returns:
      An array of ``x``'s shape and dtype. Mean and (two-pass) variance in f32
      for 8-/16-bit inputs.
    """
    x = _check_x("layernorm", x)
    weight = _check_param("layernorm", "weight", weight, x)
    bias = _check_param("layernorm", "bias", bias, x)
    eps = _check_eps("layernorm", eps, allow_zero=False)
    operands = [x] + [p for p in (weight, bias) if p is not None]
    return layernorm_op.bind(
        *operands, eps=eps, has_weight=weight is not None, has_bias=bias is not None
    )


# --- kernels ------------------------------------------------------------------------------
# Row-wise Pallas kernels (one read of x, one write of y; statistics in f32), forward and
# backward; where a backward follows, ``auto`` mode takes an operator's forward and backward
# kernels together, where the pair measured faster (norms_gpu.prefer, prefer_rmsnorm_bwd).
rmsnorm_op.add_kernel(Kernel.from_module("pallas_rows", _gpu, _gpu.rmsnorm, _gpu.prefer_rmsnorm))
layernorm_op.add_kernel(
    Kernel.from_module("pallas_rows", _gpu, _gpu.layernorm, _gpu.prefer_layernorm)
)
rmsnorm_bwd_op.add_kernel(
    Kernel.from_module("pallas_rows", _gpu, _gpu.rmsnorm_bwd, _gpu.prefer_rmsnorm_bwd)
)
layernorm_bwd_op.add_kernel(Kernel.from_module("pallas_rows", _gpu, _gpu.layernorm_bwd))
# Their Mosaic GPU ports (named as the operators), which run where those cannot (a jax
# without Pallas' Triton backend).
for _op in (rmsnorm_op, layernorm_op, rmsnorm_bwd_op, layernorm_bwd_op):
    _op.add_kernel(
        Kernel.from_module("mosaic_rows", _mgpu, getattr(_mgpu, _op.name), _mgpu.PREFER[_op.name])
    )
