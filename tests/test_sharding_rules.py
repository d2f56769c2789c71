"""Sharding rules of the kernel path: under ``jax.jit`` with NamedSharding inputs and
``TESSERA_KERNELS=interpret``, a kernel partitions without gathering what it need not.

The rules are exercised with a portable Pallas kernel (interpret mode) that runs an
operator's reference on whole blocks, installed as the operator's first kernel for the
duration of a test: the partitioning is what is tested, whatever kernel a real
operator has. Operators that ship their own kernels are checked too.
"""

import contextlib
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax.primitives._core import OPERATORS, SHARDING_RULES, Kernel
from tests._util import (
    always_and_sample,
    by_row_blocks,
    np_activation,
    np_activation_derivative,
    np_tree,
    rand,
    sample,
    sample_grid,
)


def _params_of(spec):
    """The bind parameters a kernel's ``spec`` was decoded from (``Operator.spec``): the
    operator's spec dataclass, or the frozen items of an operator without one."""
    return dict(spec) if isinstance(spec, tuple) else {"spec": spec}


def block_kernel(reference):
    """A Pallas kernel computing ``reference`` one leading-dim row at a time (a grid over
    dim 0 of the first result; operands of that leading size are blocked, the others
    whole), as a real kernel tiles its batch."""

    def fn(spec, *xs, interpret):
        params = _params_of(spec)
        outs = jax.eval_shape(lambda *a: reference(*a, **params), *xs)
        flat, tree = jax.tree.flatten(outs)
        rows = flat[0].shape[0]

        def spec(shape):
            n = len(shape)
            if n and shape[0] == rows:
                return pl.BlockSpec((1, *shape[1:]), lambda i: (i,) + (0,) * (n - 1))
            return pl.BlockSpec(shape, lambda i: (0,) * n)

        def body(*refs):
            ins, outs_ = refs[: len(xs)], refs[len(xs) :]
            for o, v in zip(outs_, jax.tree.leaves(reference(*[r[...] for r in ins], **params))):
                o[...] = v

        call = pl.pallas_call(
            body,
            out_shape=flat,
            grid=(rows,),
            in_specs=[spec(x.shape) for x in xs],
            out_specs=[spec(o.shape) for o in flat],
            interpret=interpret,
        )
        return jax.tree.unflatten(tree, call(*xs))

    return fn


@contextlib.contextmanager
def pallas_kernel(*names):
    added = []
    for name in names:
        op = OPERATORS[name]
        k = Kernel(
            name="test_block",
            fn=block_kernel(op.reference),
            supports=lambda spec, avals: None,
            platforms=("cpu", "cuda"),
        )
        op.kernels.insert(0, k)
        added.append((op, k))
    try:
        with ts.kernel_mode("interpret"):
            yield
    finally:
        for op, k in added:
            op.kernels.remove(k)


def collectives(f, *args) -> Counter:
    txt = jax.jit(f).lower(*args).compile().as_text()
    pat = r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
    return Counter(re.findall(pat, txt))


@pytest.fixture(scope="module")
def mesh():
    return ts.dist.Mesh(axes=["dp", "tp"], devices=range(8), shape=(4, 2)).jax_mesh


def put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def test_control_without_rule_the_kernel_is_gathered(mesh):
    """What the rules fix: a pallas_call is replicated by XLA's partitioner."""
    x = put(mesh, rand((8, 16, 32)), "dp")
    rule = SHARDING_RULES.pop("softmax")
    try:
        with pallas_kernel("softmax"):
            assert collectives(lambda v: ts.softmax(v), x)["all-gather"] >= 1
    finally:
        SHARDING_RULES["softmax"] = rule
        jax.clear_caches()  # the rules are not part of jax's cache keys


