"""``ts.ShardSpec``: which tensor dims are partitioned over which mesh axes.

``ShardSpec(partition=("row", "col"), mesh_axes=("tp", "pp"))`` partitions dim 0
over ``tp`` and dim 1 over ``pp``. Dim names: ``"row"`` and ``"batch"`` are dim 0,
``"col"`` is dim 1, an int is that dim (negative ints count from the end). A
mesh-axes entry may be a tuple of axis names (the dim is split over their
product, major to minor) or None. Unnamed dims are replicated. A ShardSpec
converts to ``jax.sharding.PartitionSpec`` / ``NamedSharding`` for a given rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from tessera_jax.sharding.mesh import as_mesh, is_int

_DIM_NAMES = {"row": 0, "batch": 0, "col": 1}

Entry = str | tuple[str, ...] | None


def _entry(e: Any, op: str = "ShardSpec") -> Entry:
    if e is None or isinstance(e, str):
        return e
    if isinstance(e, (tuple, list)) and e and all(isinstance(a, str) for a in e):
        return tuple(e) if len(e) != 1 else e[0]
    raise TypeError(
        f"{op}: mesh_axes entry {e!r} must be a mesh-axis name, a non-empty tuple of names or None"
    )


def entries(op: str, mesh_axes: Any) -> tuple[Entry, ...]:
    """``mesh_axes`` (one entry, or a sequence of them) as a tuple of entries."""
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    if not isinstance(mesh_axes, (tuple, list)):
        raise TypeError(
            f"{op}: mesh_axes={mesh_axes!r} must be a sequence of mesh-axis names, tuples of "
            "names or None"
        )
    return tuple(_entry(a, op) for a in mesh_axes)


def entry_axes(e: Entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of axis names."""
    if e is None:
        return ()
    return (e,) if isinstance(e, str) else tuple(e)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a tensor is laid out on a mesh.

    Attributes:
      partition: the partitioned dims: ``"row"``/``"batch"`` (0), ``"col"`` (1) or ints.
      mesh_axes: one mesh axis (or tuple of axes, or None) per partitioned dim.
    """

    partition: tuple[str | int, ...] = ()
    mesh_axes: tuple[Entry, ...] = ()

    def __post_init__(self):
        part = self.partition
        if isinstance(part, str) or is_int(part):
            part = (part,)
        if not isinstance(part, (tuple, list)):
            raise TypeError(
                f"ShardSpec: partition={part!r} must be a sequence of dims ('row', 'col', "
                "'batch' or ints)"
            )
        part = tuple(int(p) if is_int(p) else p for p in part)
        axes = entries("ShardSpec", self.mesh_axes)
        for p in part:
            if isinstance(p, str) and p not in _DIM_NAMES:
                raise ValueError(
                    f"ShardSpec: partition entry {p!r} must be 'row', 'col', 'batch' or an int"
                )
            if not isinstance(p, str) and not is_int(p):
                raise TypeError(
                    f"ShardSpec: partition entry {p!r} must be 'row', 'col', 'batch' or an int"
                )
        if len(part) != len(axes):
            raise ValueError(
                f"ShardSpec: partition={part} and mesh_axes={axes} must have the same length"
            )
        used = [a for e in axes for a in entry_axes(e)]
        if len(set(used)) != len(used):
            raise ValueError(f"ShardSpec: mesh_axes={axes} uses a mesh axis twice")
        object.__setattr__(self, "partition", part)
        object.__setattr__(self, "mesh_axes", axes)

    @classmethod
    def from_partition_spec(cls, spec: PartitionSpec) -> ShardSpec:
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"ShardSpec.from_partition_spec: spec={spec!r} must be a jax PartitionSpec"
            )
        dims = tuple(i for i, e in enumerate(spec) if e is not None)
        return cls(partition=dims, mesh_axes=tuple(spec[i] for i in dims))

    def dims(self, ndim: int) -> tuple[int, ...]:
        """The partitioned dims as non-negative ints for a tensor of rank ``ndim``."""
        out = []
        for p in self.partition:
            d = _DIM_NAMES.get(p, p) if isinstance(p, str) else p
            if not -ndim <= d < ndim:
                raise ValueError(f"ShardSpec: dim {p!r} does not exist in a tensor of rank {ndim}")
            out.append(d % ndim)
        if len(set(out)) != len(out):
            raise ValueError(f"ShardSpec: partition={self.partition} names a dim twice")
        return tuple(out)

    def partition_spec(self, ndim: int) -> PartitionSpec:
        entries: list[Entry] = [None] * ndim
        for d, a in zip(self.dims(ndim), self.mesh_axes):
            entries[d] = a
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def named_sharding(self, mesh: Any, ndim: int, what: str = "ShardSpec") -> NamedSharding:
        """The NamedSharding on ``mesh``; a ValueError naming ``what`` if this spec uses an
        axis the mesh does not have."""
        m = as_mesh(mesh, what)
        m.check_axes(what, "layout.mesh_axes", (a for e in self.mesh_axes for a in entry_axes(e)))
        return NamedSharding(m.jax_mesh, self.partition_spec(ndim))

    def check_shape(self, shape: Sequence[int], mesh: Any, what: str = "tensor") -> None:
        """ValueError unless every partitioned dim is divisible by its axis size."""
        m = as_mesh(mesh, what)
        for d, e in zip(self.dims(len(shape)), self.mesh_axes):
            if e is None:
                continue
            n = m.axis_size(e)
            if shape[d] % n:
                raise ValueError(
                    f"{what}: dim {d} of shape {tuple(shape)} has size {shape[d]}, which mesh "
                    f"axis {e!r} of size {n} does not divide"
                )

    def __repr__(self) -> str:
        return f"ts.ShardSpec(partition={self.partition}, mesh_axes={self.mesh_axes})"


def as_partition_spec(layout: Any, ndim: int) -> PartitionSpec:
    """A ShardSpec, PartitionSpec, NamedSharding or None (replicated) as a PartitionSpec."""
    if layout is None:
        return PartitionSpec()
    if isinstance(layout, ShardSpec):
        return layout.partition_spec(ndim)
    if isinstance(layout, PartitionSpec):
        return layout
    if isinstance(layout, NamedSharding):
        return layout.spec
    raise TypeError(
        f"layout={layout!r} must be a ts.ShardSpec, a PartitionSpec, a NamedSharding or None"
    )


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """Every mesh axis a PartitionSpec uses."""
    return tuple(a for e in spec for a in entry_axes(e))


def sharding_spec(x: Any) -> PartitionSpec | None:
    """The PartitionSpec of a concrete array with a NamedSharding, else None."""
    s = getattr(x, "sharding", None)
    if isinstance(x, jax.core.Tracer) or not isinstance(s, NamedSharding):
        return None
    return s.spec
