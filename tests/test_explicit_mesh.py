"""Every operator on meshes with Explicit and Auto axes: the values of its jnp counterpart,
and under Explicit axes (jax's sharding in types) the same output and gradient types."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tests._util import rand, sample


def _rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w[None, :]


def _ln(x, w, b):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * w[None, :] + b[None, :]


def _attn_ref(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


X2 = ((8, 16), P("dp", "tp"))
W16 = ((16,), P())
ATT = ((4, 16, 2, 8), P("dp", None, "tp", None))

# name: (ts function, jnp counterpart, operand (shape, spec) list)
CASES = {
    "sum_axis0": (lambda x: ts.sum(x, axis=0), lambda x: jnp.sum(x, axis=0), [X2]),
    "sum_axis1": (lambda x: ts.sum(x, axis=1), lambda x: jnp.sum(x, axis=1), [X2]),
    "sum_all": (ts.sum, jnp.sum, [X2]),
    "sum_keepdims": (
        lambda x: ts.sum(x, axis=1, keepdims=True),
        lambda x: jnp.sum(x, axis=1, keepdims=True),
        [X2],
    ),
    "max_axis1": (lambda x: ts.max(x, axis=1), lambda x: jnp.max(x, axis=1), [X2]),
    "mse": (ts.mse, lambda p, t: jnp.mean((p - t) ** 2), [X2, X2]),
    "softmax": (ts.softmax, jax.nn.softmax, [X2]),
    "log_softmax": (ts.op.log_softmax, jax.nn.log_softmax, [X2]),
    "relu": (ts.relu, jax.nn.relu, [X2]),
    "gelu": (ts.gelu, lambda x: jax.nn.gelu(x, approximate=False), [X2]),
    "tanh": (ts.tanh, jnp.tanh, [X2]),
    "exp": (ts.exp, jnp.exp, [X2]),
    "rmsnorm": (ts.rmsnorm, _rms, [X2, W16]),
    "rmsnorm_safe": (ts.rmsnorm_safe, _rms, [X2, W16]),
    "abs": (ts.abs, jnp.abs, [X2]),
    "sqrt": (lambda x: ts.sqrt(x * x + 1.0), lambda x: jnp.sqrt(x * x + 1.0), [X2]),
    "round": (lambda x: ts.round(x) + x, lambda x: jnp.round(x) + x, [X2]),
    "cast": (
        lambda x: ts.cast(x, ts.bf16).astype(jnp.float32),
        lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
        [X2],
    ),
    "fft_abs": (
        lambda x: jnp.abs(ts.fft(x, axis=0)),
        lambda x: jnp.abs(jnp.fft.fft(x, axis=0)),
        [((16, 8), P(None, "tp"))],
    ),
    "fused_mlp": (
        lambda x, w1, w2: ts.op.fused_mlp(x, w1, jnp.zeros(16), w2, jnp.zeros(4)),
        lambda x, w1, w2: jax.nn.relu(x @ w1) @ w2,
        [((8, 16), P("dp", None)), ((16, 16), P()), ((16, 4), P())],
    ),
    "layernorm": (ts.layernorm, _ln, [X2, W16, W16]),
    "rmsnorm_matmul": (
        ts.rmsnorm_matmul,
        lambda x, w, b: _rms(x, w) @ b,
        [((8, 16), P("dp", None)), W16, ((16, 4), P(None, "tp"))],
    ),
    "matmul": (ts.matmul, jnp.matmul, [((8, 16), P("dp", None)), ((16, 4), P(None, "tp"))]),
    "matmul_batched": (
        ts.matmul,
        jnp.matmul,
        [((4, 8, 16), P("dp", None, None)), ((4, 16, 6), P("dp", None, None))],
    ),
    "linear": (
        lambda x, w, b: ts.op.linear(x, w, b),
        lambda x, w, b: x @ w + b[None, :],
        [((8, 16), P("dp", None)), ((16, 4), P()), ((4,), P())],
    ),
    "flash_attention": (
        lambda q, k, v: ts.flash_attention(q, k, v, causal=True),
        _attn_ref,
        [ATT, ATT, ATT],
    ),
    # GQA with the queries sharded along the sequence, MQA with the heads: the operator
    # gathers them for the products and gives the output the queries' sharding back.
    "flash_attention_gqa": (
        lambda q, k, v: ts.flash_attention(q, k, v, causal=True),
        _attn_ref,
        [((4, 16, 4, 8), P("dp", "tp", None, None))] + [((4, 16, 2, 8), P("dp"))] * 2,
    ),
    "flash_attention_mqa": (
        lambda q, k, v: ts.flash_attention(q, k, v, causal=True),
        _attn_ref,
        [ATT] + [((4, 16, 1, 8), P("dp"))] * 2,
    ),
}

AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def _mesh(kind: str):
    return jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AXIS_TYPES[kind],) * 2)


def _operands(mesh, specs):
    return [
        jax.device_put(rand(shape, jnp.float32), NamedSharding(mesh, spec)) for shape, spec in specs
    ]


def _loss(f):
    return lambda *xs: jnp.sum(f(*xs) ** 2)


# Every operator on one of the axis types (alternating), and a sample on the other.
_KINDS = sorted(AXIS_TYPES)
_ONE_KIND = [(n, _KINDS[i % 2]) for i, n in enumerate(sorted(CASES))]
_OTHER_KIND = [(n, _KINDS[(i + 1) % 2]) for i, n in enumerate(sorted(CASES))]


@pytest.mark.parametrize("name,kind", sample(_ONE_KIND, 16) + sample(_OTHER_KIND, 3))
def test_values_and_types_match_jnp(name, kind):
    f, g, specs = CASES[name]
    mesh = _mesh(kind)
    xs = _operands(mesh, specs)
    with jax.set_mesh(mesh):
        out, ref = jax.jit(f)(*xs), jax.jit(g)(*xs)
        gout = jax.jit(jax.grad(_loss(f), argnums=tuple(range(len(xs)))))(*xs)
        gref = jax.jit(jax.grad(_loss(g), argnums=tuple(range(len(xs)))))(*xs)
        if kind == "explicit":
            assert jax.typeof(out).sharding.spec == jax.typeof(ref).sharding.spec
            for a, b in zip(gout, gref):
                assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    for a, b in zip(gout, gref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.xla_optimized  # bitwise across meshes (tests/conftest.py)
@pytest.mark.parametrize("kind", sorted(AXIS_TYPES))
def test_sum_is_mesh_invariant_on_both_axis_types(kind):
    """The canonical tree gives the bits of the one-device sum whatever the axis types."""
    mesh = _mesh(kind)
    x = rand((64, 24), jnp.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda v: ts.sum(v, axis=0))(xs)
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(jax.jit(lambda v: ts.sum(v, axis=0))(x))
    )


@pytest.mark.parametrize("kind", sorted(AXIS_TYPES))
def test_differentiated_linear_activation_on_both_axis_types(kind):
    """A layer with an activation under jax.grad binds the two-output form: on either kind
    of mesh its values and gradients are jnp's, and under Explicit axes so are its types."""
    f = lambda x, w, b: ts.op.linear(x, w, b, activation="gelu_tanh")
    g = lambda x, w, b: jax.nn.gelu(x @ w + b[None, :], approximate=True)
    mesh = _mesh(kind)
    xs = _operands(mesh, [((8, 16), P("dp", None)), ((16, 4), P(None, "tp")), ((4,), P())])
    with jax.set_mesh(mesh):
        grad = lambda h: jax.jit(jax.value_and_grad(_loss(h), argnums=(0, 1, 2)))
        jaxpr = jax.make_jaxpr(grad(f))(*xs)
        assert "ts_matmul_with_derivative" in str(jaxpr)
        (out, gout), (ref, gref) = grad(f)(*xs), grad(g)(*xs)
        if kind == "explicit":
            for a, b in zip(gout, gref):
                assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5)
    for a, b in zip(gout, gref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", sorted(AXIS_TYPES))
def test_matmul_kernel_path_on_sharded_operands(kind):
    """The kernel path (interpret mode) runs on local shards on either kind of mesh.

    f32 operands take the portable Pallas kernel: the Mosaic GPU interpreter runs its
    kernel as a nested computation inside a host callback, which XLA's multi-device CPU
    client cannot run from eight devices at once (its single-device tests are in
    tests/test_matmul_kernels.py).
    """
    mesh = _mesh(kind)
    a = jax.device_put(rand((64, 32)), NamedSharding(mesh, P("dp", None)))
    b = jax.device_put(rand((32, 32)), NamedSharding(mesh, P(None, None)))
    op = ts.op.OPERATORS["matmul"]
    with jax.set_mesh(mesh), ts.kernel_mode("interpret"):
        eqn = jax.make_jaxpr(ts.matmul)(a, b).eqns[0]
        impl, _ = op.select("cpu", [v.aval for v in eqn.invars], eqn.params)
        assert impl == "pallas_portable"
        out = jax.jit(ts.matmul)(a, b)
        if kind == "explicit":
            assert jax.typeof(out).sharding.spec == P("dp", None)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(AXIS_TYPES))
