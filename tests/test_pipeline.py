"""Pipeline parallelism: GPipe and 1F1B against the unpipelined model (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tests._util import rand, sample

D, B = 16, 32


def layer(p, h):
    return ts.tanh(ts.matmul(h, p["w"]) + p["b"][None, :])


def mse(y, t):
    return ts.mse(y, t)


@pytest.fixture(scope="module")
def pp4():
    return ts.dist.Mesh(axes=["dp", "pp"], devices=range(8), shape=(2, 4))


def stacked_params(n_layers):
    return {"w": rand((n_layers, D, D), scale=0.3), "b": rand((n_layers, D), scale=0.1)}


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "schedule,n_layers,microbatches",
    sample([(s, *lm) for s in ("gpipe", "1f1b") for lm in ((4, 4), (8, 8))], 2),
)
def test_grads_equal_unpipelined(pp4, schedule, n_layers, microbatches):
    params, x, t = stacked_params(n_layers), rand((B, D)), rand((B, D))
    pipe = ts.dist.pipeline(
        layer, microbatches=microbatches, schedule=schedule, mesh=pp4, axis="pp", loss=mse
    )
    loss, grads = jax.jit(jax.value_and_grad(pipe, argnums=(0, 1)))(params, x, t)
    ref_loss, ref_grads = jax.value_and_grad(pipe.sequential_loss, argnums=(0, 1))(params, x, t)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)
    # The full-batch mean loss of the unpipelined model is the mean of microbatch means.
    np.testing.assert_allclose(loss, mse(pipe.sequential(params, x), t), rtol=1e-5)


def test_gpipe_forward_outputs(pp4):
    params, x = stacked_params(8), rand((B, D))
    pipe = ts.dist.pipeline(layer, microbatches=4, mesh=pp4)
    # Compiled: evaluated op by op, the schedule's many small steps dominate the test's time.
    y = jax.jit(pipe)(params, x)
    assert y.shape == (B, D)
    np.testing.assert_allclose(y, jax.jit(pipe.sequential)(params, x), rtol=1e-6, atol=1e-6)
    g = jax.jit(jax.grad(lambda p: jnp.sum(pipe(p, x) ** 2)))(params)
    r = jax.jit(jax.grad(lambda p: jnp.sum(pipe.sequential(p, x) ** 2)))(params)
    assert_trees_close(g, r)


@pytest.mark.parametrize("schedule", sample(["gpipe", "1f1b"], 1))
def test_list_of_stage_functions(pp4, schedule):
    fns = [
        lambda p, h: ts.tanh(h @ p),
        lambda p, h: ts.relu(h @ p),
        lambda p, h: h @ p,
        lambda p, h: ts.gelu(h @ p),
    ]
    params = [rand((D, D), scale=0.3) for _ in fns]
    x, t = rand((B, D)), rand((B, D))
    pipe = ts.dist.pipeline(fns, microbatches=8, schedule=schedule, mesh=pp4, loss=mse)
    g = jax.jit(jax.grad(pipe, argnums=(0, 1)))(params, x, t)
    r = jax.jit(jax.grad(pipe.sequential_loss, argnums=(0, 1)))(params, x, t)
    assert_trees_close(g, r)


def test_pipeline_errors(pp4):
    params, x, t = stacked_params(6), rand((B, D)), rand((B, D))
    with pytest.raises(ValueError, match="pass loss="):
        ts.dist.pipeline(layer, microbatches=4, schedule="1f1b", mesh=pp4)
    with pytest.raises(ValueError, match="schedule='zb'"):
        ts.dist.pipeline(layer, microbatches=4, schedule="zb", mesh=pp4)
    with pytest.raises(ValueError, match="6 layers cannot be split evenly over the 4"):
        ts.dist.pipeline(layer, microbatches=4, mesh=pp4)(params, x)
    with pytest.raises(ValueError, match="batch size 32 is not a multiple of microbatches=5"):
        ts.dist.pipeline(layer, microbatches=5, mesh=pp4)(stacked_params(4), x)
    widen = lambda p, h: jnp.concatenate([h, h], axis=-1)
    with pytest.raises(ValueError, match="keep the activation shape"):
        ts.dist.pipeline(widen, microbatches=4, mesh=pp4)(stacked_params(4), x)
    with pytest.raises(ValueError, match="not an axis"):
        ts.dist.pipeline(layer, microbatches=4, mesh=pp4, axis="tp")(stacked_params(4), x)
    with pytest.raises(ValueError, match="pipe\\(params, x, targets\\)"):
        ts.dist.pipeline(layer, microbatches=4, mesh=pp4, loss=mse)(stacked_params(4), x)
    del t
