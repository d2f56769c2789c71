"""The operations of a kernel body (``ts.tile.*``) and the index values they take.

A kernel body runs once per program (a *group*: a CUDA block) on whole tiles: a
``ts.launch.thread_id()`` is not one integer but the vector of the group's lane indices,
and every operation acts on all lanes at once, as in Triton. Three kinds of value flow
through a body:

* :class:`Idx` -- an integer that is an affine function of traced scalars (the group id,
  a loop counter) plus a constant, with static bounds where known. ``k + BK - k`` is the
  constant ``BK``, so ``A[m0:m0 + BM, k:k + BK]`` has a static window shape, and a window
  whose bounds prove it inside the array needs no mask.
* :class:`Lanes` -- ``start + arange(n)`` along one axis of the tile (a thread-id vector).
  Loads and stores through it become one contiguous ``pl.ds`` window plus a mask, never a
  gather; arithmetic other than adding an integer gives a plain array.
* jax arrays -- the tile values themselves (registers), and masks.

Every load and store is masked by the array's bounds unless the index bounds prove the
window inside it, so a ragged edge never reads or writes outside an array, on the GPU or
in the interpreter; a user mask narrows that further.

Memory spaces follow Triton's lane-vector model: ``alloc_shared`` gives a tile that
``cp_async`` fills and ``dot``/``mma`` read; the backend places it (shared memory for dot
operands, registers otherwise) and issues the asynchronous copies itself when it pipelines
a ``ts.tile.range`` loop (``num_stages``), so ``cp_commit_group``/``cp_wait_group`` and
``barrier`` only fix program order, which every tile operation already has. A ``cp_async``
from an input array (which the kernel never stores to) is performed where its tile is read
(:class:`Copy`), with the same values as copying at once: a hand-written double buffer
(copy step k + 1 while multiplying step k) thus becomes loads inside the loop, which the
pipeliner overlaps with the multiplies, rather than tiles carried across iterations in
registers. Warp-level operations act on the lane vector cut into warps of 32 lanes (their
tile-level equivalents); on the GPU a shuffle is one gather along the warp's lanes, which
Triton lowers to warp shuffles.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from tessera_jax import _compat
from tessera_jax._compat import pallas_triton as plgpu
from tessera_jax.numerics.dtypes import as_np_dtype

__all__ = [
    "Idx",
    "Lanes",
    "SharedTile",
    "TileRange",
    "TileRef",
    "alloc_register",
    "alloc_shared",
    "barrier",
    "cooperative_group",
    "cp_async",
    "cp_commit_group",
    "cp_wait_group",
    "dot",
    "exp",
    "full",
    "group_id",
    "group_size",
    "lane_id",
    "lanes",
    "linear_id",
    "load",
    "load_vector",
    "local_id",
    "max",
    "maximum",
    "mma",
    "num_groups",
    "range",
    "reduce_sum",
    "relu",
    "softmax",
    "store",
    "store_vector",
    "warp_id",
    "warp_lane",
    "warp_shuffle_down",
    "where",
    "zeros",
]

WARP = 32
# tl.dot's smallest operand extent on every architecture Triton targets.
MIN_DOT = 16

_builtin_range = range
_builtin_max = max


# --- the trace context ------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What the operations of one kernel trace need: the launch and the bookkeeping."""

    name: str
    filename: str
    lines: tuple[int, int]
    grid: tuple[int, ...]
    threads: tuple[int, ...]
    interpret: bool
    # Interpreter only: the padding in front of each dimension of each array operand.
    pads: dict[int, tuple[int, ...]]
    # Filled while tracing: the largest window per (operand, dim), stored operands, prefetch.
    windows: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    stored: set[int] = dataclasses.field(default_factory=set)
    prefetch: int = 0
    shared: list[SharedTile] = dataclasses.field(default_factory=list)
    shared_bytes: int = 0
    # For autotuning's fit check: bytes of dot operand tiles (staged in shared memory, once
    # per pipeline stage) and of the largest set of loop-carried tiles (held in registers).
    dot_bytes: int = 0
    carried_bytes: int = 0
    # The trace scopes open now (the kernel's, then one per loop body being traced): a
    # deferred copy's loaded value is reused only inside the scope that loaded it.
    scopes: list[object] = dataclasses.field(default_factory=lambda: [object()])


_STATE = threading.local()


def current() -> Context:
    ctx = getattr(_STATE, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "ts.tile operations run only inside a kernel launched with ts.launch.grid(...)"
            "(kernel)(...) or kernel[grid, block](...)"
        )
    return ctx


