"""The ``ts_matmul`` contract: what every implementation of the operator computes.

``ts_matmul(a, b, *extras, spec=MatmulSpec(...))``::

    acc = op(a) @ op(b)                      in spec.accumulate_dtype
    out = cast(act(scale·acc + bias) + residual, spec.out_dtype)

``op`` transposes the last two dimensions when the spec's flag is set: ``a`` is stored
``(..., K, M)`` with ``transpose_a``, else ``(..., M, K)``; ``b`` is ``(..., N, K)`` with
``transpose_b``, else ``(..., K, N)``. ``extras`` are ``bias (N,)``, ``residual`` (the
output's shape) and ``scale`` (an f32 scalar), in that order, each present only if the
spec says so. The epilogue runs in :attr:`MatmulSpec.epilogue_dtype`; a product without
an epilogue is cast straight from the accumulator (exact int32 for int8).

``ts_matmul_with_derivative(a, b, *extras, spec=...)``, the forward of a differentiated
product with an activation, returns ``out`` and ``cast(act'(scale·acc + bias),
spec.out_dtype)`` from the same accumulator (:func:`epilogue_with_derivative`).

This module is the one owner of that contract. The operator module
(``primitives/matmul.py``) builds a :class:`MatmulSpec` once per bind; the reference and
the Pallas kernels (``pallas_kernels/``) receive the spec and the operands and import the
epilogue from here, so the math is written once. It imports nothing from
``primitives/`` or ``pallas_kernels/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from tessera_jax.contracts.activations import gelu, gelu_derivative

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh")
_F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class MatmulSpec:
    """The static parameters of one ``ts_matmul`` bind (hashable: it is the bind's param).

    Attributes:
      transpose_a: ``a`` is stored ``(..., K, M)``.
      transpose_b: ``b`` is stored ``(..., N, K)``.
      out_dtype: the result's dtype.
      accumulate_dtype: the product's accumulator dtype (f32, f64 or int32).
      activation: the epilogue activation, one of :data:`ACTIVATIONS`.
      tile_shape: ``(BM, BN, BK)`` requested by the user for the kernels, or None.
      has_bias / has_residual / has_scale: which extra operands follow ``a`` and ``b``.
      out_sharding: on a mesh with Explicit axes, the output's PartitionSpec where the
        operands' shardings leave it ambiguous (a sharded contraction, as in the adjoint
        products), as ``jax.lax.dot_general``'s ``out_sharding``; None elsewhere. A type
        annotation: kernels, which run on local shards, ignore it.
    """

    out_dtype: np.dtype
    accumulate_dtype: np.dtype
    transpose_a: bool = False
    transpose_b: bool = False
    activation: str | None = None
    tile_shape: tuple[int, int, int] | None = None
    has_bias: bool = False
    has_residual: bool = False
    has_scale: bool = False
    out_sharding: Any = None

    def __post_init__(self):
        # Normalised so that equal specs compare (and hash, and cache) equal.
        object.__setattr__(self, "out_dtype", np.dtype(self.out_dtype))
        object.__setattr__(self, "accumulate_dtype", np.dtype(self.accumulate_dtype))
        object.__setattr__(self, "transpose_a", bool(self.transpose_a))
        object.__setattr__(self, "transpose_b", bool(self.transpose_b))
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MatmulSpec: activation={self.activation!r} not in {ACTIVATIONS}")
        if self.tile_shape is not None:
            object.__setattr__(self, "tile_shape", tuple(int(t) for t in self.tile_shape))

    def replace(self, **changes: Any) -> MatmulSpec:
        return dataclasses.replace(self, **changes)

    @property
    def num_extras(self) -> int:
        return int(self.has_bias) + int(self.has_residual) + int(self.has_scale)

    @property
    def has_epilogue(self) -> bool:
        """Whether anything but the cast follows the product."""
        return self.has_bias or self.has_residual or self.has_scale or self.activation is not None

    @property
    def epilogue_dtype(self) -> np.dtype:
        """The dtype the epilogue runs in: the accumulator's when a float, else f32."""
        return epilogue_dtype(self.accumulate_dtype)

    def split(self, extras: Sequence[Any]) -> tuple[Any, Any, Any]:
        """``(bias, residual, scale)`` from the extra operands; a missing one is None."""
        if len(extras) != self.num_extras:
            raise ValueError(
                f"ts_matmul: {len(extras)} extra operands, but the spec has {self.num_extras}"
            )
        it = iter(extras)
        bias = next(it) if self.has_bias else None
        residual = next(it) if self.has_residual else None
        scale = next(it) if self.has_scale else None
        return bias, residual, scale

    def problem_shape(self, a_shape: Sequence[int], b_shape: Sequence[int]) -> tuple[int, int, int]:
        """``(M, N, K)`` of ``op(a) @ op(b)`` from the stored shapes."""
        m = a_shape[-1] if self.transpose_a else a_shape[-2]
        k = a_shape[-2] if self.transpose_a else a_shape[-1]
        n = b_shape[-2] if self.transpose_b else b_shape[-1]
        return int(m), int(n), int(k)


