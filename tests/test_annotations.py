"""ts.Tensor annotations and the trace-time checks of ts.jit.

This module uses string annotations (``from __future__ import annotations``): ts.jit
resolves them in the module globals. tests/test_seeds.py covers evaluated annotations.
"""

# ts.Tensor["B", "D", ...] names dimensions with strings, which ruff reads as forward
# references (F821 undefined name, UP037 quoted annotation), as with jaxtyping.
# ruff: noqa: F821, UP037

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tessera_jax.numerics.annotations import TensorSpec
from tessera_jax.numerics.context import accumulate_dtype, accumulation
from tests._util import assert_close, f64, rand

FP8 = ts.fp8_e4m3 @ ts.accum(ts.f32)


# --- the annotation object ------------------------------------------------------------


def test_tensor_spec_fields():
    spec = ts.Tensor["B", "D", FP8]
    assert isinstance(spec, TensorSpec)
    assert spec.dims == ("B", "D") and spec.rank == 2 and not spec.has_ellipsis
    assert spec.storage is ts.fp8_e4m3 and spec.dtype == jnp.float8_e4m3fn
    assert spec.accumulate is ts.f32 and spec.loss_scale is None and spec.is_policy
    assert repr(spec) == "ts.Tensor['B', 'D', ts.fp8_e4m3 @ ts.accum(ts.f32)]"

    any_dtype = ts.Tensor["N"]
    assert any_dtype.numerics is None and any_dtype.dtype is None
    scalar = ts.Tensor[ts.f32]
    assert scalar.dims == () and scalar.rank == 0 and not scalar.is_policy
    tail = ts.Tensor[..., "D", jnp.bfloat16]
    assert tail.has_ellipsis and tail.rank == 1 and tail.dtype == jnp.bfloat16
    assert tail.axes(3) == [(2, "D")]
    assert repr(ts.Tensor[4, ..., "D", ts.f32]) == "ts.Tensor[4, ..., 'D', ts.f32]"


@pytest.mark.parametrize(
    "make, exc, msg",
    [
        (lambda: ts.Tensor["B", 1.5], TypeError, r"1\.5 is neither a dimension"),
        (lambda: ts.Tensor["B", ts.f32, "D"], TypeError, r"ts\.f32 must be a dimension name"),
        (lambda: ts.Tensor[..., ..., ts.f32], ValueError, r"at most one \.\.\."),
        (lambda: ts.Tensor[-1, ts.f32], ValueError, r"dimension size -1 must be >= 0"),
        (lambda: ts.Tensor["", ts.f32], ValueError, r"a dimension name must not be empty"),
        (
            lambda: ts.Tensor["B", ts.accum(ts.f32)],
            TypeError,
            r"is not a dtype; attach it to a storage dtype",
        ),
        (lambda: ts.Tensor(), TypeError, r"ts\.Tensor is an annotation"),
    ],
)
def test_tensor_spec_errors(make, exc, msg):
    with pytest.raises(exc, match=msg):
        make()


# --- argument checks ------------------------------------------------------------------


@ts.jit
def gemm(
    A: ts.Tensor["M", "K", ts.f32], B: ts.Tensor["K", "N", ts.f32]
) -> ts.Tensor["M", "N", ts.f32]:
    return jnp.dot(A, B)


def test_checked_call_matches_reference():
    A, B = rand((8, 64)), rand((64, 16))
    out = gemm(A, B)
    assert out.dtype == jnp.float32 and out.shape == (8, 16)
    assert_close(out, f64(A) @ f64(B), factor=10)
    assert_close(gemm(A=A, B=B), f64(A) @ f64(B), factor=10)


def test_named_dimension_mismatch():
    with pytest.raises(
        TypeError, match=r'^gemm: dimension "K" is 64 in A\.shape\[1\] but 32 in B\.shape\[0\]'
    ):
        gemm(rand((8, 64)), rand((32, 16)))


def test_rank_mismatch():
    with pytest.raises(
        TypeError,
        match=r"^gemm: B has rank 1 \(shape \(64,\)\) but its annotation "
        r"ts\.Tensor\['K', 'N', ts\.f32\] has rank 2",
    ):
        gemm(rand((8, 64)), rand((64,)))


