"""Tile configurations of the Hopper matmul: a frozen, validated dataclass, the named candidates
the autotuner searches, the per-shape heuristic and the hardware budget checks; and what both
matmul kernels share beyond the contract itself (``tessera_jax.contracts.matmul``): the parts
of it they decline, zero-padding to whole tiles, the scale/bias rows.

A config describes one CTA (thread block) of the Mosaic GPU kernel in
:mod:`tessera_jax.pallas_kernels.matmul_mgpu`: it computes a ``block_m × block_n``
tile of C, stepping over K in ``block_k`` slices that a memory warpgroup streams
into a ``num_stages``-deep ring of shared-memory buffers with TMA, while two compute
warpgroups each own half of the tile (split along ``wg_dimension``) and issue
``wgmma`` into f32 accumulators held in registers.

Hardware limits (H100 / H200, sm_90a) the checks below enforce:

* ``wgmma`` has a fixed M of 64 rows per warpgroup, N a multiple of 8 up to 256,
  and K steps of 16 bytes × 8 = one 128-byte swizzle row (64 16-bit or 128 8-bit
  elements), so ``block_k`` is a multiple of that and operand tiles are 128-byte
  swizzled.
* The accumulator of one warpgroup (``block_m × block_n / 2`` f32 values over 128
  threads) must fit the register file next to addressing: at most 16384 values
  (128 registers a thread; with ``setmaxnreg`` a compute thread gets 232).
* Shared memory: 227 KiB (232448 bytes) a block: the operand ring plus the
  epilogue staging buffers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tessera_jax import _compat
from tessera_jax.contracts.matmul import MatmulSpec
from tessera_jax.numerics.dtypes import FP8_DTYPES

# --- hardware budget (sm_90) -------------------------------------------------------------------
SMEM_BYTES = 232_448  # max dynamic shared memory of one block on H100/H200 (227 KiB)
SMEM_RESERVED = 1_024  # barriers and alignment padding the kernel allocates besides buffers
WGMMA_M = 64  # rows of one wgmma instruction (per warpgroup)
WGMMA_N_MAX = 256
ACC_MAX_ELEMS = 16_384  # f32 accumulator values of one warpgroup (128 registers a thread)
SWIZZLE_BYTES = 128
NUM_COMPUTE_WGS = 2

_DIMS = ("m", "n")

# The 8-bit float formats of Hopper's tensor cores (the one such tuple of the matmul kernels).
KERNEL_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), *FP8_DTYPES)


def kernel_operand_dtypes(dtype_a: Any, dtype_b: Any) -> tuple[np.dtype, np.dtype] | None:
    """The element types the Hopper kernel's wgmma reads for these operands, or None.

    Equal 16-bit or 8-bit types as they are; e4m3 x e5m2 as they are where wgmma takes
    a mixed fp8 pair (jax >= 0.11), else as bf16 copies (exact: both formats embed in
    bf16, at bf16 speed). Anything else is not a kernel case.
    """
    da, db = np.dtype(dtype_a), np.dtype(dtype_b)
    if da == db:
        return (da, db) if da in KERNEL_DTYPES else None
    if da in FP8_DTYPES and db in FP8_DTYPES:
        bf16 = np.dtype(ml_dtypes.bfloat16)
        return (da, db) if _compat.MGPU_MIXED_FP8 else (bf16, bf16)
    return None


def swizzle_elems(dtype: Any) -> int:
    """Elements of ``dtype`` in one 128-byte swizzle row: the K granularity of wgmma."""
    return SWIZZLE_BYTES // np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """One tile configuration of the Hopper matmul kernel.

    Attributes:
      block_m, block_n, block_k: the CTA tile ``(BM, BN, BK)`` (what ``tile_shape``
        names); the two compute warpgroups split it along ``wg_dimension``.
      num_stages: depth of the shared-memory ring (TMA loads in flight).
      wg_dimension: ``"m"`` (each warpgroup owns ``BM/2 × BN``) or ``"n"`` (``BM × BN/2``).
      grid_minor_dim, grid_tile_width: the persistent loop visits output tiles in a
        planar snake of this width along this dimension (L2 reuse of A/B tiles).
      epi_tile_m, epi_tile_n: the epilogue writes C through shared memory in
        sub-tiles of this size (double-buffered TMA stores).
      delay_release: keep this many wgmma groups in flight before releasing an
        operand buffer (0 or 1).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4
    wg_dimension: str = "n"
    grid_minor_dim: str = "n"
    grid_tile_width: int = 8
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    delay_release: int = 0
    cluster_dimension: str | None = None

    def __post_init__(self):
        for f in (
            "block_m",
            "block_n",
            "block_k",
            "num_stages",
            "grid_tile_width",
            "epi_tile_m",
            "epi_tile_n",
        ):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"MatmulConfig: {f}={v!r} must be a positive int")
        if self.wg_dimension not in _DIMS:
            raise ValueError(f"MatmulConfig: wg_dimension={self.wg_dimension!r} must be 'm' or 'n'")
        if self.grid_minor_dim not in _DIMS:
            raise ValueError(
                f"MatmulConfig: grid_minor_dim={self.grid_minor_dim!r} must be 'm' or 'n'"
            )
        if self.cluster_dimension not in (None, *_DIMS):
            raise ValueError(
                f"MatmulConfig: cluster_dimension={self.cluster_dimension!r} must be None, 'm' "
                "or 'n'"
            )
        if self.delay_release not in (0, 1):
            raise ValueError(f"MatmulConfig: delay_release={self.delay_release!r} must be 0 or 1")
        if self.num_stages < 2:
            raise ValueError(f"MatmulConfig: num_stages={self.num_stages} must be >= 2")
        wm, wn = self.wg_tile
        if wm % WGMMA_M:
            raise ValueError(
                f"MatmulConfig: a warpgroup's rows {wm} (block_m={self.block_m}, "
                f"wg_dimension={self.wg_dimension!r}) must be a multiple of the wgmma M={WGMMA_M}"
            )
        if wn % 8 or wn > WGMMA_N_MAX:
            raise ValueError(
                f"MatmulConfig: a warpgroup's columns {wn} must be a multiple of 8 and at most "
                f"the wgmma N limit {WGMMA_N_MAX}"
            )
        if wm * wn > ACC_MAX_ELEMS:
            raise ValueError(
                f"MatmulConfig: a warpgroup's f32 accumulator {wm}x{wn} = {wm * wn} values "
                f"exceeds the register budget of {ACC_MAX_ELEMS} (128 registers a thread)"
            )
        if wm % self.epi_tile_m or wn % self.epi_tile_n:
            raise ValueError(
                f"MatmulConfig: epilogue tile {self.epi_tile_m}x{self.epi_tile_n} must divide "
                f"the warpgroup tile {wm}x{wn}"
            )

    @property
    def wg_tile(self) -> tuple[int, int]:
        """``(rows, cols)`` of the output tile one compute warpgroup owns."""
        if self.wg_dimension == "m":
            return self.block_m // NUM_COMPUTE_WGS, self.block_n
        return self.block_m, self.block_n // NUM_COMPUTE_WGS

    @property
    def cluster_size(self) -> int:
        return 1 if self.cluster_dimension is None else 2

    @property
    def cluster_tile(self) -> tuple[int, int]:
        """``(rows, cols)`` of C one cluster of CTAs computes (the padding multiple)."""
        return (
            self.block_m * (2 if self.cluster_dimension == "m" else 1),
            self.block_n * (2 if self.cluster_dimension == "n" else 1),
        )

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        return (self.block_m, self.block_n, self.block_k)

    def replace(self, **changes: Any) -> MatmulConfig:
        return dataclasses.replace(self, **changes)


