"""Region privileges: ``ts.Region[ts.read | ts.write | ts.reduce_sum]``.

Annotating a parameter of a ``@ts.jit`` function (or of a function launched by
``ts.index_launch``) declares how the launch uses that region, as Regent's
privileges do:

* ``Region[read]``: an input; the body reads it.
* ``Region[write]``: an output. The body assigns it (``Y[:] = value`` or
  ``Y[idx] = value``) and may read back what it wrote, not the old contents.
  Its new value is returned, with the argument's sharding (a DistTensor
  argument gives a DistTensor of the same layout). A written region reads
  as the values written: ``Y[idx]``, arithmetic, ``jnp`` functions.
* ``Region[reduce_sum]``: the body only accumulates into it (``Y += value``); the
  new value, old + contributions, is returned. Under ``ts.index_launch`` the
  contributions of all parts are combined with the deterministic all-reduce
  (``ts.op.all_reduce``) unless the region is itself partitioned (``Y.parts``).

Because JAX is functional, the new contents come back as return values: the
wrapped function returns the new values of its write/reduce regions in
parameter order (one bare, several as a tuple), preceded by the body's own
return value when it returns one: ``Y = step(W, X, Y)``.

Checks, at trace time, each a ``RegionError`` (a ValueError):

* two writers of one region: the same region passed to two write/reduce_sum
  parameters, or (in an index launch) a ``Region[write]`` argument that is not
  partitioned along the launch axis, so every part would write all of it;
* a read of a region that is being reduced or written in the same launch: the
  same region passed to a read parameter and a write/reduce_sum one;
* in the body: reading a ``reduce_sum`` region, reading a ``write`` region
  before writing it, or ``+=`` into a read/write region.

Regions are identified by object identity (the same array, DistTensor or Parts
object). ``jax.jit`` hands a traced body a separate tracer per argument, so the
wrapper sees aliasing of the caller's arrays only when it receives them itself:
called directly, inside a traced caller, or under ``ts.index_launch``. A caller
that jits the wrapper can run ``wrap(fn).check_aliases(*args, **kwargs)`` on its
arguments first.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tessera_jax.sharding.mesh import constrain, is_int
from tessera_jax.sharding.tensor import DistTensor, Parts, add_arithmetic


class RegionError(ValueError):
    """A region privilege violation, raised at trace time."""


@dataclasses.dataclass(frozen=True)
class Privilege:
    name: str

    def __repr__(self) -> str:
        return f"ts.{self.name}"


read = Privilege("read")
write = Privilege("write")
reduce_sum = Privilege("reduce_sum")
PRIVILEGES = (read, write, reduce_sum)


@dataclasses.dataclass(frozen=True)
class RegionType:
    """The annotation ``Region[privilege]``."""

    privilege: Privilege

    def __repr__(self) -> str:
        return f"ts.Region[{self.privilege!r}]"


class _RegionFactory:
    def __getitem__(self, privilege: Privilege) -> RegionType:
        if not isinstance(privilege, Privilege):
            raise TypeError(f"Region[{privilege!r}]: expected ts.read, ts.write or ts.reduce_sum")
        return RegionType(privilege)

    def __repr__(self) -> str:
        return "ts.Region"


Region = _RegionFactory()


# --- annotations ---------------------------------------------------------------------------


def privileges(fn: Callable[..., Any]) -> dict[str, Privilege]:
    """Parameter name -> privilege, for the parameters annotated ``Region[...]``."""
    inner = inspect.unwrap(fn)
    try:
        sig = inspect.signature(inner)
    except (TypeError, ValueError):
        return {}
    out = {}
    for p in sig.parameters.values():
        ann = p.annotation
        if isinstance(ann, str):  # from __future__ import annotations
            if "Region" not in ann:
                continue
            try:
                ann = eval(ann, getattr(inner, "__globals__", {}), {})
            except Exception as e:
                raise TypeError(
                    f"{getattr(inner, '__name__', fn)}: cannot resolve the annotation "
                    f"{p.annotation!r} of parameter {p.name!r}: {e}"
                ) from None
        if isinstance(ann, RegionType):
            out[p.name] = ann.privilege
    return out


def has_regions(fn: Callable[..., Any]) -> bool:
    """Whether any parameter of ``fn`` is annotated ``ts.Region[...]``."""
    try:
        return bool(privileges(fn))
    except TypeError:
        return False


# --- the body's view of write / reduce regions -------------------------------------------


def _arr(x: Any) -> Any:
    return x.__jax_array__() if hasattr(x, "__jax_array__") and not isinstance(x, jax.Array) else x


def _check_value(name: str, priv: str, target: Any, value: Any, what: str) -> jax.Array:
    """``value`` as an array broadcastable to ``target`` (a ShapeDtypeStruct), or a
    RegionError naming the region and both shapes."""
    try:
        if isinstance(value, (str, bytes)):  # jnp.asarray would read a str as a dtype name
            raise TypeError(type(value).__name__)
        value = jnp.asarray(_arr(value))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"region {name!r} is Region[{priv}]: {what} {type(value).__name__} {value!r:.60} "
            f"is not an array"
        ) from e
    try:
        fits = jnp.broadcast_shapes(value.shape, target.shape) == tuple(target.shape)
    except ValueError:
        fits = False
    if not fits:
        raise RegionError(
            f"region {name!r} is Region[{priv}]: {what} of shape {value.shape} does not "
            f"broadcast to shape {tuple(target.shape)}"
        )
    return value


def _check_index(name: str, idx: Any, shape: tuple[int, ...]) -> None:
    """RegionError for a static int index outside ``shape``: ``.at[i].set`` would drop
    the write silently."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    if any(p is Ellipsis or p is None for p in parts):
        return
    if len(parts) > len(shape):
        raise RegionError(
            f"region {name!r} is Region[write] of shape {shape}: index {idx!r} has "
            f"{len(parts)} entries for {len(shape)} dims"
        )
    for d, p in enumerate(parts):
        if is_int(p) and not -shape[d] <= p < shape[d]:
            raise RegionError(
                f"region {name!r} is Region[write] of shape {shape}: index {idx!r} must "
                f"be in [-{shape[d]}, {shape[d]}) along dim {d}"
            )


