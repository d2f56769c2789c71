"""Matmul: one primitive, ``ts_matmul``, for plain and fused-epilogue matrix products.

Semantics (the contract in ``.notes/MATMUL_CONTRACT.md``)
---------------------------------------------------------
``ts_matmul(a, b, *extras)`` with static parameters ``transpose_a``, ``transpose_b``,
``out_dtype``, ``accumulate_dtype``, ``tile_shape``, ``activation``, ``has_bias``,
``has_residual`` and ``has_scale``; ``extras`` are ``bias (N,)``, ``residual`` (the
output's shape) and ``scale`` (an f32 scalar), in that order, each present only if its
flag is set::

    acc = op(a) @ op(b)                      in accumulate_dtype
    out = cast(act(scale·acc + bias) + residual, out_dtype)

``op`` transposes the last two dimensions when the flag is set: ``a`` is stored
``(..., K, M)`` with ``transpose_a``, else ``(..., M, K)``; ``b`` is ``(..., N, K)`` with
``transpose_b``, else ``(..., K, N)``. The reference expresses the flags as
``lax.dot_general`` dimension numbers, never as copies. Precision follows jax's
``jax_default_matmul_precision``, exactly as ``jnp.dot`` does, so ``ts.matmul`` is never
slower than the ``jnp.dot`` it replaces: on GPUs the default rounds f32 operands to TF32
(measured on H100: ~1e-4 relative error; ``"highest"`` runs f32 at ~52 TFLOP/s against
TF32's ~376) and lets cuBLASLt accumulate fp8 products in its fast accumulator (5e-5
relative error at K=136; ``"highest"`` costs ~6%: 863 vs 916 TFLOP/s at 8192³). Set
``jax.config.update("jax_default_matmul_precision", "highest")`` for full f32 products
(the test-suite does). The epilogue (scale, bias,
activation, residual) runs in the accumulate dtype when that is a float, else in f32
(an int8 × int8 product with an epilogue); a product without any epilogue is cast
straight from the accumulator (exact int32 for int8).

Batch dimensions: ``a`` and ``b`` have identical leading dimensions, or one of them is
2-D and shared by every batch element. Nothing else broadcasts.

Dtypes (the public functions enforce them; the primitive itself accepts any pair that
``lax.dot_general`` does, which transposes use for fp8 operands)
-------------------------------------------------------------------------------------
============================  ===============  ====================
inputs                        accumulate       default output
============================  ===============  ====================
float16, bfloat16             f32              the input dtype
float32 / float64             f32 / f64        the input dtype
fp8 e4m3 / e5m2 (any mix)     f32              f32
int8 × int8                   int32            int32 (f32 with a float epilogue)
============================  ===============  ====================

Inside ``ts.jit`` over arguments with a ``ts.accum(...)`` policy the accumulate dtype is
that policy's (:func:`tessera_jax.numerics.context.accumulate_dtype`), never narrower
than the inputs.

Adjoints
--------
The product is bilinear. Its JVP is ``ts_matmul(da, b) + ts_matmul(a, db)`` (plus the
scale, bias and residual tangents), and the transpose rule gives explicit adjoints as
``ts_matmul`` binds with transpose flags: ``dA = dC·op(B)ᵀ``, ``dB = op(A)ᵀ·dC``, so
derivatives of every order stay in the operator vocabulary. A shared (2-D) operand's
cotangent sums over the batch: folded into the contraction when that is a free reshape
(``x (…, M, K) @ W``: ``dW = x₂ᵀ·dC₂`` on the flattened rows), otherwise a batched
product in the accumulate dtype followed by ``ts.op.sum`` over the batch axes.
With an activation, the derivative recomputes the pre-activation ``z = scale·acc + bias``
with ``ts_matmul`` (in the epilogue dtype) and applies the activation with the ts
elementwise operators, whose JVPs give ``act'(z)``.

Batching: ``jax.vmap`` over any operands and ``in_axes`` moves the mapped axes to the
front and makes them a leading batch dimension (broadcasting an operand only when the
other has extra batch dimensions); a mapped bias or scale, which the fused form cannot
express, is applied by the reference epilogue after a batched ``ts_matmul``.

Kernels (``tessera_jax/pallas_kernels``) are registered in the ``# --- kernels ---``
block at the bottom with the :class:`~tessera_jax.primitives._core.Kernel` convention
``fn(a, b, *extras, interpret, **params)``.

For code that runs ``ts_matmul`` in pieces (the sharding rule of a sharded K: partial
products, a reduction, then the epilogue): :func:`split_extras` takes a bind's extras
apart (it lives with the kernels, which know nothing about primitives, and is
re-exported here) and :func:`epilogue` applies the fused epilogue to an accumulator.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tessera_jax.numerics import context as _numerics_context
from tessera_jax.numerics.dtypes import as_np_dtype
from tessera_jax.pallas_kernels import matmul_configs as _mc
from tessera_jax.pallas_kernels.matmul_configs import split_extras
from tessera_jax.primitives import elementwise as _ew
from tessera_jax.primitives import reductions as _red
from tessera_jax.primitives._core import (
    Operator,
    ad,
    as_array,
    batching,
    not_mapped,
    zero_tangent,
)

ACTIVATIONS = _mc.ACTIVATIONS

_F16 = np.dtype(np.float16)
_BF16 = np.dtype(jnp.bfloat16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_I8 = np.dtype(np.int8)
_I32 = np.dtype(np.int32)
_FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
_WIDE_FLOATS = (_F16, _BF16, _F32, _F64)
SUPPORTED_DTYPES = (*_WIDE_FLOATS, *_FP8, _I8)


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))


def _is_int(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.integer))


def epilogue_dtype(accumulate_dtype: Any) -> np.dtype:
    """The dtype the epilogue runs in: the accumulator's when a float, else f32."""
    acc = np.dtype(accumulate_dtype)
    return acc if _is_float(acc) else _F32