class enter:
    """Makes ``ctx`` the context of the operations traced inside."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def __enter__(self) -> Context:
        self.prev = getattr(_STATE, "ctx", None)
        _STATE.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc) -> None:
        _STATE.ctx = self.prev


def where_in_kernel(ctx: Context) -> str:
    """``file:line`` of the innermost kernel-source frame on the stack."""
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if code.co_filename == ctx.filename and ctx.lines[0] <= frame.f_lineno <= ctx.lines[1]:
            return f"{ctx.filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ctx.filename


def error(msg: str, hint: str | None = None, exc: type[Exception] = ValueError) -> Exception:
    """An error naming the kernel and the source line of the offending operation."""
    ctx = current()
    text = f"kernel {ctx.name!r} at {where_in_kernel(ctx)}: {msg}"
    return exc(f"{text}; {hint}" if hint else text)


# --- affine integers ----------------------------------------------------------------------


def _is_int_scalar(x: Any) -> bool:
    return (
        hasattr(x, "shape")
        and hasattr(x, "dtype")
        and tuple(x.shape) == ()
        and jnp.issubdtype(x.dtype, jnp.integer)
    )


class Idx:
    """An integer ``sum(coef * tracer) + off`` whose value lies in ``[lo, hi]`` (None: unknown).

    Terms are keyed by the tracer's identity, so ``(k + BK) - k`` cancels to the static
    ``BK``. Anything beyond adding integers and scaling by a Python int gives a jax value.
    """

    __slots__ = ("hi", "lo", "off", "terms")

    def __init__(self, terms=(), off: int = 0, lo: int | None = None, hi: int | None = None):
        self.terms = tuple((t, c) for t, c in terms if c != 0)
        self.off = int(off)
        if not self.terms:
            lo = hi = self.off
        if lo is None or hi is None:  # bounds are known on both sides or not at all
            lo = hi = None
        self.lo, self.hi = lo, hi

    @staticmethod
    def of(x: Any) -> Idx:
        if isinstance(x, Idx):
            return x
        if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            return Idx(off=int(x))
        if _is_int_scalar(x):
            return Idx(((x, 1),))
        raise TypeError(f"{x!r} is not an integer index")

    @property
    def static(self) -> bool:
        return not self.terms

    def value(self) -> Any:
        if self.static:
            return self.off
        v = None
        for t, c in self.terms:
            term = t if c == 1 else t * c
            v = term if v is None else v + term
        return (v + self.off if self.off else v).astype(jnp.int32)

    def __jax_array__(self):
        return jnp.asarray(self.value(), jnp.int32)

    def _add(self, other: Idx, sign: int) -> Idx:
        terms: dict[int, list] = {}
        for t, c in self.terms:
            terms[id(t)] = [t, c]
        for t, c in other.terms:
            if id(t) in terms:
                terms[id(t)][1] += sign * c
            else:
                terms[id(t)] = [t, sign * c]
        lo = hi = None
        if sign > 0 and None not in (self.lo, other.lo, self.hi, other.hi):
            lo, hi = self.lo + other.lo, self.hi + other.hi
        elif sign < 0 and None not in (self.lo, other.lo, self.hi, other.hi):
            lo, hi = self.lo - other.hi, self.hi - other.lo
        return Idx(((t, c) for t, c in terms.values()), self.off + sign * other.off, lo, hi)

    def __add__(self, other):
        if isinstance(other, Lanes):
            return other + self
        try:
            return self._add(Idx.of(other), 1)
        except TypeError:
            return jnp.add(self.value(), other)

    __radd__ = __add__

    def __sub__(self, other):
        try:
            return self._add(Idx.of(other), -1)
        except TypeError:
            return jnp.subtract(self.value(), other)

    def __rsub__(self, other):
        try:
            return Idx.of(other)._add(self, -1)
        except TypeError:
            return jnp.subtract(other, self.value())

    def __neg__(self):
        return Idx.of(0)._add(self, -1)

    def __mul__(self, other):
        if isinstance(other, (int, np.integer)) and not isinstance(other, bool):
            c = int(other)
            lo = hi = None
            if self.lo is not None and self.hi is not None:
                lo, hi = sorted((self.lo * c, self.hi * c))
            return Idx(((t, k * c) for t, k in self.terms), self.off * c, lo, hi)
        return jnp.multiply(self.value(), other)

    __rmul__ = __mul__

    def _positive_int(self, other) -> bool:
        return isinstance(other, (int, np.integer)) and not isinstance(other, bool) and other > 0

    def __floordiv__(self, other):
        if self.static and isinstance(other, int):
            return Idx.of(self.off // other)
        v = jnp.floor_divide(self.value(), other)
        if self._positive_int(other) and self.lo is not None and self.lo >= 0:
            # A new traced integer, with bounds: program-id swizzles keep provable windows.
            return Idx(((v, 1),), 0, self.lo // other, self.hi // other)
        return v

    def __mod__(self, other):
        if self.static and isinstance(other, int):
            return Idx.of(self.off % other)
        v = jnp.remainder(self.value(), other)
        if self._positive_int(other) and self.lo is not None and self.lo >= 0:
            hi = self.hi if self.hi < other else other - 1
            return Idx(((v, 1),), 0, 0 if self.hi >= other else self.lo, hi)
        return v

    def __lt__(self, o):
        return jnp.asarray(self.value()) < o

    def __le__(self, o):
        return jnp.asarray(self.value()) <= o

    def __gt__(self, o):
        return jnp.asarray(self.value()) > o

    def __ge__(self, o):
        return jnp.asarray(self.value()) >= o

    def __eq__(self, o):  # type: ignore[override]
        return jnp.asarray(self.value()) == o

    def __ne__(self, o):  # type: ignore[override]
        return jnp.asarray(self.value()) != o

    __hash__ = None  # type: ignore[assignment]

    def __index__(self) -> int:
        if self.static:
            return self.off
        raise error(
            "this integer is traced (it depends on the group id or a loop counter), so it "
            "has no Python value",
            "use it as an index or in tile arithmetic instead of as a Python int",
            TypeError,
        )

    __int__ = __index__

    def __bool__(self) -> bool:
        if self.static:
            return bool(self.off)
        raise error(
            "a traced integer has no Python truth value",
            "compute a mask and pass mask= to ts.tile.load/store, or use ts.tile.where",
            TypeError,
        )

    def __repr__(self) -> str:
        return f"Idx({self.off})" if self.static else f"Idx(<traced>+{self.off})"


def _bounded(x: Any, lo: int, hi: int) -> Idx:
    return Idx(((x, 1),), 0, lo, hi)


# --- lane vectors -------------------------------------------------------------------------


class Lanes:
    """``start + arange(n)`` laid along ``axis`` of an ``ndim``-D tile (a thread-id vector)."""

    __slots__ = ("axis", "n", "ndim", "start")

    def __init__(self, start: Any, n: int, axis: int = 0, ndim: int = 1):
        self.start, self.n, self.axis, self.ndim = Idx.of(start), int(n), axis, ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.n if d == self.axis else 1 for d in _builtin_range(self.ndim))

    @property
    def dtype(self):
        return jnp.dtype(jnp.int32)

    def value(self) -> jax.Array:
        v = jnp.arange(self.n, dtype=jnp.int32) + jnp.asarray(self.start.value(), jnp.int32)
        return v.reshape(self.shape)

    def __jax_array__(self):
        return self.value()

    def __add__(self, other):
        try:
            return Lanes(self.start + Idx.of(other), self.n, self.axis, self.ndim)
        except TypeError:
            return jnp.add(self.value(), other)

    __radd__ = __add__

    def __sub__(self, other):
        try:
            return Lanes(self.start - Idx.of(other), self.n, self.axis, self.ndim)
        except TypeError:
            return jnp.subtract(self.value(), other)

    def __rsub__(self, other):
        return jnp.subtract(other, self.value())

    def __mul__(self, o):
        return jnp.multiply(self.value(), o)

    __rmul__ = __mul__

    def __floordiv__(self, o):
        return jnp.floor_divide(self.value(), o)

    def __mod__(self, o):
        return jnp.remainder(self.value(), o)

    def __and__(self, o):
        return jnp.bitwise_and(self.value(), o)

    def __lt__(self, o):
        return self.value() < o

    def __le__(self, o):
        return self.value() <= o

    def __gt__(self, o):
        return self.value() > o

    def __ge__(self, o):
        return self.value() >= o

    def __eq__(self, o):  # type: ignore[override]
        return self.value() == o

    def __ne__(self, o):  # type: ignore[override]
        return self.value() != o

    __hash__ = None  # type: ignore[assignment]

    def __getitem__(self, idx):
        return self.value()[idx]

    def __bool__(self) -> bool:
        raise error(
            "an `if` on a lane vector (a tile value) cannot be traced",
            "compute a mask and pass mask= to ts.tile.load/store, or use ts.tile.where",
            TypeError,
        )

    def __repr__(self) -> str:
        return f"Lanes({self.start!r}, n={self.n})"


def lanes(start: Any, size: int) -> Lanes:
    """The index vector ``start + arange(size)`` (``size`` a power of two)."""
    _check_pow2("lanes", "size", size)
    return Lanes(start, size)


# --- arrays in a kernel -------------------------------------------------------------------


class TileRef:
    """A kernel's view of an array argument: its logical ``shape``, ``dtype`` and the ref.

    ``X[idx]`` is a :class:`RefView` (array-like: it loads, bounds-masked); ``X[idx] = v``
    stores, bounds-masked; both take the same indices as :func:`load`.
    """

    def __init__(
        self, ref: Any, name: str, pos: int, shape: tuple[int, ...], dtype: Any, mut: bool
    ):
        self.ref, self.name, self.pos, self.mut = ref, name, pos, mut
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, idx) -> RefView:
        return RefView(self, idx)

    def __setitem__(self, idx, value) -> None:
        store(self, idx, value)

    def __jax_array__(self):
        return load(self)

    def __repr__(self) -> str:
        return f"TileRef({self.name}: {self.dtype}{list(self.shape)})"


class _ArrayLike:
    """Arithmetic through ``__jax_array__`` (a loaded view, a shared tile's value)."""

    def __jax_array__(self):
        raise NotImplementedError

    def _v(self):
        return self.__jax_array__()

    @property
    def T(self):
        return self._v().T

    def astype(self, dtype):
        return self._v().astype(as_np_dtype(dtype))

    def __add__(self, o):
        return self._v() + o

    def __radd__(self, o):
        return o + self._v()

    def __sub__(self, o):
        return self._v() - o

    def __rsub__(self, o):
        return o - self._v()

    def __mul__(self, o):
        return self._v() * o

    def __rmul__(self, o):
        return o * self._v()

    def __truediv__(self, o):
        return self._v() / o

    def __neg__(self):
        return -self._v()

    def __matmul__(self, o):
        return dot(self, o)

    def __lt__(self, o):
        return self._v() < o

    def __gt__(self, o):
        return self._v() > o


class RefView(_ArrayLike):
    """``X[idx]``: an indexed window of an array argument, loaded when used as a value."""

    def __init__(self, tref: TileRef, idx: Any):
        self.tref, self.idx = tref, idx

    def __jax_array__(self):
        return load(self.tref, self.idx)

    @property
    def shape(self) -> tuple[int, ...]:
        return _Access(self.tref, self.idx, "view").shape

    @property
    def dtype(self):
        return self.tref.dtype


class SharedTile(_ArrayLike):
    """A group-local tile (``alloc_shared``): filled by ``cp_async``/``store``, read whole.

    Its ``state`` is its value (an array) or a :class:`Copy` not yet performed: a copy
    from an array the kernel never stores is loaded where the tile is read, which gives the
    same values and lets the backend's pipeliner issue it ahead (a ``ts.tile.range`` loop
    recomputes a prefetched copy from its loop index, not carrying a tile of registers).
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, swizzle: str | None, align: int):
        self.shape, self.dtype, self.swizzle, self.alignment = shape, dtype, swizzle, align
        self.state: jax.Array | Copy = jnp.zeros(shape, dtype)
        # One record per loop body being traced: read before written there, written there.
        self.tracks: list[dict[str, bool]] = []

    @property
    def value(self) -> jax.Array:
        for t in self.tracks:
            t["read_first"] = t["read_first"] or not t["written"]
        return self.peek()

    def peek(self) -> jax.Array:
        """The value, unrecorded (a loop carrying it is not a read by the kernel)."""
        return self.state.load() if isinstance(self.state, Copy) else self.state

    @value.setter
    def value(self, v: Any) -> None:
        self.fill(v)

    def fill(self, state: jax.Array | Copy) -> None:
        for t in self.tracks:
            t["written"] = True
        self.state = state

    def __jax_array__(self):
        return self.value

    def __getitem__(self, idx):
        return self.value[_plain_index(idx)]

    def __setitem__(self, idx, value) -> None:
        store(self, idx, value)


class Copy:
    """A copy of the window ``src[dims]`` into a shared tile of ``dtype``, performed when the
    tile is read (``dims``: per dimension ``(start, size, window)``, an integer index where
    ``window`` is False). Its loaded value is kept for reads in the same trace scope."""

    __slots__ = ("_loaded", "dims", "dtype", "src")

    def __init__(self, src: TileRef, dims: tuple[tuple[Idx, int, bool], ...], dtype: Any):
        self.src, self.dims, self.dtype = src, dims, dtype
        self._loaded: tuple[object, jax.Array] | None = None

    def index(self) -> tuple:
        return tuple(slice(a, a + n) if w else a for a, n, w in self.dims)

    def load(self) -> jax.Array:
        scopes = current().scopes
        if self._loaded is not None and any(self._loaded[0] is sc for sc in scopes):
            return self._loaded[1]
        v = load(self.src, self.index()).astype(self.dtype)
        self._loaded = (scopes[-1], v)
        return v


def _plain_index(idx: Any) -> Any:
    if isinstance(idx, tuple):
        return tuple(_plain_index(i) for i in idx)
    if isinstance(idx, (Idx, Lanes)):
        return idx.value()
    return idx


def _check_pow2(op: str, arg: str, n: Any) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1 or n & (n - 1):
        raise error(
            f"{op}: {arg}={n!r} must be a power of two",
            "the Triton backend holds tiles whose extents are powers of two: pad the tile "
            "and mask the tail",
        )
    return int(n)


class _Access:
    """How ``ref[idx]`` becomes a window: the Pallas indexer, result shape and bounds mask."""

    def __init__(self, tref: TileRef, idx: Any, op: str):
        ctx = current()
        comps = idx if isinstance(idx, tuple) else (idx,)
        if idx is None or idx is Ellipsis:
            comps = ()
        if len(comps) > tref.ndim:
            raise error(
                f"{op}: {len(comps)} indices for the {tref.ndim}-D array {tref.name!r}",
                "give one index per dimension (an int, a slice or a thread-id vector)",
            )
        comps = comps + (slice(None),) * (tref.ndim - len(comps))
        pads = ctx.pads.get(tref.pos, (0,) * tref.ndim)
        self.indexer, self.shape, masks = [], [], []
        nwin = sum(not _is_scalar_index(c) for c in comps)
        r = 0
        for d, (c, dim) in enumerate(zip(comps, tref.shape)):
            if _is_scalar_index(c):
                start, size = Idx.of(c), 1
            elif isinstance(c, Lanes):
                start, size = c.start, c.n
            elif isinstance(c, slice):
                if c.step not in (None, 1):
                    raise error(
                        f"{op}: slice step {c.step!r} on {tref.name!r}",
                        "windows are contiguous; load the window and select lanes with a mask",
                    )
                start = Idx.of(0 if c.start is None else c.start)
                stop = Idx.of(dim if c.stop is None else c.stop)
                extent = stop - start
                if not extent.static:
                    raise error(
                        f"{op}: the slice {_fmt(c)} on {tref.name!r} has no static size",
                        "write it as start:start + SIZE with SIZE a Python int",
                    )
                size = _check_pow2(
                    op, f"size of the window along dim {d} of {tref.name!r}", extent.off
                )
            else:
                raise error(
                    f"{op}: index {c!r} of {tref.name!r} along dim {d}",
                    "an index is an int, a slice start:start + SIZE or a thread-id vector "
                    "(ts.launch.thread_id() plus an int); other index arrays would be gathers",
                    TypeError,
                )
            key = (tref.pos, d)
            ctx.windows[key] = _builtin_max(ctx.windows.get(key, 0), size)
            inside = start.lo is not None and start.lo >= 0 and start.hi + size <= dim
            if start.static and size == 1 and not 0 <= start.off < dim:
                raise error(
                    f"{op}: index {start.off} is out of bounds for dim {d} of {tref.name!r} "
                    f"(size {dim})"
                )
            s = start + pads[d]
            sv = s.value() if not s.static else s.off
            if s.static and not 0 <= s.off <= s.off + size <= tref.ref.shape[d]:
                # A constant window that runs off the array: its lanes outside are masked,
                # and a traced start keeps Pallas from rejecting the window while tracing.
                sv = pl.program_id(0) * 0 + s.off
            if size == 1 and _is_scalar_index(c):
                self.indexer.append(jnp.asarray(sv, jnp.int32))
                if not inside:
                    v = jnp.asarray(start.value())
                    masks.append(((v >= 0) & (v < dim), None))
            else:
                self.indexer.append(pl.ds(sv, size))
                self.shape.append(size)
                if not inside:
                    lanes_ = jnp.arange(size, dtype=jnp.int32) + jnp.asarray(start.value())
                    masks.append(((lanes_ >= 0) & (lanes_ < dim), r))
                r += 1
        self.shape = tuple(self.shape)
        self.mask = None
        for m, axis in masks:
            if axis is not None:
                m = m.reshape(tuple(-1 if a == axis else 1 for a in _builtin_range(nwin)))
            self.mask = m if self.mask is None else self.mask & m
        if self.mask is not None:
            self.mask = jnp.broadcast_to(self.mask, self.shape)
        self.indexer = tuple(self.indexer)

    def combine(self, mask: Any, op: str, name: str) -> Any:
        if mask is None:
            return self.mask
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise error(f"{op}: mask for {name!r} has dtype {mask.dtype}", "a mask is boolean")
        try:
            mask = jnp.broadcast_to(mask, self.shape)
        except ValueError:
            raise error(
                f"{op}: mask of shape {mask.shape} does not broadcast to the window {self.shape}"
                f" of {name!r}"
            ) from None
        return mask if self.mask is None else mask & self.mask


def _is_scalar_index(c: Any) -> bool:
    return isinstance(c, Idx) or (
        (isinstance(c, (int, np.integer)) and not isinstance(c, bool)) or _is_int_scalar(c)
    )


def _fmt(s: slice) -> str:
    return f"{s.start!r}:{s.stop!r}"


def _target(ref: Any, idx: Any, op: str) -> tuple[Any, Any]:
    if isinstance(ref, RefView):
        if idx is not None:
            raise error(f"{op}: {ref.tref.name}[...] is already indexed", "pass idx only once")
        return ref.tref, ref.idx
    if isinstance(ref, (TileRef, SharedTile)):
        return ref, idx
    raise error(
        f"{op}: the first argument is a {type(ref).__name__}",
        "pass a kernel array argument, X[idx] or a tile from ts.tile.alloc_shared",
        TypeError,
    )


def _whole(tile: SharedTile, idx: Any, op: str) -> None:
    """A shared tile is read and written whole (``None``, ``...``, ``:`` or local_id())."""
    comps = idx if isinstance(idx, tuple) else (idx,)
    ok = idx is None or idx is Ellipsis
    if not ok and len(comps) == len(tile.shape):
        ok = all(
            (isinstance(c, slice) and c == slice(None))
            or (isinstance(c, Lanes) and c.start.static and c.start.off == 0 and c.n == n)
            for c, n in zip(comps, tile.shape)
        )
    if not ok:
        raise error(
            f"{op}: a shared tile is accessed whole, not at {idx!r}",
            "load it whole and select with ts.tile.where, or allocate one tile per part",
        )


def load(ref: Any, idx: Any = None, mask: Any = None, other: Any = 0) -> jax.Array:
    """The window ``ref[idx]`` as a tile; lanes where ``mask`` is False (or outside the
    array) read ``other``.

    ``idx``: an int, a slice ``start:start + SIZE`` (SIZE a power of two), a thread-id
    vector (``ts.launch.thread_id()`` plus an int), or a tuple of those for an N-D array.
    """
    target, idx = _target(ref, idx, "ts.tile.load")
    if isinstance(target, SharedTile):
        _whole(target, idx, "ts.tile.load")
        v = target.value
        return v if mask is None else jnp.where(mask, v, jnp.asarray(other, v.dtype))
    acc = _Access(target, idx, "ts.tile.load")
    m = acc.combine(mask, "ts.tile.load", target.name)
    view = target.ref.at[acc.indexer] if acc.indexer else target.ref
    if m is None:
        return plgpu.load(view)
    return plgpu.load(view, mask=m, other=jnp.asarray(other, target.dtype))


def store(ref: Any, idx: Any, value: Any, mask: Any = None) -> None:
    """Writes ``value`` (broadcast, cast to the array's dtype) to the window ``ref[idx]``
    where ``mask`` is True and inside the array."""
    target, idx = _target(ref, idx, "ts.tile.store")
    value = jnp.asarray(value)
    if isinstance(target, SharedTile):
        _whole(target, idx, "ts.tile.store")
        new = _fit(value, target.shape, target.dtype, "ts.tile.store", "shared tile")
        target.value = new if mask is None else jnp.where(mask, new, target.value)
        return
    ctx = current()
    if not target.mut:
        raise error(
            f"ts.tile.store: {target.name!r} is an input, not a ts.mut parameter",
            f"annotate it `{target.name}: ts.mut` to make it an output of the kernel",
            TypeError,
        )
    acc = _Access(target, idx, "ts.tile.store")
    value = _fit(value, acc.shape, target.dtype, "ts.tile.store", target.name)
    m = acc.combine(mask, "ts.tile.store", target.name)
    ctx.stored.add(target.pos)
    view = target.ref.at[acc.indexer] if acc.indexer else target.ref
    if m is None:
        plgpu.store(view, value)
    else:
        plgpu.store(view, value, mask=m)


def _fit(value: Any, shape: tuple[int, ...], dtype: Any, op: str, name: str) -> jax.Array:
    try:
        return jnp.broadcast_to(value, shape).astype(dtype)
    except ValueError:
        raise error(
            f"{op}: a value of shape {tuple(value.shape)} does not fit the window {shape} of "
            f"{name!r}"
        ) from None


def load_vector(ref: Any, idx: Any = None, *, width: int, mask: Any = None, other: Any = 0):
    """``load`` of a window of ``width`` elements along the last axis (``ref[i]`` from a 2-D
    array, or a 1-D window); a power-of-two width lets the backend issue vector loads."""
    _check_pow2("ts.tile.load_vector", "width", width)
    target, idx = _target(ref, idx, "ts.tile.load_vector")
    idx = _vector_index(target, idx, width, "ts.tile.load_vector")
    return load(target, idx, mask=mask, other=other)


def store_vector(ref: Any, value: Any, idx: Any = None, *, mask: Any = None) -> None:
    """``store`` of a vector to a window along the last axis (the counterpart of
    ``load_vector``); a shared tile row takes it at ``smem[i]``."""
    target, idx = _target(ref, idx, "ts.tile.store_vector")
    value = jnp.asarray(value)
    if isinstance(target, SharedTile):
        raise error(
            "ts.tile.store_vector: a shared tile is written whole",
            "store the whole tile with ts.tile.store(smem, None, tile)",
        )
    idx = _vector_index(target, idx, value.shape[-1], "ts.tile.store_vector")
    store(target, idx, value, mask=mask)


def _vector_index(target: Any, idx: Any, width: int, op: str) -> Any:
    comps = () if idx is None else (idx if isinstance(idx, tuple) else (idx,))
    if len(comps) == target.ndim and isinstance(comps[-1], slice):
        return comps
    if len(comps) == target.ndim - 1:
        return (*comps, slice(0, width))
    if len(comps) == target.ndim and _is_scalar_index(comps[-1]):
        start = Idx.of(comps[-1])
        return (*comps[:-1], slice(start, start + width))
    raise error(f"{op}: index {idx!r} of {getattr(target, 'name', 'tile')!r}", "index a row")


# --- launch geometry ----------------------------------------------------------------------


def group_id(axis: int = 0) -> Idx:
    """This group's (program's) index along grid ``axis``."""
    ctx = current()
    if not isinstance(axis, int) or not 0 <= axis < len(ctx.grid):
        raise error(f"ts.tile.group_id: {axis=} must be an int in [0, {len(ctx.grid)})")
    return _bounded(pl.program_id(axis), 0, ctx.grid[axis] - 1)


def num_groups(axis: int = 0) -> int:
    """The number of groups along grid ``axis`` (a Python int)."""
    ctx = current()
    if not isinstance(axis, int) or not 0 <= axis < len(ctx.grid):
        raise error(f"ts.tile.num_groups: {axis=} must be an int in [0, {len(ctx.grid)})")
    return ctx.grid[axis]


def linear_id() -> Idx:
    """This group's index in the row-major flattened grid."""
    ctx = current()
    v = Idx.of(0)
    for axis, n in enumerate(ctx.grid):
        v = v * n + group_id(axis)
    return v


def group_size() -> int:
    """Lanes per group (the product of ``threads``)."""
    return math.prod(current().threads)


def local_id() -> Any:
    """The lane indices within the group: a :class:`Lanes` (a tuple of them for N-D threads)."""
    t = current().threads
    out = tuple(Lanes(0, n, d, len(t)) for d, n in enumerate(t))
    return out[0] if len(t) == 1 else out


def thread_id() -> Any:
    """The global element indices of this group's lanes, ``group_id·threads + lane`` per
    axis: a :class:`Lanes` (a tuple of them for N-D threads)."""
    ctx = current()
    if len(ctx.threads) > len(ctx.grid):
        raise error(
            f"ts.launch.thread_id: threads={ctx.threads} has more axes than blocks={ctx.grid}"
        )
    t = ctx.threads
    if len(t) == 1 and len(ctx.grid) > 1:
        return Lanes(linear_id() * t[0], t[0])
    out = tuple(Lanes(group_id(d) * n, n, d, len(t)) for d, n in enumerate(t))
    return out[0] if len(t) == 1 else out


def lane_id() -> jax.Array:
    """Each lane's index within its warp of 32 (a vector over the group's lanes)."""
    return jnp.arange(group_size(), dtype=jnp.int32) % WARP


def warp_id() -> Lanes:
    """The global indices of this group's warps: one entry per warp of 32 lanes."""
    w = _warps("ts.tile.warp_id")
    return Lanes(linear_id() * w, w)


def _warps(op: str) -> int:
    n = group_size()
    if n % WARP:
        raise error(f"{op}: the group has {n} lanes, not a whole number of warps of {WARP}")
    return n // WARP


def warp_shuffle_down(val: Any, offset: int) -> jax.Array:
    """Each lane reads lane ``lane + offset`` of its warp (CUDA's ``__shfl_down_sync``);
    lanes whose source is past the warp's end keep their own value."""
    val = jnp.asarray(val)
    w = _warps("ts.tile.warp_shuffle_down")
    if val.shape != (w * WARP,):
        raise error(f"ts.tile.warp_shuffle_down: val has shape {val.shape}, not ({w * WARP},)")
    if not isinstance(offset, int) or not 0 <= offset < WARP:
        raise error(f"ts.tile.warp_shuffle_down: {offset=} must be an int in [0, {WARP})")
    if offset == 0:
        return val
    lane = jnp.arange(WARP, dtype=jnp.int32)  # traced: a kernel captures no array constants
    source = jnp.broadcast_to(jnp.where(lane + offset < WARP, lane + offset, lane), (w, WARP))
    v = val.astype(jnp.int32) if val.dtype == jnp.bool_ else val
    moved = lane_gather(v.reshape(w, WARP), source, axis=1).reshape(val.shape)
    return moved.astype(val.dtype)


def lane_gather(x: jax.Array, idx: jax.Array, *, axis: int) -> jax.Array:
    """``jnp.take_along_axis(x, idx, axis)`` for indices within bounds: on the GPU one
    Triton ``tt.gather``, which is a warp shuffle per element when ``axis`` lies within a
    warp (a Triton tile has no other way to move values between lanes); elsewhere XLA's
    gather."""
    return _lane_gather_p.bind(x, idx, axis=axis)


def _lane_gather_impl(x, idx, *, axis):
    return jnp.take_along_axis(x, idx, axis=axis, mode="clip")


def _lane_gather_batching(args, dims, *, axis):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _compat.not_mapped)
    x, idx = (
        jnp.broadcast_to(a, (size, *a.shape)) if d is _compat.not_mapped else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims)
    )
    return lane_gather(x, idx, axis=axis + 1), 0


