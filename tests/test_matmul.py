"""ts.matmul / ts.op.linear / ts.op.fused_mlp: float64 references for every dtype, adjoints
(2nd order for the plain product), vmap/jit compositions, the jaxpr, every bad input."""

# ts.Tensor["M", "K", ...] names dimensions with strings, which ruff reads as forward
# references (F821 undefined name), as with jaxtyping.
# ruff: noqa: F821

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend.core import ClosedJaxpr
from jax.test_util import check_grads

import tessera_jax as ts
from tessera_jax.contracts.matmul import MatmulSpec
from tessera_jax.numerics.context import accumulation
from tessera_jax.primitives.matmul import (
    matmul_op,
    matmul_reference,
    matmul_with_derivative_op,
)
from tests._util import (
    f64,
    np_activation,
    np_activation_derivative,
    rand,
    rel_err,
    sample,
    sample_grid,
)

F8E4, F8E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = np.dtype(np.float32)


def eps(dtype) -> float:
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return 0.0
    return float(jnp.finfo(dtype).eps)


def tol(out_dtype, acc_dtype, k: int) -> float:
    """Norm-wise relative error bound against a float64 product of the (already rounded)
    inputs: one rounding to the output plus an accumulation error growing like sqrt(K)."""
    return eps(out_dtype) + 2 * eps(acc_dtype) * np.sqrt(max(k, 1))


def assert_matmul_close(out, ref, out_dtype, acc_dtype, k, factor=1.0, magnitude=None):
    """``magnitude``: ``|A|·|B|`` in float64, for products whose few outputs may cancel
    (a dot product's error is bounded relative to it, not to the result)."""
    if jnp.issubdtype(np.dtype(out_dtype), jnp.integer):
        np.testing.assert_array_equal(np.asarray(out).astype(np.int64), ref.astype(np.int64))
        return
    assert np.all(np.isfinite(f64(out)))
    err = rel_err(out, ref)
    if magnitude is not None:
        err = float(np.linalg.norm((f64(out) - ref).ravel()) / np.linalg.norm(magnitude.ravel()))
    bound = tol(out_dtype, acc_dtype, k) * factor
    assert err <= bound, f"relative error {err:.3e} > {bound:.3e} ({out_dtype}, K={k})"


def operand(shape, dtype):
    if np.dtype(dtype) == np.int8:
        return jax.random.randint(jax.random.key(len(shape) + sum(shape)), shape, -127, 128).astype(
            jnp.int8
        )
    return rand(shape, dtype)


