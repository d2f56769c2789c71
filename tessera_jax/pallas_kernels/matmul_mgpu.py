"""Hopper (sm_90a) matmul in Pallas Mosaic GPU: TMA, wgmma, a warp-specialised multi-stage
pipeline over a persistent grid, and a fused epilogue.

Structure of one CTA (see :mod:`.matmul_configs` for the tile parameters):

* three warpgroups: one *memory* warpgroup streams ``(BM, BK)`` A tiles and
  ``(BK, BN)`` B tiles with TMA into a ``num_stages``-deep ring of 128-byte-swizzled
  shared-memory buffers; two *compute* warpgroups each own half of the C tile and
  issue ``wgmma`` into f32 accumulators in registers (``emit_pipeline_warp_specialized``);
* a persistent loop: ``min(#SMs, #tiles)`` CTAs walk the (batch, M-tile, N-tile)
  space in a planar snake, so consecutive tiles share A rows / B columns in L2
  (optionally in 2-CTA clusters that TMA-multicast their shared operand tile);
* the epilogue runs on the registers of the accumulator: ``scale · acc + bias``,
  the activation, ``+ residual`` (staged into shared memory with TMA), the cast to
  ``out_dtype``, and a double-buffered TMA store — one pass over C. The two-output form
  (``ts_matmul_with_derivative``) also writes the activation's derivative at the
  pre-activation, through a second staging buffer, from the same registers. Outside the
  ``ts_matmul`` contract, an ``(M,)`` row scale may multiply the accumulator's rows first
  (``ts.rmsnorm_matmul``'s ``1/rms(x)``, see :func:`matmul`).

Transposed operands cost no copy: a ``(K, M)`` A or an ``(N, K)`` B is loaded as
stored and handed to wgmma through a transposed view of its shared-memory tile
(the instruction's transpose bits, 16-bit types). 8-bit wgmma only reads K-major
tiles, so fp8 operands are brought to ``A (M, K)`` / ``B (N, K)`` (an XLA transpose,
as cuBLASLt's fp8 path does too). Mixed e4m3 × e5m2 runs on the fp8 tensor cores
(wgmma's separate A/B types) from jax 0.11; on 0.10, whose wgmma wants one element
type, on bf16 copies (exact: both formats embed in bf16).

Edge tiles (M, N, K not multiples of the tile) cost no copies: TMA loads fill zeros
past the end of an array and stores skip it. Only a dim that Mosaic GPU's (8, swizzle
row) tiling of the array cannot address (longer than one tile and not whole tiles, or
a row not a whole number of 16-byte units) is zero-padded, and narrow outputs are
computed two swizzle rows wide (see :func:`_pad_for_kernel`). Batched operands run in
the same persistent loop; a batch of A against one shared B folds into M.

The module follows jax's own ``hopper_matmul_mgpu.py``: a frozen :class:`Problem`
describes one call (shapes as the kernel sees them, dtypes, config, flags, grid), the
kernel body and its pipeline and epilogue pieces are module-level functions of it, and
:func:`_build` returns the ``plgpu.kernel`` call. :func:`matmul` is the wrapper in the
kernel calling convention of ``primitives/_core.py`` (``fn(spec, *operands, interpret)``),
with :func:`supports`, :func:`prefer` and :func:`hardware` beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from tessera_jax import _compat, autotune
from tessera_jax.contracts.matmul import MatmulSpec, activation_derivative, apply_activation
from tessera_jax.pallas_kernels import device
from tessera_jax.pallas_kernels import matmul_configs as mc
from tessera_jax.pallas_kernels.matmul_configs import FP8_DTYPES, MatmulConfig

__all__ = [
    "MatmulConfig",
    "Problem",
    "hardware",
    "matmul",
    "prefer",
    "supports",
    "tuned_config",
]


def _erf(x: jax.Array) -> jax.Array:
    """erf from exp and a rational term (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7).

    Mosaic GPU's warpgroup lowering has no layout rule for ``math.erf`` (jax 0.10);
    exp, abs and division lower everywhere.
    """
    ax = jnp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * ax)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    y = 1.0 - poly * jnp.exp(-(ax * ax))
    return jnp.where(x < 0.0, -y, y)


def _tile_cols(dtype: Any, minor_elems: int) -> int:
    """Columns of the ``(8, cols)`` swizzled tiles of a shared-memory block whose rows hold
    ``minor_elems`` (one swizzle row: the largest swizzle, up to 128 bytes, dividing them).
    Global arrays moved with TMA into such blocks are addressed in the same tiles."""
    bits = np.dtype(dtype).itemsize * 8
    return plgpu.find_swizzle(minor_elems * bits) * 8 // bits


def _smem_transforms(dtype: Any, minor_elems: int) -> tuple[Any, Any]:
    """The tiling and swizzle of a shared-memory block whose rows hold ``minor_elems``."""
    cols = _tile_cols(dtype, minor_elems)
    return (
        plgpu.TilingTransform((mc.TILE_ROWS, cols)),
        plgpu.SwizzleTransform(cols * np.dtype(dtype).itemsize),
    )


# --- the problem --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    """One kernel call: a 3-D (batch-first) product of operands as stored and as passed to
    the kernel (already padded where TMA needs it), and how the kernel runs it.

    Attributes:
      config: the tile configuration (already fitted to shared memory).
      batch: products the persistent loop walks (1 when a shared B folded them into M).
      a_batched, b_batched: the operand holds one matrix per product (else one, shared).
      m, n, k: the problem as the kernel sees it (the output is ``(batch, m, n)``).
      dtype_a, dtype_b: the element types wgmma reads.
      out_dtype: the output's dtype.
      res_dtype: the residual's dtype, or None without a residual.
      transpose_a, transpose_b: A is stored ``(K, M)``, B ``(N, K)``.
      has_scale, has_bias: rows 0 / 1 of the ``(2, N)`` f32 epilogue operand apply.
      has_row_scale: an ``(M,)`` f32 operand scales the accumulator's rows before the
        epilogue (the fused rmsnorm prologue's ``1/rms(x)``; not part of ``ts_matmul``).
      activation: the epilogue activation.
      num_sms: SMs the persistent grid may span (``device.sm_counts(...).grid``).
      with_derivative: a second output, ``act'(z)`` at the pre-activation ``z``, in
        ``out_dtype`` (the ``ts_matmul_with_derivative`` contract).
    """

    config: MatmulConfig
    batch: int
    a_batched: bool
    b_batched: bool
    m: int
    n: int
    k: int
    dtype_a: np.dtype
    dtype_b: np.dtype
    out_dtype: np.dtype
    res_dtype: np.dtype | None
    transpose_a: bool
    transpose_b: bool
    has_scale: bool
    has_bias: bool
    activation: str | None
    num_sms: int
    has_row_scale: bool = False
    with_derivative: bool = False

    @property
    def has_vec(self) -> bool:
        """Whether the kernel takes the ``(2, N)`` scale/bias operand."""
        return self.has_scale or self.has_bias

    @property
    def has_res(self) -> bool:
        return self.res_dtype is not None

    @property
    def iters(self) -> tuple[int, int, int]:
        """Cluster tiles along M and N, and K steps. Edge tiles reach past M/N/K: TMA loads
        fill zeros there (so a K tail adds nothing) and TMA stores skip it."""
        cm, cn = self.config.cluster_tile
        return -(-self.m // cm), -(-self.n // cn), -(-self.k // self.config.block_k)

    @property
    def tiles_per_batch(self) -> int:
        m_iters, n_iters, _ = self.iters
        return m_iters * n_iters

    @property
    def num_tiles(self) -> int:
        return self.batch * self.tiles_per_batch

    @property
    def grid(self) -> int:
        """CTAs of the persistent grid: one per SM (a cluster per pair), at most one per tile."""
        return max(1, min(self.num_sms // self.config.cluster_size, self.num_tiles))

    @property
    def num_out_slots(self) -> int:
        """Epilogue staging buffers of a warpgroup: two (double-buffered stores) unless its
        tile is one epilogue tile."""
        cfg = self.config
        wm, wn = cfg.wg_tile
        return min(2, (wm * wn) // (cfg.epi_tile_m * cfg.epi_tile_n))

    @property
    def a_block(self) -> tuple[int, int]:
        """A's tile as stored: ``(BM, BK)`` or, transposed, ``(BK, BM)``."""
        bm, _, bk = self.config.tile_shape
        return (bk, bm) if self.transpose_a else (bm, bk)

    @property
    def b_block(self) -> tuple[int, int]:
        """B's tile as stored: ``(BK, BN)`` or, transposed, ``(BN, BK)``."""
        _, bn, bk = self.config.tile_shape
        return (bn, bk) if self.transpose_b else (bk, bn)


class _Refs(NamedTuple):
    """The kernel's references: operands and output in global memory, then its scratch."""

    a: Any
    b: Any
    vec: Any  # (2, N) f32 scale/bias rows, or None
    res: Any  # residual, or None
    rows: Any  # (M,) f32 row scale, or None
    out: Any
    deriv: Any  # the derivative output (two-output form), or None
    out_smem: Any  # (wgs, slots, epi_m, epi_n) output staging
    deriv_smem: Any  # the derivative's staging like out_smem, or None
    res_smem: Any  # residual staging like out_smem, or None
    vec_smem: Any  # (wgs, 2, wn) a warpgroup's scale/bias columns, or None
    epi_barrier: Any  # per warpgroup: [scale/bias, residual slot 0, slot 1], or None
    rows_smem: Any = None  # (wgs, wm) a warpgroup's row scales, or None
    rows_barrier: Any = None  # one per warpgroup for the row-scale copy, or None


def _unpack_refs(p: Problem, refs: Sequence[Any]) -> _Refs:
    """The kernel's positional refs (operands, output, scratch; see :func:`_build`) by name."""
    refs = list(refs)
    a, b = refs.pop(0), refs.pop(0)
    vec = refs.pop(0) if p.has_vec else None
    res = refs.pop(0) if p.has_res else None
    rows = refs.pop(0) if p.has_row_scale else None
    out = refs.pop(0)
    deriv = refs.pop(0) if p.with_derivative else None
    out_smem = refs.pop(0)
    deriv_smem = refs.pop(0) if p.with_derivative else None
    res_smem = refs.pop(0) if p.has_res else None
    vec_smem = refs.pop(0) if p.has_vec else None
    epi_barrier = refs.pop(0) if (p.has_res or p.has_vec) else None
    rows_smem, rows_barrier = (refs.pop(0), refs.pop(0)) if p.has_row_scale else (None, None)
    return _Refs(
        a,
        b,
        vec,
        res,
        rows,
        out,
        deriv,
        out_smem,
        deriv_smem,
        res_smem,
        vec_smem,
        epi_barrier,
        rows_smem,
        rows_barrier,
    )


class _Tile(NamedTuple):
    """Where one output tile of the persistent loop lies, and this warpgroup's part of it."""

    batch: Any  # product index
    m: Any  # the CTA's rows of C
    n: Any  # the CTA's columns of C
    wg_m: Any  # the warpgroup's rows within the CTA tile
    wg_n: Any  # the warpgroup's columns within the CTA tile
    wg: Any  # the warpgroup index


# --- the kernel body ----------------------------------------------------------------------------


def _kernel(*refs: Any, p: Problem) -> None:
    """One CTA: the persistent loop over output tiles, each a warp-specialised K pipeline
    followed by the fused epilogue."""
    r = _unpack_refs(p, refs)
    allocs = _pipeline(p, _ignore, _ignore).get_allocations(r.a.at[0], r.b.at[0])

    @functools.partial(pl.run_scoped, pipeline_allocs=allocs, collective_axes="wg")
    def _scope(pipeline_allocs):
        wg_idx = lax.axis_index("wg")

        @plgpu.nd_loop((p.num_tiles,), collective_axes="sm")
        def _tile_loop(loop_info):
            (lin,) = loop_info.index
            t = _tile(p, lin, wg_idx)
            a = r.a.at[t.batch if p.a_batched else 0]
            b = r.b.at[t.batch if p.b_batched else 0]
            a_tile = a.at[:, t.m] if p.transpose_a else a.at[t.m, :]
            b_tile = b.at[t.n, :] if p.transpose_b else b.at[:, t.n]
            pipeline = _pipeline(
                p,
                functools.partial(_mma_step, p=p, t=t),
                functools.partial(_compute_tile, p=p, r=r, t=t),
            )
            pipeline(a_tile, b_tile, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores


def _ignore(*_, **__) -> None:
    """A pipeline body for sizing the pipeline's allocations (bodies don't change them)."""


def _tile(p: Problem, lin: Any, wg_idx: Any) -> _Tile:
    """The output tile at position ``lin`` of the persistent loop: (batch, M-tile, N-tile) in a
    planar snake, so consecutive tiles share A rows or B columns in L2."""
    cfg = p.config
    bm, bn, _ = cfg.tile_shape
    wm, wn = cfg.wg_tile
    m_iters, n_iters, _ = p.iters
    if p.batch > 1:
        b_idx = lin // p.tiles_per_batch
        lin = lin % p.tiles_per_batch
    else:
        b_idx = 0
    minor_dim = 0 if cfg.grid_minor_dim == "m" else 1
    m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), minor_dim, cfg.grid_tile_width)
    if cfg.cluster_dimension == "m":
        m_idx = m_idx * 2 + lax.axis_index("cluster")
    elif cfg.cluster_dimension == "n":
        n_idx = n_idx * 2 + lax.axis_index("cluster")
    if cfg.wg_dimension == "m":
        wg_m, wg_n = pl.ds(wg_idx * wm, wm), slice(None)
    else:
        wg_m, wg_n = slice(None), pl.ds(wg_idx * wn, wn)
    return _Tile(b_idx, pl.ds(m_idx * bm, bm), pl.ds(n_idx * bn, bn), wg_m, wg_n, wg_idx)


