"""Precision policies and quantization: the seed's QuantizedPolicy, built-in per-tensor fp8 /
fp6 / int8 scaling (round-trip error bounds), QuantizedTensor as a pytree, and ts.matmul on
quantized operands against the dequantized float64 reference."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tessera_jax as ts
from tessera_jax.numerics.policy import ScaledPolicy
from tests._util import f64, rand, rel_err, sample, sample_grid, seed003_quantized_policy

F8E4, F8E5 = jnp.float8_e4m3fn, jnp.float8_e5m2


# The seed's example (003, "Custom Numeric Policies"), shared with tests/test_seeds.py.
QuantizedPolicy = seed003_quantized_policy()


# --- the seed's policy --------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64,), (16, 32), (2, 8, 24)])
def test_seed_quantized_policy_round_trip(shape):
    x = rand(shape, scale=3.0)
    qt = ts.quantize(x, QuantizedPolicy)
    assert isinstance(qt, ts.QuantizedTensor)
    assert qt.shape == shape and qt.dtype == np.int8 and qt.values.dtype == jnp.int8
    assert qt.scale.shape == () and qt.scale.dtype == jnp.float32
    scale = float(qt.scale)
    np.testing.assert_allclose(scale, np.max(np.abs(f64(x))) / 127.0, rtol=1e-6)
    back = ts.dequantize(qt)
    assert back.dtype == jnp.float32 and back.shape == shape
    # Round to nearest: every element within half a quantization step.
    assert np.max(np.abs(f64(back) - f64(x))) <= scale / 2 * (1 + 1e-5)
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), np.asarray(back))
    assert int(np.max(np.abs(np.asarray(qt.values).astype(np.int32)))) == 127


def test_seed_policy_under_jit_and_as_a_dtype():
    x = rand((8, 8))
    qt = jax.jit(lambda x: ts.quantize(x, QuantizedPolicy))(x)
    assert qt.policy is QuantizedPolicy and qt.dtype == np.int8
    assert np.dtype(QuantizedPolicy) == np.int8
    assert x.astype(ts.int8).dtype == jnp.int8
    assert QuantizedPolicy.storage is ts.int8 and QuantizedPolicy.accumulate is ts.f32
    back = jax.jit(ts.dequantize)(qt)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(ts.dequantize(qt)))


# --- built-in per-tensor scaling ----------------------------------------------------------

# storage -> (format max, relative half-ulp above the normal range, smallest normal)
BUILTIN = {
    "e4m3": (ts.fp8_e4m3, 448.0, 2.0**-4, 2.0**-6),
    "e5m2": (ts.fp8_e5m2, 57344.0, 2.0**-3, 2.0**-14),
    "fp6": (ts.fp6, 28.0, 2.0**-3, 2.0**-2),
}


@pytest.mark.parametrize(
    *sample_grid(
        6, name=sorted(BUILTIN), shape=[(257,), (16, 48)], dtype=[jnp.float32, jnp.bfloat16]
    )
)
def test_builtin_float_round_trip_bounds(name, shape, dtype):
    storage, fmax, rel, tiny = BUILTIN[name]
    x = rand(shape, dtype, scale=5.0)
    qt = ts.quantize(x, storage)
    assert qt.dtype == storage.container and qt.scale.dtype == jnp.float32
    scale = float(qt.scale)
    np.testing.assert_allclose(scale, np.max(np.abs(f64(x))) / fmax, rtol=1e-6)
    v = f64(qt.values)
    assert np.max(np.abs(v)) <= fmax and np.max(np.abs(v)) >= fmax * (1 - rel)
    if storage.grid != storage.container:  # fp6 values lie on the fp6 grid
        on_grid = v.astype(ml_dtypes.float6_e3m2fn).astype(np.float64)
        np.testing.assert_array_equal(on_grid, v)
    back = f64(ts.dequantize(qt))
    xs = f64(x)
    # Half an ulp of the format at |x|/scale, relative above its normal range and absolute
    # (half the subnormal spacing, scaled) below it.
    bound = np.maximum(rel * np.abs(xs), scale * tiny * rel)
    assert np.all(np.abs(back - xs) <= bound * (1 + 1e-6))


def test_builtin_int8_and_wide_storage():
    x = rand((40, 30), scale=2.0)
    qt = ts.quantize(x, ts.int8)
    assert qt.dtype == np.int8
    assert np.max(np.abs(f64(ts.dequantize(qt)) - f64(x))) <= float(qt.scale) / 2 * (1 + 1e-6)
    qb = ts.quantize(x, ts.bf16)
    assert qb.dtype == jnp.bfloat16 and float(qb.scale) == 1.0
    assert rel_err(ts.dequantize(qb), f64(x)) <= 2.0**-8


def test_policy_with_accumulate_and_zero_input():
    p = ts.fp8_e4m3 @ ts.accum(ts.f32)
    qt = ts.quantize(rand((4, 4)), p)
    assert isinstance(qt.policy, ScaledPolicy) and qt.policy.accumulate is ts.f32
    qz = ts.quantize(jnp.zeros((3, 3)), p)
    assert float(qz.scale) == 1.0
    np.testing.assert_array_equal(f64(ts.dequantize(qz)), np.zeros((3, 3)))


def test_saturation_never_makes_nan():
    x = jnp.array([1e30, -1e30, 1.0, 0.0], jnp.float32)
    for storage in (ts.fp8_e4m3, ts.fp8_e5m2):
        qt = ts.quantize(x, storage)
        assert np.all(np.isfinite(f64(qt.values)))


def test_stochastic_policy_needs_a_key_and_is_unbiased():
    p = ts.fp8_e4m3 @ ts.stochastic_round
    x = rand((64,))
    with pytest.raises(ValueError, match="key=jax.random.key"):
        ts.quantize(x, p)
    keys = jax.random.split(jax.random.key(7), 512)
    backs = jax.vmap(lambda k: ts.dequantize(ts.quantize(x, p, key=k)))(keys)
    mean = np.mean(f64(backs), axis=0)
    scale = np.max(np.abs(f64(x))) / 448
    # Unbiased: the mean of 512 draws is within a few standard errors of x.
    ulp = np.maximum(np.abs(f64(x)) * 2.0**-3, scale * 2.0**-9)
    assert np.all(np.abs(mean - f64(x)) <= 5 * ulp / np.sqrt(512) + 1e-7)
    assert not np.all(np.asarray(backs[0]) == np.asarray(backs[1]))


def test_straight_through_gradient():
    # A scale in fp8's normal range: the fp8 tangent of the values carries 3 mantissa bits.
    x = rand((6, 6), scale=300.0)
    g = jax.grad(lambda x: jnp.sum(ts.dequantize(ts.quantize(x, ts.fp8_e4m3))))(x)
    # d dequantize(quantize(x)) / dx = 1 up to the fp8 rounding of the tangent.
    np.testing.assert_allclose(np.asarray(g), 1.0, rtol=2.0**-4)
    # Integer storage is not differentiable (the built-in scale is under stop_gradient).
    gi = jax.grad(lambda x: jnp.sum(ts.dequantize(ts.quantize(x, ts.int8))))(x)
    np.testing.assert_array_equal(np.asarray(gi), 0.0)


# --- QuantizedTensor ----------------------------------------------------------------------


def test_quantized_tensor_is_a_pytree():
    qt = ts.quantize(rand((4, 6)), ts.fp8_e4m3)
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    assert len(leaves) == 2 and leaves[0].dtype == F8E4 and leaves[1].shape == ()
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, ts.QuantizedTensor) and again.policy == qt.policy
    out = jax.jit(lambda q: q)(qt)
    assert isinstance(out, ts.QuantizedTensor) and out.shape == (4, 6)
    batched = jax.vmap(lambda x: ts.quantize(x, ts.fp8_e4m3))(rand((3, 4, 6)))
    assert batched.shape == (3, 4, 6) and batched.scale.shape == (3,)
    assert qt.ndim == 2 and qt.size == 24 and "float8_e4m3fn" in repr(qt)
    assert qt.T.shape == (6, 4) and qt.mT.shape == (6, 4)
    np.testing.assert_array_equal(f64(qt.T.dequantize()), f64(qt.dequantize()).T)


def test_precision_policy_validation():
    with pytest.raises(TypeError, match="define the class attribute storage"):

        @ts.precision_policy
        class NoStorage:
            compute = ts.f32

    with pytest.raises(TypeError, match="define both quantize"):

        @ts.precision_policy
        class HalfDefined:
            storage = ts.int8

            def quantize(self, x):
                return x, 1.0

    with pytest.raises(TypeError, match="decorates a class"):
        ts.precision_policy(3)

    @ts.precision_policy
    class WrongDtype:
        storage = ts.int8

        def quantize(self, x):
            return x, jnp.float32(1.0)

        def dequantize(self, x, scale):
            return x

    with pytest.raises(TypeError, match=re.escape("returned values of dtype float32")):
        ts.quantize(rand((3,)), WrongDtype)

    class Undecorated:
        storage = ts.int8

        def quantize(self, x):
            return x, 1.0

    with pytest.raises(TypeError, match="not decorated with @ts.precision_policy"):
        ts.quantize(rand((3,)), Undecorated)
    with pytest.raises(TypeError, match="x.dtype=int32 must be a float dtype"):
        ts.quantize(jnp.ones((3,), jnp.int32), ts.fp8_e4m3)
    with pytest.raises(TypeError, match="expected a QuantizedTensor"):
        ts.dequantize(rand((3,)))


def test_policy_without_methods_gets_builtin_scaling():
    @ts.precision_policy
    class Fp8Weights:
        storage = ts.fp8_e4m3
        accumulate = ts.f32

    x = rand((8, 8))
    qt = ts.quantize(x, Fp8Weights)
    assert qt.dtype == F8E4 and qt.spec.linear_scale
    assert rel_err(ts.dequantize(qt), f64(x)) <= 2.0**-4


# --- matmul on quantized operands ---------------------------------------------------------


def dequant_ref(x):
    return f64(ts.dequantize(x)) if isinstance(x, ts.QuantizedTensor) else f64(x)


def assert_product_close(out, a, b, k, out_eps=2.0**-23):
    ref = np.matmul(dequant_ref(a), dequant_ref(b))
    err = rel_err(out, ref)
    assert err <= out_eps + 2 * 2.0**-23 * np.sqrt(k), f"relative error {err:.3e}"


@pytest.mark.parametrize(
    "pa,pb",
    [
        (ts.fp8_e4m3, ts.fp8_e4m3),
        (ts.fp8_e4m3 @ ts.accum(ts.f32), ts.fp8_e5m2),
        (ts.fp8_e5m2, ts.fp8_e4m3),
        (ts.fp6, ts.fp8_e4m3),
    ],
)
@pytest.mark.parametrize("mkn", sample([(32, 64, 16), (200, 136, 96)], 1))
def test_fp8_path_uses_the_scale_on_the_accumulator(pa, pb, mkn):
    m, k, n = mkn
    a = ts.quantize(rand((m, k), scale=3.0), pa)
    b = ts.quantize(rand((k, n), scale=0.5), pb)
    out = ts.matmul(a, b)
    assert out.dtype == jnp.float32 and out.shape == (m, n)
    assert_product_close(out, a, b, k)
    (eqn,) = [
        e for e in jax.make_jaxpr(ts.matmul)(a, b).jaxpr.eqns if e.primitive.name == "ts_matmul"
    ]
    spec = eqn.params["spec"]
    assert spec.has_scale and spec.accumulate_dtype == np.float32
    assert [v.aval.dtype for v in eqn.invars[:2]] == [a.dtype, b.dtype]


def test_fp8_quantized_times_plain_fp8_and_transposed():
    a = ts.quantize(rand((24, 40)), ts.fp8_e4m3)
    b = rand((40, 8), F8E5)
    assert_product_close(ts.matmul(a, b), a, b, 40)
    assert_product_close(ts.matmul(b.T, a.T), b.T, a.T, 40)
    bt = ts.quantize(rand((8, 40)), ts.fp8_e4m3)
    assert_product_close(ts.matmul(a, bt.T), a, bt.T, 40)


def test_int8_policy_dequantizes_to_compute_dtype():
    x = rand((16, 48))
    w = ts.quantize(rand((48, 12)), QuantizedPolicy)
    out = ts.matmul(x, w)
    assert out.dtype == jnp.float32
    assert_product_close(out, x, w, 48)
    both = ts.matmul(ts.quantize(x, QuantizedPolicy), w)
    assert_product_close(both, ts.quantize(x, QuantizedPolicy), w, 48)
    eqns = [
        e for e in jax.make_jaxpr(ts.matmul)(x, w).jaxpr.eqns if e.primitive.name == "ts_matmul"
    ]
    spec = eqns[0].params["spec"]
    assert spec.accumulate_dtype == np.float32 and not spec.has_scale
    # A bf16 activation against the int8 weight computes in the policy's f32.
    assert_product_close(ts.matmul(x.astype(jnp.bfloat16), w), x.astype(jnp.bfloat16), w, 48)


def test_linear_and_grad_with_quantized_weights():
    x, b = rand((10, 32)), rand((16,))
    w = ts.quantize(rand((32, 16)), ts.fp8_e4m3 @ ts.accum(ts.f32))
    out = ts.op.linear(x.astype(F8E4), w, b, activation="relu")
    ref = np.maximum(np.matmul(f64(x.astype(F8E4)), dequant_ref(w)) + f64(b), 0)
    assert out.dtype == jnp.float32 and rel_err(out, ref) <= 1e-5
    # Gradients with respect to the float operand of a product with quantized weights.
    wq = ts.quantize(rand((32, 16)), QuantizedPolicy)
    g = jax.grad(lambda x: jnp.sum(ts.matmul(x, wq)))(x)
    ref_g = np.broadcast_to(dequant_ref(wq).sum(1)[None, :], g.shape)
    np.testing.assert_allclose(f64(g), ref_g, rtol=1e-5, atol=1e-5)


def test_quantized_operand_errors():
    a = ts.quantize(rand((4, 5)), ts.fp8_e4m3)
    with pytest.raises(ValueError, match=re.escape("A.shape[-1]=5 must equal B.shape[-2]=6")):
        ts.matmul(a, ts.quantize(rand((6, 3)), ts.fp8_e4m3))
    with pytest.raises(TypeError, match="cannot be multiplied with a QuantizedTensor"):
        ts.matmul(ts.quantize(rand((4, 5)), QuantizedPolicy), jnp.ones((5, 3), jnp.int8))


def test_gradient_through_the_fp8_path():
    # The fp8 values' cotangents come from ts_matmul transposes of an f32 cotangent against
    # fp8 operands (mixed dtypes in the backward product), held in fp8 per JAX's rule that a
    # tangent has its primal's dtype: accurate to the format's precision while they fit its
    # range (here |scale_a·Σ w| and |scale_b·Σ x| are O(1)).
    x, w = rand((16, 32), scale=200.0), rand((32, 8))

    def loss(x, w):
        return jnp.sum(ts.matmul(ts.quantize(x, ts.fp8_e4m3), ts.quantize(w, ts.fp8_e4m3)))

    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    qx, qw = ts.quantize(x, ts.fp8_e4m3), ts.quantize(w, ts.fp8_e4m3)
    ref_gx = np.broadcast_to(dequant_ref(qw).sum(1)[None, :], gx.shape)
    ref_gw = np.broadcast_to(dequant_ref(qx).sum(0)[:, None], gw.shape)
    assert rel_err(gx, ref_gx) <= 2.0**-4 and rel_err(gw, ref_gw) <= 2.0**-4


def test_vmap_over_quantized_operands_maps_the_scale():
    # Each example quantized on its own: a mapped scale, applied after a batched product.
    xs, w = rand((3, 8, 16)), ts.quantize(rand((16, 4)), ts.fp8_e4m3)
    out = jax.vmap(lambda x: ts.matmul(ts.quantize(x, ts.fp8_e4m3), w))(xs)
    ref = np.stack(
        [np.matmul(dequant_ref(ts.quantize(x, ts.fp8_e4m3)), dequant_ref(w)) for x in xs]
    )
    assert out.shape == (3, 8, 4) and rel_err(out, ref) <= 1e-5
