"""The public collectives: argument checks, the SPMD view and the global view.

Every function checks its arguments once, here, before anything is traced: a bad one
raises a ValueError or TypeError naming the function, the argument, the value and what
is allowed. The primitives (``primitives.py``) and the data path (``algorithms.py``)
then trust them.

A call is in the *SPMD view* when every axis it names is bound (inside
``ts.index_launch`` or ``jax.shard_map``); otherwise it is in the *global view* on a
mesh (``mesh=``, a DistTensor's, or ``with mesh:``), where it runs the same collective
under ``shard_map`` on the parts of ``x``. The parts of a DistTensor are its blocks as
its layout lays them out (a mesh axis its layout does not use holds a whole copy on
every part); the parts of a plain array are the slices of its dim 0. Meshes with
Explicit axes (``jax.make_mesh``'s default from jax 0.10) are placed with
``device_put``, meshes with Auto axes with ``with_sharding_constraint``.

Only ``all_reduce`` has a kernel (``dispatch.py``), and it cannot be interpreted: under
``TESSERA_KERNELS=interpret`` every collective runs its XLA data path, as under ``xla``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tessera_jax import _compat
from tessera_jax.primitives._core import as_array, normalize_axis
from tessera_jax.primitives.collectives.algorithms import axis_size
from tessera_jax.primitives.collectives.primitives import (
    replicate,
    ts_all_gather,
    ts_all_reduce,
    ts_all_to_all,
    ts_reduce_scatter,
    ts_scatter,
)

OPS = ("sum", "mean", "max", "min")
# The algorithms a caller may ask for (algorithms.py describes them).
ALGOS = ("auto", "binary_tree", "ring", "gather", "nvlink")
SCATTER_ALGOS = ("auto", "binary_tree", "ring")


def partition_entry(axes: Sequence[str]) -> Any:
    """Mesh ``axes`` as one PartitionSpec entry: None, a name, or a tuple of names."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


# --- argument checks -----------------------------------------------------------------------


