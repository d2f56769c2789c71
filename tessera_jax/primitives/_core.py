"""How a Tessera operator is defined: one JAX primitive, its reference, its kernels.

An :class:`Operator` owns a ``jax.extend.core.Primitive`` named ``ts_<name>``
(the name rewrite passes match in a jaxpr) and registers, in one place:

* eager application (jit-compiles the single primitive, like ``jax.lax`` ops);
* abstract evaluation;
* one lowering rule for every platform. At lowering time it consults the
  ``TESSERA_KERNELS`` mode (part of the jit key) and the operator's kernels,
  in order, and lowers the first kernel that supports the case; otherwise the
  reference implementation (jax.numpy / lax). See :meth:`Operator.select`.

The operator module then adds its JVP/transpose and batching rules with the
plain jax registries (``_compat.ad`` / ``_compat.batching``), next to the rest
of the operator.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tessera_jax import _compat
from tessera_jax._config import get_kernel_mode

ad = _compat.ad
batching = _compat.batching
mlir = _compat.mlir
not_mapped = _compat.not_mapped
zero_tangent = _compat.zero_tangent

# Every operator, by name: rewrite passes and docs enumerate the graph vocabulary.
OPERATORS: dict[str, Operator] = {}

# Sharding rules, by operator name (registered by tessera_jax/sharding/rules.py). Under
# XLA's SPMD partitioner (jit over several devices), ``rule(op, impl_name, fn, platform,
# avals_in, params)`` returns what to lower instead of ``fn`` (a custom_partitioning
# wrapper running ``fn`` on local shards), or None to lower ``fn`` as it is.
SHARDING_RULES: dict[str, Callable[..., Any]] = {}


# The graph capture in force on this thread: ``CAPTURE.recorder(op, args, params)`` is set
# by ``ts.graph.capture`` (tessera_jax/graph/capture.py, which imports this module) for the
# duration of its block; an eager bind then goes through it, to be recorded and run.
class _Capture(threading.local):
    recorder: Callable[..., Any] | None = None  # a class default: no lookup miss per bind


CAPTURE = _Capture()


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel implementation of an operator (or of a collective).

    Every kernel speaks the same vocabulary, whatever its operator:

    Attributes:
      name: shown in errors and benchmark records.
      fn: ``fn(spec, *operands, interpret: bool)`` returning what the reference
        returns. ``spec`` is the operator's frozen spec (its static parameters, decoded
        once by the operator); kernels never see raw bind parameters. Called inside the
        lowering, so it may call ``pallas_call``.
      supports: ``supports(spec, avals) -> str | None``: None if the kernel can run the
        case, else the reason it cannot (shown to the user when nothing can run an
        explicit request).
      prefer: in ``auto`` mode, ``prefer(spec, avals) -> bool`` says whether the kernel
        is expected to beat XLA for this case (the dispatch heuristic; an autotune cache
        plugs in here). ``None`` means always.
      platforms: platforms the compiled (non-interpret) kernel runs on.
      hardware: ``hardware(platform) -> str | None``: None if this machine's devices of
        ``platform`` can run the compiled kernel, else why not (e.g. not a Hopper GPU).
        Not asked in interpret mode.
      interpretable: whether an interpreter can run the kernel (``TESSERA_KERNELS=
        interpret``); False for kernels built on what no interpreter emulates.
      missing: why this process cannot build the kernel in any mode (its module's
        ``MISSING``: a jax without the Pallas backend it is written in), or None.
    """

    name: str
    fn: Callable[..., Any]
    supports: Callable[[Any, Sequence[Any]], str | None]
    prefer: Callable[[Any, Sequence[Any]], bool] | None = None
    platforms: tuple[str, ...] = ("cuda",)
    hardware: Callable[[str], str | None] | None = None
    interpretable: bool = True
    missing: str | None = None

    @classmethod
    def from_module(
        cls,
        name: str,
        module: Any,
        fn: Callable[..., Any],
        prefer: Callable[[Any, Sequence[Any]], bool] | None = None,
    ) -> Kernel:
        """The record of a kernel module that offers the vocabulary by name (``supports``,
        ``prefer``, ``hardware``, optionally ``PLATFORMS``, ``INTERPRETABLE`` and
        ``MISSING``);
        ``prefer`` replaces the module's where one module holds kernels measured apart."""
        return cls(
            name=name,
            fn=fn,
            supports=module.supports,
            prefer=prefer or module.prefer,
            platforms=getattr(module, "PLATFORMS", ("cuda",)),
            hardware=module.hardware,
            interpretable=getattr(module, "INTERPRETABLE", True),
            missing=getattr(module, "MISSING", None),
        )

    def unavailable(self, mode: str, platform: str | None) -> str | None:
        """Why the kernel cannot be lowered in ``mode`` for ``platform`` (None if it can),
        before looking at the case itself."""
        if self.missing is not None:
            return self.missing
        if mode == "interpret":
            return None if self.interpretable else "no interpreter runs it"
        if platform not in self.platforms:
            return f"runs on {'/'.join(self.platforms)}, not {platform}"
        if self.hardware is not None:
            return self.hardware(platform)
        return None


