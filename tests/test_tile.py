"""The tile kernel language (``ts.kernel``, ``ts.launch``, ``ts.tile``) on Pallas' interpreter.

Every seed example under examples/kernels/ runs against a float64 NumPy reference at a
ragged size (N not a multiple of the block), as do the ``mut`` semantics (unstored elements
keep their values, the caller's arrays are unchanged), ``jit``/``vmap`` of a launch, the
loop structure the GPU compiler needs, and the errors a kernel author can hit. The ``gpu``
twins run the same examples compiled by Pallas' Triton backend.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tessera_jax import _compat
from tessera_jax.tile import lowering as tile_lowering
from tests._util import assert_close, example, rand


def _check(out, ref, dtype=np.float32, factor=4.0):
    assert_close(out, ref, dtype, factor=factor)


# --- the seed examples --------------------------------------------------------------------


def test_saxpy():
    n = 1000
    m = example("saxpy")
    x, y = rand((n,)), rand((n,))
    _check(m.run(2.5, x, y), m.reference(2.5, x, y))


def test_saxpy_issue_form_traced_scalar():
    """The issue's exact launch, with ``a`` a traced 0-d array."""
    m = example("saxpy")
    N = 777
    a, X, Y, Out = jnp.float32(-1.25), rand((N,)), rand((N,)), jnp.zeros((N,), jnp.float32)
    out = ts.launch.grid(blocks=(ts.ceil_div(N, 256),), threads=(256,))(m.saxpy)(a, X, Y, Out)
    _check(out, m.reference(-1.25, X, Y))


def test_scale_and_group_sum():
    x = rand((999,))
    s = example("scale")
    _check(s.run(x, 3.0), s.reference(x, 3.0))
    g = example("group_sum")
    _check(g.run(x), g.reference(x))  # the GPU-sized default grid (one group here)
    _check(g.run(x, groups=3, threads=128), g.reference(x, groups=3, threads=128))


def test_warp_and_cooperative_reductions():
    x = rand((1000,))
    w = example("warp_reduce_sum")
    _check(w.run(x), w.reference(x))
    c = example("cooperative_reduction")
    _check(c.run(x), c.reference(x), factor=8.0)


@pytest.mark.parametrize(
    "name, dtype", [("gemm_tc", jnp.float32), ("pipelined_gemm", jnp.bfloat16)]
)
def test_gemms_ragged(name, dtype):
    """f32 and bf16 operands, f32 accumulation and output, M/N/K not multiples of the tiles."""
    m = example(name)
    a, b = rand((100, 72), dtype), rand((72, 40), dtype)
    out = m.run(a, b, BM=32, BN=32, BK=16, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    _check(out, m.reference(a, b), factor=8.0)


def test_flash_attention_and_fused_mlp():
    fa = example("flash_attention")
    q, k, v = rand((2, 50, 16)), rand((2, 50, 16)), rand((2, 50, 16))
    _check(fa.run(q, k, v, BQ=16, BKV=16), fa.reference(q, k, v), factor=8.0)
    mlp = example("fused_mlp")
    args = (rand((50, 16)), rand((16, 32)), rand((32,)), rand((32, 16)), rand((16,)))
    _check(mlp.run(*args, BM=16), mlp.reference(*args), factor=8.0)


def test_memory_hierarchy_examples():
    mh = example("memory_hierarchy")
    a = rand((50, 70))
    _check(mh.run_memory_hierarchy(a, T=16), mh.reference_memory_hierarchy(a, T=16))
    out = mh.run_optimized_memory_access(a, TILE_M=16, TILE_N=32, ROWS=4)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(a))


def _gpu_twin(test):
    """``test`` again under ``-m gpu``: the kernels compiled by Pallas' Triton backend."""

    @functools.wraps(test)
    def twin(*args, **kwargs):
        return test(*args, **kwargs)

    twin.pytestmark = [*getattr(test, "pytestmark", []), pytest.mark.gpu]
    return twin


