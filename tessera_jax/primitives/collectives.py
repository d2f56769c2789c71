"""Collectives as operators: all_reduce, all_gather, reduce_scatter, scatter, all_to_all.

Two views
---------
*Inside an SPMD region* (``ts.index_launch``, ``jax.shard_map``), where ``axis`` is a
bound mesh axis, a collective combines the per-part values ``x`` of the parts
along ``axis``, as in MPI/NCCL:

=================================  =================================================
``all_reduce(x, op, axis)``        every part gets ``op`` over the parts' ``x``
``all_gather(x, axis, dim)``       every part gets the parts' ``x`` concatenated on ``dim``
``reduce_scatter(x, axis, dim)``   the sum over parts; part r keeps slice r of ``dim``
``scatter(x, axis, dim)``          part r keeps slice r of ``dim`` of its ``x``
``all_to_all(x, axis, s, c)``      slice j of dim ``s`` goes to part j; received slices
                                   are concatenated on dim ``c`` in part order
=================================  =================================================

*Outside* (a global array, eager or under ``jax.jit``), a collective is the same
operation applied to the parts of ``x`` over ``axis`` of a mesh (``mesh=``, the
mesh of a DistTensor argument, or ``with mesh:``): ``all_reduce`` and
``reduce_scatter`` combine the parts of ``x`` along dim 0 (``x.shape[0]`` is
``n`` times the part's), so ``all_reduce`` returns one part-sized, replicated
result; ``all_gather``, ``scatter`` and ``all_to_all`` move data without
changing the global values: they reshard ``x`` (replicated / partitioned on
``dim`` / partitioned on ``s`` instead of ``c``).

Determinism
-----------
``all_reduce(..., op="sum", deterministic=True)`` (the default) returns, on every
part, the canonical pairwise tree of ``primitives/reductions.py`` over the parts
in rank order, ``((x0+x1)+(x2+x3))+…`` (an odd last node passes up unchanged),
accumulating 8-/16-bit floats in f32 and rounding once: bitwise the same as
``ts.op.sum`` of the stacked parts on one device, run after run, whatever NCCL
would have chosen. ``algo`` chooses how the data moves, never the bits:

* ``"binary_tree"``: all_to_all (rank j receives every rank's j-th 1/n chunk),
  the tree over the n received chunks locally, all_gather. Each rank sends and
  receives ``2(n-1)/n`` of the message, like NCCL's ring all-reduce
  (measured 0.95x ``psum`` at 512 MiB on 4xH200, docs in benchmarks/allreduce.py).
* ``"ring"``: the same, with the all_to_all done as ``n-1`` ``ppermute`` rounds
  (rank r sends to r+s in round s): for fabrics where all-to-all is slow.
* ``"nvlink"``: one Mosaic GPU kernel (``pallas_kernels/allreduce_mgpu.py``): each
  rank pushes chunk j of its ``x`` straight into rank j's memory over NVLink, rank j
  adds the n contributions on the tree and pushes the result to every rank. The same
  bytes as the others in one launch, every transfer a posted write (4xH200, three
  benchmark runs: 1.04-1.17x ``psum`` at 64 MiB, 1.10-1.12x at 512 MiB). It runs on
  cuda (Hopper), with every device in this process, a sum/mean of f32/bf16/f16 over
  one mesh axis, outside ``TESSERA_KERNELS=xla|interpret``; elsewhere it is
  ``"binary_tree"`` (the same bits).
* ``"auto"``: ``"nvlink"`` for messages of at least 32 MiB per rank where it runs
  (``allreduce_mgpu.MIN_BYTES``: below that its fixed cost, ~0.2 ms, loses); else
  NCCL's own all-reduce (``lax.psum``/``pmax``/``pmin``) where the order cannot change the bits
  (``order_free``: integer sums, maxima and minima; a float sum over 2 parts in its
  accumulation dtype (f32/f64), one addition, which commutes); else all_gather + the
  local tree for messages up to 1 MiB per rank (one collective: latency-bound
  sizes; 4xH200 at 1 MiB, three runs: 0.98 / 0.81 / 0.83x ``psum`` against 0.83 /
  0.63 / 0.87x for ``"binary_tree"``), else ``"binary_tree"``.

``deterministic=False`` uses ``lax.psum``/``psum_scatter`` (NCCL's order). ``max``
and ``min`` are exact in any order; ``mean`` is the tree sum divided by n.

Adjoints
--------
Each collective is a primitive ``ts_<name>`` in the jaxpr (``ts_all_reduce``,
``ts_all_gather``, ``ts_reduce_scatter``, ``ts_scatter``, ``ts_all_to_all``,
``ts_replicate``), typed in JAX's typing of values that vary over mesh axes (an
all_reduce result is the same on every part along ``axis``; scatter's and
replicate's vary over it; the others vary as their operand) and carrying the
named-axis effects of jax's own collectives. A value that is the same on every
part and enters a collective (or an index launch) becomes each part's own copy
through ``replicate``.

The linear ones (all_reduce sum/mean, all_gather, reduce_scatter, scatter,
all_to_all, replicate) have the same collective on the tangent as their JVP and
explicit transposes: all_gather <-> reduce_scatter (the deterministic tree when
``deterministic=True``), all_reduce(sum) -> ``replicate`` of the replicated
cotangent (no communication; ``pvary`` when ``deterministic=False``), mean -> the
same of ``ct / n``, scatter -> all_gather (or, for a part's own ``x``, its slice
put back in zeros), all_to_all -> the reverse all_to_all, replicate -> the
canonical-tree all_reduce. ``max``/``min``: the tangent at the extremum, ties
sharing it equally (``all_reduce(hit * t) / all_reduce(hit)``). So ``jax.grad``
(linearize + transpose), ``jax.jvp``/``jax.jacfwd``, higher orders and
``jax.vmap`` over a plain batch dim all go through; differentiating an adjoint
again stays on the tree (replicate <-> all_reduce).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from tessera_jax import _compat
from tessera_jax._config import get_kernel_mode
from tessera_jax.pallas_kernels import allreduce_mgpu
from tessera_jax.primitives._core import as_array, check_dtype, compute_dtype, normalize_axis
from tessera_jax.primitives.reductions import pairwise_tree_sum

OPS = ("sum", "mean", "max", "min")
ALGOS = ("auto", "binary_tree", "ring", "nvlink")
SCATTER_ALGOS = ("auto", "binary_tree", "ring")
# "auto": per-rank messages up to this size take all_gather + local tree.
SMALL_MESSAGE_BYTES = 1 << 20

_NUMERIC = (jnp.number,)


# --- the deterministic data path ---------------------------------------------------------


def axis_size(axes: tuple[str, ...]) -> int:
    return math.prod(lax.axis_size(a) for a in axes)


def tree_over_ranks(stacked: jax.Array) -> jax.Array:
    """``(n, ...) -> (...)``: the canonical pairwise tree over the leading (rank) axis,
    accumulating 8-/16-bit floats in f32 and rounding once."""
    acc = compute_dtype(stacked.dtype)
    return pairwise_tree_sum(stacked.astype(acc), axis=0).astype(stacked.dtype)


def _combine_ranks(stacked: jax.Array, op: str) -> jax.Array:
    if op == "max":
        return jnp.max(stacked, axis=0)
    if op == "min":
        return jnp.min(stacked, axis=0)
    return tree_over_ranks(stacked)


def exchange(chunks: jax.Array, axes: tuple[str, ...], algo: str) -> jax.Array:
    """``chunks[j]`` is this rank's contribution for rank j; returns ``recv`` with
    ``recv[j]`` = rank j's contribution for this rank (an all_to_all)."""
    n = chunks.shape[0]
    if algo != "ring" or n == 1:
        return lax.all_to_all(chunks, axes, 0, 0, tiled=True)
    rank = lax.axis_index(axes)
    mine = lax.dynamic_index_in_dim(chunks, rank, 0, keepdims=False)
    recv = lax.dynamic_update_index_in_dim(jnp.zeros_like(chunks), mine, rank, 0)
    for s in range(1, n):
        send = lax.dynamic_index_in_dim(chunks, (rank + s) % n, 0, keepdims=False)
        got = lax.ppermute(send, axes, perm=[(r, (r + s) % n) for r in range(n)])
        recv = lax.dynamic_update_index_in_dim(recv, got, (rank - s) % n, 0)
    return recv