class Operator:
    """A Tessera operator: a primitive with a reference lowering and kernels."""

    def __init__(
        self,
        name: str,
        *,
        reference: Callable[..., Any],
        abstract_eval: Callable[..., Any],
        multiple_results: bool = False,
        spec: Callable[[dict[str, Any]], Any] | None = None,
    ):
        if name in OPERATORS:
            raise ValueError(f"operator {name!r} is already defined")
        self.name = name
        self.reference = reference
        # The operator's frozen spec from its bind parameters (what kernels receive).
        self.spec = spec if spec is not None else _params_spec
        self.kernels: list[Kernel] = []
        self.prim = _compat.Primitive(f"ts_{name}")
        self.prim.multiple_results = multiple_results
        self.prim.def_impl(functools.partial(_compat.apply_primitive, self.prim))
        self._abstract_eval = abstract_eval
        self.prim.def_abstract_eval(self._typed_abstract_eval)
        mlir.register_lowering(self.prim, self._lower)
        OPERATORS[name] = self

    def __repr__(self) -> str:
        return f"Operator({self.name!r})"

    def bind(self, *args: Any, **params: Any) -> Any:
        if _compat.vma_checking():  # inside shard_map: operands agree on their varying axes
            args = _compat.match_vma(args)
        elif _compat.is_eager():
            recorder = CAPTURE.recorder
            if recorder is not None:  # inside ``ts.graph.capture``: recorded, then run
                return recorder(self, args, params)
            return self.bind_eager(args, params)
        return self.prim.bind(*args, **params)

    def bind_eager(self, args: Sequence[Any], params: dict[str, Any]) -> Any:
        """Applies the operator to concrete arrays outside any trace.

        A jitted bind per parameter set takes jax's C++ dispatch path instead of the Python
        one that evaluating a primitive goes through (a notebook calling operators one by
        one pays only that).
        """
        fn = self._eager(_frozen(params))
        if fn is not None:
            return fn(*args)
        return self.prim.bind(*args, **params)

    @functools.lru_cache(maxsize=512)  # noqa: B019 (operators live as long as the process)
    def _eager(self, frozen: tuple | None) -> Callable[..., Any] | None:
        if frozen is None:
            return None
        params = dict(frozen)
        return jax.jit(lambda *args: self.prim.bind(*args, **params))

    def add_kernel(self, kernel: Kernel) -> Kernel:
        self.kernels.append(kernel)
        return kernel

    def select(self, platform: str | None, avals_in: Sequence[Any], params: dict[str, Any]):
        """The implementation the lowering uses: ``(name, fn)``.

        ``xla`` mode, or a lowering for several platforms at once, takes the
        reference. ``interpret`` takes the first supporting interpretable kernel, run
        in an interpreter on any platform; ``pallas`` the first supporting kernel
        compiled for this platform and hardware; ``auto`` additionally requires the
        kernel's ``prefer``. ``fn`` takes the operands and the bind parameters, as the
        reference does. (Where ``pallas`` mode would run the reference for a spec that
        explicitly requests a ``tile_shape``, the lowering raises instead: see
        :meth:`_check_request_honoured`.)
        """
        mode = get_kernel_mode()
        if mode != "xla" and platform is not None and self.kernels:
            spec = self.spec(params)
            for k in self.kernels:
                if k.unavailable(mode, platform) is not None:
                    continue
                if k.supports(spec, avals_in) is not None:
                    continue
                if mode == "auto" and k.prefer is not None and not k.prefer(spec, avals_in):
                    continue
                return k.name, _kernel_call(k, spec, interpret=mode == "interpret")
        return "reference", self.reference

    def apply(self, platform: str | None, *args: Any, **params: Any) -> Any:
        """The operator on ``args`` by the implementation :meth:`select` picks for them in
        the kernel mode in force, traced now rather than bound (whose lowering would pick
        later, perhaps where that mode no longer holds: a sharding rule's partitioner)."""
        _, fn = self.select(platform, [jax.typeof(a) for a in args], params)
        return fn(*args, **params)

    def reasons(self, platform: str | None, avals_in: Sequence[Any], params: dict[str, Any]):
        """``{kernel name: why it cannot run this case}`` in the kernel mode in force."""
        mode = get_kernel_mode()
        spec = self.spec(params)
        out = {}
        for k in self.kernels:
            why = k.unavailable(mode, platform) or k.supports(spec, avals_in)
            if why is not None:
                out[k.name] = why
        return out

    def _typed_abstract_eval(self, *avals: Any, **params: Any) -> Any:
        """The operator's abstract eval, with the types jax's own operations would give.

        On a mesh with Explicit axes (jax's sharding in types), the outputs carry the
        sharding that the reference (jax.numpy / lax: the operator's jnp counterpart)
        gives for the same operands, so ``ts.sum`` drops a reduced dimension's axis as
        ``jnp.sum`` does and ``ts.matmul`` is typed like ``jnp.dot``. Inside
        ``shard_map`` the outputs vary over the mesh axes their operands vary over.
        """
        if not any(_has_explicit_axes(a) for a in avals):
            return _with_operands_vma(self._abstract_eval(*avals, **params), avals)
        # Shapes and dtypes from the operator's rule (over unsharded operands, so that a
        # rule may change ranks), shardings from the reference.
        out = self._abstract_eval(*map(_unsharded, avals), **params)
        ref = jax.eval_shape(functools.partial(self.reference, **params), *avals)
        if self.prim.multiple_results:
            out = type(out)(o.update(sharding=r.sharding) for o, r in zip(out, ref))
        else:
            out = out.update(sharding=ref.sharding)
        return _with_operands_vma(out, avals)

    def _check_request_honoured(
        self, platform: str | None, avals_in: Sequence[Any], params: dict[str, Any]
    ) -> None:
        """In ``pallas`` mode, a ValueError if the spec explicitly asks for a kernel tile
        (``spec.tile_shape``) that no kernel can run here, naming each kernel's reason.

        Without an explicit request, ``pallas`` mode runs the reference where no kernel
        supports the case; a requested tile the reference would silently ignore is an
        error instead, raised once, after every kernel has declined.
        """
        tile = getattr(self.spec(params), "tile_shape", None)
        if tile is None or not self.kernels:
            return
        why = "; ".join(f"{k}: {r}" for k, r in self.reasons(platform, avals_in, params).items())
        raise ValueError(
            f"{self.name}: tile_shape={tile} was requested with TESSERA_KERNELS=pallas, but no "
            f"kernel can run this case on {platform or 'several platforms'} ({why})"
        )

    def _lower(self, ctx, *args, **params):
        platforms = tuple(ctx.module_context.platforms)
        platform = platforms[0] if len(platforms) == 1 else None
        impl, fn = self.select(platform, ctx.avals_in, params)
        if impl == "reference" and get_kernel_mode() == "pallas":
            self._check_request_honoured(platform, ctx.avals_in, params)
        rule = SHARDING_RULES.get(self.name)
        if rule is not None and _compat.lowering_is_partitioned(ctx):
            fn = rule(self, impl, fn, platform, ctx.avals_in, params) or fn
        # Implementations are traced vma-free (a kernel inside shard_map need not know
        # which mesh axes its operands vary over) and without sharding in types: where the
        # operands are sharded, the partitioner (or the sharding rule) distributes the
        # implementation, which must not carry sharding constraints of its own.
        # The primitive's name on the name stack labels every HLO op of its lowering
        # (``metadata.op_name``): how ``ts.profile`` attributes device time to operators.
        ctx = _compat.lowering_named(ctx, self.prim.name)
        ctx = ctx.replace(
            avals_in=[_unsharded(a) for a in ctx.avals_in],
            avals_out=[_unsharded(a) for a in ctx.avals_out],
        )
        with _compat.lowering_without_vma(ctx) as ctx:
            lowered = mlir.lower_fun(fn, multiple_results=self.prim.multiple_results)
            return lowered(ctx, *args, **params)


