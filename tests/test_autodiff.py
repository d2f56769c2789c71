"""ts.grad / value_and_grad (wrt names, loss scaling), ts.autodiff, custom_vjp/jvp, ts.jit."""

# ts.Tensor["B", "D", ...] names dimensions with strings, which ruff reads as forward
# references (F821 undefined name), as with jaxtyping.
# ruff: noqa: F821

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import tessera_jax as ts
from tests._util import assert_close, f64, rand


def loss(x, W, b, y_true):
    """A small regression loss: mse(relu(x @ W + b), y_true)."""
    return ts.mse(ts.relu(jnp.dot(x, W) + b[None, :]), y_true)


def loss_grads_f64(x, W, b, y_true):
    """Float64 reference gradients of ``loss`` with respect to W and b."""
    x, W, b, y_true = (f64(a) for a in (x, W, b, y_true))
    z = x @ W + b
    r = np.maximum(z, 0)
    dr = 2 * (r - y_true) / r.size
    dz = dr * (z > 0)
    return x.T @ dz, dz.sum(0)


def _inputs(dtype=jnp.float32):
    return rand((8, 5), dtype), rand((5, 3), dtype), rand((3,), dtype), rand((8, 3), dtype)


# --- wrt= ---------------------------------------------------------------------------------


def test_grad_default_argnums_matches_jax():
    args = _inputs()
    np.testing.assert_array_equal(ts.grad(loss)(*args), jax.grad(loss)(*args))
    v, g = ts.value_and_grad(loss, argnums=(1, 2))(*args)
    v_ref, g_ref = jax.value_and_grad(loss, argnums=(1, 2))(*args)
    assert float(v) == float(v_ref)
    for a, r in zip(g, g_ref):
        np.testing.assert_array_equal(a, r)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda f: f,
        ts.jit,
        ts.autodiff,
        lambda f: ts.jit(ts.autodiff(f)),
        jax.jit,
    ],
    ids=["plain", "ts.jit", "ts.autodiff", "ts.jit+ts.autodiff", "jax.jit"],
)
def test_wrt_names_match_float64_reference(wrap):
    args = _inputs()
    gW_ref, gb_ref = loss_grads_f64(*args)
    f = wrap(loss)
    gW, gb = ts.grad(f, wrt=("W", "b"))(*args)
    assert_close(gW, gW_ref)
    assert_close(gb, gb_ref)
    # A single name gives a bare gradient.
    assert_close(ts.grad(f, wrt="b")(*args), gb_ref)
    value, (gW2, gb2) = ts.value_and_grad(f, wrt=("W", "b"))(*args)
    assert_close(value, f64(loss(*args)))
    np.testing.assert_array_equal(gW2, gW)
    np.testing.assert_array_equal(gb2, gb)


def test_wrt_arguments_passed_by_keyword_or_default():
    x, W, b, y = _inputs()
    _, gb_ref = loss_grads_f64(x, W, b, y)
    assert_close(ts.grad(loss, wrt="b")(x, W, b=b, y_true=y), gb_ref)
    assert_close(ts.grad(loss, wrt="b")(x, W=W, y_true=y, b=b), gb_ref)

    def with_default(x, scale=2.0):
        return jnp.sum(x * scale)

    g = ts.grad(with_default, wrt="scale")(jnp.arange(4.0))
    assert float(g) == 6.0


def test_wrt_order_follows_the_names():
    args = _inputs()
    gb, gW = ts.grad(loss, wrt=("b", "W"))(*args)
    assert gb.shape == (3,) and gW.shape == (5, 3)


def test_wrt_errors():
    with pytest.raises(
        ValueError,
        match=r"ts\.grad: wrt='c' is not a parameter of loss; its parameters are "
        r"\(x, W, b, y_true\)",
    ):
        ts.grad(loss, wrt="c")
    with pytest.raises(ValueError, match=r"ts\.value_and_grad: wrt='V' is not a parameter of loss"):
        ts.value_and_grad(ts.jit(loss), wrt=("W", "V"))
    with pytest.raises(ValueError, match=r"pass either wrt= or argnums=, not both"):
        ts.grad(loss, argnums=1, wrt="W")
    with pytest.raises(ValueError, match=r"wrt=\('W', 'W'\) names a parameter twice"):
        ts.grad(loss, wrt=("W", "W"))
    with pytest.raises(TypeError, match=r"wrt=\(1,\) must be a parameter name or a tuple"):
        ts.grad(loss, wrt=(1,))

    def kw_only(x, *, w):
        return jnp.sum(x * w)

    with pytest.raises(ValueError, match=r"wrt='w' is a keyword-only or variadic parameter"):
        ts.grad(kw_only, wrt="w")
    with pytest.raises(TypeError, match=r"ts\.grad: expected a function, got a int"):
        ts.grad(3)


