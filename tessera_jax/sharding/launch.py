"""``ts.index_launch``: run a function once per partition, under ``jax.shard_map``.

``ts.index_launch(axis="tp")(fn)(A.parts("tp"), B.parts("tp"), C.parts("tp"))``
(or ``@ts.index_launch(axis="tp")``) runs ``fn`` on every device of the mesh,
each instance receiving its own blocks:

* a ``Parts`` or DistTensor argument: its local shard (the tensor's layout);
* any other array: its own copy of the whole array, and Python values as they are.

Every instance owns its arguments, as the tasks of an index launch do: inside,
they are typed as varying along the launch axis, so ``jax.grad`` inside ``fn``
gives each part its local gradient (a per-part ``local_grads``), and the
gradient of a launch with respect to a replicated argument adds the parts'
contributions on the canonical tree.

Inside, ``axis`` (and every other mesh axis) is bound, so the collectives of
``ts.op`` combine the parts. Results:

* a result identical on every part (typed invariant: after ``all_reduce``, or
  computed only from values that do not vary along the mesh axes) comes back as
  one replicated array (an ``all_gather`` result is typed varying: it comes back
  concatenated; gather in the global view for one replicated copy);
* a result that differs between parts comes back concatenated along dim 0 in
  part order (a scalar per part becomes a vector), over every mesh axis it
  varies along (mesh order);
* ``out=``: a ShardSpec / PartitionSpec (or a pytree of them matching the
  results) lays the parts out explicitly, e.g. ``out=ts.ShardSpec(("col",), ("tp",))``.

When ``fn`` has region privileges (``ts.Region[...]`` annotations), a
``Region[write]`` argument must be partitioned along the launch axis (each part
writes its own block); the contributions of all parts to a ``Region[reduce_sum]``
that is not partitioned are combined with the deterministic ``all_reduce`` (over
the launch axis and every other mesh axis they differ along); the new region
values are returned after ``fn``'s own results (see ``regions.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tessera_jax import _compat
from tessera_jax.primitives.collectives import partition_entry
from tessera_jax.sharding import regions as _regions
from tessera_jax.sharding.mesh import Mesh, as_mesh, axis_names, constrain, current_mesh
from tessera_jax.sharding.spec import ShardSpec, as_partition_spec, entry_axes, spec_axes
from tessera_jax.sharding.tensor import DistTensor, Parts


def _is_array(x: Any) -> bool:
    return (
        isinstance(x, (jax.Array, DistTensor, Parts))
        or hasattr(x, "__jax_array__")
        or (hasattr(x, "shape") and hasattr(x, "dtype"))
    )


def _order(mesh: Mesh, axes: Sequence[str]) -> tuple[str, ...]:
    return tuple(a for a in mesh.axes if a in set(axes))


def index_launch(
    fn: Callable[..., Any] | None = None,
    *,
    axis: str | Sequence[str],
    mesh: Mesh | jax.sharding.Mesh | None = None,
    out: Any = None,
) -> Any:
    """Fans ``fn`` out over the partitions of a mesh axis (module docstring).

    Arguments:
      fn: the per-part function (or use ``index_launch(axis=...)`` as a decorator).
      axis: the launch axis (a mesh axis name or tuple of names).
      mesh: default: the mesh of the first Parts/DistTensor argument, else ``with mesh:``.
      out: optional layout of the results (ShardSpec, PartitionSpec or a pytree of them).
    """
    # Arguments are checked when the launch is built, before any array is traced.
    launch_axes = axis_names("index_launch", "axis", axis)
    if mesh is not None:
        mesh = as_mesh(mesh, "index_launch")
    out_leaves = _out_leaves(out)
    if fn is None:
        return lambda f: index_launch(f, axis=axis, mesh=mesh, out=out)
    if not callable(fn):
        raise TypeError(f"index_launch: fn={fn!r} must be callable")

    @functools.wraps(fn)
    def launched(*args: Any, **kwargs: Any) -> Any:
        m = _launch_mesh(mesh, args, kwargs)
        m.check_axes("index_launch", f"axis={axis!r}", launch_axes)
        for s in out_leaves:
            m.check_axes("index_launch", f"out={s!r}", _layout_axes(s))
        privs = _regions.privileges(fn) if _regions.has_regions(fn) else {}
        bound = _regions.bind_arguments(fn, args, kwargs) if privs else None
        region_names: list[str] = []
        if privs:
            _regions.check_aliases(getattr(fn, "__name__", "fn"), privs, bound.arguments)
            _check_writers(fn, privs, bound.arguments, launch_axes)
            region_names = [
                n for n, p in privs.items() if p is not _regions.read and n in bound.arguments
            ]

        # Array leaves go through shard_map with their in_specs; other leaves are static.
        flat_args, treedef = jax.tree_util.tree_flatten(
            (args, kwargs), is_leaf=lambda x: isinstance(x, (Parts, DistTensor))
        )
        arrays, specs, where = [], [], []
        for i, a in enumerate(flat_args):
            if _is_array(a):
                arr, spec = _place(a, m)
                arrays.append(arr)
                specs.append(spec)
                where.append(i)

        # A whole region reduced into keeps its type: its new value is old + the
        # combined contributions, the same on every part.
        keep = {
            id(bound.arguments[n])
            for n in region_names
            if privs[n] is _regions.reduce_sum and not isinstance(bound.arguments[n], Parts)
        }

        def body(*locals_: Any) -> Any:
            from tessera_jax.primitives.collectives import replicate

            vals = list(flat_args)
            for i, v in zip(where, locals_):
                # each part's own copy of its arguments (its block of partitioned ones)
                vals[i] = v if id(flat_args[i]) in keep else replicate(v, launch_axes)
            pos, kw = jax.tree_util.tree_unflatten(treedef, vals)
            # The launch's mesh is the current one inside: a collective over an axis it
            # does not have is reported against this mesh.
            with m:
                if not privs:
                    return fn(*pos, **kw)
                b = _regions.bind_arguments(fn, pos, kw)
                res, proxies = _regions.run_body(fn, privs, b)
            new = []
            for name, priv, proxy in proxies:
                if priv is _regions.write:
                    new.append(proxy.result())
                    continue
                old, contrib = _regions.base(b.arguments[name]), proxy.contribution()
                if contrib is not None and not isinstance(bound.arguments[name], Parts):
                    # Every part adds into the whole region: the contributions of all parts
                    # (along the launch axes and any other axis they differ along) are
                    # combined on the canonical tree.
                    from tessera_jax.primitives.collectives import all_reduce

                    vary = set(launch_axes) | _compat.varying_axes(contrib)
                    contrib = all_reduce(contrib, "sum", _order(m, vary))
                new.append(old if contrib is None else old + contrib)
            return res, tuple(new)

        tree, info = _result_types(body, m, arrays, specs)
        k = len(info) - len(region_names)
        leaf_specs, scalar = _result_specs(m, info[:k], out)
        for name in region_names:
            arg = bound.arguments[name]
            t = arg.tensor if isinstance(arg, Parts) else arg
            leaf_specs.append(t.partition_spec if isinstance(t, DistTensor) else P())
            scalar.append(False)

        def adapted(*xs: Any) -> Any:
            leaves = jax.tree_util.tree_leaves(body(*xs))
            leaves = [jnp.expand_dims(v, 0) if s else v for v, s in zip(leaves, scalar)]
            return jax.tree_util.tree_unflatten(tree, leaves)

        res = _compat.shard_map(
            adapted,
            mesh=m.jax_mesh,
            in_specs=tuple(specs),
            out_specs=jax.tree_util.tree_unflatten(tree, leaf_specs),
            check_vma=True,
        )(*arrays)
        if not privs:
            return res
        out_val, new_regions = res
        wrapped = []
        for name, new in zip(region_names, new_regions):
            arg = bound.arguments[name]
            t = arg.tensor if isinstance(arg, Parts) else arg
            wrapped.append(t.with_array(new) if isinstance(t, DistTensor) else new)
        return _regions.package(out_val, wrapped)

    return launched


def _out_leaves(out: Any) -> list[Any]:
    """The layouts in ``out`` (a TypeError for anything else)."""
    leaves = jax.tree_util.tree_leaves(
        out, is_leaf=lambda s: isinstance(s, (ShardSpec, P, NamedSharding))
    )
    for s in leaves:
        if not isinstance(s, (ShardSpec, P, NamedSharding)):
            raise TypeError(
                f"index_launch: out={out!r} must be a ts.ShardSpec, a PartitionSpec, a "
                f"NamedSharding or a pytree of them; it holds {s!r}"
            )
    return leaves


def _layout_axes(s: ShardSpec | P | NamedSharding) -> tuple[str, ...]:
    if isinstance(s, ShardSpec):
        return tuple(a for e in s.mesh_axes for a in entry_axes(e))
    return spec_axes(s.spec if isinstance(s, NamedSharding) else s)


def _launch_mesh(mesh: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Mesh:
    if mesh is not None:
        return as_mesh(mesh)
    found = None
    for a in [*args, *kwargs.values()]:
        t = a.tensor if isinstance(a, Parts) else a
        if isinstance(t, DistTensor):
            if found is not None and t.mesh != found:
                raise ValueError("index_launch: the arguments live on different meshes")
            found = found or t.mesh
    found = found or current_mesh()
    if found is None:
        raise ValueError(
            "index_launch: no mesh; pass mesh=..., Parts/DistTensor arguments, or use `with mesh:`"
        )
    return found


def _place(a: Any, m: Mesh) -> tuple[Any, P]:
    """An argument's array and its in_spec."""
    t = a.tensor if isinstance(a, Parts) else a
    if isinstance(t, DistTensor):
        if t.mesh != m:
            raise ValueError("index_launch: a DistTensor argument lives on another mesh")
        arr, spec = t.array, t.partition_spec
    else:
        arr = (
            a.__jax_array__() if hasattr(a, "__jax_array__") and not isinstance(a, jax.Array) else a
        )
        arr, spec = jnp.asarray(arr), P()
    if m.explicit:
        # On Explicit axes shard_map takes an input only in the layout its in_spec names
        # (a sharding is part of the type); Auto axes reshard by themselves.
        arr = constrain(arr, NamedSharding(m.jax_mesh, spec))
    return arr, spec


