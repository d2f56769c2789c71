"""Graph modules (ts.graph.module) and their rewrite passes.

Each rewrite is checked applied (the fused operator in the rewritten jaxpr; results and
gradients against a float64 run of the graph as written) and not applied on near-miss
patterns (the graph left exactly as traced).
"""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import ROOT, assert_close, f64

import tessera_jax as ts

BF16 = jnp.bfloat16
GRAPHS_MD = ROOT / "docs" / "GRAPHS.md"
_RNG = np.random.default_rng(2026 + int(os.environ.get("TESSERA_TEST_SEED", "0")))


def rand(shape, dtype=jnp.float32) -> jax.Array:
    """Standard-normal values (never zeros) drawn with numpy and rounded to ``dtype``: a
    jax.random draw compiles a program for every new shape, which would dominate this file."""
    return jnp.asarray(_RNG.standard_normal(shape).astype(np.float32).astype(np.dtype(dtype)))


def _unchanged(graph):
    """The rewritten graph is the traced one: no pass reported a change."""
    assert not any(r.changed for r in graph.report), [str(r) for r in graph.report]
    assert graph.jaxpr is graph.original


def _f64(module, *args):
    """``module`` as written (no passes), on float64 copies of ``args`` (masks as they are)."""
    return module.with_passes(())(*(a if a.dtype == bool else jnp.asarray(f64(a)) for a in args))


def _grads(fn, args, w):
    """Gradients of ``sum(fn(*args) · w)`` with respect to every float argument."""
    nums = tuple(i for i, a in enumerate(args) if a.dtype != bool)
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=nums))(*args)


def _assert_grads_match_unrewritten(module, args, w, dtype):
    """The rewritten module's gradients against the unrewritten one's in float64."""
    got = _grads(module, args, w.astype(dtype))
    ref_args = [a if a.dtype == bool else jnp.asarray(f64(a)) for a in args]
    refs = _grads(module.with_passes(()), ref_args, jnp.asarray(f64(w)))
    for g, r in zip(got, refs):
        assert_close(g, f64(r), dtype, factor=8)


# --- attention ----------------------------------------------------------------------------