# --- shared-memory accounting ------------------------------------------------------------------


def _itemsize(dtype: Any) -> int:
    return np.dtype(dtype).itemsize


def epilogue_smem_bytes(
    cfg: MatmulConfig,
    out_dtype: Any,
    res_dtype: Any | None,
    has_vec: bool,
    outputs: int = 1,
) -> int:
    """Epilogue staging: two slots per warpgroup for each of ``outputs`` outputs (+ residual
    slots, + scale/bias rows)."""
    epi = cfg.epi_tile_m * cfg.epi_tile_n
    slots = min(2, math.prod(cfg.wg_tile) // epi)
    b = outputs * NUM_COMPUTE_WGS * slots * epi * _itemsize(out_dtype)
    if res_dtype is not None:
        b += NUM_COMPUTE_WGS * slots * epi * _itemsize(res_dtype)
    if has_vec:
        b += NUM_COMPUTE_WGS * 2 * cfg.wg_tile[1] * 4
    return b


def stage_smem_bytes(cfg: MatmulConfig, dtype_a: Any, dtype_b: Any) -> int:
    """Shared memory of one pipeline stage: an A tile and a B tile."""
    return cfg.block_k * (cfg.block_m * _itemsize(dtype_a) + cfg.block_n * _itemsize(dtype_b))


def smem_bytes(
    cfg: MatmulConfig,
    dtype_a: Any,
    dtype_b: Any,
    out_dtype: Any,
    res_dtype: Any | None = None,
    has_vec: bool = False,
    *,
    outputs: int = 1,
) -> int:
    return (
        cfg.num_stages * stage_smem_bytes(cfg, dtype_a, dtype_b)
        + epilogue_smem_bytes(cfg, out_dtype, res_dtype, has_vec, outputs)
        + SMEM_RESERVED
    )


def check_block_k(block_k: int, dtype_a: Any, dtype_b: Any, name: str = "block_k") -> None:
    """ValueError unless ``block_k`` is a whole number of 128-byte swizzle rows of each
    operand dtype (the K granularity of one wgmma step from shared memory)."""
    for dt in (dtype_a, dtype_b):
        if block_k % swizzle_elems(dt):
            raise ValueError(
                f"matmul: {name}={block_k} must be a multiple of {swizzle_elems(dt)} for "
                f"{np.dtype(dt).name} operands (one {SWIZZLE_BYTES}-byte swizzled wgmma K step)"
            )


def fit_stages(
    cfg: MatmulConfig,
    dtype_a: Any,
    dtype_b: Any,
    out_dtype: Any,
    res_dtype: Any | None = None,
    has_vec: bool = False,
    *,
    outputs: int = 1,
) -> MatmulConfig:
    """``cfg`` with ``num_stages`` lowered until it fits shared memory with ``outputs``
    output staging buffers; ValueError if 2 don't (or if ``block_k`` is not a whole swizzled
    row of the operand dtype)."""
    check_block_k(cfg.block_k, dtype_a, dtype_b)
    extra = (res_dtype, has_vec)
    stages = cfg.num_stages
    while stages >= 2:
        c = cfg.replace(num_stages=stages)
        if smem_bytes(c, dtype_a, dtype_b, out_dtype, *extra, outputs=outputs) <= SMEM_BYTES:
            return c
        stages -= 1
    need = smem_bytes(
        cfg.replace(num_stages=2), dtype_a, dtype_b, out_dtype, *extra, outputs=outputs
    )
    raise ValueError(
        f"matmul: tile_shape={cfg.tile_shape} needs {need} bytes of shared memory with 2 "
        f"pipeline stages ({np.dtype(dtype_a).name} x {np.dtype(dtype_b).name} -> "
        f"{np.dtype(out_dtype).name}), over the {SMEM_BYTES}-byte shared-memory limit of "
        "an sm_90 block; use a smaller block_k or block_n"
    )


# --- user tile shapes --------------------------------------------------------------------------


def config_for_tile_shape(
    tile_shape: tuple[int, int, int], dtype_a: Any, dtype_b: Any, num_stages: int = 4
) -> MatmulConfig:
    """The config running a user ``tile_shape=(BM, BN, BK)``, or a ValueError naming the limit.

    The warpgroup split is chosen from the shape: along M when each half keeps a
    multiple of 64 rows, else along N.
    """
    if (
        not isinstance(tile_shape, (tuple, list))
        or len(tile_shape) != 3
        or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tile_shape)
    ):
        raise ValueError(
            f"matmul: tile_shape={tile_shape!r} must be a tuple of 3 ints (BM, BN, BK)"
        )
    bm, bn, bk = (int(t) for t in tile_shape)
    if min(bm, bn, bk) <= 0:
        raise ValueError(f"matmul: tile_shape={tile_shape} must be positive")
    if bm % WGMMA_M:
        raise ValueError(
            f"matmul: tile_shape BM={bm} must be a multiple of the wgmma M instruction shape "
            f"{WGMMA_M} (sm_90 warpgroup MMA)"
        )
    check_block_k(bk, dtype_a, dtype_b, name="tile_shape BK")
    if bn % 64:
        raise ValueError(
            f"matmul: tile_shape BN={bn} must be a multiple of 64 (the wgmma N of a "
            f"{SWIZZLE_BYTES}-byte swizzled B tile and of the 64x64 epilogue tile)"
        )
    errors = []
    for wg_dim in ("m", "n"):
        try:
            cfg = MatmulConfig(
                block_m=bm, block_n=bn, block_k=bk, num_stages=num_stages, wg_dimension=wg_dim
            )
        except ValueError as e:
            errors.append(str(e))
            continue
        return cfg
    raise ValueError(
        f"matmul: tile_shape={tuple(tile_shape)} cannot run on sm_90: " + "; ".join(errors)
    )


