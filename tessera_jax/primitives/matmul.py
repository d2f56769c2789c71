"""Matmul: one primitive, ``ts_matmul``, for plain and fused-epilogue matrix products.

The contract
------------
``ts_matmul(a, b, *extras, spec=MatmulSpec(...))`` binds one static parameter, the frozen
:class:`~tessera_jax.contracts.matmul.MatmulSpec` (transposes, output and accumulate
dtypes, activation, tile shape, which of bias / residual / scale follow ``a`` and ``b``)::

    acc = op(a) @ op(b)                      in spec.accumulate_dtype
    out = cast(act(scale·acc + bias) + residual, spec.out_dtype)

:mod:`tessera_jax.contracts.matmul` owns that contract and its epilogue; this module builds
the spec once per bind, and everything downstream (abstract eval, batching, adjoints, the
reference, the sharding rule, the kernels) reads the spec, never raw parameters. The
reference expresses the transposes as ``lax.dot_general`` dimension numbers, never as
copies. Precision follows jax's ``jax_default_matmul_precision``, exactly as ``jnp.dot``
does, so ``ts.matmul`` is never slower than the ``jnp.dot`` it replaces: on GPUs the
default rounds f32 operands to TF32 and lets cuBLASLt accumulate fp8 products in its fast
accumulator. Set ``jax.config.update("jax_default_matmul_precision", "highest")`` for full
f32 products (the test-suite does).

Batch dimensions of the primitive: ``a`` and ``b`` have identical leading dimensions, or
one of them is 2-D and shared by every batch element. The public functions broadcast the
batch dimensions of their arguments (numpy rules, as ``jnp.matmul``) down to that form.

Dtypes (the public functions enforce them; the primitive itself accepts any pair that
``lax.dot_general`` does, which transposes use for fp8 operands)
-------------------------------------------------------------------------------------
============================  ===============  ====================
operands                      accumulate       default output
============================  ===============  ====================
float16, bfloat16             f32              the operand dtype
float32 / float64             f32 / f64        the operand dtype
two different wide floats     as promoted      ``jnp.promote_types``
fp8 e4m3 / e5m2 (any mix)     f32              f32
int8 × int8                   int32            int32 (f32 with a float epilogue)
============================  ===============  ====================

Two different wide floats (f16, bf16, f32, f64: an f32 parameter against bf16
activations, as Flax models mix them) are both cast to ``jnp.promote_types`` of the pair
first, as ``jnp.matmul`` does (f32 × bf16 and f16 × bf16 run as f32 × f32), and under
``jax_numpy_dtype_promotion='strict'`` refused, as ``jnp.matmul`` refuses them; gradients
come back in each operand's own dtype. An fp8 operand multiplies only with fp8, and int8 only
with int8: ``jnp.matmul`` would silently run those in a wide float, which defeats the
narrow format. Inside ``ts.jit`` over arguments with a ``ts.accum(...)`` policy the
accumulate dtype is that policy's (:func:`tessera_jax.numerics.context.accumulate_dtype`),
never narrower than the operands.

Adjoints
--------
The product is bilinear. Its JVP is ``ts_matmul(da, b) + ts_matmul(a, db)`` (plus the
scale, bias and residual tangents), and the transpose rule gives explicit adjoints as
``ts_matmul`` binds with transpose flags: ``dA = dC·op(B)ᵀ``, ``dB = op(A)ᵀ·dC``, so
derivatives of every order stay in the operator vocabulary. A shared (2-D) operand's
cotangent sums over the batch: folded into the contraction when that is a free reshape
(``x (…, M, K) @ W``: ``dW = x₂ᵀ·dC₂`` on the flattened rows), otherwise a batched
product in the accumulate dtype followed by ``ts.op.sum`` over the batch axes.
With an activation, the differentiated forward is the two-output form
``ts_matmul_with_derivative`` (defined below ``ts_matmul``'s reference): one product
writes y, with the bits of the undifferentiated forward, and ``act'(z)`` at the
pre-activation ``z = scale·acc + bias`` in the output dtype (bf16 for a bf16 layer); the
backward multiplies that saved derivative into the cotangent. Its own JVP (second and
higher derivatives) recomputes ``z`` with ``ts_matmul`` in the epilogue dtype.

Batching: ``jax.vmap`` over any operands and ``in_axes`` moves the mapped axes to the
front and makes them a leading batch dimension (broadcasting an operand only when the
other has extra batch dimensions); a mapped bias or scale, which the fused form cannot
express, is applied by the contract's epilogue after a batched ``ts_matmul``.

Kernels (``tessera_jax/pallas_kernels``) are registered at the bottom as
:class:`~tessera_jax.primitives._core.Kernel` records: ``fn(spec, a, b, *extras,
interpret)``, ``supports(spec, avals)`` and ``prefer(spec, avals)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tessera_jax import autotune
from tessera_jax._config import get_kernel_mode, kernel_mode
from tessera_jax.contracts.matmul import (
    ACTIVATIONS,
    MatmulSpec,
    activation_derivative,
    epilogue,
    epilogue_dtype,
    epilogue_with_derivative,
)
from tessera_jax.numerics import context as _numerics_context
from tessera_jax.numerics.dtypes import FP8_DTYPES, as_np_dtype
from tessera_jax.numerics.policy import QuantizedTensor, fp8_scaled_values
from tessera_jax.pallas_kernels import matmul_configs as _mc
from tessera_jax.pallas_kernels import matmul_mgpu as _mgpu
from tessera_jax.pallas_kernels import matmul_portable as _portable
from tessera_jax.primitives import elementwise as _ew
from tessera_jax.primitives import reductions as _red
from tessera_jax.primitives._core import (
    Kernel,
    Operator,
    ad,
    as_array,
    batching,
    explicit_sharding,
    is_float,
    not_mapped,
    zero_tangent,
)

_F16 = np.dtype(np.float16)
_BF16 = np.dtype(jnp.bfloat16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_I8 = np.dtype(np.int8)
_I32 = np.dtype(np.int32)
_WIDE_FLOATS = (_F16, _BF16, _F32, _F64)
SUPPORTED_DTYPES = (*_WIDE_FLOATS, *FP8_DTYPES, _I8)


def _is_int(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.integer))


# --- the primitive ------------------------------------------------------------------------

matmul_op = Operator(
    "matmul",
    reference=lambda *args, **params: matmul_reference(*args, **params),
    abstract_eval=lambda *args, **params: _matmul_abstract_eval(*args, **params),
    spec=lambda params: params["spec"],
)


def _bind(
    a: jax.Array,
    b: jax.Array,
    spec: MatmulSpec,
    *,
    bias: jax.Array | None = None,
    residual: jax.Array | None = None,
    scale: jax.Array | None = None,
    op: Operator = matmul_op,
) -> Any:
    """Binds ``ts_matmul`` (or ``op``, its two-output form) with the extras given (the
    spec's flags follow from which are present)."""
    spec = spec.replace(
        has_bias=bias is not None, has_residual=residual is not None, has_scale=scale is not None
    )
    extras = [x for x in (bias, residual, scale) if x is not None]
    return op.bind(a, b, *extras, spec=spec)


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

    Shapes follow ``jnp.matmul``.

    Arguments:
      A: ``(..., M, K)`` array or :class:`~tessera_jax.QuantizedTensor`; a 1-D ``(K,)``
        is a row vector (a 1 is prepended, and removed from the result). A transposed
        input (``A.T``) is just another array.
      B: ``(..., K, N)``, the same; a 1-D ``(K,)`` is a column vector (a 1 is appended,
        and removed from the result). The leading (batch) dimensions of ``A`` and ``B``
        broadcast against each other by numpy's rules; an operand whose batch dimensions
        must grow is broadcast (materialised) first, except that a 2-D operand, or one
        whose batch dimensions are all 1, is shared by every batch element at no cost.
      tile_shape: ``(BM, BN, BK)`` for the Pallas kernels, or ``None`` to let the kernel
        choose. Only its form is checked here: a tuple or list of exactly 3 positive ints
        (else ValueError); whether a kernel can run the tile (instruction multiples,
        registers, shared memory) is that kernel's to say. The XLA reference ignores it.
        In ``TESSERA_KERNELS=pallas`` mode, a tile that no kernel can run here raises a
        ValueError naming each kernel's reason; without ``tile_shape``, a case no kernel
        supports runs the reference. Other modes never raise over a tile.
      out_dtype: the output dtype (a ts dtype, numpy dtype or name). Default: the
        (promoted) operand dtype for wide floats, float32 for fp8, int32 for int8.
    Returns:
      ``(..., M, N)`` array of ``out_dtype`` (without the M or N of a 1-D operand).

    Dtypes: float16, bfloat16, float32, float64, the fp8 formats (float8_e4m3fn and
    float8_e5m2, which may be mixed) and int8 × int8. Two different wide floats are both
    cast to ``jnp.promote_types`` of the pair (f32 × bf16 runs as f32, accumulating in
    f32); gradients have each operand's own dtype. Accumulation: f32 for 8- and 16-bit
    floats, int32 for int8, else the operand dtype, or the ``ts.accum(...)`` in force
    under ``ts.jit``.

    QuantizedTensor operands: per-tensor scaled fp8 values (``ts.quantize(x, ts.fp8_e4m3)``)
    are multiplied in the fp8 path with the product of the scales applied to the
    accumulator (output f32 by default); other policies are dequantized to their compute
    dtype and accumulate in their accumulate dtype.
    """
    if (
        out_dtype is None
        and isinstance(A, jax.Array)
        and isinstance(B, jax.Array)
        and A.ndim == 2
        and B.ndim == 2
        and A.dtype == B.dtype
        and A.shape[1] == B.shape[0]
    ):
        # Two matrices of one dtype, the common case: every check below reduces to these
        # and a cached spec, so an eager call costs what jnp.dot's does.
        tile = None if tile_shape is None else _check_tile_shape("matmul", tile_shape)
        spec = _plain_spec(A.dtype, tile, _numerics_context.accumulate_dtype())
        if spec is not None:
            return matmul_op.bind(A, B, spec=spec)
    tile = _check_tile_shape("matmul", tile_shape)
    ops = _prepare("matmul", A, B, ("A", "B"), epilogue=False)
    a, b = ops.a, ops.b
    for x, name in ((a, "A"), (b, "B")):
        if x.ndim == 0:
            raise ValueError(f"matmul: {name}.shape=() has rank 0; matmul takes 1-D or more")
    row, col = a.ndim == 1, b.ndim == 1
    k_b = "B.shape[0]" if col else "B.shape[-2]"
    a2 = a[None, :] if row else a
    b2 = b[:, None] if col else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ValueError(
            f"matmul: A.shape[-1]={a.shape[-1]} must equal {k_b}={b2.shape[-2]} "
            f"(A.shape={a.shape}, B.shape={b.shape})"
        )
    a2, b2, lead = _broadcast_batch("matmul", a2, b2, ("A", "B"), (a.shape, b.shape))
    spec = MatmulSpec(
        out_dtype=ops.default_out if out_dtype is None else _out_dtype("matmul", out_dtype, ops),
        accumulate_dtype=ops.accumulate,
        tile_shape=tile,
    )
    out = _bind(a2, b2, spec, scale=ops.scale)
    m, n = a2.shape[-2], b2.shape[-1]
    shape = (*lead, *(() if row else (m,)), *(() if col else (n,)))
    return out.reshape(shape) if out.shape != shape else out


gemm = matmul


@functools.lru_cache(maxsize=256)
def _plain_spec(dtype: Any, tile: tuple[int, int, int] | None, ctx: Any) -> MatmulSpec | None:
    """The spec of :func:`matmul` of two ``dtype`` matrices under the accumulation context
    ``ctx`` (the cache key; :func:`_default_accumulate` reads it), or None where the full
    checks must run (an unsupported dtype, an accumulation that cannot apply)."""
    del ctx
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        return None
    try:
        acc = _default_accumulate("matmul", dtype, dtype)
    except TypeError:
        return None
    out = _F32 if dtype in FP8_DTYPES else (_I32 if _is_int(dtype) else dtype)
    return MatmulSpec(out_dtype=out, accumulate_dtype=acc, tile_shape=tile)


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
      w: ``(K, N)`` weights, or batched ``(..., K, N)`` whose batch dimensions broadcast
        against ``x``'s as in :func:`matmul`; or a QuantizedTensor. ``x`` and ``w`` may
        be different wide floats (promoted as in :func:`matmul`).
      b: optional bias ``(N,)`` of a float dtype, added in the accumulate dtype.
      activation: ``None``, ``"relu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``.
      residual: optional array of the output's shape, added after the activation.
      out_dtype: as :func:`matmul` (int8 operands with a bias or activation default to f32).
      tile_shape: as :func:`matmul`.
    Returns:
      ``(..., N)`` array.

    Gradients (first and higher order) flow to ``x``, ``w``, ``b`` and ``residual``; with
    an activation the differentiated forward also writes ``act'(x @ w + b)`` in the
    output dtype (bf16 for a bf16 layer: about 3 significant digits), which the backward
    multiplies into the cotangent.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation={activation!r} must be one of {ACTIVATIONS}")
    tile = _check_tile_shape("linear", tile_shape)
    ops = _prepare("linear", x, w, ("x", "w"), epilogue=b is not None or activation is not None)
    a, wt = ops.a, ops.b
    if a.ndim == 0:
        raise ValueError("linear: x.shape=() has rank 0; x must be (..., K)")
    if wt.ndim < 2:
        raise ValueError(f"linear: w.shape={wt.shape} has rank {wt.ndim}; w must be (..., K, N)")
    vector = a.ndim == 1  # a single example (K,)
    a2 = a[None, :] if vector else a
    if a2.shape[-1] != wt.shape[-2]:
        raise ValueError(
            f"linear: x.shape[-1]={a.shape[-1]} must equal w.shape[-2]={wt.shape[-2]} "
            f"(x.shape={a.shape}, w.shape={wt.shape})"
        )
    n = wt.shape[-1]
    if wt.ndim == 2:
        lead = ()
        out_shape = (*a.shape[:-1], n)
        # Rows of a 2-D weight: flatten x's leading dimensions (row-major, free) into M.
        a2 = a2.reshape(math.prod(a2.shape[:-1]), a2.shape[-1])  # (not -1: K may be 0)
    else:
        a2, wt, lead = _broadcast_batch("linear", a2, wt, ("x", "w"), (a.shape, wt.shape))
        out_shape = (*lead, n) if vector else (*lead, a2.shape[-2], n)
    bias = None
    if b is not None:
        bias = as_array("linear", "b", b)
        if not is_float(bias.dtype):
            raise TypeError(f"linear: b.dtype={bias.dtype} must be a float dtype")
        if bias.shape != (n,):
            raise ValueError(f"linear: b.shape={bias.shape} must be (N,)=({n},)")
    res = None
    if residual is not None:
        res = as_array("linear", "residual", residual)
        if not (is_float(res.dtype) or _is_int(res.dtype)):
            raise TypeError(f"linear: residual.dtype={res.dtype} must be a real dtype")
        if res.shape != out_shape:
            raise ValueError(
                f"linear: residual.shape={res.shape} must equal the output shape {out_shape}"
            )
    bind_shape = (*(a2.shape[:-2] or wt.shape[:-2]), a2.shape[-2], n)
    if res is not None:
        res = res.reshape(bind_shape)
    spec = MatmulSpec(
        out_dtype=ops.default_out if out_dtype is None else _out_dtype("linear", out_dtype, ops),
        accumulate_dtype=ops.accumulate,
        tile_shape=tile,
        activation=activation,
    )
    out = _bind(a2, wt, spec, bias=bias, residual=res, scale=ops.scale)
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
    tile_shape: tuple[int, int, int] | None = None,
) -> jax.Array:
    """The fused MLP of the execution-model walkthrough: ``act(X @ W1 + b1) @ W2 + b2``.

    Two fused ``ts_matmul`` calls: the first carries bias and activation in its epilogue,
    the second the output bias. The hidden activations have ``X``'s default output dtype.

    Arguments:
      X: ``(..., D)``; W1: ``(D, H)``; b1: ``(H,)``; W2: ``(H, F)``; b2: ``(F,)``.
      activation: ``"relu"`` (default), ``"gelu"``, ``"gelu_tanh"`` or ``None``.
      out_dtype: the output dtype (default: as :func:`linear`).
      tile_shape: as :func:`matmul`, for both products.
    Returns:
      ``(..., F)`` array.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_mlp: activation={activation!r} must be one of {ACTIVATIONS}")
    tile = _check_tile_shape("fused_mlp", tile_shape)
    h = linear(X, W1, b1, activation=activation, tile_shape=tile)
    return linear(h, W2, b2, out_dtype=out_dtype, tile_shape=tile)


# --- validation ---------------------------------------------------------------------------


def _check_tile_shape(op: str, tile_shape: Any) -> tuple[int, int, int] | None:
    """The form check of ``tile_shape``, the only one the operator makes: None, or a tuple
    or list of exactly 3 ints (Python or NumPy, not bool), each positive. Returned as a
    tuple of Python ints. Hardware limits (instruction multiples, registers, shared memory)
    are the kernels' to check, in their ``supports``."""
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
        if t <= 0:
            raise ValueError(f"{op}: tile_shape={tile} has {name}={t}; each must be positive")
    return tile


def _broadcast_batch(
    op: str,
    a: jax.Array,
    b: jax.Array,
    names: tuple[str, str],
    shapes: tuple[tuple[int, ...], tuple[int, ...]],
) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
    """``a (..., M, K)``, ``b (..., K, N)`` in the primitive's batch form (identical
    leading dimensions, or one operand 2-D), and the broadcast leading dimensions.

    An operand whose batch dimensions are all 1 becomes 2-D (a free reshape: shared by
    every batch element); one whose batch dimensions must grow is broadcast.
    """
    la, lb = a.shape[:-2], b.shape[:-2]
    try:
        lead = tuple(np.broadcast_shapes(la, lb))
    except ValueError:
        (na, nb), (sa, sb) = names, shapes
        raise ValueError(
            f"{op}: the batch dimensions of {na}.shape={sa} and {nb}.shape={sb} do not "
            "broadcast (numpy rules, as jnp.matmul)"
        ) from None

    def fit(x, lx):
        if lx == lead or not lx:
            return x
        if math.prod(lx) == 1:
            return x.reshape(x.shape[-2:])
        return jnp.broadcast_to(x, (*lead, *x.shape[-2:]))

    return fit(a, la), fit(b, lb), lead


def _check_dtypes(op: str, a: jax.Array, b: jax.Array, names: tuple[str, str]):
    """``a``, ``b`` in the dtypes the product runs in: equal, an fp8 pair, or both cast to
    the promoted dtype of two different wide floats."""
    for x, name in zip((a, b), names):
        if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
            expected = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise TypeError(f"{op}: {name}.dtype={x.dtype} is not supported; expected {expected}")
    da, db = np.dtype(a.dtype), np.dtype(b.dtype)
    if da == db or (da in FP8_DTYPES and db in FP8_DTYPES):
        return a, b
    if da in _WIDE_FLOATS and db in _WIDE_FLOATS:
        try:
            common = np.dtype(jnp.promote_types(da, db))
        except jax.dtypes.TypePromotionError:
            raise TypeError(
                f"{op}: {names[0]}.dtype={da} and {names[1]}.dtype={db} differ, and "
                "jax_numpy_dtype_promotion='strict' forbids promoting them (as in "
                "jnp.matmul); cast one first"
            ) from None
        return a.astype(common), b.astype(common)
    raise TypeError(
        f"{op}: {names[0]}.dtype={da} and {names[1]}.dtype={db} cannot be mixed: an fp8 "
        "operand multiplies only with fp8 (float8_e4m3fn or float8_e5m2) and int8 only with "
        "int8; cast one first (or ts.quantize the wide one)"
    )


def _out_dtype(op: str, out_dtype: Any, ops: _Operands) -> np.dtype:
    try:
        out = as_np_dtype(out_dtype)
    except TypeError as e:
        raise TypeError(f"{op}: out_dtype={out_dtype!r}: {e}") from None
    ints_in = _is_int(ops.a.dtype)
    if not (is_float(out) or (ints_in and out == _I32)):
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
        if ctx == _I32 or (is_float(ctx) and ctx.itemsize >= 4):
            return ctx
    elif is_float(ctx):
        # Never narrower than the inputs (an f64 product under ts.accum(ts.f32) stays f64).
        return ctx if ctx.itemsize >= max(da.itemsize, db.itemsize) else default
    raise TypeError(
        f"{op}: the accumulation dtype {ctx} in force (ts.accum) cannot accumulate "
        f"{da} × {db} products"
    )


def _prepare(op: str, A: Any, B: Any, names: tuple[str, str], *, epilogue: bool) -> _Operands:
    """Operands, dequantization scale, default output and accumulate dtypes."""
    if isinstance(A, QuantizedTensor) or isinstance(B, QuantizedTensor):
        return _prepare_quantized(op, A, B, names)
    a = as_array(op, names[0], A)
    b = as_array(op, names[1], B)
    a, b = _check_dtypes(op, a, b, names)
    da, db = np.dtype(a.dtype), np.dtype(b.dtype)
    acc = _default_accumulate(op, da, db)
    if da in FP8_DTYPES:
        default_out = _F32  # FP8 inputs, FP32 accumulation and output
    elif _is_int(da):
        default_out = _F32 if epilogue else _I32
    else:
        default_out = da
    return _Operands(a, b, None, default_out, acc)


def _prepare_quantized(op: str, A: Any, B: Any, names: tuple[str, str]) -> _Operands:
    """QuantizedTensor operands: the fp8 path with a scale, or dequantization."""

    def plain(x, name):
        return None if isinstance(x, QuantizedTensor) else as_array(op, name, x)

    pa, pb = plain(A, names[0]), plain(B, names[1])
    fa = fp8_scaled_values(A) if pa is None else ((pa, None) if pa.dtype in FP8_DTYPES else None)
    fb = fp8_scaled_values(B) if pb is None else ((pb, None) if pb.dtype in FP8_DTYPES else None)
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
            if not is_float(x.dtype):
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


def _matmul_abstract_eval(a, b, *extras, spec: MatmulSpec):
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"ts_matmul: operands of shapes {a.shape} and {b.shape} must be ≥ 2-D")
    m, n, k = spec.problem_shape(a.shape, b.shape)
    kb = b.shape[-1] if spec.transpose_b else b.shape[-2]
    if k != kb:
        raise ValueError(
            f"ts_matmul: contraction sizes differ: {k} vs {kb} ({a.shape=}, {b.shape=}, "
            f"transpose_a={spec.transpose_a}, transpose_b={spec.transpose_b})"
        )
    la, lb = a.shape[:-2], b.shape[:-2]
    if la and lb and la != lb:
        raise ValueError(f"ts_matmul: batch dimensions differ: {a.shape=}, {b.shape=}")
    shape = (*(la or lb), m, n)
    bias, residual, scale = spec.split(extras)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"ts_matmul: bias.shape={bias.shape} must be ({n},)")
    if residual is not None and residual.shape != shape:
        raise ValueError(f"ts_matmul: residual.shape={residual.shape} must be {shape}")
    if scale is not None and scale.shape != ():
        raise ValueError(f"ts_matmul: scale.shape={scale.shape} must be ()")
    return jax.core.ShapedArray(shape, spec.out_dtype)


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


