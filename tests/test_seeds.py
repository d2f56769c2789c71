"""The seed examples of the operator, numerics and autodiff chapters, run as written.

Each example is the seed's code with ``ts.`` names (seed 003: "Numerics and Types",
"Autodiff System"; seed 004: 2.2 "Operator Graphs"), checked against float64 references.
Departures from the seed text are marked SEED: with the reason.
"""

# ts.Tensor["B", "D", ...] names dimensions with strings, which ruff reads as forward
# references (F821 undefined name), as with jaxtyping.
# ruff: noqa: F821

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax.test_util import check_grads

import tessera_jax as ts
from tessera_jax import op
from tests._util import assert_close, f64, rand, seed003_quantized_policy

# --- seed 003, "Type System with Policies" --------------------------------------------------

# SEED: the seed writes `@accum(...)`, `@stochastic_round`, `@loss_scale(...)` unqualified.
x1 = ts.Tensor["B", "D", ts.fp8_e4m3 @ ts.accum(ts.f32)]
x2 = ts.Tensor["B", "D", ts.bf16 @ ts.accum(ts.f32) @ ts.stochastic_round]
x3 = ts.Tensor["B", "D", ts.fp6 @ ts.accum(ts.f32) @ ts.loss_scale(128.0)]


def test_policy_annotations_x1_x2_x3():
    assert x1.dims == x2.dims == x3.dims == ("B", "D")
    assert (x1.storage, x1.accumulate, x1.stochastic_round, x1.loss_scale) == (
        ts.fp8_e4m3,
        ts.f32,
        False,
        None,
    )
    assert (x2.storage, x2.accumulate, x2.stochastic_round, x2.loss_scale) == (
        ts.bf16,
        ts.f32,
        True,
        None,
    )
    assert (x3.storage, x3.accumulate, x3.stochastic_round, x3.loss_scale) == (
        ts.fp6,
        ts.f32,
        False,
        128.0,
    )
    assert x3.dtype == jnp.float8_e4m3fn  # fp6 values live in an fp8 e4m3 container


def test_policy_annotations_on_a_function():
    # The three tensors of the seed as the parameters of one function: fp8 and fp6 in,
    # the result stored per x2 (bf16; the return cast rounds to nearest).
    @ts.jit
    def combine(a: x1, b: x3) -> ts.Tensor["B", "D", ts.bf16 @ ts.accum(ts.f32)]:
        return ts.cast(a, ts.f32) * ts.cast(b, ts.f32)

    a = ts.cast(rand((4, 8)), ts.fp8_e4m3)
    b = ts.cast(rand((4, 8)), ts.fp6)
    out = combine(a, b)
    assert out.dtype == jnp.bfloat16
    assert_close(out, f64(a) * f64(b))
    with pytest.raises(TypeError, match=r'combine: dimension "D" is 8 in a\.shape\[1\] but 6'):
        combine(a, b[:, :6])

    # x3's ts.loss_scale(128.0) is applied by ts.grad: the fp6 argument's gradient is
    # computed scaled in its fp8 container and returned unscaled in f32.
    def loss(a: x1, b: x3):
        return ts.sum(ts.cast(a, ts.f32) * ts.cast(b, ts.f32) ** 2) / 64.0

    g, finite = ts.grad(loss, wrt="b")(a, b)
    assert bool(finite) and g.dtype == jnp.float32
    assert_close(g, 2 * f64(a) * f64(b) / 64.0, jnp.float8_e4m3fn)
    g_a = ts.grad(loss)(a, b)  # x1 carries no loss scale: a bare fp8 gradient
    assert g_a.dtype == jnp.float8_e4m3fn


# --- seed 003, "Mixed precision computation" -----------------------------------------------