def test_has_aux():
    def f(x, w):
        return jnp.sum(x * w), {"n": x.shape[0]}

    x, w = jnp.arange(3.0), jnp.float32(2.0)
    g, aux = ts.grad(f, wrt="w", has_aux=True)(x, w)
    assert float(g) == 3.0 and aux == {"n": 3}
    (v, aux), g = ts.value_and_grad(f, wrt="w", has_aux=True)(x, w)
    assert float(v) == 6.0 and float(g) == 3.0 and aux == {"n": 3}


# --- loss scaling -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scale", [128.0, 3, ts.loss_scale(1024.0), ts.bf16 @ ts.loss_scale(64.0)], ids=repr
)
def test_loss_scale_returns_unscaled_gradients_and_finite_flag(scale):
    args = _inputs()
    gW_ref, gb_ref = loss_grads_f64(*args)
    (gW, gb), finite = ts.grad(loss, wrt=("W", "b"), loss_scale=scale)(*args)
    assert finite.dtype == jnp.bool_ and finite.shape == () and bool(finite)
    assert_close(gW, gW_ref)
    assert_close(gb, gb_ref)
    value, gW2, finite2 = ts.value_and_grad(loss, wrt="W", loss_scale=scale)(*args)
    assert_close(value, f64(loss(*args)))  # the unscaled loss
    np.testing.assert_array_equal(gW2, gW)
    assert bool(finite2)


def test_loss_scale_with_aux_structures():
    def f(x, w):
        return jnp.sum(x * w), "aux"

    x, w = jnp.arange(3.0), jnp.float32(2.0)
    g, aux, finite = ts.grad(f, wrt="w", has_aux=True, loss_scale=8.0)(x, w)
    assert float(g) == 3.0 and aux == "aux" and bool(finite)
    (v, aux), g, finite = ts.value_and_grad(f, wrt="w", has_aux=True, loss_scale=8.0)(x, w)
    assert float(v) == 6.0 and float(g) == 3.0 and aux == "aux" and bool(finite)


def _tiny_grad_loss(x):
    """d loss / dx = 1e-8: below the smallest f16 subnormal (6e-8), so it underflows in f16."""
    return jnp.sum(x * 1e-4).astype(jnp.float32) * 1e-4


def test_loss_scale_rescues_f16_gradients_that_underflow():
    x = jnp.ones((16,), jnp.float16)
    assert not np.any(np.asarray(jax.grad(_tiny_grad_loss)(x)))  # all zeros without scaling
    g, finite = ts.grad(_tiny_grad_loss, loss_scale=1024.0)(x)
    assert g.dtype == jnp.float32  # unscaled in f32: f16 cannot hold 1e-8
    assert bool(finite)
    np.testing.assert_allclose(np.asarray(g), 1e-8, rtol=2e-2)


def test_loss_scale_reports_overflow():
    def f(x):
        return jnp.sum(x * 1000.0).astype(jnp.float32)

    x = jnp.ones((4,), jnp.float16)
    g, finite = ts.grad(f, loss_scale=1024.0)(x)  # 1024 * 1000 overflows f16
    assert not bool(finite) and not np.all(np.isfinite(np.asarray(g)))
    g, finite = ts.grad(f, loss_scale=1.0)(x)
    assert bool(finite) and np.all(np.asarray(g) == 1000.0)


def test_dynamic_loss_scale_array_under_jit():
    x = jnp.ones((16,), jnp.float16)

    @jax.jit
    def step(x, scale):
        return ts.grad(_tiny_grad_loss, loss_scale=scale)(x)

    g, finite = step(x, jnp.float32(1024.0))
    assert bool(finite)
    np.testing.assert_allclose(np.asarray(g), 1e-8, rtol=2e-2)
    with pytest.raises(TypeError, match=r"loss_scale must be a scalar float array, got shape"):
        ts.grad(_tiny_grad_loss, loss_scale=jnp.ones(2))