def _use_kernel(x, axes, n: int, op: str, algo: str, platform: str | None) -> bool:
    """Whether the NVLink kernel runs this all-reduce: asked for (``nvlink``, or ``auto``
    where the kernel is preferred), allowed by the kernel mode, and able to run here."""
    mode = get_kernel_mode()
    if algo not in ("auto", "nvlink") or mode in ("xla", "interpret"):
        return False
    if not allreduce_mgpu.eligible(platform, x.dtype, axes, n, op):
        return False
    return algo == "nvlink" or mode == "pallas" or allreduce_mgpu.prefer(x)


def _pick_algo(x: jax.Array, n: int, algo: str) -> str:
    if algo != "auto":
        return algo
    small = x.size * x.dtype.itemsize <= SMALL_MESSAGE_BYTES
    return "gather" if small or x.size < n else "binary_tree"


def order_free(dtype: Any, n: int, op: str) -> bool:
    """Whether every reduction order gives the canonical tree's bits, so NCCL's own
    all-reduce can run it: integer sums, maxima and minima (exact and associative, with
    wrap-around), and a sum over 2 parts in the accumulation dtype (one addition, and IEEE
    addition commutes; NaN payloads aside)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return True
    return op == "sum" and n == 2 and compute_dtype(dtype) == dtype


def tree_all_reduce(
    x: jax.Array,
    axes: tuple[str, ...],
    op: str = "sum",
    algo: str = "auto",
    platform: str | None = None,
):
    """The deterministic all-reduce of ``x`` over ``axes`` (module docstring); the
    result is typed invariant over ``axes``. ``platform``: the one being lowered for,
    where known (the NVLink kernel needs cuda)."""
    n = axis_size(axes)
    if _use_kernel(x, axes, n, op, algo, platform):
        return allreduce_mgpu.all_reduce(x, axes[0], n)
    if algo == "nvlink":
        algo = "binary_tree"
    if algo == "auto" and order_free(x.dtype, n, op):
        return {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op](x, axes)
    algo = _pick_algo(x, n, algo)
    if algo == "gather":
        stacked = _compat.all_gather_invariant(x[None], axes, axis=0, tiled=True)
        return _combine_ranks(stacked, op)
    flat = x.reshape(-1)
    size = flat.shape[0]
    m = -(-size // n)
    if m * n != size:
        flat = jnp.pad(flat, (0, m * n - size))
    recv = exchange(flat.reshape(n, m), axes, algo)
    mine = _combine_ranks(recv, op)
    full = _compat.all_gather_invariant(mine, axes, axis=0, tiled=True)
    return full[:size].reshape(x.shape)


def tree_reduce_scatter(x: jax.Array, axes: tuple[str, ...], dim: int, algo: str = "auto"):
    """Sum over ``axes`` on the canonical tree; rank r keeps slice r of ``dim``."""
    n = axis_size(axes)
    xm = jnp.moveaxis(x, dim, 0)
    chunks = xm.reshape(n, -1)
    recv = exchange(chunks, axes, "ring" if algo == "ring" else "binary_tree")
    out = tree_over_ranks(recv).reshape(xm.shape[0] // n, *xm.shape[1:])
    return jnp.moveaxis(out, 0, dim)


# --- operators (SPMD view): primitives with explicit adjoints ----------------------------
#
# Each collective is a primitive ``ts_<name>`` whose parameters are static: ``axes`` (a
# tuple of bound mesh axis names) and the operator's options. Abstract evaluation types
# the result by the mesh axes it varies over (inside ``shard_map(check_vma=True)``); the
# lowering traces the data path above (vma-free, as every Tessera lowering: the HLO is the
# same), inside shard_map's lowering, where the mesh axes are bound; JVPs, transposes and
# batching rules follow each primitive.

ad = _compat.ad
batching = _compat.batching
mlir = _compat.mlir


def _primitive(name: str) -> Any:
    prim = _compat.Primitive(f"ts_{name}")
    prim.def_impl(functools.partial(_compat.apply_primitive, prim))
    return prim


all_reduce_p = _primitive("all_reduce")
reduce_scatter_p = _primitive("reduce_scatter")
all_gather_p = _primitive("all_gather")
scatter_p = _primitive("scatter")
all_to_all_p = _primitive("all_to_all")
replicate_p = _primitive("replicate")


def _bound_size(name: str, axes: tuple[str, ...]) -> int:
    """The number of parts along ``axes``, or a NameError if one is not bound here."""
    for a in axes:
        if not _compat.axis_is_bound(a):
            raise NameError(
                f"{name}: mesh axis {a!r} is not bound here; collectives run inside "
                f"ts.index_launch or jax.shard_map over {a!r}"
            )
    return axis_size(axes)


def _require_varying(name: str, x: Any, axes: tuple[str, ...]) -> frozenset:
    """``x``'s varying axes; a ValueError if (under vma typing) ``x`` is the same on the
    parts along some of ``axes`` (the public functions ``replicate`` it first)."""
    vma = _compat.varying_axes_of_aval(x)
    missing = tuple(a for a in axes if a not in vma)
    if missing and _compat.vma_checking():
        raise ValueError(
            f"{name}: x must vary over the axes {axes} it combines over; it is typed as "
            f"varying over {tuple(sorted(vma))} (replicate(x, {missing}) makes each part's "
            "own copy)"
        )
    return vma


def _typed(x: Any, shape: tuple[int, ...], vma: frozenset, axes: tuple[str, ...]):
    """The result aval (``x``'s dtype, ``shape``, varying over ``vma``) and the effects."""
    out = _compat.with_varying(x.update(shape=shape), frozenset(vma), x)
    return out, _compat.named_axis_effects(axes)


def _resized(name: str, x: Any, dim: int, n: int, what: str, grow: bool) -> tuple[int, ...]:
    if dim >= x.ndim:
        raise ValueError(f"{name}: {what}={dim} is out of range for x of rank {x.ndim}")
    shape = list(x.shape)
    if grow:
        shape[dim] *= n
    elif shape[dim] % n:
        raise ValueError(f"{name}: x.shape[{dim}]={shape[dim]} must be a multiple of the {n} parts")
    else:
        shape[dim] //= n
    return tuple(shape)


def _lowering(impl, with_platform: bool = False):
    """A lowering rule tracing ``impl`` (the data path) on vma-free avals; with
    ``with_platform``, ``impl`` is told the platform (the one lowered for, else None)."""

    def rule(ctx, x, **params):
        if with_platform:
            platforms = tuple(ctx.module_context.platforms)
            params["platform"] = platforms[0] if len(platforms) == 1 else None
        with _compat.lowering_without_vma(ctx) as ctx:
            return mlir.lower_fun(impl, multiple_results=False)(ctx, x, **params)

    return rule


def _batcher(prim: Any, dim_params: tuple[str, ...]):
    """vmap over a plain batch dim of an SPMD value: the batch dim moves to the front and
    the primitive's dim parameters shift by one (all_reduce/replicate: elementwise)."""

    def rule(axis_data, vals_in, dims_in, **params):
        (x,), (d,) = vals_in, dims_in
        if axis_data.name in params["axes"]:
            raise NotImplementedError(
                f"{prim.name}: a collective over the vmapped axis {axis_data.name!r} is not "
                "supported; collectives run over mesh axes (ts.index_launch / jax.shard_map)"
            )
        if d is _compat.not_mapped:
            return prim.bind(x, **params), _compat.not_mapped
        if not dim_params:
            return prim.bind(x, **params), d
        x = jnp.moveaxis(x, d, 0)
        return prim.bind(x, **{**params, **{k: params[k] + 1 for k in dim_params}}), 0

    batching.fancy_primitive_batchers[prim] = rule


def _broadcast(ct: jax.Array, axes: tuple[str, ...], deterministic: bool) -> jax.Array:
    """A cotangent that is the same on every part along ``axes`` as each part's own copy:
    through ``replicate`` (whose own adjoint is the tree) when deterministic, else ``pvary``
    (whose adjoint is ``psum``). No data moves either way."""
    return replicate(ct, axes) if deterministic else _compat.pvary(ct, axes)


# all_reduce: every part gets op over the parts along axes (typed invariant over them).


def _all_reduce_impl(x, *, axes, op, algo, deterministic, platform=None):
    if op in ("max", "min"):
        if deterministic:
            return tree_all_reduce(x, axes, op, algo)
        return (lax.pmax if op == "max" else lax.pmin)(x, axes)
    y = tree_all_reduce(x, axes, "sum", algo, platform) if deterministic else lax.psum(x, axes)
    return y / jnp.asarray(axis_size(axes), y.dtype) if op == "mean" else y


def _all_reduce_abstract_eval(x, *, axes, op, algo, deterministic):
    _bound_size("ts_all_reduce", axes)
    vma = _require_varying("ts_all_reduce", x, axes)
    return _typed(x, x.shape, vma - set(axes), axes)


def _all_reduce_transpose(ct, x, *, axes, op, algo, deterministic):
    if op not in ("sum", "mean"):  # max/min's JVP is written with sums: never transposed
        raise NotImplementedError(f"ts_all_reduce: op={op!r} is not linear")
    if op == "mean":
        ct = ct / jnp.asarray(axis_size(axes), ct.dtype)
    return (_broadcast(ct, axes, deterministic),)


def _all_reduce_jvp(primals, tangents, *, axes, op, algo, deterministic):
    (x,), (t,) = primals, tangents
    params = dict(axes=axes, algo=algo, deterministic=deterministic)
    y = all_reduce_p.bind(x, op=op, **params)
    if type(t) is ad.Zero:
        return y, _compat.zero_tangent(y)
    if op in ("sum", "mean"):  # linear
        return y, all_reduce_p.bind(t, op=op, **params)
    # Ties share the derivative equally (as ts.op.max does).
    hit = (x == y).astype(t.dtype)
    total = all_reduce_p.bind(hit * t, op="sum", **params)
    return y, total / all_reduce_p.bind(hit, op="sum", **params)


all_reduce_p.def_effectful_abstract_eval(_all_reduce_abstract_eval)
mlir.register_lowering(all_reduce_p, _lowering(_all_reduce_impl, with_platform=True))
ad.deflinear2(all_reduce_p, _all_reduce_transpose)
ad.primitive_jvps[all_reduce_p] = _all_reduce_jvp
_batcher(all_reduce_p, ())


# reduce_scatter <-> all_gather: the sum over parts, part r keeping slice r of dim; the
# parts' values concatenated on dim (typed varying, like the operand).


def _reduce_scatter_impl(x, *, axes, dim, algo, deterministic):
    if deterministic:
        return tree_reduce_scatter(x, axes, dim, algo)
    return lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)