def _cases(mesh):
    x = put(mesh, rand((8, 16, 32)), "dp")
    w = put(mesh, rand((32,)))
    bias = put(mesh, rand((32,)))
    a3 = put(mesh, rand((8, 16, 32)), "dp")
    b_col = put(mesh, rand((32, 24)), None, "tp")
    q = put(mesh, rand((4, 16, 4, 8)), "dp", None, "tp")
    q8 = put(mesh, rand((4, 16, 8, 8)), "dp", None, "tp")
    kv2 = put(mesh, rand((4, 16, 2, 8)), "dp", None, "tp")
    return {
        # name: (operators, function, args, expected output spec)
        "relu": (("relu",), ts.relu, (x,), P("dp")),
        "stochastic cast": (
            ("stochastic_cast",),
            lambda x: ts.cast(x, ts.bf16 @ ts.stochastic_round, key=jax.random.key(0)),
            (x,),
            P("dp"),
        ),
        "softmax": (("softmax",), ts.softmax, (x,), P("dp")),
        "log_softmax": (("log_softmax",), ts.log_softmax, (x,), P("dp")),
        "rmsnorm": (("rmsnorm",), ts.rmsnorm, (x, w), P("dp")),
        "layernorm": (("layernorm",), ts.layernorm, (x, w, bias), P("dp")),
        "matmul batch + column parallel": (
            ("matmul",),
            ts.matmul,
            (a3, b_col),
            P("dp", None, "tp"),
        ),
        "attention batch + heads": (
            ("flash_attention_fwd",),
            lambda q: ts.flash_attention(q, q, q, causal=True),
            (q,),
            P("dp", None, "tp"),
        ),
        "attention GQA": (
            ("flash_attention_fwd",),
            lambda q, kv: ts.flash_attention(q, kv, kv),
            (q8, kv2),
            P("dp", None, "tp"),
        ),
    }


CASE_NAMES = [
    "relu",
    "stochastic cast",
    "softmax",
    "log_softmax",
    "rmsnorm",
    "layernorm",
    "matmul batch + column parallel",
    "attention batch + heads",
    "attention GQA",
]


@pytest.mark.parametrize("name", sample(CASE_NAMES, 3))
def test_sharded_kernel_does_not_gather(mesh, name):
    ops, f, args, spec = _cases(mesh)[name]
    expect = jax.jit(f)(*args)  # the XLA reference, partitioned by XLA
    with pallas_kernel(*ops):
        assert collectives(f, *args) == Counter(), name
        out = jax.jit(f)(*args)
    assert out.sharding.spec == spec
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(expect, np.float32), rtol=1e-5, atol=1e-5
    )