def ref_matmul(a, b):
    """float64 (int64 for integers) product of the stored values, with numpy's batching."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.matmul(np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64))
    return np.matmul(f64(a), f64(b))


# dtype pair -> (default output, accumulate)
DTYPES = {
    "float16": (jnp.float16, jnp.float16, jnp.float16, jnp.float32),
    "bfloat16": (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.float32),
    "float32": (jnp.float32, jnp.float32, jnp.float32, jnp.float32),
    "e4m3": (F8E4, F8E4, jnp.float32, jnp.float32),
    "e5m2": (F8E5, F8E5, jnp.float32, jnp.float32),
    "e4m3xe5m2": (F8E4, F8E5, jnp.float32, jnp.float32),
    "e5m2xe4m3": (F8E5, F8E4, jnp.float32, jnp.float32),
    "int8": (jnp.int8, jnp.int8, jnp.int32, jnp.int32),
}
SHAPES = [(1, 1, 1), (17, 33, 9), (64, 128, 32), (200, 136, 96)]


@pytest.mark.parametrize(*sample_grid(8, name=sorted(DTYPES), mkn=SHAPES))
def test_values_and_dtypes_match_float64(name, mkn):
    da, db, out_dt, acc_dt = DTYPES[name]
    m, k, n = mkn
    a, b = operand((m, k), da), operand((k, n), db)
    out = ts.matmul(a, b)
    assert out.shape == (m, n) and out.dtype == np.dtype(out_dt)
    assert_matmul_close(out, ref_matmul(a, b), out_dt, acc_dt, k)
    assert_matmul_close(jax.jit(ts.matmul)(a, b), ref_matmul(a, b), out_dt, acc_dt, k)
    eqn = jax.make_jaxpr(ts.matmul)(a, b).jaxpr.eqns[0]
    assert eqn.params["spec"].accumulate_dtype == np.dtype(acc_dt)


@pytest.mark.parametrize(
    "mkn", sample([(4, 2, 4), (4, 6, 4), (8, 13, 8), (17, 33, 9), (3, 63, 3)], 3)
)
def test_int8_contraction_sizes_off_multiples_of_4(mkn):
    # XLA's GPU Triton GEMM fusion returned twice the product for these (see _dot); the
    # reference zero-pads K. On the CPU this runs the padding path.
    m, k, n = mkn
    a, b = operand((m, k), jnp.int8), operand((k, n), jnp.int8)
    f = jax.jit(lambda a, b: (ts.matmul(a, b), ts.matmul(jnp.stack([a, a]), b)[1]))
    for out in f(a, b):
        np.testing.assert_array_equal(np.asarray(out), ref_matmul(a, b))


def test_float64(x64):
    a, b = rand((200, 136), jnp.float64), rand((136, 96), jnp.float64)
    out = ts.matmul(a, b)
    assert out.dtype == jnp.float64
    assert_matmul_close(out, ref_matmul(a, b), jnp.float64, jnp.float64, 136)
    eqn = jax.make_jaxpr(ts.matmul)(a, b).jaxpr.eqns[0]
    assert eqn.params["spec"].accumulate_dtype == np.float64


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((3, 20, 24), (3, 24, 16)),  # batched
        ((2, 3, 20, 24), (2, 3, 24, 16)),  # two batch dims
        ((2, 3, 20, 24), (24, 16)),  # shared B
        ((20, 24), (2, 3, 24, 16)),  # shared A
        ((4, 1, 24), (4, 24, 1)),  # degenerate rows / columns
    ],
)
@pytest.mark.parametrize("dtype", sample([jnp.float32, jnp.bfloat16], 1))
def test_batched_and_shared_operands(sa, sb, dtype):
    a, b = rand(sa, dtype), rand(sb, dtype)
    out = ts.matmul(a, b)
    ref = ref_matmul(a, b)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_matmul_close(out, ref, dtype, jnp.float32, sa[-1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, F8E4])
def test_transposed_inputs_are_just_arrays(dtype):
    a, b = rand((24, 20), dtype), rand((16, 24), dtype)  # stored transposed
    out_dt = jnp.float32 if dtype == F8E4 else dtype
    ref = ref_matmul(a.T, b.T)
    for x, y, r in [(a.T, b.T, ref), (a.T, b[:, :].T, ref)]:
        assert_matmul_close(ts.matmul(x, y), r, out_dt, jnp.float32, 24)
    batched = rand((3, 24, 20), dtype)
    assert_matmul_close(
        ts.matmul(jnp.swapaxes(batched, -1, -2), b.T),
        ref_matmul(jnp.swapaxes(batched, -1, -2), b.T),
        out_dt,
        jnp.float32,
        24,
    )


def flag_operands(ta, tb, layout, m, k, n, lead, dtype=jnp.float32):
    """``a``, ``b`` stored as the transpose flags say, batched by ``layout``: both
    (``batched``), neither (``2d``) or one of them (``shared_a``: a 2-D ``a``)."""
    la = () if layout in ("2d", "shared_a") else lead
    lb = () if layout in ("2d", "shared_b") else lead
    a = rand((*la, *((k, m) if ta else (m, k))), dtype)
    b = rand((*lb, *((n, k) if tb else (k, n))), dtype)
    return a, b


@pytest.mark.parametrize(
    *sample_grid(
        3, ta=[False, True], tb=[False, True], layout=["2d", "batched", "shared_a", "shared_b"]
    )
)
def test_primitive_transpose_flags(ta, tb, layout):
    """The flags are dimension numbers of the reference; the adjoints rely on them."""
    m, k, n = 7, 11, 5
    a, b = flag_operands(ta, tb, layout, m, k, n, lead=(2, 3))
    spec = MatmulSpec(F32, F32, transpose_a=ta, transpose_b=tb)
    out = matmul_op.bind(a, b, spec=spec)
    sw = lambda x, t: np.swapaxes(x, -1, -2) if t else x
    ref = np.matmul(sw(f64(a), ta), sw(f64(b), tb))
    assert out.shape == ref.shape
    assert_matmul_close(out, ref, jnp.float32, jnp.float32, k)
    np.testing.assert_allclose(
        np.asarray(matmul_reference(a, b, spec=spec)), np.asarray(out), rtol=1e-6, atol=1e-6
    )


def test_out_dtype():
    a, b = rand((16, 32), jnp.bfloat16), rand((32, 8), jnp.bfloat16)
    out = ts.matmul(a, b, out_dtype=ts.f32)
    assert out.dtype == jnp.float32
    assert_matmul_close(out, ref_matmul(a, b), jnp.float32, jnp.float32, 32)
    a8, b8 = rand((16, 32), F8E4), rand((32, 8), F8E5)
    assert ts.matmul(a8, b8, out_dtype="bfloat16").dtype == jnp.bfloat16
    i8 = operand((16, 32), jnp.int8), operand((32, 8), jnp.int8)
    out = ts.matmul(*i8, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), ref_matmul(*i8).astype(np.float32))


def test_accumulation_context_sets_the_accumulate_dtype():
    a, b = rand((8, 16), jnp.float16), rand((16, 4), jnp.float16)
    with accumulation(ts.f16):
        eqn = jax.make_jaxpr(ts.matmul)(a, b).jaxpr.eqns[0]
    assert eqn.params["spec"].accumulate_dtype == np.float16
    with accumulation(ts.f16):  # never narrower than the inputs
        eqn = jax.make_jaxpr(ts.matmul)(rand((8, 16)), rand((16, 4))).jaxpr.eqns[0]
    assert eqn.params["spec"].accumulate_dtype == np.float32


def test_seed_mixed_precision_gemm_under_ts_jit():
    """Seed 003: FP8 inputs, FP32 accumulation and output."""

    @ts.jit
    def mixed_precision_gemm(
        A: ts.Tensor["M", "K", ts.fp8_e4m3 @ ts.accum(ts.f32)],
        B: ts.Tensor["K", "N", ts.fp8_e4m3 @ ts.accum(ts.f32)],
    ) -> ts.Tensor["M", "N", ts.f32]:
        return ts.gemm(A, B)

    a, b = rand((32, 64), F8E4), rand((64, 16), F8E4)
    out = mixed_precision_gemm(a, b)
    assert out.dtype == jnp.float32
    assert_matmul_close(out, ref_matmul(a, b), jnp.float32, jnp.float32, 64)


# --- tile_shape ---------------------------------------------------------------------------


def test_tile_shape_is_a_primitive_param():
    a, b = rand((128, 64)), rand((64, 128))
    for fn in (ts.matmul, ts.gemm, ts.op.matmul, ts.op.gemm):
        jaxpr = jax.make_jaxpr(lambda a, b, fn=fn: fn(a, b, tile_shape=(128, 128, 64)))(a, b)
        (eqn,) = jaxpr.jaxpr.eqns
        assert eqn.primitive.name == "ts_matmul"
        assert eqn.params["spec"].tile_shape == (128, 128, 64)
    out = ts.op.matmul(a, b, tile_shape=[64, 64, 32])
    assert_matmul_close(out, ref_matmul(a, b), jnp.float32, jnp.float32, 64)


@pytest.mark.parametrize(
    "tile,what",
    [
        ((128, 128), "must be 3 ints"),
        ((128, 128, 64, 1), "must be 3 ints"),
        ("128", "must be 3 ints"),
        ((128.0, 128, 64), "must be 3 ints"),
        ((True, 128, 64), "must be 3 ints"),
        ((0, 128, 64), "BM=0"),
        ((128, 0, 64), "BN=0"),
        ((128, 128, -16), "BK=-16"),
    ],
)
@pytest.mark.parametrize("fn", ["matmul", "linear", "fused_mlp"])
def test_bad_tile_shape_form(tile, what, fn):
    """The operator checks the form only (3 positive ints), in every kernel mode."""
    x, w, b = rand((32, 32)), rand((32, 32)), rand((32,))
    call = {
        "matmul": lambda: ts.matmul(x, w, tile_shape=tile),
        "linear": lambda: ts.op.linear(x, w, tile_shape=tile),
        "fused_mlp": lambda: ts.op.fused_mlp(x, w, b, w, b, tile_shape=tile),
    }[fn]
    with pytest.raises(ValueError, match=re.escape(what)) as e:
        call()
    assert str(e.value).startswith(f"{fn}: tile_shape=")


@pytest.mark.parametrize(
    *sample_grid(
        2, mode=["auto", "xla", "interpret"], tile=[(32, 32, 32), (48, 16, 100), (64, 128, 64)]
    )
)
def test_any_tile_shape_runs_outside_pallas_mode(mode, tile):
    """A tile no kernel can run (the Hopper kernel needs BM a multiple of 64, the portable
    kernel powers of two) is not an error outside ``pallas`` mode: another kernel or the
    reference runs the product."""
    a, b = rand((2, 40, 72), jnp.bfloat16), rand((72, 24), jnp.bfloat16)
    bias = rand((24,), jnp.float32)
    with ts.kernel_mode(mode):
        out = jax.jit(lambda a, b: ts.matmul(a, b, tile_shape=tile))(a, b)
        lin = ts.op.linear(a, b, bias, activation="relu", tile_shape=tile)
    assert out.dtype == jnp.bfloat16
    assert_matmul_close(out, ref_matmul(a, b), jnp.bfloat16, jnp.float32, 72)
    ref = np.maximum(ref_matmul(a, b) + f64(bias), 0)
    assert_matmul_close(lin, ref, jnp.bfloat16, jnp.float32, 72, factor=2)


@pytest.mark.parametrize(
    "dtype,tile,kernel",
    [
        (jnp.bfloat16, (32, 32, 32), "pallas_portable"),  # BM=32: not a wgmma tile
        (jnp.bfloat16, (128, 128, 64), "mosaic_gpu"),
        (jnp.float32, (64, 64, 64), "pallas_portable"),  # f32: not a Hopper kernel dtype
        (jnp.bfloat16, (48, 64, 64), "reference"),  # no kernel runs BM=48
    ],
)
def test_interpret_mode_selects_the_kernel_that_supports_the_tile(dtype, tile, kernel):
    avals = [jax.core.ShapedArray((128, 64), dtype), jax.core.ShapedArray((64, 96), dtype)]
    params = {"spec": MatmulSpec(dtype, F32, tile_shape=tile)}
    with ts.kernel_mode("interpret"):
        assert matmul_op.select("cpu", avals, params)[0] == kernel
        reasons = matmul_op.reasons("cpu", avals, params)
    assert (kernel == "reference") == (set(reasons) == {"mosaic_gpu", "pallas_portable"})


def test_interpret_mode_runs_the_portable_kernel_through_the_operator():
    a, b = rand((3, 40, 72), jnp.bfloat16), rand((72, 24), jnp.bfloat16)
    f = jax.jit(lambda a, b: ts.matmul(a, b, tile_shape=(32, 32, 32)))
    with ts.kernel_mode("interpret"):
        kernel_hlo = f.lower(a, b).as_text()
        out = f(a, b)
    with ts.kernel_mode("xla"):
        xla_hlo = f.lower(a, b).as_text()
    # The interpreted pallas_call is a loop over its grid; the reference is one dot.
    assert "stablehlo.while" in kernel_hlo and "stablehlo.while" not in xla_hlo
    assert_matmul_close(out, ref_matmul(a, b), jnp.bfloat16, jnp.float32, 72)


def test_grad_through_the_portable_kernel_in_interpret_mode():
    # linear with bias + gelu in f32 (a portable-kernel case): the two-output forward (y and
    # gelu'(z)) and the transposed products of the backward all run the kernel.
    x, w, b = rand((48, 32)), rand((32, 40), scale=0.2), rand((40,))

    def loss(x, w, b):
        return jnp.sum(ts.op.linear(x, w, b, activation="gelu", tile_shape=(16, 16, 16)) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with ts.kernel_mode("interpret"):
        eqns = _matmul_eqns(grad, x, w, b)
        names = {_OPS[e.primitive].select("cpu", *_avals_params(e))[0] for e in eqns}
        got = grad(x, w, b)
    assert [e.primitive for e in eqns].count(matmul_with_derivative_op.prim) == 1
    assert len(eqns) >= 3 and names == {"pallas_portable"}
    with ts.kernel_mode("xla"):
        want = grad(x, w, b)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype == jnp.float32
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


_OPS = {op.prim: op for op in (matmul_op, matmul_with_derivative_op)}


def _matmul_eqns(f, *args):
    """The ts_matmul (and two-output form) equations of ``f``'s jaxpr, nested ones included."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive in _OPS:
                out.append(e)
            for p in e.params.values():  # a jit's ClosedJaxpr
                if isinstance(p, ClosedJaxpr):
                    walk(p.jaxpr)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return out


