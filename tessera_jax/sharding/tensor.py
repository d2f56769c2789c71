"""``ts.dist.tensor``: a DistTensor, a ``jax.Array`` laid out on a mesh by a ShardSpec.

A DistTensor is a pytree with one leaf (the array) and static metadata (layout,
mesh): ``jax.jit``, ``jax.grad`` and ``jax.tree_util`` see through it, and the
gradient with respect to a DistTensor is a DistTensor. It passes to any
``jax.numpy`` function or ``ts.op`` through ``__jax_array__`` and supports the
arithmetic operators (which return plain ``jax.Array`` values; XLA propagates
their sharding).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from tessera_jax.numerics.dtypes import as_np_dtype
from tessera_jax.sharding.mesh import (
    Mesh,
    as_mesh,
    axis_names,
    constrain,
    is_int,
    positive_shape,
    resolve_mesh,
)
from tessera_jax.sharding.spec import ShardSpec, entry_axes


@jax.tree_util.register_pytree_node_class
class DistTensor:
    """A distributed tensor: ``.array`` (a jax.Array), ``.layout`` (ShardSpec), ``.mesh``."""

    __slots__ = ("array", "layout", "mesh")
    __array_priority__ = 100

    def __init__(self, array: Any, layout: ShardSpec, mesh: Mesh):
        # No validation here: jax transformations rebuild DistTensors around tracers
        # and placeholder leaves through tree_unflatten.
        self.array = array
        self.layout = layout
        self.mesh = mesh

    def tree_flatten(self):
        return (self.array,), (self.layout, self.mesh)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    # --- array protocol ------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def ndim(self) -> int:
        return len(self.array.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def partition_spec(self) -> jax.sharding.PartitionSpec:
        return self.layout.partition_spec(self.ndim)

    @property
    def sharding(self) -> NamedSharding:
        """The layout's NamedSharding (the array's own sharding once it is concrete)."""
        s = getattr(self.array, "sharding", None)
        if isinstance(s, NamedSharding) and not isinstance(self.array, jax.core.Tracer):
            return s
        return NamedSharding(self.mesh.jax_mesh, self.partition_spec)

    @property
    def addressable_shards(self) -> list[Any]:
        return self.array.addressable_shards

    def __jax_array__(self) -> jax.Array:
        return self.array

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = np.asarray(self.array)
        return a if dtype is None else a.astype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return (
            f"DistTensor(shape={self.shape}, dtype={self.dtype}, layout={self.layout!r}, "
            f"mesh={self.mesh!r})"
        )

    # --- partitions -------------------------------------------------------------------------

    def parts(self, axis: str | Sequence[str]) -> Parts:
        """The partitions of this tensor along mesh ``axis`` (for ``ts.index_launch``)."""
        return Parts(self, axis)

    def with_array(self, array: Any) -> DistTensor:
        """A DistTensor of the same layout and mesh around ``array`` (of this shape)."""
        if tuple(getattr(array, "shape", ())) != self.shape:
            raise ValueError(
                f"DistTensor.with_array: array of shape {getattr(array, 'shape', None)} must "
                f"have this tensor's shape {self.shape}"
            )
        return DistTensor(array, self.layout, self.mesh)

    @property
    def T(self) -> jax.Array:
        return self.array.T

    def astype(self, dtype: Any) -> jax.Array:
        return self.array.astype(_dtype("DistTensor.astype", dtype))

    def __getitem__(self, idx: Any) -> jax.Array:
        return self.array[idx]


def _binary(op: Callable[[Any, Any], Any], reflected: bool) -> Callable[..., Any]:
    def method(self: DistTensor, other: Any) -> Any:
        other = other.array if isinstance(other, DistTensor) else other
        return op(other, self.array) if reflected else op(self.array, other)

    return method


# The binary arithmetic operators an array-like wrapper forwards (and their reflections).
ARITHMETIC = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "matmul": operator.matmul,
    "pow": operator.pow,
    "mod": operator.mod,
}


def add_arithmetic(cls: type, method: Callable[[Any, bool], Callable[..., Any]]) -> None:
    """Sets ``cls.__add__``, ``cls.__radd__``, … from ``method(op, reflected)``."""
    for name, op in ARITHMETIC.items():
        setattr(cls, f"__{name}__", method(op, False))
        setattr(cls, f"__r{name}__", method(op, True))


add_arithmetic(DistTensor, _binary)
for _name, _op in {
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}.items():
    setattr(DistTensor, f"__{_name}__", _binary(_op, False))
DistTensor.__neg__ = lambda self: -self.array
DistTensor.__pos__ = lambda self: self.array
DistTensor.__abs__ = lambda self: abs(self.array)


@jax.tree_util.register_pytree_node_class
class Parts:
    """``A.parts("tp")``: the disjoint partitions of a DistTensor along a mesh axis
    (a pytree around the DistTensor).

    Passed to ``ts.index_launch(axis="tp")(fn)``, each launch instance receives its
    own block (the tensor's local shard). ``len(parts)`` is the axis size and
    ``parts[i]`` is the i-th block as a global slice.
    """

    def __init__(self, tensor: DistTensor, axis: str | Sequence[str]):
        if not isinstance(tensor, DistTensor):
            raise TypeError(f"parts: tensor={tensor!r:.60} must be a ts.dist.tensor")
        axes = axis_names("parts", "axis", axis)
        tensor.mesh.check_axes("parts", f"axis={axis!r}", axes)
        dims = [
            d
            for d, e in zip(tensor.layout.dims(tensor.ndim), tensor.layout.mesh_axes)
            if set(axes) & set(entry_axes(e))
        ]
        if not dims:
            raise ValueError(
                f"parts: mesh axis {axis!r} does not partition this tensor; its layout is "
                f"{tensor.layout!r}"
            )
        self.tensor = tensor
        self.axis = axes[0] if len(axes) == 1 else axes
        self.dim = dims[0]

    def tree_flatten(self):
        return (self.tensor,), (self.axis, self.dim)

    @classmethod
    def tree_unflatten(cls, aux, children):
        self = object.__new__(cls)
        (self.tensor,), (self.axis, self.dim) = children, aux
        return self

    def __len__(self) -> int:
        return self.tensor.mesh.axis_size(self.axis)

    def __getitem__(self, i: int) -> jax.Array:
        n = len(self)
        if not is_int(i):
            raise TypeError(f"parts[i]: i={i!r} must be an int in [-{n}, {n})")
        if not -n <= i < n:
            raise ValueError(f"parts[i]: i={i} must be an int in [-{n}, {n}) ({n} parts)")
        i = int(i) % n
        if entry_axes(self.tensor.partition_spec[self.dim]) != (self.axis,):
            raise NotImplementedError(
                f"parts[i]: dim {self.dim} is split over several mesh axes "
                f"{self.tensor.partition_spec[self.dim]}; take parts along all of them "
                "through ts.index_launch"
            )
        block = self.tensor.shape[self.dim] // n
        return jax.lax.slice_in_dim(self.tensor.array, i * block, (i + 1) * block, axis=self.dim)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"Parts({self.tensor!r}, axis={self.axis!r})"


def _place(value: Any, sharding: NamedSharding, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        if tuple(value.shape) != shape:
            raise ValueError(
                f"dist.tensor: init has shape {tuple(value.shape)}, expected shape={shape}"
            )
        if isinstance(value, jax.core.Tracer):
            return constrain(value.astype(dtype), sharding)
        return jax.device_put(value.astype(dtype), sharding)
    try:
        host = np.asarray(value).astype(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"dist.tensor: init={_short(value)} must be an array of numbers of shape {shape}, "
            f"a callable init(key, shape, dtype) or None"
        ) from e
    if host.shape != shape:
        raise ValueError(f"dist.tensor: init has shape {host.shape}, expected shape={shape}")
    # Shard by shard: each device receives only its block of the host data.
    return jax.make_array_from_callback(shape, sharding, lambda idx: host[idx])


def _dtype(op: str, dtype: Any) -> np.dtype:
    try:
        return as_np_dtype(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{op}: dtype={dtype!r}: {e}") from None


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 60 else f"{r[:57]}..."


def _check_key(key: Any) -> jax.Array:
    """A PRNG key: a typed key (``jax.random.key``) or a raw ``uint32[2]`` one."""
    if isinstance(key, (jax.Array, jax.core.Tracer)):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return key
        if key.dtype == jnp.uint32 and key.shape == (2,):
            return key
    raise TypeError(
        f"dist.tensor: key={_short(key)} must be a PRNG key (jax.random.key(seed)) or None"
    )


def tensor(
    shape: Sequence[int],
    layout: ShardSpec | None = None,
    mesh: Mesh | jax.sharding.Mesh | None = None,
    dtype: Any = "f32",
    init: Any = None,
    *,
    key: jax.Array | None = None,
) -> DistTensor:
    """A DistTensor of ``shape`` laid out on ``mesh`` by ``layout``.

    Arguments:
      shape: the global shape: positive ints (an int for one dim).
      layout: a ``ts.ShardSpec`` (None: replicated).
      mesh: a ``ts.dist.Mesh`` (default: the current ``with mesh:``).
      dtype: a ts dtype, a policy, a numpy/jnp dtype or a name (``"bf16"``, ``"fp8_e4m3"``).
      init: None (zeros), an array (host data placed shard by shard, or a jax array),
        or a callable ``init(key, shape, dtype)`` evaluated sharded.
      key: the PRNG key passed to a callable ``init`` (default ``jax.random.key(0)``).
    Returns:
      A DistTensor whose array has ``NamedSharding(mesh, layout)``.
    """
    shape = positive_shape("dist.tensor", "shape", shape)
    layout = ShardSpec() if layout is None else layout
    if not isinstance(layout, ShardSpec):
        raise TypeError(f"dist.tensor: layout={layout!r} must be a ts.ShardSpec or None")
    m = resolve_mesh("dist.tensor", mesh)
    sharding = layout.named_sharding(m, len(shape), "dist.tensor")
    layout.check_shape(shape, m, "dist.tensor")
    if dtype is None:
        # np.dtype(None) would quietly mean float64.
        raise TypeError("dist.tensor: dtype=None must be a dtype such as 'f32' or jnp.bfloat16")
    dt = _dtype("dist.tensor", dtype)
    init_fn = callable(init) and not hasattr(init, "shape")
    if key is not None:
        if not init_fn:
            raise ValueError(
                f"dist.tensor: key= is only used by a callable init(key, shape, dtype); "
                f"init is {type(init).__name__}"
            )
        key = _check_key(key)
    if init is None:
        array = jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sharding)()
    elif init_fn:
        k = jax.random.key(0) if key is None else key
        out = jax.eval_shape(lambda k: init(k, shape, dt), k)
        if tuple(out.shape) != shape:
            raise ValueError(
                f"dist.tensor: init returned shape {tuple(out.shape)}, expected {shape}"
            )
        array = jax.jit(lambda k: init(k, shape, dt).astype(dt), out_shardings=sharding)(k)
    else:
        array = _place(init, sharding, dt, shape)
    return DistTensor(array, layout, m)


def unwrap(x: Any) -> Any:
    """The array inside a DistTensor; anything else unchanged."""
    return x.array if isinstance(x, DistTensor) else x


def as_dist(x: Any, mesh: Any = None) -> DistTensor:
    """A DistTensor for ``x``: itself, or a concrete NamedSharding'd array wrapped."""
    if isinstance(x, DistTensor):
        return x
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding) and not isinstance(x, jax.core.Tracer):
        return DistTensor(x, ShardSpec.from_partition_spec(s.spec), as_mesh(s.mesh))
    raise TypeError(f"{type(x).__name__} is not a DistTensor or an array with a NamedSharding")