def test_attention_backward_partitions(mesh):
    q = put(mesh, rand((4, 16, 4, 8)), "dp", None, "tp")
    loss = lambda q: jnp.sum(ts.flash_attention(q, q, q) ** 2)
    expect = jax.jit(jax.grad(loss))(q)
    with pallas_kernel("flash_attention_fwd", "flash_attention_bwd"):
        assert collectives(jax.grad(loss), q) == Counter()
        g = jax.jit(jax.grad(loss))(q)
    assert g.sharding.spec == P("dp", None, "tp")
    np.testing.assert_allclose(g, expect, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tp", [4, 2])
def test_row_parallel_matmul_reduces_deterministically(tp):
    """K sharded: local partial products, the canonical-tree all-reduce, then the epilogue;
    the operands are not gathered. Over 4 parts the tree runs (all_to_all + all_gather, no
    all-reduce); over 2, NCCL's all-reduce (one addition, which commutes: the same bits)."""
    mesh = ts.dist.Mesh(axes=["dp", "tp"], devices=range(8), shape=(8 // tp, tp)).jax_mesh
    a = put(mesh, rand((128, 32)), None, "tp")  # a 2 MiB output: the all_to_all path
    b = put(mesh, rand((32, 4096)), "tp", None)
    bias = put(mesh, rand((4096,)))
    f = lambda a, b, bias: ts.op.linear(a, b, bias, activation="relu")
    expect = jax.jit(f)(a, b, bias)
    with pallas_kernel("matmul"):
        c = collectives(f, a, b, bias)
        out = jax.jit(f)(a, b, bias)
        again = jax.jit(f)(a, b, bias)
    want = {"all-reduce": 1} if tp == 2 else {"all-to-all": 1, "all-gather": 1}
    assert c == Counter(want)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)
    assert np.asarray(out).tobytes() == np.asarray(again).tobytes()
    # the partial sums over the K parts, added on the canonical tree, then the epilogue
    k = 32 // tp
    parts = [
        np.asarray(a)[:, i * k : (i + 1) * k] @ np.asarray(b)[i * k : (i + 1) * k]
        for i in range(tp)
    ]
    np.testing.assert_allclose(
        out, np.maximum(np_tree(np.stack(parts)) + np.asarray(bias), 0), rtol=1e-5, atol=1e-5
    )


def test_row_parallel_two_output_form_reduces_then_finishes():
    """K sharded under jax.grad: the two-output form's partial products are added by the
    deterministic all-reduce, then both outputs come from one epilogue (the contract's)."""
    mesh = ts.dist.Mesh(axes=["dp", "tp"], devices=range(8), shape=(4, 2)).jax_mesh
    a = put(mesh, rand((64, 32)), None, "tp")
    b = put(mesh, rand((32, 256), scale=0.3), "tp", None)
    bias = put(mesh, rand((256,)))
    f = lambda a, b, bias: ts.op.linear(a, b, bias, activation="gelu")
    grad = jax.grad(lambda *xs: jnp.sum(f(*xs) ** 2), argnums=(0, 1, 2))
    expect = jax.jit(grad)(a, b, bias)
    with pallas_kernel("matmul_with_derivative"):
        assert collectives(grad, a, b, bias)["all-gather"] == 0
        got = jax.jit(grad)(a, b, bias)
    for g, e in zip(got, expect):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)
    z = np.asarray(a, np.float64) @ np.asarray(b, np.float64) + np.asarray(bias)
    y = np_activation(z, "gelu")
    np.testing.assert_allclose(
        got[2], (2 * y * np_activation_derivative(z, "gelu")).sum(0), rtol=1e-4, atol=1e-4
    )


def test_softmax_axis_sharded_is_gathered_along_that_axis_only(mesh):
    x = put(mesh, rand((8, 32)), "dp", "tp")
    expect = jax.jit(ts.softmax)(x)
    with pallas_kernel("softmax"):
        out = jax.jit(ts.softmax)(x)
    np.testing.assert_allclose(out, expect, rtol=1e-6)


def test_kernel_inside_index_launch():
    """Kernels traced inside shard_map (index_launch) need no vma of their own."""
    m = ts.dist.Mesh(axes=["dp"], devices=range(4))
    X = ts.dist.tensor((8, 16), ts.ShardSpec(("row",), ("dp",)), m, "f32", rand((8, 16)))
    launch = ts.index_launch(axis="dp")(lambda x: ts.softmax(x))
    expect = ts.softmax(np.asarray(X))
    with pallas_kernel("softmax"):
        out = launch(X.parts("dp"))
    np.testing.assert_allclose(out, expect, rtol=1e-6)


@pytest.mark.parametrize("name", ["softmax", "rmsnorm", "layernorm", "matmul"])
def test_shipped_kernels_do_not_gather(mesh, name):
    """Operators with their own kernels, batch-sharded, under TESSERA_KERNELS=interpret."""
    op = OPERATORS[name]
    if not op.kernels:
        pytest.skip(f"{name} has no kernel yet")
    ops, f, args, spec = {
        "softmax": _cases(mesh)["softmax"],
        "rmsnorm": _cases(mesh)["rmsnorm"],
        "layernorm": _cases(mesh)["layernorm"],
        "matmul": _cases(mesh)["matmul batch + column parallel"],
    }[name]
    del ops
    with ts.kernel_mode("interpret"):
        assert collectives(f, *args)["all-gather"] == 0
        assert jax.jit(f)(*args).sharding.spec == spec


@pytest.mark.parametrize("name", ["softmax", "rmsnorm", "layernorm"])
def test_shipped_norm_backward_keeps_rows_local(mesh, name):
    """Gradients of batch-sharded norms with the shipped forward and backward kernels: dx
    keeps x's sharding, and the only collectives move the (D,)-sized parameter sums (the
    deterministic all-reduce of each device's column sums), never x."""
    _, f, args, spec = _cases(mesh)[name]
    loss = lambda *a: jnp.sum(f(*a) ** 2)
    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    expect = jax.jit(grad)(*args)
    with ts.kernel_mode("interpret"):
        txt = jax.jit(grad).lower(*args).compile().as_text()
        got = jax.jit(grad)(*args)
    pat = r"= (.*?) (?:all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\("
    for shapes in re.findall(pat, txt):  # a collective's result types (a tuple, or one)
        for dims in re.findall(r"\[([\d,]*)\]", shapes):
            assert math.prod(int(d) for d in dims.split(",") if d) <= 4 * 32, shapes
    assert got[0].sharding.spec == spec
    for g, e in zip(got, expect):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-4)