def _avals_params(eqn):
    return [v.aval for v in eqn.invars], eqn.params


def test_pallas_mode_with_a_tile_no_kernel_runs_is_one_error():
    a, b = rand((64, 64), jnp.bfloat16), rand((64, 64), jnp.bfloat16)
    with ts.kernel_mode("pallas"):
        with pytest.raises(ValueError) as e:
            jax.jit(lambda a, b: ts.matmul(a, b, tile_shape=(48, 64, 64)))(a, b)
        # Without an explicit tile, pallas mode falls back to the reference.
        out = jax.jit(ts.matmul)(a, b)
    msg = str(e.value)
    assert msg.startswith("matmul: tile_shape=(48, 64, 64) was requested with TESSERA_KERNELS")
    assert "mosaic_gpu: " in msg and "pallas_portable: " in msg
    assert_matmul_close(out, ref_matmul(a, b), jnp.bfloat16, jnp.float32, 64)


# --- bad inputs ---------------------------------------------------------------------------


def test_contraction_mismatch_message():
    with pytest.raises(
        ValueError, match=re.escape("matmul: A.shape[-1]=5 must equal B.shape[-2]=6")
    ):
        ts.matmul(rand((4, 5)), rand((6, 3)))
    with pytest.raises(
        ValueError, match=re.escape("linear: x.shape[-1]=5 must equal w.shape[-2]=6")
    ):
        ts.op.linear(rand((4, 5)), rand((6, 3)))


ONE_D_SHAPES = [
    ((5,), (5, 3)),
    ((3, 5), (5,)),
    ((5,), (5,)),
    ((5,), (2, 4, 5, 3)),
    ((2, 4, 3, 5), (5,)),
    ((1,), (1, 1)),
]