def _product_spec(spec: MatmulSpec, out_dtype: Any) -> MatmulSpec:
    """``spec`` without its epilogue (activation, extras), writing ``out_dtype``."""
    return spec.replace(
        out_dtype=out_dtype, activation=None, has_bias=False, has_residual=False, has_scale=False
    )


def _matmul_batch(args, dims, *, spec: MatmulSpec, op: Operator = matmul_op):
    """The batching rule of ``ts_matmul`` and (``op``) of its two-output form."""
    multiple = op.prim.multiple_results
    a, b, *extras = args
    da, db, *dextras = dims
    bias, residual, scale = spec.split(extras)
    dbias, dres, dscale = spec.split(dextras)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not not_mapped)
    shared_product = da is not_mapped and db is not_mapped
    if not shared_product:
        a, b = _conform(a, da, b, db, size)
    m, n, _ = spec.problem_shape(a.shape, b.shape)
    out_shape = (*(a.shape[:-2] if a.ndim > 2 else b.shape[:-2]), m, n)
    mapped_bias = bias is not None and dbias is not not_mapped
    mapped_scale = scale is not None and dscale is not not_mapped
    if not (shared_product or mapped_bias or mapped_scale):
        if residual is not None:
            residual = _to_front(residual, dres)
            if dres is not_mapped:
                residual = jnp.broadcast_to(residual, out_shape)
        out = _bind(a, b, spec, bias=bias, residual=residual, scale=scale, op=op)
        return out, ([0] * len(out) if multiple else 0)
    # A per-example bias or scale has no fused form, and a product shared by every
    # example (only extras mapped) is computed once: product, then the contract's epilogue.
    acc = _bind(a, b, _product_spec(spec, spec.epilogue_dtype))
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
    finish = epilogue_with_derivative if multiple else epilogue
    out = finish(acc, bias, residual, scale, activation=spec.activation, out_dtype=spec.out_dtype)

    def full(x):
        return x if x.shape[0] == size else jnp.broadcast_to(x, (size, *x.shape[1:]))

    if multiple:
        return [full(x) for x in out], [0] * len(out)
    return full(out), 0


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


