"""``ts.rmsnorm_matmul``: rmsnorm fused into the following matmul.

The XLA lowering and the Hopper kernel (Mosaic GPU interpret mode on the CPU: tiny ragged
shapes, one compile each) against float64 references, forward and gradients; vmap; the
dispatch vocabulary; the real cuda lowering at a transformer shape; input validation.
The graph rewrite is tested in test_graph_module.py, the mesh types in test_explicit_mesh.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax.primitives import rmsnorm_matmul as rm
from tests._util import (
    assert_close,
    chosen_kernels,
    cuda_lowering_xla_row_dot,
    f64,
    mosaic_gpu_calls,
    rand,
    xla_ordered_sums,
)

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
EPS = 1e-6


def reference(x, w, b, eps=EPS):
    """``rmsnorm(x, w) @ b`` in float64 on the (rounded) inputs."""
    x, w, b = f64(x), f64(w), f64(b)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * r * w) @ b


def reference_grads(x, w, b, ct):
    """Gradients of ``sum(rmsnorm(x, w) @ b · ct)`` in float64 (the adjoint formulas)."""
    x, w, b, ct = f64(x), f64(w), f64(b), f64(ct)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
    xhat = x * r
    db = (xhat * w).reshape(-1, x.shape[-1]).T @ ct.reshape(-1, b.shape[-1])
    g = ct @ b.T  # d(x̂·w)
    dw = np.sum((g * xhat).reshape(-1, x.shape[-1]), axis=0)
    gw = g * w
    dx = r * (gw - xhat * np.mean(xhat * gw, axis=-1, keepdims=True))
    return dx, dw, db


# --- the XLA lowering (the operator's reference) ---------------------------------------------


@pytest.mark.parametrize("shape,n,dtype", [((3, 5, 64), 24, F32)], ids=["f32-3d"])
def test_forward_and_gradients_reference(shape, n, dtype):
    k = shape[-1]
    x, w, b = rand(shape, dtype), rand((k,), F32) + 1.0, rand((k, n), dtype)
    ct = rand((*shape[:-1], n), dtype)

    @jax.jit
    def fwd_bwd(x, w, b, ct):
        out, vjp = jax.vjp(ts.rmsnorm_matmul, x, w, b)
        # The XLA lowering is the unfused math: the bits of ts.rmsnorm then ts.matmul.
        return out, vjp(ct), ts.matmul(ts.rmsnorm(x, w), b)

    out, grads, unfused = fwd_bwd(x, w, b, ct)
    assert out.shape == (*shape[:-1], n) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(unfused))
    assert_close(out, reference(x, w, b), factor=4)
    for g, r, p in zip(grads, reference_grads(x, w, b, ct), (x, w, b)):
        assert g.shape == p.shape and g.dtype == p.dtype
        assert_close(g, r, dtype, factor=8)


def test_bf16_out_dtype_vector_and_vmap_over_x_and_over_b():
    x, w, b = rand((2, 5, 32), BF16), rand((32,), F32), rand((2, 32, 8), BF16)

    @jax.jit
    def run(x, w, b):
        return (
            jax.vmap(ts.rmsnorm_matmul, in_axes=(0, None, 0))(x, w, b),
            jax.vmap(ts.rmsnorm_matmul, in_axes=(1, None, None))(x, w, b[0]),
            ts.rmsnorm_matmul(x, w, b[0], eps=1e-5, out_dtype=ts.f32),
            ts.rmsnorm_matmul(x[0, 0], w, b[0]),  # a (K,) vector gives (N,)
        )

    over_b, over_x, wide, vector = run(x, w, b)
    assert vector.shape == (8,) and vector.dtype == BF16
    assert_close(vector, reference(x[0, 0], w, b[0]), factor=2)
    assert_close(over_b, reference(x[:, :, None, :], w, b[:, None])[:, :, 0], factor=2)
    assert_close(over_x, np.moveaxis(reference(x, w, b[0]), 1, 0), factor=2)
    assert wide.dtype == F32
    assert_close(wide, reference(x, w, b[0], eps=1e-5), BF16)


# --- the Hopper kernel in Mosaic GPU interpret mode -------------------------------------------


def test_kernel_ragged_forward_and_gradients_interpret():
    # Ragged M (2·37 rows), K and N against float64; gradients for x and weight keep the
    # fused forward (b is not differentiated), the backward through the decomposition.
    # Squares above f32's range (x_big's row 3) would overflow the accumulator of
    # x @ (weight·b): that call takes the unfused reference (a cond on the row
    # statistics), which rescales.
    x, w, b = rand((2, 37, 72), BF16), rand((72,), F32) + 1.0, rand((72, 40), BF16)
    ct = rand((2, 37, 40), BF16)
    x_big = x.at[0, 3].multiply(jnp.asarray(3e30, BF16))
    with ts.kernel_mode("interpret"):
        assert ("rmsnorm_matmul", "mosaic_gpu") in chosen_kernels(ts.rmsnorm_matmul, x, w, b)

        @jax.jit
        def fwd_bwd(x, w, ct, x_big):
            out, vjp = jax.vjp(lambda x, w: ts.rmsnorm_matmul(x, w, b), x, w)
            return out, vjp(ct), ts.rmsnorm_matmul(x_big, w, b)

        out, (dx, dw), out_big = fwd_bwd(x, w, ct, x_big)
    assert out.dtype == BF16
    # One rounding differs from the unfused path (weight·b instead of x̂): bf16 tolerance.
    assert_close(out, reference(x, w, b), factor=2)
    assert_close(out_big, reference(x_big, w, b), factor=2)
    rdx, rdw, _ = reference_grads(x, w, b, ct)
    assert_close(dx, rdx, factor=4)
    assert_close(dw, rdw, BF16, factor=4)


def _decomposition(x, w, b):
    return ts.matmul(ts.rmsnorm(x, w, eps=EPS), b)


def test_unfused_operators_interpret():
    """Where the fused kernel cannot run (f32 here), the nested ts.rmsnorm and ts.matmul,
    each by its own dispatch: the bits of the decomposition written out, in the same mode;
    on a mesh too, where the sharding rule's partitioner traces it after the mode's block
    has been left (rows over dp, N over tp: each shard's own dispatch, the same bits)."""
    x, w, b = rand((2, 8, 72), F32), rand((72,), F32) + 1.0, rand((72, 24), F32)
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "dp")))
    bs = jax.device_put(b, NamedSharding(mesh, P(None, "tp")))
    with ts.kernel_mode("interpret"):
        kernels = chosen_kernels(ts.rmsnorm_matmul, x, w, b)
        assert kernels == [("rmsnorm_matmul", "unfused_operators")], kernels
        out = jax.jit(ts.rmsnorm_matmul)(x, w, b)
        want = jax.jit(_decomposition)(x, w, b)
        with jax.set_mesh(mesh):
            sharded = jax.jit(ts.rmsnorm_matmul)(xs, w, bs)
        with pytest.raises(ValueError, match="interpret=False must agree with the kernel mode"):
            jax.jit(lambda x: rm.unfused_operators(rm_spec(F32), x, w, b))(x)
    np.testing.assert_array_equal(out, want)
    for shapes in (((3, 0), (0,), (0, 4)), ((2, 0, 5), (5,), (5, 4)), ((3, 5), (5,), (5, 0))):
        args = [jnp.ones(s, F32) for s in shapes]  # empty: the nested operators' references
        with ts.kernel_mode("interpret"):
            got = jax.jit(ts.rmsnorm_matmul)(*args)
        np.testing.assert_array_equal(got, jax.jit(ts.rmsnorm_matmul)(*args))
    assert sharded.sharding.spec == P(None, "dp", "tp")
    np.testing.assert_array_equal(sharded, out)
    assert_close(out, reference(x, w, b), factor=2)