@pytest.mark.parametrize(
    "sa,sb,dtype", sample([(*s, d) for s in ONE_D_SHAPES for d in (jnp.float32, jnp.bfloat16)], 4)
)
def test_one_dimensional_operands_as_jnp_matmul(sa, sb, dtype):
    a, b = rand(sa, dtype), rand(sb, dtype)
    out = ts.matmul(a, b)
    ref = np.matmul(f64(a), f64(b))
    assert out.shape == jnp.matmul(a, b).shape == ref.shape and out.dtype == dtype
    # A handful of outputs: one of them cancelling is likely, so the bound is taken
    # against |a|·|b|.
    magnitude = np.matmul(np.abs(f64(a)), np.abs(f64(b)))
    assert_matmul_close(out, ref, dtype, jnp.float32, sa[-1], magnitude=magnitude)


def test_rank_0_and_contraction_of_vectors_are_refused():
    with pytest.raises(ValueError, match=re.escape("matmul: A.shape=() has rank 0")):
        ts.matmul(jnp.float32(2.0), rand((5, 3)))
    with pytest.raises(ValueError, match=re.escape("matmul: B.shape=() has rank 0")):
        ts.matmul(rand((5, 3)), jnp.float32(2.0))
    with pytest.raises(ValueError, match=re.escape("A.shape[-1]=5 must equal B.shape[0]=4")):
        ts.matmul(rand((3, 5)), rand((4,)))
    with pytest.raises(ValueError, match=re.escape("linear: w.shape=(5,) has rank 1")):
        ts.op.linear(rand((3, 5)), rand((5,)))


BROADCAST_SHAPES = [
    ((2, 1, 4, 5), (3, 5, 6)),
    ((1, 4, 5), (3, 5, 6)),
    ((3, 4, 5), (1, 5, 6)),
    ((2, 3, 4, 5), (3, 5, 6)),
    ((4, 5), (2, 1, 5, 6)),
    ((1, 1, 4, 5), (5, 6)),
]


@pytest.mark.parametrize("sa,sb", sample(BROADCAST_SHAPES, 3))
def test_batch_dims_broadcast_as_jnp_matmul(sa, sb):
    a, b = rand(sa), rand(sb)
    out = ts.matmul(a, b)
    ref = ref_matmul(a, b)
    assert out.shape == ref.shape == jnp.matmul(a, b).shape
    assert_matmul_close(out, ref, jnp.float32, jnp.float32, sa[-1])
    names = [e.primitive.name for e in jax.make_jaxpr(ts.matmul)(a, b).jaxpr.eqns]
    assert names.count("ts_matmul") == 1
    lin = ts.op.linear(a, b)  # the same broadcasting for a batched weight
    assert lin.shape == ref.shape
    assert_matmul_close(lin, ref, jnp.float32, jnp.float32, sa[-1])


@pytest.mark.parametrize("sa,sb", [((2, 4, 5), (3, 5, 6)), ((2, 3, 4, 5), (2, 5, 6))])
def test_batch_dims_that_do_not_broadcast(sa, sb):
    msg = f"matmul: the batch dimensions of A.shape={sa} and B.shape={sb} do not broadcast"
    with pytest.raises(ValueError, match=re.escape(msg)):
        ts.matmul(rand(sa), rand(sb))
    with pytest.raises(ValueError, match=re.escape("linear: the batch dimensions of x.shape")):
        ts.op.linear(rand(sa), rand(sb))