def _affine_tangent(a, b, bias, scale, ta, tb, tbias, tscale, p: MatmulSpec, shape):
    """The tangent of ``scale·op(a)@op(b) + bias`` in ``p.out_dtype`` (None: zero);
    ``p`` is the product's spec without its epilogue."""
    terms = []
    if not _is_zero(ta):
        terms.append(_bind(ta, b, p, scale=scale))
    if not _is_zero(tb):
        terms.append(_bind(a, tb, p, scale=scale))
    if scale is not None and not _is_zero(tscale):
        terms.append(_bind(a, b, p, scale=tscale))
    if bias is not None and not _is_zero(tbias):
        terms.append(_bias_tangent(tbias, shape, p.out_dtype))
    return _add_all(terms)


def _ts_activation(z: jax.Array, activation: str) -> jax.Array:
    """The activation with the ts elementwise operators (their JVPs give ``act'``)."""
    if activation == "relu":
        return _ew.relu(z)
    return _ew.gelu(z, approximate=activation == "gelu_tanh")


def _activation_and_derivative(z: jax.Array, activation: str) -> tuple[jax.Array, jax.Array]:
    """``(act(z), act'(z))``, differentiable to any order (the ts operators' JVPs, and
    jax's of the contract's derivative formula)."""
    return _ts_activation(z, activation), activation_derivative(z, activation)