# --- the primitive ------------------------------------------------------------------------

matmul_op = Operator(
    "matmul",
    reference=lambda *args, **params: matmul_reference(*args, **params),
    abstract_eval=lambda *args, **params: _matmul_abstract_eval(*args, **params),
)


def _bind(
    a: jax.Array,
    b: jax.Array,
    *,
    bias: jax.Array | None = None,
    residual: jax.Array | None = None,
    scale: jax.Array | None = None,
    transpose_a: bool = False,
    transpose_b: bool = False,
    out_dtype: Any,
    accumulate_dtype: Any,
    tile_shape: tuple[int, int, int] | None = None,
    activation: str | None = None,
) -> jax.Array:
    """Binds ``ts_matmul`` with the extras given (the flags follow from which are present)."""
    extras = [x for x in (bias, residual, scale) if x is not None]
    return matmul_op.bind(
        a,
        b,
        *extras,
        transpose_a=bool(transpose_a),
        transpose_b=bool(transpose_b),
        out_dtype=np.dtype(out_dtype),
        accumulate_dtype=np.dtype(accumulate_dtype),
        tile_shape=tile_shape,
        activation=activation,
        has_bias=bias is not None,
        has_residual=residual is not None,
        has_scale=scale is not None,
    )


# --- the public functions -----------------------------------------------------------------


class _Operands(NamedTuple):
    a: jax.Array
    b: jax.Array
    scale: jax.Array | None  # the fp8 dequantization scale sa·sb (QuantizedTensor operands)
    default_out: np.dtype
    accumulate: np.dtype


def matmul(
    A: Any,
    B: Any,
    *,
    tile_shape: tuple[int, int, int] | None = None,
    out_dtype: Any = None,
) -> jax.Array:
    """Matrix product ``A @ B`` as one ``ts_matmul``, accumulating in wide precision.

    Arguments:
      A: ``(..., M, K)`` array or :class:`~tessera_jax.QuantizedTensor`. A transposed
        input (``A.T``) is just another array.
      B: ``(..., K, N)``, the same. Leading (batch) dimensions of ``A`` and ``B`` must be
        identical, or one operand must be 2-D (shared by every batch element); anything
        else is an error, never a silent broadcast. 1-D operands are refused (write
        ``x[None, :]`` for a row vector).
      tile_shape: ``(BM, BN, BK)`` for the Pallas kernels, each a positive multiple of 16
        (and within the hardware budget the kernel module checks); ``None`` lets the
        kernel choose. The reference (XLA) lowering ignores it.
      out_dtype: the output dtype (a ts dtype, numpy dtype or name). Default: the input
        dtype for float16/bfloat16/float32/float64, float32 for fp8, int32 for int8.
    Returns:
      ``(..., M, N)`` array of ``out_dtype``.

    Dtypes: float16, bfloat16, float32, float64, the fp8 formats (float8_e4m3fn and
    float8_e5m2, which may be mixed) and int8 × int8; otherwise ``A`` and ``B`` must have
    the same dtype. Accumulation: f32 for 8- and 16-bit floats, int32 for int8, else the
    input dtype, or the ``ts.accum(...)`` in force under ``ts.jit``.

    QuantizedTensor operands: per-tensor scaled fp8 values (``ts.quantize(x, ts.fp8_e4m3)``)
    are multiplied in the fp8 path with the product of the scales applied to the
    accumulator (output f32 by default); other policies are dequantized to their compute
    dtype and accumulate in their accumulate dtype.
    """
    ops = _prepare("matmul", A, B, ("A", "B"), out_dtype, epilogue=False)
    _check_shapes("matmul", ops.a, ops.b, ("A", "B"))
    tile = _check_tile_shape("matmul", tile_shape, ops.a.dtype, ops.b.dtype)
    return _bind(
        ops.a,
        ops.b,
        scale=ops.scale,
        out_dtype=ops.default_out if out_dtype is None else _out_dtype("matmul", out_dtype, ops),
        accumulate_dtype=ops.accumulate,
        tile_shape=tile,
    )


gemm = matmul


