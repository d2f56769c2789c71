"""``fft`` / ``ifft`` along one axis (complex64, or complex128 under x64).

Both are linear, so their adjoints are transposes: the DFT matrix ``F`` is
symmetric, hence ``Fᵀ = F`` and the transpose of ``fft`` is ``fft`` itself (and
of ``ifft``, ``ifft``). JAX differentiates complex functions with plain
transposes (not conjugate transposes), which is exactly this.
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
    normalize_axis,
)


def _fft_ref(x, *, axis, inverse):
    return (jnp.fft.ifft if inverse else jnp.fft.fft)(x, axis=axis)


fft_op = Operator("fft", reference=_fft_ref, abstract_eval=lambda x, **_: x)


def _fft_transpose(ct, x, *, axis, inverse):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return [fft_op.bind(ct, axis=axis, inverse=inverse)]


ad.deflinear2(fft_op.prim, _fft_transpose)


def _fft_batcher(args, dims, *, axis, inverse):
    (x,), (d,) = args, dims
    return fft_op.bind(x, axis=axis + (axis >= d), inverse=inverse), d


batching.primitive_batchers[fft_op.prim] = _fft_batcher


def _prepare(name: str, x, axis: int):
    x = as_array(name, "x", x)
    check_dtype(name, "x", x, (jnp.floating, jnp.complexfloating))
    if x.ndim == 0:
        raise ValueError(f"{name}: x must have at least one dimension, got a scalar")
    axis = normalize_axis(name, "axis", axis, x.ndim)
    if x.shape[axis] == 0:
        raise ValueError(f"{name}: x.shape[{axis}]=0; the transformed axis must be non-empty")
    wide = np.dtype(x.dtype).itemsize >= 8 and not jnp.issubdtype(x.dtype, jnp.complex64)
    ctype = jnp.complex128 if wide else jnp.complex64
    return x.astype(ctype), axis


def fft(x: jax.Array, axis: int = -1) -> jax.Array:
    """Discrete Fourier transform along ``axis`` (unnormalised, as numpy.fft.fft).

    Real inputs are promoted to complex64 (complex128 for float64).
    """
    x, axis = _prepare("fft", x, axis)
    return fft_op.bind(x, axis=axis, inverse=False)


def ifft(x: jax.Array, axis: int = -1) -> jax.Array:
    """Inverse DFT along ``axis`` (normalised by 1/n, as numpy.fft.ifft)."""
    x, axis = _prepare("ifft", x, axis)
    return fft_op.bind(x, axis=axis, inverse=True)
