"""Domains and distributions: ``ts.domain.Rect``, ``ts.dist.Block``,
``ts.array.from_domain``.

A domain is a global index space; a distribution says how it is partitioned over a
mesh. ``Rect((B, S, D))`` with ``Block(mesh_axes=("dp", "tp"))`` splits dim 0 into
contiguous blocks over ``dp`` and dim 1 over ``tp`` (dim i over ``mesh_axes[i]``;
None leaves a dim whole); ``from_domain`` allocates the DistTensor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from tessera_jax.sharding.mesh import Mesh, as_mesh, positive_shape, resolve_mesh
from tessera_jax.sharding.spec import Entry, ShardSpec, entries
from tessera_jax.sharding.tensor import DistTensor
from tessera_jax.sharding.tensor import tensor as _tensor


@dataclasses.dataclass(frozen=True)
class Rect:
    """A rectangular index space ``[0, shape[0]) × … × [0, shape[-1])`` (positive sizes)."""

    shape: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", positive_shape("domain.Rect", "shape", self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"ts.domain.Rect({self.shape})"


@dataclasses.dataclass(frozen=True)
class Block:
    """Block distribution: dim i in contiguous blocks over ``mesh_axes[i]``."""

    mesh_axes: tuple[Entry, ...]
    mesh: Mesh | None = None

    def __post_init__(self):
        object.__setattr__(self, "mesh_axes", entries("dist.Block", self.mesh_axes))
        if self.mesh is not None:
            object.__setattr__(self, "mesh", as_mesh(self.mesh, "dist.Block"))

    def layout(self, ndim: int) -> ShardSpec:
        if len(self.mesh_axes) > ndim:
            raise ValueError(
                f"dist.Block: mesh_axes={self.mesh_axes} has more entries than the domain's "
                f"{ndim} dims"
            )
        dims = tuple(i for i, a in enumerate(self.mesh_axes) if a is not None)
        return ShardSpec(partition=dims, mesh_axes=tuple(self.mesh_axes[i] for i in dims))


def from_domain(
    domain: Rect | Sequence[int],
    dtype: Any = "f32",
    distribution: Block | ShardSpec | None = None,
    *,
    mesh: Mesh | None = None,
    init: Any = None,
    key: Any = None,
) -> DistTensor:
    """A DistTensor over ``domain`` partitioned by ``distribution`` (replicated if None).

    The mesh is ``mesh``, else the distribution's, else the current ``with mesh:``.
    """
    op = "array.from_domain"
    if not isinstance(domain, Rect):
        domain = Rect(positive_shape(op, "domain", domain))
    if isinstance(distribution, Block):
        layout = distribution.layout(domain.ndim)
        m = resolve_mesh(op, mesh if mesh is not None else distribution.mesh)
    elif distribution is None or isinstance(distribution, ShardSpec):
        layout = distribution if distribution is not None else ShardSpec()
        m = resolve_mesh(op, mesh)
    else:
        raise TypeError(
            f"{op}: distribution={distribution!r} must be a ts.dist.Block, a ts.ShardSpec or None"
        )
    return _tensor(domain.shape, layout, m, dtype, init, key=key)