def _reduce_scatter_abstract_eval(x, *, axes, dim, algo, deterministic):
    n = _bound_size("ts_reduce_scatter", axes)
    vma = _require_varying("ts_reduce_scatter", x, axes)
    return _typed(x, _resized("ts_reduce_scatter", x, dim, n, "dim", False), vma, axes)


def _reduce_scatter_transpose(ct, x, *, axes, dim, algo, deterministic):
    return (all_gather_p.bind(ct, axes=axes, dim=dim, deterministic=deterministic),)


def _all_gather_impl(x, *, axes, dim, deterministic):
    return lax.all_gather(x, axes, axis=dim, tiled=True)


def _all_gather_abstract_eval(x, *, axes, dim, deterministic):
    n = _bound_size("ts_all_gather", axes)
    vma = _require_varying("ts_all_gather", x, axes)
    return _typed(x, _resized("ts_all_gather", x, dim, n, "dim", True), vma, axes)


def _all_gather_transpose(ct, x, *, axes, dim, deterministic):
    params = dict(axes=axes, dim=dim, algo="auto", deterministic=deterministic)
    return (reduce_scatter_p.bind(ct, **params),)


reduce_scatter_p.def_effectful_abstract_eval(_reduce_scatter_abstract_eval)
mlir.register_lowering(reduce_scatter_p, _lowering(_reduce_scatter_impl))
ad.deflinear2(reduce_scatter_p, _reduce_scatter_transpose)
_batcher(reduce_scatter_p, ("dim",))

