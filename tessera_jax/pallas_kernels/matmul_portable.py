"""Portable matmul: a plain ``pl.pallas_call`` with BlockSpecs, for GPUs without Hopper
features (and for ``interpret=True`` anywhere).

Each program computes one ``(BM, BN)`` tile of one batch element: its BlockSpecs
bring a ``(BM, K)`` row panel of A and a ``(K, BN)`` column panel of B (as stored,
transposed or not), a loop walks K in ``BK`` slices into an f32 accumulator, and the
same fused epilogue as the Hopper kernel (scale, bias, activation, residual, cast)
runs before the single store. On a GPU this lowers through Pallas' Triton backend
(deprecated in jax 0.11 and used here only as this fallback); block sizes are powers
of two, and ragged M/N/K are zero-padded to whole tiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tessera_jax.pallas_kernels import matmul_configs as mc

__all__ = ["PortableConfig", "matmul", "prefer", "supports"]

_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class PortableConfig:
    """Block sizes ``(BM, BN, BK)``, each a power of two >= 16 (Triton's block rule)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"PortableConfig: {name}={v!r} must be a power of two >= 16")

    @classmethod
    def from_tile_shape(cls, tile_shape) -> PortableConfig:
        """A user tile rounded down to powers of two (the fallback accepts any valid tile)."""
        bm, bn, bk = (max(16, _pow2_floor(t)) for t in tile_shape)
        return cls(bm, bn, bk)


def _kernel(
    *refs,
    k_steps,
    bk,
    transpose_a,
    transpose_b,
    has_vec,
    has_scale,
    has_bias,
    has_res,
    activation,
    out_dtype,
    precision,
):
    refs = list(refs)
    a_ref, b_ref = refs.pop(0), refs.pop(0)
    vec_ref = refs.pop(0) if has_vec else None
    res_ref = refs.pop(0) if has_res else None
    (o_ref,) = refs
    bm, bn = o_ref.shape

    def body(i, acc):
        ks = pl.ds(i * bk, bk)
        a = a_ref[ks, :] if transpose_a else a_ref[:, ks]
        b = b_ref[:, ks] if transpose_b else b_ref[ks, :]
        dims = (((0,) if transpose_a else (1,), (1,) if transpose_b else (0,)), ((), ()))
        return acc + lax.dot_general(
            a, b, dims, precision=precision, preferred_element_type=jnp.float32
        )

    acc = lax.fori_loop(0, k_steps, body, jnp.zeros((bm, bn), jnp.float32))
    if has_scale:
        acc = acc * vec_ref[0:1, :]
    if has_bias:
        acc = acc + vec_ref[1:2, :]
    acc = mc.apply_activation(acc, activation)
    if has_res:
        acc = acc + res_ref[...].astype(jnp.float32)
    o_ref[...] = acc.astype(out_dtype)


def matmul(
    a: jax.Array,
    b: jax.Array,
    *extras: jax.Array,
    interpret: bool = False,
    transpose_a: bool = False,
    transpose_b: bool = False,
    out_dtype: Any = None,
    accumulate_dtype: Any = jnp.float32,
    tile_shape: tuple[int, int, int] | None = None,
    activation: str | None = None,
    has_bias: bool = False,
    has_residual: bool = False,
    has_scale: bool = False,
    config: PortableConfig | None = None,
) -> jax.Array:
    """``cast(act(scale · op(a) @ op(b) + bias) + residual, out_dtype)`` with BlockSpecs."""

    del accumulate_dtype
    bias, residual, scale = mc.split_extras(
        extras, has_bias=has_bias, has_residual=has_residual, has_scale=has_scale
    )
    out_dtype = np.dtype(out_dtype if out_dtype is not None else a.dtype)
    m, n, k = mc.problem_shape(a.shape, b.shape, transpose_a, transpose_b)
    lead = tuple(jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    if config is None:
        config = (
            PortableConfig.from_tile_shape(tile_shape)
            if tile_shape is not None
            else PortableConfig()
        )
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    a3 = a.reshape((-1, *a.shape[-2:]))
    b3 = b.reshape((-1, *b.shape[-2:]))
    batch = max(a3.shape[0], b3.shape[0])
    a3, b3 = mc.pad_operands(a3, b3, transpose_a, transpose_b, bm, bn, bk)
    mp, np_, kp = -(-m // bm) * bm, -(-n // bn) * bn, -(-k // bk) * bk
    a_batched, b_batched = a3.shape[0] > 1, b3.shape[0] > 1

    def a_map(bi, i, j):
        return (bi if a_batched else 0, 0, i) if transpose_a else (bi if a_batched else 0, i, 0)

    def b_map(bi, i, j):
        return (bi if b_batched else 0, j, 0) if transpose_b else (bi if b_batched else 0, 0, j)

    in_specs = [
        pl.BlockSpec((None, kp, bm) if transpose_a else (None, bm, kp), a_map),
        pl.BlockSpec((None, bn, kp) if transpose_b else (None, kp, bn), b_map),
    ]
    operands = [a3, b3]
    has_vec = has_bias or has_scale
    if has_vec:
        operands.append(mc.scale_bias_rows(scale, bias, n, bn))
        in_specs.append(pl.BlockSpec((2, bn), lambda bi, i, j: (0, j)))
    if has_residual:
        r3 = residual.reshape((batch, m, n))
        operands.append(mc.pad_to(mc.pad_to(r3, 1, bm), 2, bn))
        in_specs.append(pl.BlockSpec((None, bm, bn), lambda bi, i, j: (bi, i, j)))
    precision = lax.Precision.HIGHEST if np.dtype(a.dtype).itemsize == 4 else None
    kern = functools.partial(
        _kernel,
        k_steps=kp // bk,
        bk=bk,
        transpose_a=transpose_a,
        transpose_b=transpose_b,
        has_vec=has_vec,
        has_scale=has_scale,
        has_bias=has_bias,
        has_res=has_residual,
        activation=activation,
        out_dtype=out_dtype,
        precision=precision,
    )
    out = pl.pallas_call(
        kern,
        grid=(batch, mp // bm, np_ // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bm, bn), lambda bi, i, j: (bi, i, j)),
        out_shape=jax.ShapeDtypeStruct((batch, mp, np_), out_dtype),
        interpret=interpret,
    )(*operands)
    out = out[:, :m, :n]
    return out.reshape((*lead, m, n)) if lead else out[0]


def supports(avals_in: Sequence[Any], params: dict[str, Any], platform: str | None) -> str | None:
    """None if this kernel can run the case (on any platform: a plain pallas_call), else
    why not."""
    a, b = avals_in[0], avals_in[1]
    da, db = np.dtype(a.dtype), np.dtype(b.dtype)
    if da != db or da not in _FLOATS:
        return f"operand dtypes {da} x {db} (the portable kernel takes f16/bf16/f32 pairs)"
    return mc.unsupported_contract(avals_in, params)


def prefer(avals_in: Sequence[Any], params: dict[str, Any]) -> bool:
    """Never in ``auto``: cuBLAS beats this fallback; it runs under ``pallas``/``interpret``."""
    del avals_in, params
    return False