@pytest.fixture
def standard_promotion():
    """jax's default dtype promotion, under which jnp.matmul mixes wide floats (the suite
    runs with strict promotion)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


MIXED = [
    (jnp.float32, jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.float32),
    (jnp.float16, jnp.bfloat16, jnp.float32),
    (jnp.float16, jnp.float32, jnp.float32),
]


@pytest.mark.parametrize("da,db,promoted", MIXED)
def test_mixed_wide_floats_promote_as_jnp_matmul(standard_promotion, da, db, promoted):
    a, b = rand((2, 20, 24), da), rand((24, 16), db)
    out = ts.matmul(a, b)
    assert out.dtype == jnp.matmul(a, b).dtype == promoted
    assert_matmul_close(out, ref_matmul(a, b), promoted, jnp.float32, 24)
    (eqn,) = [
        e for e in jax.make_jaxpr(ts.matmul)(a, b).jaxpr.eqns if e.primitive.name.startswith("ts_")
    ]
    assert eqn.params["spec"].accumulate_dtype == np.float32
    assert [v.aval.dtype for v in eqn.invars] == [np.dtype(promoted)] * 2
    bias = rand((16,), jnp.float32)
    lin = ts.op.linear(a, b, bias, activation="gelu")
    assert lin.dtype == promoted
    ref = np_activation(ref_matmul(a, b) + f64(bias), "gelu")
    assert_matmul_close(lin, ref, promoted, jnp.float32, 24, factor=2)


def test_mixed_float64_promotes(x64, standard_promotion):
    a, b = rand((6, 5), jnp.float32), rand((5, 4), jnp.float64)
    out = ts.matmul(a, b)
    assert out.dtype == jnp.float64
    assert_matmul_close(out, ref_matmul(a, b), jnp.float64, jnp.float64, 5)


def test_mixed_wide_floats_under_strict_promotion_are_refused():
    msg = "matmul: A.dtype=float32 and B.dtype=bfloat16 differ, and jax_numpy_dtype_promotion"
    with pytest.raises(TypeError, match=re.escape(msg)):
        ts.matmul(rand((4, 5)), rand((5, 3), jnp.bfloat16))


@pytest.mark.parametrize(
    "da,db",
    [(jnp.int8, jnp.float32), (jnp.float32, jnp.int8), (F8E4, jnp.bfloat16), (jnp.float32, F8E5)],
)
def test_fp8_and_int8_mix_only_with_their_kind(da, db):
    msg = f"A.dtype={np.dtype(da)} and B.dtype={np.dtype(db)} cannot be mixed"
    with pytest.raises(TypeError, match=re.escape(msg)):
        ts.matmul(operand((4, 5), da), operand((5, 3), db))


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.int32, jnp.bool_, jnp.uint8])
def test_unsupported_dtypes(dtype):
    a = jnp.ones((4, 5), dtype)
    with pytest.raises(TypeError, match=re.escape(f"A.dtype={np.dtype(dtype)} is not supported")):
        ts.matmul(a, a.T)


def test_bad_out_dtype():
    with pytest.raises(TypeError, match="out_dtype=int32 must be a float dtype"):
        ts.matmul(rand((4, 5)), rand((5, 3)), out_dtype=jnp.int32)
    with pytest.raises(TypeError, match="out_dtype"):
        ts.matmul(rand((4, 5)), rand((5, 3)), out_dtype="no-such-type")


def test_linear_bad_inputs():
    x, w = rand((4, 5)), rand((5, 3))
    with pytest.raises(ValueError, match=re.escape("linear: b.shape=(4,) must be (N,)=(3,)")):
        ts.op.linear(x, w, rand((4,)))
    with pytest.raises(TypeError, match="linear: b.dtype=int32 must be a float dtype"):
        ts.op.linear(x, w, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match=re.escape("residual.shape=(4, 4) must equal the output")):
        ts.op.linear(x, w, residual=rand((4, 4)))
    with pytest.raises(ValueError, match="activation='swish' must be one of"):
        ts.op.linear(x, w, activation="swish")
    with pytest.raises(ValueError, match="fused_mlp: activation='swish'"):
        ts.op.fused_mlp(x, w, rand((3,)), rand((3, 2)), rand((2,)), activation="swish")
    with pytest.raises(TypeError, match="linear: x=.x. must be an array"):
        ts.op.linear("x", w)


# --- linear / fused_mlp values ------------------------------------------------------------


@pytest.mark.parametrize(
    *sample_grid(
        12,
        activation=[None, "relu", "gelu", "gelu_tanh"],
        dtype=[jnp.float32, jnp.bfloat16, jnp.float16],
        xshape=[(200, 136), (2, 9, 136), (136,)],
    )
)
def test_linear_values(activation, dtype, xshape):
    x, w = rand(xshape, dtype), rand((136, 96), dtype, scale=0.1)
    b, r = rand((96,), jnp.float32), rand((*xshape[:-1], 96), dtype)
    out = ts.op.linear(x, w, b, activation=activation, residual=r)
    assert out.shape == (*xshape[:-1], 96) and out.dtype == dtype
    ref = np_activation(np.matmul(f64(x), f64(w)) + f64(b), activation) + f64(r)
    assert_matmul_close(out, ref, dtype, jnp.float32, 136, factor=2)
    jaxpr = jax.make_jaxpr(lambda *a: ts.op.linear(*a, activation=activation, residual=r))(x, w, b)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name.startswith("ts_")]
    assert eqn.primitive.name == "ts_matmul"
    spec = eqn.params["spec"]
    assert spec.has_bias and spec.has_residual and not spec.has_scale
    assert spec.activation == activation


def test_linear_with_batched_weights_and_int8():
    x, w = rand((3, 5, 8)), rand((3, 8, 4))
    assert_matmul_close(ts.op.linear(x, w), ref_matmul(x, w), jnp.float32, jnp.float32, 8)
    xi, wi = operand((6, 8), jnp.int8), operand((8, 4), jnp.int8)
    out = ts.op.linear(xi, wi, jnp.full((4,), 0.5, jnp.float32), activation="relu")
    assert out.dtype == jnp.float32  # int8 with a float epilogue
    np.testing.assert_array_equal(np.asarray(out), np.maximum(ref_matmul(xi, wi) + 0.5, 0))
    assert ts.op.linear(xi, wi).dtype == jnp.int32


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", None])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_mlp_values(activation, dtype):
    X, W1, b1 = rand((40, 64), dtype), rand((64, 96), dtype, scale=0.2), rand((96,), dtype)
    W2, b2 = rand((96, 24), dtype, scale=0.2), rand((24,), dtype)
    out = ts.op.fused_mlp(X, W1, b1, W2, b2, activation=activation)
    h = np_activation(np.matmul(f64(X), f64(W1)) + f64(b1), activation)
    h = f64(jnp.asarray(h).astype(dtype))  # the hidden layer is stored in the input dtype
    ref = np.matmul(h, f64(W2)) + f64(b2)
    assert out.dtype == dtype
    assert_matmul_close(out, ref, dtype, jnp.float32, 96, factor=2)
    eqns = jax.make_jaxpr(ts.op.fused_mlp)(X, W1, b1, W2, b2).jaxpr.eqns
    assert [e.primitive.name for e in eqns] == ["ts_matmul", "ts_matmul"]


# --- adjoints -----------------------------------------------------------------------------


GRAD_LAYOUTS = [
    ((5, 7), (7, 4)),
    ((3, 5, 7), (3, 7, 4)),
    ((2, 3, 5, 7), (7, 4)),  # shared B: its gradient sums over the batch
    ((5, 7), (3, 7, 4)),  # shared A
]


@pytest.mark.parametrize("sa,sb", sample(GRAD_LAYOUTS, 2))
def test_check_grads_order_2(x64, sa, sb):
    a, b = rand(sa, jnp.float64), rand(sb, jnp.float64)
    # Jitted: check_grads of an eager function compiles each operation of every derivative.
    check_grads(jax.jit(ts.matmul), (a, b), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("sa,sb", sample(GRAD_LAYOUTS, 2))
def test_check_grads_order_2_transposed_inputs(x64, sa, sb):
    a = rand((*sa[:-2], sa[-1], sa[-2]), jnp.float64)
    b = rand((*sb[:-2], sb[-1], sb[-2]), jnp.float64)
    f = lambda a, b: ts.matmul(jnp.swapaxes(a, -1, -2), jnp.swapaxes(b, -1, -2))
    check_grads(jax.jit(f), (a, b), order=2, modes=("fwd", "rev"))


# Every flag value with every layout, sampled rather than crossed (second-order checks are
# the suite's slowest).
FLAG_LAYOUTS = [
    (False, False, "2d"),
    (True, True, "2d"),
    (True, False, "batched"),
    (False, True, "batched"),
    (False, False, "shared_a"),
    (True, True, "shared_a"),
    (False, True, "shared_b"),
    (True, False, "shared_b"),
]


@pytest.mark.parametrize("ta,tb,layout", sample(FLAG_LAYOUTS, 2))
def test_check_grads_of_the_primitive_with_flags_and_scale(x64, ta, tb, layout):
    a, b = flag_operands(ta, tb, layout, 4, 6, 3, lead=(2,), dtype=jnp.float64)
    s = jnp.asarray(1.5, jnp.float64)
    spec = MatmulSpec(np.float64, np.float64, transpose_a=ta, transpose_b=tb, has_scale=True)

    def f(a, b, s):
        return matmul_op.bind(a, b, s, spec=spec)

    check_grads(jax.jit(f), (a, b, s), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize(
    *sample_grid(
        3, activation=[None, "relu", "gelu", "gelu_tanh"], xshape=[(6, 5), (2, 3, 5), (5,)]
    )
)
def test_check_grads_linear(x64, activation, xshape):
    x, w = rand(xshape, jnp.float64), rand((5, 4), jnp.float64)
    b, r = rand((4,), jnp.float64), rand((*xshape[:-1], 4), jnp.float64)
    f = lambda x, w, b, r: ts.op.linear(x, w, b, activation=activation, residual=r)
    check_grads(jax.jit(f), (x, w, b, r), order=1, modes=("fwd", "rev"))


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_check_grads_fused_mlp(x64, activation):
    args = [rand(s, jnp.float64) for s in [(6, 5), (5, 8), (8,), (8, 3), (3,)]]
    f = lambda *a: ts.op.fused_mlp(*a, activation=activation)
    # relu: a small finite-difference step, so that no pre-activation crosses the kink.
    eps = 1e-7 if activation == "relu" else None
    check_grads(jax.jit(f), args, order=1, modes=("fwd", "rev"), eps=eps)


def test_second_order_linear_without_kinks(x64):
    # Second order differentiates the two-output form (its JVP recomputes z), residual too.
    args = [rand(s, jnp.float64) for s in [(6, 5), (5, 4), (4,), (6, 4)]]
    f = lambda x, w, b, r: ts.op.linear(x, w, b, activation="gelu", residual=r)
    check_grads(jax.jit(f), args, order=2, modes=("fwd", "rev"))


# --- the two-output form of a differentiated layer with an activation ---------------------

ACTIVATIONS = ["relu", "gelu", "gelu_tanh"]
# The derivative is rounded to the output dtype: bf16 ~4e-3 relative, f32 ~1e-7.
DERIV_TOL = {np.dtype(jnp.bfloat16): 1e-2, F32: 1e-5}


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


@pytest.mark.parametrize(
    *sample_grid(4, dtype=[jnp.bfloat16, jnp.float32], activation=ACTIVATIONS, vmapped=[0, 1])
)
def test_with_derivative_outputs_match_float64(dtype, activation, vmapped):
    # y = act(x@w + b) + res and act'(x@w + b), both in the output dtype; y has the bits of
    # the one-output ts_matmul. ``vmapped``: under jax.vmap with a per-example bias (the
    # batching rule's epilogue after a batched product).
    x, w = rand((2, 24, 40), dtype), rand((40, 56), dtype, scale=0.2)
    b, res = rand((2, 56) if vmapped else (56,), dtype), rand((2, 24, 56), dtype)
    spec = MatmulSpec(dtype, F32, activation=activation, has_bias=True, has_residual=True)

    def both(x, b, res):
        return tuple(matmul_with_derivative_op.bind(x, w, b, res, spec=spec)), matmul_op.bind(
            x, w, b, res, spec=spec
        )

    (y, d), y1 = jax.jit(jax.vmap(both, in_axes=(0, 0 if vmapped else None, 0)))(x, b, res)
    z = f64(x) @ f64(w) + f64(b)[:, None, :] if vmapped else f64(x) @ f64(w) + f64(b)
    assert y.dtype == d.dtype == dtype and y.shape == d.shape == res.shape
    tol = DERIV_TOL[np.dtype(dtype)]
    assert rel_err(y, np_activation(z, activation) + f64(res)) <= tol
    assert rel_err(d, np_activation_derivative(z, activation)) <= tol
    assert _bits(y) == _bits(y1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_differentiated_layer_saves_the_derivative_in_the_output_dtype(dtype):
    # The backward keeps act'(z) in the layer's dtype (no f32 pre-activation for bf16), and
    # the primal of the differentiated layer has the bits of the forward.
    x, w, b = rand((32, 16), dtype), rand((16, 48), dtype, scale=0.3), rand((48,), dtype)
    f = lambda x, w, b: ts.op.linear(x, w, b, activation="gelu")
    y, f_vjp = jax.vjp(f, x, w, b)
    assert _bits(y) == _bits(jax.jit(f)(x, w, b))
    saved = [r for r in jax.tree.leaves(f_vjp) if getattr(r, "shape", None) == (32, 48)]
    assert [r.dtype for r in saved] == [dtype]
    z = f64(x) @ f64(w) + f64(b)
    assert rel_err(saved[0], np_activation_derivative(z, "gelu")) <= DERIV_TOL[np.dtype(dtype)]


@pytest.mark.parametrize(*sample_grid(3, dtype=[jnp.bfloat16, jnp.float32], activation=ACTIVATIONS))
def test_linear_activation_gradients_match_float64(dtype, activation):
    # dz = ct · act'(z) with the saved derivative; dx = dz·wᵀ, dw = xᵀ·dz, db = Σ dz.
    x, w, b = rand((40, 24), dtype), rand((24, 32), dtype, scale=0.3), rand((32,), dtype)
    ct = rand((40, 32), dtype)
    f = lambda x, w, b: ts.op.linear(x, w, b, activation=activation)
    _, f_vjp = jax.vjp(f, x, w, b)
    dx, dw, db = jax.jit(f_vjp)(ct)
    g = f64(ct) * np_activation_derivative(f64(x) @ f64(w) + f64(b), activation)
    for got, want in ((dx, g @ f64(w).T), (dw, f64(x).T @ g), (db, g.sum(0))):
        assert got.dtype == dtype
        assert rel_err(got, want) <= 2 * DERIV_TOL[np.dtype(dtype)]


@pytest.mark.parametrize("sa,sb", sample(ONE_D_SHAPES[:5] + BROADCAST_SHAPES, 2))
def test_grads_of_1d_and_broadcast_operands_match_jnp_matmul(x64, sa, sb):
    a, b = rand(sa, jnp.float64), rand(sb, jnp.float64)
    # First order here: second-order rules are checked for the primitive's own forms
    # (test_check_grads_order_2*), which the 1-D and broadcast forms reshape into.
    check_grads(jax.jit(ts.matmul), (a, b), order=1, modes=("fwd", "rev"))
    ct = rand(jnp.matmul(a, b).shape, jnp.float64)
    got = jax.vjp(ts.matmul, a, b)[1](ct)
    want = jax.vjp(jnp.matmul, a, b)[1](ct)
    for g, w, x in zip(got, want, (a, b)):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("da,db,promoted", MIXED)
def test_grads_of_mixed_dtypes_have_the_operand_dtypes(standard_promotion, da, db, promoted):
    a, b = rand((2, 20, 24), da), rand((24, 16), db)
    ct = rand((2, 20, 16), promoted)
    ga, gb = jax.vjp(ts.matmul, a, b)[1](ct)
    assert ga.dtype == np.dtype(da) and gb.dtype == np.dtype(db)
    assert ga.shape == a.shape and gb.shape == b.shape
    wa = np.matmul(f64(ct), f64(b).T)  # d(a @ b) in float64
    wb = np.einsum("bmk,bmn->kn", f64(a), f64(ct))
    # one rounding of the f32 product to each operand's dtype
    assert_matmul_close(ga, wa, da, jnp.float32, 16)
    assert_matmul_close(gb, wb, db, jnp.float32, 40)


def test_gradients_are_ts_matmuls_with_transpose_flags():
    x, w = rand((4, 6, 8)), rand((8, 5))
    loss = lambda x, w: jnp.sum(ts.matmul(x, w) ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert names.count("ts_matmul") == 3
    assert not {"dot_general", "transpose"} & set(names)
    flags = {
        (e.params["spec"].transpose_a, e.params["spec"].transpose_b)
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name == "ts_matmul"
    }
    assert flags == {(False, False), (False, True), (True, False)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_low_precision_gradients_match_float64(dtype):
    x, w = rand((3, 40, 64), dtype), rand((64, 32), dtype)
    ct = rand((3, 40, 32), dtype)
    _, vjp = jax.vjp(ts.matmul, x, w)
    dx, dw = vjp(ct)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert_matmul_close(dx, np.matmul(f64(ct), f64(w).T), dtype, jnp.float32, 32)
    ref_dw = np.einsum("bmk,bmn->kn", f64(x), f64(ct))
    assert_matmul_close(dw, ref_dw, dtype, jnp.float32, 120)


def test_gradient_with_f32_output_of_bf16_inputs():
    x, w = rand((16, 32), jnp.bfloat16), rand((32, 8), jnp.bfloat16)
    g = jax.grad(lambda x, w: jnp.sum(ts.matmul(x, w, out_dtype=jnp.float32)), (0, 1))(x, w)
    assert g[0].dtype == jnp.bfloat16 and g[1].dtype == jnp.bfloat16
    assert_matmul_close(g[0], np.ones((16, 8)) @ f64(w).T, jnp.bfloat16, jnp.float32, 8)


def test_int8_is_not_differentiable_but_traces():
    xi, wi = operand((6, 8), jnp.int8), operand((8, 4), jnp.int8)
    zeros = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in (xi, wi))
    y, t = jax.jvp(ts.matmul, (xi, wi), zeros)
    assert y.dtype == jnp.int32 and t.dtype == jax.dtypes.float0


# --- vmap / jit compositions --------------------------------------------------------------


@pytest.mark.parametrize(
    "sa,sb,in_axes",
    sample(
        [
            ((6, 5, 7), (7, 4), (0, None)),
            ((5, 6, 7), (7, 4), (1, None)),
            ((5, 7, 6), (7, 4), (2, None)),
            ((5, 7), (7, 4, 6), (None, -1)),
            ((6, 5, 7), (6, 7, 4), (0, 0)),
            ((5, 7, 6), (6, 7, 4), (-1, 0)),
            ((6, 3, 5, 7), (3, 7, 4), (0, None)),  # batched b broadcast over the mapped axis
            ((6, 5, 7), (3, 7, 4), (0, None)),  # mapped a is 2-D per example, b batched
            ((3, 5, 7), (6, 7, 4), (None, 0)),
        ],
        5,
    ),
)
def test_vmap_any_in_axes(sa, sb, in_axes):
    a, b = rand(sa), rand(sb)
    out = jax.vmap(ts.matmul, in_axes=in_axes)(a, b)
    size = sa[in_axes[0]] if in_axes[0] is not None else sb[in_axes[1]]
    slices = []
    for i in range(size):
        ai = a if in_axes[0] is None else np.take(np.asarray(a), i, axis=in_axes[0])
        bi = b if in_axes[1] is None else np.take(np.asarray(b), i, axis=in_axes[1])
        slices.append(ref_matmul(jnp.asarray(ai), jnp.asarray(bi)))
    ref = np.stack(slices)
    assert out.shape == ref.shape
    assert_matmul_close(out, ref, jnp.float32, jnp.float32, 7)
    jaxpr = jax.make_jaxpr(jax.vmap(ts.matmul, in_axes=in_axes))(a, b)
    assert "ts_matmul" in str(jaxpr)


@pytest.mark.parametrize(
    "sa,sb,in_axes",
    [((3, 5), (5, 4), (0, None)), ((3, 5), (3, 5), (0, 0)), ((2, 5), (3, 5), (None, 0))],
)
def test_vmap_of_one_dimensional_operands(sa, sb, in_axes):
    """Per example, a mapped ``(B, K)`` operand is a vector: jnp.matmul's 1-D rules."""
    a, b = rand(sa), rand(sb)
    out = jax.vmap(ts.matmul, in_axes=in_axes)(a, b)
    pick = lambda x, ax, i: f64(x) if ax is None else f64(x)[i]
    ref = np.stack([np.matmul(pick(a, in_axes[0], i), pick(b, in_axes[1], i)) for i in range(3)])
    assert out.shape == ref.shape
    assert_matmul_close(out, ref, jnp.float32, jnp.float32, 5)