test_saxpy_gpu = _gpu_twin(test_saxpy)
test_scale_and_group_sum_gpu = _gpu_twin(test_scale_and_group_sum)
test_warp_and_cooperative_reductions_gpu = _gpu_twin(test_warp_and_cooperative_reductions)
test_gemms_ragged_gpu = _gpu_twin(test_gemms_ragged)
test_flash_attention_and_fused_mlp_gpu = _gpu_twin(test_flash_attention_and_fused_mlp)
test_memory_hierarchy_examples_gpu = _gpu_twin(test_memory_hierarchy_examples)


# --- semantics ----------------------------------------------------------------------------


@ts.kernel
def _every_other(X, Out: ts.mut):
    i = ts.launch.thread_id()
    ts.tile.store(Out, i, 2 * ts.tile.load(X, i), mask=i % 2 == 0)


def test_mut_keeps_unstored_values_and_does_not_mutate_the_callers_array():
    x, old = rand((37,)), rand((37,))
    before = np.asarray(old).copy()
    out = _every_other[ts.ceil_div(37, 16), 16](x, old)
    even = np.arange(37) % 2 == 0
    ref = np.where(even, 2 * np.asarray(x, np.float64), before)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(old), before)  # JAX is functional


@ts.kernel
def _two_outputs(X, Lo: ts.mut, Hi: ts.mut, *, cut: float):
    i = ts.launch.thread_id()
    v = ts.tile.load(X, i)
    Lo[i] = ts.tile.where(v < cut, v, 0.0)
    Hi[i] = ts.tile.where(v < cut, 0.0, v)


def test_several_muts_jit_and_vmap():
    x = rand((4, 40))
    z = jnp.zeros((40,), jnp.float32)

    def f(row):
        return _two_outputs[ts.ceil_div(40, 32), 32](row, z, z, cut=0.25)

    lo, hi = jax.jit(jax.vmap(f))(x)
    xn = np.asarray(x)
    np.testing.assert_array_equal(np.asarray(lo), np.where(xn < 0.25, xn, 0))
    np.testing.assert_array_equal(np.asarray(hi), np.where(xn < 0.25, 0, xn))


@ts.kernel
def _rowsum(X, Out: ts.mut, *, BK: int):
    r = ts.tile.group_id()
    acc = 0.0  # a Python scalar initialiser takes the loop's shape (BK,)
    for k in ts.tile.range(0, X.shape[1], BK):
        acc += ts.tile.load(X, (r, ts.tile.lanes(k, BK)))
    Out[r] = ts.tile.reduce_sum(acc)


def test_tile_range_is_one_loop():
    """The K loop is one loop in the kernel (the pipeliner's ``scf.for``), not unrolled."""
    x = rand((3, 50))
    run = ts.launch.grid(blocks=(3,), threads=(16,))(_rowsum)
    out = run(x, jnp.zeros((3,), jnp.float32), BK=16)
    _check(out, np.asarray(x, np.float64).sum(1))
    text = str(jax.make_jaxpr(lambda a: run(a, jnp.zeros((3,), jnp.float32), BK=16))(x))
    body = text[text.index("pallas_call") :]
    assert len(re.findall(r"\b(while|scan)\[", body)) == 1, body
    assert body.count("reduce_sum") == 1


@ts.kernel
def _deferred_copies(X, n, Out: ts.mut):
    a = ts.tile.alloc_shared((16,), X.dtype)  # prefetched: X[k:k + 16] in iteration k
    b = ts.tile.alloc_shared((16,), X.dtype)  # X[32:48] first, then the previous step's
    c = ts.tile.alloc_shared((16,), X.dtype)  # copied, then read, in each iteration
    ts.tile.cp_async(a, X[0:16])
    ts.tile.cp_async(b, X[32:48])
    acc = ts.tile.zeros((16,), jnp.float32)
    for k in ts.tile.range(0, 64, 16):
        acc += a + 2 * b.astype(jnp.float32)
        ts.tile.cp_async(c, X[k + 8 : k + 24])
        acc += 3 * c.astype(jnp.float32)
        ts.tile.cp_async(a, X[k + 16 : k + 32])
        ts.tile.cp_async(b, X[k : k + 16])
    Out[0, 0:16] = acc
    Out[1, 0:16] = c  # the last iteration's copy
    Out[2, 0:16] = a  # the copy the last iteration prefetched (past X's end: zeros)
    ts.tile.cp_async(a, X[0:16])
    acc = ts.tile.zeros((16,), jnp.float32)
    for k in ts.tile.range(0, n, 16):  # the same with a traced trip count
        acc += a + 2 * b.astype(jnp.float32)
        ts.tile.cp_async(c, X[k + 8 : k + 24])
        acc += 3 * c.astype(jnp.float32)
        ts.tile.cp_async(a, X[k + 16 : k + 32])
        ts.tile.cp_async(b, X[k : k + 16])
    Out[3, 0:16] = acc
    Out[4, 0:16] = a
    ts.tile.cp_async(c, Out[3, 0:16])  # from an output the kernel stores to: copied here
    Out[3, 0:16] = ts.tile.zeros((16,), jnp.float32)
    Out[5, 0:16] = c