def _operand_spec(p: Problem, block, index, transforms, multicast_dim: str) -> Any:
    """An operand's pipeline BlockSpec. A cluster split along N shares (TMA-multicasts) its
    A tile; one split along M, its B tile."""
    return plgpu.BlockSpec(
        block,
        index,
        transforms=transforms,
        memory_space=plgpu.SMEM,
        delay_release=p.config.delay_release,
        collective_axes=("cluster",) if p.config.cluster_dimension == multicast_dim else (),
    )


def _pipeline(p: Problem, body, compute_context) -> Any:
    """The warp-specialised K pipeline of one output tile: a memory warpgroup streams the
    operand tiles into a ``num_stages``-deep ring; the compute warpgroups run ``body``."""
    a_index = (lambda kk: (kk, 0)) if p.transpose_a else (lambda kk: (0, kk))
    b_index = (lambda kk: (0, kk)) if p.transpose_b else (lambda kk: (kk, 0))
    a_tf = _smem_transforms(p.dtype_a, p.a_block[1])
    b_tf = _smem_transforms(p.dtype_b, p.b_block[1])
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(p.iters[2],),
        memory_registers=40,
        in_specs=[
            _operand_spec(p, p.a_block, a_index, a_tf, "n"),
            _operand_spec(p, p.b_block, b_index, b_tf, "m"),
        ],
        wg_axis="wg",
        num_compute_wgs=mc.NUM_COMPUTE_WGS,
        max_concurrent_steps=p.config.num_stages,
        compute_context=compute_context,
    )


