"""The distribution API on jax meshes of Auto and of Explicit axes (``jax.make_mesh``'s
default from jax 0.10): DistTensors, domains, index launches, regions and pipelines give
the same values on both (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax import Region, read, reduce_sum, write
from tests._util import f64, rand, sample

# Bitwise across meshes and runs: checked on the code XLA optimises (tests/conftest.py).
pytestmark = pytest.mark.xla_optimized

ROW_DP_COL_TP = ts.ShardSpec(("row", "col"), ("dp", "tp"))


@pytest.fixture(scope="module", params=["auto", "explicit"])
def jm(request):
    kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[request.param]
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    return jax.sharding.Mesh(devices, ("dp", "tp"), axis_types=(kind, kind))


def test_mesh_from_jax_keeps_axis_types(jm):
    m = ts.dist.Mesh.from_jax(jm)
    assert m.axes == ("dp", "tp") and m.shape == (2, 4) and m.jax_mesh is jm
    assert m.explicit == (jm.axis_types[0] == AxisType.Explicit)
    assert ts.dist.Mesh.from_jax(jm) == m


def test_tensor_and_domain(jm):
    x = rand((8, 12))
    t = ts.dist.tensor((8, 12), ROW_DP_COL_TP, jm, "f32", x)
    assert t.sharding.spec == P("dp", "tp") and t.array.sharding.mesh == jm
    np.testing.assert_array_equal(np.asarray(t), np.asarray(x))
    y = ts.dist.tensor((8, 12), ROW_DP_COL_TP, jm, "f32", np.asarray(x))  # host data
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    z = ts.array.from_domain((4, 8), distribution=ts.dist.Block((None, "tp")), mesh=jm)
    assert z.sharding.spec == P(None, "tp") and not np.any(np.asarray(z))
    # A traced init is constrained to the layout (a reshard on Explicit axes; a jit that
    # makes Explicit-axis values takes its inputs on the mesh, as jax requires).
    xm = jax.device_put(x, NamedSharding(jm, P()))
    w = jax.jit(lambda a: ts.dist.tensor((8, 12), ROW_DP_COL_TP, jm, "f32", a * 2).array)(xm)
    assert w.sharding.spec == P("dp", "tp")
    np.testing.assert_array_equal(np.asarray(w), np.asarray(x) * 2)


def test_tensor_ops_jit_grad(jm):
    x = rand((8, 12))
    t = ts.dist.tensor((8, 12), ROW_DP_COL_TP, jm, "f32", x)
    loss = lambda t: jnp.sum(ts.op.tanh(t) ** 2)
    g = jax.jit(jax.grad(loss))(t)
    assert isinstance(g, ts.dist.DistTensor) and g.layout == t.layout
    want = 2 * np.tanh(f64(x)) * (1 - np.tanh(f64(x)) ** 2)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)


def test_ts_sum_of_explicit_sharded_tensor():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    jm = jax.sharding.Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    x = rand((8, 12))
    t = ts.dist.tensor((8, 12), ROW_DP_COL_TP, jm, "f32", x)
    np.testing.assert_allclose(float(jax.jit(ts.op.sum)(t)), f64(x).sum(), rtol=1e-5, atol=1e-5)


def test_index_launch_values_and_grad(jm):
    x, w = rand((8, 12)), rand((12,))
    X = ts.dist.tensor((8, 12), ts.ShardSpec(("col",), ("tp",)), jm, "f32", x)

    # A plain array argument (here laid out over tp): every part gets all of it and picks
    # its block of columns.
    w_blocks = jax.device_put(jnp.asarray(w).reshape(4, 3), NamedSharding(jm, P("tp")))

    @ts.index_launch(axis="tp", mesh=jm)  # a jax mesh passed as it is
    def blockwise(p, wb):
        i = jax.lax.axis_index("tp")
        return ts.op.all_reduce(ts.op.sum((p * wb[i][None, :]) ** 2), axis="tp")

    want = np.sum((f64(x) * f64(w)) ** 2)
    got = jax.jit(blockwise)(X.parts("tp"), w_blocks)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    g = jax.jit(jax.grad(lambda X: blockwise(X.parts("tp"), w_blocks)))(X)
    assert isinstance(g, ts.dist.DistTensor) and g.layout == X.layout
    np.testing.assert_allclose(np.asarray(g), 2 * f64(x) * f64(w) ** 2, rtol=1e-5, atol=1e-6)


def test_index_launch_regions(jm):
    x = rand((8, 12))
    X = ts.dist.tensor((8, 12), ROW_DP_COL_TP, jm, "f32", x)
    Y = ts.dist.tensor((8, 12), ROW_DP_COL_TP, jm)
    t0 = rand((4, 3))
    T = ts.dist.tensor((4, 3), None, jm, "f32", t0)

    def kernel(X: Region[read], Y: Region[write], T: Region[reduce_sum]):
        Y[:] = X * 2.0
        T += X

    Y2, T2 = ts.index_launch(axis="tp")(kernel)(X.parts("tp"), Y.parts("tp"), T)
    assert Y2.sharding.spec == P("dp", "tp") and T2.sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(Y2), np.asarray(x) * 2)
    blocks = f64(x).reshape(2, 4, 4, 3).transpose(0, 2, 1, 3).reshape(8, 4, 3)
    np.testing.assert_allclose(np.asarray(T2), f64(t0) + blocks.sum(0), rtol=1e-5, atol=1e-5)


def test_jit_regions(jm):
    x, y0 = rand((8, 12)), rand((8, 12))
    X = ts.dist.tensor((8, 12), ROW_DP_COL_TP, jm, "f32", x)
    Y = ts.dist.tensor((8, 12), ROW_DP_COL_TP, jm, "f32", y0)

    @ts.jit
    def step(X: Region[read], Y: Region[write]):
        Y[:] = ts.op.tanh(X)

    @ts.jit
    def acc(X: Region[read], Y: Region[reduce_sum]):
        Y += X * X

    Y1 = step(X, Y)
    assert isinstance(Y1, ts.dist.DistTensor) and Y1.sharding.spec == P("dp", "tp")
    np.testing.assert_allclose(np.asarray(Y1), np.tanh(f64(x)), rtol=1e-6, atol=1e-7)
    Y2 = acc(X, Y)
    np.testing.assert_allclose(np.asarray(Y2), f64(y0) + f64(x) ** 2, rtol=1e-6, atol=1e-6)


D, B = 8, 16


def _layer(p, h):
    return ts.tanh(ts.matmul(h, p["w"]) + p["b"][None, :])


@pytest.mark.parametrize("schedule", sample(["gpipe", "1f1b"], 1))
def test_pipeline(jm, schedule):
    params = {"w": rand((4, D, D), scale=0.3), "b": rand((4, D), scale=0.1)}
    x, t = rand((B, D)), rand((B, D))
    pipe = ts.dist.pipeline(
        _layer, microbatches=4, schedule=schedule, mesh=jm, axis="tp", loss=ts.mse
    )
    loss, grads = jax.jit(jax.value_and_grad(pipe, argnums=(0, 1)))(params, x, t)
    ref = jax.jit(jax.value_and_grad(pipe.sequential_loss, argnums=(0, 1)))  # one program
    ref_loss, ref_grads = ref(params, x, t)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    fwd = ts.dist.pipeline(_layer, microbatches=4, mesh=jm, axis="tp")
    want = jax.jit(fwd.sequential)(params, x)
    np.testing.assert_allclose(fwd(params, x), want, rtol=1e-6, atol=1e-6)
