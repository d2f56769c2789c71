"""rmsnorm / rmsnorm_safe / layernorm: float64 references, zero rows, derivatives, vmap, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.test_util import check_grads

import tessera_jax as ts
from tessera_jax.primitives import norms
from tests._util import assert_close, f64, rand, sample, sample_grid

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SHAPES = [(7,), (4, 33), (2, 3, 128)]


def np_rmsnorm(x, w=None, eps=1e-6):
    ms = np.mean(x * x, axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        r = np.where(ms + eps > 0, 1.0 / np.sqrt(ms + eps), 0.0)
    return x * r * (1.0 if w is None else w)


def np_layernorm(x, w=None, b=None, eps=1e-5):
    c = x - np.mean(x, axis=-1, keepdims=True)
    y = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps)
    return y * (1.0 if w is None else w) + (0.0 if b is None else b)


@pytest.mark.parametrize(*sample_grid(5, dtype=DTYPES, shape=SHAPES))
def test_match_float64(dtype, shape):
    d = shape[-1]
    x = rand(shape, dtype, scale=2.0) + 0.5
    w, b = rand((d,), dtype), rand((d,), dtype)
    out = ts.rmsnorm(x, w)
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, np_rmsnorm(f64(x), f64(w)))
    assert_close(ts.rmsnorm_safe(x), np_rmsnorm(f64(x)))
    assert_close(ts.rmsnorm_safe(x, w, eps=0.0), np_rmsnorm(f64(x), f64(w), 0.0))
    out = ts.layernorm(x, w, b)
    assert out.dtype == dtype
    assert_close(out, np_layernorm(f64(x), f64(w), f64(b)), factor=2)
    assert_close(ts.layernorm(x, None, None, eps=1e-3), np_layernorm(f64(x), eps=1e-3), factor=2)


def test_f32_weight_with_bf16_activations():
    x, w, b = rand((4, 16), jnp.bfloat16), rand((16,)), rand((16,))
    out = ts.layernorm(x, w, b)
    assert out.dtype == jnp.bfloat16
    assert_close(out, np_layernorm(f64(x), f64(w), f64(b)))
    gw = jax.grad(lambda w: jnp.sum(ts.rmsnorm(x, w).astype(jnp.float32)))(w)
    assert gw.dtype == jnp.float32


@pytest.mark.xla_optimized  # bitwise against another program (tests/conftest.py)
@pytest.mark.parametrize("dtype", DTYPES)
def test_statistics_in_f32_rounded_once(dtype):
    x, w = rand((8, 256), dtype, scale=30.0), rand((256,), dtype)
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    want = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * wf[None]
    np.testing.assert_array_equal(f64(ts.rmsnorm(x, w)), f64(want.astype(dtype)))


@pytest.mark.parametrize("dtype", sample(DTYPES, 1))
def test_rmsnorm_safe_on_all_zero_rows(dtype):
    x = rand((3, 8), dtype).at[1].set(0)
    w = rand((8,), dtype)
    # (each transform jitted: one program, not one per op)
    for eps in (0.0, 1e-6):
        y = jax.jit(functools.partial(ts.rmsnorm_safe, eps=eps))(x, w)
        assert np.all(np.isfinite(f64(y)))
        np.testing.assert_array_equal(f64(y[1]), np.zeros(8))
        loss = lambda x, w, eps=eps: jnp.sum(ts.rmsnorm_safe(x, w, eps).astype(jnp.float32) ** 2)
        gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
        assert np.all(np.isfinite(f64(gx))) and np.all(np.isfinite(f64(gw)))
        np.testing.assert_array_equal(f64(gx[1]), np.zeros(8))
    # zero rows with eps = 0: zero gradients of every order, no NaN
    x64z = jnp.zeros((5,), jnp.float32)
    h = jax.jit(jax.hessian(lambda x: jnp.sum(ts.rmsnorm_safe(x, eps=0.0) ** 2)))(x64z)
    np.testing.assert_array_equal(h, np.zeros((5, 5)))
    # layernorm on a constant row (zero variance) is finite with eps > 0
    c = jnp.full((2, 8), 3.0, dtype)
    layer = lambda c: jnp.sum(ts.layernorm(c, w, w).astype(jnp.float32))
    y, g = jax.jit(jax.value_and_grad(layer))(c)
    assert np.isfinite(float(y)) and np.all(np.isfinite(f64(g)))


@pytest.mark.parametrize("guard_zero", [True, False], ids=["rms", "centred"])
def test_normalise_forms_agree(guard_zero):
    """The statistics' CPU form (a per-row scale) and their other form (both mean squares,
    then a select) give the same bits: ordinary rows, rows whose squares overflow, a zero
    row with eps = 0, rows holding inf or NaN."""
    v = rand((64, 1024)) * 3
    v = v.at[1].multiply(1e25).at[2].set(0).at[3, 1].set(jnp.inf).at[4, 2].set(jnp.nan)
    v = v.at[0, 0].set(3e38)
    rsqrt = norms._rsqrt_guarded if guard_zero else jax.lax.rsqrt
    eps = 0.0 if guard_zero else 1e-5
    forms = (norms._normalise_row_scale, norms._normalise_select)
    (a, ra), (b, rb) = (jax.jit(lambda v, f=f: f(v, eps=eps, rsqrt=rsqrt))(v) for f in forms)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(ra), np.asarray(rb))
    assert np.isnan(np.asarray(a)[3:5]).all() and np.isfinite(np.asarray(a)[:3]).all()


def test_each_platform_lowers_its_form_of_the_statistics():
    """The CPU lowers the per-row-scale form; cuda the form the GPU records ran."""
    v = rand((4, 8))

    def ops(f, platform):
        text = jax.jit(f).trace(v).lower(lowering_platforms=(platform,)).as_text()
        return text.count("stablehlo.multiply"), text.count("call @")

    forms = {"cpu": norms._normalise_row_scale, "cuda": norms._normalise_select}
    want = {p: ops(lambda v, f=f: f(v, eps=1e-6, rsqrt=jax.lax.rsqrt), p) for p, f in forms.items()}
    assert want["cpu"] != want["cuda"]
    for platform in forms:
        assert ops(lambda v: norms._normalise(v, 1e-6, False), platform) == want[platform]


@pytest.mark.parametrize("shape", [(64, 1024), (5, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norms_bits_do_not_depend_on_the_statistics_form(monkeypatch, shape, dtype):
    """rmsnorm and layernorm, forward and gradients, are the same bits with either form of
    the statistics (the CPU runs the per-row scale)."""
    x, w, b = rand(shape, dtype), rand(shape[-1:], dtype), rand(shape[-1:], dtype)
    ct = rand(shape)

    def outputs():
        jax.clear_caches()
        loss = lambda x, w, b: jnp.sum(
            (ts.rmsnorm(x, w).astype(jnp.float32) + ts.layernorm(x, w, b).astype(jnp.float32)) * ct
        )
        grads = jax.jit(jax.grad(loss, (0, 1, 2)))(x, w, b)
        return [np.asarray(y) for y in (ts.rmsnorm(x, w), ts.layernorm(x, w, b), *grads)]

    got = outputs()
    monkeypatch.setattr(norms, "_normalise_row_scale", norms._normalise_select)
    other = outputs()
    monkeypatch.undo()
    jax.clear_caches()  # no program of the patched form outlives the test
    for a, b in zip(got, other):
        np.testing.assert_array_equal(a, b)


# Second-order checks compile many small eager programs: a sample of the variants per run.
ORDER2 = {
    "rmsnorm": lambda x, w, b: (ts.rmsnorm, (x, w)),
    "rmsnorm_safe-eps0": lambda x, w, b: (lambda x: ts.rmsnorm_safe(x, eps=0.0), (x,)),
    "layernorm": lambda x, w, b: (ts.layernorm, (x, w, b)),
    "layernorm-no-weight": lambda x, w, b: (lambda x, b: ts.layernorm(x, None, b), (x, b)),
}


@pytest.mark.parametrize("variant", sample(sorted(ORDER2), 2))
def test_gradients_order_2(x64, variant):
    x = rand((3, 4, 6)).astype(jnp.float64)
    w, b = rand((6,)).astype(jnp.float64), rand((6,)).astype(jnp.float64)
    # Jitted: check_grads of an eager function compiles each operation of every derivative.
    fn, args = ORDER2[variant](x, w, b)
    check_grads(jax.jit(fn), args, order=2)


def test_jvp_formula():
    x, w, tx, tw = rand((4, 6)), rand((6,)), rand((4, 6)), rand((6,))
    _, dy = jax.jvp(ts.rmsnorm, (x, w), (tx, w * 0))
    xd, wd, td = f64(x), f64(w), f64(tx)
    r = 1 / np.sqrt(np.mean(xd * xd, -1, keepdims=True) + 1e-6)
    xhat = xd * r
    want = wd * r * (td - xhat * np.mean(xhat * td, -1, keepdims=True))
    np.testing.assert_allclose(dy, want, rtol=1e-5, atol=1e-5)
    _, dy = jax.jvp(lambda w: ts.rmsnorm(x, w), (w,), (tw,))
    np.testing.assert_allclose(dy, xhat * f64(tw), rtol=1e-5, atol=1e-6)


def test_vmap_jit_and_vmap_of_grad():
    x, w, b = rand((5, 4, 6)), rand((6,)), rand((6,))
    ref = np_layernorm(f64(x), f64(w), f64(b))
    for ax in (0, 1):
        got = jax.vmap(lambda r: ts.layernorm(r, w, b), in_axes=ax, out_axes=ax)(x)
        assert_close(got, ref, factor=2)
    # vmapping over x's last axis: each example is normalised over what was axis 1
    wt = rand((4,))
    got = jax.vmap(lambda r: ts.rmsnorm(r, wt), in_axes=2, out_axes=2)(x)
    assert_close(got, np.stack([np_rmsnorm(f64(x[..., i]), f64(wt)) for i in range(6)], -1))
    # batched weights: one weight per example
    W, B = rand((5, 6)), rand((5, 6))
    got = jax.vmap(ts.layernorm)(x, W, B)
    assert_close(got, np_layernorm(f64(x), f64(W)[:, None], f64(B)[:, None]), factor=2)
    assert_close(jax.jit(ts.rmsnorm)(x, w), np_rmsnorm(f64(x), f64(w)))
    loss = lambda x, w: jnp.sum(ts.rmsnorm(x, w) ** 2)
    gx, gw = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(x, w)
    assert gw.shape == (5, 6)
    gx2 = jax.grad(lambda x: jnp.sum(jax.vmap(loss, in_axes=(0, None))(x, w)))(x)
    np.testing.assert_allclose(gx, gx2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", sample(["rmsnorm", "layernorm"], 1))
def test_vmap_weight_gradients(x64, op):
    x, W, B = (rand(s).astype(jnp.float64) for s in ((3, 4, 6), (3, 6), (3, 6)))
    if op == "rmsnorm":
        check_grads(jax.jit(jax.vmap(ts.rmsnorm)), (x, W), order=2)
    else:
        check_grads(jax.jit(jax.vmap(ts.layernorm)), (x, W, B), order=2)


def test_jaxpr_shows_the_primitives():
    x, w = rand((3, 4)), rand((4,))
    assert "ts_rmsnorm[eps=1e-06 has_weight=True]" in str(jax.make_jaxpr(ts.rmsnorm)(x, w))
    assert "ts_rmsnorm[eps=0.0 has_weight=False]" in str(
        jax.make_jaxpr(lambda x: ts.rmsnorm_safe(x, eps=0.0))(x)
    )
    assert "ts_layernorm" in str(jax.make_jaxpr(ts.layernorm)(x, w, w))


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3))
def test_norms_hypothesis_shapes(shape):
    x = rand(tuple(shape), scale=2.0)
    w, b = rand(tuple(shape[-1:])), rand(tuple(shape[-1:]))
    assert_close(ts.rmsnorm(x, w), np_rmsnorm(f64(x), f64(w)), factor=2)
    assert_close(
        ts.layernorm(x, w, b, eps=1e-3), np_layernorm(f64(x), f64(w), f64(b), 1e-3), factor=4
    )


def test_bad_inputs():
    x, w = rand((3, 4)), rand((4,))
    with pytest.raises(ValueError, match=r"rmsnorm: weight.shape=\(3,\) must be \(D,\) = \(4,\)"):
        ts.rmsnorm(x, rand((3,)))
    with pytest.raises(ValueError, match=r"layernorm: bias.shape=\(1, 4\) must be \(D,\)"):
        ts.layernorm(x, w, rand((1, 4)))
    with pytest.raises(TypeError, match="rmsnorm: weight is required"):
        ts.rmsnorm(x, None)
    with pytest.raises(ValueError, match="rmsnorm: eps=0.0 must be a finite float > 0"):
        ts.rmsnorm(x, w, eps=0.0)
    with pytest.raises(ValueError, match="rmsnorm_safe: eps=-1.0 must be a finite float ≥ 0"):
        ts.rmsnorm_safe(x, eps=-1.0)
    with pytest.raises(ValueError, match="layernorm: eps=nan must be a finite float > 0"):
        ts.layernorm(x, w, w, eps=float("nan"))
    with pytest.raises(TypeError, match="layernorm: eps=.* must be a Python float"):
        ts.layernorm(x, w, w, eps=jnp.float32(1e-5) * jnp.ones(()))
    with pytest.raises(TypeError, match="rmsnorm: x.dtype=int32 is not supported"):
        ts.rmsnorm(jnp.ones((3, 4), jnp.int32), w)
    with pytest.raises(TypeError, match="layernorm: weight.dtype=int32 is not supported"):
        ts.layernorm(x, jnp.ones((4,), jnp.int32), w)
    with pytest.raises(ValueError, match="rmsnorm_safe: x must have at least one dimension"):
        ts.rmsnorm_safe(jnp.float32(2.0))
