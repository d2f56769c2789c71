"""Meshes, ShardSpecs, DistTensors, parts and index launches, domains (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tests._util import by_row_blocks, f64, rand

# Bitwise across meshes and runs: checked on the code XLA optimises (tests/conftest.py).
pytestmark = pytest.mark.xla_optimized

# --- meshes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "axes,shape", [(("dp",), (8,)), (("dp", "tp"), (2, 4)), (("dp", "tp", "pp"), (2, 2, 2))]
)
def test_mesh_shapes(axes, shape):
    m = ts.dist.Mesh(axes=list(axes), devices=range(8), shape=shape)
    assert m.axes == axes and m.shape == shape and m.size == 8
    assert isinstance(m.jax_mesh, jax.sharding.Mesh)
    assert dict(m.jax_mesh.shape) == dict(zip(axes, shape))
    for a, s in zip(axes, shape):
        assert m.axis_size(a) == s
    assert m.axis_size(axes) == 8


def test_mesh_device_spellings():
    devs = jax.devices()
    by_index = ts.dist.Mesh(axes=["dp"], devices=range(4))
    by_device = ts.dist.Mesh(axes=["dp"], devices=devs[:4])
    by_string = ts.dist.mesh(devices=[f"cpu:{i}" for i in range(4)], axes=("dp",), shape=(4,))
    assert by_index == by_device == by_string
    # an ndarray of devices, as jax meshes hold them, in row-major order
    grid = ts.dist.Mesh(axes=("a", "b"), devices=np.array(devs[:8]).reshape(2, 4), shape=(2, 4))
    assert grid == ts.dist.Mesh(axes=("a", "b"), devices=range(8), shape=(2, 4))
    assert list(by_string.devices.flat) == devs[:4]
    whole = ts.dist.Mesh(axes="dp")  # all devices on one axis
    assert whole.shape == (8,)


def test_mesh_errors():
    with pytest.raises(ValueError, match="pass shape"):
        ts.dist.Mesh(axes=["tp", "pp", "dp"], devices=range(8))
    with pytest.raises(ValueError, match=r"holds 6 devices but 8 devices"):
        ts.dist.Mesh(axes=["dp", "tp"], devices=range(8), shape=(2, 3))
    with pytest.raises(ValueError, match="no gpu devices"):
        ts.dist.mesh(devices=["cuda:0", "cuda:1"], axes=("tp",), shape=(2,))
    with pytest.raises(ValueError, match="out of range"):
        ts.dist.Mesh(axes=["dp"], devices=range(9))
    with pytest.raises(ValueError, match="twice"):
        ts.dist.Mesh(axes=["dp"], devices=[0, 0])
    with pytest.raises(ValueError, match="repeats"):
        ts.dist.Mesh(axes=["dp", "dp"], devices=range(4), shape=(2, 2))


def test_mesh_context():
    m = ts.dist.Mesh(axes=["dp"], devices=range(2))
    assert ts.dist.current_mesh() is None
    with m:
        assert ts.dist.current_mesh() is m
        t = ts.dist.tensor((4, 2), ts.ShardSpec(("row",), ("dp",)))
        assert t.mesh is m
    assert ts.dist.current_mesh() is None
    with pytest.raises(ValueError, match="no mesh"):
        ts.dist.tensor((4, 2))


# --- ShardSpecs ---------------------------------------------------------------------------


def test_shardspec_to_partition_spec():
    assert ts.ShardSpec(("row", "col"), ("tp", "pp")).partition_spec(2) == P("tp", "pp")
    assert ts.ShardSpec(("col",), ("tp",)).partition_spec(3) == P(None, "tp")
    assert ts.ShardSpec(("batch",), ("dp",)).partition_spec(3) == P("dp")
    assert ts.ShardSpec((2, 0), ("tp", ("dp", "pp"))).partition_spec(3) == P(
        ("dp", "pp"), None, "tp"
    )
    assert ts.ShardSpec((-1,), ("tp",)).partition_spec(2) == P(None, "tp")
    assert ts.ShardSpec().partition_spec(2) == P()
    m = ts.dist.Mesh(axes=["tp", "pp"], devices=range(8), shape=(4, 2))
    s = ts.ShardSpec(("row", "col"), ("tp", "pp")).named_sharding(m, 2)
    assert s.spec == P("tp", "pp") and s.mesh == m.jax_mesh


def test_shardspec_errors():
    with pytest.raises(ValueError, match="same length"):
        ts.ShardSpec(("row", "col"), ("tp",))
    with pytest.raises(ValueError, match="'diag'"):
        ts.ShardSpec(("diag",), ("tp",))
    with pytest.raises(ValueError, match="twice"):
        ts.ShardSpec(("row", "col"), ("tp", "tp"))
    with pytest.raises(ValueError, match="rank 1"):
        ts.ShardSpec(("col",), ("tp",)).partition_spec(1)
    m = ts.dist.Mesh(axes=["dp"], devices=range(2))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        ts.ShardSpec(("row",), ("tp",)).named_sharding(m, 2)


# --- DistTensor ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh24():
    return ts.dist.Mesh(axes=["dp", "tp"], devices=range(8), shape=(2, 4))


def test_tensor_layout_and_shards(mesh24):
    host = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    t = ts.dist.tensor((8, 12), ts.ShardSpec(("row", "col"), ("dp", "tp")), mesh24, "f32", host)
    assert t.shape == (8, 12) and t.dtype == np.float32 and t.ndim == 2
    assert t.sharding.spec == P("dp", "tp") and t.array.sharding.spec == P("dp", "tp")
    assert {s.data.shape for s in t.addressable_shards} == {(4, 3)}
    for s in t.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), host[s.index])
    np.testing.assert_array_equal(np.asarray(t), host)
    assert isinstance(t.__jax_array__(), jax.Array)


@pytest.mark.parametrize(
    "dtype,expect",
    [
        ("bf16", jnp.bfloat16),
        ("f32", np.float32),
        ("fp8_e4m3", jnp.float8_e4m3fn),
        (ts.f16, np.float16),
        (jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_tensor_dtypes(mesh24, dtype, expect):
    t = ts.dist.tensor((4, 8), ts.ShardSpec(("col",), ("tp",)), mesh24, dtype)
    assert t.dtype == np.dtype(expect)
    assert not np.any(np.asarray(t.array.astype(jnp.float32)))  # zeros


def test_tensor_callable_init(mesh24):
    init = lambda key, shape, dtype: jax.random.normal(key, shape, dtype)
    k = jax.random.key(7)
    t = ts.dist.tensor((8, 8), ts.ShardSpec(("row",), ("dp",)), mesh24, "f32", init, key=k)
    np.testing.assert_array_equal(np.asarray(t), np.asarray(jax.random.normal(k, (8, 8))))
    assert t.array.sharding.spec == P("dp")


def test_tensor_indivisible(mesh24):
    with pytest.raises(ValueError, match=r"dim 1 of shape \(8, 6\) has size 6.*'tp' of size 4"):
        ts.dist.tensor((8, 6), ts.ShardSpec(("col",), ("tp",)), mesh24)


def test_tensor_in_jnp_and_ts_ops_jit_grad(mesh24):
    x = rand((8, 12))
    t = ts.dist.tensor((8, 12), ts.ShardSpec(("row",), ("dp",)), mesh24, "f32", x)
    # jnp.sum's order is XLA's (it differs with the sharding): compare with float64, with an
    # error bound of f32 rounding on the sum of magnitudes.
    xd = f64(x)
    np.testing.assert_allclose(jnp.sum(t), xd.sum(), rtol=0, atol=1e-6 * np.abs(xd).sum())
    np.testing.assert_array_equal(ts.op.relu(t), ts.op.relu(x))
    np.testing.assert_array_equal(np.asarray(t * 2 + 1), np.asarray(x * 2 + 1))
    rows = by_row_blocks(lambda xi: jax.jit(jnp.matmul)(xi, x.T), 2, x)  # dp=2
    np.testing.assert_array_equal(np.asarray(t @ x.T), np.asarray(rows))
    f = jax.jit(lambda t: ts.op.sum(ts.op.tanh(t) * t))
    np.testing.assert_array_equal(f(t), f(x))
    g = jax.grad(lambda t: ts.op.sum(ts.op.tanh(t) ** 2))(t)
    assert isinstance(g, ts.dist.DistTensor) and g.layout == t.layout and g.mesh == t.mesh
    np.testing.assert_allclose(
        np.asarray(g), np.asarray(jax.grad(lambda x: ts.op.sum(ts.op.tanh(x) ** 2))(x)), rtol=1e-6
    )
    leaves, tree = jax.tree_util.tree_flatten(t)
    assert len(leaves) == 1 and jax.tree_util.tree_unflatten(tree, leaves).layout == t.layout


# --- parts and index launches -------------------------------------------------------------


def test_parts(mesh24):
    x = rand((8, 12))
    t = ts.dist.tensor((8, 12), ts.ShardSpec(("col",), ("tp",)), mesh24, "f32", x)
    parts = t.parts("tp")
    assert len(parts) == 4
    np.testing.assert_array_equal(np.asarray(parts[1]), np.asarray(x[:, 3:6]))
    with pytest.raises(ValueError, match="does not partition"):
        t.parts("dp")


@pytest.mark.parametrize("tp", [2, 4])
def test_index_launch_tp_gemm(tp):
    """Seed 002 §4.4 with tp=2/4: C[M, N/tp] += reduce_scatter(A[M, K/tp] @ B[K/tp, N])."""
    mesh = ts.dist.Mesh(axes=["tp"], devices=range(tp))
    M, K, N = 8, 16, 12
    a, b, c = rand((M, K)), rand((K, N)), rand((M, N))
    A = ts.dist.tensor((M, K), ts.ShardSpec(("col",), ("tp",)), mesh, "f32", a)
    B = ts.dist.tensor((K, N), ts.ShardSpec(("row",), ("tp",)), mesh, "f32", b)
    C = ts.dist.tensor((M, N), ts.ShardSpec(("col",), ("tp",)), mesh, "f32", c)

    def tp_gemm(A, B, C):
        return C + ts.op.reduce_scatter(ts.matmul(A, B), axis="tp", dim=1)

    out = ts.index_launch(axis="tp", out=ts.ShardSpec(("col",), ("tp",)))(tp_gemm)(
        A.parts("tp"), B.parts("tp"), C.parts("tp")
    )
    assert out.shape == (M, N) and out.sharding.spec == P(None, "tp")
    np.testing.assert_allclose(out, c + a @ b, rtol=1e-5, atol=1e-5)


def test_index_launch_results(mesh24):
    x = rand((8, 12))
    X = ts.dist.tensor((8, 12), ts.ShardSpec(("row", "col"), ("dp", "tp")), mesh24, "f32", x)

    @ts.index_launch(axis="tp")
    def per_part(x, scale):
        local = jnp.sum(x) * scale  # differs between parts: a scalar per part
        total = ts.op.all_reduce(x, axis=("dp", "tp"))  # identical on every part
        return local, total, x * 2

    local, total, doubled = per_part(X.parts("tp"), 3.0)
    blocks = [x[i * 4 : (i + 1) * 4, j * 3 : (j + 1) * 3] for i in range(2) for j in range(4)]
    np.testing.assert_allclose(local, [np.sum(b) * 3 for b in blocks], rtol=1e-5)
    assert total.shape == (4, 3) and total.sharding.spec == P()
    np.testing.assert_allclose(total, sum(blocks), rtol=1e-5)
    assert doubled.shape == (32, 3)  # differing parts concatenated along dim 0, mesh order
    np.testing.assert_array_equal(np.asarray(doubled), np.concatenate(blocks) * 2)


def test_index_launch_errors(mesh24):
    X = ts.dist.tensor((8, 12), ts.ShardSpec(("col",), ("tp",)), mesh24)
    with pytest.raises(ValueError, match="not an axis"):
        ts.index_launch(axis="pp")(lambda x: x)(X.parts("tp"))
    with pytest.raises(ValueError, match="no mesh"):
        ts.index_launch(axis="tp")(lambda x: x)(jnp.ones(3))
    with pytest.raises(ValueError, match="2 layouts for 1 results"):
        ts.index_launch(axis="tp", out=(P(), P()))(lambda x: x)(X.parts("tp"))


def test_index_launch_under_jit_and_grad(mesh24):
    x = rand((8, 12))
    X = ts.dist.tensor((8, 12), ts.ShardSpec(("col",), ("tp",)), mesh24, "f32", x)
    launch = ts.index_launch(axis="tp")(lambda p: ts.op.all_reduce(ts.op.sum(p * p), axis="tp"))
    val = jax.jit(launch)(X.parts("tp"))
    np.testing.assert_allclose(val, np.sum(np.asarray(x) ** 2), rtol=1e-5)
    g = jax.grad(lambda X: launch(X.parts("tp")))(X)
    assert isinstance(g, ts.dist.DistTensor)
    np.testing.assert_allclose(np.asarray(g), 2 * np.asarray(x), rtol=1e-6)


# --- domains and distributions ------------------------------------------------------------


def test_domain_block_from_domain(mesh24):
    D = ts.domain.Rect((4, 8, 16))
    assert D.shape == (4, 8, 16) and D.ndim == 3 and D.size == 512
    dist = ts.dist.Block(mesh_axes=("dp", "tp"))
    with mesh24:
        X = ts.array.from_domain(D, dtype="bf16", distribution=dist)
    assert X.shape == (4, 8, 16) and X.dtype == jnp.bfloat16
    assert X.sharding.spec == P("dp", "tp")
    assert {s.data.shape for s in X.addressable_shards} == {(2, 2, 16)}
    Y = ts.array.from_domain(D, distribution=ts.dist.Block(mesh_axes=(None, "tp")), mesh=mesh24)
    assert Y.sharding.spec == P(None, "tp")
    with pytest.raises(ValueError, match="no mesh"):
        ts.array.from_domain(D, distribution=dist)
    with pytest.raises(ValueError, match="more entries"):
        ts.array.from_domain((4,), distribution=dist, mesh=mesh24)


def test_index_launch_pytree_arguments(mesh24):
    """Pytree arguments: array leaves are each part's own copy (so a result that uses
    them is a per-part result), Python scalars are static."""
    x = rand((8, 12))
    X = ts.dist.tensor((8, 12), ts.ShardSpec(("col",), ("tp",)), mesh24, "f32", x)
    params = {"w": rand((3,)), "b": jnp.float32(2.0)}

    @ts.index_launch(axis="tp")
    def f(p, params, *, scale):
        total = ts.op.all_reduce(ts.op.sum(p * params["w"][None, :]), axis="tp")
        return total * scale + params["b"]

    val = f(X.parts("tp"), params, scale=3.0)
    w4 = np.tile(np.asarray(params["w"]), 4)
    assert val.shape == (4,)  # one value per part
    np.testing.assert_allclose(val, [np.sum(np.asarray(x) * w4) * 3 + 2] * 4, rtol=1e-5)
    g = jax.grad(lambda prm: jnp.mean(f(X.parts("tp"), prm, scale=3.0)))(params)
    np.testing.assert_allclose(g["w"], 3 * np.asarray(x).reshape(8, 4, 3).sum((0, 1)), rtol=1e-5)
    np.testing.assert_allclose(g["b"], 1.0, rtol=1e-6)
