"""ts dtypes, policy composition, cast (round-to-nearest and stochastic)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tessera_jax as ts
from tests._util import rand

GRIDS = {
    ts.bf16: jnp.bfloat16,
    ts.f16: np.float16,
    ts.fp8_e4m3: ml_dtypes.float8_e4m3fn,
    ts.fp8_e5m2: ml_dtypes.float8_e5m2,
    ts.fp6_e3m2: ml_dtypes.float6_e3m2fn,
}


def test_policy_composition_and_repr():
    p = ts.bf16 @ ts.accum(ts.f32) @ ts.stochastic_round
    assert (p.storage, p.accumulate, p.stochastic_round, p.loss_scale) == (
        ts.bf16,
        ts.f32,
        True,
        None,
    )
    q = ts.fp6_e3m2 @ ts.accum(ts.f32) @ ts.loss_scale(128.0)
    assert q.loss_scale == 128.0 and q.dtype == jnp.float8_e4m3fn
    assert repr(ts.fp8_e4m3 @ ts.accum(ts.f32)) == "ts.fp8_e4m3 @ ts.accum(ts.f32)"
    assert ts.fp6 is ts.fp6_e3m2


def test_ts_dtypes_are_usable_as_jnp_dtypes():
    x = rand((3,))
    assert x.astype(ts.bf16).dtype == jnp.bfloat16
    assert jnp.zeros(2, ts.fp8_e4m3).dtype == jnp.float8_e4m3fn
    assert x.astype(ts.bf16 @ ts.accum(ts.f32)).dtype == jnp.bfloat16


def test_bad_policy_modifiers():
    with pytest.raises(TypeError, match="policy composition: cannot apply"):
        ts.bf16 @ ts.f32
    with pytest.raises(ValueError, match="loss_scale: scale=-1.0 must be a positive finite"):
        ts.loss_scale(-1.0)
    with pytest.raises(TypeError, match="unknown dtype 'fp7'"):
        ts.cast(rand((2,)), "fp7")


@pytest.mark.parametrize("target", list(GRIDS), ids=lambda t: t.name)
def test_round_to_nearest_matches_ml_dtypes(target):
    x = rand((4096,), scale=4.0)
    got = np.asarray(ts.cast(x, target)).astype(np.float32)
    want = np.asarray(x).astype(GRIDS[target]).astype(np.float32)
    finite = np.isfinite(want)  # e4m3fn/fp6 saturate where ml_dtypes gives nan
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.all(np.isfinite(got))


def _ulp(x, target):
    """Grid spacing of ``target`` at |x| (1 for integers), in float64."""
    if target is ts.int8:
        return np.ones_like(x)
    fi = ml_dtypes.finfo(GRIDS[target])
    e = np.maximum(np.floor(np.log2(np.abs(x))), fi.minexp)
    return 2.0 ** (e - fi.nmant)


@pytest.mark.parametrize("target", [*GRIDS, ts.int8], ids=lambda t: t.name)
def test_stochastic_rounding_is_unbiased_and_on_the_grid(target):
    x = rand((512,), scale=2.0)
    keys = jax.random.split(jax.random.key(7), 4000)
    outs = jax.jit(jax.vmap(lambda k: ts.cast(x, target, key=k).astype(jnp.float32)))(keys)
    outs, xd = np.asarray(outs, np.float64), np.asarray(x, np.float64)
    ulp = _ulp(xd, target)
    # Every sample is one of the two grid neighbours of x: within one ulp, on the grid.
    assert np.all(np.abs(outs - xd) < ulp * (1 + 1e-6))
    if target is not ts.int8:
        grid = GRIDS[target]
        np.testing.assert_array_equal(outs[:8].astype(grid).astype(np.float64), outs[:8])
    # Unbiased: per element the mean is within 5 standard errors of x (variance ≤ ulp²/4).
    err = outs.mean(0) - xd
    assert np.all(np.abs(err) <= 5 * ulp * 0.5 / np.sqrt(outs.shape[0]))
    assert abs(np.mean(err / ulp)) < 5 * 0.5 / np.sqrt(outs.size)


def test_stochastic_policy_needs_a_key_and_same_key_same_bits():
    p = ts.bf16 @ ts.accum(ts.f32) @ ts.stochastic_round
    x = rand((64,))
    with pytest.raises(ValueError, match="rounds stochastically; pass key="):
        ts.cast(x, p)
    k = jax.random.key(3)
    np.testing.assert_array_equal(
        np.asarray(ts.cast(x, p, key=k)), np.asarray(ts.cast(x, p, key=k))
    )


def test_cast_derivative_is_straight_through(x64):
    x, t = rand((5,)).astype(jnp.float64), rand((5,)).astype(jnp.float64)
    _, ty = jax.jvp(lambda x: ts.cast(x, ts.f32), (x,), (t,))
    assert ty.dtype == jnp.float32
    np.testing.assert_array_equal(ty, t.astype(jnp.float32))
    _, vjp = jax.vjp(lambda x: ts.cast(x, ts.bf16), x)
    (ct,) = vjp(jnp.ones(5, jnp.bfloat16) * 3)
    assert ct.dtype == jnp.float64
    np.testing.assert_array_equal(ct, np.full(5, 3.0))
    # Second order through a cast: d²/dx² of cast(x)² is 2.
    h = jax.grad(jax.grad(lambda x: ts.cast(x, ts.f32) ** 2))(jnp.float64(1.5))
    assert float(h) == 2.0
    g = jax.grad(lambda x: jnp.sum(ts.cast(x, ts.bf16, key=jax.random.key(0)).astype(jnp.float32)))
    np.testing.assert_array_equal(g(rand((5,))), np.ones(5, np.float32))


def test_cast_vmap_and_jaxpr():
    x = rand((4, 6))
    keys = jax.random.split(jax.random.key(1), 4)
    out = jax.vmap(lambda r, k: ts.cast(r, ts.fp8_e4m3, key=k))(x, keys)
    assert out.shape == (4, 6) and out.dtype == jnp.float8_e4m3fn
    assert "ts_cast" in str(jax.make_jaxpr(lambda x: ts.cast(x, ts.bf16))(x))
    np.testing.assert_array_equal(
        jax.vmap(lambda r: ts.cast(r, ts.f16), 1, 1)(x), ts.cast(x, ts.f16)
    )


def test_complex_to_real_is_refused():
    with pytest.raises(TypeError, match="cast: x.dtype=complex64 is complex"):
        ts.cast(jnp.ones(2, jnp.complex64), ts.f32)
