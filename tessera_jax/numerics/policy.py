"""Quantizing precision policies: ``@ts.precision_policy``, ``ts.quantize``, ``ts.dequantize``.

A precision policy says how a tensor is stored and computed with::

    @ts.precision_policy
    class QuantizedPolicy:
        storage = ts.int8          # the stored values
        scale = ts.f32             # the dtype of the scale
        compute = ts.f32           # what dequantize returns (what matmul computes in)
        accumulate = ts.f32        # what products accumulate in

        def quantize(self, x):                 # -> (values, scale)
            scale = ts.max(ts.abs(x)) / 127.0
            return ts.round(x / scale).astype(ts.int8), scale

        def dequantize(self, x, scale):        # -> compute dtype
            return x.astype(ts.f32) * scale

``ts.quantize(x, QuantizedPolicy)`` returns a :class:`QuantizedTensor` (a pytree of the
values and the scale, with the policy as static data) and ``ts.dequantize(qt)`` maps it
back. A policy without ``quantize``/``dequantize`` gets the built-in per-tensor scaling.

Built-in per-tensor scaling, for a ts dtype or a ``Policy`` (``ts.fp8_e4m3``,
``ts.fp8_e4m3 @ ts.accum(ts.f32)``, ``ts.int8``, ``ts.fp6``):

* narrow formats (fp8 e4m3 / e5m2, fp6, int8): ``scale = amax(|x|) / fmax`` with
  ``fmax`` the format's largest finite value (448 for e4m3, 57344 for e5m2, 28 for fp6,
  127 for int8) and ``scale = 1`` for an all-zero ``x``; ``values = cast(x / scale)``,
  round to nearest even (stochastic with ``key=`` for a ``@ts.stochastic_round``
  policy), saturating at ``±fmax``. The relative error of an element is at most half an
  ulp of the format at ``|x|/scale`` (2⁻⁴ for e4m3, 2⁻³ for e5m2) above the format's
  subnormal range, and ``scale/2`` absolute for int8.
* wide floats (f16, bf16, f32, f64): ``scale = 1`` and ``values = cast(x)``.

Non-finite elements: the amax is taken over the finite elements, so a NaN or ±inf
leaves every other element as it would be without it. NaN stays NaN; ±inf stays ±inf
in formats with infinities (e5m2, wide floats) and saturates to ±fmax in those without
(e4m3, fp6). int8 holds neither: a tensor with a non-finite element gets a NaN scale
(its values are those of the finite scale), so ``dequantize`` gives NaN, never a
plausible finite tensor. An empty ``x`` has scale 1.

Derivatives: the scale is computed under ``stop_gradient`` and float rounding is
straight-through (``ts.cast``), so ``dequantize(quantize(x))`` has derivative 1 in ``x``
up to one thing JAX fixes: a tangent has its primal's dtype, so the tangent of fp8 values
is itself fp8 (``scale · ct`` rounded to the format, subnormal when the scale is small).
In a product on fp8 QuantizedTensors those fp8 cotangents are ``scale · (ct @ other)``
in value space: accurate to the format while they fit its range, NaN (e4m3) or inf (e5m2)
where they overflow it. Integer storage is not differentiable (zero gradient, as any
integer array in JAX).
Gradients with respect to the float operand of a product with a QuantizedTensor are exact.

``ts.matmul`` accepts QuantizedTensor operands: per-tensor scaled fp8 values are
multiplied in the fp8 path with the scales applied to the f32 accumulator; anything
else is dequantized to the policy's compute dtype first.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tessera_jax.numerics.checks import key_arg
from tessera_jax.numerics.dtypes import FP8_DTYPES, DType, Policy, as_tdtype, f32, f64
from tessera_jax.primitives._core import as_array, is_float
from tessera_jax.primitives.cast import cast

__all__ = [
    "PolicySpec",
    "QuantizedTensor",
    "ScaledPolicy",
    "dequantize",
    "precision_policy",
    "quantize",
]

_WIDE = (np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float64))


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """The normalized numerics of a policy.

    Attributes:
      storage: the ts dtype of the stored values.
      scale: the ts dtype of the scale.
      compute: the numpy dtype dequantize returns and products compute in.
      accumulate: the numpy dtype products accumulate in (None: the operator's default).
      linear_scale: dequantize is ``values · scale`` (the built-in scaling), so a
        per-tensor scale may be applied to a product's accumulator instead.
    """

    storage: DType
    scale: DType
    compute: np.dtype
    accumulate: np.dtype | None
    linear_scale: bool


def _format_max(storage: DType) -> float | None:
    """The largest finite value of a narrow format (None: a wide float, stored unscaled)."""
    grid = storage.grid
    if jnp.issubdtype(grid, jnp.integer):
        return float(np.iinfo(grid).max)
    if grid in _WIDE:
        return None
    return float(ml_dtypes.finfo(grid).max)


def _default_compute(storage: DType) -> DType:
    return f64 if storage.container == np.dtype(np.float64) else f32


@dataclasses.dataclass(frozen=True)
class ScaledPolicy:
    """The built-in per-tensor scaled quantization of a ts dtype or ``Policy``.

    Attributes as a ``@ts.precision_policy`` class has them (``storage``, ``scale``,
    ``compute``, ``accumulate``), plus ``stochastic_round`` (quantize needs a ``key``).
    """

    storage: DType
    scale: DType = f32
    compute: DType = f32
    accumulate: DType | None = None
    stochastic_round: bool = False

    def __post_init__(self):
        grid = self.storage.grid
        if not (is_float(grid) or jnp.issubdtype(grid, jnp.integer)):
            raise TypeError(
                f"quantize: storage={self.storage!r} must be a float or integer format "
                "(per-tensor scaling maps real values onto it)"
            )

    @property
    def dtype(self) -> np.dtype:
        return self.storage.container

    def quantize(self, x: jax.Array, key: jax.Array | None = None):
        """``(values, scale)``: per-tensor amax scaling onto the storage format."""
        xf = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
        fmax = _format_max(self.storage)
        if fmax is None:
            return cast(x, self.storage, key), jnp.ones((), self.scale.container)
        # The amax of the finite elements: a NaN or ±inf must not become the scale of
        # every other element (initial=0: an empty x has scale 1).
        finite = jnp.isfinite(xf)
        amax = jnp.max(jnp.where(finite, jnp.abs(xf), 0), initial=0)
        amax = jax.lax.stop_gradient(amax)
        scale = jnp.where(amax > 0, amax / fmax, jnp.ones_like(amax)).astype(self.scale.container)
        scaled = xf / scale.astype(xf.dtype)
        if not self.storage.is_float:
            # Integers hold neither NaN nor inf: a non-finite element makes the returned
            # scale NaN, so dequantize gives NaN rather than a plausible finite tensor.
            scale = jnp.where(jnp.all(finite), scale, jnp.asarray(jnp.nan, scale.dtype))
        # Saturate finite values (e4m3fn has no inf: NaN on overflow). With amax scaling
        # only rounding can push an element (the amax one, at ±fmax) over the edge, so the
        # clip is straight-through: a derivative of 1 for every element (jnp.clip would
        # give the amax element 0 or 1/2 depending on which way its scale rounded).
        # Non-finite elements pass to ts.cast, which keeps NaN and inf where the format
        # has them and saturates inf where it does not.
        step = jax.lax.stop_gradient(jnp.clip(scaled, -fmax, fmax) - scaled)
        scaled = jnp.where(finite, scaled + step, scaled)
        return cast(scaled, self.storage, key), scale

    def dequantize(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        c = self.compute.container
        return x.astype(c) * scale.astype(c)


def _spec_of_scaled(p: ScaledPolicy) -> PolicySpec:
    acc = None if p.accumulate is None else p.accumulate.container
    return PolicySpec(p.storage, p.scale, p.compute.container, acc, True)


def _scaled_from(storage: DType, accumulate: DType | None = None, stochastic: bool = False):
    return ScaledPolicy(
        storage=storage,
        compute=_default_compute(storage),
        accumulate=accumulate,
        stochastic_round=stochastic,
    )


def precision_policy(cls: type) -> type:
    """Class decorator declaring a precision policy (see the module docstring).

    The class attributes ``storage`` (required), ``scale`` (default ``ts.f32``),
    ``compute`` (default ``ts.f32``; ``ts.f64`` for f64 storage) and ``accumulate``
    (default: the operator's) are normalized to ts dtypes. ``quantize(self, x) ->
    (values, scale)`` and ``dequantize(self, x, scale)`` are the user's; a class that
    defines neither gets the built-in per-tensor scaling. The class gets ``dtype`` (the
    storage container), so ``np.dtype(Policy)`` and ``x.astype(Policy)`` work.
    """
    if not isinstance(cls, type):
        raise TypeError(f"precision_policy decorates a class, got {cls!r}")
    name = cls.__name__
    if getattr(cls, "storage", None) is None:
        raise TypeError(f"precision_policy {name}: define the class attribute storage = ts.<dtype>")

    def tdtype(attr, default):
        v = getattr(cls, attr, None)
        if v is None:
            return default
        try:
            return as_tdtype(v)
        except TypeError as e:
            raise TypeError(f"precision_policy {name}: {attr}={v!r}: {e}") from None

    storage = tdtype("storage", None)
    scale = tdtype("scale", f32)
    compute = tdtype("compute", _default_compute(storage))
    accumulate = tdtype("accumulate", None)
    if not scale.is_float or not compute.is_float:
        raise TypeError(
            f"precision_policy {name}: scale={scale!r} and compute={compute!r} must be floats"
        )
    has_q, has_dq = (
        callable(getattr(cls, "quantize", None)),
        callable(getattr(cls, "dequantize", None)),
    )
    if has_q != has_dq:
        raise TypeError(
            f"precision_policy {name}: define both quantize(self, x) and "
            "dequantize(self, x, scale), or neither (built-in per-tensor scaling)"
        )
    if not has_q:
        try:
            builtin = ScaledPolicy(storage, scale, compute, accumulate)
        except TypeError as e:
            raise TypeError(f"precision_policy {name}: {e}") from None
        cls.quantize = lambda self, x, key=None: builtin.quantize(x, key)
        cls.dequantize = lambda self, x, scale: builtin.dequantize(x, scale)
    cls.storage, cls.scale, cls.compute, cls.accumulate = storage, scale, compute, accumulate
    if "dtype" not in cls.__dict__:
        cls.dtype = storage.container
    cls.__ts_policy_spec__ = PolicySpec(
        storage,
        scale,
        compute.container,
        None if accumulate is None else accumulate.container,
        not has_q,
    )
    return cls


def _is_user_policy(p: Any) -> bool:
    return isinstance(getattr(p, "__ts_policy_spec__", None), PolicySpec)


@functools.cache
def _instance(cls: type) -> Any:
    return cls()


def _implementation(policy: Any) -> Any:
    """The object whose ``quantize``/``dequantize`` methods a policy runs."""
    return _instance(policy) if isinstance(policy, type) else policy


def resolve_policy(policy: Any) -> Any:
    """A policy argument → the static policy a QuantizedTensor carries.

    A ``@ts.precision_policy`` class or instance is kept; a ts dtype, a ``Policy`` or a
    dtype name becomes a :class:`ScaledPolicy`.
    """
    if isinstance(policy, ScaledPolicy) or _is_user_policy(policy):
        return policy
    if isinstance(policy, type) and hasattr(policy, "quantize"):
        raise TypeError(
            f"quantize: {policy.__name__} has a quantize method but is not decorated with "
            "@ts.precision_policy"
        )
    if isinstance(policy, Policy):
        return _scaled_from(policy.storage, policy.accumulate, policy.stochastic_round)
    try:
        if policy is None:
            raise TypeError("None")
        storage = as_tdtype(policy)
    except TypeError:
        raise TypeError(
            f"quantize: policy={policy!r} must be a ts dtype, a policy (ts.fp8_e4m3 @ "
            "ts.accum(ts.f32)) or a @ts.precision_policy class"
        ) from None
    return _scaled_from(storage)


def policy_spec(policy: Any) -> PolicySpec:
    """The :class:`PolicySpec` of a resolved policy."""
    if isinstance(policy, ScaledPolicy):
        return _spec_of_scaled(policy)
    return policy.__ts_policy_spec__


@jax.tree_util.register_pytree_node_class
class QuantizedTensor:
    """Quantized values with their scale and policy: a pytree of ``(values, scale)``.

    The policy is static (pytree aux data), so a QuantizedTensor passes through
    ``jax.jit``, ``jax.grad`` and ``jax.vmap`` like a pair of arrays.

    Attributes:
      values: the stored values (``policy.storage``'s container dtype).
      scale: the scale (``policy.scale``'s dtype); per-tensor scales are scalars.
      policy: the precision policy (a ``@ts.precision_policy`` class or a
        :class:`ScaledPolicy`).
    """

    __slots__ = ("policy", "scale", "values")

    def __init__(self, values: Any, scale: Any, policy: Any):
        self.values = values
        self.scale = scale
        self.policy = policy

    def tree_flatten(self):
        return (self.values, self.scale), self.policy

    @classmethod
    def tree_unflatten(cls, policy, children):
        return cls(*children, policy)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype (of the values)."""
        return np.dtype(self.values.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def spec(self) -> PolicySpec:
        return policy_spec(self.policy)

    @property
    def mT(self) -> QuantizedTensor:
        """The last two dimensions swapped (a per-tensor scale is unchanged)."""
        if self.ndim < 2:
            raise ValueError(f"QuantizedTensor.mT: shape={self.shape} has rank < 2")
        s = self.scale
        if getattr(s, "ndim", 0) >= 2:
            s = jnp.swapaxes(s, -1, -2)
        return QuantizedTensor(jnp.swapaxes(self.values, -1, -2), s, self.policy)

    @property
    def T(self) -> QuantizedTensor:
        """The transpose of a 2-D QuantizedTensor (as ``.mT``)."""
        if self.ndim != 2:
            raise ValueError(f"QuantizedTensor.T: shape={self.shape}; use .mT for batches")
        return self.mT

    def dequantize(self) -> jax.Array:
        return dequantize(self)

    def __repr__(self) -> str:
        p = self.policy
        pname = p.__name__ if isinstance(p, type) else repr(p)
        return f"QuantizedTensor(shape={self.shape}, dtype={self.dtype}, policy={pname})"


def quantize(x: Any, policy: Any, *, key: jax.Array | None = None) -> QuantizedTensor:
    """Quantizes ``x`` under ``policy``.

    Arguments:
      x: a float array.
      policy: a ``@ts.precision_policy`` class (or instance), a ts dtype (``ts.fp8_e4m3``,
        ``ts.fp8_e5m2``, ``ts.fp6``, ``ts.int8``, ``ts.bf16``…) or a ``Policy``
        (``ts.fp8_e4m3 @ ts.accum(ts.f32)``): built-in per-tensor scaling.
      key: a PRNG key for stochastic rounding (required by ``@ts.stochastic_round``).
    Returns:
      A :class:`QuantizedTensor` with ``values`` of the storage dtype and ``scale``.
    """
    x = as_array("quantize", "x", x)
    if not is_float(x.dtype):
        raise TypeError(f"quantize: x.dtype={x.dtype} must be a float dtype")
    key = key_arg("quantize", key)
    p = resolve_policy(policy)
    spec = policy_spec(p)
    if isinstance(p, ScaledPolicy):
        if p.stochastic_round and key is None:
            raise ValueError(
                f"quantize: the policy rounds stochastically; pass key=jax.random.key(...)"
                f" ({policy!r})"
            )
        values, scale = p.quantize(x, key)
    else:
        impl = _implementation(p)
        if key is not None:
            if "key" not in inspect.signature(impl.quantize).parameters:
                raise TypeError(f"quantize: {_name(p)}.quantize takes no key")
            out = impl.quantize(x, key=key)
        else:
            out = impl.quantize(x)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"quantize: {_name(p)}.quantize must return (values, scale)")
        values, scale = out
        values, scale = jnp.asarray(values), jnp.asarray(scale)
    if np.dtype(values.dtype) != spec.storage.container:
        raise TypeError(
            f"quantize: {_name(p)}.quantize returned values of dtype {values.dtype}; "
            f"the policy's storage is {spec.storage!r} ({spec.storage.container})"
        )
    if values.shape != x.shape:
        raise ValueError(
            f"quantize: {_name(p)}.quantize returned values of shape {values.shape} "
            f"for x.shape={x.shape}"
        )
    return QuantizedTensor(values, scale.astype(spec.scale.container), p)


def dequantize(qt: QuantizedTensor) -> jax.Array:
    """The values of ``qt`` mapped back by its policy, in the policy's compute dtype."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize: expected a QuantizedTensor, got {type(qt).__name__}")
    out = _implementation(qt.policy).dequantize(qt.values, qt.scale)
    compute = qt.spec.compute
    return out if out.dtype == compute else out.astype(compute)


def fp8_scaled_values(x: Any) -> tuple[jax.Array, jax.Array] | None:
    """``(values, scale)`` of a per-tensor scaled fp8 QuantizedTensor, else None.

    Such an operand can enter a product in the fp8 path with its scale applied to the
    accumulator (``dequantize`` is ``values · scale`` with a scalar scale).
    """
    if not isinstance(x, QuantizedTensor):
        return None
    spec = x.spec
    if spec.linear_scale and x.dtype in FP8_DTYPES and jnp.shape(x.scale) == ():
        return x.values, x.scale
    return None


def _name(p: Any) -> str:
    return p.__name__ if isinstance(p, type) else type(p).__name__