def _matmul_jvp(primals, tangents, *, spec: MatmulSpec):
    a, b, *extras = primals
    ta, tb, *textras = tangents
    bias, residual, scale = spec.split(extras)
    tbias, tres, tscale = spec.split(textras)
    out_dtype = spec.out_dtype
    if not is_float(out_dtype):  # an int32 product: not differentiable
        y = matmul_op.bind(*primals, spec=spec)
        return y, zero_tangent(y)
    if spec.activation is None:
        # Affine in each of a, b, scale, bias, residual: the fused primal, tangents in out_dtype.
        y = matmul_op.bind(*primals, spec=spec)
        p = _product_spec(spec, out_dtype)
        dz = _affine_tangent(a, b, bias, scale, ta, tb, tbias, tscale, p, y.shape)
        terms = [] if dz is None else [dz]
        if residual is not None and not _is_zero(tres):
            terms.append(tres.astype(out_dtype))
        dy = _add_all(terms)
        return y, zero_tangent(y) if dy is None else dy
    # With an activation: one product writes y (the bits of the undifferentiated forward)
    # and act'(z) in out_dtype; the tangent is dz · act'(z), which the backward pass turns
    # into the cotangent times the saved derivative. The product is taken in out_dtype:
    # any operation on act'(z) alone (a cast to f32) would be saved in its place.
    y, deriv = matmul_with_derivative_op.bind(*primals, spec=spec)
    p = _product_spec(spec, spec.epilogue_dtype)
    dz = _affine_tangent(a, b, bias, scale, ta, tb, tbias, tscale, p, y.shape)
    dy = None if dz is None else dz.astype(out_dtype) * deriv
    if residual is not None and not _is_zero(tres):
        dy = tres.astype(out_dtype) if dy is None else dy + tres.astype(out_dtype)
    return y, zero_tangent(y) if dy is None else dy