all_gather_p.def_effectful_abstract_eval(_all_gather_abstract_eval)
mlir.register_lowering(all_gather_p, _lowering(_all_gather_impl))
ad.deflinear2(all_gather_p, _all_gather_transpose)
_batcher(all_gather_p, ("dim",))


# scatter: part r keeps slice r of dim of its x (typed varying over axes).


def _scatter_impl(x, *, axes, dim):
    block = x.shape[dim] // axis_size(axes)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axes) * block, block, axis=dim)


def _scatter_abstract_eval(x, *, axes, dim):
    n = _bound_size("ts_scatter", axes)
    vma = _compat.varying_axes_of_aval(x)
    if _compat.vma_checking():
        vma = vma | set(axes)
    return _typed(x, _resized("ts_scatter", x, dim, n, "dim", False), vma, axes)


def _scatter_transpose(ct, x, *, axes, dim):
    same = tuple(a for a in axes if a not in _compat.varying_axes_of_aval(x.aval))
    if len(same) == len(axes):  # x was the same on every part: its cotangent gathers the slices
        return (_compat.all_gather_invariant(ct, axes, axis=dim, tiled=True),)
    n = axis_size(axes)
    shape = list(ct.shape)
    shape[dim] *= n
    zeros = jnp.zeros(shape, ct.dtype)
    placed = lax.dynamic_update_slice_in_dim(zeros, ct, lax.axis_index(axes) * ct.shape[dim], dim)
    if same:  # the same along some axes: add the parts' disjoint slices (exact)
        placed = all_reduce_p.bind(placed, axes=same, op="sum", algo="auto", deterministic=True)
    return (placed,)