_lane_gather_p = _compat.Primitive("ts_tile_lane_gather")
_lane_gather_p.def_impl(_lane_gather_impl)
_lane_gather_p.def_abstract_eval(lambda x, idx, *, axis: jax.core.ShapedArray(idx.shape, x.dtype))
_compat.mlir.register_lowering(
    _lane_gather_p, _compat.mlir.lower_fun(_lane_gather_impl, multiple_results=False)
)
_compat.batching.primitive_batchers[_lane_gather_p] = _lane_gather_batching
_compat.register_triton_gather_lowering(_lane_gather_p)


def _to_bits(v: jax.Array, op: str) -> jax.Array:
    """``v``'s bit patterns as 32- or 64-bit integers, which a sum with zeros keeps exactly
    (NaN payloads and -0 too, which a float sum would not)."""
    if v.dtype == jnp.bool_:
        return v.astype(jnp.int32)
    if v.dtype.itemsize not in (1, 2, 4, 8) or jnp.issubdtype(v.dtype, jnp.complexfloating):
        raise error(
            f"{op}: val has dtype {v.dtype}; warp operations move booleans, integers and reals"
        )
    if v.dtype.itemsize == 8:
        return jax.lax.bitcast_convert_type(v, jnp.int64) if v.dtype != jnp.int64 else v
    ints = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}[v.dtype.itemsize]
    b = v if jnp.issubdtype(v.dtype, jnp.signedinteger) else v.view(ints)
    return b.astype(jnp.int32)