def test_loss_scale_from_annotation():
    policy = ts.f16 @ ts.accum(ts.f32) @ ts.loss_scale(1024.0)

    def f(x: ts.Tensor["N", policy]):
        return _tiny_grad_loss(x)

    x = jnp.ones((16,), jnp.float16)
    for fn in (f, ts.jit(f)):
        g, finite = ts.grad(fn)(x)
        assert bool(finite)
        np.testing.assert_allclose(np.asarray(g), 1e-8, rtol=2e-2)
    # An explicit loss_scale wins over the annotation (here: 1, which underflows).
    g, _ = ts.grad(f, loss_scale=1.0)(x)
    assert not np.any(np.asarray(g))


def test_loss_scale_from_annotation_only_of_differentiated_arguments():
    def f(x: ts.Tensor["N", ts.f32], y: ts.Tensor["N", ts.f32 @ ts.loss_scale(4.0)]):
        return jnp.sum(x * y)

    x = jnp.arange(3.0)
    g = ts.grad(f)(x, x)  # x carries no scale: a bare gradient
    np.testing.assert_array_equal(g, x)
    g, finite = ts.grad(f, wrt="y")(x, x)
    np.testing.assert_array_equal(g, x)
    assert bool(finite)


def test_conflicting_annotated_loss_scales():
    def f(
        x: ts.Tensor["N", ts.f32 @ ts.loss_scale(2.0)],
        y: ts.Tensor["N", ts.f32 @ ts.loss_scale(4.0)],
    ):
        return jnp.sum(x * y)

    x = jnp.arange(3.0)
    with pytest.raises(
        ValueError,
        match=r"ts\.grad: the differentiated arguments of f carry "
        r"different loss scales \{'x': 2\.0, 'y': 4\.0\}",
    ):
        ts.grad(f, argnums=(0, 1))(x, x)
    (gx, gy), _ = ts.grad(f, argnums=(0, 1), loss_scale=8.0)(x, x)
    np.testing.assert_array_equal(gx, x)
    np.testing.assert_array_equal(gy, x)


def test_loss_scale_errors():
    with pytest.raises(ValueError, match=r"scale=0\.0 must be a positive finite number"):
        ts.grad(loss, loss_scale=0.0)
    with pytest.raises(ValueError, match=r"scale=inf must be a positive finite number"):
        ts.grad(loss, loss_scale=float("inf"))
    with pytest.raises(
        ValueError,
        match=r"the policy ts\.bf16 @ ts\.accum\(ts\.f32\) carries no "
        r"ts\.loss_scale",
    ):
        ts.grad(loss, loss_scale=ts.bf16 @ ts.accum(ts.f32))
    with pytest.raises(TypeError, match=r"loss_scale='8' must be a number"):
        ts.value_and_grad(loss, loss_scale="8")
    with pytest.raises(TypeError, match=r"loss_scale=True must be a number"):
        ts.grad(loss, loss_scale=True)


def test_loss_scaled_gradients_check_grads(x64):
    # The scaled-and-unscaled gradient is the exact gradient: check it numerically in f64.
    x, W, b, y = (a.astype(jnp.float64) for a in _inputs())

    def grads_W(W):
        (g,), _ = ts.grad(loss, wrt=("W",), loss_scale=256.0)(x, W, b, y)
        return g

    np.testing.assert_allclose(grads_W(W), jax.grad(loss, 1)(x, W, b, y), rtol=1e-12)
    check_grads(lambda W: loss(x, W, b, y), (W,), order=2, modes=("rev",))
    check_grads(grads_W, (W,), order=1, modes=("rev",))


# --- ts.autodiff ----------------------------------------------------------------------------


def test_autodiff_call_unchanged_and_adjoint_graph():
    f = ts.autodiff(loss)
    args = _inputs()
    assert f.__name__ == "loss" and f.__doc__ == loss.__doc__
    np.testing.assert_array_equal(f(*args), loss(*args))
    graph = f.adjoint_graph(*args)
    assert isinstance(graph, jax.extend.core.ClosedJaxpr)
    # Inputs: the cotangent of the scalar loss; outputs: one cotangent per argument.
    assert [v.aval.shape for v in graph.jaxpr.invars] == [()]
    assert [v.aval.shape for v in graph.jaxpr.outvars] == [a.shape for a in args]
    out = jax.core.eval_jaxpr(graph.jaxpr, graph.consts, jnp.float32(1.0))
    gW_ref, gb_ref = loss_grads_f64(*args)
    assert_close(out[1], gW_ref)
    assert_close(out[2], gb_ref)


