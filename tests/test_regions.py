"""Region privileges (seed 002 §4.5–4.6): reads, writes, reductions and their checks."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax import Region, read, reduce_sum, write
from tessera_jax.sharding import regions
from tests._util import f64, np_tree, rand

# Bitwise across meshes and runs: checked on the code XLA optimises (tests/conftest.py).
pytestmark = pytest.mark.xla_optimized


@pytest.fixture(scope="module")
def mesh():
    return ts.dist.Mesh(axes=["dp", "tp"], devices=range(8), shape=(2, 4))


def test_has_regions_and_wrap_contract():
    def f(W: Region[read], Y: Region[write], n: int = 3):
        Y[:] = W * n

    def g(x, y):
        return x

    assert regions.has_regions(f) and not regions.has_regions(g)
    assert regions.privileges(f) == {"W": read, "Y": write}
    w = rand((4, 4))
    out = regions.wrap(f)(w, np.zeros((4, 4), np.float32))
    np.testing.assert_array_equal(out, w * 3)
    with pytest.raises(TypeError, match="Region"):
        Region["rw"]


def test_seed002_norm_layer_and_step(mesh):
    """Seed 002 §4.5/§4.6 with ts.jit: writes return the region with its sharding,
    reduce_sum regions accumulate."""
    B, S, Dm = 4, 8, 16
    with mesh:
        D = ts.domain.Rect((B, S, Dm))
        dist = ts.dist.Block(mesh_axes=("dp", "tp"))
        X = ts.array.from_domain(D, dtype="f32", distribution=dist, init=rand((B, S, Dm)))
        Y = ts.array.from_domain(D, dtype="f32", distribution=dist)

    @ts.jit
    def norm_layer(X: Region[read], Y: Region[write]):
        Y[:] = ts.rmsnorm_safe(X)

    Y = norm_layer(X, Y)
    assert isinstance(Y, ts.dist.DistTensor) and Y.sharding.spec == P("dp", "tp")
    np.testing.assert_allclose(np.asarray(Y), ts.rmsnorm_safe(np.asarray(X)), rtol=1e-6)

    W = ts.dist.tensor((Dm, Dm), None, mesh, "f32", rand((Dm, Dm)))
    acc0 = rand((B, S, Dm))
    Z = ts.dist.tensor((B, S, Dm), ts.ShardSpec(("batch",), ("dp",)), mesh, "f32", acc0)

    @ts.jit
    def step(W: Region[read], X: Region[read], Y: Region[reduce_sum]):
        Y += ts.gemm(X, W)

    Z = step(W, X, Z)
    assert Z.sharding.spec == P("dp")
    np.testing.assert_allclose(
        np.asarray(Z), np.asarray(acc0) + np.asarray(X) @ np.asarray(W), rtol=1e-5, atol=1e-5
    )


def test_privilege_errors_in_the_body():
    @regions.wrap
    def reads_reduction(W: Region[read], Y: Region[reduce_sum]):
        Y += W * Y

    @regions.wrap
    def reads_before_write(W: Region[read], Y: Region[write]):
        Y[:] = Y + W

    @regions.wrap
    def accumulates_into_write(W: Region[read], Y: Region[write]):
        Y += W

    w, y = rand((3,)), rand((3,))
    with pytest.raises(regions.RegionError, match="'Y' is Region\\[reduce_sum\\].*not read"):
        jax.jit(reads_reduction)(w, y)
    with pytest.raises(regions.RegionError, match="read before being written"):
        reads_before_write(w, y)
    with pytest.raises(regions.RegionError, match="declare it Region\\[reduce_sum\\]"):
        accumulates_into_write(w, y)


def test_aliasing_errors():
    def step(W: Region[read], X: Region[read], Y: Region[reduce_sum]):
        Y += X @ W

    def two(Y1: Region[write], Y2: Region[write]):
        Y1[:] = 1.0
        Y2[:] = 2.0

    w, y = rand((3, 3)), rand((3, 3))
    with pytest.raises(regions.RegionError, match="a read of a region being reduced"):
        regions.wrap(step)(w, y, y)
    with pytest.raises(regions.RegionError, match="two writers of the same region"):
        regions.wrap(two)(y, y)
    regions.wrap(step)(w, w, y)  # two reads of one region are fine

    # Inside a traced caller the same tracer reaches both parameters: still caught.
    with pytest.raises(regions.RegionError, match="being reduced"):
        jax.jit(lambda w, y: regions.wrap(step)(w, y, y))(w, y)
    # ts.jit checks the caller's arguments before jax.jit gives each its own tracer.
    with pytest.raises(regions.RegionError, match="being reduced"):
        ts.jit(step)(w, y, y)
    with pytest.raises(regions.RegionError, match="two writers of the same region"):
        ts.jit(two)(y, y)
    new_y = ts.jit(step)(w, w, y)  # the new value of the one reduce_sum region
    np.testing.assert_allclose(new_y, f64(y) + f64(w) @ f64(w), rtol=1e-5)


def test_index_launch_with_regions(mesh):
    x = rand((8, 12))
    X = ts.dist.tensor((8, 12), ts.ShardSpec(("row", "col"), ("dp", "tp")), mesh, "f32", x)
    Y = ts.dist.tensor((8, 12), ts.ShardSpec(("row", "col"), ("dp", "tp")), mesh)
    T = ts.dist.tensor((4, 3), None, mesh, "f32", np.ones((4, 3), np.float32))

    def kernel(X: Region[read], Y: Region[write], T: Region[reduce_sum]):
        Y[:] = X * 2
        T += X  # every part's block: combined by the deterministic all-reduce over tp

    Y2, T2 = ts.index_launch(axis="tp")(kernel)(X.parts("tp"), Y.parts("tp"), T)
    np.testing.assert_array_equal(np.asarray(Y2), np.asarray(x) * 2)
    assert Y2.sharding.spec == P("dp", "tp")
    # Every part's block, from all 8 devices, added to T on the canonical tree.
    blocks = np.asarray(x).reshape(2, 4, 4, 3).transpose(0, 2, 1, 3).reshape(8, 4, 3)
    assert T2.shape == (4, 3) and T2.sharding.spec == P()
    # f32 sums of 8 values near cancellation: an absolute term at the f32 rounding level
    np.testing.assert_allclose(np.asarray(T2), 1 + blocks.sum(0), rtol=1e-5, atol=1e-5)
    expect = np.ones((4, 3), np.float32) + np_tree(blocks)  # parts in mesh (dp, tp) order
    assert np.asarray(T2).tobytes() == expect.tobytes()

    with pytest.raises(regions.RegionError, match="not partitioned along the launch axis"):
        ts.index_launch(axis="tp")(kernel)(X.parts("tp"), Y, T)
    with pytest.raises(regions.RegionError, match="a read of a region being written"):
        ts.index_launch(axis="tp")(kernel)(Y.parts("tp"), Y.parts("tp"), T)


def test_check_aliases_before_jit():
    def step(W: Region[read], X: Region[read], Y: Region[reduce_sum]):
        Y += X @ W

    g = regions.wrap(step)
    w, y = rand((3, 3)), rand((3, 3))
    g.check_aliases(w, w, y)
    with pytest.raises(regions.RegionError, match="being reduced"):
        g.check_aliases(w, y, y)