def _cotangent_for(ct: jax.Array, other: jax.Array) -> jax.Array:
    """The cotangent in the dtype of the operand it multiplies, when that is a wide float.

    The backward product then runs at the forward's operand precision (bf16 × bf16,
    accumulating in f32); against fp8 operands the cotangent stays as it is.
    """
    od = np.dtype(other.dtype)
    if ct.dtype != od and od in _WIDE_FLOATS and is_float(ct.dtype):
        return ct.astype(od)
    return ct


def _sum_leading(x: jax.Array, nlead: int) -> jax.Array:
    return _red.sum(x, axis=tuple(range(nlead))) if nlead else x


def _explicit_operand(*xs: jax.Array) -> bool:
    """Whether any of ``xs`` is typed by a mesh with Explicit axes."""
    return any(explicit_sharding(jax.typeof(x)) is not None for x in xs)


def _matmul_transpose(ct, a, b, *extras, spec: MatmulSpec):
    if spec.has_bias or spec.has_residual or spec.activation is not None:
        raise NotImplementedError(
            "ts_matmul is linear only without bias, residual and activation; "
            "its JVP emits such products only"
        )
    _, _, scale = spec.split(extras)
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
    ta, tb = spec.transpose_a, spec.transpose_b
    acc = spec.accumulate_dtype if is_float(spec.accumulate_dtype) else _F32
    ep = epilogue_dtype(acc)
    nlead = ct.ndim - 2

    def mm(x, y, out, *, transpose_a=False, transpose_b=False, like=None):
        # The adjoint products have other shapes than the forward: they pick their own
        # tiles (the user's tile_shape was chosen for the forward product). Their
        # contraction runs over the forward's rows, which may be sharded: on a mesh with
        # Explicit axes the result takes the operand's sharding, as jax's dot_general
        # transpose does.
        sharding = None if like is None else explicit_sharding(like)
        spec = None if sharding is None else sharding.spec
        if like is not None and spec is None and _explicit_operand(x, y):
            # An operand not typed by the mesh (a weight passed unplaced) is replicated
            # there: so is its cotangent, as jax types it.
            spec = jax.sharding.PartitionSpec()
        s = MatmulSpec(
            out_dtype=out,
            accumulate_dtype=acc,
            transpose_a=transpose_a,
            transpose_b=transpose_b,
            out_sharding=spec,
        )
        return _bind(x, y, s, scale=scale)

    if us:
        # d scale = Σ ct ⊙ op(a)@op(b): a scalar.
        s = MatmulSpec(out_dtype=ep, accumulate_dtype=acc, transpose_a=ta, transpose_b=tb)
        prod = _bind(a, b, s)
        ds = _red.sum(ct.astype(ep) * prod)
        cts[slot] = ds.astype(lin.aval.dtype)
        return cts
    if ua:
        out_dt, shared = lin.aval.dtype, lin.aval.ndim == 2 and nlead > 0
        g = _cotangent_for(ct, b)
        dt = ep if shared else out_dt
        like = None if shared else lin.aval
        if not ta:  # dA = ct · op(b)ᵀ
            d = mm(g, b, dt, transpose_b=not tb, like=like)
        else:  # stored (…, K, M): dAᵀ = op(b) · ctᵀ
            d = mm(b, g, dt, transpose_a=tb, transpose_b=True, like=like)
        cts[0] = _sum_leading(d, nlead).astype(out_dt) if shared else d
        return cts
    out_dt, shared = lin.aval.dtype, lin.aval.ndim == 2 and nlead > 0
    g = _cotangent_for(ct, a)
    if shared and not ta:
        # x (…, M, K) against a shared weight: fold the batch into the contraction (free).
        rows = math.prod(a.shape[:-1])  # (not -1 in the reshapes: K or N may be 0)
        a2, g2 = a.reshape(rows, a.shape[-1]), g.reshape(rows, g.shape[-1])
        if not tb:
            cts[1] = mm(a2, g2, out_dt, transpose_a=True, like=lin.aval)
        else:
            cts[1] = mm(g2, a2, out_dt, transpose_a=True, like=lin.aval)
        return cts
    dt = ep if shared else out_dt
    like = None if shared else lin.aval
    if not tb:  # dB = op(a)ᵀ · ct
        d = mm(a, g, dt, transpose_a=not ta, like=like)
    else:  # stored (…, N, K): dBᵀ = ctᵀ · op(a)
        d = mm(g, a, dt, transpose_a=True, transpose_b=ta, like=like)
    cts[1] = _sum_leading(d, nlead).astype(out_dt) if shared else d
    return cts


