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
  ``out_dtype``, and a double-buffered TMA store — one pass over C.

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
computed two swizzle rows wide (see ``matmul``). Batched operands run in the same
persistent loop; a batch of A against one shared B folds into M.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tessera_jax import _compat
from tessera_jax.contracts.matmul import MatmulSpec, apply_activation
from tessera_jax.pallas_kernels import device
from tessera_jax.pallas_kernels import matmul_configs as mc
from tessera_jax.pallas_kernels.matmul_configs import MatmulConfig, validate_tile_shape

__all__ = ["MatmulConfig", "hardware", "matmul", "prefer", "supports", "validate_tile_shape"]

_F8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))

# CTAs of the persistent grid in interpret mode: each simulated warpgroup is a CPU
# thread, so a small grid keeps CPU tests fast while still exercising the loop.
INTERPRET_NUM_SMS = 2


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


# --- the kernel --------------------------------------------------------------------------------


def _tile_cols(dtype: Any, minor_elems: int) -> int:
    """Columns of the ``(8, cols)`` swizzled tiles of a shared-memory block whose rows hold
    ``minor_elems`` (one swizzle row: the largest swizzle, up to 128 bytes, dividing them).
    Global arrays moved with TMA into such blocks are addressed in the same tiles."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bits = np.dtype(dtype).itemsize * 8
    return plgpu.find_swizzle(minor_elems * bits) * 8 // bits


def _build_kernel(
    *,
    cfg: MatmulConfig,
    batch: int,
    a_batched: bool,
    b_batched: bool,
    m: int,
    n: int,
    k: int,
    dtype_a: np.dtype,
    dtype_b: np.dtype,
    out_dtype: np.dtype,
    res_dtype: np.dtype | None,
    transpose_a: bool,
    transpose_b: bool,
    has_scale: bool,
    has_bias: bool,
    activation: str | None,
    num_sms: int,
    interpret: bool,
):
    """The ``plgpu.kernel`` computing one 3-D-batched problem of ``(m, n, k)`` as stored."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bm, bn, bk = cfg.tile_shape
    wm, wn = cfg.wg_tile
    cs = cfg.cluster_size
    cm, cn = cfg.cluster_tile
    # Edge tiles reach past M/N/K: TMA loads fill zeros there (so a K tail adds nothing) and
    # TMA stores skip it.
    m_iters, n_iters, k_iters = -(-m // cm), -(-n // cn), -(-k // bk)
    tiles_per_batch = m_iters * n_iters
    num_tiles = batch * tiles_per_batch
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    num_out_slots = min(2, (wm * wn) // (epi_m * epi_n))
    has_vec = has_scale or has_bias
    has_res = res_dtype is not None
    minor_dim = 0 if cfg.grid_minor_dim == "m" else 1
    dr = cfg.delay_release

    def swz(dt, minor_elems):
        cols = _tile_cols(dt, minor_elems)
        return (
            plgpu.TilingTransform((mc.TILE_ROWS, cols)),
            plgpu.SwizzleTransform(cols * np.dtype(dt).itemsize),
        )

    # Operand tiles as stored: A (BM, BK) or, transposed, (BK, BM); B (BK, BN) or (BN, BK).
    a_block = (bk, bm) if transpose_a else (bm, bk)
    b_block = (bn, bk) if transpose_b else (bk, bn)
    a_tf = swz(dtype_a, a_block[1])
    b_tf = swz(dtype_b, b_block[1])
    out_tf = swz(out_dtype, epi_n)
    res_tf = swz(res_dtype, epi_n) if has_res else None
    a_index = (lambda kk: (kk, 0)) if transpose_a else (lambda kk: (0, kk))
    b_index = (lambda kk: (0, kk)) if transpose_b else (lambda kk: (kk, 0))

    def kernel(a_gmem, b_gmem, *rest):
        rest = list(rest)
        vec_gmem = rest.pop(0) if has_vec else None
        res_gmem = rest.pop(0) if has_res else None
        out_gmem, out_smem = rest[0], rest[1]
        scr = rest[2:]
        res_smem = scr.pop(0) if has_res else None
        vec_smem = scr.pop(0) if has_vec else None
        epi_barrier = scr.pop(0) if (has_res or has_vec) else None

        def operand_spec(block, index, tf, multicast_dim):
            # A cluster split along N shares (multicasts) its A tile; along M, its B tile.
            return plgpu.BlockSpec(
                block,
                index,
                transforms=tf,
                memory_space=plgpu.SMEM,
                delay_release=dr,
                collective_axes=("cluster",) if cfg.cluster_dimension == multicast_dim else (),
            )

        def get_pipeline(body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    operand_spec(a_block, a_index, a_tf, "n"),
                    operand_spec(b_block, b_index, b_tf, "m"),
                ],
                wg_axis="wg",
                num_compute_wgs=mc.NUM_COMPUTE_WGS,
                max_concurrent_steps=cfg.num_stages,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None  # the bodies don't change the allocations
        a0 = a_gmem.at[0]
        b0 = b_gmem.at[0]

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a0, b0),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs):
            wg_idx = lax.axis_index("wg")

            @plgpu.nd_loop((num_tiles,), collective_axes="sm")
            def _tile_loop(loop_info):
                (lin,) = loop_info.index
                if batch > 1:
                    b_idx = lin // tiles_per_batch
                    lin = lin % tiles_per_batch
                else:
                    b_idx = 0
                m_idx, n_idx = plgpu.planar_snake(
                    lin, (m_iters, n_iters), minor_dim, cfg.grid_tile_width
                )
                if cfg.cluster_dimension == "m":
                    m_idx = m_idx * 2 + lax.axis_index("cluster")
                elif cfg.cluster_dimension == "n":
                    n_idx = n_idx * 2 + lax.axis_index("cluster")
                cta_m = pl.ds(m_idx * bm, bm)
                cta_n = pl.ds(n_idx * bn, bn)
                if cfg.wg_dimension == "m":
                    wg_m, wg_n = pl.ds(wg_idx * wm, wm), slice(None)
                else:
                    wg_m, wg_n = slice(None), pl.ds(wg_idx * wn, wn)
                a_b = a_gmem.at[b_idx if a_batched else 0]
                b_b = b_gmem.at[b_idx if b_batched else 0]
                a_tile = a_b.at[:, cta_m] if transpose_a else a_b.at[cta_m, :]
                b_tile = b_b.at[cta_n, :] if transpose_b else b_b.at[:, cta_n]
                out_wg = out_gmem.at[b_idx].at[cta_m, cta_n].at[wg_m, wg_n]
                res_wg = res_gmem.at[b_idx].at[cta_m, cta_n].at[wg_m, wg_n] if has_res else None

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
                    def _acc_scope(acc_ref):
                        if has_vec:
                            # scale/bias rows of this warpgroup's columns: issued before the
                            # main loop so the copy hides behind it.
                            plgpu.copy_gmem_to_smem(
                                vec_gmem.at[:, cta_n].at[:, wg_n],
                                vec_smem.at[wg_idx],
                                epi_barrier.at[wg_idx * (1 + num_out_slots)],
                            )
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...]
                        if has_vec:
                            plgpu.barrier_wait(epi_barrier.at[wg_idx * (1 + num_out_slots)])
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for ei in range(wm // epi_m):
                            for ej in range(wn // epi_n):
                                esl_m = slice(ei * epi_m, (ei + 1) * epi_m)
                                esl_n = slice(ej * epi_n, (ej + 1) * epi_n)
                                slot = (ei * (wn // epi_n) + ej) % 2
                                bar = (
                                    epi_barrier.at[wg_idx * (1 + num_out_slots) + 1 + slot]
                                    if has_res
                                    else None
                                )
                                if has_res:
                                    plgpu.copy_gmem_to_smem(
                                        res_wg.at[esl_m, esl_n], res_smem.at[wg_idx, slot], bar
                                    )
                                v = acc[esl_m, esl_n]
                                if has_scale:
                                    srow = vec_smem[wg_idx, 0, esl_n]
                                    v = v * lax.broadcast_in_dim(srow, (epi_m, epi_n), (1,))
                                if has_bias:
                                    brow = vec_smem[wg_idx, 1, esl_n]
                                    v = v + lax.broadcast_in_dim(brow, (epi_m, epi_n), (1,))
                                v = apply_activation(v, activation, erf=_erf)
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                if has_res:
                                    plgpu.barrier_wait(bar)
                                    v = v + res_smem[wg_idx, slot].astype(jnp.float32)
                                out_smem[wg_idx, slot] = v.astype(out_dtype)
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg_idx, slot], out_wg.at[esl_m, esl_n]
                                )

                def mma_body(_, a_smem, b_smem, acc_ref):
                    if transpose_a:
                        a_op = a_smem.at[:, wg_m].transpose((1, 0))
                    else:
                        a_op = a_smem.at[wg_m]
                    if transpose_b:
                        b_op = b_smem.at[wg_n].transpose((1, 0))
                    else:
                        b_op = b_smem.at[:, wg_n]
                    plgpu.wgmma(acc_ref, a_op, b_op)
                    plgpu.wgmma_wait(dr)
                    return acc_ref

                get_pipeline(mma_body, compute_context)(a_tile, b_tile, allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = [
        plgpu.SMEM((mc.NUM_COMPUTE_WGS, num_out_slots, epi_m, epi_n), out_dtype, transforms=out_tf)
    ]
    if has_res:
        scratch.append(
            plgpu.SMEM(
                (mc.NUM_COMPUTE_WGS, num_out_slots, epi_m, epi_n), res_dtype, transforms=res_tf
            )
        )
    if has_vec:
        scratch.append(plgpu.SMEM((mc.NUM_COMPUTE_WGS, 2, wn), jnp.float32))
    if has_res or has_vec:
        scratch.append(plgpu.Barrier(num_barriers=mc.NUM_COMPUTE_WGS * (1 + num_out_slots)))

    grid = max(1, min(num_sms // cs, num_tiles))
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, m, n), out_dtype),
        scratch_types=scratch,
        grid=(grid,),
        grid_names=("sm",),
        cluster=(cs,),
        cluster_names=("cluster",),
        num_threads=mc.NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


# --- the wrapper (Kernel calling convention of primitives/_core.py) ----------------------------

_INTERPRET_LOCK = threading.Lock()


def _run_interpret(call, operands):
    """Runs ``call`` in the Mosaic GPU interpreter behind an opaque host callback.

    The interpreter threads its simulated memory operations through *ordered* io
    callbacks; a primitive's lowering (``Operator._lower``) has no effect tokens to
    give them. So the interpreted kernel runs as its own computation inside a
    ``pure_callback`` (same values, no effects outside), one at a time: the
    interpreter's simulated device state is process-global. The interpreter
    parameters (race detection) in force when this is traced are the ones used.
    """
    params = _compat.gpu_interpret_current_params()
    out_aval = jax.eval_shape(call, *operands)
    jitted = jax.jit(call)

    def host(*xs):
        with _INTERPRET_LOCK, _compat.gpu_interpret_mode_with(params):
            return np.asarray(jitted(*xs))

    return jax.pure_callback(host, out_aval, *operands)


def _to3d(x: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    lead = x.shape[:-2]
    return x.reshape((int(np.prod(lead, dtype=np.int64)) if lead else 1, *x.shape[-2:])), lead


def matmul(
    spec: MatmulSpec,
    a: jax.Array,
    b: jax.Array,
    *extras: jax.Array,
    interpret: bool = False,
    config: MatmulConfig | None = None,
    num_sms: int | None = None,
) -> jax.Array:
    """``cast(act(scale · op(a) @ op(b) + bias) + residual, out_dtype)`` on Hopper.

    The ``ts_matmul`` contract (``.notes/MATMUL_CONTRACT.md``): ``extras`` are
    ``bias (N,)``, ``residual`` (output shape) and ``scale ()`` f32, each present only
    if its flag is set. ``config`` overrides the tile heuristic (benchmarks, autotuning);
    ``tile_shape`` from the user is turned into a config (ValueError if sm_90 cannot run it).
    """
    bias, residual, scale = spec.split(extras)
    out_dtype = spec.out_dtype
    transpose_a, transpose_b = spec.transpose_a, spec.transpose_b
    has_bias, has_scale, activation = spec.has_bias, spec.has_scale, spec.activation
    tile_shape = spec.tile_shape
    m, n, k = spec.problem_shape(a.shape, b.shape)

    dts = mc.kernel_operand_dtypes(a.dtype, b.dtype)
    if dts is None:
        raise ValueError(f"matmul_mgpu: unsupported operand dtypes {a.dtype} x {b.dtype}")
    dtype_a, dtype_b = dts
    a, b = a.astype(dtype_a), b.astype(dtype_b)  # no-ops but for mixed fp8 before jax 0.11
    if dtype_a.itemsize == 1:  # 8-bit wgmma reads K-major tiles only: A (M, K), B (N, K)
        if transpose_a:
            a, transpose_a = jnp.swapaxes(a, -1, -2), False
        if not transpose_b:
            b, transpose_b = jnp.swapaxes(b, -1, -2), True

    # Batch: one shared B against a batch of untransposed A folds into M.
    lead = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if a.ndim > 2 and b.ndim == 2 and not transpose_a:
        a = a.reshape((-1, a.shape[-1]))
        m_fold = a.shape[0]
    else:
        m_fold = None
    a3, _ = _to3d(a)
    b3, _ = _to3d(b)
    batch = max(a3.shape[0], b3.shape[0])
    mm = m_fold if m_fold is not None else m

    if config is None:
        if tile_shape is not None:
            config = mc.config_for_tile_shape(tuple(tile_shape), dtype_a, dtype_b)
        else:
            # (in interpret mode: the config the H100 would get)
            sms = device.H100_SMS if interpret else (num_sms or device.num_sms())
            config = mc.default_config(mm, n, k, dtype_a, dtype_b, num_sms=sms)
    res_dtype = np.dtype(residual.dtype) if residual is not None else None
    config = mc.fit_stages(config, dtype_a, dtype_b, out_dtype, res_dtype, has_bias or has_scale)
    if interpret and config.cluster_dimension is not None:
        # The interpreter has no cluster-collective (multicast) allocations: same tiles, no pair.
        config = config.replace(cluster_dimension=None)
    bk = config.block_k
    cm, cn = config.cluster_tile

    # Edge tiles need no copies: TMA reads zeros past the end of an array (a K tail adds
    # nothing) and skips stores there. Mosaic GPU addresses a global array in the (8, cols)
    # tiles of its shared-memory block, though, and a dim longer than one tile must be whole
    # tiles: only such dims are zero-padded (K padding zeros, M/N padding cut off the result).
    # jax 0.10's interpreter has no out-of-bounds copies: there, whole tiles are padded.
    r3 = None
    if residual is not None:
        r3 = residual.reshape((batch if m_fold is None else 1, mm, n))
    bm, bn, bk = config.tile_shape
    if interpret and not _compat.MGPU_INTERPRET_TMA_OOB:
        a3, b3 = mc.pad_operands(a3, b3, transpose_a, transpose_b, cm, cn, bk)
        mp, np_, kp = (-(-mm // cm)) * cm, (-(-n // cn)) * cn, (-(-k // bk)) * bk
    else:
        a3 = mc.pad_for_tma(a3, _tile_cols(dtype_a, bm if transpose_a else bk))
        b3 = mc.pad_for_tma(b3, _tile_cols(dtype_b, bk if transpose_b else bn))
        # Output rows of at least two swizzle rows: on the H100 a bf16 output of one
        # 64-column tile (N <= 64) came back unwritten (all zeros) when a warpgroup's second
        # epilogue store fell past it; wider rows, f32 rows and loads were right.
        mp, np_, kp = mc.tma_extent(mm, mc.TILE_ROWS), n, k
        for t in (out_dtype, res_dtype):
            if t is not None:
                cols = _tile_cols(t, config.epi_tile_n)
                np_ = max(np_, mc.tma_extent(n, cols, t.itemsize), 2 * cols)
    if r3 is not None:
        r3 = mc.pad_to_extent(mc.pad_to_extent(r3, 1, mp), 2, np_)

    operands = [a3, b3]
    if has_bias or has_scale:
        operands.append(mc.scale_bias_rows(scale, bias, n, cn))
    if r3 is not None:
        operands.append(r3)

    if num_sms is None:
        num_sms = INTERPRET_NUM_SMS if interpret else device.num_sms()
    call = _build_kernel(
        cfg=config,
        batch=batch if m_fold is None else 1,
        a_batched=a3.shape[0] > 1,
        b_batched=b3.shape[0] > 1,
        m=mp,
        n=np_,
        k=kp,
        dtype_a=dtype_a,
        dtype_b=dtype_b,
        out_dtype=out_dtype,
        res_dtype=res_dtype,
        transpose_a=transpose_a,
        transpose_b=transpose_b,
        has_scale=has_scale,
        has_bias=has_bias,
        activation=activation,
        num_sms=num_sms,
        interpret=interpret,
    )
    out = _run_interpret(call, operands) if interpret else call(*operands)
    if (mp, np_) != (mm, n):
        out = out[:, :mm, :n]
    if m_fold is not None:
        return out.reshape((*lead, m, n))
    return out.reshape((*lead, m, n)) if lead else out[0]


# --- dispatch ----------------------------------------------------------------------------------


def _aval_dtype(x) -> np.dtype:
    return np.dtype(x.dtype)


def supports(spec: MatmulSpec, avals_in: Sequence[Any]) -> str | None:
    """None if this kernel can run the case, else why not."""
    a, b = avals_in[0], avals_in[1]
    da, db = _aval_dtype(a), _aval_dtype(b)
    if mc.kernel_operand_dtypes(da, db) is None:
        return f"operand dtypes {da} x {db} (the kernel takes bf16/f16 pairs or fp8 e4m3/e5m2)"
    reason = mc.unsupported_contract(spec, avals_in)
    if reason is not None:
        return reason
    if spec.tile_shape is not None:
        try:
            validate_tile_shape(spec.tile_shape, da, db)
        except ValueError as e:
            return str(e)
    return None


def hardware(platform: str) -> str | None:
    """None if this process's GPUs can run the compiled kernel (Hopper), else why not."""
    if platform != "cuda" or not device.is_sm90():
        return "not a Hopper (sm_90) GPU"
    return None


# Dispatch rules, from the interleaved H100 measurements in benchmarks/NOTES-matmul.md:
# * fp8 (one format for both operands): the kernel ran 1.39-1.46x XLA's cuBLASLt fp8 dot at
#   8192^3, 1.8x at 4096^3 and 1.24x at a ragged 8000^3 -> from 1024 on each of M, N, K.
# * 16-bit with a fused epilogue (bias / activation / residual / scale): 1.02-1.07x XLA's
#   cuBLASLt-fused expression at 8192^3, a tie (0.99-1.0x) at a ragged 8000^3 -> from 4096
#   on each of M, N, K, whole tiles only.
# * 16-bit with M <= 64 (decode; memory-bound): 1.00-1.06x jnp.dot at 16x8192x8192 (four
#   readings) and 1.13-1.28x at 64x8192x8192 with 128-column tiles (one wave over N), but
#   0.96-0.97x at K = 28672 and 0.99-1.02x at N = 28672 -> 4096 <= K <= 8192, N >= 4096 and
#   one wave of tiles over N.
# * plain 16-bit products otherwise: within +-1.5% of cuBLAS at 4096^3 and 8192^3 (parity,
#   not a win), 0.88-0.89x at K=1024, 0.98x at a ragged 8000^3 -> XLA.
# * mixed e4m3 x e5m2: 0.93-0.97x on the fp8 tensor cores (jax >= 0.11; XLA's cuBLASLt runs
#   this pair at ~1260 TF/s at 8192^3, well above its ~850 for e4m3 x e4m3), 0.52x on bf16
#   copies (jax 0.10) -> XLA.
# Batched x batched products (the batch loop) are unmeasured -> XLA.
PREFER_MIN_FP8 = 1024
PREFER_MIN_EPILOGUE = 4096
DECODE_K = (4096, 8192)
DECODE_MIN_N = 4096
# Plain 16-bit products: None = XLA. 4096 would route them to the kernel (a tie with cuBLAS,
# 0.987-1.02x jnp.dot measured), worth it only while the XLA path is slower than jnp.dot.
PREFER_PLAIN_MIN: int | None = None


def prefer(spec: MatmulSpec, avals_in: Sequence[Any]) -> bool:
    """Whether the kernel is expected to beat XLA/cuBLAS here (``auto`` mode on cuda).

    Only classes of cases where the kernel measured at least as fast as XLA in the same
    process (the rules above); everything else goes to XLA, so ``ts.op.matmul`` is never
    slower than ``jnp.dot``.
    """
    a, b = avals_in[0], avals_in[1]
    da, db = _aval_dtype(a), _aval_dtype(b)
    if da != db:
        return False  # mixed fp8: XLA's cuBLASLt path measured faster
    if a.ndim > 2 and b.ndim > 2:
        return False  # batched x batched: the batch loop is unmeasured
    m, n, k = spec.problem_shape(a.shape, b.shape)
    if a.ndim > 2 and not spec.transpose_a:
        m *= int(np.prod(a.shape[:-2]))  # a batch of A against a shared B folds into M
    elif a.ndim > 2 or b.ndim > 2:
        return False
    if da in _F8:
        return min(m, n, k) >= PREFER_MIN_FP8
    if spec.tile_shape is None and m <= mc.DECODE_M:
        one_wave = mc.decode_config(n, device.num_sms()) is mc.CANDIDATES["bf16_64x128x128_s4"]
        return DECODE_K[0] <= k <= DECODE_K[1] and n >= DECODE_MIN_N and one_wave
    lo = PREFER_MIN_EPILOGUE if spec.has_epilogue else PREFER_PLAIN_MIN
    if lo is None or min(m, n, k) < lo:
        return False
    cfg = (
        mc.config_for_tile_shape(spec.tile_shape, da, db)
        if spec.tile_shape is not None
        else mc.default_config(m, n, k, da, db)
    )
    cm, cn = cfg.cluster_tile
    return m % cm == 0 and n % cn == 0 and k % cfg.block_k == 0