def linear(
    x: Any,
    w: Any,
    b: Any = None,
    *,
    activation: str | None = None,
    residual: Any = None,
    out_dtype: Any = None,
    tile_shape: tuple[int, int, int] | None = None,
) -> jax.Array:
    """A fused linear layer ``act(x @ w + b) + residual`` as one ``ts_matmul``.

    Arguments:
      x: ``(..., K)`` activations (a 1-D ``(K,)`` vector is allowed) or a QuantizedTensor.
        With a 2-D ``w`` the leading dimensions are flattened into rows (a free reshape),
        so the kernel sees one 2-D product.
      w: ``(K, N)`` weights (or batched ``(..., K, N)`` with ``x``'s batch dimensions), or
        a QuantizedTensor.
      b: optional bias ``(N,)`` of a float dtype, added in the accumulate dtype.
      activation: ``None``, ``"relu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``.
      residual: optional array of the output's shape, added after the activation.
      out_dtype: as :func:`matmul` (int8 operands with a bias or activation default to f32).
      tile_shape: as :func:`matmul`.
    Returns:
      ``(..., N)`` array.

    Gradients (first and higher order) flow to ``x``, ``w``, ``b`` and ``residual``; with
    an activation the backward pass recomputes the pre-activation with ``ts_matmul``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation={activation!r} must be one of {ACTIVATIONS}")
    ops = _prepare(
        "linear",
        x,
        w,
        ("x", "w"),
        out_dtype,
        epilogue=b is not None or activation is not None,
    )
    a, wt = ops.a, ops.b
    vector = a.ndim == 1  # a single example (K,)
    if vector:
        a = a[None, :]
    lead = _check_shapes("linear", a, wt, ("x", "w"))
    n = wt.shape[-1]
    out_shape = (*lead, a.shape[-2], n)
    if vector:
        out_shape = (*lead, n)
    bias = None
    if b is not None:
        bias = as_array("linear", "b", b)
        if not _is_float(bias.dtype):
            raise TypeError(f"linear: b.dtype={bias.dtype} must be a float dtype")
        if bias.shape != (n,):
            raise ValueError(f"linear: b.shape={bias.shape} must be (N,)=({n},)")
    res = None
    if residual is not None:
        res = as_array("linear", "residual", residual)
        if not (_is_float(res.dtype) or _is_int(res.dtype)):
            raise TypeError(f"linear: residual.dtype={res.dtype} must be a real dtype")
        if res.shape != out_shape:
            raise ValueError(
                f"linear: residual.shape={res.shape} must equal the output shape {out_shape}"
            )
    tile = _check_tile_shape("linear", tile_shape, a.dtype, wt.dtype)
    # Rows of a 2-D weight: flatten x's leading dimensions (row-major, free) into M.
    if wt.ndim == 2 and a.ndim > 2:
        a = a.reshape(-1, a.shape[-1])
    bind_shape = (*(a.shape[:-2] or wt.shape[:-2]), a.shape[-2], n)
    if res is not None:
        res = res.reshape(bind_shape)
    out = _bind(
        a,
        wt,
        bias=bias,
        residual=res,
        scale=ops.scale,
        out_dtype=ops.default_out if out_dtype is None else _out_dtype("linear", out_dtype, ops),
        accumulate_dtype=ops.accumulate,
        tile_shape=tile,
        activation=activation,
    )
    return out.reshape(out_shape) if out.shape != out_shape else out


def fused_mlp(
    X: Any,
    W1: Any,
    b1: Any,
    W2: Any,
    b2: Any,
    activation: str | None = "relu",
    *,
    out_dtype: Any = None,
) -> jax.Array:
    """The fused MLP of the execution-model walkthrough: ``act(X @ W1 + b1) @ W2 + b2``.

    Two fused ``ts_matmul`` calls: the first carries bias and activation in its epilogue,
    the second the output bias. The hidden activations have ``X``'s default output dtype.

    Arguments:
      X: ``(..., D)``; W1: ``(D, H)``; b1: ``(H,)``; W2: ``(H, F)``; b2: ``(F,)``.
      activation: ``"relu"`` (default), ``"gelu"``, ``"gelu_tanh"`` or ``None``.
      out_dtype: the output dtype (default: as :func:`linear`).
    Returns:
      ``(..., F)`` array.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_mlp: activation={activation!r} must be one of {ACTIVATIONS}")
    h = linear(X, W1, b1, activation=activation)
    return linear(h, W2, b2, out_dtype=out_dtype)


# --- validation ---------------------------------------------------------------------------


def _check_dtype_pair(op: str, a: jax.Array, b: jax.Array, names: tuple[str, str]) -> None:
    for x, name in zip((a, b), names):
        if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
            expected = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise TypeError(f"{op}: {name}.dtype={x.dtype} is not supported; expected {expected}")
    da, db = np.dtype(a.dtype), np.dtype(b.dtype)
    if da != db and not (da in _FP8 and db in _FP8):
        raise TypeError(
            f"{op}: {names[0]}.dtype={da} and {names[1]}.dtype={db} must be the same "
            "(only the fp8 formats float8_e4m3fn and float8_e5m2 may be mixed); cast one first"
        )