def _bshd_attention(causal: bool, scale: str | None = "scores"):
    """Seed 004's attention over (batch, seq, heads, dim) inputs, heads moved for the
    products and back; the scale applied to the scores, to the queries, or not at all."""

    @ts.graph.module("attention")
    def attention(q, k, v):
        c = 1.0 / math.sqrt(q.shape[-1])
        s = ts.matmul((q * c if scale == "q" else q).transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1))
        if scale == "scores":
            s = s * c
        if causal:
            n = s.shape[-1]
            s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
        return ts.matmul(ts.softmax(s, axis=-1), v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    return attention


@ts.graph.module("seed004")
def seed004(Q, K, V):
    """Seed 004 verbatim: 2-D operands, no scale."""
    S = ts.matmul(Q, K.T)
    A = ts.softmax(S)
    return ts.matmul(A, V)


@ts.graph.module("heads_masked")
def heads_masked(q, k, v, drop):
    """(heads, seq, dim) operands, the scale as a division, a runtime mask of the keys
    to drop (True: hidden), broadcast over the queries."""
    s = ts.matmul(q, jnp.swapaxes(k, -1, -2)) / 2.0
    s = jnp.where(drop, -jnp.inf, s)
    return ts.matmul(ts.softmax(s, axis=-1), v)


def test_graph_text_ops_and_report():
    q, k, v = (rand((2, 8, 3, 4)) for _ in range(3))
    attention = _bshd_attention(causal=True)
    graph = attention.lower(q, k, v)
    assert graph.ops == ("ts_flash_attention_fwd",)
    plain = attention.with_passes(()).lower(q, k, v)
    assert plain.ts_ops == ("ts_matmul", "ts_softmax", "ts_matmul")
    assert plain.ops[:3] == ("transpose", "transpose", "ts_matmul")
    assert plain.ops.count("transpose") == 4 and plain.ops[-1] == "transpose"
    assert {"mul", "select_n", "iota"} <= set(plain.ops)  # jax operations by their names
    assert [e.primitive.name for e in graph.original.jaxpr.eqns] == list(plain.ops)
    text = str(graph)
    assert text.startswith("graph attention: 3 inputs, 1 ops")
    for piece in (
        "q: f32[2,8,3,4]",
        "ts_flash_attention_fwd(q, k, v)",
        "causal=True",
        "scale=0.5",
        "attention_fusion: 1 rewrite, 18 ops -> 3",  # the mask's iota etc. dropped too
        "ts_matmul, mul, select_n, ts_softmax, ts_matmul -> ts_flash_attention_fwd",
        "matmul_epilogue: no match (graph unchanged)",
    ):
        assert piece in text, (piece, text)
    assert [r.name for r in graph.report] == [p.name for p in ts.graph.DEFAULT_PASSES]


def test_graph_text_shows_shardings():
    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(rand((8, 4)), jax.NamedSharding(mesh, jax.P("x")))
    w = rand((4, 4))

    @ts.graph.module("dense")
    def dense(x, w):
        return ts.relu(ts.matmul(x, w))

    text = str(dense.lower(x, w))
    assert "x: f32[8@x,4]  sharding {'x': 8} spec=('x',)" in text, text
    assert "w: f32[4,4]\n" in text
    assert "%0: f32[8@x,4] = ts_matmul(x, w)" in text  # Explicit axes: sharding in the types
    out = dense(x, w)
    assert out.sharding.spec == jax.P("x", None)
    np.testing.assert_allclose(out, np.maximum(f64(x) @ f64(w), 0), rtol=1e-5, atol=1e-6)


_ATTENTION_CASES = [
    # (name, module, input shapes, dtype, check gradients)
    ("bshd-causal", _bshd_attention(True), [(2, 8, 2, 4)] * 3, jnp.float32, True),
    ("bshd-full-qscale", _bshd_attention(False, scale="q"), [(1, 6, 2, 4)] * 3, BF16, False),
    ("seed004-2d", seed004, [(5, 4), (7, 4), (7, 4)], jnp.float32, True),
]


@pytest.mark.parametrize(
    "name,module,shapes,dtype,grads", _ATTENTION_CASES, ids=[c[0] for c in _ATTENTION_CASES]
)
def test_attention_rewrite_matches_unrewritten(name, module, shapes, dtype, grads, x64):
    args = [rand(s, dtype) for s in shapes]
    graph = module.lower(*args)
    assert graph.ts_ops == ("ts_flash_attention_fwd",)
    assert graph.report[0].changed
    out = module(*args)
    assert out.dtype == dtype
    assert_close(out, f64(_f64(module, *args)), dtype, factor=4)
    if not grads:
        return
    _assert_grads_match_unrewritten(module, args, rand(out.shape, jnp.float32), dtype)


def test_attention_runtime_mask():
    q, k, v = rand((2, 6, 4)), rand((2, 5, 4)), rand((2, 5, 4))
    drop = _RNG.random((2, 1, 5)) < 0.4
    drop[:, :, 0] = False  # every query sees a key
    drop = jnp.asarray(drop)
    graph = heads_masked.lower(q, k, v, drop)
    assert graph.ts_ops == ("ts_flash_attention_fwd",)
    (change,) = graph.report[0].changes
    assert "mask" in change.note and "scale=0.5" in change.note and "batch flattened" in change.note
    assert "not" in graph.ops  # the mask inverted: flash attention's mask says who attends
    ref = heads_masked.with_passes(())(q, k, v, drop)
    np.testing.assert_allclose(heads_masked(q, k, v, drop), ref, rtol=1e-5, atol=1e-6)


def test_attention_constant_noncausal_mask_with_finite_fill():
    """A constant mask that is not causal is passed as flash attention's mask; a finite
    fill is accepted since every row keeps a visible key."""
    band = np.abs(np.arange(6)[:, None] - np.arange(6)[None, :]) <= 1

    @ts.graph.module("banded")
    def banded(q, k, v):
        s = ts.matmul(q, k.T)
        s = jnp.where(band, s, jnp.finfo(jnp.float32).min)
        return ts.matmul(ts.softmax(s), v)

    q, k, v = (rand((6, 4)) for _ in range(3))
    graph = banded.lower(q, k, v)
    assert graph.ts_ops == ("ts_flash_attention_fwd",)
    assert_close(banded(q, k, v), f64(banded.with_passes(())(q, k, v)), jnp.float32, factor=4)


def _near_misses():
    def wrong_axis(q, k, v):
        return ts.matmul(ts.softmax(ts.matmul(q, k.T), axis=0), v)

    def probabilities_twice(q, k, v):
        p = ts.softmax(ts.matmul(q, k.T))
        return ts.matmul(p, v), p

    def transposed_probabilities(q, k, v):  # contracts over the queries: not attention
        return ts.matmul(ts.softmax(ts.matmul(q, k.T)).T, v)

    def value_dim_differs(q, k, v):  # flash attention needs k.shape == v.shape
        return ts.matmul(ts.softmax(ts.matmul(q, k.T)), jnp.concatenate([v, v], axis=1))

    def finite_fill_too_small(q, k, v):
        s = jnp.where(jnp.tril(jnp.ones((6, 6), bool)), ts.matmul(q, k.T), -1e4)
        return ts.matmul(ts.softmax(s), v)

    def scale_per_key(q, k, v):
        return ts.matmul(ts.softmax(ts.matmul(q, k.T) * jnp.arange(1.0, 7.0)[None, :]), v)

    return [
        wrong_axis,
        probabilities_twice,
        transposed_probabilities,
        value_dim_differs,
        finite_fill_too_small,
        scale_per_key,
    ]


@pytest.mark.parametrize("fn", _near_misses(), ids=lambda f: f.__name__)
def test_attention_near_misses_are_not_rewritten(fn):
    module = ts.graph.module(fn.__name__)(fn)
    q, k, v = (rand((6, 4)) for _ in range(3))
    graph = module.lower(q, k, v)
    _unchanged(graph)
    assert "ts_flash_attention_fwd" not in graph.ops


def test_attention_shared_key_batch_is_not_rewritten():
    """Batch dimensions that differ between the products (a 2-D key shared by every head)."""

    @ts.graph.module("shared_k")
    def shared_k(q, k, v):
        return ts.matmul(ts.softmax(ts.matmul(q, k.T)), v)

    graph = shared_k.lower(rand((2, 6, 4)), rand((6, 4)), rand((2, 6, 4)))
    _unchanged(graph)


# --- matmul epilogue ----------------------------------------------------------------------

_EPILOGUES = [
    ("bias", "relu", "residual"),
    ("bias", "gelu_tanh", None),
    (None, "gelu", None),
    ("bias", None, "residual"),
]


@pytest.mark.parametrize("bias,act,residual", _EPILOGUES)
def test_matmul_epilogue_rewrite(bias, act, residual, x64):
    grads = _EPILOGUES.index((bias, act, residual)) < 2  # gradients of two cases suffice
    acts = {"relu": ts.relu, "gelu": ts.gelu, "gelu_tanh": lambda z: ts.gelu(z, approximate=True)}

    @ts.graph.module("layer")
    def layer(x, w, b, r):
        y = ts.matmul(x, w)
        if bias:
            y = y + b[None, None, :]
        if act:
            y = acts[act](y)
        return y + r if residual else y

    args = [rand((2, 3, 5)), rand((5, 4)), rand((4,)), rand((2, 3, 4))]
    graph = layer.lower(*args)
    assert graph.ts_ops == ("ts_matmul",)
    (eqn,) = [e for e in graph.jaxpr.jaxpr.eqns if e.primitive.name == "ts_matmul"]
    spec = eqn.params["spec"]
    assert (spec.has_bias, spec.activation, spec.has_residual) == (
        bias is not None,
        act,
        residual is not None,
    )
    assert_close(layer(*args), f64(_f64(layer, *args)), jnp.float32, factor=4)
    if not grads:
        return
    _assert_grads_match_unrewritten(layer, args, rand((2, 3, 4)), jnp.float32)


def test_matmul_epilogue_near_misses():
    @ts.graph.module("used_twice")
    def used_twice(x, w, b):
        y = ts.matmul(x, w)
        return ts.relu(y + b[None, :]), y

    @ts.graph.module("column_bias")
    def column_bias(x, w, c):  # broadcast along the rows' axis: not ts_matmul's bias
        return ts.matmul(x, w) + c[:, None]

    x, w = rand((4, 5)), rand((5, 4))
    _unchanged(used_twice.lower(x, w, rand((4,))))
    _unchanged(column_bias.lower(x, w, rand((4,))))


# --- rmsnorm fused into the following matmul -----------------------------------------------


def test_rmsnorm_matmul_rewrite(x64):
    # ts.linear flattens the rows (a reshape between the norm and the product); ts.matmul
    # shares a 2-D b across x's batch: both rewritten, results and gradients as written.
    @ts.graph.module("block")
    def block(x, g, w1, w2):
        h = ts.op.linear(ts.rmsnorm(x, g), w1)
        return ts.matmul(ts.rmsnorm(h, g[:4]), w2)

    args = [rand((2, 3, 8)), rand((8,)), rand((8, 4)), rand((4, 5))]
    graph = block.lower(*args)
    assert graph.ts_ops == ("ts_rmsnorm_matmul", "ts_rmsnorm_matmul")
    assert "rmsnorm_matmul: 2 rewrites" in str(graph)
    assert_close(block(*args), f64(_f64(block, *args)), jnp.float32, factor=4)
    _assert_grads_match_unrewritten(block, args, rand((2, 3, 5)), jnp.float32)


def test_rmsnorm_matmul_near_misses():
    @ts.graph.module("used_twice")
    def used_twice(x, g, w):
        y = ts.rmsnorm(x, g)
        return ts.matmul(y, w), y

    @ts.graph.module("right_operand")
    def right_operand(x, g, w):  # the normalised value is b: no row statistic of a
        return ts.matmul(w.T, ts.rmsnorm(x, g))

    @ts.graph.module("with_bias")
    def with_bias(x, g, w, c):  # a fused epilogue: the epilogue pass's product
        return ts.op.linear(ts.rmsnorm(x, g), w, c)

    @ts.graph.module("no_weight")
    def no_weight(x, w):
        return ts.matmul(ts.rmsnorm_safe(x), w)

    x, g, w = rand((8, 8)), rand((8,)), rand((8, 8))
    _unchanged(used_twice.lower(x, g, w))
    _unchanged(right_operand.lower(x, g, w))
    _unchanged(no_weight.lower(x, w))
    graph = with_bias.lower(x, g, w, rand((8,)))
    assert graph.ts_ops == ("ts_rmsnorm", "ts_matmul")


# --- transformations, caching, user passes, errors ----------------------------------------


def test_jit_vmap_and_ts_grad_compose():
    attention = _ATTENTION_CASES[0][1]  # compiled for (2, 8, 2, 4) by the test above
    q, k, v = (rand((2, 2, 8, 2, 4)) for _ in range(3))
    batched = jax.vmap(attention)(q, k, v)
    looped = jnp.stack([attention(q[i], k[i], v[i]) for i in range(2)])
    np.testing.assert_allclose(batched, looped, rtol=1e-6, atol=1e-6)

    @ts.graph.module("layer")
    def layer(x, w, b):
        return ts.gelu(ts.matmul(x, w) + b[None, :])

    x, w, b = rand((4, 3)), rand((3, 2)), rand((2,))
    assert layer.lower(x, w, b).ts_ops == ("ts_matmul",)
    np.testing.assert_array_equal(jax.jit(layer)(x, w, b), layer(x, w, b))
    dw = ts.grad(lambda x, w, b: jnp.sum(layer(x, w, b)), wrt="w")(x, w, b)
    dw_ref = jax.grad(lambda w: jnp.sum(layer.with_passes(())(x, w, b)))(w)
    assert_close(dw, f64(dw_ref), jnp.float32, factor=8)


def test_traced_once_per_input_types():
    calls = []

    @ts.graph.module("counted")
    def counted(x, w):
        calls.append(1)
        return ts.relu(ts.matmul(x, w))

    x, w = rand((4, 3)), rand((3, 2))
    g1 = counted.lower(x, w)
    counted(x, w)
    jax.jit(counted)(x + 1, w)
    assert len(calls) == 1 and counted.lower(x, w).jaxpr is g1.jaxpr
    counted(rand((5, 3)), w)
    assert len(calls) == 2


def _docs_example() -> dict:
    """Runs docs/GRAPHS.md's user-pass example and returns its namespace."""
    blocks = re.findall(r"```python\n(.*?)```", GRAPHS_MD.read_text(), flags=re.S)
    (example,) = [b for b in blocks if "PatternPass" in b]
    namespace: dict = {"__name__": "__graphs_md__"}
    exec(compile(example, "docs/GRAPHS.md", "exec"), namespace)
    return namespace


def test_docs_user_pass_example_runs():
    ns = _docs_example()
    graph, block = ns["graph"], ns["block"]
    assert graph.ts_ops == ("ts_matmul", "ts_relu")
    assert str(graph.report[0]) == (
        "relu_idempotent: 1 rewrite, 3 ops -> 2\n  ts_relu, ts_relu -> ts_relu"
    )
    x, w = ns["x"], ns["w"]
    np.testing.assert_array_equal(block(x, w), block.with_passes(())(x, w))


def test_user_pass_declines_and_bad_replacements():
    @ts.graph.module("double_exp")
    def double_exp(x):
        return ts.exp(ts.exp(x))

    x = rand((3,))
    decline = ts.graph.PatternPass("never", ["exp", "exp"], lambda m: None)
    _unchanged(double_exp.with_passes([decline]).lower(x))
    wrong = ts.graph.PatternPass("wrong", ["ts_exp", "exp"], lambda m: lambda x: x[:2])
    with pytest.raises(TypeError, match=r"graph pass 'wrong': the replacement of ts_exp, ts_exp"):
        double_exp.with_passes([wrong]).lower(x)


def test_bad_input_errors():
    with pytest.raises(TypeError, match=r"graph.module: name=3 must be a non-empty str"):
        ts.graph.module(3)
    with pytest.raises(TypeError, match=r"passes entry 'fuse' is not a graph pass"):
        ts.graph.module("m", passes=["fuse"])
    with pytest.raises(TypeError, match=r"passes=.* must be a tuple or list"):
        ts.graph.module("m", passes=ts.graph.TransposeFolding())
    with pytest.raises(ValueError, match=r"pattern entry 'softmaxx' is not a ts operator"):
        ts.graph.PatternPass("p", ["softmaxx"], lambda m: None)
    with pytest.raises(TypeError, match=r"pattern='relu' must be a non-empty sequence"):
        ts.graph.PatternPass("p", "relu", lambda m: None)
    with pytest.raises(TypeError, match=r"argument K='keys' of type str is not an array"):
        seed004(rand((2, 4)), "keys", rand((2, 4)))
    types = [jax.ShapeDtypeStruct((2, 4), jnp.float32)] * 3
    assert seed004.lower(*types).ts_ops == ("ts_flash_attention_fwd",)
    with pytest.raises(TypeError, match=r"argument Q is a ShapeDtypeStruct; call the module"):
        seed004(*types)
    with pytest.raises(TypeError, match=r"graph module 'seed004': missing a required argument"):
        seed004(rand((2, 4)), rand((2, 4)))