def _check_writers(fn, privs, arguments, launch_axes) -> None:
    for name, priv in privs.items():
        if priv is not _regions.write or name not in arguments:
            continue
        arg = arguments[name]
        if not (isinstance(arg, Parts) and set(entry_axes(arg.axis)) == set(launch_axes)):
            raise _regions.RegionError(
                f"{getattr(fn, '__name__', 'fn')}: region {name!r} is Region[write] but is not "
                f"partitioned along the launch axis {launch_axes}: every part would write all "
                f"of it (two writers of the same region); pass {name}.parts(...) or declare "
                "it Region[reduce_sum]"
            )


def _result_types(body, m: Mesh, arrays, specs):
    """The results' treedef and, per leaf, (the mesh axes it varies over, its rank):
    one abstract trace of ``body`` under ``shard_map``."""
    record: list[Any] = []

    def probe(*xs):
        leaves, tree = jax.tree_util.tree_flatten(body(*xs))
        for v in leaves:
            if not _is_array(v) and not isinstance(v, (int, float, complex, np.generic)):
                raise TypeError(
                    f"index_launch: the launched function returned {v!r:.60} (a "
                    f"{type(v).__name__}); its results must be arrays or numbers"
                )
        record.append((tree, [(_compat.varying_axes(v), jnp.ndim(v)) for v in leaves]))
        return [jnp.expand_dims(v, 0) for v in leaves]

    jm = m.jax_mesh
    shapes = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(jm, s))
        for a, s in zip(arrays, specs)
    ]
    spec = P(partition_entry(tuple(m.axes)))
    jax.eval_shape(
        _compat.shard_map(probe, mesh=jm, in_specs=tuple(specs), out_specs=spec, check_vma=True),
        *shapes,
    )
    return record[-1]


def _result_specs(m: Mesh, info, out: Any) -> tuple[list[P], list[bool]]:
    """Per result leaf: its out_spec, and whether it is a per-part scalar to stack."""
    if out is not None:
        user = jax.tree_util.tree_leaves(
            out, is_leaf=lambda s: isinstance(s, (ShardSpec, P, NamedSharding))
        )
        if len(user) == 1 and len(info) != 1:
            user = user * len(info)
        if len(user) != len(info):
            raise ValueError(
                f"index_launch: out= gives {len(user)} layouts for {len(info)} results"
            )
        return [as_partition_spec(s, nd) for s, (_, nd) in zip(user, info)], [False] * len(info)
    specs, scalar = [], []
    for vma, nd in info:
        specs.append(P(partition_entry(_order(m, vma))) if vma else P())
        scalar.append(bool(vma) and nd == 0)
    return specs, scalar
