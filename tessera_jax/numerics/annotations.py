"""``ts.Tensor["B", "D", policy]``: shape and numerics annotations that ``ts.jit`` checks.

An annotation names each dimension and the tensor's numerics::

    def mixed_precision_gemm(
        A: ts.Tensor["M", "K", ts.fp8_e4m3 @ ts.accum(ts.f32)],
        B: ts.Tensor["K", "N", ts.fp8_e4m3 @ ts.accum(ts.f32)],
    ) -> ts.Tensor["M", "N", ts.f32]: ...

Dimensions are names (``"K"``: every argument with a ``K`` must agree on its
size), ints (that exact size) or one ``...`` (any number of dimensions there).
The last item is the numerics: a ts dtype, a policy (``ts.bf16 @ ts.accum(ts.f32)``),
a ``@ts.precision_policy`` class or a numpy dtype; leave it out to accept any
dtype.

What ``ts.jit`` does with them at trace time (see :func:`check_arguments` and
:func:`finish_output`):

* each annotated argument must have the annotation's rank, its dtype must be
  the policy's storage dtype, and a dimension name has one size across all
  arguments (and the return value); a mismatch is a ``TypeError`` naming the
  function, the dimension, both arguments and the sizes;
* a ``QuantizedTensor`` is accepted for a parameter annotated with a policy:
  its stored values are checked;
* the body is traced under the widest ``ts.accum(...)`` of the argument
  policies (``tessera_jax.numerics.context.accumulation``), which operators such
  as matmul read as their default accumulation dtype;
* a return annotation fixes the output dtype (cast with ``ts.cast``, round to
  nearest) and its rank is checked.

Annotations written as strings (``from __future__ import annotations``) are
resolved in the function's module globals when the function is first traced.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from tessera_jax.numerics.dtypes import Accum, DType, Policy, as_tdtype
from tessera_jax.numerics.policy import QuantizedTensor
from tessera_jax.primitives.cast import cast

__all__ = ["Signature", "Tensor", "TensorSpec", "policy_accumulate", "policy_loss_scale"]


# --- policies ---------------------------------------------------------------------------


def _is_precision_policy(x: Any) -> bool:
    """A ``@ts.precision_policy`` class or instance: anything with a ts ``storage`` dtype."""
    return isinstance(getattr(x, "storage", None), DType)


def _numerics(x: Any) -> Any:
    """Validates the numerics item of an annotation (returned unchanged), or a TypeError."""
    if isinstance(x, (DType, Policy)) or _is_precision_policy(x):
        return x
    if x is None:  # np.dtype(None) would silently mean float64
        raise TypeError(
            "ts.Tensor: None is not a dtype; leave the numerics out to accept any dtype"
        )
    if isinstance(x, Accum):
        raise TypeError(
            f"ts.Tensor: {x!r} is not a dtype; attach it to a storage dtype: "
            "ts.bf16 @ ts.accum(...)"
        )
    try:
        np.dtype(x)
    except TypeError:
        raise TypeError(
            f"ts.Tensor: {x!r} is neither a dimension (str, int or ...) nor a dtype or policy"
        ) from None
    return x


def policy_accumulate(policy: Any) -> DType | None:
    """The ``ts.accum(...)`` dtype of a policy or precision-policy class (None: not set)."""
    acc = getattr(policy, "accumulate", None)
    return as_tdtype(acc) if acc is not None and not callable(acc) else None


def policy_loss_scale(policy: Any) -> float | None:
    """The ``ts.loss_scale(...)`` of a policy or precision-policy class (None: not set)."""
    s = getattr(policy, "loss_scale", None)
    return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else None


# --- the annotation ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What ``ts.Tensor[...]`` evaluates to: dimensions and numerics.

    Attributes:
      dims: names (str), sizes (int) and at most one ``...``.
      numerics: a ts dtype, a Policy, a precision-policy class, a numpy dtype,
        or None (any dtype).
    """

    dims: tuple[Any, ...]
    numerics: Any = None

    @property
    def storage(self) -> DType | None:
        """The ts dtype arrays annotated with this spec are stored in (None: any)."""
        return None if self.numerics is None else as_tdtype(self.numerics)

    @property
    def dtype(self) -> np.dtype | None:
        """The numpy dtype an annotated array has (None: any)."""
        storage = self.storage
        return None if storage is None else storage.container

    @property
    def accumulate(self) -> DType | None:
        return policy_accumulate(self.numerics)

    @property
    def loss_scale(self) -> float | None:
        return policy_loss_scale(self.numerics)

    @property
    def stochastic_round(self) -> bool:
        return bool(getattr(self.numerics, "stochastic_round", False) is True)

    @property
    def is_policy(self) -> bool:
        """Annotated with a Policy or a precision policy (not a bare dtype)."""
        return isinstance(self.numerics, Policy) or _is_precision_policy(self.numerics)

    @property
    def has_ellipsis(self) -> bool:
        return any(d is Ellipsis for d in self.dims)

    @property
    def rank(self) -> int:
        """The rank an annotated array has (with ``...``: the least rank)."""
        return len(self.dims) - self.has_ellipsis

    def rank_ok(self, ndim: int) -> bool:
        return ndim >= self.rank if self.has_ellipsis else ndim == self.rank

    def rank_text(self) -> str:
        return f"at least {self.rank}" if self.has_ellipsis else str(self.rank)

    def axes(self, ndim: int) -> list[tuple[int, Any]]:
        """``(axis, dim)`` for every named or sized dimension of a rank-``ndim`` array."""
        if not self.has_ellipsis:
            return list(enumerate(self.dims))
        cut = self.dims.index(Ellipsis)
        head, tail = self.dims[:cut], self.dims[cut + 1 :]
        return list(enumerate(head)) + [(ndim - len(tail) + i, d) for i, d in enumerate(tail)]

    def __repr__(self) -> str:
        items = ["..." if d is Ellipsis else repr(d) for d in self.dims]
        if self.numerics is not None:
            n = self.numerics
            items.append(n.__name__ if isinstance(n, type) else repr(n))
        return f"ts.Tensor[{', '.join(items)}]"


