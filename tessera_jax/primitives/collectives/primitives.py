"""The six collective primitives of the SPMD view, each declared with its whole definition.

Each collective is a primitive ``ts_<name>`` in the jaxpr (``ts_all_reduce``,
``ts_all_gather``, ``ts_reduce_scatter``, ``ts_scatter``, ``ts_all_to_all``,
``ts_replicate``) whose parameters are static: ``axes`` (a tuple of bound mesh axis
names) and the operator's options. Abstract evaluation types the result in JAX's typing
of values that vary over mesh axes (inside ``shard_map(check_vma=True)``: an all_reduce
result is the same on every part along ``axes``; scatter's and replicate's vary over
them; the others vary as their operand) and states the named-axis effects of jax's own
collectives. The lowering traces the data path (``algorithms.py``) vma-free, as every
Tessera lowering, inside shard_map's lowering where the mesh axes are bound. A value
that is the same on every part and enters a collective becomes each part's own copy
through ``replicate``.

Adjoints
--------
The linear ones (all_reduce sum/mean, all_gather, reduce_scatter, scatter, all_to_all,
replicate) have the same collective on the tangent as their JVP and explicit
transposes: all_gather <-> reduce_scatter (the deterministic tree when
``deterministic=True``), all_reduce(sum) -> ``replicate`` of the replicated cotangent
(no communication; ``pvary`` when ``deterministic=False``), mean -> the same of
``ct / n``, scatter -> all_gather (or, for a part's own ``x``, its slice put back in
zeros), all_to_all -> the reverse all_to_all, replicate -> the canonical-tree
all_reduce. ``max``/``min``: the tangent at the extremum, ties sharing it equally
(``all_reduce(hit * t) / all_reduce(hit)``). So ``jax.grad``, ``jax.jvp``/``jacfwd``,
higher orders and ``jax.vmap`` over a plain batch dim all go through; differentiating an
adjoint again stays on the tree (replicate <-> all_reduce).

Parameters are checked by the public functions (``api.py``); the abstract evaluations
check only what a direct ``bind`` could get wrong about the mesh (an unbound axis, an
operand that does not vary over the axes, a dim that does not divide).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tessera_jax import _compat
from tessera_jax.primitives.collectives.algorithms import (
    axis_size,
    tree_all_reduce,
    tree_reduce_scatter,
)

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
        # Named like an Operator's lowering, so ts.profile attributes the HLO ops.
        ctx = _compat.lowering_named(ctx, ctx.primitive.name)
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
    if deterministic:
        return tree_all_reduce(x, axes, op, algo, platform)
    if op in ("max", "min"):
        return (lax.pmax if op == "max" else lax.pmin)(x, axes)
    y = lax.psum(x, axes)
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