@jax.tree_util.register_pytree_node_class
class WriteRegion:
    """A ``Region[write]`` inside the body: assign with ``Y[:] = v`` / ``Y[idx] = v``;
    once written, it reads (``Y[idx]``, arithmetic, ``jnp`` functions) as the values
    written. A pytree (the old and new values), so that ``jnp`` functions traced under
    ``jit`` convert it through ``__jax_array__`` and see the RegionError of an early read."""

    def __init__(self, name: str, old: Any):
        self._name, self._old, self._new = name, _arr(old), None

    def tree_flatten(self):
        return (self._old, self._new), self._name

    @classmethod
    def tree_unflatten(cls, name, children):
        self = object.__new__(cls)
        self._name, (self._old, self._new) = name, children
        return self

    shape = property(lambda self: self._old.shape)
    dtype = property(lambda self: self._old.dtype)
    ndim = property(lambda self: self._old.ndim)

    def __setitem__(self, idx: Any, value: Any) -> None:
        if idx is Ellipsis or (isinstance(idx, slice) and idx == slice(None)):
            value = _check_value(self._name, "write", self._old, value, "the value assigned")
            self._new = jnp.broadcast_to(value, self.shape).astype(self.dtype)
            return
        base = self._new if self._new is not None else self._old
        _check_index(self._name, idx, tuple(self.shape))
        try:
            target = jax.eval_shape(lambda b: b[idx], base)
        except (IndexError, TypeError, ValueError) as e:
            raise RegionError(
                f"region {self._name!r} is Region[write] of shape {tuple(self.shape)}: "
                f"index {idx!r} does not select part of it ({e})"
            ) from None
        value = _check_value(self._name, "write", target, value, f"the value assigned to [{idx}]")
        self._new = base.at[idx].set(value.astype(self.dtype))

    def __jax_array__(self) -> jax.Array:
        if self._new is None:
            raise RegionError(
                f"region {self._name!r} is Region[write]: it is read before being written"
            )
        return self._new

    def __getitem__(self, idx: Any) -> jax.Array:
        return self.__jax_array__()[idx]

    def __iadd__(self, other: Any) -> Any:
        raise RegionError(
            f"region {self._name!r} is Region[write]: `+=` reads it; declare it "
            "Region[reduce_sum] to accumulate"
        )

    def result(self) -> jax.Array:
        return self._old if self._new is None else self._new


def _read_written(op: Callable[[Any, Any], Any], reflected: bool) -> Callable[..., Any]:
    # Python numbers do not go through __jax_array__: without these, `Y + 1.0` on an
    # unwritten region would be a bare "unsupported operand" TypeError, not a RegionError.
    def method(self: WriteRegion, other: Any) -> Any:
        v = self.__jax_array__()
        return op(_arr(other), v) if reflected else op(v, _arr(other))

    return method


add_arithmetic(WriteRegion, _read_written)
WriteRegion.__neg__ = lambda self: -self.__jax_array__()


@jax.tree_util.register_pytree_node_class
class ReduceRegion:
    """A ``Region[reduce_sum]`` inside the body: accumulate with ``Y += v`` only (a
    pytree of the accumulated value, as WriteRegion is)."""

    def __init__(self, name: str, like: Any):
        like = _arr(like)
        self._name, self._shape, self._dtype, self._acc = name, like.shape, like.dtype, None

    def tree_flatten(self):
        return (self._acc,), (self._name, tuple(self._shape), self._dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        self = object.__new__(cls)
        (self._name, self._shape, self._dtype), (self._acc,) = aux, children
        return self

    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self._dtype)
    ndim = property(lambda self: len(self._shape))

    def __iadd__(self, value: Any) -> ReduceRegion:
        target = jax.ShapeDtypeStruct(self._shape, self._dtype)
        value = _check_value(self._name, "reduce_sum", target, value, "the value added")
        v = jnp.broadcast_to(value, self._shape).astype(self._dtype)
        self._acc = v if self._acc is None else self._acc + v
        return self

    def _read(self, *_: Any) -> Any:
        raise RegionError(
            f"region {self._name!r} is Region[reduce_sum]: it may only be accumulated "
            "into with `+=`, not read"
        )

    __jax_array__ = __array__ = __getitem__ = __setitem__ = _read
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _read
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __pow__ = _read

    def contribution(self) -> jax.Array | None:
        return self._acc