def test_dtype_mismatch():
    with pytest.raises(
        TypeError,
        match=r"^gemm: A has dtype bfloat16 but its annotation ts\.Tensor\['M', 'K', ts\.f32\] "
        r"stores f32 \(float32\)",
    ):
        gemm(rand((8, 64), jnp.bfloat16), rand((64, 16)))

    @ts.jit
    def fp8_in(x: ts.Tensor["B", "D", FP8]):
        return x.astype(jnp.float32)

    with pytest.raises(
        TypeError,
        match=r"fp8_in: x has dtype float32 but its annotation ts\.Tensor\['B', 'D', "
        r"ts\.fp8_e4m3 @ ts\.accum\(ts\.f32\)\] stores fp8_e4m3 \(float8_e4m3fn\)",
    ):
        fp8_in(rand((2, 3)))
    assert fp8_in(rand((2, 3), jnp.float8_e4m3fn)).dtype == jnp.float32


def test_fixed_sizes_and_ellipsis():
    @ts.jit
    def proj(x: ts.Tensor[..., "D", ts.f32], w: ts.Tensor["D", 3, ts.f32]):
        return x @ w

    x, w = rand((2, 5, 4)), rand((4, 3))
    assert_close(proj(x, w), f64(x) @ f64(w), factor=10)
    assert proj(rand((4,)), w).shape == (3,)
    with pytest.raises(
        TypeError, match=r'^proj: dimension "D" is 4 in x\.shape\[2\] but 5 in w\.shape\[0\]'
    ):
        proj(x, rand((5, 3)))
    with pytest.raises(
        TypeError,
        match=r"^proj: w\.shape\[1\] is 2 but the annotation ts\.Tensor\['D', 3, ts\.f32\] "
        r"requires 3",
    ):
        proj(x, rand((4, 2)))
    with pytest.raises(
        TypeError,
        match=r"proj: x has rank 0 \(shape \(\)\) but its annotation "
        r"ts\.Tensor\[\.\.\., 'D', ts\.f32\] has rank at least 1",
    ):
        proj(jnp.float32(1.0), w)


def test_non_array_argument():
    @ts.jit
    def f(x: ts.Tensor["N", ts.f32], n: int):
        return x * n

    with pytest.raises(
        TypeError, match=r"f: x is annotated ts\.Tensor\['N', ts\.f32\] but is a list, not an array"
    ):
        f([jnp.float32(1.0)], 2)
    np.testing.assert_array_equal(f(jnp.ones(3), 2), jnp.full(3, 2.0))


def test_static_and_keyword_arguments():
    @ts.jit(static_argnames="axis")
    def norm(x: ts.Tensor["B", "D", ts.f32], axis: int = -1) -> ts.Tensor["B", ts.f32]:
        return jnp.sqrt(jnp.sum(x * x, axis=axis))

    x = rand((3, 4))
    ref = np.sqrt((f64(x) ** 2).sum(-1))
    assert_close(norm(x), ref)
    assert_close(norm(x=x, axis=1), ref)
    with pytest.raises(
        TypeError, match=r'^norm: dimension "B" is 3 in x\.shape\[0\] but 4 in return\.shape\[0\]'
    ):
        norm(x, axis=0)


def test_checks_see_per_example_shapes_under_vmap_and_grad():
    A, B = rand((5, 8, 64)), rand((5, 64, 16))
    out = jax.vmap(gemm)(A, B)
    assert_close(out, np.einsum("bmk,bkn->bmn", f64(A), f64(B)), factor=10)
    g = jax.grad(lambda A, B: jnp.sum(gemm(A, B)))(A[0], B[0])
    assert_close(g, np.broadcast_to(f64(B[0]).sum(1), (8, 64)), factor=10)
    with pytest.raises(TypeError, match=r'dimension "K" is 64 in A\.shape\[1\] but 32'):
        jax.vmap(gemm)(A, rand((5, 32, 16)))


# --- return annotations ---------------------------------------------------------------


def test_return_annotation_casts_with_ts_cast():
    @ts.jit
    def to_bf16(x: ts.Tensor["N", ts.f32]) -> ts.Tensor["N", ts.bf16 @ ts.accum(ts.f32)]:
        return x * 3.0

    x = rand((32,))
    out = to_bf16(x)
    assert out.dtype == jnp.bfloat16
    assert_close(out, 3.0 * f64(x))
    prims = [str(e.primitive) for e in jax.make_jaxpr(to_bf16.__wrapped__)(x).eqns]
    assert prims[-1] == "ts_cast"


def test_return_checks():
    @ts.jit
    def bad_rank(x: ts.Tensor["N", ts.f32]) -> ts.Tensor["N", "N", ts.f32]:
        return x

    with pytest.raises(
        TypeError,
        match=r"^bad_rank: return has rank 1 \(shape \(3,\)\) but its annotation "
        r"ts\.Tensor\['N', 'N', ts\.f32\] has rank 2",
    ):
        bad_rank(jnp.ones(3))

    @ts.jit
    def pair(x: ts.Tensor["N", ts.f32]) -> ts.Tensor["N", ts.f32]:
        return x, x

    with pytest.raises(
        TypeError,
        match=r"pair: the return annotation is ts\.Tensor\['N', ts\.f32\] but the function "
        r"returned a tuple",
    ):
        pair(jnp.ones(3))


