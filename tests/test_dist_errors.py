"""Bad arguments to the distribution API: each public function raises a TypeError or
ValueError at trace time naming itself, the argument and the value (8 CPU devices).

One table per module; every row is (id, call, exception type, message fragment), where
``call`` takes the (dp=2, tp=4) mesh.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax.sharding.regions import RegionError


@pytest.fixture(scope="module")
def m():
    return ts.dist.Mesh(axes=("dp", "tp"), shape=(2, 4))


def _check(call, m, exc, fragment):
    """``call(m)`` raises exactly ``exc`` with every fragment (one or a tuple) in order."""
    fragments = (fragment,) if isinstance(fragment, str) else fragment
    with pytest.raises(exc, match=".*".join(map(re.escape, fragments))) as info:
        call(m)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"


def _table(rows):
    return pytest.mark.parametrize(
        "call,exc,fragment", [r[1:] for r in rows], ids=[r[0] for r in rows]
    )


# --- ts.dist.Mesh / ts.dist.mesh -----------------------------------------------------------

MESH = [
    ("axes-None", lambda m: ts.dist.Mesh(axes=None), TypeError, "Mesh: axes=None"),
    ("axes-int", lambda m: ts.dist.Mesh(axes=5), TypeError, "Mesh: axes=5"),
    ("axes-empty", lambda m: ts.dist.Mesh(axes=()), ValueError, "Mesh: axes=() must name"),
    (
        "axes-not-str",
        lambda m: ts.dist.Mesh(axes=("a", 1), shape=(2, 4)),
        TypeError,
        "Mesh: axes=('a', 1) must be mesh-axis names",
    ),
    (
        "axes-duplicate",
        lambda m: ts.dist.mesh(axes=("a", "a"), shape=(2, 4)),
        ValueError,
        "Mesh: axes=('a', 'a') repeats",
    ),
    (
        "shape-float",
        lambda m: ts.dist.Mesh(axes="a", shape=(8.7,)),
        TypeError,
        "Mesh: shape=(8.7,) must be a sequence of positive ints; entry 0 is 8.7",
    ),
    (
        "shape-integral-float",
        lambda m: ts.dist.Mesh(axes="a", shape=(8.0,)),
        TypeError,
        "entry 0 is 8.0",
    ),
    (
        "shape-negative",
        lambda m: ts.dist.Mesh(axes=("a", "b"), shape=(-2, -4)),
        ValueError,
        "Mesh: shape=(-2, -4) must be a sequence of positive ints; entry 0 is -2",
    ),
    (
        "shape-zero",
        lambda m: ts.dist.Mesh(axes=("a", "b"), devices=[0], shape=(1, 0)),
        ValueError,
        "entry 1 is 0",
    ),
    (
        "shape-bool",
        lambda m: ts.dist.Mesh(axes="a", devices=[0], shape=(True,)),
        TypeError,
        "entry 0 is True",
    ),
    ("shape-str", lambda m: ts.dist.Mesh(axes="a", shape="8"), TypeError, "Mesh: shape='8'"),
    ("shape-None-entry", lambda m: ts.dist.Mesh(axes="a", shape=(None,)), TypeError, "None"),
    (
        "shape-rank",
        lambda m: ts.dist.Mesh(axes=("a", "b"), shape=(8,)),
        ValueError,
        "one size per axis",
    ),
    (
        "shape-device-count",
        lambda m: ts.dist.Mesh(axes=("a", "b"), shape=(2, 3)),
        ValueError,
        "holds 6 devices but 8",
    ),
    (
        "devices-empty",
        lambda m: ts.dist.Mesh(axes="a", devices=[]),
        ValueError,
        "Mesh: devices=[] is empty",
    ),
    (
        "devices-empty-with-shape",
        lambda m: ts.dist.Mesh(axes="a", devices=[], shape=(0,)),
        ValueError,
        "is empty",
    ),
    ("devices-int", lambda m: ts.dist.Mesh(axes="a", devices=5), TypeError, "Mesh: devices=5"),
    (
        "devices-str",
        lambda m: ts.dist.Mesh(axes="a", devices="cpu:0"),
        TypeError,
        "Mesh: devices='cpu:0'",
    ),
    (
        "device-negative",
        lambda m: ts.dist.Mesh(axes="a", devices=[-1]),
        ValueError,
        "devices[0]=-1 is out of range",
    ),
    (
        "device-too-large",
        lambda m: ts.dist.Mesh(axes="a", devices=[8]),
        ValueError,
        "devices[0]=8 is out of range",
    ),
    (
        "device-float",
        lambda m: ts.dist.Mesh(axes="a", devices=[1.0]),
        TypeError,
        "devices[0]=1.0 must be",
    ),
    (
        "device-bool",
        lambda m: ts.dist.Mesh(axes="a", devices=[True]),
        TypeError,
        "devices[0]=True must be",
    ),
    (
        "device-None",
        lambda m: ts.dist.Mesh(axes="a", devices=[None]),
        TypeError,
        "devices[0]=None must be",
    ),
    (
        "device-string",
        lambda m: ts.dist.Mesh(axes="a", devices=["cpu:-1"]),
        ValueError,
        "devices[0]='cpu:-1' must look like",
    ),
    (
        "device-platform",
        lambda m: ts.dist.Mesh(axes="a", devices=["gpu:0"]),
        ValueError,
        "no gpu devices",
    ),
    (
        "device-twice",
        lambda m: ts.dist.Mesh(axes="a", devices=[0, 0]),
        ValueError,
        "names a device twice",
    ),
    (
        "axis_size-unknown",
        lambda m: m.axis_size("zz"),
        ValueError,
        "Mesh.axis_size: axis names 'zz', which is not an axis of the mesh ('dp', 'tp')",
    ),
    ("axis_size-int", lambda m: m.axis_size(3), TypeError, "Mesh.axis_size: axis=3"),
    ("from_jax-int", lambda m: ts.dist.Mesh.from_jax(5), TypeError, "Mesh.from_jax: mesh=5"),
]


@_table(MESH)
def test_mesh_bad_arguments(m, call, exc, fragment):
    _check(call, m, exc, fragment)


# --- ts.ShardSpec ---------------------------------------------------------------------------

SPEC = [
    (
        "partition-None",
        lambda m: ts.ShardSpec(partition=None, mesh_axes=("tp",)),
        TypeError,
        "ShardSpec: partition=None",
    ),
    (
        "partition-float",
        lambda m: ts.ShardSpec(partition=(1.5,), mesh_axes=("tp",)),
        TypeError,
        "ShardSpec: partition entry 1.5",
    ),
    (
        "partition-bool",
        lambda m: ts.ShardSpec(partition=(True,), mesh_axes=("tp",)),
        TypeError,
        "ShardSpec: partition entry True",
    ),
    (
        "partition-name",
        lambda m: ts.ShardSpec(partition=("diag",), mesh_axes=("tp",)),
        ValueError,
        "ShardSpec: partition entry 'diag' must be 'row', 'col', 'batch' or an int",
    ),
    (
        "mesh_axes-None",
        lambda m: ts.ShardSpec(partition=(0,), mesh_axes=None),
        TypeError,
        "ShardSpec: mesh_axes=None",
    ),
    (
        "mesh_axes-int",
        lambda m: ts.ShardSpec(partition=(0,), mesh_axes=5),
        TypeError,
        "ShardSpec: mesh_axes=5",
    ),
    (
        "mesh_axes-entry-int",
        lambda m: ts.ShardSpec(partition=(0,), mesh_axes=(5,)),
        TypeError,
        "ShardSpec: mesh_axes entry 5",
    ),
    (
        "mesh_axes-entry-empty",
        lambda m: ts.ShardSpec(partition=(0,), mesh_axes=((),)),
        TypeError,
        "ShardSpec: mesh_axes entry ()",
    ),
    (
        "from_partition_spec-int",
        lambda m: ts.ShardSpec.from_partition_spec(5),
        TypeError,
        "ShardSpec.from_partition_spec: spec=5 must be a jax PartitionSpec",
    ),
    (
        "lengths",
        lambda m: ts.ShardSpec(partition=(0, 1), mesh_axes=("tp",)),
        ValueError,
        "must have the same length",
    ),
    (
        "axis-twice",
        lambda m: ts.ShardSpec(("row", "col"), ("tp", "tp")),
        ValueError,
        "uses a mesh axis twice",
    ),
    (
        "dim-twice",
        lambda m: ts.ShardSpec((0, "row"), ("dp", "tp")).partition_spec(2),
        ValueError,
        "names a dim twice",
    ),
    (
        "rank",
        lambda m: ts.ShardSpec(("col",), ("tp",)).partition_spec(1),
        ValueError,
        "dim 'col' does not exist in a tensor of rank 1",
    ),
]


@_table(SPEC)
def test_shardspec_bad_arguments(m, call, exc, fragment):
    _check(call, m, exc, fragment)


# --- ts.dist.tensor and DistTensor methods -------------------------------------------------

ROW_TP = ts.ShardSpec(("row",), ("tp",))


def _tensor(m, **kw):
    return ts.dist.tensor((8, 8), ROW_TP, mesh=m, **kw)


TENSOR = [
    (
        "shape-float",
        lambda m: ts.dist.tensor((8.7,), mesh=m),
        TypeError,
        "dist.tensor: shape=(8.7,) must be a sequence of positive ints; entry 0 is 8.7",
    ),
    ("shape-integral-float", lambda m: ts.dist.tensor((8.0,), mesh=m), TypeError, "8.0"),
    ("shape-negative", lambda m: ts.dist.tensor((-1,), mesh=m), ValueError, "entry 0 is -1"),
    ("shape-zero", lambda m: ts.dist.tensor((8, 0), mesh=m), ValueError, "entry 1 is 0"),
    ("shape-bool", lambda m: ts.dist.tensor((True,), mesh=m), TypeError, "entry 0 is True"),
    ("shape-None", lambda m: ts.dist.tensor(None, mesh=m), TypeError, "shape=None"),
    ("shape-str", lambda m: ts.dist.tensor("8", mesh=m), TypeError, "shape='8'"),
    (
        "layout-PartitionSpec",
        lambda m: ts.dist.tensor((8,), P("dp"), mesh=m),
        TypeError,
        ("dist.tensor: layout=", "'dp'", "must be a ts.ShardSpec or None"),
    ),
    (
        "layout-unknown-axis",
        lambda m: ts.dist.tensor((8, 8), ts.ShardSpec((0,), ("zz",)), mesh=m),
        ValueError,
        "dist.tensor: layout.mesh_axes names 'zz', which is not an axis of the mesh",
    ),
    (
        "layout-unknown-axis-in-tuple",
        lambda m: ts.dist.tensor((8, 8), ts.ShardSpec((0,), (("dp", "zz"),)), mesh=m),
        ValueError,
        "names 'zz'",
    ),
    (
        "layout-rank",
        lambda m: ts.dist.tensor((8,), ts.ShardSpec(("col",), ("tp",)), mesh=m),
        ValueError,
        "rank 1",
    ),
    (
        "layout-indivisible",
        lambda m: ts.dist.tensor((6,), ts.ShardSpec((0,), ("tp",)), mesh=m),
        ValueError,
        "dist.tensor: dim 0 of shape (6,) has size 6",
    ),
    ("mesh-int", lambda m: ts.dist.tensor((8,), mesh=5), TypeError, "dist.tensor: mesh=5"),
    ("no-mesh", lambda m: ts.dist.tensor((8,)), ValueError, "dist.tensor: no mesh"),
    (
        "dtype-unknown",
        lambda m: ts.dist.tensor((8,), mesh=m, dtype="bogus"),
        TypeError,
        "dist.tensor: dtype='bogus'",
    ),
    (
        "dtype-None",
        lambda m: ts.dist.tensor((8,), mesh=m, dtype=None),
        TypeError,
        "dist.tensor: dtype=None",
    ),
    (
        "dtype-int",
        lambda m: ts.dist.tensor((8,), mesh=m, dtype=5),
        TypeError,
        "dist.tensor: dtype=5",
    ),
    (
        "init-numpy-shape",
        lambda m: _tensor(m, init=np.ones(8, np.float32)),
        ValueError,
        "dist.tensor: init has shape (8,), expected shape=(8, 8)",
    ),
    (
        "init-jax-shape",
        lambda m: _tensor(m, init=jnp.ones(8)),
        ValueError,
        "dist.tensor: init has shape (8,), expected shape=(8, 8)",
    ),
    (
        "init-jax-transposed",
        lambda m: ts.dist.tensor((8, 4), mesh=m, init=jnp.ones((4, 8))),
        ValueError,
        "init has shape (4, 8), expected shape=(8, 4)",
    ),
    (
        "init-list-shape",
        lambda m: _tensor(m, init=[1.0, 2.0]),
        ValueError,
        "init has shape (2,), expected shape=(8, 8)",
    ),
    (
        "init-scalar",
        lambda m: _tensor(m, init=3.0),
        ValueError,
        "init has shape (), expected shape=(8, 8)",
    ),
    (
        "init-traced-shape",
        lambda m: jax.jit(lambda a: _tensor(m, init=a).array)(jnp.ones(8)),
        ValueError,
        "init has shape (8,), expected shape=(8, 8)",
    ),
    (
        "init-str",
        lambda m: ts.dist.tensor((8,), mesh=m, init="abc"),
        TypeError,
        "dist.tensor: init='abc' must be an array of numbers of shape (8,)",
    ),
    (
        "init-ragged",
        lambda m: ts.dist.tensor((2,), mesh=m, init=[[1.0], [1.0, 2.0]]),
        TypeError,
        "must be an array of numbers",
    ),
    (
        "init-callable-shape",
        lambda m: _tensor(m, init=lambda k, s, d: jnp.ones(3, d)),
        ValueError,
        "dist.tensor: init returned shape (3,), expected (8, 8)",
    ),
    (
        "key-int",
        lambda m: _tensor(m, init=lambda k, s, d: jax.random.normal(k, s, d), key=5),
        TypeError,
        "dist.tensor: key=5 must be a PRNG key",
    ),
    (
        "key-without-callable-init",
        lambda m: _tensor(m, init=np.ones((8, 8), np.float32), key=jax.random.key(0)),
        ValueError,
        "dist.tensor: key= is only used by a callable init(key, shape, dtype); init is ndarray",
    ),
    (
        "parts-unknown-axis",
        lambda m: _tensor(m).parts("zz"),
        ValueError,
        "parts: axis='zz' names 'zz', which is not an axis of the mesh",
    ),
    (
        "parts-unpartitioned-axis",
        lambda m: _tensor(m).parts("dp"),
        ValueError,
        "parts: mesh axis 'dp' does not partition this tensor",
    ),
    ("parts-int", lambda m: _tensor(m).parts(3), TypeError, "parts: axis=3"),
    ("parts-None", lambda m: _tensor(m).parts(None), TypeError, "parts: axis=None"),
    ("parts-empty", lambda m: _tensor(m).parts(()), ValueError, "parts: axis=()"),
    (
        "parts-index-range",
        lambda m: _tensor(m).parts("tp")[4],
        ValueError,
        "parts[i]: i=4 must be an int in [-4, 4)",
    ),
    (
        "parts-index-negative",
        lambda m: _tensor(m).parts("tp")[-5],
        ValueError,
        "i=-5 must be an int in [-4, 4)",
    ),
    (
        "parts-index-float",
        lambda m: _tensor(m).parts("tp")[1.5],
        TypeError,
        "parts[i]: i=1.5 must be an int",
    ),
    (
        "parts-of-int",
        lambda m: ts.dist.Parts(5, "tp"),
        TypeError,
        "parts: tensor=5 must be a ts.dist.tensor",
    ),
    (
        "with_array-shape",
        lambda m: _tensor(m).with_array(jnp.ones(8)),
        ValueError,
        "DistTensor.with_array: array of shape (8,) must have this tensor's shape (8, 8)",
    ),
    (
        "astype-unknown",
        lambda m: _tensor(m).astype("bogus"),
        TypeError,
        "DistTensor.astype: dtype='bogus'",
    ),
]


@_table(TENSOR)
def test_tensor_bad_arguments(m, call, exc, fragment):
    _check(call, m, exc, fragment)


# --- ts.domain / ts.dist.Block / ts.array ---------------------------------------------------

DOMAIN = [
    (
        "rect-float",
        lambda m: ts.domain.Rect((8.7,)),
        TypeError,
        "domain.Rect: shape=(8.7,) must be a sequence of positive ints",
    ),
    ("rect-negative", lambda m: ts.domain.Rect((4, -1)), ValueError, "entry 1 is -1"),
    ("rect-zero", lambda m: ts.domain.Rect((0,)), ValueError, "entry 0 is 0"),
    ("rect-bool", lambda m: ts.domain.Rect((True,)), TypeError, "entry 0 is True"),
    ("rect-None", lambda m: ts.domain.Rect(None), TypeError, "domain.Rect: shape=None"),
    (
        "block-mesh_axes-int",
        lambda m: ts.dist.Block(mesh_axes=5),
        TypeError,
        "dist.Block: mesh_axes=5",
    ),
    (
        "block-mesh_axes-None",
        lambda m: ts.dist.Block(mesh_axes=None),
        TypeError,
        "dist.Block: mesh_axes=None",
    ),
    (
        "block-mesh_axes-entry",
        lambda m: ts.dist.Block(mesh_axes=("dp", 3)),
        TypeError,
        "dist.Block: mesh_axes entry 3",
    ),
    ("block-mesh-int", lambda m: ts.dist.Block(("dp",), mesh=5), TypeError, "dist.Block: mesh=5"),
    (
        "block-rank",
        lambda m: ts.array.from_domain((8,), distribution=ts.dist.Block(("dp", "tp")), mesh=m),
        ValueError,
        "dist.Block: mesh_axes=('dp', 'tp') has more entries than the domain's 1 dims",
    ),
    (
        "from_domain-unknown-axis",
        lambda m: ts.array.from_domain((8, 8), distribution=ts.dist.Block(("zz",)), mesh=m),
        ValueError,
        "names 'zz', which is not an axis of the mesh ('dp', 'tp')",
    ),
    (
        "from_domain-distribution-int",
        lambda m: ts.array.from_domain((8, 8), distribution=5, mesh=m),
        TypeError,
        "array.from_domain: distribution=5 must be a ts.dist.Block, a ts.ShardSpec or None",
    ),
    (
        "from_domain-domain-None",
        lambda m: ts.array.from_domain(None, mesh=m),
        TypeError,
        "array.from_domain: domain=None",
    ),
    (
        "from_domain-domain-float",
        lambda m: ts.array.from_domain((8, 2.5), mesh=m),
        TypeError,
        "array.from_domain: domain=(8, 2.5) must be a sequence of positive ints",
    ),
    (
        "from_domain-no-mesh",
        lambda m: ts.array.from_domain((8,)),
        ValueError,
        "array.from_domain: no mesh",
    ),
]


@_table(DOMAIN)
def test_domain_bad_arguments(m, call, exc, fragment):
    _check(call, m, exc, fragment)


# --- ts.index_launch ------------------------------------------------------------------------


def _launch(m, **kw):
    return ts.index_launch(lambda x: x * 2.0, mesh=m, **kw)


LAUNCH = [
    ("axis-int", lambda m: _launch(m, axis=5), TypeError, "index_launch: axis=5"),
    ("axis-None", lambda m: _launch(m, axis=None), TypeError, "index_launch: axis=None"),
    ("axis-empty", lambda m: _launch(m, axis=()), ValueError, "index_launch: axis=() must name"),
    (
        "axis-duplicate",
        lambda m: _launch(m, axis=("tp", "tp")),
        ValueError,
        "index_launch: axis=('tp', 'tp') repeats",
    ),
    (
        "axis-unknown",
        lambda m: _launch(m, axis="zz")(jnp.ones(8)),
        ValueError,
        "index_launch: axis='zz' names 'zz', which is not an axis of the mesh ('dp', 'tp')",
    ),
    (
        "axis-unknown-mesh-from-parts",
        lambda m: ts.index_launch(lambda a: a, axis="zz")(_tensor(m).parts("tp")),
        ValueError,
        "index_launch: axis='zz' names 'zz'",
    ),
    (
        "collective-axis-unknown",
        lambda m: ts.index_launch(lambda a: ts.op.all_reduce(a, axis="zz"), axis="tp")(
            _tensor(m, init=np.ones((8, 8), np.float32)).parts("tp")
        ),
        ValueError,
        "all_reduce: axis='zz' is not an axis of the mesh ('dp', 'tp')",
    ),
    (
        "no-mesh",
        lambda m: ts.index_launch(lambda x: x, axis="tp")(jnp.ones(8)),
        ValueError,
        "index_launch: no mesh",
    ),
    ("fn-int", lambda m: ts.index_launch(5, axis="tp"), TypeError, "index_launch: fn=5"),
    ("mesh-int", lambda m: ts.index_launch(axis="tp", mesh=5), TypeError, "index_launch: mesh=5"),
    ("out-int", lambda m: _launch(m, axis="tp", out=5), TypeError, "index_launch: out=5"),
    (
        "out-unknown-axis",
        lambda m: _launch(m, axis="tp", out=ts.ShardSpec((0,), ("zz",)))(jnp.ones(8)),
        ValueError,
        "names 'zz', which is not an axis of the mesh",
    ),
    (
        "out-unknown-axis-PartitionSpec",
        lambda m: _launch(m, axis="tp", out=P("zz"))(jnp.ones(8)),
        ValueError,
        "names 'zz', which is not an axis of the mesh",
    ),
    (
        "out-count",
        lambda m: _launch(m, axis="tp", out=(P(), P()))(jnp.ones(8)),
        ValueError,
        "index_launch: out= gives 2 layouts for 1 results",
    ),
    (
        "result-str",
        lambda m: ts.index_launch(lambda x: "done", axis="tp", mesh=m)(jnp.ones(8)),
        TypeError,
        "index_launch: the launched function returned 'done' (a str)",
    ),
    (
        "other-mesh",
        lambda m: ts.index_launch(lambda x: x, axis="a", mesh=ts.dist.Mesh("a"))(
            _tensor(m).parts("tp")
        ),
        ValueError,
        "index_launch: a DistTensor argument lives on another mesh",
    ),
]


@_table(LAUNCH)
def test_index_launch_bad_arguments(m, call, exc, fragment):
    _check(call, m, exc, fragment)


# --- regions: ts.Region / ts.jit's privilege checks ----------------------------------------


def _jit_write(body):
    @ts.jit
    def step(X: ts.Region[ts.read], Y: ts.Region[ts.write]):
        body(X, Y)

    return step


def _jit_reduce(body):
    @ts.jit
    def step(X: ts.Region[ts.read], Y: ts.Region[ts.reduce_sum]):
        body(X, Y)

    return step


def _set(Y, idx, v):
    Y[idx] = v


def _add(Y, v):
    Y += v


X4 = np.arange(1.0, 5.0, dtype=np.float32)
Y4 = np.arange(5.0, 9.0, dtype=np.float32)  # another region: passing X4 twice is aliasing

REGIONS = [
    ("privilege-int", lambda m: ts.Region[5], TypeError, "Region[5]: expected ts.read"),
    (
        "write-read-scalar-add",
        lambda m: _jit_write(lambda X, Y: _set(Y, ..., Y + 1.0))(X4, Y4),
        RegionError,
        "region 'Y' is Region[write]: it is read before being written",
    ),
    (
        "write-read-scalar-rmul",
        lambda m: _jit_write(lambda X, Y: _set(Y, ..., 2.0 * Y))(X4, Y4),
        RegionError,
        "read before being written",
    ),
    (
        "write-read-index",
        lambda m: _jit_write(lambda X, Y: _set(Y, ..., Y[0]))(X4, Y4),
        RegionError,
        "read before being written",
    ),
    (
        "write-read-array-add",
        lambda m: _jit_write(lambda X, Y: _set(Y, ..., X + Y))(X4, Y4),
        RegionError,
        "read before being written",
    ),
    (
        "write-read-jnp",
        lambda m: _jit_write(lambda X, Y: _set(Y, ..., jnp.sum(Y) * X))(X4, Y4),
        RegionError,
        "region 'Y' is Region[write]: it is read before being written",
    ),
    (
        "write-iadd",
        lambda m: _jit_write(lambda X, Y: _add(Y, X))(X4, Y4),
        RegionError,
        "`+=` reads it; declare it Region[reduce_sum]",
    ),
    (
        "write-shape",
        lambda m: _jit_write(lambda X, Y: _set(Y, slice(None), jnp.ones(7)))(X4, Y4),
        RegionError,
        "region 'Y' is Region[write]: the value assigned of shape (7,) does not broadcast "
        "to shape (4,)",
    ),
    (
        "write-index-range",
        lambda m: _jit_write(lambda X, Y: _set(Y, 9, 1.0))(X4, Y4),
        RegionError,
        "region 'Y' is Region[write] of shape (4,): index 9 must be in [-4, 4) along dim 0",
    ),
    (
        "write-index-rank",
        lambda m: _jit_write(lambda X, Y: _set(Y, (0, 1), 1.0))(X4, Y4),
        RegionError,
        "index (0, 1) has 2 entries for 1 dims",
    ),
    (
        "write-value-str",
        lambda m: _jit_write(lambda X, Y: _set(Y, ..., "a"))(X4, Y4),
        TypeError,
        "region 'Y' is Region[write]: the value assigned str 'a' is not an array",
    ),
    (
        "reduce-read",
        lambda m: _jit_reduce(lambda X, Y: Y[0])(X4, Y4),
        RegionError,
        "region 'Y' is Region[reduce_sum]: it may only be accumulated into with `+=`",
    ),
    (
        "reduce-read-scalar",
        lambda m: _jit_reduce(lambda X, Y: 1.0 + Y)(X4, Y4),
        RegionError,
        "not read",
    ),
    (
        "reduce-read-jnp",
        lambda m: _jit_reduce(lambda X, Y: jnp.mean(Y))(X4, Y4),
        RegionError,
        "region 'Y' is Region[reduce_sum]: it may only be accumulated into with `+=`",
    ),
    (
        "reduce-shape",
        lambda m: _jit_reduce(lambda X, Y: _add(Y, jnp.ones(7)))(X4, Y4),
        RegionError,
        "region 'Y' is Region[reduce_sum]: the value added of shape (7,) does not broadcast",
    ),
    (
        "region-list",
        lambda m: _jit_write(lambda X, Y: _set(Y, ..., X))(X4, [1.0, 2.0, 3.0, 4.0]),
        TypeError,
        "step: region 'Y' (Region[write]) must be an array or a ts.dist.tensor; got list",
    ),
    (
        "region-None",
        lambda m: _jit_write(lambda X, Y: _set(Y, ..., X))(X4, None),
        TypeError,
        "region 'Y' (Region[write]) must be an array or a ts.dist.tensor; got NoneType",
    ),
    (
        "missing-argument",
        lambda m: _jit_write(lambda X, Y: _set(Y, ..., X))(X4),
        TypeError,
        "step: missing a required argument: 'Y'",
    ),
]


@_table(REGIONS)
def test_region_bad_arguments(m, call, exc, fragment):
    _check(call, m, exc, fragment)


def test_write_region_reads_what_was_written():
    """After a write, the region reads as the written values (arithmetic with Python
    numbers, indexing, jnp functions), so the errors above are about order, not syntax."""

    @ts.jit
    def step(X: ts.Region[ts.read], Y: ts.Region[ts.write]):
        Y[:] = X * 2.0
        Y[1] = 1.0 + Y[0]
        Y[2] = 3.0 * Y[2] - Y[3]
        return jnp.sum(Y) + Y[0]

    x = np.random.default_rng(0).normal(size=4).astype(np.float32)
    out, y = step(x, np.zeros(4, np.float32))
    want = (2.0 * x).astype(np.float64)
    want[1] = 1.0 + want[0]
    want[2] = 3.0 * want[2] - want[3]
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6)
    np.testing.assert_allclose(float(out), want.sum() + want[0], rtol=1e-6)


# --- ts.dist.pipeline -----------------------------------------------------------------------


def _layer(p, h):
    return jnp.tanh(h @ p)


def _pipe(m, **kw):
    kw = {"microbatches": 2, "mesh": m, "axis": "tp", **kw}
    return ts.dist.pipeline(kw.pop("stages", _layer), **kw)


PARAMS = np.ones((4, 4, 4), np.float32)
XB = np.ones((8, 4), np.float32)

PIPELINE = [
    ("microbatches-zero", lambda m: _pipe(m, microbatches=0), ValueError, "microbatches=0"),
    ("microbatches-float", lambda m: _pipe(m, microbatches=2.0), TypeError, "microbatches=2.0"),
    ("microbatches-bool", lambda m: _pipe(m, microbatches=True), TypeError, "microbatches=True"),
    (
        "microbatches-None",
        lambda m: _pipe(m, microbatches=None),
        TypeError,
        "pipeline: microbatches=None must be a positive int",
    ),
    (
        "schedule-unknown",
        lambda m: _pipe(m, schedule="zb"),
        ValueError,
        "pipeline: schedule='zb' must be one of ('gpipe', '1f1b')",
    ),
    ("schedule-None", lambda m: _pipe(m, schedule=None), ValueError, "schedule=None"),
    ("stages-int", lambda m: _pipe(m, stages=5), TypeError, "pipeline: stages=5"),
    ("stages-empty", lambda m: _pipe(m, stages=[]), TypeError, "pipeline: stages=[]"),
    ("stages-entry", lambda m: _pipe(m, stages=[_layer, 3]), TypeError, "callables"),
    ("loss-int", lambda m: _pipe(m, loss=5), TypeError, "pipeline: loss=5 must be a callable"),
    ("1f1b-no-loss", lambda m: _pipe(m, schedule="1f1b"), ValueError, "pass loss="),
    ("axis-int", lambda m: _pipe(m, axis=5), TypeError, "pipeline: axis=5"),
    ("mesh-int", lambda m: _pipe(m, mesh=5), TypeError, "pipeline: mesh=5"),
    (
        "axis-unknown",
        lambda m: _pipe(m, axis="zz")(PARAMS, XB),
        ValueError,
        "pipeline: axis='zz' names 'zz', which is not an axis of the mesh",
    ),
    (
        "params-empty",
        lambda m: _pipe(m)({}, XB),
        ValueError,
        "pipeline: params must be arrays stacked along a leading dim",
    ),
    (
        "params-scalar",
        lambda m: _pipe(m)(np.float32(1.0), XB),
        ValueError,
        "params must be arrays stacked",
    ),
    (
        "params-leading-dims",
        lambda m: _pipe(m)({"w": PARAMS, "b": np.ones((8, 4), np.float32)}, XB),
        ValueError,
        "the same size in every leaf",
    ),
    (
        "params-list-length",
        lambda m: _pipe(m, stages=[_layer] * 4)([PARAMS[0]] * 3, XB),
        ValueError,
        "pipeline: 4 stage functions but 3 params",
    ),
    (
        "params-list-type",
        lambda m: _pipe(m, stages=[_layer] * 4)(PARAMS, XB),
        TypeError,
        "4 stage functions take a list of 4 params; got a ndarray",
    ),
    (
        "layers-indivisible",
        lambda m: _pipe(m)(np.ones((6, 4, 4), np.float32), XB),
        ValueError,
        "6 layers cannot be split evenly over the 4 devices",
    ),
    ("x-None", lambda m: _pipe(m)(PARAMS, None), TypeError, "pipeline: x=None must be an array"),
    ("x-str", lambda m: _pipe(m)(PARAMS, "x"), TypeError, "pipeline: x='x' must be an array"),
    (
        "x-scalar",
        lambda m: _pipe(m)(PARAMS, np.float32(1.0)),
        ValueError,
        "pipeline: x of shape () must have a batch dim",
    ),
    (
        "x-batch",
        lambda m: _pipe(m, microbatches=3)(PARAMS, XB),
        ValueError,
        "batch size 8 is not a multiple of microbatches=3",
    ),
    (
        "loss-not-scalar",
        lambda m: _pipe(m, loss=lambda y, t: (y - t) ** 2)(PARAMS, XB, XB),
        ValueError,
        "pipeline: loss(y, targets) must return a scalar per microbatch; it returned shape (4, 4)",
    ),
    (
        "loss-not-scalar-1f1b",
        lambda m: jax.grad(_pipe(m, schedule="1f1b", loss=lambda y, t: (y - t) ** 2))(
            PARAMS, XB, XB
        ),
        ValueError,
        "must return a scalar per microbatch",
    ),
    (
        "targets-batch",
        lambda m: _pipe(m, loss=ts.mse)(PARAMS, XB, XB[:6]),
        ValueError,
        "pipeline: targets of shape (6, 4) must have x's batch size 8 as their leading dim",
    ),
    (
        "targets-without-loss",
        lambda m: _pipe(m)(PARAMS, XB, XB),
        ValueError,
        "pipeline: targets given but no loss=",
    ),
]


@_table(PIPELINE)
def test_pipeline_bad_arguments(m, call, exc, fragment):
    _check(call, m, exc, fragment)
