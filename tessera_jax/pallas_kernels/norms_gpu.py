"""Row-wise softmax, log_softmax, rmsnorm and layernorm kernels, forward and backward, in
Pallas' Triton backend.

Each operator normalises over the last axis, so a kernel treats ``x`` as ``(rows, D)``: one
program loads a block of ``block_rows`` whole rows into registers (``D`` padded to a power
of two, the padding masked), takes the row statistics in f32, and writes its rows once; a
program may walk ``row_steps`` such blocks in turn, loading the weight and bias once and
perhaps the next block ahead (``RowConfig.default`` says where). The input is read once and
the output written once, which is all a bandwidth-bound operator can do. The backward
kernels recompute the statistics from ``x`` (softmax: from the saved output) instead of
saving them, and read ``x`` and the cotangent once; the weight and bias gradients are
per-program partial column sums in f32 (each program walks ``row_steps`` blocks) that the
canonical pairwise tree finishes, so no atomics and the same bits every run and in every
program. :func:`row_dot` (attention's backward Δ = rowsum(dO ∘ O)) is a row kernel too.

Why Triton rather than Mosaic GPU: a row-wise reduction is a register-resident tile, a
reduction along its minor axis and masked loads and stores of ragged rows, which the
Triton backend lowers directly (warp shuffles, vectorised masked accesses) for any row
length. Everything here also runs in Pallas' interpreter. The Triton backend is deprecated
from jax 0.11 (it warns at lowering); the kernel bodies are jax.numpy on register tiles, so
a port changes the loads, stores and launch, not the math: :mod:`norms_mgpu` is that port
for rows of a multiple of 128 elements (one row at a time in Mosaic GPU's strided layout,
sharing this module's row math), which the operators register after these kernels.
Under a jax without it (:data:`MISSING`) the operators run their references (or, in
``pallas`` and ``interpret`` modes, the Mosaic ports) and :func:`row_dot` sums on the
canonical tree in XLA.

The numerics are the operators' own (``primitives/norms.py``, ``primitives/softmax.py``),
restated here because kernels do not import the operators: softmax's fully ``-inf`` row
gives zeros, a NaN or ``+inf`` gives a NaN row; rmsnorm/layernorm take a row whose mean
square overflows f32 through the power-of-two rescaling, a NaN or ``±inf`` gives a NaN row,
and rmsnorm's ``mean(x²) + eps == 0`` row gives zeros.

Kernel calling convention (``primitives/_core.Kernel``): ``fn(spec, *operands,
interpret)``, where ``spec`` is the operator's frozen bind parameters (a sorted tuple of
``(name, value)`` pairs), with :func:`supports`, :func:`prefer` and :func:`hardware`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from tessera_jax import _compat
from tessera_jax._compat import pallas_triton as plgpu
from tessera_jax.pallas_kernels import device
from tessera_jax.primitives.reductions import pairwise_tree_sum

__all__ = [
    "ForwardPreference",
    "Preference",
    "RowConfig",
    "hardware",
    "layernorm",
    "layernorm_bwd",
    "log_softmax",
    "log_softmax_bwd",
    "prefer",
    "prefer_layernorm",
    "prefer_rmsnorm",
    "prefer_rmsnorm_bwd",
    "prefer_softmax",
    "rmsnorm",
    "rmsnorm_bwd",
    "row_dot",
    "softmax",
    "softmax_bwd",
    "supports",
]

_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32))
_F32 = np.dtype(np.float32)
# A row is held in registers: beyond this many (padded) elements a row no longer fits.
MAX_ROW = 16384
# Pallas' Triton lowering needs compute capability 8.0 (Ampere) or newer.
_MIN_COMPUTE_CAPABILITY = 8
# Why no kernel here can be built in this process at all (a jax without Pallas' Triton
# backend), or None: the dispatch then runs the references.
MISSING = _compat.TRITON_MISSING
# The power of two that brings a finite f32 row's squares into range (primitives/norms.py).
_OVERFLOW_SCALE = np.float32(2.0**-100)
# The multiprocessors of an H100 or H200: programs that walk several row blocks are
# launched in multiples of it (fixed, so the weight gradients' sums do not move by GPU).
_SMS = device.H100_SMS
# Forward programs of rows this wide (padded) with a weight or bias walk several blocks
# (narrower ones with both a weight and a bias too: RowConfig.default).
_WALK_ROW = 8192
# Backward programs prefetch their next block up to rows this wide (padded).
_PREFETCH_ROW = 8192


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """How one launch tiles the rows.

    Attributes:
      block_rows: rows per program block (a power of two).
      num_warps: warps per program (a power of two, 1 to 32).
      row_steps: row blocks each program walks, in order.
      prefetch: a program that walks several blocks issues the next block's loads before
        it computes the current one, so their latency overlaps the work; the loaded tiles
        then take registers twice over. The results are the same bits either way.
    """

    block_rows: int
    num_warps: int
    row_steps: int = 1
    prefetch: bool = False

    def __post_init__(self):
        for name in ("block_rows", "num_warps", "row_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RowConfig: {name}={v!r} must be a positive int")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"RowConfig: prefetch={self.prefetch!r} must be a bool")
        for name in ("block_rows", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1) or (name == "num_warps" and v > 32):
                raise ValueError(f"RowConfig: {name}={v} must be a power of two (≤ 32 warps)")

    @staticmethod
    def default(rows: int, d: int, *, backward: bool, params: int = 0) -> RowConfig:
        """Forward: blocks of about 8192 elements, 32 per thread (two 4096-wide rows on 8
        warps ran fastest), one block per program; except where that would reload the f32
        parameter vectors the forward reads (``params``: weight, bias) for every block.
        There a program walks several of the same blocks, loading the vectors once and
        prefetching its next block: at rows of ``_WALK_ROW`` or more with any vector
        (each block's vectors are more bytes than its bf16 row), two programs per
        multiprocessor; at narrower rows with two (layernorm's weight and bias), four
        (``benchmarks/archive/norms-walk-h200.txt``: without the prefetch the walks gained
        less, but for layernorm at rows of 8192 a little more; narrower rows with one
        vector gained nothing from walking, with none they lost).
        Backward, which keeps four f32 tiles live: blocks of about 2048 elements, 16 per
        thread, each program walking enough blocks for as many programs as fit on the
        multiprocessors (four apiece at blocks of 2048 elements, one from 8192), so that
        the f32 partial column sums stay small. Rows of up to ``_PREFETCH_ROW`` (padded)
        prefetch the next block; at 16384 prefetching ran slower, with two blocks' tiles
        held at once. The measured configs are in benchmarks/results/norms-h100-sweep.json,
        norms-h100-wide-sweep.json and norms-h100-prefetch-sweep.json."""
        dp = pl.next_power_of_2(d)
        if not backward and (params >= 2 or (params and dp >= _WALK_ROW)):
            tile = RowConfig.blocks(d, max_rows=rows)
            per_sm = 2 if dp >= _WALK_ROW else 4
            steps = max(1, pl.cdiv(rows, tile.block_rows * per_sm * _SMS))
            return dataclasses.replace(tile, row_steps=steps, prefetch=True)
        if not backward:
            return RowConfig.blocks(d, max_rows=rows)
        elems, per_thread = 2048, 16
        block_rows = max(1, min(elems // dp, pl.next_power_of_2(rows)))
        num_warps = max(4, min(16, block_rows * dp // (32 * per_thread)))
        programs = _SMS * max(1, min(4, 8192 // (block_rows * dp)))
        steps = max(1, pl.cdiv(rows, block_rows * programs))
        return RowConfig(block_rows, num_warps, steps, prefetch=dp <= _PREFETCH_ROW)

    @staticmethod
    def blocks(d: int, max_rows: int | None = None) -> RowConfig:
        """One block of about 8192 elements per program, 32 per thread (the forward's
        tiling), at most ``max_rows`` rows (rounded up to a power of two). Without
        ``max_rows`` it depends on the row length only: the same tiling, and the same
        order within a row, whatever the row count."""
        dp = pl.next_power_of_2(d)
        block_rows = max(1, 8192 // dp)
        if max_rows is not None:
            block_rows = max(1, min(block_rows, pl.next_power_of_2(max_rows)))
        return RowConfig(block_rows, max(4, min(16, block_rows * dp // (32 * 32))))


@dataclasses.dataclass(frozen=True)
class Problem:
    """One launch: ``rows`` rows of ``d`` elements (``d_pad`` in registers) and its tiling."""

    rows: int
    d: int
    config: RowConfig

    @property
    def d_pad(self) -> int:
        return pl.next_power_of_2(self.d)

    @property
    def programs(self) -> int:
        c = self.config
        return pl.cdiv(self.rows, c.block_rows * c.row_steps)


# --- loads, stores and the shared statistics ----------------------------------------------


def _index(p: Problem, block: Any) -> tuple[Any, Any, Any]:
    """``(rows, cols, mask)`` of row block ``block``: a ``(block_rows, d_pad)`` tile."""
    rows = block * p.config.block_rows + jnp.arange(p.config.block_rows)
    cols = jnp.arange(p.d_pad)
    mask = (rows[:, None] < p.rows) & (cols[None, :] < p.d)
    return rows, cols, mask


def _load(ref, rows, cols, mask, other=0.0) -> jax.Array:
    """A tile of rows in f32; masked elements read ``other``."""
    tile = plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=other)
    return tile.astype(jnp.float32)


def _load_vec(ref, p: Problem, cols) -> jax.Array:
    """A ``(D,)`` weight or bias as a ``(1, d_pad)`` f32 row (zeros in the padding)."""
    return plgpu.load(ref.at[cols], mask=cols < p.d, other=0.0).astype(jnp.float32)[None, :]


def _store(ref, rows, cols, mask, value) -> None:
    plgpu.store(ref.at[rows[:, None], cols[None, :]], value.astype(ref.dtype), mask=mask)


def _reduce(f, v: jax.Array, axis: int | None) -> jax.Array:
    """``f`` (``jnp.sum``, ``jnp.max``) over a tile's rows (``axis`` 1, kept), or over a
    single row held as a vector (``axis`` None, to a scalar: norms_mgpu's layout)."""
    return f(v, axis=axis, keepdims=axis is not None)


def _mean(v: jax.Array, d: int, axis: int | None = 1) -> jax.Array:
    """The row mean over the ``d`` real columns (the padding holds zeros)."""
    return _reduce(jnp.sum, v, axis) / np.float32(d)


def _rsqrt_guarded(s: jax.Array) -> jax.Array:
    """``1/sqrt(s)``, 0 where ``s == 0`` (a NaN ``s`` stays NaN)."""
    zero = s == 0
    return jnp.where(zero, 0.0, jax.lax.rsqrt(jnp.where(zero, 1.0, s)))


def _normalise(
    v: jax.Array, d: int, eps: float, guard_zero: bool, branch: bool, axis: int | None = 1
):
    """``(v·r, r)`` with ``r = 1/sqrt(mean(v²) + eps)``: the operators' ``_normalise``,
    including the rescaled statistics of a row whose mean square overflows f32 (rows along
    ``axis``, :func:`_reduce`).

    ``branch``: only a block holding such a row takes the second mean square, behind a
    branch on the block (the same values). The forward kernels branch: there the second
    row reduction is one more dependent step before the store. The backward kernels,
    which walk and prefetch row blocks, ran slower with the branch
    (``benchmarks/archive/norms-branch-h200.txt``)."""
    rsqrt = _rsqrt_guarded if guard_zero else jax.lax.rsqrt
    s = _mean(v * v, d, axis) + np.float32(eps)
    big = jnp.isinf(s)

    def both():  # both mean squares, each row's picked by a select
        c = _OVERFLOW_SCALE
        vc = v * c
        sc = _mean(vc * vc, d, axis) + np.float32(eps) * c * c
        sc = jnp.where(jnp.isinf(sc), jnp.nan, sc)  # a row holding ±inf comes out NaN
        rs = rsqrt(jnp.where(big, sc, 1.0))
        r = rsqrt(jnp.where(big, 1.0, s))
        return jnp.where(big, (v * rs) * c, v * r), jnp.where(big, rs * c, r)

    def plain():  # the values of ``both`` where no row is big
        r = rsqrt(s)
        return v * r, r

    if not branch:
        return both()
    any_big = big if axis is None else jnp.max(big.astype(jnp.int32)) > 0  # (a row: a scalar)
    return jax.lax.cond(any_big, both, plain)


def _stats(p: Problem, x: jax.Array, mask: jax.Array, op: str, eps: float, branch: bool):
    """``(x̂, r)`` of rmsnorm or layernorm for a tile ``x`` whose padding holds zeros
    (``branch``: :func:`_normalise`'s)."""
    if op == "rmsnorm":
        return _normalise(x, p.d, eps, guard_zero=True, branch=branch)
    centred = jnp.where(mask, x - _mean(x, p.d), 0.0)
    return _normalise(centred, p.d, eps, guard_zero=False, branch=branch)


# --- kernel bodies ------------------------------------------------------------------------


def _walk(p: Problem, load, body, init: Any = ()) -> Any:
    """``carry = body(block, load(block), carry)`` for each of this program's ``row_steps``
    row blocks, in order, from ``init``; the last carry. With ``prefetch`` the loop carries
    the next block's tiles, loaded before the current block's work (the last step reloads
    its own block rather than read past the program's rows)."""
    steps = p.config.row_steps
    first = pl.program_id(0) * steps
    if steps == 1:
        return body(first, load(first), init)
    if not p.config.prefetch:
        return jax.lax.fori_loop(0, steps, lambda i, c: body(first + i, load(first + i), c), init)

    def step(i, state):
        tiles, carry = state
        ahead = load(first + jnp.minimum(i + 1, steps - 1))
        return ahead, body(first + i, tiles, carry)

    return jax.lax.fori_loop(0, steps, step, (load(first), init))[1]


def _loader(p: Problem, *refs_and_fill):
    """``load(block) -> (rows, mask, tiles)``: the f32 tiles of ``(ref, fill)`` pairs, in
    order, for row block ``block``; masked elements read ``fill``."""

    def load(block):
        rows, cols, mask = _index(p, block)
        return rows, mask, tuple(_load(r, rows, cols, mask, fill) for r, fill in refs_and_fill)

    return load


def _softmax_rows(x: jax.Array, log: bool, axis: int | None = 1) -> jax.Array:
    """softmax or log_softmax of f32 rows along ``axis`` (:func:`_reduce`)."""
    m = _reduce(jnp.max, x, axis)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # a fully -inf row: zeros (softmax), -inf (log)
    shifted = x - m
    e = jnp.exp(shifted)
    s = _reduce(jnp.sum, e, axis)
    s = jnp.where(s == 0, 1.0, s)
    return shifted - jnp.log(s) if log else e / s


def _softmax_kernel(x_ref, o_ref, *, p: Problem, log: bool) -> None:
    cols = jnp.arange(p.d_pad)

    def block(_, loaded, carry):
        rows, mask, (x,) = loaded
        _store(o_ref, rows, cols, mask, _softmax_rows(x, log))
        return carry

    _walk(p, _loader(p, (x_ref, -jnp.inf)), block)


def _softmax_bwd_rows(y: jax.Array, g: jax.Array, log: bool, axis: int | None = 1):
    """dx of softmax (``y`` its output) or log_softmax along ``axis`` (:func:`_reduce`)."""
    if log:  # dx = g − softmax·Σg, softmax = exp(log_softmax)
        return g - jnp.exp(y) * _reduce(jnp.sum, g, axis)
    return y * (g - _reduce(jnp.sum, y * g, axis))  # dx = y·(g − Σ y·g)


def _softmax_bwd_kernel(y_ref, g_ref, o_ref, *, p: Problem, log: bool) -> None:
    cols = jnp.arange(p.d_pad)
    # log_softmax's padding reads -inf, so that its exp is 0 there
    load = _loader(p, (y_ref, -jnp.inf if log else 0.0), (g_ref, 0.0))

    def block(_, loaded, carry):
        rows, mask, (y, g) = loaded
        _store(o_ref, rows, cols, mask, _softmax_bwd_rows(y, g, log))
        return carry

    _walk(p, load, block)


def _norm_kernel(*refs, p: Problem, op: str, eps: float, has_weight: bool, has_bias: bool):
    """``row_steps`` row blocks per program, the weight and bias loaded once: a wide row's
    f32 parameters are twice the bytes of its bf16 row, so reloading them for every block
    costs as much cache traffic as the row itself."""
    refs = list(refs)
    x_ref = refs.pop(0)
    w_ref = refs.pop(0) if has_weight else None
    b_ref = refs.pop(0) if has_bias else None
    (o_ref,) = refs
    cols = jnp.arange(p.d_pad)
    w = _load_vec(w_ref, p, cols) if w_ref is not None else None
    b = _load_vec(b_ref, p, cols) if b_ref is not None else None

    def block(_, loaded, carry):
        rows, mask, (x,) = loaded
        y, _ = _stats(p, x, mask, op, eps, branch=True)
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        _store(o_ref, rows, cols, mask, y)
        return carry

    _walk(p, _loader(p, (x_ref, 0.0)), block)


def _norm_dx(op: str, xhat, r, ct, w, d: int, mask=None, axis: int | None = 1) -> jax.Array:
    """dx of rmsnorm or layernorm from the statistics ``(x̂, r)`` of :func:`_normalise`, the
    cotangent and the weight (or None), rows along ``axis``; ``mask`` keeps a tile's padding
    at zero (None: no padding)."""
    g = ct if w is None else ct * w
    u = g - xhat * _mean(xhat * g, d, axis)
    if op == "layernorm":  # the transpose of the centring x − mean(x)
        u = u - _mean(u, d, axis)
        u = u if mask is None else jnp.where(mask, u, 0.0)
    return r * u


def _norm_bwd_kernel(
    *refs, p: Problem, op: str, eps: float, has_weight: bool, want_dw: bool, want_db: bool
):
    """dx of one row block per step, and this program's partial column sums of
    ``ct·x̂`` (dw) and ``ct`` (db) over its ``row_steps`` blocks."""
    refs = list(refs)
    x_ref = refs.pop(0)
    w_ref = refs.pop(0) if has_weight else None
    g_ref, dx_ref = refs.pop(0), refs.pop(0)
    dw_ref = refs.pop(0) if want_dw else None
    db_ref = refs.pop(0) if want_db else None
    cols = jnp.arange(p.d_pad)
    w = _load_vec(w_ref, p, cols) if w_ref is not None else None

    def block(_, loaded, acc):
        dw, db = acc
        rows, mask, (x, ct) = loaded
        xhat, r = _stats(p, x, mask, op, eps, branch=False)
        _store(dx_ref, rows, cols, mask, _norm_dx(op, xhat, r, ct, w, p.d, mask))
        dw = dw + jnp.sum(ct * xhat, axis=0, keepdims=True)
        db = db + jnp.sum(ct, axis=0, keepdims=True)
        return dw, db

    zeros = jnp.zeros((1, p.d_pad), jnp.float32)
    load = _loader(p, (x_ref, 0.0), (g_ref, 0.0))
    dw, db = _walk(p, load, block, (zeros, zeros))
    prow = jnp.full((1,), pl.program_id(0), jnp.int32)
    cmask = cols[None, :] < p.d
    if dw_ref is not None:
        plgpu.store(dw_ref.at[prow[:, None], cols[None, :]], dw, mask=cmask)
    if db_ref is not None:
        plgpu.store(db_ref.at[prow[:, None], cols[None, :]], db, mask=cmask)


def _row_dot_kernel(a_ref, b_ref, o_ref, *, p: Problem, heads: tuple[int, int, int] | None):
    def block(_, loaded, carry):
        rows, _, (a, b) = loaded
        plgpu.store(o_ref.at[rows], jnp.sum(a * b, axis=1), mask=rows < p.rows)
        return carry

    if heads is None:
        _walk(p, _loader(p, (a_ref, 0.0), (b_ref, 0.0)), block)
        return
    # Row ``r`` of the result is ``(b, h, s)`` head-major over ``seq_pad`` positions: it
    # loads input row ``(b, s, h)``, or nothing past ``seq`` (a sum of zeros). The tile,
    # and so each row's order of summation, is the one above.
    seq, h, seq_pad = heads

    def load(blk):
        rows, cols, mask = _index(p, blk)
        s, bh = rows % seq_pad, rows // seq_pad
        src = ((bh // h) * seq + s) * h + bh % h
        mask = mask & (s < seq)[:, None]
        return rows, mask, tuple(_load(r, src, cols, mask) for r in (a_ref, b_ref))

    _walk(p, load, block)


# --- wrappers -----------------------------------------------------------------------------


def _params(spec: Any) -> dict[str, Any]:
    """The operator's bind parameters from its frozen spec (a sorted tuple of pairs)."""
    return dict(spec)


def _problem(x: jax.Array, backward: bool, config: RowConfig | None, params: int = 0) -> Problem:
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    d = x.shape[-1]
    default = RowConfig.default(rows, d, backward=backward, params=params)
    return Problem(rows, d, config or default)


def _call(kernel, p: Problem, out_shape, operands, interpret: bool, name: str):
    with device.int32_tracing():
        return pl.pallas_call(
            kernel,
            grid=(p.programs,),
            out_shape=out_shape,
            compiler_params=plgpu.CompilerParams(num_warps=p.config.num_warps, num_stages=1),
            interpret=interpret,
            name=name,
        )(*operands)


def _rows(x: jax.Array) -> jax.Array:
    return x.reshape((-1, x.shape[-1]))


def _softmax(spec, x, *, interpret, config, log):
    del spec  # supports() admits only the last axis
    p = _problem(x, False, config)
    out = jax.ShapeDtypeStruct((p.rows, p.d), x.dtype)
    kernel = functools.partial(_softmax_kernel, p=p, log=log)
    name = "ts_log_softmax" if log else "ts_softmax"
    return _call(kernel, p, out, [_rows(x)], interpret, name).reshape(x.shape)


def softmax(spec, x, *, interpret: bool = False, config: RowConfig | None = None):
    """``ts_softmax`` over the last axis of ``x`` (a case :func:`supports` accepts)."""
    return _softmax(spec, x, interpret=interpret, config=config, log=False)


def log_softmax(spec, x, *, interpret: bool = False, config: RowConfig | None = None):
    """``ts_log_softmax`` over the last axis of ``x``."""
    return _softmax(spec, x, interpret=interpret, config=config, log=True)


def _softmax_bwd(spec, y, g, *, interpret, config, log):
    del spec
    p = _problem(y, False, config)
    out = jax.ShapeDtypeStruct((p.rows, p.d), y.dtype)
    kernel = functools.partial(_softmax_bwd_kernel, p=p, log=log)
    name = "ts_log_softmax_bwd" if log else "ts_softmax_bwd"
    return _call(kernel, p, out, [_rows(y), _rows(g)], interpret, name).reshape(y.shape)


def softmax_bwd(spec, y, g, *, interpret: bool = False, config: RowConfig | None = None):
    """``ts_softmax_bwd``: ``y·(g − Σ y·g)`` over the last axis, ``y`` softmax's output."""
    return _softmax_bwd(spec, y, g, interpret=interpret, config=config, log=False)


def log_softmax_bwd(spec, y, g, *, interpret: bool = False, config: RowConfig | None = None):
    """``ts_log_softmax_bwd``: ``g − exp(y)·Σg`` over the last axis, ``y`` log_softmax's output."""
    return _softmax_bwd(spec, y, g, interpret=interpret, config=config, log=True)


def _norm(op, spec, x, *params, interpret, config):
    kw = _params(spec)
    has_weight, has_bias = kw["has_weight"], kw.get("has_bias", False)
    p = _problem(x, False, config, params=len(params))
    out = jax.ShapeDtypeStruct((p.rows, p.d), x.dtype)
    kernel = functools.partial(
        _norm_kernel, p=p, op=op, eps=kw["eps"], has_weight=has_weight, has_bias=has_bias
    )
    return _call(kernel, p, out, [_rows(x), *params], interpret, f"ts_{op}").reshape(x.shape)


def rmsnorm(spec, x, *weight, interpret: bool = False, config: RowConfig | None = None):
    """``ts_rmsnorm(x, [weight])`` with a ``(D,)`` weight."""
    return _norm("rmsnorm", spec, x, *weight, interpret=interpret, config=config)


def layernorm(spec, x, *params, interpret: bool = False, config: RowConfig | None = None):
    """``ts_layernorm(x, [weight], [bias])`` with ``(D,)`` weight and bias."""
    return _norm("layernorm", spec, x, *params, interpret=interpret, config=config)


def _norm_bwd(op, spec, x, *rest, interpret, config):
    kw = _params(spec)
    has_weight = kw["has_weight"]
    want_dw = kw["weight_grad_shape"] is not None
    want_db = kw.get("bias_grad_shape") is not None
    *w, ct = rest
    p = _problem(x, True, config)
    outs = [jax.ShapeDtypeStruct((p.rows, p.d), x.dtype)]
    outs += [jax.ShapeDtypeStruct((p.programs, p.d), _F32)] * (want_dw + want_db)
    kernel = functools.partial(
        _norm_bwd_kernel,
        p=p,
        op=op,
        eps=kw["eps"],
        has_weight=has_weight,
        want_dw=want_dw,
        want_db=want_db,
    )
    dx, *partials = _call(kernel, p, outs, [_rows(x), *w, _rows(ct)], interpret, f"ts_{op}_bwd")
    # The column sums of the programs' partials, in f32 on the canonical tree: the order of
    # XLA's own reduction depends on the emitter its autotuner picks.
    return (dx.reshape(x.shape), *(pairwise_tree_sum(s, axis=0) for s in partials))


def rmsnorm_bwd(spec, x, *rest, interpret: bool = False, config: RowConfig | None = None):
    """``ts_rmsnorm_bwd(x, [weight], ct) -> (dx, [dweight])``; dweight in f32, ``(D,)``."""
    return _norm_bwd("rmsnorm", spec, x, *rest, interpret=interpret, config=config)


def layernorm_bwd(spec, x, *rest, interpret: bool = False, config: RowConfig | None = None):
    """``ts_layernorm_bwd(x, [weight], ct) -> (dx, [dweight], [dbias])``; f32 ``(D,)`` sums."""
    return _norm_bwd("layernorm", spec, x, *rest, interpret=interpret, config=config)


def row_dot(
    a: jax.Array, b: jax.Array, *, interpret: bool = False, seq_pad: int | None = None
) -> jax.Array:
    """``Σ_d a·b`` over the last axis in f32, shape ``a.shape[:-1]``: one read of each.

    The tiling depends on the row length only (blocks of about 8192 elements, one per
    program), never on the row count, so the order of each row's sum, and its bits, is the
    same in every program (one GPU or a mesh's shard), unlike XLA's own reduction, whose
    emitter its autotuner picks by timing. Products of 16-bit inputs are exact in f32.

    With ``seq_pad``, ``a`` and ``b`` are ``(B, S, H, D)`` (attention's rows) and the sums
    come out head-major and padded, ``(B, H, seq_pad)`` with zeros past ``S``, the same
    bits: the layout attention's backward kernels read, written by this kernel rather than
    by a transpose and a pad after it (one more launch between the forward and them).
    """
    why = supports((), (a, b)) if a.shape == b.shape else f"{a.shape=} and {b.shape=} differ"
    if why is None and seq_pad is not None:
        if not isinstance(seq_pad, int) or isinstance(seq_pad, bool):
            why = f"{seq_pad=} must be an int or None"
        elif a.ndim != 4 or seq_pad < a.shape[1]:
            why = f"{seq_pad=} needs (B, S, H, D) inputs with S <= seq_pad, not {a.shape}"
    if why is not None:
        raise ValueError(f"norms_gpu.row_dot: {why}")
    if MISSING is not None:
        return _row_dot_tree(a, b, seq_pad)
    d, shape, heads = a.shape[-1], a.shape[:-1], None
    if seq_pad is not None:
        bsz, seq, h = shape
        shape, heads = (bsz, h, seq_pad), (seq, h, seq_pad)
    p = Problem(int(np.prod(shape, dtype=np.int64)), d, RowConfig.blocks(d))
    out = jax.ShapeDtypeStruct((p.rows,), _F32)
    kernel = functools.partial(_row_dot_kernel, p=p, heads=heads)
    with _compat.without_gpu_interpret_mode():  # (it may run between Mosaic GPU kernels)
        out = _call(kernel, p, out, [_rows(a), _rows(b)], interpret, "ts_row_dot")
    return out.reshape(shape)


def _row_dot_tree(a: jax.Array, b: jax.Array, seq_pad: int | None) -> jax.Array:
    """:func:`row_dot` without the kernel (:data:`MISSING`): the products in f32 summed on
    the canonical pairwise tree, whose adds XLA may not reorder, so each row's bits are
    again the same in every program (not the kernel's bits: another order)."""
    out = pairwise_tree_sum(a.astype(_F32) * b.astype(_F32), axis=-1)
    if seq_pad is None:
        return out
    return jnp.pad(jnp.swapaxes(out, 1, 2), ((0, 0), (0, 0), (0, seq_pad - out.shape[1])))


# --- dispatch vocabulary ------------------------------------------------------------------


def supports(spec: Any, avals: Sequence[Any]) -> str | None:
    """None if a kernel here can run the case, else why not: the normalised axis is the
    last, a 16-bit or f32 ``x`` with rows that fit in registers, and ``(D,)`` parameters."""
    kw = _params(spec)
    x = avals[0]
    if x.ndim == 0 or x.size == 0:
        return f"x.shape={x.shape}: the kernels take non-empty arrays of rank ≥ 1"
    if "axis" in kw and kw["axis"] != x.ndim - 1:
        return f"axis={kw['axis']}: the kernels normalise the last axis (of rank {x.ndim})"
    dtype = np.dtype(x.dtype)
    if dtype not in _DTYPES:
        return f"x.dtype={dtype} (the kernels take bf16, f16 and f32)"
    if x.size >= 2**31:
        return f"x.size={x.size}: the kernels address elements with 32-bit offsets"
    d = x.shape[-1]
    if pl.next_power_of_2(d) > MAX_ROW:
        return f"a row of {d} elements does not fit in one program (at most {MAX_ROW})"
    for a in avals[1:]:  # weight, bias (a (D,) vector) or the cotangent (x's shape)
        if a.shape not in ((d,), x.shape) or np.dtype(a.dtype) not in _DTYPES:
            return (
                f"a parameter of shape {a.shape} and dtype {a.dtype}: the kernels take (D,) = "
                f"({d},) weights and biases of bf16, f16 or f32"
            )
    for key in ("weight_grad_shape", "bias_grad_shape"):
        if kw.get(key) not in (None, (d,)):
            return f"{key}={kw[key]}: the kernels reduce to (D,) = ({d},)"
    return None


# Where ``auto`` mode takes the kernels. Where a backward follows (a forward bound by the
# operator's JVP rule), it takes an operator's forward and backward kernels together: a
# forward kernel beside the reference's backward measured slower in a training step than
# either pair, since XLA's forward+backward takes less than its two halves apart
# only when it owns both (docs/ARCHITECTURE.md). On an H200, forward and backward timed
# inside one program with every gradient consumed (benchmarks/archive/
# norm_mosaic_fallback_probe.py, norm-step-h200.txt) at 2¹⁹ to 2²² elements, rows of 1024 to
# 4096: a forward kernel beside the reference's backward ran 0.72-0.89x jnp, the references
# 0.83-1.08x; both rmsnorm kernels ran 1.03-1.23x (both layernorm kernels 0.75-1.05x, both
# softmax kernels 0.68-0.86x).
#
# ``prefer``, from 2²³ elements at rows of 256 to 16384: the backward kernels, which finish
# the weight gradient with an XLA sum, won there on an H100 and lost below (bf16;
# benchmarks/results/norms-h100.json at 8192×2048 and 32768×4096, norms-h100-rows.json at
# rows of 256 to 16384, 2²² to 2²⁶ elements), and the forward kernels won at every row
# length measured (norms-h100-wide-sweep.json: rmsnorm's at 16384 once its programs walk
# their rows, loading the weight once). At 16384-wide rows rmsnorm trails jnp on either
# path, and the forward kernel beside the reference backward is slower than both
# (norms-h100-rows.json).
#
# ``prefer_rmsnorm``, from 2¹⁹ elements: its reference's overflow-safe statistics are not
# fused by XLA into one row kernel. Timed forward alone on an H200 at 2¹⁹ to 2²¹ elements,
# rows of 256 to 4096 (benchmarks/results/norms-h200-in-graph.json), its forward kernel ran
# 1.10-1.22x jnp and the reference 0.68-0.87x; forward and backward (there, and with every
# gradient in norm-step-h200.txt) both kernels 0.96-1.23x, the lowest at 256-wide rows, and
# the references 0.73-0.96x. The pair (``prefer_rmsnorm_bwd``) stops at rows of 8192: at
# 16384 it ran 0.75x jnp where the references ran 0.81x (H200, norms-h200.json at
# 4096×16384; on an H100 0.78x and 0.82x against 0.83x and 0.85x, norms-h100-rows.json),
# while the forward kernel alone there ran 1.32x (H100: 0.97x, the reference 0.76x).
#
# A forward that no backward follows (inference) takes its kernel by the forward kernel's own
# measurements (``ForwardPreference.alone``): layernorm's from 2¹⁹ elements, where it ran
# 1.06-1.12x jnp on the H200 (norms-h200-in-graph.json; its reference 1.02-1.11x), and
# softmax's from 2²², where it won on the H100 (softmax's ran 0.92-1.14x at 2¹⁹ to 2²¹ on
# the H200, its reference 0.93-1.01x). Elsewhere the reference runs until measured.
@dataclasses.dataclass(frozen=True)
class Preference:
    """``auto`` mode's rule for one kernel: ``x``'s rows of ``rows[0]`` to ``rows[1]``
    elements and at least ``min_elements`` elements in all."""

    rows: tuple[int, int]
    min_elements: int

    def __call__(self, spec: Any, avals: Sequence[Any]) -> bool:
        del spec
        x = avals[0]
        return self.rows[0] <= x.shape[-1] <= self.rows[1] and x.size >= self.min_elements


@dataclasses.dataclass(frozen=True)
class ForwardPreference:
    """``auto`` mode's rule for a forward kernel whose operator's JVP rule binds it with
    ``differentiated=True``: ``differentiated`` (its backward kernel's rule) there, else
    ``alone``. Each is a rule ``(spec, avals) -> bool`` (a :class:`Preference`)."""

    alone: Callable[[Any, Sequence[Any]], bool]
    differentiated: Callable[[Any, Sequence[Any]], bool]

    def __call__(self, spec: Any, avals: Sequence[Any]) -> bool:
        rule = self.differentiated if _params(spec).get("differentiated") else self.alone
        return rule(spec, avals)


prefer = Preference(rows=(256, 16384), min_elements=1 << 23)
_from_2_19 = Preference(rows=(256, 16384), min_elements=1 << 19)
prefer_rmsnorm_bwd = Preference(rows=(256, 8192), min_elements=1 << 19)
prefer_rmsnorm = ForwardPreference(alone=_from_2_19, differentiated=prefer_rmsnorm_bwd)
prefer_layernorm = ForwardPreference(alone=_from_2_19, differentiated=prefer)
prefer_softmax = ForwardPreference(
    alone=Preference(rows=(256, 16384), min_elements=1 << 22), differentiated=prefer
)


def hardware(platform: str) -> str | None:
    """None if this process's GPUs can run the compiled kernels (compute capability ≥ 8)."""
    if platform != "cuda":
        return f"the norm kernels compile for cuda, not {platform}"
    try:
        cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:  # no GPU backend in this process
        return "no GPU in this process"
    if cc is not None and int(str(cc).split(".")[0]) < _MIN_COMPUTE_CAPABILITY:
        return f"compute capability {cc} < {_MIN_COMPUTE_CAPABILITY}.0 (Pallas' Triton lowering)"
    return None
