"""Collectives: bitwise canonical-tree all-reduce, the other collectives, adjoints, and
mesh-size-invariant sums over sharded axes (8 CPU devices)."""

import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import tessera_jax as ts
from tessera_jax import _compat, op
from tessera_jax.primitives import collectives as coll
from tests._util import assert_close, f64, np_tree, rand, sample, sample_grid

# Bitwise across meshes and runs: checked on the code XLA optimises (tests/conftest.py).
pytestmark = pytest.mark.xla_optimized


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def collectives_in(f, *args) -> Counter:
    txt = jax.jit(f).lower(*args).compile().as_text()
    pat = r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
    return Counter(re.findall(pat, txt))


MESHES = {
    "8": dict(axes=["dp"], shape=(8,)),
    "2x4": dict(axes=["dp", "tp"], shape=(2, 4)),
    "2x2x2": dict(axes=["dp", "tp", "pp"], shape=(2, 2, 2)),
}


def mesh_of(name):
    return ts.dist.Mesh(devices=range(8), **MESHES[name])


# --- the deterministic all-reduce ----------------------------------------------------------


CASES = [  # (mesh, axis, algo, per-device shape): odd sizes, fewer elements than ranks
    *[
        ("8", "dp", algo, shape)
        for algo in ("binary_tree", "ring", "auto")
        for shape in ((5, 7), (3,))
    ],
    ("2x4", "tp", "binary_tree", (5, 7)),
    ("2x4", "dp", "ring", (3,)),
    ("2x4", ("dp", "tp"), "binary_tree", (3,)),
    ("2x2x2", ("tp", "pp"), "auto", (5, 7)),
    ("2x2x2", "pp", "binary_tree", (4, 2)),
    ("2x4", "dp", "auto", (5, 7)),  # 2 parts: NCCL's all-reduce, the same bits
]


@pytest.mark.parametrize("mesh_name,axis,algo,shape", CASES)
def test_all_reduce_is_the_canonical_tree(mesh_name, axis, algo, shape):
    m = mesh_of(mesh_name)
    axes = (axis,) if isinstance(axis, str) else axis
    n = m.axis_size(axes)
    x = rand((8, *shape))  # block d lives on device d (row-major over the mesh)
    X = ts.dist.tensor(x.shape, ts.ShardSpec((0,), (tuple(m.axes),)), m, "f32", x)

    @ts.index_launch(axis=axis)
    def reduce(part):
        return op.all_reduce(part[0], axis=axis, algo=algo)

    y = np.asarray(reduce(X.parts(tuple(m.axes))))
    # Groups: the devices that differ only along `axes`, ranks in row-major order of `axes`.
    others = [a for a in m.axes if a not in axes]
    devs = np.arange(8).reshape(m.shape)
    perm = [m.axes.index(a) for a in (*others, *axes)]
    groups = np.transpose(devs, perm).reshape(-1, n)
    expect = [np_tree(np.asarray(x)[g]) for g in groups]
    # Results differing between groups come back concatenated along dim 0 in mesh order
    # of the other axes, which is the order of `groups`.
    got = y.reshape(len(groups), *shape)
    for k, e in enumerate(expect):
        assert bits_equal(got[k], e), k


@pytest.mark.parametrize("algo", ["binary_tree", "ring", "gather", "auto"])
def test_all_reduce_of_no_elements(algo):
    """An empty array reduces to an empty array by every algorithm: the chunked ones have
    nothing to send (their zero-size exchange failed MLIR's verifier) and take XLA's."""
    for name in ("sum", "max", "mean"):
        f = lambda a, name=name: op.all_reduce(a, name, axis="dp", algo=algo)
        out = spmd(mesh_of("8"), f, P("dp"), out_spec=P())(jnp.ones((0, 4)))
        assert out.shape == (0, 4), name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32])
def test_all_reduce_dtypes(dtype):
    m = mesh_of("8")
    x = (rand((8, 33), scale=100.0)).astype(dtype)
    y = op.all_reduce(x, axis="dp", mesh=m, algo="binary_tree")
    assert y.dtype == dtype and y.shape == (1, 33)
    if dtype == jnp.int32:
        np.testing.assert_array_equal(np.asarray(y)[0], np.asarray(x).sum(0))
    else:  # accumulated in f32 on the tree, rounded once
        expect = np_tree(np.asarray(x.astype(jnp.float32))).astype(dtype)
        assert bits_equal(np.asarray(y)[0], expect)


@pytest.mark.parametrize(
    "axis,dtype,nccl",
    [
        ("dp", jnp.float32, True),  # 2 parts: one addition, which commutes
        ("tp", jnp.float32, False),  # 4 parts: the order matters, the tree runs
        ("dp", jnp.bfloat16, False),  # 16-bit accumulates in f32 and rounds once: the tree
        ("tp", jnp.int32, True),  # integer sums are associative: any order
    ],
)
def test_auto_takes_nccl_only_where_the_order_is_free(axis, dtype, nccl):
    m = ts.dist.Mesh(axes=["dp", "tp"], devices=range(8), shape=(2, 4))
    x = (rand((8, 4096), scale=100.0)).astype(dtype)
    X = ts.dist.tensor(x.shape, ts.ShardSpec((0,), (("dp", "tp"),)), m, dtype, x)

    def f(X):
        @ts.index_launch(axis=axis)
        def reduce(part):
            return op.all_reduce(part[0], axis=axis)

        return reduce(X.parts(("dp", "tp")))

    found = collectives_in(f, X)
    assert (found["all-reduce"] > 0) == nccl, found
    n = m.axis_size((axis,))
    groups = np.arange(8).reshape(2, 4) if axis == "tp" else np.arange(8).reshape(2, 4).T
    y = np.asarray(jax.jit(f)(X)).reshape(-1, 4096)  # one row per group, in mesh order
    xs = np.asarray(x)
    for i, g in enumerate(groups.reshape(-1, n)):
        expect = xs[g].sum(0, dtype=xs.dtype) if dtype == jnp.int32 else np_tree(xs[g])
        assert bits_equal(y[i], expect)


@pytest.mark.parametrize("reduce_op", ["max", "min"])
def test_integer_max_min_take_nccl_and_are_exact(reduce_op):
    m = mesh_of("8")
    x = (rand((8, 257), scale=1000.0)).astype(jnp.int32)
    f = lambda x: op.all_reduce(x, op=reduce_op, axis="dp", mesh=m)
    assert collectives_in(f, x)["all-reduce"] == 1
    want = getattr(np.asarray(x), reduce_op)(axis=0)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x))[0], want)


