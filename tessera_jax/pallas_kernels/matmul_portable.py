"""Portable matmul: a plain ``pl.pallas_call`` with BlockSpecs, for GPUs without Hopper
features (and for ``interpret=True`` anywhere).

Each program computes one ``(BM, BN)`` tile of one batch element: its BlockSpecs
bring a ``(BM, K)`` row panel of A and a ``(K, BN)`` column panel of B (as stored,
transposed or not), a loop walks K in ``BK`` slices into an f32 accumulator, and the
contract's epilogue (:func:`tessera_jax.contracts.matmul.epilogue`: scale, bias,
activation, residual, cast) runs before the single store (with ``with_derivative``, also
the activation's derivative: ``epilogue_with_derivative``, a second output). On a GPU
this lowers through Pallas' Triton backend (deprecated in jax 0.11 and used here only as
this fallback); block sizes are powers of two, and ragged M/N/K are zero-padded to whole
tiles.
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

from tessera_jax import _compat
from tessera_jax.contracts.matmul import MatmulSpec, epilogue, epilogue_with_derivative
from tessera_jax.pallas_kernels import device
from tessera_jax.pallas_kernels import matmul_configs as mc

__all__ = ["PortableConfig", "hardware", "matmul", "prefer", "supports"]

_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
# Pallas' Triton lowering emits mma instructions for 16-bit dots from Ampere on.
_MIN_COMPUTE_CAPABILITY = 8


def _is_block(v: Any) -> bool:
    return (
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 16 and not v & (v - 1)
    )


@dataclasses.dataclass(frozen=True)
class PortableConfig:
    """Block sizes ``(BM, BN, BK)``, each a power of two >= 16 (Triton's block rule)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not _is_block(v):
                raise ValueError(f"PortableConfig: {name}={v!r} must be a power of two >= 16")


def _kernel(*refs, k_steps, bk, spec: MatmulSpec, has_vec: bool, precision):
    refs = list(refs)
    a_ref, b_ref = refs.pop(0), refs.pop(0)
    vec_ref = refs.pop(0) if has_vec else None
    res_ref = refs.pop(0) if spec.has_residual else None
    out_refs = refs  # the output, and the derivative in the two-output form
    bm, bn = out_refs[0].shape
    ta, tb = spec.transpose_a, spec.transpose_b

    def body(i, acc):
        ks = pl.ds(i * bk, bk)
        a = a_ref[ks, :] if ta else a_ref[:, ks]
        b = b_ref[:, ks] if tb else b_ref[ks, :]
        dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
        return acc + lax.dot_general(
            a, b, dims, precision=precision, preferred_element_type=jnp.float32
        )

    acc = lax.fori_loop(0, k_steps, body, jnp.zeros((bm, bn), jnp.float32))
    scale = vec_ref[0:1, :] if spec.has_scale else None
    bias = vec_ref[1:2, :] if spec.has_bias else None
    residual = res_ref[...] if spec.has_residual else None
    finish = epilogue_with_derivative if len(out_refs) == 2 else epilogue
    outs = finish(acc, bias, residual, scale, activation=spec.activation, out_dtype=spec.out_dtype)
    for ref, v in zip(out_refs, outs if len(out_refs) == 2 else (outs,)):
        ref[...] = v


def matmul(
    spec: MatmulSpec,
    a: jax.Array,
    b: jax.Array,
    *extras: jax.Array,
    interpret: bool = False,
    config: PortableConfig | None = None,
    with_derivative: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``ts_matmul`` of ``spec`` with BlockSpecs (a case :func:`supports` accepts), or with
    ``with_derivative`` its two-output form ``(out, act'(z))``.

    ``config`` overrides the blocks (benchmarks); else ``spec.tile_shape``, else the
    default :class:`PortableConfig`.
    """
    bias, residual, scale = spec.split(extras)
    m, n, k = spec.problem_shape(a.shape, b.shape)
    ta, tb = spec.transpose_a, spec.transpose_b
    lead = tuple(jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    if config is None:
        config = PortableConfig(*spec.tile_shape) if spec.tile_shape else PortableConfig()
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    a3 = a.reshape((-1, *a.shape[-2:]))
    b3 = b.reshape((-1, *b.shape[-2:]))
    batch = max(a3.shape[0], b3.shape[0])
    a3, b3 = mc.pad_operands(a3, b3, ta, tb, bm, bn, bk)
    mp, np_, kp = -(-m // bm) * bm, -(-n // bn) * bn, -(-k // bk) * bk
    a_batched, b_batched = a3.shape[0] > 1, b3.shape[0] > 1

    def a_map(bi, i, j):
        return (bi if a_batched else 0, 0, i) if ta else (bi if a_batched else 0, i, 0)

    def b_map(bi, i, j):
        return (bi if b_batched else 0, j, 0) if tb else (bi if b_batched else 0, 0, j)

    in_specs = [
        pl.BlockSpec((None, kp, bm) if ta else (None, bm, kp), a_map),
        pl.BlockSpec((None, bn, kp) if tb else (None, kp, bn), b_map),
    ]
    operands = [a3, b3]
    has_vec = spec.has_bias or spec.has_scale
    if has_vec:
        operands.append(mc.scale_bias_rows(scale, bias, n, bn))
        in_specs.append(pl.BlockSpec((2, bn), lambda bi, i, j: (0, j)))
    if residual is not None:
        r3 = residual.reshape((batch, m, n))
        operands.append(mc.pad_to(mc.pad_to(r3, 1, bm), 2, bn))
        in_specs.append(pl.BlockSpec((None, bm, bn), lambda bi, i, j: (bi, i, j)))
    precision = lax.Precision.HIGHEST if np.dtype(a.dtype).itemsize == 4 else None
    kern = functools.partial(
        _kernel, k_steps=kp // bk, bk=bk, spec=spec, has_vec=has_vec, precision=precision
    )
    n_out = 2 if with_derivative else 1
    with device.int32_tracing():
        outs = pl.pallas_call(
            kern,
            grid=(batch, mp // bm, np_ // bn),
            in_specs=in_specs,
            out_specs=[pl.BlockSpec((None, bm, bn), lambda bi, i, j: (bi, i, j))] * n_out,
            out_shape=[jax.ShapeDtypeStruct((batch, mp, np_), spec.out_dtype)] * n_out,
            interpret=interpret,
        )(*operands)
    outs = [o[:, :m, :n] for o in outs]
    outs = [o.reshape((*lead, m, n)) if lead else o[0] for o in outs]
    return tuple(outs) if with_derivative else outs[0]


def supports(
    spec: MatmulSpec, avals: Sequence[Any], *, with_derivative: bool = False
) -> str | None:
    """None if this kernel can run the case, else why not: f16/bf16/f32 pairs, the
    contract parts both matmul kernels cover, power-of-two blocks >= 16, and with
    ``with_derivative`` an activation to differentiate."""
    if with_derivative and spec.activation is None:
        return "a derivative output with activation=None (it needs an activation)"
    da, db = np.dtype(avals[0].dtype), np.dtype(avals[1].dtype)
    if da != db or da not in _FLOATS:
        return f"operand dtypes {da} x {db} (the portable kernel takes f16/bf16/f32 pairs)"
    reason = mc.unsupported_contract(spec, avals)
    if reason is not None:
        return reason
    if spec.tile_shape is not None and not all(_is_block(t) for t in spec.tile_shape):
        return f"tile_shape={spec.tile_shape}: its blocks must be powers of two >= 16 (Triton)"
    return None


def prefer(spec: MatmulSpec, avals: Sequence[Any]) -> bool:
    """Never in ``auto``: cuBLAS beats this fallback; it runs under ``pallas``/``interpret``."""
    del spec, avals
    return False


def hardware(platform: str) -> str | None:
    """None if this process's GPUs can run the compiled kernel (compute capability >= 8).
    It compiles through Pallas' Triton backend; its interpreter needs none."""
    if platform != "cuda":
        return f"the portable kernel compiles for cuda, not {platform}"
    if _compat.TRITON_MISSING is not None:
        return _compat.TRITON_MISSING
    try:
        cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:  # no GPU backend in this process
        return "no GPU in this process"
    if cc is not None and int(str(cc).split(".")[0]) < _MIN_COMPUTE_CAPABILITY:
        return f"compute capability {cc} < {_MIN_COMPUTE_CAPABILITY}.0 (Triton's 16-bit mma)"
    return None