# --- named candidates and the heuristic --------------------------------------------------------

CANDIDATES: dict[str, MatmulConfig] = {
    # 128x256 CTA, two 128x128 warpgroups: the large-square workhorse (bf16/f16).
    "bf16_128x256x64_s4": MatmulConfig(128, 256, 64, 4, "n", "n", 8),
    "bf16_256x128x64_s4": MatmulConfig(256, 128, 64, 4, "m", "n", 8),
    "bf16_128x256x64_s4_dr1": MatmulConfig(128, 256, 64, 4, "n", "n", 8, delay_release=1),
    "bf16_128x256x64_s4_w16": MatmulConfig(128, 256, 64, 4, "n", "m", 16),
    "bf16_128x256x64_s4_wgm": MatmulConfig(128, 256, 64, 4, "m", "n", 8),
    # 2-CTA clusters: the pair shares (TMA-multicasts) its common B (cluster "m") or A tile,
    # a third less L2 -> SM traffic.
    "bf16_128x256x64_s4_cm": MatmulConfig(128, 256, 64, 4, "n", "n", 8, cluster_dimension="m"),
    "bf16_128x256x64_s4_cn": MatmulConfig(128, 256, 64, 4, "n", "n", 8, cluster_dimension="n"),
    "bf16_128x256x64_s4_dr1_cm": MatmulConfig(
        128, 256, 64, 4, "n", "n", 8, delay_release=1, cluster_dimension="m"
    ),
    # 256x128 CTA pairs sharing A (cluster "n"), warpgroups 128x128 along M, one wgmma group
    # in flight: the shape of cuBLAS's own kernel at 8192^3 on the H100 (nvjet 128x256 /
    # 256x128 with a 2-CTA cluster); on par with the 1-CTA default there
    # (benchmarks/results/matmul-h100-sweep.json).
    "bf16_256x128x64_s4_dr1_cn": MatmulConfig(
        256, 128, 64, 4, "m", "n", 8, delay_release=1, cluster_dimension="n"
    ),
    "bf16_128x128x64_s6": MatmulConfig(128, 128, 64, 6, "m", "n", 8),
    # Small M (decode-like): a 64-row CTA streaming its B columns, warpgroups split N.
    "bf16_64x256x64_s6": MatmulConfig(64, 256, 64, 6, "n", "n", 4),
    "bf16_64x128x128_s4": MatmulConfig(64, 128, 128, 4, "n", "n", 4),
    # 8-bit operands: K steps of 128 (one 128-byte swizzle row).
    "fp8_128x256x128_s4": MatmulConfig(128, 256, 128, 4, "n", "n", 8),
    "fp8_256x128x128_s4": MatmulConfig(256, 128, 128, 4, "m", "n", 8),
    "fp8_128x256x128_s4_dr1": MatmulConfig(128, 256, 128, 4, "n", "n", 8, delay_release=1),
    "fp8_128x256x128_s4_cm": MatmulConfig(128, 256, 128, 4, "n", "n", 8, cluster_dimension="m"),
    # 64x32 epilogue sub-tiles: half the staging memory, so an f32 output keeps 4 stages.
    "fp8_128x256x128_s4_e32": MatmulConfig(128, 256, 128, 4, "n", "n", 8, epi_tile_n=32),
}