@pytest.mark.parametrize("mapped", ["x", "w", "b", "r", "all"])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_vmap_linear_any_operand(mapped, activation):
    v = 3
    x, w, b, r = rand((5, 8)), rand((8, 4)), rand((4,)), rand((5, 4))
    args = {"x": x, "w": w, "b": b, "r": r}
    axes = {}
    for name, val in args.items():
        if mapped in (name, "all"):
            args[name] = rand((v, *val.shape))
            axes[name] = 0
        else:
            axes[name] = None
    f = lambda x, w, b, r: ts.op.linear(x, w, b, activation=activation, residual=r)
    out = jax.vmap(f, in_axes=tuple(axes[n] for n in "xwbr"))(*(args[n] for n in "xwbr"))
    pick = lambda n, i: args[n][i] if axes[n] == 0 else args[n]
    ref = np.stack(
        [
            np_activation(
                np.matmul(f64(pick("x", i)), f64(pick("w", i))) + f64(pick("b", i)), activation
            )
            + f64(pick("r", i))
            for i in range(v)
        ]
    )
    assert_matmul_close(out, ref, jnp.float32, jnp.float32, 8, factor=2)


@pytest.mark.xla_optimized  # jit against eager within 1e-6 (tests/conftest.py)
def test_vmap_of_grad_and_grad_of_vmap():
    xs, w = rand((4, 6, 8)), rand((8, 5))
    loss = lambda x, w: jnp.sum(jnp.tanh(ts.op.linear(x, w, activation="gelu")))
    ref_loss = lambda x, w: jnp.sum(jnp.tanh(jax.nn.gelu(x @ w, approximate=False)))
    per_ex = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None))(xs, w)
    with jax.default_matmul_precision("highest"):  # no TF32 in the reference on GPU
        per_ex_ref = jax.vmap(jax.grad(ref_loss, argnums=1), in_axes=(0, None))(xs, w)
    np.testing.assert_allclose(per_ex, per_ex_ref, rtol=2e-5, atol=2e-5)
    total = jax.grad(lambda w: jnp.sum(jax.vmap(loss, in_axes=(0, None))(xs, w)))(w)
    np.testing.assert_allclose(total, per_ex_ref.sum(0), rtol=2e-5, atol=2e-5)
    jit_total = jax.jit(jax.grad(lambda w: jnp.sum(jax.vmap(loss, in_axes=(0, None))(xs, w))))(w)
    np.testing.assert_allclose(jit_total, total, rtol=1e-6, atol=1e-6)