class Tensor:
    """``ts.Tensor["M", "K", ts.bf16 @ ts.accum(ts.f32)]``: an annotation, never an array.

    Subscripting returns a :class:`TensorSpec`; see this module's docstring for what
    ``ts.jit`` checks.
    """

    def __new__(cls, *args, **kwargs):
        raise TypeError(
            "ts.Tensor is an annotation (ts.Tensor['B', 'D', ts.bf16]); "
            "create arrays with jax.numpy"
        )

    def __class_getitem__(cls, items: Any) -> TensorSpec:
        items = items if isinstance(items, tuple) else (items,)
        numerics = None
        if items and not _is_dim(items[-1]):
            numerics = _numerics(items[-1])
            items = items[:-1]
        for d in items:
            if not _is_dim(d):
                raise TypeError(
                    f"ts.Tensor: {d!r} must be a dimension name (str), a size (int) or ...; "
                    "only the last item may be a dtype or policy"
                )
            if isinstance(d, int) and d < 0:
                raise ValueError(f"ts.Tensor: dimension size {d} must be >= 0")
            if isinstance(d, str) and not d:
                raise ValueError("ts.Tensor: a dimension name must not be empty")
        if sum(d is Ellipsis for d in items) > 1:
            raise ValueError("ts.Tensor: at most one ... in an annotation")
        return TensorSpec(tuple(items), numerics)


def _is_dim(d: Any) -> bool:
    return d is Ellipsis or isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool))


# --- a function's annotations -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Signature:
    """The ``ts.Tensor`` annotations of one function, resolved."""

    name: str
    sig: inspect.Signature
    params: dict[str, TensorSpec]  # parameter name -> its annotation
    result: TensorSpec | None

    @property
    def empty(self) -> bool:
        return not self.params and self.result is None

    def accumulate(self) -> DType | None:
        """The widest ``ts.accum`` among the argument policies (None when none sets one)."""
        accs = [s.accumulate for s in self.params.values() if s.accumulate is not None]
        if not accs:
            return None
        widest = max(a.container.itemsize for a in accs)
        candidates = {a for a in accs if a.container.itemsize == widest}
        if len(candidates) > 1:  # e.g. f16 and bf16: neither holds the other
            return as_tdtype(np.float32)
        return candidates.pop()


def _resolve(annotation: Any, fn: Callable, fname: str, where: str) -> Any:
    """An annotation object; strings are evaluated in ``fn``'s module globals."""
    if not isinstance(annotation, str):
        return annotation
    glb = getattr(fn, "__globals__", {})
    try:
        return eval(annotation, dict(glb))
    except Exception as e:
        if "Tensor[" not in annotation:
            return None  # not ours; leave other (e.g. typing-only) annotations alone
        raise TypeError(
            f"{fname}: cannot resolve the annotation {annotation!r} of {where} in the module "
            f"globals ({type(e).__name__}: {e}); define the names it uses at module level"
        ) from None


