"""Elementwise operators against float64 references: values, derivatives (2nd order), vmap, jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax.test_util import check_grads

import tessera_jax as ts
from tests._util import assert_close, f64, np_activation_derivative, rand, sample, sample_grid


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


# name -> (ts function, float64 reference, input transform keeping the domain valid)
CASES = {
    "relu": (ts.relu, lambda x: np.maximum(x, 0), lambda x: x),
    "gelu": (ts.gelu, lambda x: 0.5 * x * (1 + scipy.special.erf(x / np.sqrt(2))), lambda x: x),
    "gelu_tanh": (lambda x: ts.gelu(x, approximate=True), _gelu_tanh, lambda x: x),
    "tanh": (ts.tanh, np.tanh, lambda x: x),
    "exp": (ts.exp, np.exp, lambda x: x),
    "sqrt": (ts.sqrt, np.sqrt, lambda x: jnp.abs(x) + 0.1),
    "abs": (ts.abs, np.abs, lambda x: x),
}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize(
    *sample_grid(21, name=sorted(CASES), dtype=DTYPES, shape=[(7,), (3, 5, 4)])
)
def test_values_match_float64_reference(name, dtype, shape):
    fn, ref, prep = CASES[name]
    x = prep(rand(shape)).astype(dtype)
    out = fn(x)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, ref(f64(x)))
    assert_close(jax.jit(fn)(x), ref(f64(x)))


@pytest.mark.parametrize("name", sample(sorted(set(CASES) - {"relu", "abs"}), 3))
def test_second_order_gradients(name, x64):
    fn, _, prep = CASES[name]
    x = prep(rand((4, 3))).astype(jnp.float64)
    # Jitted: check_grads of an eager function compiles each operation of every derivative.
    check_grads(jax.jit(fn), (x,), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("name", ["relu", "abs"])
def test_piecewise_gradients_away_from_kink(name, x64):
    fn, _, _ = CASES[name]
    x = rand((4, 3)).astype(jnp.float64)
    x = jnp.where(jnp.abs(x) < 0.1, 0.5, x)
    check_grads(jax.jit(fn), (x,), order=2, modes=("fwd", "rev"), eps=1e-4)


def test_relu_gradient_at_zero_is_zero():
    assert float(jax.grad(ts.relu)(jnp.float32(0.0))) == 0.0


def test_round_is_half_to_even_with_zero_gradient():
    x = jnp.array([0.5, 1.5, 2.5, -0.5, 1.2], jnp.float32)
    np.testing.assert_array_equal(ts.round(x), np.array([0, 2, 2, -0.0, 1], np.float32))
    np.testing.assert_array_equal(jax.grad(lambda x: ts.round(x).sum())(x), np.zeros(5))


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_and_vmap_of_grad(name):
    fn, _, prep = CASES[name]
    x = prep(rand((5, 6)))
    np.testing.assert_allclose(jax.vmap(fn, in_axes=1, out_axes=1)(x), fn(x), rtol=1e-6)
    g = jax.vmap(jax.grad(lambda r: jnp.sum(fn(r))))(x)
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sum(fn(x)))(x), rtol=1e-6)


def test_operators_appear_in_the_jaxpr():
    jaxpr = str(jax.make_jaxpr(lambda x: ts.gelu(ts.tanh(ts.exp(x))))(rand((3,))))
    for name in ("ts_exp", "ts_tanh", "ts_gelu"):
        assert name in jaxpr


def test_python_scalars_keep_weak_type():
    # ts.sqrt(2 * ts.pi) as in seed 003: a weakly typed scalar mixes with bf16 under
    # strict promotion.
    y = rand((4,), jnp.bfloat16) / ts.sqrt(2 * ts.pi)
    assert y.dtype == jnp.bfloat16


@pytest.mark.parametrize("fn", [ts.relu, ts.gelu, ts.tanh, ts.abs])
def test_integer_input_is_rejected(fn):
    with pytest.raises(TypeError, match=r"x\.dtype=int32 is not supported"):
        fn(jnp.arange(3))


def test_gelu_approximate_must_be_bool():
    with pytest.raises(TypeError, match="gelu: approximate='tanh' must be a bool"):
        ts.gelu(rand((3,)), approximate="tanh")


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_gradient_of_bf16_is_rounded_once(approximate):
    # The derivative is computed in f32 and rounded once to bf16: within half a bf16 ulp
    # (2**-8 relative) of the float64 derivative, where bf16 arithmetic would round each step.
    x = rand((256,), jnp.bfloat16, scale=3.0)
    g = jax.grad(lambda x: jnp.sum(ts.gelu(x, approximate=approximate).astype(jnp.float32)))(x)
    assert g.dtype == jnp.bfloat16
    want = np_activation_derivative(f64(x), "gelu_tanh" if approximate else "gelu")
    np.testing.assert_array_less(np.abs(f64(g) - want), 2.0**-8 * np.abs(want) + 1e-5)