def test_adjoint_graph_through_ts_jit_contains_ts_operators():
    @ts.jit
    @ts.autodiff
    def layer(x, W):
        return ts.sum(ts.tanh(ts.matmul(x, W)))

    x, W = rand((4, 5)), rand((5, 3))
    graph = layer.adjoint_graph(x, W)
    prims = [str(e.primitive) for e in graph.jaxpr.eqns]
    # The adjoints of C = x @ W are matmuls themselves: dx = dC Wᵀ, dW = xᵀ dC.
    assert prims.count("ts_matmul") == 2, prims
    gx, gW = jax.core.eval_jaxpr(graph.jaxpr, graph.consts, jnp.float32(1.0))
    xd, Wd = f64(x), f64(W)
    dC = 1 - np.tanh(xd @ Wd) ** 2
    assert_close(gx, dC @ Wd.T)
    assert_close(gW, xd.T @ dC)


def test_autodiff_rejects_non_callables():
    with pytest.raises(TypeError, match=r"ts\.autodiff: expected a function, got a str"):
        ts.autodiff("f")


# --- custom_vjp / custom_jvp --------------------------------------------------------------


def _clip_gradient_fn():
    @ts.custom_vjp
    def clip_grad(x):
        """Identity forward; the backward clips the cotangent to [-1, 1]."""
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: jnp.clip(g, -1.0, 1.0))  # bare cotangent
    return clip_grad


def test_custom_vjp_one_argument_bare_cotangent():
    clip_grad = _clip_gradient_fn()
    assert clip_grad.__name__ == "clip_grad" and "Identity" in clip_grad.__doc__
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(clip_grad(x), x)
    g = jax.grad(lambda x: jnp.sum(clip_grad(x) * 5.0))(x)
    np.testing.assert_array_equal(g, jnp.ones(4))
    g = jax.jit(jax.vmap(jax.grad(lambda x: clip_grad(x) * -3.0)))(x)
    np.testing.assert_array_equal(g, -jnp.ones(4))


def test_custom_vjp_several_arguments_and_nondiff(x64):
    @ts.custom_vjp
    def mul(x, y):
        return x * y

    mul.defvjp(lambda x, y: (x * y, (x, y)), lambda r, g: (g * r[1], g * r[0]))
    x, y = rand((3,), jnp.float64), rand((3,), jnp.float64)
    check_grads(mul, (x, y), order=1, modes=("rev",))

    @ts.custom_vjp(nondiff_argnums=(0,))
    def power(n, x):
        return x**n

    power.defvjp(lambda n, x: (x**n, x), lambda n, x, g: n * x ** (n - 1) * g)  # bare
    check_grads(lambda x: power(3, x), (x,), order=1, modes=("rev",))
    assert repr(power) == "ts.custom_vjp(power)"


def test_custom_jvp(x64):
    @ts.custom_jvp
    def softplus(x):
        return jnp.log1p(jnp.exp(x))

    @softplus.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return softplus(x), t * jax.nn.sigmoid(x)

    x = rand((5,), jnp.float64)
    np.testing.assert_allclose(softplus(x), np.log1p(np.exp(f64(x))), rtol=1e-12)
    check_grads(softplus, (x,), order=2, modes=("fwd", "rev"))

    @ts.custom_jvp
    def square(x):
        return x * x

    square.defjvps(lambda t, ans, x: 2 * x * t)
    check_grads(square, (x,), order=1, modes=("fwd", "rev"))


# --- ts.jit -------------------------------------------------------------------------------


def test_jit_forms():
    def f(x, n):
        return x * n

    x = jnp.arange(3.0)
    for jf in (
        ts.jit(f, static_argnames="n"),
        ts.jit(static_argnames=("n",))(f),
        ts.jit(static_argnums=1)(f),
    ):
        np.testing.assert_array_equal(jf(x, 2), x * 2)
        assert jf.__name__ == "f"
        assert "mul" in str(jf.trace(x, 2).jaxpr)

    @ts.jit
    def g(x):
        return x + 1

    np.testing.assert_array_equal(g(x), x + 1)

    @ts.jit()
    def train_step(batch):
        return jnp.sum(batch)

    assert float(train_step(x)) == 3.0


def test_jit_errors():
    with pytest.raises(TypeError, match=r"ts\.jit: capture_graph='yes' must be a bool or None"):
        ts.jit(lambda x: x, capture_graph="yes")
    with pytest.raises(TypeError, match=r"ts\.jit: capture_graph=1 must be a bool or None"):
        ts.jit(capture_graph=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'capture_graphs'"):
        ts.jit(lambda x: x, capture_graphs=True)
    with pytest.raises(TypeError, match=r"ts\.jit: expected a function, got a int"):
        ts.jit(1)
