"""Domains and distributions (seed 002 §4.5): ``ts.domain.Rect``, ``ts.dist.Block``,
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

from tessera_jax.sharding.mesh import Mesh, resolve_mesh
from tessera_jax.sharding.spec import Entry, ShardSpec
from tessera_jax.sharding.tensor import DistTensor
from tessera_jax.sharding.tensor import tensor as _tensor


@dataclasses.dataclass(frozen=True)
class Rect:
    """A rectangular index space ``[0, shape[0]) × … × [0, shape[-1])``."""

    shape: tuple[int, ...]

    def __post_init__(self):
        shape = (self.shape,) if isinstance(self.shape, int) else tuple(self.shape)
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"domain.Rect: shape={self.shape!r} must be non-negative ints")
        object.__setattr__(self, "shape", shape)

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
        axes = (self.mesh_axes,) if isinstance(self.mesh_axes, str) else tuple(self.mesh_axes)
        object.__setattr__(self, "mesh_axes", axes)

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
    domain = domain if isinstance(domain, Rect) else Rect(tuple(domain))
    if isinstance(distribution, Block):
        layout = distribution.layout(domain.ndim)
        m = resolve_mesh("array.from_domain", mesh or distribution.mesh)
    else:
        layout = distribution if distribution is not None else ShardSpec()
        m = resolve_mesh("array.from_domain", mesh)
    return _tensor(domain.shape, layout, m, dtype, init, key=key)
