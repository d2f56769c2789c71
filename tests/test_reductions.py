"""sum / max / mse: float64 references, the canonical tree bit for bit, derivatives, vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.test_util import check_grads

import tessera_jax as ts
from tessera_jax.primitives import reductions
from tessera_jax.primitives.reductions import canonical_sum, fixed_point_sum
from tests._util import assert_close, cuda_lowering, f64, np_tree, rand


def numpy_canonical_tree(x: np.ndarray) -> np.ndarray:
    """The documented tree over the last axis (the shared NumPy tree, written independently
    of the library)."""
    return np_tree(np.moveaxis(x, -1, 0))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 1000])
def test_sum_is_the_canonical_tree_bit_for_bit(n):
    x = rand((3, n))
    got = np.asarray(ts.sum(x, axis=1))
    want = numpy_canonical_tree(np.asarray(x))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: ts.sum(x, 1))(x)), want)


def _unit_values(n: int, dtype) -> np.ndarray:
    """Three rows of ``n`` softmax-like values in (0, 1] spread over many binades, a 1 in
    each (the row maximum's probability)."""
    rng = np.random.default_rng(n)
    x = np.exp(-rng.exponential(4.0, size=(3, n)))
    x[:, 0] = 1.0
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 128, 4096, 1 << 19])
def test_fixed_point_sum_is_order_free_and_accurate(n, dtype, x64):
    x = _unit_values(n, dtype)
    got = np.asarray(fixed_point_sum(jnp.asarray(x)))
    assert got.dtype == dtype and got.shape == (3, 1)
    perm = np.random.default_rng(0).permutation(n)
    np.testing.assert_array_equal(np.asarray(fixed_point_sum(jnp.asarray(x[:, perm]))), got)
    exact = x.astype(np.float64).sum(-1, keepdims=True)
    # the digits' truncation is below a quarter ulp, then one rounding per digit column
    np.testing.assert_allclose(got, exact, rtol=2 * np.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("n", [7, 32, 33, 1000, 4097])
def test_fixed_point_sum_in_two_stages_has_the_same_bits(n):
    """The CPU's two-stage digit sums (runs of 32 zero-padded, then their sums) and one
    reduction per digit column: exact integers, so the same bits."""
    x = jnp.asarray(_unit_values(n, np.float32))
    one = jax.jit(lambda x: reductions._fixed_point_sum(x, lanes=None))(x)
    two = jax.jit(lambda x: reductions._fixed_point_sum(x, lanes=reductions._CPU_LANES))(x)
    np.testing.assert_array_equal(np.asarray(two), np.asarray(one))
    np.testing.assert_array_equal(np.asarray(jax.jit(fixed_point_sum)(x)), np.asarray(one))


def test_fixed_point_sum_two_stages_only_on_the_cpu():
    """The CPU lowering holds the two stages' barrier; a cuda lowering the single reduction."""
    x = jnp.asarray(_unit_values(100, np.float32))
    cpu = jax.jit(fixed_point_sum).trace(x).lower(lowering_platforms=("cpu",)).as_text()
    assert "optimization_barrier" in cpu
    assert "optimization_barrier" not in cuda_lowering(fixed_point_sum, x)


def test_fixed_point_sum_takes_values_just_below_two():
    # the largest values the digits leave room for, in a row as long as a digit allows
    n = (1 << 19) - 1
    x = jnp.full((1, n), np.nextafter(np.float32(2), np.float32(0)), jnp.float32)
    got = float(fixed_point_sum(x)[0, 0])
    assert got == pytest.approx(2.0 * n, rel=1e-6)


def test_sum_over_several_axes_flattens_them_row_major():
    x = rand((4, 3, 5))
    got = np.asarray(ts.sum(x, axis=(0, 2)))
    want = numpy_canonical_tree(np.moveaxis(np.asarray(x), 1, 0).reshape(3, 20))
    np.testing.assert_array_equal(got, want)


def test_subtree_of_aligned_block_composes():
    # A block of 2**k leaves at a multiple of 2**k is a complete subtree: summing
    # blocks first and then their partial sums on the same tree gives the same bits.
    x = rand((64,))
    blocks = jnp.stack([ts.sum(x[i : i + 16]) for i in range(0, 64, 16)])
    np.testing.assert_array_equal(np.asarray(ts.sum(blocks)), np.asarray(ts.sum(x)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, True), ((1, 2), False), (-1, True)])