scatter_p.def_effectful_abstract_eval(_scatter_abstract_eval)
mlir.register_lowering(scatter_p, _lowering(_scatter_impl))
ad.deflinear2(scatter_p, _scatter_transpose)
_batcher(scatter_p, ("dim",))


# all_to_all: slice j of split_dim goes to part j; received slices concatenated on
# concat_dim in part order. Its adjoint is the reverse all_to_all.


def _all_to_all_impl(x, *, axes, split_dim, concat_dim):
    return lax.all_to_all(x, axes, split_dim, concat_dim, tiled=True)


def _all_to_all_abstract_eval(x, *, axes, split_dim, concat_dim):
    n = _bound_size("ts_all_to_all", axes)
    vma = _require_varying("ts_all_to_all", x, axes)
    shape = _resized("ts_all_to_all", x, split_dim, n, "split_dim", False)
    shape = _resized("ts_all_to_all", x.update(shape=shape), concat_dim, n, "concat_dim", True)
    return _typed(x, shape, vma, axes)


def _all_to_all_transpose(ct, x, *, axes, split_dim, concat_dim):
    return (all_to_all_p.bind(ct, axes=axes, split_dim=concat_dim, concat_dim=split_dim),)


all_to_all_p.def_effectful_abstract_eval(_all_to_all_abstract_eval)
mlir.register_lowering(all_to_all_p, _lowering(_all_to_all_impl))
ad.deflinear2(all_to_all_p, _all_to_all_transpose)
_batcher(all_to_all_p, ("split_dim", "concat_dim"))