def test_vmap_of_hessian_vector_product(x64):
    a, b = rand((3, 4, 5), jnp.float64), rand((5, 2), jnp.float64)
    f = lambda a, b: jnp.sum(jnp.sin(ts.matmul(a, b)))
    hvp = lambda a, b, t: jax.jvp(jax.grad(f, argnums=1), (a, b), (jnp.zeros_like(a), t))[1]
    t = rand((3, 5, 2), jnp.float64)
    out = jax.vmap(hvp, in_axes=(0, None, 0))(a, b, t)
    fr = lambda a, b: jnp.sum(jnp.sin(a @ b))
    hvpr = lambda a, b, t: jax.jvp(jax.grad(fr, argnums=1), (a, b), (jnp.zeros_like(a), t))[1]
    np.testing.assert_allclose(out, jax.vmap(hvpr, in_axes=(0, None, 0))(a, b, t), rtol=1e-12)


def test_jit_and_eager_agree_bit_for_bit():
    a, b = rand((3, 33, 17), jnp.bfloat16), rand((17, 9), jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(ts.matmul(a, b).astype(jnp.float32)),
        np.asarray(jax.jit(ts.matmul)(a, b).astype(jnp.float32)),
    )


def test_jaxpr_shows_one_ts_matmul_per_call():
    a, b = rand((4, 5)), rand((5, 3))
    for fn in (ts.matmul, ts.gemm, ts.op.matmul, ts.op.gemm, ts.op.linear):
        jaxpr = jax.make_jaxpr(fn)(a, b)
        (eqn,) = jaxpr.jaxpr.eqns
        assert eqn.primitive.name == "ts_matmul"
        assert list(eqn.params) == ["spec"]
        assert eqn.params["spec"] == MatmulSpec(F32, F32)
    assert "matmul" in ts.op.OPERATORS