@pytest.mark.parametrize("name", ["matmul", "linear", "rmsnorm_matmul"])
def test_gradient_of_a_weight_passed_unplaced(name, kind):
    """A batch sharded over the mesh and a weight passed as a plain array (not placed on
    the mesh): the weight's gradient contracts the sharded rows. Under Explicit axes it
    raised (no output sharding for the product); now its values and type are jnp's."""
    wn = rand((16,))
    f, g = {
        "matmul": (ts.op.matmul, jnp.dot),
        "linear": (
            lambda x, w: ts.op.linear(x, w, activation="relu"),
            lambda x, w: jax.nn.relu(x @ w),
        ),
        "rmsnorm_matmul": (
            lambda x, w: ts.op.rmsnorm_matmul(x, wn, w),
            lambda x, w: _rms(x, wn) @ w,
        ),
    }[name]
    mesh = _mesh(kind)
    x = jax.device_put(rand((32, 16)), NamedSharding(mesh, P("dp", None)))
    w = rand((16, 8))
    with jax.set_mesh(mesh):
        gout = jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(x, w)
        gref = jax.jit(jax.grad(_loss(g), argnums=(0, 1)))(x, w)
        if kind == "explicit":
            for a, b in zip(gout, gref):
                assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec
    for a, b in zip(gout, gref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