@ts.jit
def mixed_precision_gemm(
    A: ts.Tensor["M", "K", ts.fp8_e4m3 @ ts.accum(ts.f32)],
    B: ts.Tensor["K", "N", ts.fp8_e4m3 @ ts.accum(ts.f32)],
) -> ts.Tensor["M", "N", ts.f32]:
    """FP8 inputs, FP32 accumulation and output"""
    return ts.gemm(A, B)  # Automatic precision handling


def test_mixed_precision_gemm():
    A = rand((32, 64), jnp.float8_e4m3fn)
    B = rand((64, 16), jnp.float8_e4m3fn)
    C = mixed_precision_gemm(A, B)
    assert C.dtype == jnp.float32 and C.shape == (32, 16)
    # fp8 products are exact in f32; only the f32 accumulation rounds.
    assert_close(C, f64(A) @ f64(B), factor=8)
    (eqn,) = [
        e
        for e in jax.make_jaxpr(mixed_precision_gemm)(A, B).eqns[0].params["jaxpr"].eqns
        if str(e.primitive) == "ts_matmul"
    ]
    assert eqn.params["spec"].accumulate_dtype == np.float32
    assert eqn.invars[0].aval.dtype == jnp.float8_e4m3fn  # no upcast before the matmul


def test_mixed_precision_gemm_errors():
    A = rand((32, 64), jnp.float8_e4m3fn)
    with pytest.raises(
        TypeError,
        match=r'^mixed_precision_gemm: dimension "K" is 64 in A\.shape\[1\] but 32 in '
        r"B\.shape\[0\]",
    ):
        mixed_precision_gemm(A, rand((32, 16), jnp.float8_e4m3fn))
    with pytest.raises(
        TypeError,
        match=r"^mixed_precision_gemm: B has dtype float32 but its annotation "
        r"ts\.Tensor\['K', 'N', ts\.fp8_e4m3 @ ts\.accum\(ts\.f32\)\] stores fp8_e4m3 "
        r"\(float8_e4m3fn\)",
    ):
        mixed_precision_gemm(A, rand((64, 16)))


# --- seed 003, "Safe Numerical Operations" -------------------------------------------------


@ts.jit
def numerically_stable_softmax(x: ts.Tensor["B", "S", ts.bf16]) -> ts.Tensor["B", "S", ts.bf16]:
    """Numerically stable softmax with explicit precision control"""
    # Convert to FP32 for stability
    x_f32 = ts.cast(x, ts.f32)

    # Safe operations
    x_max = ts.max(x_f32, axis=-1, keepdims=True)
    exp_x = ts.exp(x_f32 - x_max)  # Prevent overflow
    sum_exp = ts.sum(exp_x, axis=-1, keepdims=True)

    # Safe division with epsilon
    softmax = exp_x / (sum_exp + 1e-10)

    # Cast back to BF16
    return ts.cast(softmax, ts.bf16)


def _softmax_f64(x):
    x = f64(x)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_numerically_stable_softmax():
    x = rand((4, 128), jnp.bfloat16, scale=30.0)  # exp would overflow f32 without the max
    out = numerically_stable_softmax(x)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    assert_close(out, _softmax_f64(x))
    assert_close(out, f64(ts.softmax(x)), jnp.bfloat16)  # the softmax operator agrees
    with pytest.raises(
        TypeError, match=r"^numerically_stable_softmax: x has dtype float32 but its annotation"
    ):
        numerically_stable_softmax(x.astype(jnp.float32))


# --- seed 003, "Custom Numeric Policies" ---------------------------------------------------