def test_all_reduce_seed000_global_view_and_run_to_run():
    """Seed 000 §4: Y = op.all_reduce(X, mesh=mesh, algo="binary_tree", deterministic=True)."""
    mesh = ts.dist.Mesh(axes=["dp"], devices=range(8))
    X = rand((8 * 4, 129))
    Y = op.all_reduce(X, mesh=mesh, algo="binary_tree", deterministic=True)
    assert Y.shape == (4, 129) and Y.sharding.spec == P()
    expect = np_tree(np.asarray(X).reshape(8, 4, 129))
    assert bits_equal(Y, expect)
    f = jax.jit(lambda x: op.all_reduce(x, mesh=mesh, algo="binary_tree"))
    runs = [np.asarray(f(X)) for _ in range(3)]
    assert all(bits_equal(r, expect) for r in runs)
    # The same bits as ts.op.sum of the stacked parts on one device.
    assert bits_equal(Y, op.sum(X.reshape(8, 4, 129), axis=0))
    # deterministic=False is XLA's psum: same value, its own order.
    np.testing.assert_allclose(
        op.all_reduce(X, mesh=mesh, deterministic=False), expect, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kind", ["max", "min", "mean"])
def test_all_reduce_ops(kind):
    m = mesh_of("2x4")
    x = rand((4 * 3, 10))
    y = op.all_reduce(x, kind, axis="tp", mesh=m)
    parts = np.asarray(x).reshape(4, 3, 10)
    if kind == "mean":
        assert bits_equal(y, np_tree(parts) / np.float32(4))
    else:
        np.testing.assert_array_equal(y, getattr(np, kind)(parts, axis=0))


def test_all_reduce_errors():
    m = mesh_of("8")
    with pytest.raises(ValueError, match="op='prod'"):
        op.all_reduce(jnp.ones(8), "prod", axis="dp", mesh=m)
    with pytest.raises(ValueError, match="algo='fast'"):
        op.all_reduce(jnp.ones(8), axis="dp", mesh=m, algo="fast")
    with pytest.raises(ValueError, match=r"x.shape\[0\]=6 must be a multiple of the 8"):
        op.all_reduce(jnp.ones((6, 2)), axis="dp", mesh=m)
    with pytest.raises(ValueError, match="no mesh"):
        op.all_reduce(jnp.ones(8), axis="dp")
    with pytest.raises(ValueError, match="not an axis"):
        op.all_reduce(jnp.ones(8), axis="tp", mesh=m)
    with pytest.raises(TypeError, match="bool"):
        op.all_reduce(jnp.ones(8, bool), axis="dp", mesh=m)


# --- the other collectives -----------------------------------------------------------------


def test_collectives_spmd_semantics():
    m = mesh_of("2x4")
    x = rand((8, 8, 6))  # one (8, 6) block per device
    X = ts.dist.tensor(x.shape, ts.ShardSpec((0,), (("dp", "tp"),)), m, "f32", x)
    blocks = np.asarray(x).reshape(2, 4, 8, 6)

    @ts.index_launch(axis="tp")
    def run(p):
        p = p[0]
        return (
            op.all_gather(p, axis="tp", dim=1),
            op.reduce_scatter(p, axis="tp", dim=0),
            op.scatter(p, axis="tp", dim=0),
            op.all_to_all(p, axis="tp", split_dim=0, concat_dim=1),
        )

    ag, rs, sc, a2a = (np.asarray(v) for v in run(X.parts(("dp", "tp"))))
    for d in range(2):
        g = blocks[d]  # the 4 parts of group d
        for r in range(4):
            i = d * 4 + r
            np.testing.assert_array_equal(ag[i * 8 : (i + 1) * 8], np.concatenate(g, axis=1))
            assert bits_equal(rs[i * 2 : (i + 1) * 2], np_tree(g)[r * 2 : (r + 1) * 2])
            np.testing.assert_array_equal(sc[i * 2 : (i + 1) * 2], g[r][r * 2 : (r + 1) * 2])
            np.testing.assert_array_equal(
                a2a[i * 2 : (i + 1) * 2],
                np.concatenate([g[j][r * 2 : (r + 1) * 2] for j in range(4)], 1),
            )


def test_scatter_and_global_views():
    m = mesh_of("8")
    x = rand((16, 24))
    assert op.all_gather(x, axis="dp", mesh=m).sharding.spec == P()
    s = op.scatter(x, axis="dp", dim=1, mesh=m)
    assert s.sharding.spec == P(None, "dp")
    np.testing.assert_array_equal(s, x)
    t = op.all_to_all(s, axis="dp", split_dim=0, concat_dim=1, mesh=m)
    assert t.sharding.spec == P("dp")
    np.testing.assert_array_equal(t, x)
    rs = op.reduce_scatter(x, axis="dp", dim=1, mesh=m)  # sum of the 8 (2, 24) parts
    assert rs.shape == (2, 24) and rs.sharding.spec == P(None, "dp")
    assert bits_equal(rs, np_tree(np.asarray(x).reshape(8, 2, 24)))

    @ts.index_launch(axis="dp", mesh=m)
    def sc(v):  # scatter of a replicated value: part r keeps slice r
        return op.scatter(v, axis="dp", dim=1)

    np.testing.assert_array_equal(sc(x), np.concatenate(np.split(np.asarray(x), 8, axis=1)))


# --- adjoints ------------------------------------------------------------------------------


def test_all_gather_adjoint_is_deterministic_reduce_scatter():
    """Seed 003 'Effect-Aware Autodiff' inside an SPMD region: the backward of
    all_gather is reduce_scatter on the canonical tree."""
    m = mesh_of("8")
    x = rand((8 * 2, 5))
    X = ts.dist.tensor(x.shape, ts.ShardSpec(("row",), ("dp",)), m, "f32", x)

    def loss(X):
        @ts.index_launch(axis="dp")
        def per_part(p):
            y = op.all_gather(p, axis="dp", dim=0)  # (16, 5), the same on every part
            weight = (jax.lax.axis_index("dp") + 1).astype(jnp.float32)
            return ts.sum(y**2) * weight  # each part's loss term differs

        return jnp.sum(per_part(X.parts("dp")))

    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(X))
    assert "ts_reduce_scatter" in jaxpr and "psum_scatter" not in jaxpr
    grad = jax.jit(jax.grad(loss))  # (one program, not one per op)
    g = grad(X)
    assert isinstance(g, ts.dist.DistTensor)
    np.testing.assert_allclose(np.asarray(g), 2 * np.asarray(x) * sum(range(1, 9)), rtol=1e-6)
    assert bits_equal(g.array, grad(X).array)


