"""fft / ifft: values against numpy.fft in float64, adjoints, vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import tessera_jax as ts
from tests._util import assert_close, f64, rand


def crand(shape, dtype=jnp.complex64):
    return jax.lax.complex(rand(shape), rand(shape)).astype(dtype)


@pytest.mark.parametrize("shape,axis", [((16,), -1), ((6, 10), 0), ((3, 7, 5), 1)])
def test_fft_ifft_match_numpy(shape, axis):
    x = crand(shape)
    out = ts.fft(x, axis)
    assert out.dtype == jnp.complex64
    assert_close(out, np.fft.fft(f64(x), axis=axis), rtol=1e-5)
    assert_close(ts.ifft(x, axis), np.fft.ifft(f64(x), axis=axis), rtol=1e-5)
    assert_close(ts.ifft(ts.fft(x, axis), axis), f64(x), rtol=1e-5)


def test_real_input_is_promoted():
    x = rand((8,))
    assert ts.fft(x).dtype == jnp.complex64
    assert_close(ts.fft(x), np.fft.fft(f64(x)), rtol=1e-5)


def test_adjoints(x64):
    x = crand((6, 8), jnp.complex128)
    # Jitted: check_grads of an eager function compiles each operation of every derivative.
    check_grads(jax.jit(lambda x: ts.fft(x, 0)), (x,), order=2, modes=("fwd", "rev"))
    check_grads(jax.jit(lambda x: ts.ifft(x * x, 1)), (x,), order=2, modes=("fwd", "rev"))
    r = rand((8,)).astype(jnp.float64)
    check_grads(jax.jit(lambda r: jnp.abs(ts.fft(r)) ** 2), (r,), order=1, modes=("rev",))


def test_vmap():
    x = crand((4, 8))
    np.testing.assert_allclose(
        jax.vmap(ts.fft, in_axes=1, out_axes=1)(x), ts.fft(x, 0), rtol=1e-5, atol=1e-5
    )
    assert "ts_fft" in str(jax.make_jaxpr(ts.fft)(x))


def test_bad_inputs():
    with pytest.raises(ValueError, match="fft: axis=2 is out of range for an array of rank 2"):
        ts.fft(crand((2, 3)), 2)
    with pytest.raises(TypeError, match="ifft: x.dtype=int32 is not supported"):
        ts.ifft(jnp.arange(4))
    with pytest.raises(ValueError, match="fft: x must have at least one dimension"):
        ts.fft(jnp.float32(1.0))