def test_quantized_policy():
    QuantizedPolicy = seed003_quantized_policy()
    # Use custom policy
    spec = ts.Tensor["D", "D", QuantizedPolicy]  # the seed's `quantized_weight: ...`
    assert spec.dims == ("D", "D") and spec.storage is ts.int8 and spec.is_policy
    assert spec.accumulate == ts.f32

    w = rand((16, 16))
    qw = ts.quantize(w, QuantizedPolicy)
    assert qw.values.dtype == jnp.int8 and qw.shape == (16, 16)
    scale = float(np.max(np.abs(f64(w)))) / 127.0
    np.testing.assert_allclose(float(qw.scale), scale, rtol=1e-6)
    deq = ts.dequantize(qw)
    assert deq.dtype == jnp.float32
    assert np.max(np.abs(f64(deq) - f64(w))) <= scale / 2 * (1 + 1e-5)

    @ts.jit
    def project(
        x: ts.Tensor["B", "D", ts.f32], quantized_weight: ts.Tensor["D", "D", QuantizedPolicy]
    ) -> ts.Tensor["B", "D", ts.f32]:
        return ts.matmul(x, quantized_weight)

    x = rand((4, 16))
    assert_close(project(x, qw), f64(x) @ f64(deq), factor=4)
    with pytest.raises(TypeError, match=r"project: quantized_weight has dtype float32 but its"):
        project(x, w)  # a plain f32 weight is not stored in the policy's int8


# --- seed 003, "Basic Autodiff" -------------------------------------------------------------


@ts.jit
@ts.autodiff
def loss_function(x, W, b, y_true):
    """Automatic differentiation example"""
    # Forward pass
    y_pred = ts.matmul(x, W) + b
    y_pred = ts.relu(y_pred)
    loss = ts.mse(y_pred, y_true)
    return loss


def _loss_grads_f64(x, W, b, y_true):
    x, W, b, y_true = (f64(a) for a in (x, W, b, y_true))
    z = x @ W + b
    dz = 2 * (np.maximum(z, 0) - y_true) / z.size * (z > 0)
    return x.T @ dz, dz.sum(0, keepdims=True)


def _loss_inputs(dtype=jnp.float32):
    # SEED: b is (1, N), not (N,): the test-suite runs with jax_numpy_rank_promotion="raise".
    return rand((8, 6), dtype), rand((6, 4), dtype), rand((1, 4), dtype), rand((8, 4), dtype)


def test_basic_autodiff():
    x, W, b, y_true = _loss_inputs()
    # Compute gradients
    # SEED: `ts.grad(loss_function)` differentiates the first argument (argnums=0, as
    # jax.grad); the seed unpacks grad_W, grad_b, so name them.
    grad_fn = ts.grad(loss_function, wrt=("W", "b"))
    grad_W, grad_b = grad_fn(x, W, b, y_true)
    gW_ref, gb_ref = _loss_grads_f64(x, W, b, y_true)
    assert_close(grad_W, gW_ref, factor=4)
    assert_close(grad_b, gb_ref, factor=4)
    # The backward pass is an operator graph: the adjoints of ts.matmul are ts.matmuls.
    graph = loss_function.adjoint_graph(x, W, b, y_true)
    assert [str(e.primitive) for e in graph.jaxpr.eqns].count("ts_matmul") == 2


def test_basic_autodiff_check_grads(x64):
    x, W, b, y_true = _loss_inputs(jnp.float64)
    check_grads(lambda W, b: loss_function(x, W, b, y_true), (W, b), order=2, modes=("fwd", "rev"))


# --- seed 003, "Custom VJP/JVP Rules" ------------------------------------------------------


@ts.custom_vjp
def custom_gelu(x):
    """GELU with custom backward pass"""
    return 0.5 * x * (1 + ts.tanh(0.79788456 * (x + 0.044715 * x**3)))


def custom_gelu_fwd(x):
    y = custom_gelu(x)
    return y, (x, y)  # Save for backward


def custom_gelu_bwd(saved, grad_output):
    x, y = saved  # noqa: RUF059 - the seed's text
    # Custom gradient computation
    cdf = 0.5 * (1 + ts.tanh(0.79788456 * (x + 0.044715 * x**3)))
    pdf = ts.exp(-0.5 * x**2) / ts.sqrt(2 * ts.pi)
    grad_input = grad_output * (cdf + x * pdf)
    return grad_input


custom_gelu.defvjp(custom_gelu_fwd, custom_gelu_bwd)