def _check_shapes(op: str, a: jax.Array, b: jax.Array, names: tuple[str, str]) -> tuple:
    """Validates ``(..., M, K) @ (..., K, N)``; returns the output's leading dimensions."""
    na, nb = names
    for x, name in zip((a, b), names):
        if x.ndim < 2:
            raise ValueError(
                f"{op}: {name}.shape={x.shape} has rank {x.ndim}; {op} takes matrices "
                f"(..., M, K) @ (..., K, N) (1-D operands are not promoted: "
                f"write x[None, :] or x[:, None])"
            )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"{op}: {na}.shape[-1]={a.shape[-1]} must equal {nb}.shape[-2]={b.shape[-2]} "
            f"({na}.shape={a.shape}, {nb}.shape={b.shape})"
        )
    la, lb = a.shape[:-2], b.shape[:-2]
    if la and lb and la != lb:
        raise ValueError(
            f"{op}: the batch dimensions of {na}.shape={a.shape} and {nb}.shape={b.shape} "
            "differ; they must be identical, or one operand must be 2-D (no broadcasting)"
        )
    return la or lb


def _check_tile_shape(op: str, tile_shape: Any, dtype_a: Any, dtype_b: Any):
    """``tile_shape`` as a tuple of 3 ints, validated; None stays None."""
    if tile_shape is None:
        return None
    ok = (
        isinstance(tile_shape, (tuple, list))
        and len(tile_shape) == 3
        and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tile_shape)
    )
    if not ok:
        raise ValueError(f"{op}: tile_shape={tile_shape!r} must be 3 ints (BM, BN, BK)")
    tile = tuple(int(t) for t in tile_shape)
    for name, t in zip(("BM", "BN", "BK"), tile):
        if t <= 0 or t % 16:
            raise ValueError(
                f"{op}: tile_shape={tile} has {name}={t}; BM, BN and BK must each be a "
                "positive multiple of 16"
            )
    for validate in _kernel_tile_validators():
        validate(tile, np.dtype(dtype_a), np.dtype(dtype_b))
    return tile


def _kernel_tile_validators():
    """``validate_tile_shape`` of every registered kernel's module that exports one."""
    seen, out = set(), []
    for k in matmul_op.kernels:
        fn = getattr(k.fn, "func", k.fn)  # a functools.partial's function
        mod = inspect.getmodule(fn)
        if mod is None or mod.__name__ in seen:
            continue
        seen.add(mod.__name__)
        if hasattr(mod, "validate_tile_shape"):
            out.append(mod.validate_tile_shape)
    return out


def _out_dtype(op: str, out_dtype: Any, ops: _Operands) -> np.dtype:
    try:
        out = as_np_dtype(out_dtype)
    except TypeError as e:
        raise TypeError(f"{op}: out_dtype={out_dtype!r}: {e}") from None
    ints_in = _is_int(ops.a.dtype)
    if not (_is_float(out) or (ints_in and out == _I32)):
        allowed = "a float dtype or int32" if ints_in else "a float dtype"
        raise TypeError(f"{op}: out_dtype={out} must be {allowed}")
    return out


def _default_accumulate(op: str, da: np.dtype, db: np.dtype) -> np.dtype:
    """Accumulation dtype of a product of ``da × db`` (see the module docstring)."""
    if _is_int(da):
        default = _I32
    elif _F64 in (da, db):
        default = _F64
    else:
        default = _F32
    ctx = _numerics_context.accumulate_dtype()
    if ctx is None:
        return default
    ctx = np.dtype(ctx)
    if _is_int(da):
        if ctx == _I32 or (_is_float(ctx) and ctx.itemsize >= 4):
            return ctx
    elif _is_float(ctx):
        # Never narrower than the inputs (an f64 product under ts.accum(ts.f32) stays f64).
        return ctx if ctx.itemsize >= max(da.itemsize, db.itemsize) else default
    raise TypeError(
        f"{op}: the accumulation dtype {ctx} in force (ts.accum) cannot accumulate "
        f"{da} × {db} products"
    )


def _prepare(
    op: str, A: Any, B: Any, names: tuple[str, str], out_dtype: Any, *, epilogue: bool
) -> _Operands:
    """Operands, dequantization scale, default output and accumulate dtypes."""
    from tessera_jax.numerics.policy import QuantizedTensor

    if isinstance(A, QuantizedTensor) or isinstance(B, QuantizedTensor):
        return _prepare_quantized(op, A, B, names)
    a = as_array(op, names[0], A)
    b = as_array(op, names[1], B)
    _check_dtype_pair(op, a, b, names)
    da, db = np.dtype(a.dtype), np.dtype(b.dtype)
    acc = _default_accumulate(op, da, db)
    if da in _FP8:
        default_out = _F32  # FP8 inputs, FP32 accumulation and output
    elif _is_int(da):
        default_out = _F32 if epilogue else _I32
    else:
        default_out = da
    return _Operands(a, b, None, default_out, acc)