# M and N from which 16-bit products take the 2-CTA cluster config (whole cluster tiles only).
LARGE_MN = 4096


DECODE_M = 64  # M up to one wgmma row block: decode-like, memory-bound products


def decode_config(n: int, *, num_sms: int) -> MatmulConfig:
    """The 16-bit config for ``M <= DECODE_M``. Memory-bound: 128-column tiles put twice the
    SMs on streaming B while one wave of them (``num_sms`` tiles) covers N; past one wave the
    256-column tiles, which need fewer waves (benchmarks/results/matmul-edges-h100-*.txt)."""
    narrow = CANDIDATES["bf16_64x128x128_s4"]
    return narrow if -(-n // narrow.block_n) <= num_sms else CANDIDATES["bf16_64x256x64_s6"]


def default_config(
    m: int, n: int, k: int, dtype_a: Any, dtype_b: Any, *, num_sms: int
) -> MatmulConfig:
    """Per-shape heuristic: the candidate expected to be fastest for ``(m, n, k)`` on a GPU of
    ``num_sms`` SMs (``device.sm_counts(...).tuned``)."""
    eight_bit = max(_itemsize(dtype_a), _itemsize(dtype_b)) == 1
    if eight_bit:
        return CANDIDATES["fp8_128x256x128_s4"]
    if m <= DECODE_M:
        return decode_config(n, num_sms=num_sms)
    big = CANDIDATES["bf16_256x128x64_s4_dr1_cn"]
    cm, cn = big.cluster_tile
    if m >= LARGE_MN and n >= LARGE_MN and m % cm == 0 and n % cn == 0:
        return big
    return CANDIDATES["bf16_128x256x64_s4"]


def candidates_for(dtype_a: Any, dtype_b: Any) -> dict[str, MatmulConfig]:
    """The named candidates valid for these operand dtypes (the autotuner's search space)."""
    prefix = "fp8_" if max(_itemsize(dtype_a), _itemsize(dtype_b)) == 1 else "bf16_"
    return {k: v for k, v in CANDIDATES.items() if k.startswith(prefix)}


# --- autotuning: the cache's key and configs of the Hopper kernel ------------------------------

# The kernel's name in the autotune cache (``ts.autotune``): ``ts.autotune.search(kernel=
# ts.op.matmul, ...)`` writes entries under it and the kernel reads them.
TUNING_NAME = "ts.matmul"
TUNING_PARAMS = ("BM", "BN", "BK", "stages")  # BM, BN, BK required; stages optional


def tuning_key(spec: MatmulSpec, avals: Sequence[Any]) -> tuple:
    """What makes two ``ts_matmul`` binds different problems for tuning: the operands'
    shapes and dtypes as bound, the output dtype, the transposes and the epilogue."""
    a, b, *extras = avals
    return (
        tuple(int(d) for d in a.shape),
        np.dtype(a.dtype).name,
        tuple(int(d) for d in b.shape),
        np.dtype(b.dtype).name,
        spec.out_dtype.name,
        spec.transpose_a,
        spec.transpose_b,
        spec.activation,
        spec.has_bias,
        spec.has_residual,
        spec.has_scale,
        tuple(np.dtype(x.dtype).name for x in extras),
    )


def config_from_tuned(tuned: dict[str, Any], dtype_a: Any, dtype_b: Any) -> MatmulConfig:
    """The config of a tuned ``{BM, BN, BK[, stages]}`` (ValueError/TypeError naming what is
    wrong with it): ``config_for_tile_shape((BM, BN, BK))`` with ``stages`` pipeline stages
    (default 4)."""
    names = set(tuned)
    if not {"BM", "BN", "BK"} <= names <= set(TUNING_PARAMS):
        raise ValueError(
            f"matmul: tuning parameters {sorted(names)} must be BM, BN, BK and optionally stages"
        )
    stages = tuned.get("stages", 4)
    if not isinstance(stages, (int, np.integer)) or isinstance(stages, bool):
        raise TypeError(f"matmul: tuning parameter stages={stages!r} must be an int")
    tile = (tuned["BM"], tuned["BN"], tuned["BK"])
    return config_for_tile_shape(tile, dtype_a, dtype_b, num_stages=int(stages))


# --- what both kernels (matmul_mgpu and matmul_portable) share ----------------------------------


def unsupported_contract(spec: MatmulSpec, avals: Sequence[Any]) -> str | None:
    """What both kernels decline beyond their operand dtypes (None if nothing): the parts of
    the ``ts_matmul`` contract their f32 accumulator, epilogue and batching do not cover."""
    if len(avals) != 2 + spec.num_extras:
        return f"{len(avals)} operands, but the spec has {2 + spec.num_extras}"
    a, b = avals[0], avals[1]
    if spec.accumulate_dtype != np.float32:
        return f"accumulate_dtype={spec.accumulate_dtype} (the kernels accumulate in float32)"
    if a.ndim < 2 or b.ndim < 2:
        return f"operands of rank {a.ndim} and {b.ndim} (the kernels take rank >= 2)"
    if a.ndim > 2 and b.ndim > 2 and tuple(a.shape[:-2]) != tuple(b.shape[:-2]):
        return f"batch dims {tuple(a.shape[:-2])} and {tuple(b.shape[:-2])} differ"
    if 0 in (*a.shape, *b.shape):
        return f"an empty product of {tuple(a.shape)} and {tuple(b.shape)} (nothing to tile)"
    if spec.has_residual:
        rdt = np.dtype(avals[2 + spec.has_bias].dtype)
        if not jnp.issubdtype(rdt, jnp.floating):
            return f"residual dtype {rdt} (the epilogue adds a float residual)"
    out = spec.out_dtype
    if not jnp.issubdtype(out, jnp.floating) or out.itemsize > 4:
        return f"out_dtype={out} (the kernels write 8- to 32-bit floats)"
    return None


TILE_ROWS = 8  # rows of Mosaic GPU's swizzled (8, one swizzle row) shared-memory tiles
TMA_STRIDE_BYTES = 16  # TMA descriptors take strides in whole 16-byte units


def tma_extent(size: int, tile: int, itemsize: int | None = None) -> int:
    """The extent a dim of ``size`` needs for TMA copies in tiles of ``tile``: Mosaic GPU takes
    a dim of at most one tile or of whole tiles (the kernel's edge tiles read past it). For
    the minor dim give ``itemsize``: a row is also a whole number of 16-byte units."""
    ext = size if size <= tile or size % tile == 0 else -(-size // tile) * tile
    if itemsize is not None:
        unit = max(1, TMA_STRIDE_BYTES // itemsize)
        ext = -(-ext // unit) * unit
    return ext


def pad_to_extent(x: Any, axis: int, extent: int) -> Any:
    """``x`` zero-padded at the end of ``axis`` to ``extent``."""
    extra = extent - x.shape[axis]
    if not extra:
        return x
    w = [(0, 0)] * x.ndim
    w[axis] = (0, extra)
    return jnp.pad(x, w)


def pad_for_tma(x: Any, tile_cols: int) -> Any:
    """An operand as stored, its two minor dims zero-padded only where TMA copies in
    ``(TILE_ROWS, tile_cols)`` tiles need it (:func:`tma_extent`)."""
    itemsize = np.dtype(x.dtype).itemsize
    x = pad_to_extent(x, x.ndim - 1, tma_extent(x.shape[-1], tile_cols, itemsize))
    return pad_to_extent(x, x.ndim - 2, tma_extent(x.shape[-2], TILE_ROWS))


def pad_to(x: Any, axis: int, mult: int) -> Any:
    """``x`` zero-padded at the end of ``axis`` to a multiple of ``mult``."""
    return pad_to_extent(x, axis, -(-x.shape[axis] // mult) * mult)


def pad_operands(
    a3: Any, b3: Any, transpose_a: bool, transpose_b: bool, tile_m: int, tile_n: int, tile_k: int
) -> tuple[Any, Any]:
    """3-D (batch-first) operands, as stored, zero-padded to whole ``(tile_m, tile_n, tile_k)``
    tiles (K padding must be zeros; M/N padding is cut off the result)."""
    a3 = pad_to(pad_to(a3, 2 if transpose_a else 1, tile_m), 1 if transpose_a else 2, tile_k)
    b3 = pad_to(pad_to(b3, 1 if transpose_b else 2, tile_n), 2 if transpose_b else 1, tile_k)
    return a3, b3


def scale_bias_rows(scale: Any, bias: Any, n: int, tile_n: int) -> Any:
    """The epilogue's ``(2, N)`` f32 operand, N zero-padded to whole ``tile_n`` tiles: row 0
    the scale (ones without one), row 1 the bias (zeros without one); None with neither."""
    if scale is None and bias is None:
        return None
    sv = (
        jnp.broadcast_to(scale.astype(jnp.float32), (n,))
        if scale is not None
        else jnp.ones((n,), jnp.float32)
    )
    bv = bias.astype(jnp.float32) if bias is not None else jnp.zeros((n,), jnp.float32)
    return pad_to(jnp.stack([sv, bv]), 1, tile_n)
