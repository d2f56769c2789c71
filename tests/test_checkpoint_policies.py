"""ts.checkpoint_policies save ts_matmul outputs where jax's policies save jnp.dot's."""

from __future__ import annotations

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tests._util import rand, sample_grid, subjaxprs

POLICIES = [
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
    "nothing_saveable",
    "everything_saveable",
]


def _model(mm):
    def f(x, w1, w2):
        h = jnp.tanh(mm(x, w1))
        return jnp.sum(jnp.tanh(mm(h, w2)) ** 2)

    return f


def _count(jaxpr, names):
    """Equations named in ``names``, nested jaxprs (pjit, remat, custom rules) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in names
        n += sum(_count(sub, names) for sub in subjaxprs(eqn.params))
    return n


def _products_in_grad(mm, policy, shapes):
    f = jax.checkpoint(_model(mm), policy=policy)
    args = [rand(s) for s in shapes]
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(*args).jaxpr
    return _count(jaxpr, {"dot_general", "ts_matmul"})


@pytest.mark.parametrize(*sample_grid(7, name=POLICIES, batched=[False, True]))
def test_saves_what_jax_saves_for_jnp_dot(name, batched):
    shapes = [(3, 8, 16), (3, 16, 16), (3, 16, 4)] if batched else [(8, 16), (16, 16), (16, 4)]
    ts_count = _products_in_grad(ts.matmul, getattr(ts.checkpoint_policies, name), shapes)
    jnp_count = _products_in_grad(jnp.matmul, getattr(jax.checkpoint_policies, name), shapes)
    assert ts_count == jnp_count


def test_jax_policy_recomputes_ts_matmul_and_ours_does_not():
    shapes = [(8, 16), (16, 16), (16, 4)]
    ours = _products_in_grad(ts.matmul, ts.checkpoint_policies.dots_saveable, shapes)
    theirs = _products_in_grad(ts.matmul, jax.checkpoint_policies.dots_saveable, shapes)
    assert ours < theirs  # jax's policy does not know ts_matmul: it recomputes the products


def test_same_gradients_under_every_policy():
    x, w1, w2 = rand((8, 16)), rand((16, 16)) / 4, rand((16, 4)) / 4
    f = _model(ts.matmul)
    ref = jax.grad(f, argnums=(0, 1, 2))(x, w1, w2)
    for name in POLICIES:
        g = jax.grad(jax.checkpoint(f, policy=getattr(ts.checkpoint_policies, name)), (0, 1, 2))
        for a, b in zip(g(x, w1, w2), ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_combined_and_custom_policies():
    names = ts.checkpoint_policies.save_only_these_names("h")
    both = ts.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable, names
    )
    shapes = [(8, 16), (16, 16), (16, 4)]
    assert _products_in_grad(ts.matmul, both, shapes) == _products_in_grad(
        ts.matmul, ts.checkpoint_policies.dots_saveable, shapes
    )
    custom = ts.checkpoint_policies.ts_aware(lambda prim, *_, **__: prim is jax.lax.dot_general_p)
    assert _products_in_grad(ts.matmul, custom, shapes) == _products_in_grad(
        ts.matmul, ts.checkpoint_policies.dots_saveable, shapes
    )


def test_offload_policy_is_built():
    policy = ts.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    x = rand((8, 16))
    prim = ts.op.OPERATORS["matmul"].prim
    jaxpr = jax.make_jaxpr(lambda a, b: ts.matmul(a, b))(x, rand((16, 4)))
    eqn = jaxpr.jaxpr.eqns[0]
    assert eqn.primitive is prim
    decision = policy(prim, *[v.aval for v in eqn.invars], **eqn.params)
    assert isinstance(decision, jax.ad_checkpoint.Offloadable)