# replicate: x, the same on every part along axes, as each part's own copy (typed varying
# over axes; no data moves). Its adjoint adds the copies' cotangents on the canonical tree.


def _replicate_abstract_eval(x, *, axes):
    _bound_size("ts_replicate", axes)
    vma = _compat.varying_axes_of_aval(x)
    if vma & set(axes):
        raise ValueError(f"ts_replicate: x already varies over {tuple(sorted(vma & set(axes)))}")
    out, _ = _typed(x, x.shape, vma | set(axes), axes)
    return out, set()  # as jax's pvary: a type change, no communication


def _replicate_transpose(ct, x, *, axes):
    return (all_reduce_p.bind(ct, axes=axes, op="sum", algo="auto", deterministic=True),)


replicate_p.def_effectful_abstract_eval(_replicate_abstract_eval)
mlir.register_lowering(replicate_p, lambda ctx, x, *, axes: [x])
ad.deflinear2(replicate_p, _replicate_transpose)
_batcher(replicate_p, ())


def replicate(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` as every part's own copy along ``axes`` (typed varying over them); its
    adjoint adds the copies' cotangents on the canonical tree (jax's implicit ``pvary``
    would transpose to ``psum``, NCCL's order)."""
    missing = tuple(a for a in axes if a not in _compat.varying_axes(x))
    if not missing or not _compat.vma_checking():
        return x
    return replicate_p.bind(x, axes=missing)


def ts_all_reduce(x, axes, op, algo, deterministic):
    return all_reduce_p.bind(
        replicate(x, axes), axes=axes, op=op, algo=algo, deterministic=deterministic
    )


def ts_reduce_scatter(x, axes, dim, algo, deterministic):
    return reduce_scatter_p.bind(
        replicate(x, axes), axes=axes, dim=dim, algo=algo, deterministic=deterministic
    )


def ts_all_gather(x, axes, dim, deterministic):
    return all_gather_p.bind(replicate(x, axes), axes=axes, dim=dim, deterministic=deterministic)


def ts_scatter(x, axes, dim):
    return scatter_p.bind(x, axes=axes, dim=dim)


def ts_all_to_all(x, axes, split_dim, concat_dim):
    return all_to_all_p.bind(
        replicate(x, axes), axes=axes, split_dim=split_dim, concat_dim=concat_dim
    )


# --- public functions --------------------------------------------------------------------


def _axes_of(op: str, axis: Any, mesh: Any) -> tuple[str, ...]:
    if axis is None:
        if mesh is None:
            raise ValueError(f"{op}: pass axis=... (a mesh axis name) or mesh=...")
        return tuple(mesh.axes)
    if isinstance(axis, str):
        return (axis,)
    if isinstance(axis, (tuple, list)) and axis and all(isinstance(a, str) for a in axis):
        return tuple(axis)
    raise TypeError(f"{op}: axis={axis!r} must be a mesh axis name or a tuple of names")


def _prepare(op: str, x: Any, axis: Any, mesh: Any):
    """``(x as array, axes, mesh or None)``; mesh None means the SPMD view."""
    from tessera_jax.sharding.mesh import resolve_mesh
    from tessera_jax.sharding.tensor import DistTensor

    dist = x if isinstance(x, DistTensor) else None
    x = as_array(op, "x", x.array if dist is not None else x)
    names = (axis,) if isinstance(axis, str) else tuple(axis or ())
    if names and all(_compat.axis_is_bound(a) for a in names):
        return x, _axes_of(op, axis, None), None
    m = resolve_mesh(op, mesh, dist)
    axes = _axes_of(op, axis, m)
    for a in axes:
        if a not in m.axes:
            raise ValueError(f"{op}: axis {a!r} is not an axis of the mesh {m.axes}")
    return x, axes, m


def _entry(axes: tuple[str, ...]) -> Any:
    return axes[0] if len(axes) == 1 else axes


def _spec_at(dim: int, axes: tuple[str, ...]) -> P:
    return P(*([None] * dim), _entry(axes))


def _check_divisible(op: str, x: jax.Array, dim: int, n: int, what: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"{op}: x.shape[{dim}]={x.shape[dim]} must be a multiple of the {n} {what}"
        )


def _local_size(axes: tuple[str, ...], mesh: Any) -> int:
    return axis_size(axes) if mesh is None else mesh.axis_size(axes)


def _shard_map(fn, mesh, in_spec, out_spec):
    return _compat.shard_map(
        fn, mesh=mesh.jax_mesh, in_specs=(in_spec,), out_specs=out_spec, check_vma=True
    )


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return replicate(x, axes)


def all_reduce(
    x: Any,
    op: str = "sum",
    axis: str | Sequence[str] | None = None,
    *,
    algo: str = "auto",
    deterministic: bool = True,
    mesh: Any = None,
) -> jax.Array:
    """Combines ``x`` over the parts along mesh ``axis`` with ``op``.

    Arguments:
      x: inside an SPMD region, this part's value; outside, a global array whose
        dim 0 holds the parts (its size is a multiple of the axis size).
      op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
      axis: a mesh axis name or tuple of names (default: every axis of the mesh).
      algo: ``"auto"``, ``"binary_tree"``, ``"ring"`` or ``"nvlink"``: how data moves,
        never the bits (module docstring).
      deterministic: True: the canonical pairwise tree over ranks, bitwise
        reproducible; False: ``lax.psum`` (NCCL's order).
      mesh: the mesh for the global view (default: a DistTensor's, or ``with mesh:``).
    Returns:
      The combined value: on every part (SPMD), or one replicated part-sized array.
    """
    if op not in OPS:
        raise ValueError(f"all_reduce: op={op!r} must be one of {OPS}")
    if algo not in ALGOS:
        raise ValueError(f"all_reduce: algo={algo!r} must be one of {ALGOS}")
    x, axes, m = _prepare("all_reduce", x, axis, mesh)
    check_dtype("all_reduce", "x", x, _NUMERIC)
    det = bool(deterministic)

    def local(v):
        return ts_all_reduce(_varying(v, axes), axes, op, algo, det)

    if m is None:
        return local(x)
    n = m.axis_size(axes)
    if x.ndim == 0:
        raise ValueError("all_reduce: a global x needs a dim 0 holding the parts; got a scalar")
    _check_divisible("all_reduce", x, 0, n, f"parts along {axes}")
    return _shard_map(local, m, P(_entry(axes)), P())(x)


def all_gather(
    x: Any,
    axis: str | Sequence[str],
    dim: int = 0,
    *,
    deterministic: bool = True,
    mesh: Any = None,
) -> jax.Array:
    """Concatenates the parts along ``dim``: the inverse of partitioning.

    SPMD view: every part gets the parts' values concatenated on ``dim`` (typed as
    varying; its adjoint is ``reduce_scatter``, deterministic when
    ``deterministic=True``). Global view: ``x`` itself, replicated over ``axis``.
    """
    x, axes, m = _prepare("all_gather", x, axis, mesh)
    dim = normalize_axis("all_gather", "dim", dim, max(x.ndim, 1))
    if m is None:
        return ts_all_gather(_varying(x, axes), axes, dim, bool(deterministic))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(m.jax_mesh, P()))


def reduce_scatter(
    x: Any,
    axis: str | Sequence[str],
    dim: int = 0,
    *,
    algo: str = "auto",
    deterministic: bool = True,
    mesh: Any = None,
) -> jax.Array:
    """Sums the parts, then part r keeps slice r of ``dim`` (``x.shape[dim]`` must be a
    multiple of the axis size). The sum is the canonical tree over ranks when
    ``deterministic=True``. Global view: sums the parts of ``x`` along dim 0 and
    returns the part-sized sum partitioned on ``dim``."""
    if algo not in SCATTER_ALGOS:
        raise ValueError(f"reduce_scatter: algo={algo!r} must be one of {SCATTER_ALGOS}")
    x, axes, m = _prepare("reduce_scatter", x, axis, mesh)
    check_dtype("reduce_scatter", "x", x, _NUMERIC)
    if x.ndim == 0:
        raise ValueError("reduce_scatter: x must have at least one dim")
    dim = normalize_axis("reduce_scatter", "dim", dim, x.ndim)
    n = _local_size(axes, m)
    det = bool(deterministic)

    def local(v):
        _check_divisible("reduce_scatter", v, dim, n, f"parts along {axes}")
        return ts_reduce_scatter(_varying(v, axes), axes, dim, algo, det)

    if m is None:
        return local(x)
    _check_divisible("reduce_scatter", x, 0, n, f"parts along {axes}")
    return _shard_map(local, m, P(_entry(axes)), _spec_at(dim, axes))(x)


def scatter(x: Any, axis: str | Sequence[str], dim: int = 0, *, mesh: Any = None) -> jax.Array:
    """Part r keeps slice r of ``dim`` (the inverse of ``all_gather``). Global view:
    ``x`` itself, partitioned on ``dim`` over ``axis``."""
    x, axes, m = _prepare("scatter", x, axis, mesh)
    if x.ndim == 0:
        raise ValueError("scatter: x must have at least one dim")
    dim = normalize_axis("scatter", "dim", dim, x.ndim)
    _check_divisible("scatter", x, dim, _local_size(axes, m), f"parts along {axes}")
    if m is None:
        return ts_scatter(x, axes, dim)
    sharding = jax.sharding.NamedSharding(m.jax_mesh, _spec_at(dim, axes))
    return jax.lax.with_sharding_constraint(x, sharding)


def all_to_all(
    x: Any,
    axis: str | Sequence[str],
    split_dim: int = 0,
    concat_dim: int = 0,
    *,
    mesh: Any = None,
) -> jax.Array:
    """Slice j of ``split_dim`` goes to part j; the received slices are concatenated on
    ``concat_dim`` in part order. Global view: ``x`` repartitioned from
    ``concat_dim`` to ``split_dim``."""
    x, axes, m = _prepare("all_to_all", x, axis, mesh)
    if x.ndim == 0:
        raise ValueError("all_to_all: x must have at least one dim")
    split_dim = normalize_axis("all_to_all", "split_dim", split_dim, x.ndim)
    concat_dim = normalize_axis("all_to_all", "concat_dim", concat_dim, x.ndim)
    _check_divisible("all_to_all", x, split_dim, _local_size(axes, m), f"parts along {axes}")
    if m is None:
        return ts_all_to_all(_varying(x, axes), axes, split_dim, concat_dim)
    sharding = jax.sharding.NamedSharding(m.jax_mesh, _spec_at(split_dim, axes))
    return jax.lax.with_sharding_constraint(x, sharding)