# --- hypothesis ---------------------------------------------------------------------------


# Each example compiles its own shapes: half the profile's examples keep CI within budget.
@settings(max_examples=4)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 40),
    n=st.integers(1, 40),
    lead=st.sampled_from([(), (2,), (2, 3)]),
    shared=st.sampled_from(["none", "a", "b"]),
    ta=st.booleans(),
    tb=st.booleans(),
)
def test_hypothesis_shapes(m, k, n, lead, shared, ta, tb):
    la = () if shared == "a" else lead
    lb = () if shared == "b" else lead
    a = rand((*la, k, m) if ta else (*la, m, k))
    b = rand((*lb, n, k) if tb else (*lb, k, n))
    a_ = jnp.swapaxes(a, -1, -2) if ta else a
    b_ = jnp.swapaxes(b, -1, -2) if tb else b
    out = ts.matmul(a_, b_)
    ref = ref_matmul(a_, b_)
    assert out.shape == ref.shape == (*lead, m, n)
    assert_matmul_close(out, ref, jnp.float32, jnp.float32, k)


@pytest.mark.parametrize(
    "x_shape, w_shape", [((3, 0), (0, 4)), ((2, 3, 0), (0, 4)), ((0, 5), (5, 4))]
)
def test_linear_with_an_empty_contraction_or_batch(x_shape, w_shape):
    """K = 0 (the product is zero, the output the bias) or no rows: the value and the
    gradients of jnp's formula, at trace time and under jit (x's rows are folded into one
    dimension by their count: a -1 reshape of a zero-size array divides by zero)."""
    x, w, b = jnp.ones(x_shape, F32), jnp.ones(w_shape, F32), jnp.arange(4, dtype=F32)
    f = lambda x, w, b: jnp.sum(ts.linear(x, w, b, activation="relu") ** 2)
    ref = lambda x, w, b: x @ w + b.reshape((1,) * (x.ndim - 1) + b.shape)
    g = lambda x, w, b: jnp.sum(jnp.maximum(ref(x, w, b), 0) ** 2)
    np.testing.assert_array_equal(jax.jit(ts.linear)(x, w, b), ref(x, w, b))
    for got, want in zip(jax.jit(jax.grad(f, (0, 1, 2)))(x, w, b), jax.grad(g, (0, 1, 2))(x, w, b)):
        np.testing.assert_array_equal(got, want)