def test_collective_grads_match_references():
    m = mesh_of("2x4")
    x = rand((4 * 4, 6))
    X = ts.dist.tensor(x.shape, ts.ShardSpec(("row",), ("tp",)), m, "f32", x)
    c = jnp.arange(1.0, 7.0)[None, :]
    parts = lambda v: v.reshape(4, 4, 6)
    cases = {  # per-part function, the same loss on the whole array
        "all_reduce": (lambda p: op.all_reduce(p, axis="tp") * c, lambda v: parts(v).sum(0) * c),
        "mean": (
            lambda p: op.all_reduce(p, "mean", axis="tp") ** 2,
            lambda v: parts(v).mean(0) ** 2,
        ),
        "max": (
            lambda p: op.all_reduce(p, "max", axis="tp") * 3.0,
            lambda v: parts(v).max(0) * 3.0,
        ),
        "reduce_scatter": (
            lambda p: op.reduce_scatter(p, axis="tp", dim=0) ** 2,
            lambda v: parts(v).sum(0) ** 2,
        ),
        "all_to_all": (
            lambda p: op.all_to_all(p, axis="tp", split_dim=0, concat_dim=1) ** 2,
            lambda v: v**2,
        ),
    }
    for name, (fn, ref) in cases.items():  # (jitted: one program each, not one per op)
        launch = ts.index_launch(axis="tp")(fn)
        g = jax.jit(jax.grad(lambda X, launch=launch: jnp.sum(launch(X.parts("tp")))))(X)
        r = jax.grad(lambda v, ref=ref: jnp.sum(ref(v)))(x)
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-6, err_msg=name)
    # scatter of a replicated value: its adjoint gathers the slices' cotangents
    v = rand((4, 6))
    launch = ts.index_launch(axis="tp", mesh=m)(lambda v: op.scatter(v, axis="tp", dim=0) ** 2)
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(launch(v)))(v), 2 * v, rtol=1e-6)


def test_seed003_distributed_loss():
    """Seed 003 'Effect-Aware Autodiff' in the global view: ts.all_gather of a
    tensor-parallel matmul, differentiated with ts.grad."""
    tp_mesh = ts.dist.mesh(devices=["cpu:0", "cpu:1"], axes=("tp",), shape=(2,))
    x = rand((4, 8))
    W = ts.dist.tensor((8, 6), ts.ShardSpec(("col",), ("tp",)), tp_mesh, "f32", rand((8, 6)))

    @ts.jit
    @ts.autodiff
    def distributed_loss(x, W):
        y = ts.matmul(x, W)
        y = ts.all_gather(y, axis="tp", mesh=tp_mesh)
        return ts.sum(y**2)

    grad_W = ts.grad(distributed_loss, argnums=1)(x, W)
    xd, wd = f64(x), f64(np.asarray(W))
    assert_close(np.asarray(grad_W), 2 * xd.T @ (xd @ wd), rtol=1e-5)


# --- the collectives as primitives: jaxprs, JVPs, second order, vmap ----------------------


EVERY_PART = P(("dp", "tp"))  # one block per device of the 2x4 mesh


def spmd(m, fn, *in_specs, out_spec=EVERY_PART):
    """``fn`` over the parts of mesh ``m`` (default: one block per device, varying over
    every axis), jitted."""
    in_specs = in_specs or (EVERY_PART,)
    return jax.jit(
        _compat.shard_map(
            fn, mesh=m.jax_mesh, in_specs=in_specs, out_specs=out_spec, check_vma=True
        )
    )


def eqns_named(jaxpr, prefix="ts_") -> dict:
    """The equations of ``jaxpr`` and its sub-jaxprs whose primitive name starts with
    ``prefix``, by name."""
    found: dict = {}
    for e in jaxpr.eqns:
        if e.primitive.name.startswith(prefix):
            found.setdefault(e.primitive.name, []).append(e)
        for p in e.params.values():
            sub = p.jaxpr if hasattr(getattr(p, "jaxpr", None), "eqns") else p
            if hasattr(sub, "eqns"):
                for k, v in eqns_named(sub, prefix).items():
                    found.setdefault(k, []).extend(v)
    return found


def test_collectives_are_primitives_in_jaxprs():
    m = mesh_of("2x4")
    x = rand((8, 8, 8))  # one (8, 8) block per device
    X = ts.dist.tensor(x.shape, ts.ShardSpec((0,), (("dp", "tp"),)), m, "f32", x)
    w = rand((8, 8))  # replicated: each part's own copy through ts_replicate

    @ts.index_launch(axis="tp")
    def run(p, w):
        p = p[0]
        return (
            op.all_reduce(p, axis="tp"),
            op.all_gather(p, axis="tp", dim=1),
            op.reduce_scatter(p, axis="tp", dim=0),
            op.scatter(w, axis="tp", dim=0),
            op.all_to_all(p, axis="tp", split_dim=0, concat_dim=1),
        )

    jaxpr = jax.make_jaxpr(run)(X.parts(("dp", "tp")), w)
    found = eqns_named(jaxpr.jaxpr)
    names = ("all_reduce", "all_gather", "reduce_scatter", "scatter", "all_to_all", "replicate")
    assert {f"ts_{n}" for n in names} <= set(found), sorted(found)
    assert "custom_vjp_call" not in str(jaxpr)

    def vma(name):
        (e,) = found[name]
        return _compat.varying_axes_of_aval(e.outvars[0].aval)

    assert vma("ts_all_reduce") == {"dp"}  # the same on every part along tp
    for name in ("ts_all_gather", "ts_reduce_scatter", "ts_all_to_all"):
        assert vma(name) == {"dp", "tp"}, name
    assert vma("ts_replicate") == {"tp"}  # w, entering the launch: each part's own copy
    assert vma("ts_scatter") == {"tp"}
    (e,) = found["ts_all_gather"]
    assert e.outvars[0].aval.shape == (8, 32) and e.params["axes"] == ("tp",)


JVP_CASES = {  # ours, the same operation from lax collectives
    "sum": (lambda v: op.all_reduce(v, axis="tp"), lambda v: lax.psum(v, "tp")),
    "mean": (
        lambda v: op.all_reduce(v, "mean", axis=("dp", "tp"), algo="ring"),
        lambda v: lax.pmean(v, ("dp", "tp")),
    ),
    "max": (
        lambda v: op.all_reduce(v, "max", axis="tp"),
        lambda v: jnp.max(lax.all_gather(v, "tp"), axis=0),
    ),
    "min": (
        lambda v: op.all_reduce(v, "min", axis="tp", deterministic=False),
        lambda v: jnp.min(lax.all_gather(v, "tp"), axis=0),
    ),
    "all_gather": (
        lambda v: op.all_gather(v, axis="tp", dim=1),
        lambda v: lax.all_gather(v, "tp", axis=1, tiled=True),
    ),
    "reduce_scatter": (
        lambda v: op.reduce_scatter(v, axis="tp", dim=0),
        lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True),
    ),
    "scatter": (
        lambda v: op.scatter(v, axis="tp", dim=1),
        lambda v: lax.dynamic_slice_in_dim(v, lax.axis_index("tp") * 2, 2, axis=1),
    ),
    "all_to_all": (
        lambda v: op.all_to_all(v, axis="tp", split_dim=0, concat_dim=1),
        lambda v: lax.all_to_all(v, "tp", 0, 1, tiled=True),
    ),
}