def _prepare_quantized(op: str, A: Any, B: Any, names: tuple[str, str]) -> _Operands:
    """QuantizedTensor operands: the fp8 path with a scale, or dequantization."""
    from tessera_jax.numerics.policy import QuantizedTensor, fp8_scaled_values

    def plain(x, name):
        return None if isinstance(x, QuantizedTensor) else as_array(op, name, x)

    pa, pb = plain(A, names[0]), plain(B, names[1])
    fa = fp8_scaled_values(A) if pa is None else ((pa, None) if pa.dtype in _FP8 else None)
    fb = fp8_scaled_values(B) if pb is None else ((pb, None) if pb.dtype in _FP8 else None)
    specs = [x.spec for x in (A, B) if isinstance(x, QuantizedTensor)]
    accs = [s.accumulate for s in specs if s.accumulate is not None]
    if fa is not None and fb is not None:
        (a, sa), (b, sb) = fa, fb
        scales = [s.astype(_F32) for s in (sa, sb) if s is not None]
        scale = scales[0] * scales[1] if len(scales) == 2 else scales[0]
        if accs:
            acc = _widest(accs)
        else:
            acc = _default_accumulate(op, np.dtype(a.dtype), np.dtype(b.dtype))
        return _Operands(a, b, scale, _F32, acc)
    # Dequantize to the widest compute dtype of the policies; plain operands are cast to it.
    compute = _widest([s.compute for s in specs])
    arrays = []
    for x, p, name in ((A, pa, names[0]), (B, pb, names[1])):
        if p is None:
            x = x.dequantize()
        else:
            x = p
            if not _is_float(x.dtype):
                raise TypeError(
                    f"{op}: {name}.dtype={x.dtype} cannot be multiplied with a "
                    "QuantizedTensor; pass a float array"
                )
        arrays.append(x.astype(compute))
    a, b = arrays
    acc = _widest(accs) if accs else _default_accumulate(op, compute, compute)
    acc = acc if acc.itemsize >= compute.itemsize else compute
    return _Operands(a, b, None, compute, acc)


def _widest(dtypes: Sequence[Any]) -> np.dtype:
    """The widest of float dtypes (by bits; f32 beats bf16 and f16 at equal width)."""
    dts = [np.dtype(d) for d in dtypes]
    return max(dts, key=lambda d: (d.itemsize, d == _F32 or d == _F64))


# --- abstract evaluation ------------------------------------------------------------------


def _matmul_abstract_eval(
    a,
    b,
    *extras,
    transpose_a,
    transpose_b,
    out_dtype,
    accumulate_dtype,
    tile_shape,
    activation,
    has_bias,
    has_residual,
    has_scale,
):
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"ts_matmul: operands of shapes {a.shape} and {b.shape} must be ≥ 2-D")
    m, ka = (a.shape[-1], a.shape[-2]) if transpose_a else a.shape[-2:]
    kb, n = (b.shape[-1], b.shape[-2]) if transpose_b else b.shape[-2:]
    if ka != kb:
        raise ValueError(
            f"ts_matmul: contraction sizes differ: {ka} vs {kb} "
            f"({a.shape=}, {b.shape=}, {transpose_a=}, {transpose_b=})"
        )
    la, lb = a.shape[:-2], b.shape[:-2]
    if la and lb and la != lb:
        raise ValueError(f"ts_matmul: batch dimensions differ: {a.shape=}, {b.shape=}")
    shape = (*(la or lb), m, n)
    if len(extras) != has_bias + has_residual + has_scale:
        raise ValueError(f"ts_matmul: {len(extras)} extra operands for the flags set")
    bias, residual, scale = split_extras(
        extras, has_bias=has_bias, has_residual=has_residual, has_scale=has_scale
    )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"ts_matmul: bias.shape={bias.shape} must be ({n},)")
    if residual is not None and residual.shape != shape:
        raise ValueError(f"ts_matmul: residual.shape={residual.shape} must be {shape}")
    if scale is not None and scale.shape != ():
        raise ValueError(f"ts_matmul: scale.shape={scale.shape} must be ()")
    if activation not in ACTIVATIONS:
        raise ValueError(f"ts_matmul: activation={activation!r} must be one of {ACTIVATIONS}")
    return jax.core.ShapedArray(shape, np.dtype(out_dtype))


# --- lowerings: the reference (XLA) below; Pallas kernels in the block at the bottom ------

# --- batching -----------------------------------------------------------------------------


def _to_front(x: jax.Array, d: int | None) -> jax.Array:
    return x if d is not_mapped or d == 0 else jnp.moveaxis(x, d, 0)


def _conform(a, da, b, db, size):
    """``a``, ``b`` with the mapped axis as a leading batch dimension (output axis 0).

    An unmapped 2-D operand stays shared; otherwise an operand whose batch dimensions
    fall short of the other's is broadcast to ``(size, *lead)``.
    """
    a, b = _to_front(a, da), _to_front(b, db)
    la = a.shape[1:-2] if da is not not_mapped else a.shape[:-2]
    lb = b.shape[1:-2] if db is not not_mapped else b.shape[:-2]
    lead = la or lb

    def fit(x, mapped, lx):
        if not mapped and not lx:
            return x  # shared 2-D
        if mapped and lx == lead:
            return x
        core = x.shape[-2:]
        if mapped:  # (size, r, c) → (size, 1…, r, c) → broadcast
            x = x.reshape(size, *([1] * len(lead)), *core)
        return jnp.broadcast_to(x, (size, *lead, *core))

    return fit(a, da is not not_mapped, la), fit(b, db is not not_mapped, lb)


