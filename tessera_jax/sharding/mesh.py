"""Meshes: named axes over devices (``ts.dist.Mesh`` / ``ts.dist.mesh``).

A Tessera mesh is a thin wrapper around a ``jax.sharding.Mesh`` (``.jax_mesh``):
the meshes it builds have Auto axes, and ``Mesh.from_jax`` wraps a jax mesh of
Auto or Explicit axes (``jax.make_mesh``'s default) as it is. Devices are given
as indices into ``jax.devices()``, as jax devices, or as strings ``"cuda:3"`` /
``"gpu:3"`` / ``"cpu:3"`` (platform and index within that platform).
``with mesh:`` makes it the current mesh, which ``ts.dist.tensor``,
``ts.array.from_domain``, the collectives' global view and ``ts.index_launch``
use when no mesh is passed.
"""

from __future__ import annotations

import contextvars
import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from tessera_jax import _compat

_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}

_current: contextvars.ContextVar[tuple[Mesh, ...]] = contextvars.ContextVar(
    "tessera_mesh", default=()
)


def is_int(value: Any) -> bool:
    """A Python or NumPy integer, not a bool (``True`` is not a size or an index)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def positive_int(op: str, name: str, value: Any) -> int:
    """``value`` as an int >= 1: a TypeError for bools, floats (no silent truncation of
    8.7 to 8) and non-numbers, a ValueError for 0 and negative sizes."""
    if not is_int(value):
        raise TypeError(f"{op}: {name}={value!r} must be a positive int")
    if value < 1:
        raise ValueError(f"{op}: {name}={value!r} must be a positive int")
    return operator.index(value)


def positive_shape(op: str, name: str, shape: Any) -> tuple[int, ...]:
    """A shape (an int, or a sequence of them) as a tuple of positive ints."""
    if is_int(shape):
        shape = (shape,)
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)):
        raise TypeError(f"{op}: {name}={shape!r} must be a sequence of positive ints")
    for i, s in enumerate(shape):
        if not is_int(s) or s < 1:
            raise (ValueError if is_int(s) else TypeError)(
                f"{op}: {name}={tuple(shape)!r} must be a sequence of positive ints; "
                f"entry {i} is {s!r}"
            )
    return tuple(operator.index(s) for s in shape)


def axis_names(op: str, name: str, axes: Any) -> tuple[str, ...]:
    """A mesh-axis name or a sequence of distinct names, as a non-empty tuple."""
    if isinstance(axes, str):
        axes = (axes,)
    if not isinstance(axes, (Sequence, np.ndarray)):
        raise TypeError(f"{op}: {name}={axes!r} must be a mesh-axis name or a sequence of names")
    axes = tuple(axes)
    if not axes:
        raise ValueError(f"{op}: {name}={axes!r} must name at least one mesh axis")
    for a in axes:
        if not isinstance(a, str) or not a:
            raise TypeError(
                f"{op}: {name}={axes!r} must be mesh-axis names (non-empty strings); {a!r} is not"
            )
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: {name}={axes!r} repeats a mesh axis")
    return axes


def _device(spec: Any, index: int) -> Any:
    """One device from an int, a jax device or a ``"platform:i"`` string."""
    if is_int(spec):
        devs = jax.devices()
        if not 0 <= spec < len(devs):
            raise ValueError(
                f"Mesh: devices[{index}]={spec} is out of range; this process has "
                f"{len(devs)} {devs[0].platform} devices"
            )
        return devs[int(spec)]
    if isinstance(spec, str):
        platform, _, idx = spec.partition(":")
        kind = _PLATFORM_ALIASES.get(platform.lower())
        if kind is None or not idx.isdigit():
            raise ValueError(
                f"Mesh: devices[{index}]={spec!r} must look like 'cuda:3', 'gpu:3' or 'cpu:3'"
            )
        try:
            devs = jax.devices(kind)
        except RuntimeError:
            devs = []
        if not devs:
            have = f"{len(jax.devices())} {jax.devices()[0].platform}"
            raise ValueError(
                f"Mesh: devices[{index}]={spec!r}: no {kind} devices here (have {have})"
            )
        if int(idx) >= len(devs):
            raise ValueError(
                f"Mesh: devices[{index}]={spec!r} is out of range; there are "
                f"{len(devs)} {kind} devices"
            )
        return devs[int(idx)]
    if hasattr(spec, "platform") and hasattr(spec, "id"):
        return spec
    raise TypeError(
        f"Mesh: devices[{index}]={spec!r} must be an int, a jax device or a 'cuda:i' string"
    )


class Mesh:
    """Devices arranged along named axes: ``ts.dist.Mesh(axes=["dp"], devices=range(8))``.

    Arguments:
      axes: axis names, e.g. ``("dp", "tp", "pp")``.
      devices: device indices, jax devices or ``"cuda:i"`` strings, at least one
        (default: all).
      shape: the size of each axis, positive ints; its product must equal the device
        count.
        Without it a mesh of one axis takes all devices; with several axes it is
        required.
    """

    def __init__(
        self,
        axes: Sequence[str] | str,
        devices: Iterable[Any] | None = None,
        shape: Sequence[int] | None = None,
    ):
        axes = axis_names("Mesh", "axes", axes)
        if devices is None:
            devs = list(jax.devices())
        elif isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
            raise TypeError(
                f"Mesh: devices={devices!r} must be a sequence of device indices, jax devices "
                "or 'cuda:i' strings"
            )
        else:
            # an ndarray of devices (as jax meshes hold them) is taken in row-major order
            devs = list(np.ravel(devices)) if isinstance(devices, np.ndarray) else list(devices)
        if not devs:
            raise ValueError(
                f"Mesh: devices={devices!r} is empty; a mesh needs at least one device"
            )
        devs = [_device(d, i) for i, d in enumerate(devs)]
        if len({(d.platform, d.id) for d in devs}) != len(devs):
            raise ValueError(f"Mesh: devices={devices!r} names a device twice")
        if shape is None:
            if len(axes) != 1:
                raise ValueError(
                    f"Mesh: axes={axes} has {len(axes)} axes; pass shape=(...) saying how "
                    f"the {len(devs)} devices split over them"
                )
            shape = (len(devs),)
        shape = positive_shape("Mesh", "shape", shape)
        if len(shape) != len(axes):
            raise ValueError(f"Mesh: shape={shape} must have one size per axis in axes={axes}")
        if math.prod(shape) != len(devs):
            raise ValueError(
                f"Mesh: shape={shape} holds {math.prod(shape)} devices but "
                f"{len(devs)} devices were given"
            )
        self.axes: tuple[str, ...] = axes
        self.shape: tuple[int, ...] = shape
        self.jax_mesh: jax.sharding.Mesh = _compat.make_mesh(
            np.array(devs, dtype=object).reshape(shape), axes
        )

    @classmethod
    def from_jax(cls, mesh: jax.sharding.Mesh) -> Mesh:
        """Wraps an existing ``jax.sharding.Mesh`` (Auto or Explicit axes)."""
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"Mesh.from_jax: mesh={mesh!r} must be a jax.sharding.Mesh")
        self = cls.__new__(cls)
        self.axes = tuple(mesh.axis_names)
        self.shape = tuple(mesh.devices.shape)
        self.jax_mesh = mesh
        return self

    @property
    def devices(self) -> np.ndarray:
        return self.jax_mesh.devices

    @property
    def explicit(self) -> bool:
        """Whether any axis is Explicit (shardings are part of the types: inputs must be
        placed as ``shard_map``'s in_specs say before it runs)."""
        return has_explicit_axes(self.jax_mesh)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axis: str | Sequence[str]) -> int:
        """The number of devices along ``axis`` (a name or a tuple of names)."""
        names = axis_names("Mesh.axis_size", "axis", axis)
        self.check_axes("Mesh.axis_size", "axis", names)
        return math.prod(self.shape[self.axes.index(a)] for a in names)

    def check_axes(self, op: str, name: str, axes: Iterable[str]) -> None:
        """ValueError naming ``op`` and its argument ``name`` unless every one of ``axes``
        is an axis of this mesh."""
        for a in axes:
            if a not in self.axes:
                raise ValueError(
                    f"{op}: {name} names {a!r}, which is not an axis of the mesh {self.axes}"
                )

    def __enter__(self) -> Mesh:
        # A stack of tokens: the same mesh may be entered again inside itself (an index
        # launch makes its mesh current while it traces the body).
        token = _current.set((*_current.get(), self))
        self.__dict__.setdefault("_tokens", []).append(token)
        return self

    def __exit__(self, *exc: Any) -> None:
        _current.reset(self.__dict__["_tokens"].pop())

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Mesh) and self.jax_mesh == other.jax_mesh

    def __hash__(self) -> int:
        return hash(self.jax_mesh)

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={s}" for a, s in zip(self.axes, self.shape))
        return f"ts.dist.Mesh({axes}; {self.devices.flat[0].platform})"