def _from_bits(b: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of ``_to_bits``."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return b != 0
    if dtype.itemsize == 8:
        return b if dtype == np.int64 else jax.lax.bitcast_convert_type(b, dtype)
    ints = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}[dtype.itemsize]
    b = b.astype(ints)
    return b if np.issubdtype(dtype, np.signedinteger) else b.view(dtype)


def warp_lane(val: Any, lane: int = 0) -> jax.Array:
    """Each warp's value at ``lane``: a vector with one entry per warp (what
    ``if lane_id() == lane: out[warp_id()] = val`` stores)."""
    val = jnp.asarray(val)
    w = _warps("ts.tile.warp_lane")
    if val.shape != (w * WARP,):
        raise error(f"ts.tile.warp_lane: val has shape {val.shape}, not ({w * WARP},)")
    if not isinstance(lane, int) or not 0 <= lane < WARP:
        raise error(f"ts.tile.warp_lane: {lane=} must be an int in [0, {WARP})")
    # A sum of one lane's bits and zeros: a warp reduction, exact for every value.
    v = _to_bits(val, "ts.tile.warp_lane").reshape(w, WARP)
    picked = jnp.where((jnp.arange(WARP) == lane)[None, :], v, jnp.zeros((), v.dtype))
    return _from_bits(jnp.sum(picked, axis=1, dtype=v.dtype), val.dtype)