def test_sum_and_max_match_float64(dtype, axis, keepdims):
    x = rand((4, 6, 5), dtype)
    ref = f64(x)
    assert_close(ts.sum(x, axis, keepdims), np.sum(ref, axis=axis, keepdims=keepdims), factor=3)
    out = ts.max(x, axis, keepdims)
    assert out.dtype == dtype
    np.testing.assert_array_equal(f64(out), np.max(ref, axis=axis, keepdims=keepdims))


def test_sum_nondeterministic_uses_xla_and_agrees():
    x = rand((100,))
    np.testing.assert_allclose(ts.sum(x, deterministic=False), np.sum(f64(x)), rtol=1e-5)


def test_sum_of_integers_is_exact():
    x = jnp.arange(100, dtype=jnp.int32)
    assert int(ts.sum(x)) == 4950


def test_bf16_accumulates_in_f32():
    x = jnp.full((4096,), 1.0, jnp.bfloat16) + rand((4096,), jnp.bfloat16) * 0.01
    want = canonical_sum(x.astype(jnp.float32), (0,), False).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(ts.sum(x)), np.asarray(want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mse_matches_float64(dtype):
    p, t = rand((8, 5), dtype), rand((8, 5), dtype)
    assert_close(ts.mse(p, t), np.mean((f64(p) - f64(t)) ** 2))


def test_gradients(x64):
    x = rand((4, 5)).astype(jnp.float64)
    y = rand((4, 5)).astype(jnp.float64)
    # Jitted: check_grads of an eager function compiles each operation of every derivative.
    check_grads(jax.jit(lambda x: ts.sum(x * x, axis=1)), (x,), order=2)
    check_grads(jax.jit(lambda x: ts.sum(x, axis=(0, 1), keepdims=True)), (x,), order=2)
    check_grads(jax.jit(lambda x: ts.max(x, axis=0)), (x,), order=2)
    check_grads(jax.jit(ts.mse), (x, y), order=2)


def test_max_splits_gradient_between_ties():
    g = jax.grad(lambda x: ts.max(x))(jnp.array([1.0, 3.0, 3.0]))
    np.testing.assert_array_equal(g, [0.0, 0.5, 0.5])


def test_vmap_grad_of_vmap():
    x, y = rand((6, 4, 3)), rand((6, 4, 3))
    np.testing.assert_allclose(
        jax.vmap(lambda a: ts.sum(a, 1), in_axes=2, out_axes=1)(x), ts.sum(x, 1), rtol=1e-6
    )
    np.testing.assert_allclose(
        jax.vmap(ts.mse)(x, y), np.mean((f64(x) - f64(y)) ** 2, axis=(1, 2)), rtol=1e-5
    )
    g1 = jax.vmap(jax.grad(ts.mse))(x, y)
    g2 = jax.grad(lambda x: jnp.sum(jax.vmap(ts.mse)(x, y)))(x)
    np.testing.assert_allclose(g1, g2, rtol=1e-6)
    np.testing.assert_allclose(g1, 2 * (f64(x) - f64(y)) / 12, rtol=1e-5)
    gm = jax.vmap(jax.grad(lambda r: ts.max(r)), in_axes=1)(x)
    assert gm.shape == (4, 6, 3)


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), data=st.data())
def test_sum_hypothesis_shapes(shape, data):
    axes = data.draw(st.sets(st.integers(0, len(shape) - 1)))
    axis = tuple(sorted(axes)) or None
    x = rand(tuple(shape))
    np.testing.assert_allclose(ts.sum(x, axis), np.sum(f64(x), axis=axis), rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    x = rand((3, 4))
    with pytest.raises(ValueError, match="sum: axis=2 is out of range for an array of rank 2"):
        ts.sum(x, 2)
    with pytest.raises(ValueError, match=r"sum: axis=\(0, 0\) repeats an axis"):
        ts.sum(x, (0, 0))
    with pytest.raises(
        ValueError, match=r"mse: pred.shape=\(3, 4\) must equal target.shape=\(4,\)"
    ):
        ts.mse(x, rand((4,)))
    with pytest.raises(TypeError, match="mse: pred.dtype=float32 must equal target.dtype=bfloat16"):
        ts.mse(x, x.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="max: cannot reduce a zero-size axis"):
        ts.max(jnp.zeros((0, 3)), 0)
    with pytest.raises(TypeError, match="sum: x.dtype=bool is not supported"):
        ts.sum(jnp.ones(3, bool))


def test_mse_vmapped_over_an_empty_batch():
    """No examples: an empty result (its per-example rows are flattened by count, not -1)."""
    x = jnp.ones((0, 4, 3), jnp.float32)
    assert jax.jit(jax.vmap(ts.mse))(x, x).shape == (0,)
