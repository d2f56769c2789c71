"""Row-wise softmax, log_softmax, rmsnorm and layernorm forward kernels in Pallas Mosaic GPU:
the port of :mod:`norms_gpu`'s Triton forwards, for when Pallas' Triton backend (deprecated
from jax 0.11) is gone.

Not dispatched yet: no operator registers these kernels until they are measured against
jnp, the references and the Triton kernels (``benchmarks/archive/norm_mosaic_probe.py``).

A CTA is one warpgroup that walks ``MosaicRowConfig.rows`` rows in order. Each row goes from
global memory straight into registers, spread over the warpgroup's 128 threads in the
strided layout (``D / 128`` elements a thread, in vectors); its statistics are full
reductions of that vector (warp shuffles, then shared memory between the warps), so a row
is read once and written once, and its reduction order depends on ``D`` only, not on the
row count. There is no TMA or shared-memory staging: the design counts on the many CTAs
resident on a multiprocessor to keep loads in flight (not yet measured). The numerics
are :mod:`norms_gpu`'s own functions (``_normalise``, ``_softmax_rows``) on a row vector: a
row whose mean square overflows f32 takes the rescaled statistics behind a branch, ``±inf``
or NaN gives a NaN row, rmsnorm's zero row gives zeros, softmax's fully ``-inf`` row zeros
(log_softmax ``-inf``).

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

from tessera_jax.pallas_kernels import device, norms_gpu

__all__ = ["MosaicRowConfig", "layernorm", "log_softmax", "rmsnorm", "softmax", "supports"]

# The strided register layout spreads a row over a warpgroup's 128 threads.
LANES = 128
# Rows wider than this hold more than 128 f32 registers a thread for the row alone.
MAX_ROW = 16384


@dataclasses.dataclass(frozen=True)
class MosaicRowConfig:
    """How one launch tiles the rows.

    Attributes:
      rows: rows each CTA (one warpgroup) walks in order.
    """

    rows: int = 4

    def __post_init__(self):
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1:
            raise ValueError(f"MosaicRowConfig: rows={self.rows!r} must be a positive int")


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


def _vec_size(d: int, itemsize: int) -> int:
    """Elements a thread holds contiguously of a row of ``d``: up to a 16-byte vector of
    the row's dtype (``itemsize`` bytes), a power of two dividing ``d / 128``."""
    vec = 16 // itemsize
    while (d // LANES) % vec:
        vec //= 2
    return vec


def _load_row(ref, idx, d: int, vec: int, interpret: bool) -> jax.Array:
    """``ref[idx]`` (a row of ``d``, or the ``(d,)`` parameters) in f32 in the strided
    layout of ``vec`` elements a thread: the row and an f32 weight must agree on it for an
    elementwise product, and each dtype's default would pick its own 16-byte vector."""
    if interpret:  # (the interpreter holds values, not layouts)
        return ref[idx].astype(jnp.float32)
    layout = plgpu.Layout.WG_STRIDED((d,), vec_size=vec)
    return plgpu.load(ref, idx, layout=layout).astype(jnp.float32)


def _walk(n: int, rows: int, body) -> None:
    """``body(r)`` for each of this CTA's rows ``r``, in order."""
    base = lax.axis_index("rows") * rows
    pl.loop(base, jnp.minimum(base + rows, n))(body)


def _launch(kernel, x: jax.Array, params: Sequence[jax.Array], config, interpret, name):
    """``kernel(x_ref, *param_refs, o_ref, n=, rows=, load=)`` over ``x``'s rows, one CTA
    per ``config.rows`` of them; ``load(ref, idx)`` is :func:`_load_row`."""
    config = config or MosaicRowConfig()
    x2 = x.reshape((-1, x.shape[-1]))
    n, d = x2.shape
    vec = _vec_size(d, x.dtype.itemsize)
    load = functools.partial(_load_row, d=d, vec=vec, interpret=interpret)
    call = plgpu.kernel(
        functools.partial(kernel, n=n, rows=config.rows, load=load),
        out_type=jax.ShapeDtypeStruct(x2.shape, x.dtype),
        grid=(pl.cdiv(n, config.rows),),
        grid_names=("rows",),
        kernel_name=name,
    )
    return device.run_mosaic(call, [x2, *params], interpret=interpret).reshape(x.shape)


def _softmax_kernel(x_ref, o_ref, *, n: int, rows: int, load, log: bool) -> None:
    def row(r):
        x = load(x_ref, r)
        o_ref[r] = norms_gpu._softmax_rows(x, log, axis=None).astype(o_ref.dtype)

    _walk(n, rows, row)


def _softmax(spec, x, *, interpret, config, log):
    del spec  # supports() admits only the last axis
    kernel = functools.partial(_softmax_kernel, log=log)
    name = "ts_log_softmax_mgpu" if log else "ts_softmax_mgpu"
    return _launch(kernel, x, [], config, interpret, name)


def softmax(spec, x, *, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_softmax`` over the last axis of ``x`` (a case :func:`supports` accepts)."""
    return _softmax(spec, x, interpret=interpret, config=config, log=False)


def log_softmax(spec, x, *, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_log_softmax`` over the last axis of ``x``."""
    return _softmax(spec, x, interpret=interpret, config=config, log=True)


def _norm_kernel(
    *refs, n: int, rows: int, load, op: str, eps: float, weight: bool, bias: bool
) -> None:
    refs = list(refs)
    x_ref, o_ref = refs.pop(0), refs.pop()
    # The parameters are loaded once per CTA, in f32, in the row's layout.
    w = load(refs.pop(0), ()) if weight else None
    b = load(refs.pop(0), ()) if bias else None
    d = x_ref.shape[-1]

    def row(r):
        x = load(x_ref, r)
        if op == "layernorm":
            x = x - norms_gpu._mean(x, d, axis=None)
        y, _ = norms_gpu._normalise(x, d, eps, guard_zero=op == "rmsnorm", branch=True, axis=None)
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        o_ref[r] = y.astype(o_ref.dtype)

    _walk(n, rows, row)


def _norm(op, spec, x, *params, interpret, config):
    kw = dict(spec)
    weight, bias = kw["has_weight"], kw.get("has_bias", False)
    kernel = functools.partial(_norm_kernel, op=op, eps=kw["eps"], weight=weight, bias=bias)
    return _launch(kernel, x, params, config, interpret, f"ts_{op}_mgpu")


def rmsnorm(spec, x, *weight, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_rmsnorm(x, [weight])`` with a ``(D,)`` weight."""
    return _norm("rmsnorm", spec, x, *weight, interpret=interpret, config=config)


def layernorm(spec, x, *params, interpret: bool = False, config: MosaicRowConfig | None = None):
    """``ts_layernorm(x, [weight], [bias])`` with ``(D,)`` weight and bias."""
    return _norm("layernorm", spec, x, *params, interpret=interpret, config=config)