def mesh(
    devices: Iterable[Any] | None = None,
    axes: Sequence[str] | str = ("dp",),
    shape: Sequence[int] | None = None,
) -> Mesh:
    """``ts.dist.mesh(devices=[...], axes=("dp",), shape=(4,))``: ``Mesh`` with the
    devices first."""
    return Mesh(axes=axes, devices=devices, shape=shape)


def current_mesh() -> Mesh | None:
    """The innermost ``with mesh:`` mesh, or None."""
    stack = _current.get()
    return stack[-1] if stack else None


def as_mesh(m: Any, op: str = "mesh") -> Mesh:
    """A ts.dist.Mesh for a ts or jax mesh; a TypeError naming ``op`` for anything else."""
    if isinstance(m, Mesh):
        return m
    if isinstance(m, jax.sharding.Mesh):
        return Mesh.from_jax(m)
    raise TypeError(f"{op}: mesh={m!r} must be a ts.dist.Mesh or a jax.sharding.Mesh")


def resolve_mesh(op: str, mesh: Any = None, *candidates: Any) -> Mesh:
    """``mesh``, else the mesh of the first DistTensor among ``candidates``, else the
    current ``with mesh:``; a ValueError naming ``op`` when there is none."""
    if mesh is not None:
        return as_mesh(mesh, op)
    for c in candidates:
        m = getattr(c, "mesh", None)
        if isinstance(m, Mesh):
            return m
    m = current_mesh()
    if m is None:
        raise ValueError(
            f"{op}: no mesh; pass mesh=..., a ts.dist.tensor, or call inside "
            "`with ts.dist.Mesh(...):`"
        )
    return m


def constrain(x: Any, sharding: jax.sharding.NamedSharding) -> Any:
    """``x`` laid out as ``sharding``, traced or concrete, on a mesh of Auto or Explicit
    axes: ``with_sharding_constraint`` may only name Auto axes, so Explicit ones are
    resharded (the sharding is then part of the value's type)."""
    if has_explicit_axes(sharding.mesh):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def has_explicit_axes(mesh: Any) -> bool:
    """Whether a jax mesh has an Explicit axis (``jax.make_mesh``'s default from 0.10)."""
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))
