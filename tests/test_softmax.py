"""softmax / log_softmax: float64 references, -inf rows, derivatives, vmap/jit, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.test_util import check_grads

import tessera_jax as ts
from tessera_jax.primitives import softmax as _softmax
from tests._util import assert_close, f64, rand, sample

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def np_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """float64 softmax; a fully -inf row gives zeros."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - np.where(np.isneginf(m), 0.0, m))
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(s == 0, 1.0, s)


def np_log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    s = np.sum(np.exp(x - m), axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        return x - m - np.log(np.where(s == 0, 1.0, s))


@pytest.mark.parametrize(
    "dtype,shape,axis",
    sample(
        [
            (d, *sa)
            for d in DTYPES
            for sa in [((7,), 0), ((4, 33), -1), ((3, 5, 6), 1), ((5, 2, 9), 0)]
        ],
        6,
    ),
)
def test_softmax_matches_float64(dtype, shape, axis):
    x = rand(shape, dtype, scale=3.0)
    out = ts.softmax(x, axis)
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, np_softmax(f64(x), axis))
    assert_close(ts.log_softmax(x, axis), np_log_softmax(f64(x), axis), factor=2)


def test_large_logits_do_not_overflow():
    x = jnp.array([[1000.0, 999.0, -1000.0], [88.0, 89.0, 90.0]], jnp.float32)
    assert_close(ts.softmax(x), np_softmax(f64(x), -1))
    x16 = jnp.array([[60000.0, 59000.0, -60000.0]], jnp.float16)  # exp overflows f16 and f32
    assert_close(ts.softmax(x16), np_softmax(f64(x16), -1))


def test_bf16_is_computed_in_f32_and_rounded_once():
    x = rand((8, 64), jnp.bfloat16, scale=4.0)
    want = jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(jnp.bfloat16)
    np.testing.assert_array_equal(f64(ts.softmax(x)), f64(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_neg_inf_rows_give_zeros_and_zero_gradient(dtype):
    x = rand((3, 5), dtype).at[1].set(-jnp.inf)
    x = x.at[2, :3].set(-jnp.inf)  # a partly masked row stays a distribution
    y = ts.softmax(x)
    np.testing.assert_array_equal(f64(y[1]), np.zeros(5))
    assert_close(y, np_softmax(f64(x), -1))
    ls = ts.log_softmax(x)
    assert np.all(np.isneginf(f64(ls[1])))
    w = rand((3, 5))
    g = jax.grad(lambda x: jnp.sum(ts.softmax(x).astype(jnp.float32) * w))(x)
    assert np.all(np.isfinite(f64(g)))
    np.testing.assert_array_equal(f64(g[1]), np.zeros(5))
    ct = rand((3, 5), dtype)
    (gl,) = jax.vjp(ts.log_softmax, x)[1](ct)
    assert np.all(np.isfinite(f64(gl)))
    np.testing.assert_array_equal(f64(gl[1]), f64(ct[1]))  # δ − softmax, softmax = 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_stable_exp_forms_agree(x64, dtype):
    """The CPU's form of the row statistics (selects on the reduced values) and the GPUs'
    (a maximum from the lowest finite value, a floored sum) agree: on ordinary rows, fully
    and partly -inf rows, rows holding +inf or NaN and rows of the dtype's extremes: their
    softmax and log-softmax bit for bit, on the CPU one row at a time (a GPU fuses the two
    forms differently, and so sums in another order)."""
    info = jnp.finfo(dtype)
    x = (rand((8, 33)) * 5).astype(dtype)
    x = x.at[1].set(-jnp.inf).at[2, :30].set(-jnp.inf).at[3, 4].set(jnp.inf)
    x = x.at[4, 5].set(jnp.nan).at[5].set(info.min).at[6, :3].set(info.max)
    for row in range(x.shape[0]):
        outs = []
        for form in (_softmax._stable_exp_selects, _softmax._stable_exp_floors):
            f = jax.jit(lambda r, f=form: f(r, axis=-1))
            shifted, e, s = f(jax.device_put(x[row : row + 1], jax.devices("cpu")[0]))
            outs.append((e / s, shifted - jnp.log(s)))
        for a, b in zip(*outs):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_each_platform_lowers_its_form_of_the_statistics():
    """cuda lowers the select-free form, which XLA's GPU compiler fuses into one kernel a
    row; the CPU the form with selects."""
    x = rand((4, 8))

    def selects(platform):
        text = jax.jit(ts.softmax).trace(x).lower(lowering_platforms=(platform,)).as_text()
        return text.count("stablehlo.select")

    assert selects("cuda") == 0 and selects("cpu") > 0


@pytest.mark.parametrize("axis", sample([0, 1, -1], 2))
def test_gradients_order_2(x64, axis):
    x = rand((3, 4, 5)).astype(jnp.float64)
    # Jitted: check_grads of an eager function compiles each operation of every derivative.
    check_grads(jax.jit(lambda x: ts.softmax(x, axis)), (x,), order=2)
    check_grads(jax.jit(lambda x: ts.log_softmax(x, axis)), (x,), order=2)


def test_jvp_formula():
    x, t = rand((4, 6)), rand((4, 6))
    y, dy = jax.jvp(ts.softmax, (x,), (t,))
    yr, tr = f64(y), f64(t)
    np.testing.assert_allclose(dy, yr * (tr - np.sum(yr * tr, -1, keepdims=True)), atol=1e-6)


def test_vmap_jit_and_vmap_of_grad():
    x = rand((5, 4, 6))
    for in_axes in (0, 1, 2):
        got = jax.vmap(lambda r: ts.softmax(r, 0), in_axes=in_axes, out_axes=in_axes)(x)
        want = np_softmax(f64(x), 1 if in_axes == 0 else 0)
        assert_close(got, want)
    assert_close(jax.jit(ts.softmax, static_argnums=1)(x, 1), np_softmax(f64(x), 1))
    w = rand((4, 6))
    loss = lambda r: jnp.sum(ts.softmax(r) * w)
    g1 = jax.vmap(jax.grad(loss))(x)
    g2 = jax.grad(lambda x: jnp.sum(jax.vmap(loss)(x)))(x)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-7)
    y = f64(ts.softmax(x))
    np.testing.assert_allclose(g1, y * (f64(w) - np.sum(y * f64(w), -1, keepdims=True)), atol=1e-6)


def test_jaxpr_shows_the_primitive():
    jaxpr = str(jax.make_jaxpr(lambda x: ts.softmax(x, 0))(rand((3, 4))))
    assert "ts_softmax[axis=0]" in jaxpr
    assert "ts_log_softmax" in str(jax.make_jaxpr(ts.log_softmax)(rand((3, 4))))


def test_zero_size_axis():
    assert ts.softmax(jnp.zeros((3, 0))).shape == (3, 0)


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), data=st.data())
def test_softmax_hypothesis_shapes(shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = rand(tuple(shape), scale=2.0)
    assert_close(ts.softmax(x, axis), np_softmax(f64(x), axis), factor=2)


def test_bad_inputs():
    x = rand((3, 4))
    with pytest.raises(ValueError, match="softmax: axis=2 is out of range for an array of rank 2"):
        ts.softmax(x, 2)
    with pytest.raises(TypeError, match="softmax: axis=None must be an int"):
        ts.softmax(x, None)
    with pytest.raises(TypeError, match="softmax: x.dtype=int32 is not supported"):
        ts.softmax(jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="softmax: x must have at least one dimension"):
        ts.softmax(jnp.float32(1.0))
    with pytest.raises(ValueError, match="log_softmax: axis=-3 is out of range"):
        ts.log_softmax(x, -3)