@pytest.mark.parametrize("name", list(JVP_CASES))
def test_collective_jvp_matches_lax(name):
    m = mesh_of("2x4")
    x = jnp.round(rand((8 * 8, 8)) * 2) / 2  # ties between parts: max/min share them
    t = rand((8 * 8, 8))
    ours, ref = JVP_CASES[name]
    y, ty = jax.jvp(spmd(m, ours), (x,), (t,))
    ry, rty = jax.jvp(spmd(m, ref), (x,), (t,))
    assert ty.shape == rty.shape and ty.dtype == rty.dtype
    np.testing.assert_allclose(y, ry, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ty, rty, rtol=1e-5, atol=1e-6)
    tb = np.asarray(t).reshape(2, 4, 8, 8)  # [dp, tp, block]
    if name == "sum":  # the tangent is the canonical tree over the tangents' parts, bitwise
        got = np.asarray(ty).reshape(2, 4, 8, 8)
        assert all(bits_equal(got[d, r], np_tree(tb[d])) for d in range(2) for r in range(4))
    if name == "reduce_scatter":
        got = np.asarray(ty).reshape(2, 4, 2, 8)
        for d, r in np.ndindex(2, 4):
            assert bits_equal(got[d, r], np_tree(tb[d])[r * 2 : (r + 1) * 2])


GRAD_CASES = {  # (in_spec, per-part input shape, body)
    "sum": (P(("dp", "tp")), (4, 4), lambda v: jnp.sin(op.all_reduce(v, axis="tp"))),
    "mean": (
        P(("dp", "tp")),
        (4, 4),
        lambda v: jnp.sin(op.all_reduce(v, "mean", axis=("dp", "tp"))),
    ),
    "max": (P(("dp", "tp")), (4, 4), lambda v: jnp.sin(op.all_reduce(v, "max", axis="tp"))),
    "all_gather": (P(("dp", "tp")), (4, 4), lambda v: jnp.sin(op.all_gather(v, "tp", dim=1))),
    "reduce_scatter": (
        P(("dp", "tp")),
        (4, 4),
        lambda v: jnp.sin(op.reduce_scatter(v, "tp", dim=0, deterministic=False)),
    ),
    "all_to_all": (
        P(("dp", "tp")),
        (4, 4),
        lambda v: jnp.sin(op.all_to_all(v, "tp", split_dim=0, concat_dim=1)),
    ),
    "scatter": (P(("dp", "tp")), (4, 4), lambda v: jnp.sin(op.scatter(v, "tp", dim=0))),
    "scatter_replicated": (P(), (4, 4), lambda v: jnp.sin(op.scatter(v, "tp", dim=1))),
    "scatter_partly_replicated": (  # the same on every part along tp, not along dp
        P("dp"),
        (8, 4),
        lambda v: jnp.sin(op.scatter(v, ("dp", "tp"), dim=0)),
    ),
}


@pytest.mark.parametrize("name", sample(GRAD_CASES, 2))
def test_collective_check_grads_order2(name, x64):
    in_spec, shape, body = GRAD_CASES[name]
    m = mesh_of("2x4")
    parts = math.prod(m.axis_size(tuple(e if isinstance(e, tuple) else (e,))) for e in in_spec)
    x = rand((shape[0] * parts, *shape[1:]), jnp.float64)
    check_grads(spmd(m, body, in_spec), (x,), order=2, modes=("fwd", "rev"))


def test_collectives_vmap_and_jacfwd():
    m = mesh_of("2x4")

    def body(v):
        return (
            op.all_reduce(v, axis="tp", algo="binary_tree"),
            op.all_reduce(v, "max", axis="tp"),
            op.all_gather(v, axis="tp", dim=1),
            op.reduce_scatter(v, axis="tp", dim=1),
            op.scatter(v, axis="tp", dim=1),
            op.all_to_all(v, axis="tp", split_dim=0, concat_dim=1),
        )

    xs = rand((3, 8 * 4, 8))
    f = spmd(m, body)
    per_example = [f(x) for x in xs]
    # vmap of the shard_map: the batch dim is a plain dim of every body value
    outside = jax.jit(
        jax.vmap(
            _compat.shard_map(
                body, mesh=m.jax_mesh, in_specs=(P(("dp", "tp")),), out_specs=P(("dp", "tp"))
            )
        )
    )(xs)
    # vmap inside the body, over a middle dim
    inside = spmd(m, lambda v: jax.vmap(body, in_axes=1, out_axes=1)(v))(jnp.stack(list(xs), 1))
    for i, ref in enumerate(per_example):
        for a, b, r in zip(outside, inside, ref):
            assert bits_equal(a[i], r) and bits_equal(b[:, i], r)
    # jacfwd (vmap of jvp) and jacrev agree
    g = spmd(m, lambda v: jnp.sin(op.all_gather(op.all_reduce(v, axis="tp"), "tp", dim=0)))
    x = rand((8 * 2, 3))
    jac = lambda t: jax.jit(t(g))(x)  # (jitted: one program each, not one per op)
    np.testing.assert_allclose(jac(jax.jacfwd), jac(jax.jacrev), rtol=1e-6, atol=1e-7)
    # vmap of grad
    grad = jax.jit(jax.grad(lambda v: jnp.sum(g(v) ** 2)))
    gs = jax.jit(jax.vmap(grad))(xs[:, :16, :3])
    for i in range(3):
        np.testing.assert_allclose(gs[i], grad(xs[i, :16, :3]), rtol=1e-6)


def test_replicate_adjoint_is_the_tree():
    """A value entering the parts as their own copies gets the canonical tree of the
    parts' cotangents, bitwise (not psum's order)."""
    m = mesh_of("8")
    v, w = rand((3, 5)), rand((8 * 3, 5))
    f = spmd(
        m,
        lambda v, w: coll.replicate(v, ("dp",)) * w,
        P(),
        P("dp"),
        out_spec=P("dp"),
    )
    g = jax.grad(lambda v: jnp.sum(f(v, w)))(v)
    assert bits_equal(g, np_tree(np.asarray(w).reshape(8, 3, 5)))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(f(v, w))))(v))
    assert "ts_all_reduce" in jaxpr and "psum" not in jaxpr


def test_collective_transposes_take_symbolic_zeros():
    ad = _compat.ad
    aval = jax.typeof(jnp.ones((8, 4)))
    cases = [
        (coll.all_reduce_p, dict(op="sum", algo="auto", deterministic=True)),
        (coll.all_reduce_p, dict(op="mean", algo="ring", deterministic=False)),
        (coll.all_gather_p, dict(dim=0, deterministic=True)),
        (coll.reduce_scatter_p, dict(dim=1, algo="auto", deterministic=True)),
        (coll.scatter_p, dict(dim=0)),
        (coll.all_to_all_p, dict(split_dim=0, concat_dim=1)),
        (coll.replicate_p, {}),
    ]
    for prim, params in cases:
        transpose = ad.primitive_transposes[prim]
        (ct,) = transpose(ad.Zero(aval), ad.UndefinedPrimal(aval), axes=("tp",), **params)
        assert type(ct) is ad.Zero and ct.aval.shape == (8, 4), prim