def signature_of(f: Callable) -> Signature | None:
    """The resolved ``ts.Tensor`` annotations of ``f`` (follows ``__wrapped__``).

    None when ``f`` has no readable signature.
    """
    inner = inspect.unwrap(f)
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return None
    fname = getattr(inner, "__name__", None) or getattr(f, "__name__", type(f).__name__)
    params = {}
    for p in sig.parameters.values():
        if p.annotation is inspect.Parameter.empty:
            continue
        ann = _resolve(p.annotation, inner, fname, f"parameter {p.name!r}")
        if isinstance(ann, TensorSpec):
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"{fname}: ts.Tensor cannot annotate *{p.name} / **{p.name}")
            params[p.name] = ann
    result = None
    if sig.return_annotation is not inspect.Signature.empty:
        ann = _resolve(sig.return_annotation, inner, fname, "the return value")
        result = ann if isinstance(ann, TensorSpec) else None
    return Signature(fname, sig, params, result)


# --- trace-time checks ------------------------------------------------------------------


def _fmt_dtype(d: np.dtype, storage: DType | None = None) -> str:
    if storage is not None and storage.name != str(d):
        return f"{storage.name} ({d})"
    return str(d)


class _Dims:
    """Sizes bound to dimension names so far, with where each was first seen."""

    def __init__(self, fname: str):
        self.fname = fname
        self.seen: dict[str, tuple[int, str]] = {}

    def check(self, spec: TensorSpec, shape: tuple[int, ...], label: str) -> None:
        if not spec.rank_ok(len(shape)):
            raise TypeError(
                f"{self.fname}: {label} has rank {len(shape)} (shape {tuple(shape)}) but its "
                f"annotation {spec!r} has rank {spec.rank_text()}"
            )
        for axis, d in spec.axes(len(shape)):
            size, where = int(shape[axis]), f"{label}.shape[{axis}]"
            if isinstance(d, int) and size != d:
                raise TypeError(
                    f"{self.fname}: {where} is {size} but the annotation {spec!r} requires {d}"
                )
            if isinstance(d, str):
                if d in self.seen and self.seen[d][0] != size:
                    first, first_where = self.seen[d]
                    raise TypeError(
                        f'{self.fname}: dimension "{d}" is {first} in {first_where} but '
                        f"{size} in {where}"
                    )
                self.seen.setdefault(d, (size, where))


def _check_value(dims: _Dims, spec: TensorSpec, value: Any, label: str) -> None:
    # A QuantizedTensor's shape and dtype are those of its stored values.
    if isinstance(value, QuantizedTensor) and not spec.is_policy:
        raise TypeError(
            f"{dims.fname}: {label} is a QuantizedTensor but its annotation {spec!r} "
            "is not a policy"
        )
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(
            f"{dims.fname}: {label} is annotated {spec!r} but is a {type(value).__name__}, "
            "not an array"
        )
    dims.check(spec, tuple(value.shape), label)
    expected = spec.dtype
    if expected is not None and np.dtype(value.dtype) != expected:
        raise TypeError(
            f"{dims.fname}: {label} has dtype {np.dtype(value.dtype)} but its annotation "
            f"{spec!r} stores {_fmt_dtype(expected, spec.storage)}"
        )


def check_arguments(s: Signature, args: tuple, kwargs: dict) -> _Dims:
    """Checks every annotated argument (rank, named dimensions, dtype); TypeError if not.

    Returns the dimension sizes bound, for :func:`finish_output`.
    """
    dims = _Dims(s.name)
    if not s.params:
        return dims
    try:
        bound = s.sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"{s.name}: the arguments do not match its signature {s.sig}: {e}"
        ) from None
    for name, spec in s.params.items():
        if name in bound.arguments:
            _check_value(dims, spec, bound.arguments[name], name)
    return dims


def finish_output(s: Signature, dims: _Dims, out: Any) -> Any:
    """Casts the output to the return annotation's dtype and checks its shape."""
    spec = s.result
    if spec is None:
        return out
    if not (hasattr(out, "shape") and hasattr(out, "dtype")):
        raise TypeError(
            f"{s.name}: the return annotation is {spec!r} but the function returned a "
            f"{type(out).__name__}"
        )
    if spec.storage is not None and np.dtype(out.dtype) != spec.dtype:
        out = cast(out, spec.storage)
    dims.check(spec, tuple(out.shape), "return")
    return out