def test_rmsnorm_matmul_kernel_keeps_rows_and_columns_local(mesh):
    """The fused kernel (interpret mode, compiled only: the Mosaic GPU interpreter cannot
    run from eight CPU devices at once) on batch-sharded x and column-sharded b: rows and
    N pass through, nothing is gathered."""
    x = put(mesh, rand((8, 16, 64)).astype(jnp.bfloat16), "dp")
    w = put(mesh, rand((64,)))
    b = put(mesh, rand((64, 32)).astype(jnp.bfloat16), None, "tp")
    with ts.kernel_mode("interpret"):
        compiled = jax.jit(ts.rmsnorm_matmul).lower(x, w, b).compile()
    assert "callback" in compiled.as_text()  # the interpreted kernel, on local shards
    pat = r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
    assert Counter(re.findall(pat, compiled.as_text())) == Counter()
    assert compiled.output_shardings.spec == P("dp", None, "tp")


@pytest.mark.xla_optimized
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_attention_with_sharded_sequences_keeps_its_bits(axis_type):
    """Queries and keys sharded along their sequences (and a bias along its keys), with
    every extra operand: the blocked reference, gathered along the sequences by the rule
    (Auto axes) or before the bind (Explicit), gives the one-device bits, forward, every
    gradient and a forward-mode derivative, where XLA would split its contractions over
    the devices."""
    types = (getattr(jax.sharding.AxisType, axis_type),) * 2
    mesh = jax.make_mesh((2, 4), ("dp", "sp"), axis_types=types)
    b, sq, skv, hq, hkv, d = 2, 16, 160, 4, 2, 8
    q, k, v = rand((b, sq, hq, d)), rand((b, skv, hkv, d)), rand((b, skv, hkv, d))
    bias = rand((1, hq, sq, skv))
    kw = dict(
        causal=True,
        local_window_size=(12, 0),  # the first 32 keys are sliced off (128 kept)
        mask=jax.random.bernoulli(jax.random.key(3), 0.8, (b, 1, sq, skv)),
        key_value_seq_lengths=jnp.asarray([skv, 141], jnp.int32),
        q_segment_ids=jnp.asarray(np.repeat([[0] * 6 + [1] * 10], b, 0), jnp.int32),
        kv_segment_ids=jnp.asarray(np.repeat([[0] * 148 + [1] * 12], b, 0), jnp.int32),
    )
    do = rand(q.shape)

    @jax.jit
    def run(q, k, v, bias, do):
        f = lambda *a: ts.flash_attention(*a, **kw)
        out, vjp = jax.vjp(f, q, k, v, bias)
        return out, vjp(do), jax.jvp(f, (q, k, v, bias), (q, v, k, bias))[1]

    want = run(q, k, v, bias, do)
    with jax.set_mesh(mesh):
        sharded = (
            put(mesh, q, "dp", "sp"),
            put(mesh, k, "dp", "sp"),
            put(mesh, v, "dp", "sp"),
            put(mesh, bias, None, None, None, "sp"),
            # (Under Explicit axes a GQA group's queries are gathered along the sequence,
            # as the reference folds them into one axis of rows; the output gets the
            # queries' sharding back, as jax.nn types it.)
            put(mesh, do, "dp", "sp"),
        )
        got = run(*sharded)
    if axis_type == "Explicit":
        assert jax.typeof(got[0]).sharding.spec[:2] == ("dp", "sp")
        assert jax.typeof(got[1][1]).sharding.spec[:2] == ("dp", "sp")
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.xla_optimized
@pytest.mark.parametrize(
    *sample_grid(
        5,
        name=["softmax", "log_softmax", "rmsnorm", "layernorm", "rmsnorm_matmul"],
        axis_type=["Auto", "Explicit"],
    )
)
def test_normalised_axis_sharded_keeps_its_bits(name, axis_type):
    """Rows and the normalised axis sharded: the reference runs on local rows with the
    axis gathered (the rule applies to it too), so the output and dx are one device's
    bits, where XLA would add partial sums across the devices. (The weight gradients of
    the norms, sums over the rows, are not claimed: see the norm rules.)"""
    types = (getattr(jax.sharding.AxisType, axis_type),) * 2
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=types)
    x, w, wk = rand((64, 1024)) * 3, rand((1024,)), rand((1024, 64))
    g = rand((64, 64)) if name == "rmsnorm_matmul" else rand((64, 1024))
    op = {
        "softmax": ts.softmax,
        "log_softmax": ts.log_softmax,
        "rmsnorm": lambda x: ts.rmsnorm(x, w),
        "layernorm": lambda x: ts.layernorm(x, w, w),
        "rmsnorm_matmul": lambda x: ts.op.rmsnorm_matmul(x, w, wk),
    }[name]
    run = jax.jit(lambda x, g: (op(x), jax.vjp(op, x)[1](g)[0]))
    want = by_row_blocks(run, 2, x, g)  # dp=2 (rmsnorm_matmul's reference has a dot)
    with jax.set_mesh(mesh):
        got = run(
            put(mesh, x, "dp", "tp"), put(mesh, g, "dp", "tp" if g.shape == x.shape else None)
        )
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# The cases that gave wrong values (MQA) or did not lower (two kv heads on four devices)
# always run, a sample of the others.
_HEAD_CASES = [(h, t) for h in (8, 4, 2, 1) for t in ("Auto", "Explicit")]
_HEAD_ALWAYS = [(1, "Auto"), (2, "Auto")]