def test_collective_primitive_errors():
    m = mesh_of("2x4")
    with pytest.raises(NameError, match="ts_all_reduce: mesh axis 'dp' is not bound"):
        coll.all_reduce_p.bind(jnp.ones(3), axes=("dp",), op="sum", algo="auto", deterministic=True)
    same = spmd(
        m,
        lambda v: coll.all_gather_p.bind(v, axes=("tp",), dim=0, deterministic=True),
        P(),
    )
    with pytest.raises(ValueError, match=r"ts_all_gather: x must vary over the axes \('tp',\)"):
        same(jnp.ones((4, 2)))
    rs = spmd(
        m,
        lambda v: coll.reduce_scatter_p.bind(
            v, axes=("tp",), dim=0, algo="auto", deterministic=True
        ),
    )
    with pytest.raises(ValueError, match=r"x.shape\[0\]=6 must be a multiple of the 4 parts"):
        rs(jnp.ones((48, 2)))
    ag = spmd(m, lambda v: coll.all_gather_p.bind(v, axes=("tp",), dim=2, deterministic=True))
    with pytest.raises(ValueError, match="ts_all_gather: dim=2 is out of range for x of rank 2"):
        ag(jnp.ones((8, 2)))
    rep = spmd(m, lambda v: coll.replicate_p.bind(v, axes=("tp",)))
    with pytest.raises(ValueError, match=r"ts_replicate: x already varies over \('tp',\)"):
        rep(jnp.ones((8, 2)))
    named = spmd(m, lambda v: jax.vmap(lambda u: op.all_reduce(u, axis="tp"), axis_name="tp")(v))
    with pytest.raises(NotImplementedError, match="ts_all_reduce: a collective over the vmapped"):
        named(jnp.ones((8, 2)))


# --- mesh-size invariance of ts.op.sum -----------------------------------------------------


def np_canonical_sum(x: np.ndarray, axes) -> np.ndarray:
    keep = [a for a in range(x.ndim) if a not in axes]
    xt = np.transpose(x, keep + list(axes)).reshape(*[x.shape[a] for a in keep], -1)
    return np_tree(np.moveaxis(xt, -1, 0))


@pytest.mark.parametrize(
    "shape,dim,axes",
    [
        ((64, 96), 0, (0,)),  # power-of-two local blocks: all_to_all + all_gather
        ((96, 40), 1, (1,)),
        ((48, 16), 0, (0,)),  # local block 6 = 3 whole level-1 subtrees
        ((24, 9), 0, (0,)),  # local block 3 (odd on 8): the leaves are gathered
        ((16, 8, 5), 1, (0, 1)),  # the sharded reduced dim is not the leading one
        ((8, 6, 5), 0, (0, 2)),  # few outputs: all_gather of the nodes
        ((40,), 0, (0,)),
    ],
)
def test_sum_mesh_size_invariance(shape, dim, axes):
    x = rand(shape)
    expect = np_canonical_sum(np.asarray(x), axes)
    assert bits_equal(op.sum(x, axis=axes), expect)
    for n in (1, 2, 4, 8):
        if shape[dim] % n:
            continue
        m = ts.dist.Mesh(axes=["dp"], devices=range(n))
        spec = [None] * len(shape)
        spec[dim] = "dp"
        xs = jax.device_put(x, NamedSharding(m.jax_mesh, P(*spec)))
        y = jax.jit(lambda v: op.sum(v, axis=axes))(xs)
        assert bits_equal(y, expect), f"{n} devices"


def test_sum_invariance_2d_mesh_keepdims_bf16():
    m = mesh_of("2x4")
    x = rand((16, 32, 8)).astype(jnp.bfloat16)
    expect = np_canonical_sum(np.asarray(x.astype(jnp.float32)), (0, 1)).astype(jnp.bfloat16)
    for spec in (P("dp", "tp"), P(("dp", "tp")), P(None, ("tp", "dp")), P("tp", None, "dp")):
        xs = jax.device_put(x, NamedSharding(m.jax_mesh, spec))
        y = jax.jit(lambda v: op.sum(v, axis=(0, 1), keepdims=True))(xs)
        assert y.shape == (1, 1, 8)
        assert bits_equal(np.asarray(y)[0, 0], expect), spec


def test_sum_sharded_communication():
    """The cross-device part is the top of the tree: all_to_all + all_gather of one value
    per output and device; no collective-permute halo exchanges, no gather of the input."""
    m = mesh_of("8")
    x = jax.device_put(rand((64, 1024)), NamedSharding(m.jax_mesh, P("dp")))
    c = collectives_in(lambda v: op.sum(v, axis=0), x)
    assert c == Counter({"all-to-all": 1, "all-gather": 1})
    y = rand((1024, 64))
    kept = jax.device_put(y, NamedSharding(m.jax_mesh, P("dp")))  # kept dim sharded
    assert collectives_in(lambda v: op.sum(v, axis=1), kept) == Counter()
    out = jax.jit(lambda v: op.sum(v, axis=1))(kept)
    assert out.sharding.spec == P("dp")


def test_allreduce_benchmark_smoke(tmp_path):
    """benchmarks/allreduce.py --smoke: runs, checks its bits, writes its records."""
    import json
    import os
    import subprocess
    import sys

    from tests._util import ROOT as root

    env = {**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "allreduce.py"),
            "--smoke",
            "--algos",
            "binary_tree",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = tmp_path.glob("allreduce-*.json")
    records = json.loads(path.read_text())
    assert {r["suite"] for r in records} == {"allreduce"}
    assert all(
        r["bitwise_equal_3_runs"]
        and r["bitwise_equal_all_ranks"]
        and r["equals_1device_canonical_tree"]
        for r in records
    )
    assert all(r["ratio"] > 0 and r["busbw_gbs"] >= 0 for r in records)
    assert "ratio" in proc.stdout.splitlines()[-len(records) - 1]


def test_mse_mesh_size_invariance():
    """ts.mse over a batch-sharded pair: the same tree, the same bits on 1/2/4/8 devices;
    one all-gather of a partial per device."""
    pred, target = rand((48, 16)), rand((48, 16))
    expect = np.asarray(op.mse(pred, target))
    for n in (1, 2, 4, 8):
        m = ts.dist.Mesh(axes=["dp"], devices=range(n))
        s = NamedSharding(m.jax_mesh, P("dp"))
        p_, t_ = jax.device_put(pred, s), jax.device_put(target, s)
        assert bits_equal(jax.jit(op.mse)(p_, t_), expect), f"{n} devices"
    assert collectives_in(op.mse, p_, t_) == Counter({"all-gather": 1})


def test_sum_of_products_mesh_size_invariance():
    """A multiply fused into the sum cannot be contracted into the tree (an FMA would
    change the bits depending on how each mesh's program fuses)."""
    x, w = rand((64, 24)), rand((64, 24))
    f = jax.jit(lambda x, w: op.sum(ts.tanh(x) * w, axis=0))
    g = jax.jit(lambda x, w: op.sum(ts.tanh(x) * w))
    e1, e2 = np.asarray(f(x, w)), np.asarray(g(x, w))
    for n in (2, 4, 8):
        m = ts.dist.Mesh(axes=["dp"], devices=range(n))
        s = NamedSharding(m.jax_mesh, P("dp"))
        xs, ws = jax.device_put(x, s), jax.device_put(w, s)
        assert bits_equal(f(xs, ws), e1) and bits_equal(g(xs, ws), e2), f"{n} devices"


# --- the global view follows a DistTensor's layout, on Auto and Explicit meshes ------------


