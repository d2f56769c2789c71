"""``ts.checkpoint_policies``: ``jax.checkpoint`` (remat) policies that know ``ts_matmul``.

jax's dot policies (``dots_saveable``, ``dots_with_no_batch_dims_saveable``,
``offload_dot_with_no_batch_dims``) look for ``dot_general`` equations only. A model
built from ``ts.matmul`` / ``ts.op.linear`` has ``ts_matmul`` equations instead, so
under those policies remat silently recomputes every product. The policies here have
the same names and meaning as ``jax.checkpoint_policies``; each one presents a
``ts_matmul`` equation to jax's own policy as the ``dot_general`` it computes (batch
dimensions included), so a product is saved, offloaded or recomputed exactly where
jax would decide so for ``jnp.dot``::

    @functools.partial(jax.checkpoint, policy=ts.checkpoint_policies.dots_saveable)
    def block(x, w1, w2):
        return ts.op.linear(ts.op.linear(x, w1, activation="gelu"), w2)

A fused epilogue (bias, activation, residual) is part of the ``ts_matmul`` output, so
a saved product is saved after its epilogue; so is the two-output form that a
differentiated layer with an activation binds (``ts_matmul_with_derivative``: the output
and the activation's derivative). Flash attention is not a dot: its
forward saves its output and log-sum-exp, and the backward recomputes the scores by
design. :func:`ts_aware` turns any policy (your own too) into one that knows
``ts_matmul``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from tessera_jax.primitives.matmul import matmul_op, matmul_with_derivative_op

__all__ = [
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "nothing_saveable",
    "offload_dot_with_no_batch_dims",
    "save_and_offload_only_these_names",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_only_these_names",
    "ts_aware",
]

_jcp = jax.checkpoint_policies


def _dot_dimension_numbers(a: Any, b: Any, spec: Any) -> tuple:
    """The ``dot_general`` dimension numbers of a ``ts_matmul`` of operands ``a``, ``b``.

    Operands with leading dimensions on both sides are a batched product; a 2-D
    operand shared by every batch element is a product without batch dimensions (its
    reference is one ``dot_general`` over the flattened rows).
    """
    batched = a.ndim > 2 and b.ndim > 2
    batch = tuple(range(a.ndim - 2)) if batched else ()
    ca = a.ndim - 2 if spec.transpose_a else a.ndim - 1
    cb = b.ndim - 1 if spec.transpose_b else b.ndim - 2
    return ((ca,), (cb,)), (batch, batch)


def ts_aware(policy: Callable[..., Any]) -> Callable[..., Any]:
    """``policy`` with each ``ts_matmul`` equation presented as its ``dot_general``."""
    matmul_prims = (matmul_op.prim, matmul_with_derivative_op.prim)

    def aware(prim: Any, *avals: Any, **params: Any) -> Any:
        if prim in matmul_prims:
            dn = _dot_dimension_numbers(avals[0], avals[1], params["spec"])
            return policy(jax.lax.dot_general_p, avals[0], avals[1], dimension_numbers=dn)
        return policy(prim, *avals, **params)

    aware.__name__ = getattr(policy, "__name__", type(policy).__name__)
    aware.__doc__ = f"{aware.__name__}, with ts_matmul treated as the dot_general it computes."
    return aware


dots_saveable = checkpoint_dots = ts_aware(_jcp.dots_saveable)
dots_with_no_batch_dims_saveable = checkpoint_dots_with_no_batch_dims = ts_aware(
    _jcp.dots_with_no_batch_dims_saveable
)
# Policies that never look at dots are jax's own.
everything_saveable = _jcp.everything_saveable
nothing_saveable = _jcp.nothing_saveable
save_only_these_names = _jcp.save_only_these_names
save_any_names_but_these = _jcp.save_any_names_but_these
save_anything_except_these_names = _jcp.save_anything_except_these_names
save_and_offload_only_these_names = _jcp.save_and_offload_only_these_names


def offload_dot_with_no_batch_dims(offload_src: str, offload_dst: str) -> Callable[..., Any]:
    """jax's ``offload_dot_with_no_batch_dims``, offloading ``ts_matmul`` outputs too."""
    return ts_aware(_jcp.offload_dot_with_no_batch_dims(offload_src, offload_dst))


def save_from_both_policies(policy_1: Callable[..., Any], policy_2: Callable[..., Any]):
    """Saves what either policy saves (either may be a dot policy of this module or jax's)."""
    return ts_aware(_jcp.save_from_both_policies(policy_1, policy_2))