# --- numerics policies ----------------------------------------------------------------


def test_accumulation_policy_is_in_force_while_tracing():
    seen = []

    @ts.jit
    def f(a: ts.Tensor["N", ts.bf16 @ ts.accum(ts.f32)], b: ts.Tensor["N", ts.f16]):
        seen.append(accumulate_dtype())
        return a.astype(jnp.float32) + b.astype(jnp.float32)

    @ts.jit
    def g(
        a: ts.Tensor["N", ts.bf16 @ ts.accum(ts.f16)], b: ts.Tensor["N", ts.f16 @ ts.accum(ts.f64)]
    ):
        seen.append(accumulate_dtype())
        return a

    @ts.jit
    def plain(a: ts.Tensor["N", ts.bf16]):
        seen.append(accumulate_dtype())
        return a

    a, b = jnp.ones(3, jnp.bfloat16), jnp.ones(3, jnp.float16)
    f(a, b)
    g(a, b)
    plain(a)
    assert seen == [np.dtype(np.float32), np.dtype(np.float64), None]  # widest; none
    assert accumulate_dtype() is None  # restored after the trace


@pytest.mark.parametrize("dtype", [ts.bf16, ts.f64])
def test_accumulation_context_is_part_of_the_jit_key(dtype):
    """A function jitted (and run) outside the context is retraced inside it: the trace
    reads the context's dtype, and matmul's accumulate_dtype parameter follows it."""
    seen = []

    @jax.jit
    def f(a):
        seen.append(accumulate_dtype())
        return ts.matmul(a, a)

    a = rand((4, 4), jnp.bfloat16)
    f(a)
    with accumulation(dtype):
        f(a)
        params = [e.params for e in jax.make_jaxpr(f)(a).eqns[0].params["jaxpr"].eqns]
    f(a)  # back outside: the first trace's cache entry again, no new trace
    assert seen == [None, np.dtype(dtype.container)]
    assert params[0]["spec"].accumulate_dtype == np.dtype(dtype.container)


def test_accumulation_context_is_thread_local():
    seen = {}

    def other():
        seen["other"] = accumulate_dtype()

    with accumulation(ts.f64):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        seen["here"] = accumulate_dtype()
    assert seen == {"other": None, "here": np.dtype(np.float64)}


def test_quantized_tensor_accepted_for_a_policy_annotation():
    from tessera_jax.numerics.policy import dequantize, quantize

    @ts.jit
    def dq(w: ts.Tensor["D", "E", ts.int8 @ ts.accum(ts.f32)]) -> ts.Tensor["D", "E", ts.f32]:
        return dequantize(w)

    x = rand((4, 6))
    qt = quantize(x, ts.int8)
    out = dq(qt)
    assert out.dtype == jnp.float32
    # int8 per-tensor scaling: every element within half a quantization step.
    assert np.max(np.abs(f64(out) - f64(x))) <= float(qt.scale) / 2 * (1 + 1e-6)
    with pytest.raises(TypeError, match=r"dq: w has rank 3 \(shape \(6, 4, 1\)\)"):
        dq(quantize(jnp.ones((6, 4, 1)), ts.int8))

    @ts.jit
    def bare(w: ts.Tensor["D", "E", ts.int8]):
        return w

    with pytest.raises(
        TypeError,
        match=r"bare: w is a QuantizedTensor but its annotation ts\.Tensor\['D', 'E', ts\.int8\] "
        r"is not a policy",
    ):
        bare(qt)


# --- string annotations ---------------------------------------------------------------


def test_unresolvable_string_annotations():
    local_policy = ts.bf16 @ ts.accum(ts.f32)  # not visible to the string annotation

    @ts.jit
    def f(x: ts.Tensor["N", local_policy]):
        return x

    with pytest.raises(
        TypeError,
        match=r"f: cannot resolve the annotation \"ts\.Tensor\['N', local_policy\]\" of "
        r"parameter 'x' in the module globals \(NameError",
    ):
        f(jnp.ones(3))

    @ts.jit
    def g(x: NotATessera[int]) -> ts.Tensor["N", ts.f32]:
        return x  # annotations other than ts.Tensor are left alone

    assert g(jnp.ones(3)).dtype == jnp.float32