def mesh_2x4(kind):
    """The 2x4 (dp, tp) mesh with Auto axes (ts.dist.Mesh) or Explicit ones (what
    jax.make_mesh gives from jax 0.10 on)."""
    if kind == "auto":
        return mesh_of("2x4").jax_mesh
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=explicit)


def np_global_all_reduce(x, entries, axes, combine):
    """The reference of a global all_reduce over ``axes`` of ``x`` laid out on the 2x4
    (dp, tp) mesh by ``entries`` (the mesh axes of each dim): the blocks of the devices
    that differ only along ``axes``, stacked in rank order and combined, placed where the
    layout without ``axes`` puts them."""
    sizes = {"dp": 2, "tp": 4}
    x = np.asarray(x)

    def index(coord, names):  # row-major over names
        i = 0
        for a in names:
            i = i * sizes[a] + coord[a]
        return i

    def block(coord, ents):
        sl = []
        for s, e in zip(x.shape, ents):
            b = s // math.prod(sizes[a] for a in e)
            sl.append(slice(index(coord, e) * b, (index(coord, e) + 1) * b))
        return tuple(sl)

    out_ents = [tuple(a for a in e if a not in axes) for e in entries]
    out_shape = [s // math.prod(sizes[a] for a in e if a in axes) for s, e in zip(x.shape, entries)]
    out = np.zeros(out_shape, x.dtype)
    others = [a for a in sizes if a not in axes]
    for co in np.ndindex(*(sizes[a] for a in others)):
        fixed = dict(zip(others, co))
        group = [
            x[block({**fixed, **dict(zip(axes, ca))}, entries)]
            for ca in np.ndindex(*(sizes[a] for a in axes))
        ]
        where = [
            slice(index(fixed, e) * (s // math.prod(sizes[a] for a in e)), None)
            for s, e in zip(out_shape, out_ents)
        ]
        res = combine(np.stack(group))
        where = tuple(slice(w.start, w.start + r) for w, r in zip(where, res.shape))
        out[where] = res
    return out


LAYOUTS = {  # name: (ShardSpec, the mesh axes of each dim of an (8, 12) tensor)
    "replicated": (ts.ShardSpec(), [(), ()]),
    "rows_dp": (ts.ShardSpec((0,), ("dp",)), [("dp",), ()]),
    "cols_tp": (ts.ShardSpec((1,), ("tp",)), [(), ("tp",)]),
    "rows_dp_cols_tp": (ts.ShardSpec((0, 1), ("dp", "tp")), [("dp",), ("tp",)]),
    "rows_dp_tp": (ts.ShardSpec((0,), (("dp", "tp"),)), [("dp", "tp"), ()]),
}
COMBINE = {
    "sum": np_tree,
    "max": lambda s: np.max(s, axis=0),
    "mean": lambda s: np_tree(s) / np.asarray(s.shape[0], s.dtype),
}


@pytest.mark.parametrize(
    *sample_grid(
        8, kind=["auto", "explicit"], layout=list(LAYOUTS), axes=[("tp",), ("dp",), ("dp", "tp")]
    )
)
def test_global_all_reduce_follows_the_layout(kind, layout, axes):
    jm = mesh_2x4(kind)
    spec, entries = LAYOUTS[layout]
    x = rand((8, 12))
    X = ts.dist.tensor(x.shape, spec, jm, "f32", x)
    want = np_global_all_reduce(x, entries, axes, np_tree)
    for f in (op.all_reduce, jax.jit(op.all_reduce, static_argnums=(1, 2))):
        y = f(X, "sum", axes)
        assert y.shape == want.shape and bits_equal(y, want), (layout, axes)
    out = tuple(tuple(a for a in e if a not in axes) for e in entries)
    assert y.sharding.is_equivalent_to(
        NamedSharding(y.sharding.mesh, P(*(coll.partition_entry(e) for e in out))), 2
    )


@pytest.mark.parametrize(
    "dtype,reduce_op",
    [
        (d, o)
        for d in (jnp.float32, jnp.bfloat16, jnp.int32)
        for o in COMBINE
        if not (o == "mean" and d == jnp.int32)  # an error: test_collective_bad_arguments
    ],
)
def test_global_all_reduce_of_a_dist_tensor_dtypes(dtype, reduce_op):
    m = mesh_of("2x4")
    spec, entries = LAYOUTS["rows_dp_cols_tp"]
    x = (rand((8, 12)) * 100).astype(dtype)
    X = ts.dist.tensor(x.shape, spec, m, dtype, x)
    y = op.all_reduce(X, reduce_op, "tp")
    want = np_global_all_reduce(x, entries, ("tp",), COMBINE[reduce_op])
    assert bits_equal(y, want)
    exact = {"sum": lambda s: s.sum(0), "max": lambda s: s.max(0), "mean": lambda s: s.mean(0)}
    assert_close(y, np_global_all_reduce(f64(x), entries, ("tp",), exact[reduce_op]), dtype)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_global_reduce_scatter_follows_the_layout(kind):
    jm = mesh_2x4(kind)
    x = rand((8, 12))
    X = ts.dist.tensor(x.shape, ts.ShardSpec((1,), ("tp",)), jm, "f32", x)
    y = op.reduce_scatter(X, "tp", dim=0)  # the 4 column blocks summed, rows split over tp
    assert bits_equal(y, np_tree(np.stack(np.split(np.asarray(x), 4, axis=1))))
    assert y.sharding.is_equivalent_to(NamedSharding(y.sharding.mesh, P("tp")), 2)
    rows = ts.dist.tensor(x.shape, ts.ShardSpec((0,), ("dp",)), jm, "f32", x)
    y = jax.jit(lambda v: op.reduce_scatter(v, "dp", dim=1))(rows)
    assert bits_equal(y, np_tree(np.asarray(x).reshape(2, 4, 12)))
    assert y.sharding.is_equivalent_to(NamedSharding(y.sharding.mesh, P(None, "dp")), 2)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("jit", [False, True])
def test_global_views_on_auto_and_explicit_meshes(kind, jit):
    jm = mesh_2x4(kind)
    x = rand((16, 24))
    placed = jax.device_put(x, NamedSharding(jm, P(None, "tp")))  # columns over tp

    def run(v):
        return (
            op.all_reduce(v, axis="tp", mesh=jm),
            op.reduce_scatter(v, "tp", dim=1, mesh=jm),
            op.all_gather(v, "tp", mesh=jm),
            op.scatter(v, "tp", dim=1, mesh=jm),
            op.all_to_all(v, "tp", split_dim=0, concat_dim=1, mesh=jm),
        )

    f = jax.jit(run) if jit else run
    for v in (x, placed):
        ar, rs, ag, sc, a2a = f(v)
        parts = np.asarray(x).reshape(4, 4, 24)  # dim 0 holds the 4 parts along tp
        assert bits_equal(ar, np_tree(parts))
        assert bits_equal(rs, np_tree(parts))
        for got, spec in [(ag, P()), (sc, P(None, "tp")), (a2a, P("tp"))]:
            np.testing.assert_array_equal(got, x)
            assert got.sharding.is_equivalent_to(NamedSharding(jm, spec), 2)
        assert ar.sharding.is_equivalent_to(NamedSharding(jm, P()), 2)
        assert rs.sharding.is_equivalent_to(NamedSharding(jm, P(None, "tp")), 2)


# --- dispatch: algorithm names, interpret mode ---------------------------------------------


def test_every_algorithm_dispatch_picks_is_documented():
    doc = coll.algorithms.__doc__
    for name in coll.ALGORITHMS:
        assert f'``"{name}"``' in doc, name
    assert set(coll.ALGOS) - {"auto"} <= set(coll.ALGORITHMS)
    picked = set()
    for algo in coll.ALGOS:
        for dtype, n, reduce_op in [(jnp.float32, 4, "sum"), (jnp.int32, 4, "max")]:
            for shape in [(3,), (1 << 20,)]:
                spec = coll.AllReduceSpec(("x",), reduce_op, algo, True, n)
                for platform in ("cpu", "cuda", None):
                    got = coll.choose_algo(spec, jax.ShapeDtypeStruct(shape, dtype), platform)
                    picked.add(got)
                    assert got in coll.ALGORITHMS and (algo in ("auto", "nvlink") or got == algo)
    assert {"psum", "gather", "binary_tree"} <= picked


@pytest.mark.parametrize("algo", ["auto", "nvlink", "gather", "binary_tree"])
def test_interpret_mode_takes_the_tree(algo):
    """No all-reduce kernel can be interpreted: interpret mode gives the XLA tree's bits."""
    m = mesh_of("8")
    x = rand((8 * 3, 37))
    with ts.kernel_mode("interpret"):
        y = jax.jit(lambda v: op.all_reduce(v, axis="dp", algo=algo, mesh=m))(x)
    assert bits_equal(y, np_tree(np.asarray(x).reshape(8, 3, 37)))


# --- bad arguments: a ValueError/TypeError naming the function, argument and value ---------


def _in_launch(fn):
    """``fn`` on one (2, 6) block per device of the 2x4 mesh, inside jax.shard_map."""
    return lambda: spmd(mesh_of("2x4"), lambda v: fn(v[0]), EVERY_PART)(jnp.ones((8, 2, 6)))


def _in_index_launch(fn):
    """``fn`` on one (2, 6) block per device of the 2x4 mesh, inside ts.index_launch."""

    def call():
        x = jnp.ones((8, 2, 6))
        X = ts.dist.tensor(x.shape, ts.ShardSpec((0,), (("dp", "tp"),)), mesh_of("2x4"), "f32", x)
        return ts.index_launch(axis="tp")(lambda p: fn(p[0]))(X.parts(("dp", "tp")))

    return call


def _global(fn, mesh="2x4"):
    return lambda: fn(jnp.ones((8, 6)), mesh_of(mesh))


BAD = {  # name: (call, exception, the message it must contain)
    # all_reduce
    "ar_x": (
        lambda: op.all_reduce(object(), axis="dp", mesh=mesh_of("8")),
        TypeError,
        "all_reduce: x",
    ),
    "ar_x_bool": (
        _global(lambda x, m: op.all_reduce(x > 0, axis="dp", mesh=m)),
        TypeError,
        "all_reduce: x.dtype=bool",
    ),
    "ar_x_int_mean": (
        _global(lambda x, m: op.all_reduce(x.astype(jnp.int32), "mean", "dp", mesh=m)),
        TypeError,
        "all_reduce: x.dtype=int32 is not supported with op='mean'",
    ),
    "ar_x_int_mean_spmd": (
        _in_launch(lambda v: op.all_reduce(v.astype(jnp.int32), "mean", "tp")),
        TypeError,
        "op='mean'",
    ),
    "ar_x_complex_max": (
        _global(lambda x, m: op.all_reduce(x.astype(jnp.complex64), "max", "dp", mesh=m)),
        TypeError,
        "x.dtype=complex64",
    ),
    "ar_x_scalar": (
        lambda: op.all_reduce(jnp.float32(1), axis="dp", mesh=mesh_of("8")),
        ValueError,
        "got a scalar",
    ),
    "ar_x_shape": (
        _global(lambda x, m: op.all_reduce(x[:6], axis="tp", mesh=m)),
        ValueError,
        "all_reduce: x.shape[0]=6 must be a multiple of the 4 parts along ('tp',)",
    ),
    "ar_op": (
        _global(lambda x, m: op.all_reduce(x, "prod", "dp", mesh=m)),
        ValueError,
        "all_reduce: op='prod' must be one of",
    ),
    "ar_op_type": (_in_launch(lambda v: op.all_reduce(v, 3, "tp")), ValueError, "op=3"),
    "ar_axis_type": (
        _global(lambda x, m: op.all_reduce(x, axis=0, mesh=m)),
        TypeError,
        "all_reduce: axis=0 must be a mesh axis name",
    ),
    "ar_axis_missing": (
        _global(lambda x, m: op.all_reduce(x, axis="pp", mesh=m)),
        ValueError,
        "all_reduce: axis='pp' is not an axis of the mesh",
    ),
    "ar_axis_twice": (
        _global(lambda x, m: op.all_reduce(x, axis=("dp", "dp"), mesh=m)),
        ValueError,
        "names a mesh axis twice",
    ),
    "ar_axis_unbound": (
        _in_launch(lambda v: op.all_reduce(v, axis=("tp", "pp"))),
        ValueError,
        "'pp'",
    ),
    "ar_no_mesh": (
        lambda: op.all_reduce(jnp.ones(8), axis="dp"),
        ValueError,
        "all_reduce: no mesh",
    ),
    "ar_mesh_type": (
        lambda: op.all_reduce(jnp.ones(8), axis="dp", mesh="dp"),
        TypeError,
        "all_reduce: mesh='dp' must be",
    ),
    "ar_mesh_in_launch": (
        _in_launch(lambda v: op.all_reduce(v, axis="tp", mesh=mesh_of("2x4"))),
        ValueError,
        "global view",
    ),
    "ar_algo": (
        _global(lambda x, m: op.all_reduce(x, axis="dp", mesh=m, algo="fast")),
        ValueError,
        "all_reduce: algo='fast' must be one of",
    ),
    "ar_algo_psum": (
        _in_launch(lambda v: op.all_reduce(v, axis="tp", algo="psum")),
        ValueError,
        "algo='psum'",
    ),
    "ar_algo_nondet": (
        _in_launch(lambda v: op.all_reduce(v, axis="tp", algo="ring", deterministic=False)),
        ValueError,
        "all_reduce: algo='ring'",
    ),
    "ar_algo_nondet_global": (
        _global(
            lambda x, m: op.all_reduce(x, axis="dp", mesh=m, algo="nvlink", deterministic=False)
        ),
        ValueError,
        "deterministic=False",
    ),
    "ar_deterministic": (
        _global(lambda x, m: op.all_reduce(x, axis="dp", mesh=m, deterministic="yes")),
        TypeError,
        "all_reduce: deterministic='yes' must be",
    ),
    "ar_dist_mesh": (
        lambda: op.all_reduce(
            ts.dist.tensor((8, 2), None, mesh_of("8"), "f32", jnp.ones((8, 2))),
            axis="dp",
            mesh=mesh_of("2x4"),
        ),
        ValueError,
        "is not the mesh",
    ),
    "ar_op_launch": (
        _in_index_launch(lambda v: op.all_reduce(v, "any", "tp")),
        ValueError,
        "all_reduce: op='any' must be one of",
    ),
    # all_gather
    "ag_x": (lambda: op.all_gather("abc", "dp", mesh=mesh_of("8")), TypeError, "all_gather: x"),
    "ag_x_scalar": (
        _in_launch(lambda v: op.all_gather(v[0, 0], "tp")),
        ValueError,
        "all_gather: x must have at least one dim",
    ),
    "ag_axis_none": (
        _global(lambda x, m: op.all_gather(x, None, mesh=m)),
        TypeError,
        "all_gather: axis=None",
    ),
    "ag_axis_missing": (
        _global(lambda x, m: op.all_gather(x, "pp", mesh=m)),
        ValueError,
        "all_gather: axis='pp'",
    ),
    "ag_dim": (
        _in_launch(lambda v: op.all_gather(v, "tp", dim=2)),
        ValueError,
        "all_gather: dim=2 is out of range",
    ),
    "ag_dim_type": (
        _in_launch(lambda v: op.all_gather(v, "tp", dim="0")),
        TypeError,
        "all_gather: dim='0' must be an int",
    ),
    "ag_deterministic": (
        _in_launch(lambda v: op.all_gather(v, "tp", deterministic=None)),
        TypeError,
        "all_gather: deterministic=None",
    ),
    "ag_mesh_type": (
        lambda: op.all_gather(jnp.ones(8), "dp", mesh=8),
        TypeError,
        "all_gather: mesh=8",
    ),
    "ag_dim_launch": (
        _in_index_launch(lambda v: op.all_gather(v, "tp", dim=5)),
        ValueError,
        "all_gather: dim=5 is out of range",
    ),
    # reduce_scatter
    "rs_x_bool": (
        _in_launch(lambda v: op.reduce_scatter(v > 0, "tp", dim=1)),
        TypeError,
        "reduce_scatter: x.dtype=bool",
    ),
    "rs_x_shape": (
        _in_launch(lambda v: op.reduce_scatter(v, "tp", dim=0)),
        ValueError,
        "reduce_scatter: x.shape[0]=2 must be a multiple of the 4 parts",
    ),
    "rs_x_shape_global": (
        _global(lambda x, m: op.reduce_scatter(x, "tp", dim=1, mesh=m)),
        ValueError,
        "reduce_scatter: the part's shape[1]=6 must be a multiple of the 4",
    ),
    "rs_axis_type": (
        _in_launch(lambda v: op.reduce_scatter(v, ["tp", 1], dim=1)),
        TypeError,
        "reduce_scatter: axis=['tp', 1]",
    ),
    "rs_dim": (
        _in_launch(lambda v: op.reduce_scatter(v, "tp", dim=-3)),
        ValueError,
        "reduce_scatter: dim=-3 is out of range",
    ),
    "rs_algo": (
        _in_launch(lambda v: op.reduce_scatter(v, "tp", dim=1, algo="nvlink")),
        ValueError,
        "reduce_scatter: algo='nvlink' must be one of",
    ),
    "rs_algo_nondet": (
        _in_launch(lambda v: op.reduce_scatter(v, "tp", dim=1, algo="ring", deterministic=False)),
        ValueError,
        "reduce_scatter: algo='ring'",
    ),
    "rs_deterministic": (
        _global(lambda x, m: op.reduce_scatter(x, "dp", dim=1, mesh=m, deterministic=1)),
        TypeError,
        "reduce_scatter: deterministic=1",
    ),
    "rs_algo_launch": (
        _in_index_launch(lambda v: op.reduce_scatter(v, "tp", dim=1, algo="gather")),
        ValueError,
        "reduce_scatter: algo='gather' must be one of",
    ),
    # scatter
    "sc_x": (
        lambda: op.scatter(None, "dp", mesh=mesh_of("8")),
        TypeError,
        "scatter: x=None is not an array",
    ),
    "sc_x_shape": (
        _in_launch(lambda v: op.scatter(v, "tp", dim=1)),
        ValueError,
        "scatter: x.shape[1]=6 must be a multiple of the 4 parts",
    ),
    "sc_x_shape_global": (
        _global(lambda x, m: op.scatter(x, "tp", dim=1, mesh=m)),
        ValueError,
        "scatter: x.shape[1]=6 must be a multiple of the 4",
    ),
    "sc_axis": (
        _in_launch(lambda v: op.scatter(v, ("tp", "zz"), dim=0)),
        ValueError,
        "scatter: axis=('tp', 'zz')",
    ),
    "sc_dim": (
        _global(lambda x, m: op.scatter(x, "dp", dim=2, mesh=m)),
        ValueError,
        "scatter: dim=2 is out of range",
    ),
    "sc_dim_type": (
        _global(lambda x, m: op.scatter(x, "dp", dim=1.0, mesh=m)),
        TypeError,
        "scatter: dim=1.0 must be an int",
    ),
    "sc_mesh": (
        lambda: op.scatter(jnp.ones(8), "dp", mesh=["dp"]),
        TypeError,
        "scatter: mesh=['dp']",
    ),
    "sc_x_shape_launch": (
        _in_index_launch(lambda v: op.scatter(v, "tp", dim=0)),
        ValueError,
        "scatter: x.shape[0]=2 must be a multiple of the 4 parts",
    ),
    # all_to_all
    "a2a_x_shape": (
        _in_launch(lambda v: op.all_to_all(v, "tp", split_dim=0, concat_dim=1)),
        ValueError,
        "all_to_all: x.shape[0]=2 must be a multiple of the 4 parts",
    ),
    "a2a_concat_dim_launch": (
        _in_index_launch(lambda v: op.all_to_all(v, "tp", split_dim=1, concat_dim="1")),
        TypeError,
        "all_to_all: concat_dim='1' must be an int",
    ),
    "a2a_split_dim": (
        _in_launch(lambda v: op.all_to_all(v, "tp", split_dim=2)),
        ValueError,
        "all_to_all: split_dim=2 is out of range",
    ),
    "a2a_concat_dim": (
        _global(lambda x, m: op.all_to_all(x, "dp", concat_dim=-5, mesh=m)),
        ValueError,
        "all_to_all: concat_dim=-5 is out of range",
    ),
    "a2a_axis": (
        _global(lambda x, m: op.all_to_all(x, 7, mesh=m)),
        TypeError,
        "all_to_all: axis=7",
    ),
    "a2a_mesh": (
        lambda: op.all_to_all(jnp.ones(8), "dp", mesh=object()),
        TypeError,
        "all_to_all: mesh=",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_collective_bad_arguments(name):
    call, exc, message = BAD[name]
    with pytest.raises(exc, match=re.escape(message)):
        call()