def test_kernel_lowers_for_cuda_at_a_transformer_shape():
    # The real Mosaic GPU lowering (layouts of the row-scale broadcast, TMA descriptors),
    # built on this CPU: one kernel, and no (M, K) normalised activation anywhere.
    x = jax.ShapeDtypeStruct((4, 4096, 4096), BF16)
    w = jax.ShapeDtypeStruct((4096,), BF16)
    b = jax.ShapeDtypeStruct((4096, 1024), BF16)
    with ts.kernel_mode("pallas"):
        hlo = cuda_lowering_xla_row_dot(
            lambda x, w, b: rm.fused_kernel(rm_spec(BF16), x, w, b, interpret=False), x, w, b
        )
    assert len(mosaic_gpu_calls(hlo)) == 1


def test_row_statistics_sum_in_a_fixed_order():
    """The kernel's mean squares come from the row kernel (its order depends on K only),
    not an XLA reduction, whose order XLA's GPU autotuner picks by timing; they match
    float64."""
    x = rand((37, 200), BF16)
    assert xla_ordered_sums(rm.mean_square, x) == []
    got = jax.jit(rm.mean_square, static_argnames="interpret")(x, interpret=True)
    np.testing.assert_allclose(got, np.mean(f64(x) ** 2, axis=-1), rtol=2e-6)


def rm_spec(dtype) -> rm.RMSNormMatmulSpec:
    return rm.RMSNormMatmulSpec(eps=EPS, out_dtype=dtype, accumulate_dtype=F32)


