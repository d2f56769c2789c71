"""Row-wise softmax, log_softmax, rmsnorm and layernorm kernels, forward and backward, in
Pallas Mosaic GPU: the port of :mod:`norms_gpu`'s Triton kernels (all but ``row_dot``), for
when Pallas' Triton backend (deprecated from jax 0.11) is gone.

The operators register these kernels after the Triton ones, so they run where those cannot:
a jax without Pallas' Triton backend. There ``auto`` mode takes them by :data:`PREFER`
(from 2²³ elements: softmax and log_softmax, layernorm's pair at rows up to 4096, the
rmsnorm forward where no backward follows: its pair measured slower than its reference),
``pallas`` and ``interpret`` modes always.

A CTA is one warpgroup that walks ``MosaicRowConfig.rows`` rows in order. Each row goes from
global memory straight into registers, spread over the warpgroup's 128 threads in the
strided layout (``D / 128`` elements a thread, in vectors); its statistics are full
reductions of that vector (warp shuffles, then shared memory between the warps), so a row
is read once and written once, and its reduction order depends on ``D`` only, not on the
row count. There is no TMA or shared-memory staging: the design counts on the many CTAs
resident on a multiprocessor to keep loads in flight (not yet measured). The numerics
are :mod:`norms_gpu`'s own functions (``_normalise``, ``_softmax_rows``, ``_norm_dx``,
``_softmax_bwd_rows``) on a row vector: a row whose mean square overflows f32 takes the
rescaled statistics behind a branch, ``±inf`` or NaN gives a NaN row, rmsnorm's zero row
gives zeros, softmax's fully ``-inf`` row zeros (log_softmax ``-inf``). The backward
kernels recompute the statistics from ``x`` (softmax: take the saved output), as
:mod:`norms_gpu`'s do; the weight and bias gradients are each CTA's column sums over its
rows, in row order, finished on the canonical pairwise tree, so no atomics and the same
bits every run.

The strided layout needs ``D`` to be a multiple of 128; other rows are left to the Triton
kernels or the references (:func:`supports`).

Kernel calling convention: as :mod:`norms_gpu`'s, ``fn(spec, *operands, interpret)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tessera_jax import _compat
from tessera_jax.pallas_kernels import device, norms_gpu
from tessera_jax.primitives.reductions import pairwise_tree_sum

__all__ = [
    "PREFER",
    "MosaicRowConfig",
    "hardware",
    "layernorm",
    "layernorm_bwd",
    "log_softmax",
    "log_softmax_bwd",
    "prefer",
    "rmsnorm",
    "rmsnorm_bwd",
    "softmax",
    "softmax_bwd",
    "supports",
]

# The strided register layout spreads a row over a warpgroup's 128 threads.
LANES = 128
# Rows wider than this hold more than 128 f32 registers a thread for the row alone.
MAX_ROW = 16384


@dataclasses.dataclass(frozen=True)
class MosaicRowConfig:
    """How one launch tiles the rows.

    Attributes:
      rows: rows each CTA (one warpgroup) walks in order.
      params_per_row: load the weight and bias (rmsnorm's, layernorm's) for each row rather
        than once per CTA: d/128 fewer f32 registers a thread held across the walk for each,
        for one more read of them a row, from the caches. The same bits either way.
      sums_in_smem: the backward keeps its column sums (the weight's and bias's partial
        gradients) in shared memory, 4·d bytes a CTA each, rather than in registers carried
        across the walk (d/128 f32 a thread each). The same bits either way.
    """

    rows: int = 4
    params_per_row: bool = False
    sums_in_smem: bool = False

    def __post_init__(self):
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1:
            raise ValueError(f"MosaicRowConfig: rows={self.rows!r} must be a positive int")
        for knob in ("params_per_row", "sums_in_smem"):
            if not isinstance(value := getattr(self, knob), bool):
                raise TypeError(f"MosaicRowConfig: {knob}={value!r} must be a bool")

    @staticmethod
    def default(n: int, d: int, *, partials: bool) -> MosaicRowConfig:
        """The tiling of ``n`` rows of ``d`` elements when none is given.

        A kernel without column sums walks 4 rows a CTA (the forwards: 1 or 4 ran alike,
        16 slower; benchmarks/archive/norm-mosaic-h200.txt). A backward that writes f32
        column sums for the weight and bias writes a row of them per CTA, and the tree
        reads them back: walking few rows a CTA, that traffic rivals the rows' own (two
        partial rows of 4-byte sums against six bytes an element for every four rows of
        layernorm's), while too few CTAs leave the multiprocessors idle. So it launches
        about one wave of the CTAs that fit at once, their registers the limit
        (:func:`_resident_ctas`), each walking its share of the rows. On an H200 the
        rmsnorm and layernorm backward at 4096- and 8192-wide rows ran 1.2-1.5x faster
        with 256 to 512 CTAs than with 4 rows a CTA, and at 1024- and 2048-wide rows with
        fewer than a wave slower (benchmarks/archive/norm-mosaic-bwd-h200.txt). The
        sums' bits depend on the rows a CTA, so on the shape only: the wave is sized for an
        H100's or H200's multiprocessors on any GPU, as norms_gpu's backward is."""
        if not partials:
            return MosaicRowConfig()
        return MosaicRowConfig(rows=max(1, pl.cdiv(n, device.H100_SMS * _resident_ctas(d))))