@pytest.mark.xla_optimized
@pytest.mark.parametrize(
    "heads_kv, axis_type",
    always_and_sample(_HEAD_ALWAYS, _HEAD_CASES, 2),
)
def test_attention_with_sharded_heads_keeps_its_bits(heads_kv, axis_type):
    """Batch and query heads sharded, the kv heads too where they divide (MHA, GQA with a
    kv head per device, GQA with fewer kv heads than devices, MQA), with every extra
    operand: the output and every gradient are one device's bits. (Before: GQA and MQA
    raised under Explicit axes; under Auto axes MQA's dK/dV summed one device's query
    heads only, and GQA with fewer kv heads than devices did not lower.)"""
    types = (getattr(jax.sharding.AxisType, axis_type),) * 2
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=types)
    b, sq, skv, hq, d = 4, 16, 32, 8, 8
    q, k, v = rand((b, sq, hq, d)), rand((b, skv, heads_kv, d)), rand((b, skv, heads_kv, d))
    bias, do = rand((1, hq, sq, skv)), rand(q.shape)
    kw = dict(
        causal=True,
        mask=jax.random.bernoulli(jax.random.key(5), 0.8, (b, 1, sq, skv)),
        query_seq_lengths=jnp.asarray([sq, 1, sq, 2], jnp.int32),
        key_value_seq_lengths=jnp.asarray([skv, 5, 3, skv], jnp.int32),
        q_segment_ids=jnp.zeros((b, sq), jnp.int32),
        kv_segment_ids=jax.random.randint(jax.random.key(6), (b, skv), 0, 2),
    )
    f = lambda q, k, v, bias: ts.flash_attention(q, k, v, bias, **kw)

    @jax.jit
    def run(q, k, v, bias, do):
        out, vjp = jax.vjp(f, q, k, v, bias)
        return out, vjp(do)

    want = run(q, k, v, bias, do)
    kv_heads = "tp" if heads_kv % 4 == 0 else None
    with jax.set_mesh(mesh):
        args = [
            put(mesh, q, "dp", None, "tp"),
            put(mesh, k, "dp", None, kv_heads),
            put(mesh, v, "dp", None, kv_heads),
            put(mesh, bias, None, "tp"),
        ]
        # Under Explicit axes the output's type says where the cotangent lives.
        out_spec = jax.jit(f)(*args).sharding.spec if axis_type == "Explicit" else ("dp",)
        got = run(*args, put(mesh, do, *out_spec))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