def _deferred_copies_reference(x, n):
    xp = np.zeros(128)
    xp[: x.size] = x
    window = lambda s: xp[s : s + 16]
    out, b = np.zeros((6, 16)), window(32)
    for row, a_row, trips in ((0, 2, 4), (3, 4, n // 16)):
        acc = np.zeros(16)
        for j in range(trips):
            acc += window(16 * j) + 2 * b + 3 * window(16 * j + 8)
            b = window(16 * j)
        out[row], out[a_row] = acc, window(16 * trips)
    out[1] = window(56)
    out[5], out[3] = out[3], 0
    return out


def test_deferred_copies():
    """``cp_async`` from an input is performed where the tile is read, and a loop carries a
    prefetched copy as its index: the same values as copying at once, for a copy the loop
    prefetches (ragged: the last prefetch runs past X), one it overwrites, one whose first
    value comes from elsewhere, with static and traced trip counts; a copy from an output
    is performed at once."""
    x = rand((72,))
    for n in (64, 0):
        out = _deferred_copies[1, 16](x, jnp.int32(n), jnp.zeros((6, 16), jnp.float32))
        _check(out, _deferred_copies_reference(np.asarray(x, np.float64), n))


test_deferred_copies_gpu = _gpu_twin(test_deferred_copies)


def test_double_buffered_gemm_carries_no_tiles():
    """The double-buffered GEMM's K loop carries its accumulator, not its four shared
    tiles: each copy is a load the GPU compiler pipelines, issued where its tile is read."""
    m = example("pipelined_gemm")
    a, b = rand((64, 128), jnp.bfloat16), rand((128, 64), jnp.bfloat16)
    closed = jax.make_jaxpr(lambda a, b: m.run(a, b, BM=32, BN=32, BK=32))(a, b)

    def loops(jaxpr):  # the carry counts of the loops in jaxpr, nested ones included
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                yield _compat.scan_carry_count(eqn)
            for v in eqn.params.values():
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    yield from loops(inner)

    found = list(loops(closed.jaxpr))
    assert found == [2], found  # the iteration count and the f32 accumulator


# --- errors -------------------------------------------------------------------------------


@ts.kernel
def _if_on_tile(X, Out: ts.mut):
    i = ts.launch.thread_id()
    if i < X.shape[0]:
        Out[i] = X[i]


@ts.kernel
def _python_loop(X, Out: ts.mut):
    for k in range(ts.tile.group_id()):
        Out[k] = 1.0


@ts.kernel
def _never_stored(X, Out: ts.mut):
    ts.tile.load(X, ts.launch.thread_id())


@ts.kernel
def _small_dot(A, Out: ts.mut):
    Out[0:8, 0:8] = ts.tile.dot(A[0:8, 0:8], A[0:8, 0:8])


@ts.kernel
def _dynamic_window(X, Out: ts.mut):
    g = ts.tile.group_id()
    Out[0:16] = X[g : 2 * g]


@ts.kernel
def _stores_an_input(X, Out: ts.mut):
    Out[0:16] = X[0:16]
    X[0:16] = 0.0


@ts.kernel
def _shape_change(X, Out: ts.mut):
    acc = ts.tile.zeros((1,), jnp.float32)
    for k in ts.tile.range(0, 32, 16):
        acc = acc + ts.tile.load(X, ts.tile.lanes(k, 16))
    Out[0:16] = acc


def _line(fn, text):
    src, first = __import__("inspect").getsourcelines(fn)
    return first + next(i for i, s in enumerate(src) if text in s)


@pytest.mark.parametrize(
    "kern, exc, pattern, line",
    [
        (_if_on_tile, TypeError, r"`if` .* on a tile value.*mask=.*ts\.tile\.where", "if i <"),
        (
            _python_loop,
            TypeError,
            r"range\(\.\.\.\)` over a traced bound.*ts\.tile\.range",
            "for k",
        ),
        (_never_stored, ValueError, r"ts\.mut parameter 'Out' is never stored", None),
        (_small_dot, ValueError, r"extent below 16", "ts.tile.dot"),
        (_dynamic_window, ValueError, r"no static size.*start:start \+ SIZE", "X[g"),
        (_stores_an_input, TypeError, r"'X' is an input.*`X: ts\.mut`", "X[0:16] = 0"),
        (
            _shape_change,
            TypeError,
            r"'acc' is float32\[1\] before the loop and float32\[16\]",
            "for k",
        ),
    ],
)
def test_kernel_errors_name_the_kernel_and_line(kern, exc, pattern, line):
    x = rand((32, 32)) if kern is _small_dot else rand((32,))
    with pytest.raises(exc, match=pattern) as e:
        kern[2, 16](x, jnp.zeros_like(x))
    assert f"kernel '{kern.name}'" in str(e.value)
    if line is not None:
        assert f"{__file__}:{_line(kern.fn, line)}" in str(e.value), str(e.value)


def test_launch_errors():
    x = rand((32,))
    with pytest.raises(
        TypeError, match=r"kernel '_every_other' takes 2 arguments \(X, Out: ts\.mut\), got 3"
    ):
        _every_other[2, 16](x, x, x)
    with pytest.raises(TypeError, match=r"ts\.mut parameter 'Out' got float"):
        _every_other[2, 16](x, 1.0)
    with pytest.raises(ValueError, match=r"threads=\(24,\) must be powers of two"):
        _every_other[2, 24](x, x)
    with pytest.raises(ValueError, match=r"blocks=\(0,\)"):
        ts.launch.grid(blocks=(0,), threads=(16,))
    with pytest.raises(TypeError, match=r"is launched over a grid"):
        _every_other(x, x)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['BK'\]"):
        _every_other[2, 16](x, x, BK=4)
    with pytest.raises(RuntimeError, match=r"only inside a kernel"):
        ts.tile.group_id()


test_mut_keeps_unstored_values_gpu = _gpu_twin(
    test_mut_keeps_unstored_values_and_does_not_mutate_the_callers_array
)
test_several_muts_jit_and_vmap_gpu = _gpu_twin(test_several_muts_jit_and_vmap)


# --- autotuning ---------------------------------------------------------------------------


def test_autotuned_kernel_tunes_once_per_key(monkeypatch):
    """The first launch for a shape searches (``BM`` here; ``stages`` given), the next one
    reuses the winner; ``ts.autotune.search`` on the launch prunes a tile that cannot fit
    shared memory before compiling it, and a second search comes from the cache."""
    ax = example("axpy_tiled")
    calls = []
    real = ts.autotune.search
    monkeypatch.setattr(ts.autotune, "search", lambda **kw: calls.append(kw) or real(**kw))
    x, y = rand((700,), jnp.float16), rand((700,), jnp.float16)
    for _ in range(2):
        out = ax.run(x, y, 0.5, stages=2)
        assert_close(out, ax.reference(x, y, 0.5), jnp.float16, factor=2.0)
    assert len(calls) == 1 and calls[0]["params"] == {"BM": [128, 256]}
    space = dict(BM=[128, 1 << 20], stages=[2])
    first = real(kernel=ax.launch(x.shape[0]), args=(x, y, 0.5), params=space, progress=False)
    assert first == {"BM": 128, "stages": 2} and not first.report.cached
    ((config, reason),) = first.report.pruned
    assert config["BM"] == 1 << 20 and "shared memory" in reason
    again = real(kernel=ax.launch(x.shape[0]), args=(x, y, 0.5), params=space, progress=False)
    assert again == first and again.report.cached


def test_autotune_space_must_name_keyword_only_parameters():
    with pytest.raises(TypeError, match=r"tuned through a launch"):
        ts.autotune.search(kernel=_every_other, args=(rand((8,)),), params=dict(BM=[1]))
    with pytest.raises(ValueError, match=r"no keyword-only parameters \['BM'\]"):

        @ts.kernel.autotune(space=dict(BM=[64]))
        def k(X, Out: ts.mut):
            Out[0] = X[0]


def test_fresh_output_from_a_shape():
    """A ``ts.mut`` given as a ShapeDtypeStruct is an output with no input to alias."""
    m = example("saxpy")
    x, y = rand((300,)), rand((300,))
    out = m.saxpy[3, 128](2.0, x, y, jax.ShapeDtypeStruct((300,), jnp.float32))
    _check(out, m.reference(2.0, x, y))
    with pytest.raises(TypeError, match=r"argument 'X' is a ShapeDtypeStruct"):
        m.saxpy[3, 128](2.0, jax.ShapeDtypeStruct((300,), jnp.float32), y, x)


def test_launch_inside_index_launch():
    """Seed 002 §4.4: a kernel launched once per partition of a mesh axis (shard_map)."""
    m = example("saxpy")
    mesh = ts.dist.mesh(axes=("dp",))
    x, y = rand((8 * 40,)), rand((8 * 40,))
    spec = ts.ShardSpec((0,), ("dp",))
    X = ts.dist.tensor(x.shape, spec, mesh, "f32", x)
    Y = ts.dist.tensor(y.shape, spec, mesh, "f32", y)

    @ts.index_launch(axis="dp", mesh=mesh)
    def part(xp, yp):  # each part (40 elements on 8 devices) in ragged groups of 64 lanes
        return m.saxpy[ts.ceil_div(xp.shape[0], 64), 64](2.0, xp, yp, jnp.zeros_like(xp))

    _check(part(X.parts("dp"), Y.parts("dp")), m.reference(2.0, x, y))


test_launch_inside_index_launch_gpu = _gpu_twin(test_launch_inside_index_launch)


def test_vmap_inside_index_launch(monkeypatch):
    """``vmap`` of a launch per partition: the batch (axis 1 of ``X``, with the traced scalar
    ``a`` batched too and ``Y`` shared) is a grid axis; past the grid's limit, or for an
    empty batch, a loop of launches with the same results."""
    m = example("saxpy")
    mesh = ts.dist.mesh(axes=("dp",))
    n = 8 * 24
    x, y, a = rand((n, 3)), rand((n,)), rand((3,))
    spec = ts.ShardSpec((0,), ("dp",))
    X = ts.dist.tensor(x.shape, spec, mesh, "f32", x)
    Y = ts.dist.tensor(y.shape, spec, mesh, "f32", y)
    ref = np.asarray(a, np.float64) * np.asarray(x, np.float64) + np.asarray(y, np.float64)[:, None]

    def launch(batch):
        @ts.index_launch(axis="dp", mesh=mesh, out=ts.ShardSpec((1,), ("dp",)))
        def part(xp, yp, a):
            groups = ts.ceil_div(yp.shape[0], 32)  # a part's size depends on the device count
            one = lambda a, r: m.saxpy[groups, 32](a, r, yp, jnp.zeros_like(yp))
            return jax.vmap(one, in_axes=(0, 1))(a[:batch], xp[:, :batch])

        return part(X.parts("dp"), Y.parts("dp"), a)

    _check(launch(3), ref.T)
    monkeypatch.setattr(tile_lowering, "MAX_PROGRAMS", 2)  # past 3 batched launches: a loop
    _check(launch(3), ref.T)
    assert launch(0).shape == (0, n)


test_vmap_inside_index_launch_gpu = _gpu_twin(test_vmap_inside_index_launch)


test_tile_range_is_one_loop_gpu = _gpu_twin(test_tile_range_is_one_loop)


@ts.kernel
def _prefix_sum(X, n, Out: ts.mut):
    acc = ts.tile.zeros((16,), jnp.float32)
    for k in ts.tile.range(0, n, 16):  # a traced trip count
        j = ts.tile.lanes(k, 16)
        acc += ts.tile.load(X, j, mask=j < n)
    Out[0] = ts.tile.reduce_sum(acc)


def test_tile_range_with_a_traced_bound():
    x = rand((100,))
    for n in (37, 100):
        out = _prefix_sum[1, 16](x, jnp.int32(n), jnp.zeros((1,), jnp.float32))
        _check(out, np.asarray(x, np.float64)[:n].sum(keepdims=True))


test_tile_range_with_a_traced_bound_gpu = _gpu_twin(test_tile_range_with_a_traced_bound)


@ts.kernel
def _geometry(Out: ts.mut):
    tid = ts.launch.thread_id()
    g = ts.tile.cooperative_group(16)
    g.sync()
    Out[0, tid] = tid
    Out[1, tid] = ts.tile.lane_id()
    Out[2, tid] = g.thread_rank()
    Out[3, tid] = ts.tile.where(ts.tile.local_id() < 1, ts.tile.linear_id(), -1)
    w = ts.tile.warp_id()
    Out[4, w] = ts.tile.warp_lane(ts.tile.local_id() * 10, 1)  # lane 1 of each warp


def test_lane_geometry():
    out = np.asarray(_geometry[2, 64](jnp.full((5, 128), -7, jnp.int32)))
    lane = np.arange(128)
    np.testing.assert_array_equal(out[0], lane)
    np.testing.assert_array_equal(out[1], lane % 32)
    np.testing.assert_array_equal(out[2], lane % 16)
    np.testing.assert_array_equal(out[3], np.where(lane % 64 == 0, lane // 64, -1))
    np.testing.assert_array_equal(out[4, :4], [10, 330, 10, 330])  # local ids 1, 33 per group
    np.testing.assert_array_equal(out[4, 4:], -7)  # never stored: the input's values


SHUFFLE_OFFSETS = (0, 1, 3, 8, 16, 31)


@ts.kernel
def _shuffles(X, H, U, Out: ts.mut, OutH: ts.mut, OutU: ts.mut):
    tid = ts.launch.thread_id()
    v, h, u = ts.tile.load(X, tid), ts.tile.load(H, tid), ts.tile.load(U, tid)
    for row, offset in enumerate(SHUFFLE_OFFSETS):
        Out[row, tid] = ts.tile.warp_shuffle_down(v, offset)
    OutH[0, tid] = ts.tile.warp_shuffle_down(h, 3)  # other widths: one offset of two rotations
    OutU[0, tid] = ts.tile.warp_shuffle_down(u, 3)
    w = ts.tile.warp_id()
    Out[len(SHUFFLE_OFFSETS), w] = ts.tile.warp_lane(v, 5)


def test_warp_shuffle_down_every_offset_kind():
    """Power-of-two offsets, others and 0 (the identity), on f32 (NaN, ±0 and ∞ among the
    values), f16 and uint8: lane l reads lane l + offset of its warp, or keeps its own value
    past the warp's end, bit for bit; ``warp_lane`` picks one lane of each warp."""
    x = np.array(rand((128,)))
    x[[3, 40, 77, 100]] = [np.nan, -0.0, np.inf, -np.inf]
    h = np.asarray(rand((128,), jnp.float16))
    u = np.random.default_rng(0).integers(0, 256, 128, dtype=np.uint8)
    rows = len(SHUFFLE_OFFSETS)
    outs = _shuffles[2, 64](
        jnp.asarray(x),
        jnp.asarray(h),
        jnp.asarray(u),
        jnp.zeros((rows + 1, 128), jnp.float32),
        jax.ShapeDtypeStruct((1, 128), jnp.float16),
        jax.ShapeDtypeStruct((1, 128), jnp.uint8),
    )
    lane = np.arange(128)
    bits = lambda a: np.asarray(a).view(f"u{np.asarray(a).itemsize}")
    src = lambda offset: np.where(lane % 32 + offset < 32, lane + offset, lane)
    for row, offset in enumerate(SHUFFLE_OFFSETS):
        np.testing.assert_array_equal(bits(outs[0][row]), bits(x[src(offset)]))
    np.testing.assert_array_equal(bits(outs[1][0]), bits(h[src(3)]))
    np.testing.assert_array_equal(outs[2][0], u[src(3)])
    np.testing.assert_array_equal(bits(outs[0][rows, :4]), bits(x[5::32]))


test_warp_shuffle_down_every_offset_kind_gpu = _gpu_twin(test_warp_shuffle_down_every_offset_kind)