def _frozen(params: dict[str, Any]) -> tuple | None:
    """``params`` as a hashable key, or None if a value is not hashable."""
    frozen = tuple(sorted(params.items()))
    try:
        hash(frozen)
    except TypeError:
        return None
    return frozen


def _params_spec(params: dict[str, Any]) -> Any:
    """The spec of an operator bound with ``spec=``; else its parameters, frozen."""
    if "spec" in params:
        return params["spec"]
    return tuple(sorted(params.items()))


def _kernel_call(kernel: Kernel, spec: Any, *, interpret: bool) -> Callable[..., Any]:
    """``kernel.fn`` in the reference's calling convention (operands, bind parameters)."""

    def call(*operands: Any, **params: Any) -> Any:
        del params  # the kernel reads the spec decoded from them
        return kernel.fn(spec, *operands, interpret=interpret)

    return call


def _has_explicit_axes(aval: Any) -> bool:
    """Whether ``aval`` is typed by a mesh with Explicit axes (sharding in types)."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def explicit_sharding(aval: Any) -> Any:
    """``aval``'s sharding if typed by a mesh with Explicit axes, else None: what to pass
    as ``out_sharding`` to a jax.numpy call building a value of ``aval``'s type."""
    return aval.sharding if _has_explicit_axes(aval) else None