@dataclasses.dataclass(frozen=True)
class CooperativeGroup:
    """``size`` consecutive lanes of a group that synchronise together."""

    size: int

    def sync(self) -> None:
        """Orders the group's memory operations (a no-op on whole-tile operations)."""
        barrier()

    def thread_rank(self) -> jax.Array:
        """Each lane's rank within its cooperative group."""
        return jnp.arange(group_size(), dtype=jnp.int32) % self.size


def cooperative_group(size: int) -> CooperativeGroup:
    """Cooperative groups of ``size`` lanes (a power of two dividing the group size)."""
    _check_pow2("ts.tile.cooperative_group", "size", size)
    if group_size() % size:
        raise error(f"ts.tile.cooperative_group: {size=} does not divide {group_size()} lanes")
    return CooperativeGroup(size)


def barrier() -> None:
    """Synchronises the group. Every tile operation already acts on all lanes at once and
    the backend inserts the barriers its own shared-memory traffic needs, so this fixes
    only program order."""
    current()


# --- memory hierarchy ---------------------------------------------------------------------

_SWIZZLES = (None, "xor")


def alloc_shared(
    shape: Sequence[int],
    dtype: Any = jnp.float32,
    *,
    swizzle: str | None = None,
    alignment: int = 16,
) -> SharedTile:
    """A group-local tile of ``shape`` (powers of two), zero-filled.

    ``swizzle``: ``None`` or ``"xor"``: Triton lays dot operands out in XOR-swizzled shared
    memory itself, which is the only layout it offers. ``alignment`` (bytes, a power of
    two): the tile's rows must be a multiple of it, so that copies into it are full vectors.
    """
    ctx = current()
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    for d, n in enumerate(shape):
        _check_pow2("ts.tile.alloc_shared", f"shape[{d}]", n)
    dt = as_np_dtype(dtype)
    if swizzle not in _SWIZZLES:
        raise error(f"ts.tile.alloc_shared: {swizzle=!r} must be one of {_SWIZZLES}")
    _check_pow2("ts.tile.alloc_shared", "alignment", alignment)
    row = shape[-1] * dt.itemsize
    if row % alignment:
        raise error(
            f"ts.tile.alloc_shared: rows of {row} bytes are not a multiple of {alignment=}",
            "widen the tile's last dimension or lower the alignment",
        )
    tile = SharedTile(shape, dt, swizzle, alignment)
    ctx.shared.append(tile)
    ctx.shared_bytes += math.prod(shape) * dt.itemsize
    return tile