def test_supports_and_prefer():
    sds = jax.ShapeDtypeStruct
    ok = (sds((16384, 4096), BF16), sds((4096,), F32), sds((4096, 1024), BF16))
    assert rm.supports(rm_spec(BF16), ok) is None
    assert "16-bit" in rm.supports(rm_spec(F32), (sds((64, 64), F32), ok[1], sds((64, 8), F32)))
    w64 = sds((64,), F32)
    assert "empty" in rm.supports(rm_spec(BF16), (sds((0, 64), BF16), w64, sds((64, 8), BF16)))
    wide = (sds((64, 32768), BF16), sds((32768,), F32), sds((32768, 8), BF16))
    assert "row statistics' kernel" in rm.supports(rm_spec(BF16), wide)
    assert rm.prefer(rm_spec(BF16), ok)
    for n in (4096, 12288):  # the Mosaic GEMM trails cuBLAS by more than the saving
        assert not rm.prefer(rm_spec(BF16), (ok[0], ok[1], sds((4096, n), BF16)))
    for m in (256, 4096, 8192):  # the pass over b and the launches outweigh the saving
        assert not rm.prefer(rm_spec(BF16), (sds((m, 4096), BF16), ok[1], ok[2]))


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kw,err,match",
    [
        (((4, 8), (8,), (8, 2, 1)), {}, ValueError, r"b.shape=\(8, 2, 1\) has rank 3"),
        (((4, 8), (7,), (8, 2)), {}, ValueError, r"weight.shape=\(7,\) must be \(K,\) = \(8,\)"),
        (((4, 8), (8,), (6, 2)), {}, ValueError, r"b.shape\[0\]=6 must equal x.shape\[-1\]=8"),
        (((4, 8), (8,), (8, 2)), {"eps": 0.0}, ValueError, r"eps=0.0 must be a finite float > 0"),
        (((4, 8), (8,), (8, 2)), {"eps": "1"}, TypeError, r"eps='1' must be a Python float"),
        (((4, 8), (8,), (8, 2)), {"out_dtype": jnp.int8}, TypeError, r"out_dtype=int8 must be"),
    ],
)
def test_bad_input(args, kw, err, match):
    xs = [jnp.ones(s, F32) for s in args]
    with pytest.raises(err, match=f"rmsnorm_matmul: {match}"):
        ts.rmsnorm_matmul(*xs, **kw)


def test_bad_dtypes():
    x, w = jnp.ones((4, 8), BF16), jnp.ones((8,), F32)
    with pytest.raises(TypeError, match=r"rmsnorm_matmul: b.dtype=float32 must equal x.dtype"):
        ts.rmsnorm_matmul(x, w, jnp.ones((8, 2), F32))
    with pytest.raises(TypeError, match=r"rmsnorm_matmul: x.dtype=int32 is not supported"):
        ts.rmsnorm_matmul(jnp.ones((4, 8), jnp.int32), w, jnp.ones((8, 2), jnp.int32))


# --- on the GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_unfused_operators_on_gpu():
    """Where ``auto`` does not take the fused kernel (N above ``PREFER_MAX_N``), the row
    kernel's rmsnorm and the product: the bits of the decomposition written out."""
    x, w, b = rand((4096, 1024), BF16), rand((1024,), F32) + 1.0, rand((1024, 2048), BF16)
    kernels = chosen_kernels(ts.rmsnorm_matmul, x, w, b)
    assert kernels == [("rmsnorm_matmul", "unfused_operators")], kernels
    assert ("rmsnorm", "pallas_rows") in chosen_kernels(_decomposition, x, w, b)
    out = jax.jit(ts.rmsnorm_matmul)(x, w, b)
    np.testing.assert_array_equal(out, jax.jit(_decomposition)(x, w, b))
    assert_close(out, reference(x, w, b), factor=2)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(201, 136, 72), (1024, 512, 256)])
def test_kernel_on_gpu(m, k, n):
    x, w, b = rand((m, k), BF16), rand((k,), F32) + 1.0, rand((k, n), BF16)
    with ts.kernel_mode("pallas"):
        assert ("rmsnorm_matmul", "mosaic_gpu") in chosen_kernels(ts.rmsnorm_matmul, x, w, b)
        out = jax.jit(ts.rmsnorm_matmul)(x, w, b)
        ct = rand((m, n), F32)
        loss = lambda x, w: jnp.sum(ts.rmsnorm_matmul(x, w, b).astype(F32) * ct)
        dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert_close(out, reference(x, w, b), factor=2)
    rdx, rdw, _ = reference_grads(x, w, b, ct)
    assert_close(dx, rdx, factor=4)
    assert_close(dw, rdw, F32, rtol=1e-2)