def epilogue_dtype(accumulate_dtype: Any) -> np.dtype:
    """The dtype the epilogue runs in: the accumulator's when a float, else f32."""
    acc = np.dtype(accumulate_dtype)
    return acc if jnp.issubdtype(acc, jnp.floating) else _F32


def apply_activation(x, activation: str | None, erf=lax.erf):
    """The fused epilogue's activation on ``x`` (``gelu`` exact via ``erf``, ``gelu_tanh``
    the tanh form). ``erf`` is a parameter because Mosaic GPU cannot lower ``lax.erf``."""
    if activation is None:
        return x
    if activation == "relu":
        return jnp.maximum(x, 0.0)
    if activation in ("gelu", "gelu_tanh"):
        return gelu(x, approximate=activation == "gelu_tanh", erf=erf)
    raise ValueError(f"matmul: activation={activation!r} must be one of {ACTIVATIONS}")


def activation_derivative(x, activation: str, erf=lax.erf):
    """``act'(x)`` of the fused epilogue's activation, in ``x``'s dtype (relu's is 0 at 0,
    as ``ts.relu``'s). ``erf`` as in :func:`apply_activation`."""
    if activation == "relu":
        return (x > 0).astype(x.dtype)
    if activation in ("gelu", "gelu_tanh"):
        return gelu_derivative(x, approximate=activation == "gelu_tanh", erf=erf)
    raise ValueError(
        f"matmul: activation={activation!r} must be one of {ACTIVATIONS[1:]} for a derivative"
    )


def _pre_activation(acc, bias, scale):
    """``scale·acc + bias`` in :func:`epilogue_dtype` of ``acc.dtype``."""
    ep = epilogue_dtype(acc.dtype)
    z = acc.astype(ep)
    if scale is not None:
        z = z * scale.astype(ep)
    if bias is not None:
        z = z + bias.astype(ep).reshape(*([1] * (z.ndim - bias.ndim)), *bias.shape)
    return z


def epilogue(
    acc,
    bias=None,
    residual=None,
    scale=None,
    *,
    activation: str | None = None,
    out_dtype: Any,
):
    """``cast(act(scale·acc + bias) + residual, out_dtype)`` of an accumulator ``acc``.

    It runs in :func:`epilogue_dtype` of ``acc.dtype``; ``bias`` broadcasts over the rows.
    Without bias, residual, scale and activation it is a plain cast straight from the
    accumulator (exact int32 for an int8 product).
    """
    if bias is None and residual is None and scale is None and activation is None:
        return acc.astype(out_dtype)
    z = apply_activation(_pre_activation(acc, bias, scale), activation)
    if residual is not None:
        z = z + residual.astype(z.dtype)
    return z.astype(out_dtype)


def epilogue_with_derivative(
    acc,
    bias=None,
    residual=None,
    scale=None,
    *,
    activation: str,
    out_dtype: Any,
):
    """``(epilogue(...), cast(act'(z), out_dtype))`` with ``z = scale·acc + bias``: the
    output of :func:`epilogue`, computed by the same operations (the same bits), and the
    activation's derivative at the pre-activation, both from one accumulator.

    This is the ``ts_matmul_with_derivative`` contract: the forward of a differentiated
    fused linear layer saves ``act'(z)`` for the backward, which multiplies it into the
    cotangent. The derivative is rounded to ``out_dtype`` (bf16 for a bf16 layer, about
    3 significant digits) from ``z`` in the epilogue dtype, so that the backward needs no
    activation of its own and can read half the bytes of an f32 pre-activation.
    """
    z = _pre_activation(acc, bias, scale)
    y = apply_activation(z, activation)
    if residual is not None:
        y = y + residual.astype(y.dtype)
    return y.astype(out_dtype), activation_derivative(z, activation).astype(out_dtype)