def alloc_register(dtype: Any = jnp.float32, shape: Sequence[int] = ()) -> jax.Array:
    """A zero-filled register tile (a scalar by default)."""
    return jnp.zeros(tuple(shape), as_np_dtype(dtype))


def cp_async(dst: SharedTile, src: Any) -> SharedTile:
    """Copies the window ``src`` (``A[m:m + BM, k:k + BK]``) into the shared tile ``dst``;
    elements outside ``A`` read 0. A copy from an input is deferred to where ``dst`` is read
    (module docstring), one from a ``ts.mut`` array is made at once; the backend makes the
    loads asynchronous when it pipelines the enclosing ``ts.tile.range`` loop. The result is
    the same either way."""
    if not isinstance(dst, SharedTile):
        raise error(
            f"ts.tile.cp_async: dst is a {type(dst).__name__}",
            "copy into a tile from ts.tile.alloc_shared",
            TypeError,
        )
    if not isinstance(src, (RefView, TileRef)):
        raise error(
            f"ts.tile.cp_async: src is a {type(src).__name__}",
            "pass a window of a kernel argument, e.g. A[m:m + BM, k:k + BK]",
            TypeError,
        )
    tref, idx = (src.tref, src.idx) if isinstance(src, RefView) else (src, None)
    shape = _Access(tref, idx, "ts.tile.cp_async").shape
    if tuple(shape) != dst.shape:
        raise error(f"ts.tile.cp_async: the source window {tuple(shape)} is not dst's {dst.shape}")
    if tref.mut:  # the kernel may store to it before the tile is read: copy now
        dst.fill(load(tref, idx).astype(dst.dtype))
    else:
        dst.fill(Copy(tref, _window_dims(tref, idx), dst.dtype))
    return dst


