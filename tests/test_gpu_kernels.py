"""Every compiled kernel against the float64 reference at small shapes, through the operators.

``TestKernelsGPU`` runs the cases of ``_KernelCases`` with the kernels compiled
(``TESSERA_KERNELS=pallas``) and carries the ``gpu`` marker: ``python -m pytest -m gpu`` on
a GPU host. ``TestKernelsInterpret`` runs the same cases in interpret mode on the CPU (the
Mosaic GPU interpreter for the Hopper kernel, Pallas interpret for the portable one). Each
case first asserts which kernel the operator chose, so a kernel that silently declined
would fail the test instead of testing the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tests._util import (
    assert_close,
    chosen_kernels,
    f64,
    np_activation,
    np_activation_derivative,
    np_tree,
    rand,
    skip_unsampled_twin,
)

# (M, K, N): whole tiles, and ragged edges in every dimension.
SHAPES = [(128, 128, 128), (72, 48, 40)]


def _chosen(f, *args) -> list[str]:
    """The implementation each ``ts_matmul`` in ``f``'s program lowers to."""
    return [impl for _, impl in chosen_kernels(f, *args, ops=("matmul",))]


def _ref_linear(x, w, b=None, residual=None, activation=None):
    z = f64(x) @ f64(w)
    if b is not None:
        z = z + f64(b)
    z = np_activation(z, activation)
    return z if residual is None else z + f64(residual)


class _KernelCases:
    MODE: str

    @pytest.fixture(autouse=True)
    def _mode(self):
        with ts.kernel_mode(self.MODE):
            yield

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    @pytest.mark.parametrize("mkn", SHAPES)
    def test_hopper_matmul(self, mkn, dtype):
        m, k, n = mkn
        a, b = rand((m, k), dtype), rand((k, n), dtype)
        assert _chosen(ts.matmul, a, b) == ["mosaic_gpu"]
        assert_close(jax.jit(ts.matmul)(a, b), f64(a) @ f64(b), factor=2)

    @pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh"])
    def test_hopper_fused_epilogue(self, activation):
        m, k, n = SHAPES[1]
        x, w = rand((m, k), jnp.bfloat16), rand((k, n), jnp.bfloat16)
        bias, res = rand((n,), jnp.float32), rand((m, n), jnp.bfloat16)
        f = functools.partial(ts.op.linear, activation=activation)
        g = lambda x, w, bias, res: f(x, w, bias, residual=res)
        assert _chosen(g, x, w, bias, res) == ["mosaic_gpu"]
        out = jax.jit(g)(x, w, bias, res)
        assert_close(out, _ref_linear(x, w, bias, res, activation), factor=2)

    @pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
    def test_hopper_differentiated_activation(self, activation):
        """Under jax.grad the forward is the two-output form on the kernel: y with the bits
        of the undifferentiated forward, and act'(z) in bf16 for the backward."""
        m, k, n = SHAPES[1]
        x, w = rand((m, k), jnp.bfloat16), rand((k, n), jnp.bfloat16, scale=0.3)
        bias, ct = rand((n,), jnp.bfloat16), rand((m, n), jnp.bfloat16)
        f = functools.partial(ts.op.linear, activation=activation)

        def fwd_bwd(x, w, bias):
            y, f_vjp = jax.vjp(f, x, w, bias)
            return y, f_vjp(ct)

        chosen = chosen_kernels(fwd_bwd, x, w, bias, ops=("matmul", "matmul_with_derivative"))
        assert ("matmul_with_derivative", "mosaic_gpu") in chosen
        assert {impl for _, impl in chosen} == {"mosaic_gpu"}
        y, (dx, dw, db) = jax.jit(fwd_bwd)(x, w, bias)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(f)(x, w, bias)))
        z = f64(x) @ f64(w) + f64(bias)
        g = f64(ct) * np_activation_derivative(z, activation)
        assert_close(y, _ref_linear(x, w, bias, activation=activation), factor=2)
        assert_close(dx, g @ f64(w).T, factor=2)
        assert_close(dw, f64(x).T @ g, factor=2)
        assert_close(db, g.sum(0), factor=2)

    def test_hopper_gradients(self):
        """The backward products carry transpose flags: the kernel runs them too."""
        m, k, n = SHAPES[0]
        x, w = rand((m, k), jnp.bfloat16), rand((k, n), jnp.bfloat16)

        def loss(x, w):
            return jnp.sum(ts.matmul(x, w).astype(jnp.float32) ** 2)

        grad = jax.grad(loss, argnums=(0, 1))
        assert set(_chosen(grad, x, w)) == {"mosaic_gpu"}
        dx, dw = jax.jit(grad)(x, w)
        g = 2 * f64(x) @ f64(w)
        assert_close(dx, g @ f64(w).T, factor=4)
        assert_close(dw, f64(x).T @ g, factor=4)

    @pytest.mark.parametrize("fmt", [ts.fp8_e4m3, ts.fp8_e5m2])
    def test_hopper_fp8(self, fmt):
        m, k, n = SHAPES[0]
        x, w = rand((m, k)), rand((k, n))
        qx, qw = ts.quantize(x, fmt), ts.quantize(w, fmt)
        assert _chosen(ts.matmul, qx, qw) == ["mosaic_gpu"]
        ref = f64(qx.dequantize()) @ f64(qw.dequantize())
        # Hopper's fp8 wgmma keeps fewer accumulator bits than f32 (about 1e-4 relative
        # here, as cuBLASLt's fast fp8 accumulation): an f32 tolerance would not hold.
        assert_close(jax.jit(ts.matmul)(qx, qw), ref, rtol=5e-4)

    @pytest.mark.parametrize("mkn", SHAPES)
    def test_portable_matmul(self, mkn):
        """f32 operands: the Hopper kernel declines them, the portable Pallas kernel runs."""
        m, k, n = mkn
        a, b = rand((m, k)), rand((k, n))
        assert _chosen(ts.matmul, a, b) == ["pallas_portable"]
        assert_close(jax.jit(ts.matmul)(a, b), f64(a) @ f64(b), rtol=1e-5)

    def test_nvlink_all_reduce(self):
        """The peer-to-peer all-reduce kernel: the canonical tree's bits on every GPU."""
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if self.MODE == "interpret":
            pytest.skip("peer-to-peer NVLink writes have no interpreter (the tree path runs)")
        if len(gpus) < 2:
            pytest.skip(f"the NVLink all-reduce needs 2+ GPUs; this host has {len(gpus)}")
        n = len(gpus)
        mesh = jax.make_mesh((n,), ("dp",), devices=gpus)
        parts = rand((n, 1 << 18), jnp.float32)
        x = jax.device_put(parts.reshape(-1), NamedSharding(mesh, P("dp")))

        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
        def reduce(v):
            return ts.op.all_reduce(v, op="sum", axis="dp", algo="nvlink")

        out = np.asarray(reduce(x)).reshape(n, -1)
        expected = np_tree(np.asarray(parts))
        for rank in range(n):
            np.testing.assert_array_equal(out[rank], expected)


@pytest.mark.gpu
class TestKernelsGPU(_KernelCases):
    MODE = "pallas"


class TestKernelsInterpret(_KernelCases):
    MODE = "interpret"

    @pytest.fixture(autouse=True)
    def _sampled(self, request):
        skip_unsampled_twin(request, 1)