def _matmul_batch(args, dims, **params):
    a, b, *extras = args
    da, db, *dextras = dims
    bias, residual, scale = split_extras(extras, **params)
    dbias, dres, dscale = split_extras(dextras, **params)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not not_mapped)
    ta, tb = params["transpose_a"], params["transpose_b"]
    shared_product = da is not_mapped and db is not_mapped
    if not shared_product:
        a, b = _conform(a, da, b, db, size)
    m = a.shape[-1] if ta else a.shape[-2]
    n = b.shape[-2] if tb else b.shape[-1]
    out_shape = (*(a.shape[:-2] if a.ndim > 2 else b.shape[:-2]), m, n)
    mapped_bias = bias is not None and dbias is not not_mapped
    mapped_scale = scale is not None and dscale is not not_mapped
    if not (shared_product or mapped_bias or mapped_scale):
        if residual is not None:
            residual = _to_front(residual, dres)
            if dres is not_mapped:
                residual = jnp.broadcast_to(residual, out_shape)
        out = _bind(
            a,
            b,
            bias=bias,
            residual=residual,
            scale=scale,
            transpose_a=ta,
            transpose_b=tb,
            out_dtype=params["out_dtype"],
            accumulate_dtype=params["accumulate_dtype"],
            tile_shape=params["tile_shape"],
            activation=params["activation"],
        )
        return out, 0
    # A per-example bias or scale has no fused form, and a product shared by every
    # example (only extras mapped) is computed once: product, then the reference epilogue.
    acc = _bind(
        a,
        b,
        transpose_a=ta,
        transpose_b=tb,
        out_dtype=epilogue_dtype(params["accumulate_dtype"]),
        accumulate_dtype=params["accumulate_dtype"],
        tile_shape=params["tile_shape"],
    )
    if shared_product:
        acc = acc[None]  # broadcasts against the mapped extras
    rank = acc.ndim
    if bias is not None:
        bias = _to_front(bias, dbias)
        bias = bias.reshape(size, *([1] * (rank - 2)), n) if mapped_bias else bias
    if scale is not None:
        scale = _to_front(scale, dscale)
        scale = scale.reshape(size, *([1] * (rank - 1))) if mapped_scale else scale
    if residual is not None:
        residual = _to_front(residual, dres)
        if dres is not_mapped:
            residual = residual[None]
    out = epilogue(
        acc, bias, residual, scale, activation=params["activation"], out_dtype=params["out_dtype"]
    )
    if out.shape[0] != size:
        out = jnp.broadcast_to(out, (size, *out.shape[1:]))
    return out, 0


batching.primitive_batchers[matmul_op.prim] = _matmul_batch


# --- adjoints -----------------------------------------------------------------------------


def _is_zero(t: Any) -> bool:
    return type(t) is ad.Zero


def _add_all(terms: list[jax.Array]) -> jax.Array | None:
    return functools.reduce(lambda x, y: x + y, terms) if terms else None