def _window_dims(tref: TileRef, idx: Any) -> tuple[tuple[Idx, int, bool], ...]:
    """``idx`` (checked by ``_Access``) as ``(start, size, window)`` per dimension."""
    comps = () if idx is None or idx is Ellipsis else (idx if isinstance(idx, tuple) else (idx,))
    comps = comps + (slice(None),) * (tref.ndim - len(comps))
    dims = []
    for c, n in zip(comps, tref.shape):
        if _is_scalar_index(c):
            dims.append((Idx.of(c), 1, False))
        elif isinstance(c, Lanes):
            dims.append((c.start, c.n, True))
        else:
            start = Idx.of(0 if c.start is None else c.start)
            stop = Idx.of(n if c.stop is None else c.stop)
            dims.append((start, (stop - start).off, True))
    return tuple(dims)


def cp_commit_group() -> None:
    """Closes a group of ``cp_async`` copies (program order; see ``cp_async``)."""
    current()


def cp_wait_group(n: int = 0) -> None:
    """Waits until at most ``n`` committed copy groups are in flight (copies complete in
    program order here, so this holds on return)."""
    if not isinstance(n, int) or n < 0:
        raise error(f"ts.tile.cp_wait_group: {n=} must be an int >= 0")
    current()


# --- loops --------------------------------------------------------------------------------