def _resident_ctas(d: int) -> int:
    """CTAs of one warpgroup a multiprocessor holds at once for a backward at rows of ``d``:
    its 64K registers over about 4·d/128 live f32 a thread (x, the cotangent, the weight and
    the sums), at most 16 (2048 threads) and at least 4 (wider rows spill beyond the
    register limit)."""
    return max(4, min(16, MAX_ROW // d))


def supports(spec: Any, avals: Sequence[Any]) -> str | None:
    """None if a kernel here can run the case, else why not: :func:`norms_gpu.supports`'s
    conditions, and rows of a multiple of 128 elements, at most :data:`MAX_ROW`."""
    why = norms_gpu.supports(spec, avals)
    if why is not None:
        return why
    d = avals[0].shape[-1]
    if d % LANES or d > MAX_ROW:
        return (
            f"a row of {d} elements: the Mosaic GPU kernels take multiples of {LANES} "
            f"up to {MAX_ROW}"
        )
    return None


def _never(spec: Any, avals: Sequence[Any]) -> bool:
    del spec, avals
    return False


# ``auto`` mode's rules, from an H200 under a jax without the Triton backend. Timed from the
# host (benchmarks/results/norms-mosaic-h200.json: ``benchmarks/norms.py`` with the Triton
# modules blocked; bf16 at 8192×2048, 32768×4096 and 4096×16384, 2²⁴ to 2²⁷ elements), the
# softmax and log_softmax kernels ran 1.01-2.37x jnp forward and their pairs 1.29-2.44x,
# layernorm's forward 1.08-1.26x and its pair 1.49-1.65x at rows of 2048 and 4096 but 0.66x
# at 16384 (its backward holds x, the cotangent and two column sums a thread), and rmsnorm's
# forward 0.99-1.22x but its pair 0.25-0.98x. The references ran 0.63-1.08x at 2²⁶ and up;
# at 2²⁴ host timing is loose (one reference program ran 0.64x and 0.85x jnp in one run).
# Below 2²³ elements, timed inside one program with every gradient consumed at 2²¹
# (benchmarks/archive/norm-mosaic-fallback-h200.txt), a forward kernel beside the reference's
# backward ran 0.67-0.84x jnp and the pairs 0.56-0.89x, where the references ran 0.81-1.09x.
# (Timed inside one program at 2²⁴ elements and up, XLA's own row programs ran up to 2.8x
# slower than from the host, so the large cases are host-timed.) So rmsnorm's forward runs
# alone only (``differentiated``: the reference pair, as for layernorm's wide rows).
prefer = norms_gpu.Preference(rows=(2048, MAX_ROW), min_elements=1 << 23)
_layernorm_pair = norms_gpu.Preference(rows=(2048, 4096), min_elements=1 << 23)
# Each kernel's rule, by the name of the operator it implements.
PREFER = {
    "softmax": prefer,
    "log_softmax": prefer,
    "softmax_bwd": prefer,
    "log_softmax_bwd": prefer,
    "layernorm": norms_gpu.ForwardPreference(alone=prefer, differentiated=_layernorm_pair),
    "layernorm_bwd": _layernorm_pair,
    "rmsnorm": norms_gpu.ForwardPreference(alone=prefer, differentiated=_never),
    "rmsnorm_bwd": _never,
}


def hardware(platform: str) -> str | None:
    """None if this machine's ``platform`` devices can run the compiled kernels, else why not."""
    return device.hopper_only(platform, "a Mosaic GPU kernel")


def _vec_size(d: int, itemsize: int) -> int:
    """Elements a thread holds contiguously of a row of ``d``: up to a 16-byte vector of
    the row's dtype (``itemsize`` bytes), a power of two dividing ``d / 128``."""
    vec = 16 // itemsize
    while (d // LANES) % vec:
        vec //= 2
    return vec


@dataclasses.dataclass(frozen=True)
class _Launch:
    """What a kernel body needs of its launch: ``n`` rows of ``d``, ``rows`` a CTA, and the
    rows' register layout (``vec`` elements a thread, :func:`_vec_size`)."""

    n: int
    d: int
    rows: int
    vec: int
    interpret: bool
    params_per_row: bool = False
    sums_in_smem: bool = False

    @property
    def layout(self):
        return plgpu.Layout.WG_STRIDED((self.d,), vec_size=self.vec)

    def load(self, ref, idx) -> jax.Array:
        """``ref[idx]`` (a row, or the ``(d,)`` parameters) in f32 in the rows' layout:
        the row and an f32 weight must agree on it for an elementwise product, and each
        dtype's default would pick its own 16-byte vector."""
        if self.interpret:  # (the interpreter holds values, not layouts)
            return ref[idx].astype(jnp.float32)
        return _compat.mgpu_load(ref.at[idx], layout=self.layout).astype(jnp.float32)

    def params(self, *refs):
        """A function of no arguments giving the ``(d,)`` parameters of ``refs`` (None
        stays None) as :meth:`load` gives them: loaded here, once per CTA, or at each call
        (each row) with ``params_per_row``."""

        def load():
            return tuple(None if r is None else self.load(r, ()) for r in refs)

        if self.params_per_row:
            return load
        held = load()
        return lambda: held

    def zeros(self) -> jax.Array:
        """An f32 row of zeros in the rows' layout (a loop carry's start)."""
        zeros = jnp.zeros((self.d,), jnp.float32)
        return zeros if self.interpret else plgpu.layout_cast(zeros, self.layout)

    def cta(self) -> jax.Array:
        return lax.axis_index("rows")

    def walk(self, body, carry=None):
        """``carry = body(r, carry)`` for each of this CTA's rows ``r``, in order (with
        ``carry`` None, ``body(r)``)."""
        base = self.cta() * self.rows
        stop = jnp.minimum(base + self.rows, self.n)
        if carry is None:
            pl.loop(base, stop)(body)
            return None
        return lax.fori_loop(base, stop, body, carry)


def _rows(a: jax.Array) -> jax.Array:
    return a.reshape((-1, a.shape[-1]))


def _launch(
    kernel,
    x: jax.Array,
    operands: Sequence[jax.Array],
    outs: int,
    partials: int,
    config,
    interpret,
    name,
):
    """``kernel(*refs, at=_Launch)`` over the rows of ``x``'s shape, one CTA per
    ``config.rows`` of them: ``operands`` are ``(rows, D)`` (:func:`_rows`) or ``(D,)``
    parameters; the outputs are ``outs`` arrays of ``x``'s shape and dtype, then
    ``partials`` f32 ``(CTAs, D)`` arrays (a row of per-CTA column sums each), and with
    ``config.sums_in_smem`` as many ``(D,)`` f32 shared-memory refs after them."""
    d = x.shape[-1]
    n = x.size // d
    config = config or MosaicRowConfig.default(n, d, partials=partials > 0)
    vec = _vec_size(d, x.dtype.itemsize)
    smem = config.sums_in_smem and partials > 0
    at = _Launch(n, d, config.rows, vec, interpret, config.params_per_row, smem)
    ctas = pl.cdiv(n, config.rows)
    out_type = [jax.ShapeDtypeStruct((n, d), x.dtype)] * outs
    out_type += [jax.ShapeDtypeStruct((ctas, d), jnp.float32)] * partials
    call = plgpu.kernel(
        functools.partial(kernel, at=at),
        out_type=out_type,
        # (with sums_in_smem, a (d,) f32 sum for each partial output)
        scratch_types=[plgpu.SMEM((d,), jnp.float32)] * partials if smem else [],
        grid=(ctas,),
        grid_names=("rows",),
        kernel_name=name,
        # Lane semantics (the register layouts above): jax 0.11 made Warpgroup the default.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    results = device.run_mosaic(call, list(operands), interpret=interpret)
    return [r.reshape(x.shape) for r in results[:outs]] + list(results[outs:])


def _softmax_kernel(x_ref, o_ref, *, at: _Launch, log: bool) -> None:
    def row(r):
        o_ref[r] = norms_gpu._softmax_rows(at.load(x_ref, r), log, axis=None).astype(o_ref.dtype)

    at.walk(row)


def _softmax_name(log: bool, suffix: str = "") -> str:
    return f"ts_{'log_' if log else ''}softmax{suffix}_mgpu"


def _softmax(spec, x, *, interpret, config, log):
    del spec  # supports() admits only the last axis
    kernel = functools.partial(_softmax_kernel, log=log)
    return _launch(kernel, x, [_rows(x)], 1, 0, config, interpret, _softmax_name(log))[0]


def softmax(spec, x, *, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_softmax`` over the last axis of ``x`` (a case :func:`supports` accepts)."""
    return _softmax(spec, x, interpret=interpret, config=config, log=False)


def log_softmax(spec, x, *, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_log_softmax`` over the last axis of ``x``."""
    return _softmax(spec, x, interpret=interpret, config=config, log=True)


def _softmax_bwd_kernel(y_ref, g_ref, dx_ref, *, at: _Launch, log: bool) -> None:
    def row(r):
        dx = norms_gpu._softmax_bwd_rows(at.load(y_ref, r), at.load(g_ref, r), log, axis=None)
        dx_ref[r] = dx.astype(dx_ref.dtype)

    at.walk(row)


def _softmax_bwd(spec, y, g, *, interpret, config, log):
    del spec
    kernel = functools.partial(_softmax_bwd_kernel, log=log)
    name = _softmax_name(log, "_bwd")
    return _launch(kernel, y, [_rows(y), _rows(g)], 1, 0, config, interpret, name)[0]


def softmax_bwd(spec, y, g, *, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_softmax_bwd``: ``y·(g − Σ y·g)`` over the last axis, ``y`` softmax's output."""
    return _softmax_bwd(spec, y, g, interpret=interpret, config=config, log=False)


def log_softmax_bwd(spec, y, g, *, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_log_softmax_bwd``: ``g − exp(y)·Σg`` over the last axis."""
    return _softmax_bwd(spec, y, g, interpret=interpret, config=config, log=True)


def _xhat(at: _Launch, x: jax.Array, op: str, eps: float, branch: bool):
    """``(x̂, r)`` of one f32 row: :func:`norms_gpu._normalise` of the row (layernorm: of
    the centred row)."""
    if op == "layernorm":
        x = x - norms_gpu._mean(x, at.d, axis=None)
    return norms_gpu._normalise(x, at.d, eps, guard_zero=op == "rmsnorm", branch=branch, axis=None)


def _norm_kernel(*refs, at: _Launch, op: str, eps: float, weight: bool, bias: bool) -> None:
    refs = list(refs)
    x_ref, o_ref = refs.pop(0), refs.pop()
    params = at.params(refs.pop(0) if weight else None, refs.pop(0) if bias else None)

    def row(r):
        y, _ = _xhat(at, at.load(x_ref, r), op, eps, branch=True)
        w, b = params()
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        o_ref[r] = y.astype(o_ref.dtype)

    at.walk(row)


def _norm(op, spec, x, *params, interpret, config):
    kw = norms_gpu._params(spec)
    weight, bias = kw["has_weight"], kw.get("has_bias", False)
    kernel = functools.partial(_norm_kernel, op=op, eps=kw["eps"], weight=weight, bias=bias)
    operands = [_rows(x), *params]
    return _launch(kernel, x, operands, 1, 0, config, interpret, f"ts_{op}_mgpu")[0]


def rmsnorm(spec, x, *weight, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_rmsnorm(x, [weight])`` with a ``(D,)`` weight."""
    return _norm("rmsnorm", spec, x, *weight, interpret=interpret, config=config)


def layernorm(spec, x, *params, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_layernorm(x, [weight], [bias])`` with ``(D,)`` weight and bias."""
    return _norm("layernorm", spec, x, *params, interpret=interpret, config=config)


def _norm_bwd_kernel(
    *refs, at: _Launch, op: str, eps: float, weight: bool, want_dw: bool, want_db: bool
) -> None:
    """dx of each row, and this CTA's partial column sums of ``ct·x̂`` (dw) and ``ct`` (db)
    over its rows, in row order."""
    refs = list(refs)
    x_ref = refs.pop(0)
    params = at.params(refs.pop(0) if weight else None)
    g_ref, dx_ref = refs.pop(0), refs.pop(0)
    # Only the sums asked for are kept (each d/128 registers a thread, or shared memory).
    outs = [refs.pop(0) for _ in range(want_dw + want_db)]
    smem = refs if at.sums_in_smem else []

    def row(r, acc):
        ct = at.load(g_ref, r)
        xhat, rs = _xhat(at, at.load(x_ref, r), op, eps, branch=False)
        (w,) = params()
        dx = norms_gpu._norm_dx(op, xhat, rs, ct, w, at.d, axis=None)
        dx_ref[r] = dx.astype(dx_ref.dtype)
        terms = ([ct * xhat] if want_dw else []) + ([ct] if want_db else [])
        if not smem:
            return tuple(a + t for a, t in zip(acc, terms))
        for ref, t in zip(smem, terms):  # each thread updates its own elements
            ref[...] = at.load(ref, ()) + t
        return acc

    if smem:
        for ref in smem:
            ref[...] = at.zeros()
        at.walk(row, ())
        sums = [at.load(ref, ()) for ref in smem]
    else:
        sums = at.walk(row, (at.zeros(),) * len(outs))
    for ref, total in zip(outs, sums):
        ref[at.cta()] = total


def _norm_bwd(op, spec, x, *rest, interpret, config):
    kw = norms_gpu._params(spec)
    want_dw = kw["weight_grad_shape"] is not None
    want_db = kw.get("bias_grad_shape") is not None
    *w, ct = rest
    kernel = functools.partial(
        _norm_bwd_kernel,
        op=op,
        eps=kw["eps"],
        weight=kw["has_weight"],
        want_dw=want_dw,
        want_db=want_db,
    )
    operands = [_rows(x), *w, _rows(ct)]
    dx, *partials = _launch(
        kernel, x, operands, 1, want_dw + want_db, config, interpret, f"ts_{op}_bwd_mgpu"
    )
    # The column sums of the CTAs' partials, in f32 on the canonical tree, as norms_gpu's.
    return (dx, *(pairwise_tree_sum(s, axis=0) for s in partials))


def rmsnorm_bwd(spec, x, *rest, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_rmsnorm_bwd(x, [weight], ct) -> (dx, [dweight])``; dweight in f32, ``(D,)``."""
    return _norm_bwd("rmsnorm", spec, x, *rest, interpret=interpret, config=config)


def layernorm_bwd(spec, x, *rest, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_layernorm_bwd(x, [weight], ct) -> (dx, [dweight], [dbias])``; f32 ``(D,)`` sums."""
    return _norm_bwd("layernorm", spec, x, *rest, interpret=interpret, config=config)
