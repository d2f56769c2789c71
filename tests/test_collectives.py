"""Collectives: bitwise canonical-tree all-reduce, the other collectives, adjoints, and
mesh-size-invariant sums over sharded axes (8 CPU devices)."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax import op
from tests._util import assert_close, f64, rand


def np_tree(stacked: np.ndarray) -> np.ndarray:
    """The canonical pairwise tree over axis 0, in NumPy: ((x0+x1)+(x2+x3))+…, an odd
    last node passing up; 16-bit floats accumulate in f32 and round once."""
    out_dtype = stacked.dtype
    acc = (
        np.float32
        if (out_dtype.itemsize < 4 and out_dtype.kind == "V")
        or str(out_dtype) in ("bfloat16", "float16")
        else out_dtype
    )
    nodes = [np.asarray(s, dtype=acc) for s in stacked]
    while len(nodes) > 1:
        nxt = [nodes[i] + nodes[i + 1] for i in range(0, len(nodes) - 1, 2)]
        if len(nodes) % 2:
            nxt.append(nodes[-1])
        nodes = nxt
    return nodes[0].astype(out_dtype)


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
    g = jax.grad(loss)(X)
    assert isinstance(g, ts.dist.DistTensor)
    np.testing.assert_allclose(np.asarray(g), 2 * np.asarray(x) * sum(range(1, 9)), rtol=1e-6)
    assert bits_equal(g.array, jax.grad(loss)(X).array)


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
    for name, (fn, ref) in cases.items():
        launch = ts.index_launch(axis="tp")(fn)
        g = jax.grad(lambda X, launch=launch: jnp.sum(launch(X.parts("tp"))))(X)
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
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
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