class TileRange:
    """``ts.tile.range(start, stop, step, prefetch=)``: a loop the kernel's compiler turns
    into one ``scf.for`` (software-pipelined ``prefetch + 1`` stages deep on the GPU)."""

    def __init__(self, start: Any, stop: Any = None, step: int = 1, *, prefetch: int | None = None):
        if stop is None:
            start, stop = 0, start
        if isinstance(start, TileRef) or isinstance(stop, TileRef):
            raise error(
                "ts.tile.range: bounds are integers, not arrays",
                "write ts.tile.range(0, X.shape[0], step)",
                TypeError,
            )
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise error(f"ts.tile.range: {step=!r} must be a positive Python int")
        if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 0):
            raise error(f"ts.tile.range: {prefetch=!r} must be an int >= 0")
        try:
            self.start, self.stop = Idx.of(start), Idx.of(stop)
        except TypeError:
            raise error(
                f"ts.tile.range: bounds ({start!r}, {stop!r}) must be integers", exc=TypeError
            ) from None
        self.step, self.prefetch = step, prefetch
        if prefetch is not None:
            ctx = current()
            ctx.prefetch = _builtin_max(ctx.prefetch, prefetch)

    def __iter__(self):
        raise error(
            "ts.tile.range used outside a `for` statement of a kernel body",
            "write `for k in ts.tile.range(...)` directly in the @ts.kernel function",
            TypeError,
        )


range = TileRange


# --- math on tiles ------------------------------------------------------------------------


def _arr(x: Any) -> jax.Array:
    return jnp.asarray(x)


def dot(a: Any, b: Any, acc: Any = None) -> jax.Array:
    """``a @ b`` on the tensor cores, accumulated in f32 (int32 for integer inputs), plus
    ``acc`` when given. Both operands are 2-D tiles with every extent ≥ 16."""
    a, b = _arr(a), _arr(b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise error(f"ts.tile.dot: shapes {a.shape} @ {b.shape} are not (M, K) @ (K, N)")
    small = [n for n in (*a.shape, b.shape[1]) if n < MIN_DOT]
    if small:
        raise error(
            f"ts.tile.dot: {a.shape} @ {b.shape} has an extent below {MIN_DOT}",
            f"tensor-core dots take tiles of at least {MIN_DOT} in every dimension; use a "
            "larger tile, or multiply and ts.tile.reduce_sum",
        )
    ctx = current()
    ctx.dot_bytes = _builtin_max(
        ctx.dot_bytes, a.size * a.dtype.itemsize + b.size * b.dtype.itemsize
    )
    out = jnp.int32 if jnp.issubdtype(a.dtype, jnp.integer) else jnp.float32
    if a.dtype != b.dtype:
        common = jnp.promote_types(a.dtype, b.dtype)
        a, b = a.astype(common), b.astype(common)
    r = jnp.dot(a, b, preferred_element_type=out)
    return r if acc is None else _arr(acc) + r


def mma(a: Any, b: Any, acc: Any = None) -> jax.Array:
    """The tensor-core multiply-accumulate ``acc + a @ b`` (see ``dot``)."""
    return dot(a, b, acc)


def softmax(x: Any, axis: int = -1) -> jax.Array:
    """The softmax over ``axis``, computed in f32 with the maximum subtracted."""
    x = _arr(x).astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / jnp.sum(e, axis=axis, keepdims=True)


def relu(x: Any) -> jax.Array:
    x = _arr(x)
    return jnp.maximum(x, jnp.zeros((), x.dtype))


def exp(x: Any) -> jax.Array:
    return jnp.exp(_arr(x))


def max(x: Any, axis: int | None = None, keepdims: bool = False) -> jax.Array:
    return jnp.max(_arr(x), axis=axis, keepdims=keepdims)


def maximum(x: Any, y: Any) -> jax.Array:
    return jnp.maximum(_arr(x), _arr(y))


def reduce_sum(x: Any, axis: int | None = None, keepdims: bool = False) -> jax.Array:
    """The sum over ``axis`` (all axes by default); f16/bf16 tiles are summed in f32."""
    x = _arr(x)
    if x.dtype in (jnp.float16, jnp.bfloat16):
        x = x.astype(jnp.float32)
    return jnp.sum(x, axis=axis, keepdims=keepdims)


def where(cond: Any, x: Any, y: Any) -> jax.Array:
    """Per-lane select: the tile-level replacement for an ``if`` on a tile value."""
    return jnp.where(_arr(cond), _arr(x), _arr(y))


def zeros(shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    return jnp.zeros(tuple(shape), as_np_dtype(dtype))


def full(shape: Sequence[int], value: Any, dtype: Any = jnp.float32) -> jax.Array:
    return jnp.full(tuple(shape), value, as_np_dtype(dtype))