def explicit_spec(x: jax.Array) -> tuple[Any, ...] | None:
    """``x``'s PartitionSpec entries, one per dim, on a mesh with Explicit axes; None
    elsewhere."""
    aval = jax.typeof(x)
    if not _has_explicit_axes(aval):
        return None
    spec = tuple(aval.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def unshard_axes(x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """``x`` with ``axes`` not sharded over Explicit mesh axes (gathered if they were).

    A reference that slices or reorders along ``axes`` (the canonical tree) calls this
    first: on a mesh with Explicit axes jax refuses such slices of a sharded dimension.
    Elsewhere it returns ``x`` unchanged (under Auto axes the partitioner, or the
    operator's sharding rule, decides).
    """
    spec = explicit_spec(x)
    if spec is None or all(spec[a] is None for a in axes):
        return x
    return reshard_spec(x, [None if d in axes else s for d, s in enumerate(spec)])


def reshard_spec(x: jax.Array, spec: Sequence[Any], like: jax.Array | None = None) -> jax.Array:
    """``x`` resharded to the PartitionSpec entries ``spec`` on the mesh that types ``like``
    (default ``x``), a mesh with Explicit axes; unchanged where it has them already."""
    if explicit_spec(x) == tuple(spec):
        return x
    sharding = jax.typeof(x if like is None else like).sharding
    return jax.sharding.reshard(x, sharding.update(spec=jax.sharding.PartitionSpec(*spec)))


def _unsharded(aval: Any) -> Any:
    if not _has_explicit_axes(aval):
        return aval
    return jax.core.ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _with_operands_vma(out: Any, avals: Sequence[Any]) -> Any:
    """``out`` typed as varying over the mesh axes its operands vary over (inside
    shard_map; a no-op elsewhere)."""
    if not _compat.vma_checking():
        return out
    vmas = [_compat.varying_axes_of_aval(a) for a in avals]
    vma = frozenset().union(*vmas)
    if not vma:
        return out
    like = next(a for a, v in zip(avals, vmas) if v)
    if isinstance(out, (tuple, list)):
        return type(out)(_compat.with_varying(o, vma, like) for o in out)
    return _compat.with_varying(out, vma, like)


# --- helpers shared by operator modules -------------------------------------------------


def move_bdim_to_front(x: jax.Array, bdim: int | None, size: int) -> jax.Array:
    """``x`` with its vmapped dimension first, broadcasting an unbatched operand."""
    if bdim is not_mapped:
        return jax.numpy.broadcast_to(x, (size, *x.shape))
    return jax.numpy.moveaxis(x, bdim, 0)


def normalize_axis(op: str, arg: str, axis: Any, ndim: int) -> int:
    """``axis`` as a non-negative int, or an error naming the operator and argument."""
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(
            f"{op}: {arg}={axis!r} must be an int (a static Python int in "
            f"[-{ndim}, {ndim}); got {type(axis).__name__})"
        )
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: {arg}={axis} is out of range for an array of rank {ndim}")
    return int(axis) % ndim


def normalize_axes(op: str, axis: Any, ndim: int, arg: str = "axis") -> tuple[int, ...]:
    """``axis`` (None = all, an int, or a sequence) as a sorted tuple of distinct axes."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool):
        axis = (axis,)
    elif not isinstance(axis, (tuple, list)):
        raise TypeError(
            f"{op}: {arg}={axis!r} must be None, an int or a tuple of ints "
            f"(got {type(axis).__name__})"
        )
    axes = tuple(normalize_axis(op, arg, a, ndim) for a in axis)
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: {arg}={tuple(axis)} repeats an axis")
    return tuple(sorted(axes))


def check_dtype(op: str, arg: str, x: Any, kinds: Sequence[Any]) -> None:
    """TypeError unless ``x.dtype`` is a subtype of one of ``kinds`` (jnp.floating, …)."""
    dt = np.dtype(x.dtype)
    if not any(jax.numpy.issubdtype(dt, k) for k in kinds):
        names = ", ".join(getattr(k, "__name__", str(k)) for k in kinds)
        raise TypeError(f"{op}: {arg}.dtype={dt} is not supported; expected {names}")


def as_array(op: str, arg: str, x: Any) -> jax.Array:
    """``x`` as a jax array (Python scalars stay weakly typed); None, strings and other
    non-arrays are a TypeError naming the operator and the argument."""
    if isinstance(x, jax.Array):
        return x
    if hasattr(x, "__jax_array__"):
        return x.__jax_array__()
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"{op}: {arg}={x!r} must be an array")
    try:
        return jax.numpy.asarray(x)
    except (TypeError, ValueError) as e:  # an object, a ragged nested list
        raise TypeError(f"{op}: {arg} of type {type(x).__name__} is not an array: {e}") from None


def is_float(dtype: Any) -> bool:
    return bool(jax.numpy.issubdtype(np.dtype(dtype), jax.numpy.floating))


def compute_dtype(dtype: Any) -> np.dtype:
    """The dtype a reference computes in: f32 for 8- and 16-bit floats, else ``dtype``."""
    dtype = np.dtype(dtype)
    if is_float(dtype) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype
