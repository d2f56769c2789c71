"""NaN and ±inf inputs to the reduction-like operators: a non-finite value in a row gives
that row its documented result (NaN, or ±inf where the maths says so) and leaves every
other row bit-for-bit what it is without it."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tessera_jax as ts
from tests._util import f64, rand

ROWS, D = 5, 8
NAN_ROW, INF_ROW, NEG_INF_ROW = 1, 2, 3  # rows 0 and 4 stay finite


def _poisoned(dtype):
    """A random ``(ROWS, D)`` input and the same input with NaN / +inf / -inf in three rows."""
    clean = rand((ROWS, D), dtype)
    bad = clean.at[NAN_ROW, 3].set(jnp.nan).at[INF_ROW, 5].set(jnp.inf)
    bad = bad.at[NEG_INF_ROW, 0].set(-jnp.inf)
    return clean, bad


def _nan_row(y):
    return np.all(np.isnan(f64(y)))


# (name, row-wise function, expected rows for NaN / +inf / -inf: "nan", "finite" or a check)
ROWWISE = [
    ("softmax", lambda x: ts.softmax(x, -1), "nan", "nan", "finite"),
    ("log_softmax", lambda x: ts.log_softmax(x, -1), "nan", "nan", "neg_inf_at"),
    ("rmsnorm", lambda x: ts.rmsnorm(x, jnp.ones(D, x.dtype)), "nan", "nan", "nan"),
    ("rmsnorm_safe", lambda x: ts.rmsnorm_safe(x, eps=0.0), "nan", "nan", "nan"),
    ("layernorm", lambda x: ts.layernorm(x, None, None), "nan", "nan", "nan"),
    ("sum", lambda x: ts.sum(x, axis=-1), "nan", "+inf", "-inf"),
    ("max", lambda x: ts.max(x, axis=-1), "nan", "+inf", "finite"),
    ("mse", lambda x: jax.vmap(ts.mse)(x, jnp.zeros_like(x)), "nan", "+inf", "+inf"),
]


def _check_row(name, kind, got_row, bad_row):
    g = f64(got_row)
    if kind == "nan":
        assert np.all(np.isnan(g)), f"{name}: expected a NaN row, got {g}"
    elif kind in ("+inf", "-inf"):
        assert np.all(g == (np.inf if kind == "+inf" else -np.inf)), f"{name}: {g}"
    elif kind == "finite":
        assert np.all(np.isfinite(g)), f"{name}: expected a finite row, got {g}"
    elif kind == "neg_inf_at":  # log_softmax: -inf exactly where the input is -inf
        assert np.array_equal(np.isneginf(g), np.isneginf(f64(bad_row))), f"{name}: {g}"
        assert np.all(np.isfinite(g[~np.isneginf(g)]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "name, fn, on_nan, on_inf, on_neg_inf", ROWWISE, ids=[r[0] for r in ROWWISE]
)
def test_non_finite_row_gives_its_result_and_leaves_other_rows(
    name, fn, on_nan, on_inf, on_neg_inf, dtype
):
    clean, bad = _poisoned(dtype)
    want, got = np.asarray(fn(clean)), np.asarray(fn(bad))
    for row in (0, ROWS - 1):  # the finite rows: bit for bit as without the bad rows
        np.testing.assert_array_equal(got[row], want[row])
    _check_row(name, on_nan, got[NAN_ROW], bad[NAN_ROW])
    _check_row(name, on_inf, got[INF_ROW], bad[INF_ROW])
    _check_row(name, on_neg_inf, got[NEG_INF_ROW], bad[NEG_INF_ROW])


def test_softmax_of_a_row_with_minus_inf_matches_float64():
    _, bad = _poisoned(jnp.float32)
    x = f64(bad[NEG_INF_ROW])
    e = np.exp(x - x.max())
    np.testing.assert_allclose(f64(ts.softmax(bad)[NEG_INF_ROW]), e / e.sum(), rtol=1e-6)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2**-8)])
@pytest.mark.parametrize("scale", [1e20, 1e30, 3e38])
def test_rmsnorm_of_rows_whose_squares_overflow_is_exact(scale, dtype, rtol):
    x = (rand((3, 16)) * jnp.float32(scale / 4)).astype(dtype)  # x² overflows f32
    x32 = x.astype(jnp.float32)
    assert np.all(np.isfinite(f64(x))) and np.all(np.isinf(jnp.mean(x32 * x32, axis=-1)))
    ref = f64(x) / np.sqrt(np.mean(f64(x) ** 2, axis=-1, keepdims=True))
    w = jnp.ones(16, dtype)
    for y in (ts.rmsnorm_safe(x, eps=0.0), ts.rmsnorm_safe(x), ts.rmsnorm(x, w)):
        np.testing.assert_allclose(f64(y), ref, rtol=rtol)
    if dtype != jnp.float32:
        return
    centred = f64(x) - f64(x).mean(-1, keepdims=True)
    ln_ref = centred / np.sqrt(np.mean(centred**2, axis=-1, keepdims=True))
    y = ts.layernorm(x, None, None)
    if scale < 1e38:  # the mean itself stays finite
        np.testing.assert_allclose(f64(y), ln_ref, rtol=1e-5, atol=1e-5)
    else:  # the mean overflows: NaN, never a plausible 0
        assert not np.any(f64(y) == 0)


def test_rmsnorm_overflowing_rows_have_finite_gradients():
    x = rand((2, 8)) * jnp.float32(1e25)
    g = jax.grad(lambda x: jnp.sum(ts.rmsnorm_safe(x) * jnp.arange(8.0)[None]))(x)
    assert np.all(np.isfinite(f64(g))) and np.any(f64(g) != 0)


E4M3_MAX = float(ml_dtypes.finfo(jnp.float8_e4m3fn).max)
E5M2_MAX = float(ml_dtypes.finfo(jnp.float8_e5m2).max)


@pytest.mark.parametrize(
    "target, fmax, has_inf",
    [
        (ts.fp8_e4m3, E4M3_MAX, False),  # no inf: out-of-range values and inf saturate
        (ts.fp6, 28.0, False),
        (ts.fp8_e5m2, E5M2_MAX, True),  # inf: IEEE rounding to inf
        (ts.f16, 65504.0, True),
    ],
    ids=["e4m3", "fp6", "e5m2", "f16"],
)
def test_cast_saturates_formats_without_inf_and_keeps_nan(target, fmax, has_inf):
    big = np.float32(2 * fmax)
    x = jnp.array([big, -big, np.inf, -np.inf, np.nan, 1.3, fmax], jnp.float32)
    y = f64(ts.cast(x, target))
    out_of_range = np.inf if has_inf else fmax
    np.testing.assert_array_equal(y[[0, 1, 2, 3]], [out_of_range, -out_of_range] * 2)
    assert np.isnan(y[4])
    np.testing.assert_array_equal(y[6], fmax)  # the largest finite value is kept
    # in range: the format's round-to-nearest-even value
    np.testing.assert_array_equal(y[5], float(np.float32(1.3).astype(target.grid)))
    np.testing.assert_array_equal(f64(jax.jit(lambda x: ts.cast(x, target))(x)), y)
    if not has_inf:  # stochastic rounding saturates the same way
        ys = f64(ts.cast(x, target, key=jax.random.key(1)))
        np.testing.assert_array_equal(ys[[0, 1, 2, 3]], [fmax, -fmax] * 2)
        assert np.isnan(ys[4])


@pytest.mark.parametrize("policy", [ts.fp8_e4m3, ts.fp8_e5m2, ts.fp6, ts.bf16])
def test_quantize_with_nan_and_inf_keeps_the_finite_elements(policy):
    clean = rand((4, 8))
    bad = clean.at[1, 3].set(jnp.nan).at[2, 5].set(jnp.inf).at[0, 0].set(-jnp.inf)
    filled = bad.at[1, 3].set(0.0).at[2, 5].set(0.0).at[0, 0].set(0.0)
    qb, qf = ts.quantize(bad, policy), ts.quantize(filled, policy)
    np.testing.assert_array_equal(f64(qb.scale), f64(qf.scale))  # amax of the finite ones
    finite = np.isfinite(f64(bad))
    np.testing.assert_array_equal(f64(qb.values)[finite], f64(qf.values)[finite])
    back = f64(ts.dequantize(qb))
    assert np.isnan(back[1, 3])
    fmt_has_inf = policy in (ts.fp8_e5m2, ts.bf16)
    if fmt_has_inf:
        assert back[2, 5] == np.inf and back[0, 0] == -np.inf
    else:  # saturated at the largest magnitude the scale represents
        assert back[2, 5] == -back[0, 0] == np.max(np.abs(back[finite]))


def test_quantize_int8_with_nan_gives_a_nan_scale():
    x = rand((4, 8)).at[1, 3].set(jnp.nan)
    q = ts.quantize(x, ts.int8)
    assert np.isnan(f64(q.scale)) and np.all(np.isnan(f64(ts.dequantize(q))))
    finite = ts.quantize(rand((4, 8)), ts.int8)
    assert np.isfinite(f64(finite.scale))


def test_quantize_of_an_empty_array():
    q = ts.quantize(jnp.ones((0, 3)), ts.fp8_e4m3)
    assert q.values.shape == (0, 3) and f64(q.scale) == 1.0
    assert ts.dequantize(q).shape == (0, 3)