ad.primitive_jvps[matmul_op.prim] = _matmul_jvp
ad.primitive_transposes[matmul_op.prim] = _matmul_transpose


# --- the reference ------------------------------------------------------------------------


# XLA GPU (jax 0.11.2, H100) returns twice the true int8 × int8 → int32 product from its
# Triton GEMM fusion for some contraction sizes that are not multiples of 4 (17×33×9,
# 4×{2,3,5,6,7}×4, 8×13×8). Zero-padding K to a multiple of this sidesteps it; zeros add
# nothing to the product.
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


def _dot(a, b, *, transpose_a, transpose_b, accumulate_dtype, out_sharding=None):
    """``op(a) @ op(b)`` with ``lax.dot_general``: the transposes are dimension numbers."""
    ca = a.ndim - 2 if transpose_a else a.ndim - 1
    cb = b.ndim - 1 if transpose_b else b.ndim - 2
    pet = np.dtype(accumulate_dtype)
    if _is_int(a.dtype) and _is_int(b.dtype):
        a, b = _pad_contraction(a, b, ca, cb)
    dot = functools.partial(lax.dot_general, preferred_element_type=pet)
    if a.ndim == b.ndim:  # identical batch dimensions (or plain 2-D)
        batch = tuple(range(a.ndim - 2))
        return dot(a, b, (((ca,), (cb,)), (batch, batch)), out_sharding=out_sharding)
    if out_sharding is not None and a.ndim == 2:  # dot_general's (M, …, N) order
        spec = tuple(out_sharding) + (None,) * (b.ndim - len(out_sharding))
        out_sharding = jax.sharding.PartitionSpec(spec[-2], *spec[:-2], spec[-1])
    out = dot(a, b, (((ca,), (cb,)), ((), ())), out_sharding=out_sharding)
    if a.ndim == 2:  # shared a: dot_general gives (M, …, N)
        out = jnp.moveaxis(out, 0, -2)
    return out  # shared b: (…, M, N)