# --- launches ------------------------------------------------------------------------------


def _region_key(x: Any) -> int:
    if isinstance(x, Parts):
        x = x.tensor
    if isinstance(x, DistTensor):
        x = x.array
    return id(x)


def check_aliases(fname: str, privs: dict[str, Privilege], bound: dict[str, Any]) -> None:
    """RegionError if one region is passed to two parameters and one of them writes or
    reduces it (two writers, or a read of a region written/reduced in the launch)."""
    seen: dict[int, tuple[str, Privilege]] = {}
    for name, priv in privs.items():
        if name not in bound:
            continue
        key = _region_key(bound[name])
        if key in seen:
            other, opriv = seen[key]
            if priv is read and opriv is read:
                continue
            if read in (priv, opriv):
                r, w = (name, other) if priv is read else (other, name)
                wp = opriv if priv is read else priv
                raise RegionError(
                    f"{fname}: region passed as {r!r} (Region[read]) is also {w!r} "
                    f"(Region[{wp.name}]) in the same launch: a read of a region being "
                    f"{'reduced' if wp is reduce_sum else 'written'}"
                )
            raise RegionError(
                f"{fname}: one region is passed to {other!r} (Region[{opriv.name}]) and "
                f"{name!r} (Region[{priv.name}]): two writers of the same region"
            )
        seen[key] = (name, priv)


def bind_arguments(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]):
    sig = inspect.signature(inspect.unwrap(fn))
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{getattr(fn, '__name__', fn)}: {e}") from None
    return bound


def run_body(
    fn: Callable[..., Any],
    privs: dict[str, Privilege],
    bound: inspect.BoundArguments,
) -> tuple[Any, list[tuple[str, Privilege, Any]]]:
    """Calls ``fn`` with write/reduce regions replaced by their proxies; returns the
    body's return value and ``(name, privilege, proxy)`` for each such region."""
    proxies = []
    arguments = dict(bound.arguments)
    for name, priv in privs.items():
        if name not in arguments or priv is read:
            continue
        arr = base(arguments[name])
        if not (hasattr(arr, "shape") and hasattr(arr, "dtype")):
            raise TypeError(
                f"{getattr(fn, '__name__', 'function')}: region {name!r} "
                f"(Region[{priv.name}]) must be an array or a ts.dist.tensor; got "
                f"{type(arr).__name__} {arr!r:.60}"
            )
        proxy = (WriteRegion if priv is write else ReduceRegion)(name, base(arguments[name]))
        arguments[name] = proxy
        proxies.append((name, priv, proxy))
    call = inspect.BoundArguments(bound.signature, arguments)
    out = fn(*call.args, **call.kwargs)
    return out, proxies


def base(x: Any) -> Any:
    """The array of a region argument (a DistTensor's or Parts' array, or ``x``)."""
    if isinstance(x, Parts):
        x = x.tensor
    return x.array if isinstance(x, DistTensor) else x


def package(out: Any, regions: list[Any]) -> Any:
    """The wrapped function's return value (module docstring)."""
    if not regions:
        return out
    vals = regions[0] if len(regions) == 1 else tuple(regions)
    if out is None:
        return vals
    return (out, *regions)


def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its region privileges enforced at trace time (module docstring).

    The result takes ``fn``'s arguments and returns the new values of its
    write/reduce_sum regions (after ``fn``'s own return value, if any). It is
    traceable: ``ts.jit`` passes it to ``jax.jit``.
    """
    privs = privileges(fn)
    fname = getattr(fn, "__name__", "function")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        bound = bind_arguments(fn, args, kwargs)
        check_aliases(fname, privs, bound.arguments)
        out, proxies = run_body(fn, privs, bound)
        regions = []
        for name, priv, proxy in proxies:
            arg = bound.arguments[name]
            if priv is write:
                new = proxy.result()
            else:
                contrib = proxy.contribution()
                new = base(arg) if contrib is None else base(arg) + contrib
            if isinstance(arg, DistTensor):
                new = arg.with_array(constrain(new, arg.sharding))
            regions.append(new)
        return package(out, regions)

    def check(*args: Any, **kwargs: Any) -> None:
        check_aliases(fname, privs, bind_arguments(fn, args, kwargs).arguments)

    wrapped.__region_privileges__ = privs  # type: ignore[attr-defined]
    # For callers that flatten arguments before calling (jax.jit): the aliasing check
    # on the caller's own objects.
    wrapped.check_aliases = check  # type: ignore[attr-defined]
    return wrapped