def _seed_gelu_grad_f64(x):
    """The seed's backward in float64: tanh-approximate CDF plus x times the exact pdf."""
    x = f64(x)
    cdf = 0.5 * (1 + np.tanh(0.79788456 * (x + 0.044715 * x**3)))
    return cdf + x * np.exp(-0.5 * x**2) / np.sqrt(2 * np.pi)


def test_custom_gelu():
    x = rand((64,), scale=3.0)
    y = custom_gelu(x)
    assert_close(y, f64(jax.nn.gelu(x.astype(jnp.float32), approximate=True)))
    xd = f64(x)
    assert_close(y, 0.5 * xd * (1 + np.tanh(np.sqrt(2 / np.pi) * (xd + 0.044715 * xd**3))))
    g = jax.grad(lambda x: ts.sum(custom_gelu(x)))(x)
    assert_close(g, _seed_gelu_grad_f64(x))  # the custom rule ran
    # It approximates the derivative of the tanh GELU (its pdf is the exact GELU's), so
    # it agrees with jax's gradient to the approximation's 8.3e-4.
    g_jax = jax.grad(lambda x: jnp.sum(jax.nn.gelu(x, approximate=True)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_jax), atol=1e-3)
    # The same under jit and vmap.
    g_jit = jax.jit(jax.vmap(jax.grad(custom_gelu)))(x)
    assert_close(g_jit, _seed_gelu_grad_f64(x))


def test_custom_gelu_against_finite_differences(x64):
    # The custom backward is not the exact derivative of the forward (its pdf is the exact
    # GELU's, its cdf the tanh approximation's), so check_grads' directional test, whose
    # error grows with the size, does not apply; compare elementwise central differences
    # of the forward instead: they agree to the approximation gap (at most 8.3e-4).
    x = rand((64,), jnp.float64, scale=3.0)
    h = 1e-6
    fd = (f64(custom_gelu(x + h)) - f64(custom_gelu(x - h))) / (2 * h)
    g = jax.grad(lambda x: jnp.sum(custom_gelu(x)))(x)
    np.testing.assert_allclose(np.asarray(g), fd, atol=1e-3)
    np.testing.assert_allclose(np.asarray(g), _seed_gelu_grad_f64(x), rtol=1e-12, atol=1e-14)
    xd = f64(x)
    exact = scipy.special.ndtr(xd) + xd * np.exp(-0.5 * xd**2) / np.sqrt(2 * np.pi)
    np.testing.assert_allclose(np.asarray(g), exact, atol=1e-3)  # the exact GELU's derivative


# --- seed 004, 2.2 "Operator Graphs" -------------------------------------------------------


# SEED: the seed decorates it with @graph.module("attention") (graph modules are not built
# yet); here it is a plain function of ts.op operators.
def attention(Q, K, V):
    S = op.matmul(Q, K.T)
    A = op.softmax(S)
    return op.matmul(A, V)


def _attention_f64(Q, K, V):
    return _softmax_f64(f64(Q) @ f64(K).T) @ f64(V)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention(dtype):
    Q, K, V = rand((16, 32), dtype, scale=0.3), rand((24, 32), dtype), rand((24, 32), dtype)
    out = attention(Q, K, V)
    assert out.dtype == dtype and out.shape == (16, 32)
    assert_close(out, _attention_f64(Q, K, V), factor=4)
    assert_close(ts.jit(attention)(Q, K, V), _attention_f64(Q, K, V), factor=4)
    prims = [str(e.primitive) for e in jax.make_jaxpr(attention)(Q, K, V).eqns]
    assert [p for p in prims if p.startswith("ts_")] == ["ts_matmul", "ts_softmax", "ts_matmul"]


def test_attention_check_grads(x64):
    Q, K, V = (rand((6, 8), jnp.float64, scale=0.5) for _ in range(3))
    check_grads(attention, (Q, K, V), order=2, modes=("fwd", "rev"))