def matmul_reference(a: jax.Array, b: jax.Array, *extras: jax.Array, spec: MatmulSpec):
    """The XLA lowering of ``ts_matmul`` and the oracle of its kernels (``spec.tile_shape``
    unused): ``lax.dot_general`` then the contract's epilogue."""
    bias, residual, scale = spec.split(extras)
    accumulate = spec.accumulate_dtype
    out_dtype = spec.out_dtype
    if not spec.has_epilogue and out_dtype in (_F16, _BF16) and a.dtype == b.dtype == out_dtype:
        # Ask XLA for the 16-bit result, as jnp.dot does: cuBLAS still accumulates in f32,
        # but writes C once in 16 bits instead of an f32 C plus a convert pass, which ran
        # slower than jnp.dot (benchmarks/results/matmul-h100.json).
        accumulate = out_dtype
    acc = _dot(
        a,
        b,
        transpose_a=spec.transpose_a,
        transpose_b=spec.transpose_b,
        accumulate_dtype=accumulate,
        out_sharding=spec.out_sharding,
    )
    return epilogue(acc, bias, residual, scale, activation=spec.activation, out_dtype=out_dtype)


# --- the two-output form: ts_matmul_with_derivative ----------------------------------------
# The forward of a differentiated product with an activation: ``ts_matmul``'s output y and
# the activation's derivative ``act'(z)`` at the pre-activation ``z = scale·acc + bias``,
# both in ``spec.out_dtype``, from one product and one epilogue
# (``contracts/matmul.py``'s ``epilogue_with_derivative``). ``_matmul_jvp`` binds it; the
# backward pass multiplies the saved ``act'(z)`` into the cotangent.
#
# Why ``act'(z)`` rather than ``z`` is saved: the backward then needs one multiply and no
# activation of its own, and the derivative is rounded once from ``z`` in the epilogue
# dtype, where recomputing it from a saved ``z`` would start from ``z`` already rounded to
# out_dtype. For a bf16 layer the saved derivative is bf16 (relu's 0/1 exactly, gelu's to
# about 3 significant digits), as plain JAX saves bf16 there; an f32 layer's is exact f32.
# y is computed by the operations of ``ts_matmul``'s epilogue and on the implementation
# ``ts_matmul`` picks for the same spec (the kernel's ``prefer`` is shared), so the primal
# of a differentiated layer has the bits of the undifferentiated one. (A tile whose second
# staging buffer does not fit shared memory runs the reference instead: an f32 output with
# a residual at the large default tiles.) The Hopper kernel writes both outputs from its
# registers; on XLA's path the product is written in f32 first, and XLA may compute
# ``act'(z)`` inside the backward's multiply from it (as it does in the training step:
# benchmarks/results/linear-grad-h100.json has the forward forms' times).


def _with_derivative_abstract_eval(a, b, *extras, spec: MatmulSpec):
    if spec.activation is None:
        raise ValueError(
            "ts_matmul_with_derivative: spec.activation=None; the derivative output needs "
            f"one of {ACTIVATIONS[1:]}"
        )
    y = _matmul_abstract_eval(a, b, *extras, spec=spec)
    return [y, y]


matmul_with_derivative_op = Operator(
    "matmul_with_derivative",
    reference=lambda *args, **params: matmul_with_derivative_reference(*args, **params),
    abstract_eval=_with_derivative_abstract_eval,
    multiple_results=True,
    spec=lambda params: params["spec"],
)


def matmul_with_derivative_reference(
    a: jax.Array, b: jax.Array, *extras: jax.Array, spec: MatmulSpec
) -> tuple[jax.Array, jax.Array]:
    """The XLA lowering of ``ts_matmul_with_derivative`` and the oracle of its kernels:
    the product of :func:`matmul_reference`, then both outputs from one epilogue."""
    bias, residual, scale = spec.split(extras)
    acc = _dot(
        a,
        b,
        transpose_a=spec.transpose_a,
        transpose_b=spec.transpose_b,
        accumulate_dtype=spec.accumulate_dtype,
        out_sharding=spec.out_sharding,
    )
    return epilogue_with_derivative(
        acc, bias, residual, scale, activation=spec.activation, out_dtype=spec.out_dtype
    )


def _with_derivative_jvp(primals, tangents, *, spec: MatmulSpec):
    """Second and higher derivatives: the outputs' tangents from the pre-activation
    recomputed with ``ts_matmul`` in the epilogue dtype, through differentiable formulas of
    ``act`` and ``act'`` (first-order gradients never reach this rule)."""
    a, b, *extras = primals
    ta, tb, *textras = tangents
    bias, residual, scale = spec.split(extras)
    tbias, tres, tscale = spec.split(textras)
    y, deriv = matmul_with_derivative_op.bind(*primals, spec=spec)
    ep, out_dtype = spec.epilogue_dtype, spec.out_dtype
    p = _product_spec(spec, ep)
    dz = _affine_tangent(a, b, bias, scale, ta, tb, tbias, tscale, p, y.shape)
    if dz is None:
        dh, dd = None, None
    else:
        z = _bind(a, b, p, bias=bias, scale=scale)
        both = functools.partial(_activation_and_derivative, activation=spec.activation)
        _, (dh, dd) = jax.jvp(both, (z,), (dz,))
    if residual is not None and not _is_zero(tres):
        dh = tres.astype(ep) if dh is None else dh + tres.astype(ep)
    dy = zero_tangent(y) if dh is None else dh.astype(out_dtype)
    dderiv = zero_tangent(deriv) if dd is None else dd.astype(out_dtype)
    return [y, deriv], [dy, dderiv]


ad.primitive_jvps[matmul_with_derivative_op.prim] = _with_derivative_jvp
batching.primitive_batchers[matmul_with_derivative_op.prim] = functools.partial(
    _matmul_batch, op=matmul_with_derivative_op
)