def _mma_step(_, a_smem, b_smem, acc_ref, *, p: Problem, t: _Tile):
    """One K step of a compute warpgroup: its rows of A times its columns of B into the
    accumulator. A transposed operand is read through a transposed view of its tile."""
    if p.transpose_a:
        a_op = a_smem.at[:, t.wg_m].transpose((1, 0))
    else:
        a_op = a_smem.at[t.wg_m]
    if p.transpose_b:
        b_op = b_smem.at[t.wg_n].transpose((1, 0))
    else:
        b_op = b_smem.at[:, t.wg_n]
    plgpu.wgmma(acc_ref, a_op, b_op)
    plgpu.wgmma_wait(p.config.delay_release)
    return acc_ref


def _compute_tile(eval_pipeline, *, p: Problem, r: _Refs, t: _Tile) -> None:
    """A compute warpgroup's work on one output tile: the K pipeline into an f32 accumulator
    in registers, then the epilogue from it."""
    wm, wn = p.config.wg_tile
    pl.run_scoped(
        functools.partial(_accumulate_and_store, eval_pipeline=eval_pipeline, p=p, r=r, t=t),
        acc_ref=plgpu.ACC((wm, wn), jnp.float32),
    )


def _accumulate_and_store(acc_ref, *, eval_pipeline, p: Problem, r: _Refs, t: _Tile) -> None:
    """The fused epilogue over the accumulator, in ``(epi_m, epi_n)`` sub-tiles through a
    double-buffered shared-memory slot and a TMA store each."""
    cfg = p.config
    wm, wn = cfg.wg_tile
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    bars = 1 + p.num_out_slots  # a warpgroup's barriers: scale/bias, then one per slot
    if p.has_vec:
        # This warpgroup's columns of the scale/bias rows, issued before the main loop so the
        # copy hides behind it.
        plgpu.copy_gmem_to_smem(
            r.vec.at[:, t.n].at[:, t.wg_n], r.vec_smem.at[t.wg], r.epi_barrier.at[t.wg * bars]
        )
    if p.has_row_scale:
        # This warpgroup's rows of the row scale, likewise hidden behind the main loop.
        plgpu.copy_gmem_to_smem(
            r.rows.at[t.m].at[t.wg_m], r.rows_smem.at[t.wg], r.rows_barrier.at[t.wg]
        )
    eval_pipeline(acc_ref)
    acc = acc_ref[...]
    if p.has_vec:
        plgpu.barrier_wait(r.epi_barrier.at[t.wg * bars])
    if p.has_row_scale:
        plgpu.barrier_wait(r.rows_barrier.at[t.wg])
    out_wg = r.out.at[t.batch].at[t.m, t.n].at[t.wg_m, t.wg_n]
    deriv_wg = r.deriv.at[t.batch].at[t.m, t.n].at[t.wg_m, t.wg_n] if p.with_derivative else None
    res_wg = r.res.at[t.batch].at[t.m, t.n].at[t.wg_m, t.wg_n] if p.has_res else None
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores
    for ei in range(wm // epi_m):
        for ej in range(wn // epi_n):
            esl_m = slice(ei * epi_m, (ei + 1) * epi_m)
            esl_n = slice(ej * epi_n, (ej + 1) * epi_n)
            slot = (ei * (wn // epi_n) + ej) % 2
            bar = r.epi_barrier.at[t.wg * bars + 1 + slot] if p.has_res else None
            if p.has_res:
                plgpu.copy_gmem_to_smem(res_wg.at[esl_m, esl_n], r.res_smem.at[t.wg, slot], bar)
            v = acc[esl_m, esl_n]
            if p.has_row_scale:
                rcol = r.rows_smem[t.wg, esl_m]
                v = v * lax.broadcast_in_dim(rcol, (epi_m, epi_n), (0,))
            if p.has_scale:
                srow = r.vec_smem[t.wg, 0, esl_n]
                v = v * lax.broadcast_in_dim(srow, (epi_m, epi_n), (1,))
            if p.has_bias:
                brow = r.vec_smem[t.wg, 1, esl_n]
                v = v + lax.broadcast_in_dim(brow, (epi_m, epi_n), (1,))
            z = v
            v = apply_activation(z, p.activation, erf=_erf)
            # One bulk-copy group per sub-tile (both stores of the two-output form), so
            # waiting for all but the last group frees this slot's buffers.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's previous stores
            if p.has_res:
                plgpu.barrier_wait(bar)
                v = v + r.res_smem[t.wg, slot].astype(jnp.float32)
            r.out_smem[t.wg, slot] = v.astype(p.out_dtype)
            if p.with_derivative:
                d = activation_derivative(z, p.activation, erf=_erf)
                r.deriv_smem[t.wg, slot] = d.astype(p.out_dtype)
            plgpu.commit_smem()
            if p.with_derivative:
                plgpu.copy_smem_to_gmem(
                    r.deriv_smem.at[t.wg, slot], deriv_wg.at[esl_m, esl_n], commit_group=False
                )
            plgpu.copy_smem_to_gmem(r.out_smem.at[t.wg, slot], out_wg.at[esl_m, esl_n])


def _scratch_types(p: Problem) -> list[Any]:
    """The kernel's scratch, in the order :func:`_unpack_refs` reads it."""
    cfg = p.config
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    slots = (mc.NUM_COMPUTE_WGS, p.num_out_slots, epi_m, epi_n)
    out_tf = _smem_transforms(p.out_dtype, epi_n)
    scratch = [plgpu.SMEM(slots, p.out_dtype, transforms=out_tf)]
    if p.with_derivative:
        scratch.append(plgpu.SMEM(slots, p.out_dtype, transforms=out_tf))
    if p.has_res:
        scratch.append(
            plgpu.SMEM(slots, p.res_dtype, transforms=_smem_transforms(p.res_dtype, epi_n))
        )
    if p.has_vec:
        scratch.append(plgpu.SMEM((mc.NUM_COMPUTE_WGS, 2, cfg.wg_tile[1]), jnp.float32))
    if p.has_res or p.has_vec:
        scratch.append(plgpu.Barrier(num_barriers=mc.NUM_COMPUTE_WGS * (1 + p.num_out_slots)))
    if p.has_row_scale:
        scratch.append(plgpu.SMEM((mc.NUM_COMPUTE_WGS, cfg.wg_tile[0]), jnp.float32))
        scratch.append(plgpu.Barrier(num_barriers=mc.NUM_COMPUTE_WGS))
    return scratch


def _build(p: Problem) -> Any:
    """The ``plgpu.kernel`` computing ``p``: ``a, b[, vec][, res][, rows]`` -> ``(batch, m, n)``
    (and, with ``p.with_derivative``, a second such array, the derivative)."""
    out = jax.ShapeDtypeStruct((p.batch, p.m, p.n), p.out_dtype)
    return plgpu.kernel(
        functools.partial(_kernel, p=p),
        out_type=(out, out) if p.with_derivative else out,
        scratch_types=_scratch_types(p),
        grid=(p.grid,),
        grid_names=("sm",),
        cluster=(p.config.cluster_size,),
        cluster_names=("cluster",),
        num_threads=mc.NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


# --- the wrapper (Kernel calling convention of primitives/_core.py) ----------------------------


def _to3d(x: jax.Array) -> jax.Array:
    lead = x.shape[:-2]
    return x.reshape((int(np.prod(lead, dtype=np.int64)) if lead else 1, *x.shape[-2:]))


def _folds_into_m(a_ndim: int, b_ndim: int, transpose_a: bool) -> bool:
    """Whether a batch of A against one shared B runs as one product with the batch folded
    into M (A's rows are contiguous across the batch only when A is not transposed)."""
    return a_ndim > 2 and b_ndim == 2 and not transpose_a


def _config(
    spec: MatmulSpec,
    dtype_a: np.dtype,
    dtype_b: np.dtype,
    m: int,
    n: int,
    k: int,
    res_dtype: np.dtype | None,
    *,
    tuned_sms: int,
    config: MatmulConfig | None = None,
    row_scaled: bool = False,
    outputs: int = 1,
) -> MatmulConfig:
    """The tile config of a product of ``(m, n, k)`` (M with a folded batch): ``config`` if
    given, else ``spec.tile_shape``'s, else the heuristic's; its pipeline shortened until it
    fits shared memory with this epilogue (``outputs`` staging buffers of ``out_dtype``).
    ValueError, naming the sm_90 limit, if it can't.
    A row scale's ``(wgs, wm)`` f32 block is budgeted as the ``(wgs, 2, wn)`` scale/bias
    block, which it must not exceed (so it runs without a scale or bias)."""
    if config is None:
        if spec.tile_shape is not None:
            config = mc.config_for_tile_shape(spec.tile_shape, dtype_a, dtype_b)
        else:
            config = mc.default_config(m, n, k, dtype_a, dtype_b, num_sms=tuned_sms)
    if row_scaled:
        wm, wn = config.wg_tile
        if spec.has_bias or spec.has_scale or wm > 2 * wn:
            raise ValueError(
                f"a row scale with has_bias={spec.has_bias}, has_scale={spec.has_scale} and a "
                f"warpgroup tile {config.wg_tile} (the kernel takes it alone, rows <= 2 * cols)"
            )
    has_vec = spec.has_bias or spec.has_scale or row_scaled
    return mc.fit_stages(
        config, dtype_a, dtype_b, spec.out_dtype, res_dtype, has_vec, outputs=outputs
    )


def tuned_config(spec: MatmulSpec, avals: Sequence[Any]) -> MatmulConfig | None:
    """The autotuned config of this product (``ts.autotune.search(kernel=ts.op.matmul)``
    stored it for these shapes and dtypes on this device), or None: with an explicit
    ``spec.tile_shape``, without a cache entry, or with one this kernel cannot read (a
    warning). Read at trace time; the autotune cache keeps parsed entries in memory."""
    if spec.tile_shape is not None:
        return None
    tuned = autotune.lookup(mc.TUNING_NAME, mc.tuning_key(spec, avals))
    if tuned is None:
        return None
    dts = mc.kernel_operand_dtypes(avals[0].dtype, avals[1].dtype)
    if dts is None:
        return None
    try:
        return mc.config_from_tuned(tuned, *dts)
    except (TypeError, ValueError) as e:
        warnings.warn(
            f"matmul: ignoring the autotuned config {tuned} ({e}); using the heuristic's",
            autotune.CacheWarning,
            stacklevel=2,
        )
        return None


def _pad_for_kernel(
    p: Problem, a3: jax.Array, b3: jax.Array, m: int, n: int, k: int, *, interpret: bool
) -> tuple[jax.Array, jax.Array, int, int, int]:
    """The operands padded where the kernel can't address them, and the ``(m, n, k)`` the
    kernel then computes, from the product's ``(m, n, k)`` and ``p``'s config, dtypes and
    layout.

    Edge tiles need no copies: TMA reads zeros past the end of an array (a K tail adds
    nothing) and skips stores there. Mosaic GPU addresses a global array in the (8, cols)
    tiles of its shared-memory block, though, and a dim longer than one tile must be whole
    tiles: only such dims are zero-padded (K padding zeros, M/N padding cut off the
    result). jax 0.10's interpreter has no out-of-bounds copies: there, whole tiles are
    padded.
    """
    cfg = p.config
    bm, bn, bk = cfg.tile_shape
    cm, cn = cfg.cluster_tile
    if interpret and not _compat.MGPU_INTERPRET_TMA_OOB:
        a3, b3 = mc.pad_operands(a3, b3, p.transpose_a, p.transpose_b, cm, cn, bk)
        return a3, b3, (-(-m // cm)) * cm, (-(-n // cn)) * cn, (-(-k // bk)) * bk
    a3 = mc.pad_for_tma(a3, _tile_cols(p.dtype_a, bm if p.transpose_a else bk))
    b3 = mc.pad_for_tma(b3, _tile_cols(p.dtype_b, bk if p.transpose_b else bn))
    # Output rows of at least two swizzle rows: on the H100 a bf16 output of one 64-column
    # tile (N <= 64) came back unwritten (all zeros) when a warpgroup's second epilogue store
    # fell past it; wider rows, f32 rows and loads were right.
    np_ = n
    for t in (p.out_dtype, p.res_dtype):
        if t is not None:
            cols = _tile_cols(t, cfg.epi_tile_n)
            np_ = max(np_, mc.tma_extent(n, cols, t.itemsize), 2 * cols)
    return a3, b3, mc.tma_extent(m, mc.TILE_ROWS), np_, k


def matmul(
    spec: MatmulSpec,
    a: jax.Array,
    b: jax.Array,
    *extras: jax.Array,
    interpret: bool = False,
    config: MatmulConfig | None = None,
    num_sms: int | None = None,
    row_scale: jax.Array | None = None,
    with_derivative: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``cast(act(scale · op(a) @ op(b) + bias) + residual, spec.out_dtype)`` on Hopper.

    The ``ts_matmul`` contract of :mod:`tessera_jax.contracts.matmul`: ``extras`` are
    ``bias (N,)``, ``residual`` (output shape) and ``scale ()`` f32, each present only if
    ``spec`` says so. ``interpret`` runs the kernel in the Mosaic GPU interpreter (any
    platform). The tile config: ``spec.tile_shape``'s, else the one ``ts.autotune`` cached
    for this problem (:func:`tuned_config`), else the heuristic's. Keyword-only overrides
    for benchmarks and tests: ``config`` replaces all of those; ``num_sms`` the SM count
    (see ``device.sm_counts``).
    ``row_scale``, outside the ``ts_matmul`` contract, is an f32 array of ``op(a)``'s rows
    ``a.shape[:-1]`` (untransposed ``a``, shared ``b``, no scale or bias) multiplying the
    accumulator's rows before the epilogue: ``diag(row_scale) · (a @ b)``, the fused
    rmsnorm prologue of ``primitives/rmsnorm_matmul.py``.
    ``with_derivative``: the ``ts_matmul_with_derivative`` contract
    (``contracts/matmul.py``'s ``epilogue_with_derivative``): returns ``(out, act'(z))``,
    both ``spec.out_dtype``, the first computed exactly as without it.
    A case :func:`supports` declines is a ValueError naming the reason.
    """
    reason = supports(
        spec,
        (a, b, *extras),
        row_scaled=row_scale is not None,
        with_derivative=with_derivative,
    )
    if reason is not None:
        raise ValueError(f"matmul_mgpu.matmul: this kernel cannot run the case: {reason}")
    if config is None and row_scale is None:  # tuned for the plain product: not this one
        config = tuned_config(spec, (a, b, *extras))
    sms = device.sm_counts(interpret=interpret, override=num_sms)
    bias, residual, scale = spec.split(extras)
    m, n, k = spec.problem_shape(a.shape, b.shape)
    transpose_a, transpose_b = spec.transpose_a, spec.transpose_b

    dtype_a, dtype_b = mc.kernel_operand_dtypes(a.dtype, b.dtype)
    a, b = a.astype(dtype_a), b.astype(dtype_b)  # no-ops but for mixed fp8 before jax 0.11
    if dtype_a.itemsize == 1:  # 8-bit wgmma reads K-major tiles only: A (M, K), B (N, K)
        if transpose_a:
            a, transpose_a = jnp.swapaxes(a, -1, -2), False
        if not transpose_b:
            b, transpose_b = jnp.swapaxes(b, -1, -2), True

    lead = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    fold = _folds_into_m(a.ndim, b.ndim, transpose_a)
    a3, b3 = _to3d(a.reshape((-1, a.shape[-1])) if fold else a), _to3d(b)
    batch = 1 if fold else max(a3.shape[0], b3.shape[0])
    mm = a3.shape[1] if fold else m

    res_dtype = np.dtype(residual.dtype) if residual is not None else None
    cfg = _config(
        spec,
        dtype_a,
        dtype_b,
        mm,
        n,
        k,
        res_dtype,
        tuned_sms=sms.tuned,
        config=config,
        row_scaled=row_scale is not None,
        outputs=2 if with_derivative else 1,
    )
    if interpret and cfg.cluster_dimension is not None:
        # The interpreter has no cluster-collective (multicast) allocations: same tiles, no pair.
        cfg = cfg.replace(cluster_dimension=None)
    p = Problem(
        config=cfg,
        batch=batch,
        a_batched=a3.shape[0] > 1,
        b_batched=b3.shape[0] > 1,
        m=mm,
        n=n,
        k=k,
        dtype_a=dtype_a,
        dtype_b=dtype_b,
        out_dtype=spec.out_dtype,
        res_dtype=res_dtype,
        transpose_a=transpose_a,
        transpose_b=transpose_b,
        has_scale=spec.has_scale,
        has_bias=spec.has_bias,
        activation=spec.activation,
        num_sms=sms.grid,
        has_row_scale=row_scale is not None,
        with_derivative=with_derivative,
    )
    a3, b3, mp, np_, kp = _pad_for_kernel(p, a3, b3, mm, n, k, interpret=interpret)
    p = dataclasses.replace(p, m=mp, n=np_, k=kp)

    operands = [a3, b3]
    if p.has_vec:
        operands.append(mc.scale_bias_rows(scale, bias, n, cfg.cluster_tile[1]))
    if residual is not None:
        r3 = residual.reshape((batch, mm, n))
        operands.append(mc.pad_to_extent(mc.pad_to_extent(r3, 1, mp), 2, np_))
    if row_scale is not None:
        # Whole cluster tiles of rows (>= mp): every tile's copy stays inside the array.
        rows = row_scale.astype(jnp.float32).reshape(mm)
        operands.append(mc.pad_to(rows, 0, cfg.cluster_tile[0]))

    call = _build(p)
    outs = device.run_mosaic(call, operands, interpret=interpret)

    def result(out):
        if (mp, np_) != (mm, n):
            out = out[:, :mm, :n]
        return out.reshape((*lead, m, n)) if fold or lead else out[0]

    return tuple(map(result, outs)) if with_derivative else result(outs)


# --- dispatch ----------------------------------------------------------------------------------


def hardware(platform: str) -> str | None:
    """None if this machine's ``platform`` devices can run the compiled kernel, else why not."""
    return device.hopper_only(platform, "a Mosaic GPU kernel")


def supports(
    spec: MatmulSpec,
    avals: Sequence[Any],
    *,
    row_scaled: bool = False,
    with_derivative: bool = False,
) -> str | None:
    """None if this kernel can run the case, else why not (never raises): the operand
    dtypes, the parts of the contract it does not cover, and a tile (``spec.tile_shape``, or
    the heuristic's) that sm_90 cannot run with this epilogue (and a row scale, with
    ``row_scaled``, or the derivative output, with ``with_derivative``: see :func:`matmul`)."""
    a, b = avals[0], avals[1]
    if with_derivative and (spec.activation is None or row_scaled):
        return (
            f"a derivative output with activation={spec.activation!r} and "
            f"row_scaled={row_scaled} (it needs an activation, and no row scale)"
        )
    if row_scaled and (spec.transpose_a or b.ndim != 2 or spec.has_bias or spec.has_scale):
        return (
            f"a row scale with transpose_a={spec.transpose_a}, b of rank {b.ndim}, "
            f"has_bias={spec.has_bias}, has_scale={spec.has_scale} (it takes an untransposed a "
            "against a 2-D b, without scale or bias)"
        )
    da, db = np.dtype(a.dtype), np.dtype(b.dtype)
    dts = mc.kernel_operand_dtypes(da, db)
    if dts is None:
        return f"operand dtypes {da} x {db} (the kernel takes bf16/f16 pairs or fp8 e4m3/e5m2)"
    reason = mc.unsupported_contract(spec, avals)
    if reason is not None:
        return reason
    m, n, k = spec.problem_shape(a.shape, b.shape)
    if _folds_into_m(a.ndim, b.ndim, spec.transpose_a and dts[0].itemsize > 1):
        m *= int(np.prod(a.shape[:-2]))
    res_dtype = np.dtype(avals[2 + spec.has_bias].dtype) if spec.has_residual else None
    try:
        _config(
            spec,
            *dts,
            m,
            n,
            k,
            res_dtype,
            tuned_sms=device.sm_counts(interpret=False).tuned,
            config=None if row_scaled else tuned_config(spec, avals),
            row_scaled=row_scaled,
            outputs=2 if with_derivative else 1,
        )
    except ValueError as e:
        return str(e)
    return None


# Dispatch rules: the classes of cases where the kernel measured at least as fast as XLA's
# cuBLAS(Lt) path in the same process on the H100 (benchmarks/results/matmul-h100.json and
# the edge-shape probes, benchmarks/archive/matmul-edges-h100-*.txt):
# * fp8 with one format for both operands, from PREFER_MIN_FP8 on each of M, N, K (ragged
#   shapes included);
# * 16-bit with a fused epilogue (bias / activation / residual / scale), from
#   PREFER_MIN_EPILOGUE on each of M, N, K and whole tiles only (ragged shapes tie). A
#   GELU layer alone is faster on the kernel from K = 1024 too (linear-grad-h100.json),
#   but the training step (benchmarks/train.py) measured slower with those layers on it.
# * 16-bit with M <= DECODE_M (decode; memory-bound): K in DECODE_K, N >= DECODE_MIN_N and one
#   wave of 128-column tiles over N (longer K or wider N measured behind cuBLAS).
# Everything else goes to XLA: plain 16-bit products are at parity with cuBLAS (not a win,
# behind it at small K); XLA runs mixed e4m3 x e5m2 faster; batched x batched products (the
# batch loop) are unmeasured.
PREFER_MIN_FP8 = 1024
PREFER_MIN_EPILOGUE = 4096
DECODE_K = (4096, 8192)
DECODE_MIN_N = 4096
# Plain 16-bit products: None = XLA. A size here would route them to the kernel (a tie with
# cuBLAS), worth it only while the XLA path is slower than jnp.dot.
PREFER_PLAIN_MIN: int | None = None


def prefer(spec: MatmulSpec, avals: Sequence[Any]) -> bool:
    """Whether the kernel is expected to beat XLA/cuBLAS here (``auto`` mode on cuda).

    Only classes of cases where the kernel measured at least as fast as XLA (the rules
    above); everything else goes to XLA, so ``ts.op.matmul`` is never slower than
    ``jnp.dot``. Asked only of cases :func:`supports` accepts.
    """
    a, b = avals[0], avals[1]
    da, db = np.dtype(a.dtype), np.dtype(b.dtype)
    if da != db:
        return False  # mixed fp8: XLA's cuBLASLt path is faster
    if a.ndim > 2 and b.ndim > 2:
        return False  # batched x batched: the batch loop is unmeasured
    m, n, k = spec.problem_shape(a.shape, b.shape)
    if _folds_into_m(a.ndim, b.ndim, spec.transpose_a):
        m *= int(np.prod(a.shape[:-2]))
    elif a.ndim > 2 or b.ndim > 2:
        return False
    if da in FP8_DTYPES:
        return min(m, n, k) >= PREFER_MIN_FP8
    sms = device.sm_counts(interpret=False).tuned
    if spec.tile_shape is None and m <= mc.DECODE_M:
        one_wave = mc.decode_config(n, num_sms=sms) is mc.CANDIDATES["bf16_64x128x128_s4"]
        return DECODE_K[0] <= k <= DECODE_K[1] and n >= DECODE_MIN_N and one_wave
    lo = PREFER_MIN_EPILOGUE if spec.has_epilogue else PREFER_PLAIN_MIN
    if lo is None or min(m, n, k) < lo:
        return False
    cfg = tuned_config(spec, avals) or (
        mc.config_for_tile_shape(spec.tile_shape, da, db)
        if spec.tile_shape is not None
        else mc.default_config(m, n, k, da, db, num_sms=sms)
    )
    cm, cn = cfg.cluster_tile
    return m % cm == 0 and n % cn == 0 and k % cfg.block_k == 0
