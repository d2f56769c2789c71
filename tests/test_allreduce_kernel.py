"""The NVLink all-reduce kernel (pallas_kernels/allreduce_mgpu.py) on the CPU: its tiling
plan, its in-register tree against the canonical one, and where ``ts.op.all_reduce``
lowers to it (a cuda lowering built here), and its dispatch vocabulary. No interpreter
runs peer references (the kernel is not interpretable: interpret mode takes the XLA
tree); the bits on GPUs are checked by ``benchmarks/allreduce.py`` (docs/DISTRIBUTION.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax import _compat
from tessera_jax.pallas_kernels import allreduce_mgpu as ar
from tessera_jax.primitives import collectives as coll
from tessera_jax.primitives.reductions import pairwise_tree_sum
from tests._util import cuda_lowering, mosaic_gpu_calls, rand

MIB = 1 << 20


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("size", [1, 1000, MIB // 4, 16 * MIB + 3, 128 * MIB])
def test_plan_tiles_the_message(size, dtype, n):
    p = ar.plan(size, n, dtype, num_sms=132)
    row_bytes = ar.LANES * jnp.dtype(dtype).itemsize
    assert p.rows * ar.LANES >= size
    # Padding: under one tile per CTA and rank.
    assert p.rows * ar.LANES - size < n * p.blocks * p.tile_rows * ar.LANES
    assert p.tile_rows & (p.tile_rows - 1) == 0
    tiles = p.chunk_rows // p.tile_rows
    assert tiles % p.blocks == 0 and p.blocks <= 132 and p.tiles_per_block >= 1
    # Both phases' staging fits the shared-memory budget.
    assert p.stages * (n - 1) * p.tile_rows * row_bytes <= ar.SMEM_BUDGET
    assert (2 * n + 2) * p.tile_rows * row_bytes <= ar.SMEM_BUDGET
    if size >= 64 * MIB // jnp.dtype(dtype).itemsize:  # large messages use every SM it can
        assert p.blocks >= 64


def test_plan_errors():
    with pytest.raises(ValueError, match="at least 2"):
        ar.Plan(n=1, rows=8, tile_rows=1, blocks=1, stages=1)
    with pytest.raises(ValueError, match="multiple of n"):
        ar.Plan(n=4, rows=6, tile_rows=1, blocks=1, stages=1)
    with pytest.raises(ValueError, match="evenly"):
        ar.Plan(n=2, rows=12, tile_rows=2, blocks=2, stages=1)
    with pytest.raises(ValueError, match=r"unsupported dtype int32"):
        ar.all_reduce(jnp.ones((4, 256), jnp.int32), "x", 4)


@pytest.mark.parametrize("n", range(1, 10))
def test_kernel_tree_is_the_canonical_tree(n):
    """The kernel adds the n contributions with ``canonical_tree`` (f32 registers): bit
    for bit the tree every other path uses."""
    x = rand((n, 4099))
    want = pairwise_tree_sum(jnp.asarray(x), axis=0)
    got = ar.canonical_tree([jnp.asarray(x[r]) for r in range(n)])
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.fixture
def hopper(monkeypatch):
    """Lower as if on one process of Hopper GPUs with a jax that runs peer kernels."""
    monkeypatch.setattr(ar.device, "is_sm90", lambda: True)
    monkeypatch.setattr(_compat, "MGPU_PEER_KERNELS", True)


def _cuda_hlo(axis, algo, per_rank, dtype=jnp.float32, op="sum"):
    mesh = _compat.make_mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))

    def body(v):
        return ts.op.all_reduce(v[0, 0], op, axis=axis, algo=algo)[None, None]

    f = _compat.shard_map(
        body, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"), check_vma=False
    )
    x = jax.ShapeDtypeStruct((2, 4, per_rank), dtype, sharding=NamedSharding(mesh, P("dp", "tp")))
    return cuda_lowering(f, x)


SMALL = coll.algorithms.SMALL_MESSAGE_BYTES // 4  # f32 elements: "auto" gathers up to this
BIG = 2 * SMALL  # f32 elements per rank where "auto" takes the kernel
BIG2 = ar.MIN_BYTES_VS_NCCL // 4  # the same where NCCL's order-free psum could run instead


@pytest.mark.parametrize(
    "axis,algo,per_rank,dtype,op,mode,kernel",
    [
        ("tp", "nvlink", 1 << 14, jnp.float32, "sum", "auto", True),
        ("dp", "nvlink", 1 << 14, jnp.bfloat16, "mean", "auto", True),  # 2 parts, other axis
        ("tp", "auto", BIG, jnp.float32, "sum", "auto", True),
        ("dp", "auto", BIG2, jnp.float32, "sum", "auto", True),  # before NCCL's order-free path
        ("dp", "auto", BIG2 // 2, jnp.float32, "sum", "auto", False),  # NCCL's psum
        ("dp", "auto", 2 * BIG, jnp.bfloat16, "sum", "auto", True),  # bf16: no order-free path
        ("tp", "auto", SMALL, jnp.float32, "sum", "auto", False),  # gather's, not the kernel's
        ("tp", "auto", 1 << 14, jnp.float32, "sum", "pallas", True),  # pallas: no threshold
        ("tp", "nvlink", 1 << 14, jnp.float32, "sum", "xla", False),
        ("tp", "nvlink", 1 << 14, jnp.float32, "sum", "interpret", False),
        ("tp", "nvlink", 1 << 14, jnp.float32, "max", "auto", False),
        ("tp", "nvlink", 1 << 14, jnp.int32, "sum", "auto", False),
        (("dp", "tp"), "nvlink", 1 << 14, jnp.float32, "sum", "auto", False),  # one axis only
        ("tp", "binary_tree", BIG, jnp.float32, "sum", "auto", False),
    ],
)
def test_where_all_reduce_lowers_to_the_kernel(
    hopper, axis, algo, per_rank, dtype, op, mode, kernel
):
    with ts.kernel_mode(mode):
        txt = _cuda_hlo(axis, algo, per_rank, dtype, op)
    assert bool(mosaic_gpu_calls(txt)) == kernel
    if kernel:  # a multi-device kernel: XLA passes it the peers' buffer addresses
        assert "xla_replica_ids" in txt
        assert "all-to-all" not in txt and "all_to_all" not in txt


def _spec(axes=("x",), op="sum", n=4, deterministic=True, algo="auto"):
    return coll.AllReduceSpec(axes=axes, op=op, algo=algo, deterministic=deterministic, n=n)


F32 = jax.ShapeDtypeStruct((1024,), jnp.float32)


@pytest.mark.parametrize(
    "spec,aval,why",
    [
        (_spec(), F32, None),
        (_spec(op="mean"), jax.ShapeDtypeStruct((3, 5), jnp.bfloat16), None),
        (_spec(op="max"), F32, "op='max'"),
        (_spec(axes=("x", "y")), F32, "one mesh axis"),
        (_spec(deterministic=False), F32, "deterministic=False"),
        (_spec(n=1), F32, "fewer than 2"),
        (_spec(), jax.ShapeDtypeStruct((8,), jnp.int32), "dtype int32"),
    ],
)
def test_kernel_supports_names_the_reason(spec, aval, why):
    got = ar.supports(spec, (aval,))
    assert got is None if why is None else why in got


def test_kernel_hardware_and_dispatch_vocabulary(hopper):
    assert "not cuda" in ar.hardware("cpu")
    assert ar.hardware("cuda") is None  # the fixture's Hopper with a peer-capable jax
    k = coll.dispatch.NVLINK
    assert (k.name, k.platforms, k.interpretable) == ("nvlink", ("cuda",), False)
    assert (k.fn, k.supports, k.prefer, k.hardware) == (ar.fn, ar.supports, ar.prefer, ar.hardware)
    big = jax.ShapeDtypeStruct((BIG,), jnp.float32)
    small = jax.ShapeDtypeStruct((SMALL,), jnp.float32)  # the largest "auto" gathers
    assert ar.prefer(_spec(), (big,)) and not ar.prefer(_spec(), (small,))
    # Over 2 parts an f32 sum may run NCCL's own all-reduce: the kernel from 32 MiB.
    assert not ar.prefer(_spec(n=2), (big,))
    assert ar.prefer(_spec(n=2), (jax.ShapeDtypeStruct((ar.MIN_BYTES_VS_NCCL // 4,), "f4"),))
    assert ar.prefer(_spec(n=2), (jax.ShapeDtypeStruct((2 * BIG,), jnp.bfloat16),))
    with pytest.raises(ValueError, match="no interpreter runs peer references"):
        ar.fn(_spec(), jnp.ones(8), interpret=True)


def test_kernel_hardware_off_hopper():
    if ar.device.is_sm90():
        pytest.skip("this machine has Hopper GPUs")
    why = ar.hardware("cuda")
    assert why is not None and ("Hopper" in why or "jax >= 0.11" in why)


@pytest.mark.parametrize("mode", ["xla", "pallas", "auto", "interpret"])
@pytest.mark.parametrize("platform", ["cuda", "cpu", None])
def test_select_kernel_follows_the_modes(hopper, mode, platform):
    """pallas/auto take the kernel compiled on cuda (auto: where it is preferred or asked
    for by name); xla never; interpret never, as no interpreter runs it."""
    big = jax.ShapeDtypeStruct((BIG,), jnp.float32)
    with ts.kernel_mode(mode):
        for algo, aval in [("nvlink", F32), ("auto", big), ("auto", F32), ("ring", big)]:
            got = coll.select_kernel(_spec(algo=algo), (aval,), platform)
            want = platform == "cuda" and mode in ("pallas", "auto") and algo != "ring"
            if mode == "auto" and algo == "auto" and aval is F32:
                want = False  # gather's size
            assert got == ((coll.dispatch.NVLINK, False) if want else None), (algo, aval)


def test_nvlink_off_gpu_is_binary_tree_bit_for_bit():
    m = ts.dist.Mesh(devices=range(8), axes=["dp"], shape=(8,))
    x = rand((8, 37, 5))

    def run(algo):
        return np.asarray(ts.op.all_reduce(jnp.asarray(x), axis="dp", algo=algo, mesh=m))

    assert run("nvlink").tobytes() == run("binary_tree").tobytes()
    with pytest.raises(ValueError, match="algo='nvlink'"):
        ts.op.reduce_scatter(jnp.asarray(x), axis="dp", algo="nvlink", mesh=m)