# --- kernels ------------------------------------------------------------------------------
# The Hopper Mosaic GPU kernel first (sm_90 only; ``prefer`` routes a case to it in ``auto``
# mode only where it measured at least as fast as cuBLAS), then the portable BlockSpec kernel
# for other GPUs (never preferred over cuBLAS; runs under ``pallas``). ``interpret`` mode
# takes the first kernel that supports the case, on any platform.
matmul_op.add_kernel(Kernel.from_module("mosaic_gpu", _mgpu, _mgpu.matmul))
matmul_op.add_kernel(Kernel.from_module("pallas_portable", _portable, _portable.matmul))
# The two-output form on the same kernels, with ts_matmul's ``prefer``: a differentiated
# layer runs where its undifferentiated forward runs (the same bits of y). Where no kernel
# is preferred, the reference.
for _name, _module in (("mosaic_gpu", _mgpu), ("pallas_portable", _portable)):
    matmul_with_derivative_op.add_kernel(
        Kernel(
            name=_name,
            fn=functools.partial(_module.matmul, with_derivative=True),
            supports=functools.partial(_module.supports, with_derivative=True),
            prefer=_module.prefer,
            platforms=getattr(_module, "PLATFORMS", ("cuda",)),
            hardware=_module.hardware,
            interpretable=getattr(_module, "INTERPRETABLE", True),
        )
    )


# --- autotuning ---------------------------------------------------------------------------
# ``ts.autotune.search(kernel=ts.op.matmul, args=(A, B), params=dict(BM=…, BN=…, BK=…,
# stages=…))`` tunes the Hopper kernel's tile for the product ``matmul(A, B)`` binds; the
# kernel reads the winner from the cache whenever it runs that product without an explicit
# ``tile_shape`` (``matmul_mgpu.tuned_config``).


def _bound_product(A: Any, B: Any) -> tuple[MatmulSpec, list[Any]]:
    """The spec and operand avals of the one ``ts_matmul`` that ``matmul(A, B)`` binds."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is matmul_op.prim:
                found.append((eqn.params["spec"], [v.aval for v in eqn.invars]))
            for v in eqn.params.values():
                for item in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(matmul)(A, B).jaxpr)
    if len(found) != 1:
        raise ValueError(f"matmul autotune: matmul(A, B) binds {len(found)} products, not one")
    return found[0]


def _tuning_mode() -> str:
    """The kernel mode a tuning run uses: the interpreter where it is in force (CPU tests),
    else ``pallas``, so the kernel runs whatever ``auto``'s speed heuristic would pick."""
    return "interpret" if get_kernel_mode() == "interpret" else "pallas"


class _MatmulTunable:
    """:class:`ts.autotune.Tunable` of ``matmul(A, B)`` on the Hopper Mosaic GPU kernel:
    ``{BM, BN, BK[, stages]}`` is the kernel's ``tile_shape=(BM, BN, BK)`` with ``stages``
    pipeline stages (default 4, lowered to fit shared memory)."""

    name = _mc.TUNING_NAME

    def __init__(self):
        # Compiled programs by (argument types, config): timed calls skip tracing and the
        # kernel-mode context, so they measure the kernel rather than Python dispatch.
        self._compiled: dict[tuple, Any] = {}
        self._keys: dict[Any, tuple] = {}  # tuning keys by argument types

    @staticmethod
    def _signature(args: tuple) -> Any:
        leaves, tree = jax.tree.flatten(args)
        return tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)

    def key(self, args: tuple) -> tuple:
        if len(args) != 2:
            raise ValueError(f"matmul autotune: args must be (A, B), got {len(args)} arguments")
        sig = self._signature(args)
        if sig not in self._keys:
            self._keys[sig] = _mc.tuning_key(*_bound_product(*args))
        return self._keys[sig]

    def check(self, args: tuple, config: dict) -> str | None:
        """Why the kernel cannot run ``config`` here, asked of the operator's own dispatch
        (hardware, shared memory, instruction shapes) before anything compiles."""
        for name, v in config.items():
            if name not in _mc.TUNING_PARAMS:
                raise ValueError(
                    f"matmul autotune: parameter {name!r} is not one of "
                    f"{_mc.TUNING_PARAMS} (BM, BN, BK are required)"
                )
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"matmul autotune: {name}={v!r} must be an int")
        spec, avals = _bound_product(*args)
        key = _mc.tuning_key(spec, avals)
        dts = _mc.kernel_operand_dtypes(avals[0].dtype, avals[1].dtype)
        if dts is None:
            return f"operand dtypes {avals[0].dtype} x {avals[1].dtype} are not the kernel's"
        try:
            cfg = _mc.config_from_tuned(config, *dts)
        except ValueError as e:
            return str(e)
        if "stages" in config:
            # The kernel lowers stages until the ring fits; a count that does not fit would
            # run as a smaller one already in the space.
            res = avals[2 + spec.has_bias].dtype if spec.has_residual else None
            has_vec = spec.has_bias or spec.has_scale
            need = _mc.smem_bytes(cfg, *dts, spec.out_dtype, res, has_vec)
            if need > _mc.SMEM_BYTES:
                return (
                    f"{cfg.num_stages} stages of tile {cfg.tile_shape} need {need} bytes of "
                    f"shared memory, over {_mc.SMEM_BYTES}"
                )
        platform = jax.devices()[0].platform
        platform = "cuda" if platform == "gpu" else platform
        with kernel_mode(_tuning_mode()), autotune.trial(self.name, key, config):
            impl, _ = matmul_op.select(platform, avals, {"spec": spec})
            if impl != "mosaic_gpu":
                why = matmul_op.reasons(platform, avals, {"spec": spec}).get("mosaic_gpu")
                return f"the Mosaic GPU kernel does not run it ({why or impl + ' would'})"
        return None

    def run(self, args: tuple, config: dict) -> Any:
        slot = (self._signature(args), tuple(sorted(config.items())))
        compiled = self._compiled.get(slot)
        if compiled is None:
            # A fresh jit traced under the trial: the kernel reads ``config`` as the cached one.
            with kernel_mode(_tuning_mode()), autotune.trial(self.name, self.key(args), config):
                compiled = jax.jit(lambda a, b: matmul(a, b)).lower(*args).compile()
            self._compiled[slot] = compiled
        return compiled(*args)


matmul.__tessera_tunable__ = _MatmulTunable