def _bias_tangent(tbias: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A bias tangent ``(N,)`` broadcast over the output's rows."""
    t = tbias.astype(dtype)
    return jnp.broadcast_to(t.reshape(*([1] * (len(shape) - 1)), shape[-1]), shape)


def _affine_tangent(a, b, bias, scale, ta, tb, tbias, tscale, p, shape):
    """The tangent of ``scale·op(a)@op(b) + bias`` in ``p['out_dtype']`` (None: zero)."""
    terms = []
    if not _is_zero(ta):
        terms.append(_bind(ta, b, scale=scale, **p))
    if not _is_zero(tb):
        terms.append(_bind(a, tb, scale=scale, **p))
    if scale is not None and not _is_zero(tscale):
        terms.append(_bind(a, b, scale=tscale, **p))
    if bias is not None and not _is_zero(tbias):
        terms.append(_bias_tangent(tbias, shape, p["out_dtype"]))
    return _add_all(terms)


def _ts_activation(z: jax.Array, activation: str) -> jax.Array:
    """The activation with the ts elementwise operators (their JVPs give ``act'``)."""
    if activation == "relu":
        return _ew.relu(z)
    return _ew.gelu(z, approximate=activation == "gelu_tanh")


def _matmul_jvp(primals, tangents, **params):
    a, b, *extras = primals
    ta, tb, *textras = tangents
    bias, residual, scale = split_extras(extras, **params)
    tbias, tres, tscale = split_extras(textras, **params)
    out_dtype = params["out_dtype"]
    if not _is_float(out_dtype):  # an int32 product: not differentiable
        y = matmul_op.bind(*primals, **params)
        return y, zero_tangent(y)
    base = dict(
        transpose_a=params["transpose_a"],
        transpose_b=params["transpose_b"],
        accumulate_dtype=params["accumulate_dtype"],
        tile_shape=params["tile_shape"],
    )
    activation = params["activation"]
    if activation is None:
        # Affine in each of a, b, scale, bias, residual: the fused primal, tangents in out_dtype.
        y = matmul_op.bind(*primals, **params)
        p = dict(base, out_dtype=out_dtype)
        dz = _affine_tangent(a, b, bias, scale, ta, tb, tbias, tscale, p, y.shape)
        terms = [] if dz is None else [dz]
        if residual is not None and not _is_zero(tres):
            terms.append(tres.astype(out_dtype))
        dy = _add_all(terms)
        return y, zero_tangent(y) if dy is None else dy
    # With an activation: recompute the pre-activation z (epilogue dtype) with ts_matmul.
    ep = epilogue_dtype(params["accumulate_dtype"])
    p = dict(base, out_dtype=ep)
    z = _bind(a, b, bias=bias, scale=scale, **p)
    dz = _affine_tangent(a, b, bias, scale, ta, tb, tbias, tscale, p, z.shape)
    if dz is None:
        h, dh = _ts_activation(z, activation), None
    else:
        h, dh = jax.jvp(functools.partial(_ts_activation, activation=activation), (z,), (dz,))
    if residual is not None:
        h = h + residual.astype(ep)
        if not _is_zero(tres):
            dh = tres.astype(ep) if dh is None else dh + tres.astype(ep)
    y = h.astype(out_dtype)
    return y, zero_tangent(y) if dh is None else dh.astype(out_dtype)


def _cotangent_for(ct: jax.Array, other: jax.Array) -> jax.Array:
    """The cotangent in the dtype of the operand it multiplies, when that is a wide float.

    The backward product then runs at the forward's operand precision (bf16 × bf16,
    accumulating in f32); against fp8 operands the cotangent stays as it is.
    """
    od = np.dtype(other.dtype)
    if ct.dtype != od and od in _WIDE_FLOATS and _is_float(ct.dtype):
        return ct.astype(od)
    return ct


def _sum_leading(x: jax.Array, nlead: int) -> jax.Array:
    return _red.sum(x, axis=tuple(range(nlead))) if nlead else x


def _matmul_transpose(ct, a, b, *extras, **params):
    if params["has_bias"] or params["has_residual"] or params["activation"] is not None:
        raise NotImplementedError(
            "ts_matmul is linear only without bias, residual and activation; "
            "its JVP emits such products only"
        )
    _, _, scale = split_extras(extras, **params)
    ua, ub = ad.is_undefined_primal(a), ad.is_undefined_primal(b)
    us = scale is not None and ad.is_undefined_primal(scale)
    if ua + ub + us != 1:
        raise NotImplementedError("ts_matmul: transpose with respect to exactly one operand")
    lin = a if ua else (b if ub else scale)
    cts: list[Any] = [None] * (2 + len(extras))
    slot = 0 if ua else (1 if ub else len(cts) - 1)
    if _is_zero(ct):
        cts[slot] = ad.Zero(lin.aval)
        return cts
    ta, tb = params["transpose_a"], params["transpose_b"]
    acc = np.dtype(params["accumulate_dtype"])
    acc = acc if _is_float(acc) else _F32
    ep = epilogue_dtype(acc)
    nlead = ct.ndim - 2

    def mm(x, y, out, **flags_):
        return _bind(x, y, scale=scale, out_dtype=out, accumulate_dtype=acc, **flags_)

    if us:
        # d scale = Σ ct ⊙ op(a)@op(b): a scalar.
        prod = _bind(a, b, transpose_a=ta, transpose_b=tb, out_dtype=ep, accumulate_dtype=acc)
        ds = _red.sum(ct.astype(ep) * prod)
        cts[slot] = ds.astype(lin.aval.dtype)
        return cts
    if ua:
        out_dt, shared = lin.aval.dtype, lin.aval.ndim == 2 and nlead > 0
        g = _cotangent_for(ct, b)
        dt = ep if shared else out_dt
        if not ta:  # dA = ct · op(b)ᵀ
            d = mm(g, b, dt, transpose_b=not tb)
        else:  # stored (…, K, M): dAᵀ = op(b) · ctᵀ
            d = mm(b, g, dt, transpose_a=tb, transpose_b=True)
        cts[0] = _sum_leading(d, nlead).astype(out_dt) if shared else d
        return cts
    out_dt, shared = lin.aval.dtype, lin.aval.ndim == 2 and nlead > 0
    g = _cotangent_for(ct, a)
    if shared and not ta:
        # x (…, M, K) against a shared weight: fold the batch into the contraction (free).
        a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        if not tb:
            cts[1] = mm(a2, g2, out_dt, transpose_a=True)
        else:
            cts[1] = mm(g2, a2, out_dt, transpose_a=True)
        return cts
    dt = ep if shared else out_dt
    if not tb:  # dB = op(a)ᵀ · ct
        d = mm(a, g, dt, transpose_a=not ta)
    else:  # stored (…, N, K): dBᵀ = ctᵀ · op(a)
        d = mm(g, a, dt, transpose_a=True, transpose_b=ta)
    cts[1] = _sum_leading(d, nlead).astype(out_dt) if shared else d
    return cts


ad.primitive_jvps[matmul_op.prim] = _matmul_jvp
ad.primitive_transposes[matmul_op.prim] = _matmul_transpose


# --- the reference ------------------------------------------------------------------------


# XLA GPU (jax 0.11.2, H100) returns twice the true int8 × int8 → int32 product from its
# Triton GEMM fusion for some contraction sizes that are not multiples of 4 (17×33×9,
# 4×{2,3,5,6,7}×4, 8×13×8; measured 2026-11-21). Zero-padding K to a multiple of this
# sidesteps it; zeros add nothing to the product.
_INT8_K_MULTIPLE = 16


def _pad_contraction(a, b, ca, cb):
    k = a.shape[ca]
    pad = -k % _INT8_K_MULTIPLE
    if not pad:
        return a, b
    pa = [(0, 0)] * a.ndim
    pb = [(0, 0)] * b.ndim
    pa[ca], pb[cb] = (0, pad), (0, pad)
    return jnp.pad(a, pa), jnp.pad(b, pb)


def _dot(a, b, *, transpose_a, transpose_b, accumulate_dtype):
    """``op(a) @ op(b)`` with ``lax.dot_general``: the transposes are dimension numbers."""
    ca = a.ndim - 2 if transpose_a else a.ndim - 1
    cb = b.ndim - 1 if transpose_b else b.ndim - 2
    pet = np.dtype(accumulate_dtype)
    if _is_int(a.dtype) and _is_int(b.dtype):
        a, b = _pad_contraction(a, b, ca, cb)
    dot = functools.partial(lax.dot_general, preferred_element_type=pet)
    if a.ndim == b.ndim:  # identical batch dimensions (or plain 2-D)
        batch = tuple(range(a.ndim - 2))
        return dot(a, b, (((ca,), (cb,)), (batch, batch)))
    out = dot(a, b, (((ca,), (cb,)), ((), ())))
    if a.ndim == 2:  # shared a: dot_general gives (M, …, N)
        out = jnp.moveaxis(out, 0, -2)
    return out  # shared b: (…, M, N)


def epilogue(
    acc: jax.Array,
    bias: jax.Array | None = None,
    residual: jax.Array | None = None,
    scale: jax.Array | None = None,
    *,
    activation: str | None = None,
    out_dtype: Any,
) -> jax.Array:
    """``cast(act(scale·acc + bias) + residual, out_dtype)`` of an accumulator ``acc``.

    The contract's fused epilogue: it runs in :func:`epilogue_dtype` of ``acc.dtype``;
    ``bias`` broadcasts over the rows. Without bias, residual, scale and activation it is
    a plain cast straight from the accumulator (exact int32 for an int8 product).
    """
    if bias is None and residual is None and scale is None and activation is None:
        return acc.astype(out_dtype)
    ep = epilogue_dtype(acc.dtype)
    z = acc.astype(ep)
    if scale is not None:
        z = z * scale.astype(ep)
    if bias is not None:
        z = z + bias.astype(ep).reshape(*([1] * (z.ndim - bias.ndim)), *bias.shape)
    z = _mc.apply_activation(z, activation)
    if residual is not None:
        z = z + residual.astype(ep)
    return z.astype(out_dtype)


def matmul_reference(
    a: jax.Array,
    b: jax.Array,
    *extras: jax.Array,
    transpose_a: bool,
    transpose_b: bool,
    out_dtype: Any,
    accumulate_dtype: Any,
    tile_shape: tuple[int, int, int] | None = None,
    activation: str | None = None,
    has_bias: bool = False,
    has_residual: bool = False,
    has_scale: bool = False,
) -> jax.Array:
    """The XLA lowering of ``ts_matmul`` and the oracle of its kernels (``tile_shape`` unused)."""
    del tile_shape
    bias, residual, scale = split_extras(
        extras, has_bias=has_bias, has_residual=has_residual, has_scale=has_scale
    )
    plain = not (has_bias or has_residual or has_scale) and activation is None
    out_dtype = np.dtype(out_dtype)
    if plain and out_dtype in (_F16, _BF16) and a.dtype == b.dtype == out_dtype:
        # Ask XLA for the 16-bit result, as jnp.dot does: cuBLAS still accumulates in f32,
        # but writes C once in 16 bits instead of an f32 C plus a convert pass (measured on
        # H100: the f32 detour ran 0.74-0.96x jnp.dot; benchmarks/NOTES-matmul.md).
        accumulate_dtype = out_dtype
    acc = _dot(
        a, b, transpose_a=transpose_a, transpose_b=transpose_b, accumulate_dtype=accumulate_dtype
    )
    return epilogue(acc, bias, residual, scale, activation=activation, out_dtype=out_dtype)


# --- kernels ------------------------------------------------------------------------------
# (helper D) The Hopper Mosaic GPU kernel first (sm_90 only; ``prefer`` routes a case to it in
# ``auto`` mode only where it measured at least as fast as cuBLAS), then the portable
# BlockSpec kernel for other GPUs (never preferred over cuBLAS; runs under ``pallas``).
# ``interpret`` mode takes the first kernel that supports the case, on any platform.
from tessera_jax.pallas_kernels import matmul_mgpu as _mgpu  # noqa: E402
from tessera_jax.pallas_kernels import matmul_portable as _portable  # noqa: E402
from tessera_jax.primitives._core import Kernel as _Kernel  # noqa: E402

matmul_op.add_kernel(_Kernel("mosaic_gpu", _mgpu.matmul, _mgpu.supports, ("cuda",), _mgpu.prefer))
matmul_op.add_kernel(
    _Kernel("pallas_portable", _portable.matmul, _portable.supports, ("cuda",), _portable.prefer)
)