def _check_choice(fn: str, arg: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{fn}: {arg}={value!r} must be one of {allowed}")


def _check_deterministic(fn: str, deterministic: Any, algo: str | None) -> bool:
    """``deterministic`` as a bool; ``algo`` chooses among the deterministic paths, so a
    non-default one with ``deterministic=False`` (lax's own order) is an error."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"{fn}: deterministic={deterministic!r} must be True or False")
    if not deterministic and algo not in (None, "auto"):
        raise ValueError(
            f"{fn}: algo={algo!r} chooses how the deterministic tree moves data; with "
            "deterministic=False the reduction is lax's own, so leave algo='auto'"
        )
    return bool(deterministic)


def _check_dtype(fn: str, x: jax.Array, op: str | None) -> None:
    """Reductions take numbers: sums any, ``mean`` inexact ones, ``max``/``min`` ordered
    ones (not complex)."""
    dt = jnp.dtype(x.dtype)
    if op == "mean":
        ok, allowed = jnp.issubdtype(dt, jnp.inexact), "a floating or complex dtype"
    elif op in ("max", "min"):
        ok = jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.floating)
        allowed = "an integer or floating dtype"
    else:
        ok, allowed = jnp.issubdtype(dt, jnp.number), "a numeric (not bool) dtype"
    if not ok:
        with_op = f" with op={op!r}" if op is not None else ""
        raise TypeError(f"{fn}: x.dtype={dt} is not supported{with_op}; it needs {allowed}")


def _as_array(fn: str, x: Any) -> jax.Array:
    if isinstance(x, jax.Array) or hasattr(x, "__jax_array__"):
        return as_array(fn, "x", x)
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: x={x!r} is not an array (nor convertible to one)") from None


def _axis_names(fn: str, axis: Any) -> tuple[str, ...]:
    """``axis`` (None, a name, or a non-empty sequence of distinct names) as a tuple."""
    if axis is None:
        return ()
    if isinstance(axis, str):
        return (axis,)
    if isinstance(axis, (tuple, list)) and axis and all(isinstance(a, str) for a in axis):
        if len(set(axis)) != len(axis):
            raise ValueError(f"{fn}: axis={axis!r} names a mesh axis twice")
        return tuple(axis)
    raise TypeError(f"{fn}: axis={axis!r} must be a mesh axis name or a tuple of names")


def _prepare(fn: str, x: Any, axis: Any, mesh: Any, required: bool = False):
    """``(x as an array, axes, mesh or None, DistTensor or None)``; mesh None means the
    SPMD view. ``required``: ``axis`` must be given (the data-movement collectives)."""
    # Import cycle: sharding imports the collectives (rules.py, launch.py).
    from tessera_jax.sharding.mesh import Mesh, resolve_mesh
    from tessera_jax.sharding.tensor import DistTensor

    if mesh is not None and not isinstance(mesh, (Mesh, jax.sharding.Mesh)):
        raise TypeError(f"{fn}: mesh={mesh!r} must be a ts.dist.Mesh or a jax.sharding.Mesh")
    dist = x if isinstance(x, DistTensor) else None
    x = _as_array(fn, x.array if dist is not None else x)
    names = _axis_names(fn, axis)
    if required and not names:
        raise TypeError(f"{fn}: axis={axis!r} must be a mesh axis name or a tuple of names")
    bound = tuple(a for a in names if _compat.axis_is_bound(a))
    if bound:
        if len(bound) != len(names):
            free = tuple(a for a in names if a not in bound)
            raise ValueError(
                f"{fn}: axis={axis!r} mixes bound mesh axes {bound} with {free}, which are "
                "not bound here (inside ts.index_launch / jax.shard_map every axis of a "
                "collective must be bound)"
            )
        if mesh is not None or dist is not None:
            raise ValueError(
                f"{fn}: mesh={mesh!r} and a DistTensor x are for the global view; inside "
                f"an SPMD region axis={axis!r} is bound and x is this part's value"
            )
        return x, names, None, None
    m = resolve_mesh(fn, mesh, dist)
    if dist is not None and dist.mesh != m:
        raise ValueError(f"{fn}: mesh={m!r} is not the mesh {dist.mesh!r} of the DistTensor x")
    axes = names or tuple(m.axes)
    for a in axes:
        if a not in m.axes:
            raise ValueError(f"{fn}: axis={a!r} is not an axis of the mesh {m.axes}")
    return x, axes, m, dist


def _dim(fn: str, arg: str, dim: Any, x: jax.Array) -> int:
    if x.ndim == 0:
        raise ValueError(f"{fn}: x must have at least one dim; got a scalar")
    return normalize_axis(fn, arg, dim, x.ndim)


def _check_divisible(fn: str, what: str, size: int, n: int, axes: tuple[str, ...]) -> None:
    if size % n:
        raise ValueError(f"{fn}: {what}={size} must be a multiple of the {n} parts along {axes}")


# --- the global view -----------------------------------------------------------------------


def _entries(spec: P, ndim: int) -> list[tuple[str, ...]]:
    """A PartitionSpec as the mesh axes of each of ``ndim`` dims."""
    out = []
    for e in (*spec, *([None] * (ndim - len(spec)))):
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    return out


def _spec(entries: list[tuple[str, ...]]) -> P:
    """Per-dim mesh axes as a PartitionSpec, without trailing replicated dims."""
    out = [partition_entry(e) for e in entries]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _parts_layout(dist: Any, axes: tuple[str, ...], ndim: int) -> list[tuple[str, ...]]:
    """The layout whose blocks are the parts: a DistTensor's own, else dim 0 over
    ``axes``."""
    if dist is not None:
        return _entries(dist.partition_spec, ndim)
    return [axes] + [()] * (ndim - 1)


def _part_shape(x: jax.Array, layout: list[tuple[str, ...]], mesh: Any) -> list[int]:
    return [s // mesh.axis_size(e) if e else s for s, e in zip(x.shape, layout)]


def _explicit(mesh: Any) -> bool:
    explicit = jax.sharding.AxisType.Explicit
    return any(t == explicit for t in getattr(mesh.jax_mesh, "axis_types", ()))


def _place(x: jax.Array, mesh: Any, spec: P) -> jax.Array:
    """``x`` laid out as ``spec`` on ``mesh`` (module docstring: Explicit vs Auto axes)."""
    sharding = NamedSharding(mesh.jax_mesh, spec)
    if _explicit(mesh):
        return jax.device_put(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _on_parts(fn, mesh: Any, x: jax.Array, in_spec: P, out_spec: P) -> jax.Array:
    """``fn`` on every part of ``x`` (laid out as ``in_spec``), under shard_map."""
    if _explicit(mesh):  # shard_map on Explicit axes wants x placed as in_spec says
        x = _place(x, mesh, in_spec)
    return _compat.shard_map(
        fn, mesh=mesh.jax_mesh, in_specs=(in_spec,), out_specs=out_spec, check_vma=True
    )(x)


# --- public functions ------------------------------------------------------------------------


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
      x: inside an SPMD region, this part's value. Outside, a DistTensor (its parts are
        its blocks as its layout lays them out) or a global array whose dim 0 holds the
        parts (``x.shape[0]`` is a multiple of the axis size).
      op: ``"sum"``, ``"mean"`` (floating x), ``"max"`` or ``"min"``.
      axis: a mesh axis name or tuple of names (default: every axis of the mesh).
      algo: ``"auto"``, ``"binary_tree"``, ``"ring"``, ``"gather"`` or ``"nvlink"``: how
        the deterministic tree moves data, never the bits (``algorithms.py``); only
        ``"auto"`` with ``deterministic=False``.
      deterministic: True: the canonical pairwise tree over ranks, bitwise
        reproducible; False: ``lax.psum`` (NCCL's order).
      mesh: the mesh for the global view (default: a DistTensor's, or ``with mesh:``).

    Returns:
      SPMD view: the combined value on every part. Global view: the parts combined,
      replicated over ``axis`` and laid out as ``x`` over the other axes (a plain
      array's result is one part-sized, replicated array).
    """
    _check_choice("all_reduce", "op", op, OPS)
    _check_choice("all_reduce", "algo", algo, ALGOS)
    det = _check_deterministic("all_reduce", deterministic, algo)
    x, axes, m, dist = _prepare("all_reduce", x, axis, mesh)
    _check_dtype("all_reduce", x, op)

    def local(v):
        return ts_all_reduce(replicate(v, axes), axes, op, algo, det)

    if m is None:
        return local(x)
    if dist is None:
        if x.ndim == 0:
            raise ValueError("all_reduce: a global x needs a dim 0 holding the parts; got a scalar")
        _check_divisible("all_reduce", "x.shape[0]", x.shape[0], m.axis_size(axes), axes)
    layout = _parts_layout(dist, axes, x.ndim)
    out = [tuple(a for a in e if a not in axes) for e in layout]
    return _on_parts(local, m, x, _spec(layout), _spec(out))


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
    varying; its adjoint is ``reduce_scatter``, on the canonical tree when
    ``deterministic=True``). Global view: ``x`` itself, replicated over ``axis``.
    """
    det = _check_deterministic("all_gather", deterministic, None)
    x, axes, m, _ = _prepare("all_gather", x, axis, mesh, required=True)
    dim = _dim("all_gather", "dim", dim, x)
    if m is None:
        return ts_all_gather(replicate(x, axes), axes, dim, det)
    return _place(x, m, P())


def reduce_scatter(
    x: Any,
    axis: str | Sequence[str],
    dim: int = 0,
    *,
    algo: str = "auto",
    deterministic: bool = True,
    mesh: Any = None,
) -> jax.Array:
    """Sums the parts, then part r keeps slice r of ``dim`` (the part's ``shape[dim]``
    must be a multiple of the axis size). The sum is the canonical tree over ranks when
    ``deterministic=True``; ``algo`` (``"auto"``, ``"binary_tree"``, ``"ring"``) says how
    it moves data. Global view: sums the parts of ``x`` (a DistTensor's blocks, else the
    slices of dim 0) and returns the part-sized sum partitioned on ``dim`` over
    ``axis``."""
    _check_choice("reduce_scatter", "algo", algo, SCATTER_ALGOS)
    det = _check_deterministic("reduce_scatter", deterministic, algo)
    x, axes, m, dist = _prepare("reduce_scatter", x, axis, mesh, required=True)
    _check_dtype("reduce_scatter", x, None)
    dim = _dim("reduce_scatter", "dim", dim, x)

    def local(v):
        return ts_reduce_scatter(replicate(v, axes), axes, dim, algo, det)

    if m is None:
        _check_divisible("reduce_scatter", f"x.shape[{dim}]", x.shape[dim], axis_size(axes), axes)
        return local(x)
    n = m.axis_size(axes)
    if dist is None:
        _check_divisible("reduce_scatter", "x.shape[0]", x.shape[0], n, axes)
    layout = _parts_layout(dist, axes, x.ndim)
    part = _part_shape(x, layout, m)
    _check_divisible("reduce_scatter", f"the part's shape[{dim}]", part[dim], n, axes)
    out = [tuple(a for a in e if a not in axes) for e in layout]
    out[dim] = (*out[dim], *axes)
    return _on_parts(local, m, x, _spec(layout), _spec(out))


def scatter(x: Any, axis: str | Sequence[str], dim: int = 0, *, mesh: Any = None) -> jax.Array:
    """Part r keeps slice r of ``dim`` (the inverse of ``all_gather``). Global view:
    ``x`` itself, partitioned on ``dim`` over ``axis``."""
    x, axes, m, _ = _prepare("scatter", x, axis, mesh, required=True)
    dim = _dim("scatter", "dim", dim, x)
    n = axis_size(axes) if m is None else m.axis_size(axes)
    _check_divisible("scatter", f"x.shape[{dim}]", x.shape[dim], n, axes)
    if m is None:
        return ts_scatter(x, axes, dim)
    return _place(x, m, P(*([None] * dim), partition_entry(axes)))


def all_to_all(
    x: Any,
    axis: str | Sequence[str],
    split_dim: int = 0,
    concat_dim: int = 0,
    *,
    mesh: Any = None,
) -> jax.Array:
    """Slice j of ``split_dim`` goes to part j; the received slices are concatenated on
    ``concat_dim`` in part order. Global view: ``x`` repartitioned from ``concat_dim``
    to ``split_dim``."""
    x, axes, m, _ = _prepare("all_to_all", x, axis, mesh, required=True)
    split_dim = _dim("all_to_all", "split_dim", split_dim, x)
    concat_dim = _dim("all_to_all", "concat_dim", concat_dim, x)
    n = axis_size(axes) if m is None else m.axis_size(axes)
    _check_divisible("all_to_all", f"x.shape[{split_dim}]", x.shape[split_dim], n, axes)
    if m is None:
        return ts_all_to_all(replicate(x, axes), axes, split_dim, concat_dim)
    return _place(x, m, P(*([None] * split_dim), partition_entry(axes)))
