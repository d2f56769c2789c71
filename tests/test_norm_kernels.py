"""The row-wise softmax / log_softmax / rmsnorm / layernorm kernels against float64 references.

``TestNormKernelsInterpret`` runs the kernels in Pallas' interpreter on the CPU;
``TestNormKernelsGPU`` (marker ``gpu``) runs the same cases compiled. Each case first
asserts that the forward and the backward primitive chose the kernel, so a kernel that
silently declined fails instead of testing the reference. Gradients are ``jax.vjp`` with a
random cotangent, compared with jax's own derivative of a float64 jax.numpy formula.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tessera_jax import _compat
from tessera_jax.pallas_kernels import norms_gpu, norms_mgpu
from tessera_jax.primitives import norms as _norms
from tessera_jax.primitives import softmax as _softmax
from tessera_jax.primitives._core import Kernel
from tests._util import (
    assert_close,
    assert_same_bits_with_x64,
    chosen_kernels,
    cuda_lowering,
    f64,
    rand,
    skip_unsampled_twin,
    triton_lowers_here,
    xla_ordered_sums,
)

# (shape, dtype), sampled rather than crossed: one whole block of power-of-two rows in
# bf16, and ragged rows of a length that is not a power of two (masked columns, a partial
# last block) in f32; test_non_finite_rows runs bf16 rows of 96.
CASES = [((8, 128), jnp.bfloat16), ((3, 5, 200), jnp.float32)]
OPS = ["softmax", "log_softmax", "rmsnorm", "layernorm"]
EPS = 1e-5


def _ts(op: str, x, w=None, b=None):
    if op == "softmax":
        return ts.softmax(x)
    if op == "log_softmax":
        return ts.log_softmax(x)
    if op == "rmsnorm":
        return ts.rmsnorm(x, w, eps=EPS)
    return ts.layernorm(x, w, b, eps=EPS)


def _f64(op: str, x, w=None, b=None):
    """The float64 formula (under x64), differentiated by jax for the gradient reference."""
    if op == "softmax":
        return jax.nn.softmax(x, axis=-1)
    if op == "log_softmax":
        return jax.nn.log_softmax(x, axis=-1)
    row = lambda p: p.reshape((1,) * (x.ndim - 1) + p.shape)
    if op == "rmsnorm":
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * row(w)
    c = x - jnp.mean(x, axis=-1, keepdims=True)
    return c / jnp.sqrt(jnp.mean(c * c, axis=-1, keepdims=True) + EPS) * row(w) + row(b)


def _operands(op: str, shape, dtype):
    x = rand(shape, dtype, scale=2.0)
    if op in ("softmax", "log_softmax"):
        return (x,)
    w = rand(shape[-1:], jnp.float32) + 1.0
    return (x, w) if op == "rmsnorm" else (x, w, rand(shape[-1:], jnp.float32))


def _fwd_spec(op: str) -> tuple:
    """The forward kernel's bind parameters for :func:`_operands`' arguments."""
    if op.endswith("softmax"):
        return (("axis", 1),)
    kw = dict(eps=EPS, has_weight=True) | (dict(has_bias=True) if op == "layernorm" else {})
    return tuple(sorted(kw.items()))


def _chosen(f, *args) -> dict[str, str]:
    """The implementation each ts primitive in ``f``'s program lowers to, by operator."""
    return dict(chosen_kernels(f, *args))


def _non_finite_operands(op: str, d: int) -> list:
    """:func:`_operands` of 6 bf16 rows of ``d``: a NaN, a ``+inf``, a row of ``-inf``
    (softmax) or zeros (the norms), one ``-inf`` element, and a row whose squares overflow
    f32 (the norms' rescaled statistics)."""
    x = np.array(rand((6, d), jnp.float32))
    x[1, 7] = np.nan
    x[2, 3] = np.inf
    x[3, :] = -np.inf if op.endswith("softmax") else 0.0
    x[4, 5] = -np.inf
    x[5, :] *= 1e30
    args = list(_operands(op, (6, d), jnp.float32))
    args[0] = jnp.asarray(x, jnp.bfloat16)
    return args


def _nan_equal_close(out, ref, rtol):
    """Same NaN positions; the other entries within ``rtol`` of the reference."""
    out, ref = f64(out), f64(ref)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_allclose(out[ok], ref[ok], rtol=rtol, atol=rtol)


class _NormKernelCases:
    MODE: str

    @pytest.fixture(autouse=True)
    def _mode(self):
        with ts.kernel_mode(self.MODE):
            yield

    @pytest.mark.parametrize("shape, dtype", CASES)
    @pytest.mark.parametrize("op", OPS)
    def test_forward_and_gradients(self, op, shape, dtype):
        args = _operands(op, shape, dtype)
        ct = rand(shape, dtype)
        f = functools.partial(_ts, op)

        def vjp(*args):
            y, pull = jax.vjp(f, *args)
            return y, pull(ct)

        chosen = _chosen(vjp, *args)
        assert chosen == {op: "pallas_rows", f"{op}_bwd": "pallas_rows"}, chosen
        y, grads = jax.jit(vjp)(*args)
        with _compat.enable_x64(True):
            ref, pull = jax.vjp(functools.partial(_f64, op), *map(f64, args))
            ref_grads = pull(f64(ct))
        assert y.dtype == args[0].dtype
        assert_close(y, ref, factor=2)
        for g, r, a in zip(grads, ref_grads, args):
            assert g.dtype == a.dtype and g.shape == a.shape
            # f32 gradients sum D products: allow a few roundings per element
            assert_close(g, r, factor=4 if g.dtype == jnp.bfloat16 else 20)

    @pytest.mark.parametrize("op", OPS)
    def test_non_finite_rows(self, op):
        """A NaN or ±inf row gives a NaN row (softmax: a -inf element is fine, a fully -inf
        row gives zeros / -inf), as the XLA reference does, in the output and dx."""
        args = _non_finite_operands(op, 96)
        ct = rand((6, 96), jnp.bfloat16)
        fn = functools.partial(_ts, op)

        def run(*a):
            y, pull = jax.vjp(fn, *a)
            return y, pull(ct)[0]

        assert set(_chosen(run, *args).values()) == {"pallas_rows"}
        y, dx = jax.jit(run)(*args)
        with ts.kernel_mode("xla"):
            y_ref, dx_ref = jax.jit(run)(*args)
        _nan_equal_close(y, y_ref, 2e-2)
        _nan_equal_close(dx, dx_ref, 5e-2)

    def test_rmsnorm_safe_zero_rows(self):
        """eps = 0 and an all-zero row: zeros and zero gradients, never NaN."""
        x = np.array(rand((4, 256), jnp.float32))
        x[2] = 0.0
        x = jnp.asarray(x, jnp.bfloat16)
        ct = rand((4, 256), jnp.bfloat16)

        def run(x):
            y, pull = jax.vjp(lambda x: ts.rmsnorm_safe(x, eps=0.0), x)
            return y, pull(ct)[0]

        assert set(_chosen(run, x).values()) == {"pallas_rows"}
        y, dx = jax.jit(run)(x)
        assert np.all(f64(y)[2] == 0) and np.all(f64(dx)[2] == 0)
        with ts.kernel_mode("xla"):
            y_ref, dx_ref = jax.jit(run)(x)
        assert_close(y, y_ref)
        assert_close(dx, dx_ref, factor=2)

    @pytest.mark.parametrize("d", [128, 80])
    def test_row_dot(self, d):
        """``row_dot`` (attention's Δ = rowsum(dO ∘ O)) against float64, and each row's
        bits the same in a launch of fewer rows (a mesh's shard): the tiling reads the row
        length only."""
        a, b = rand((3, 50, d), jnp.bfloat16), rand((3, 50, d), jnp.bfloat16)
        run = jax.jit(functools.partial(norms_gpu.row_dot, interpret=self.MODE == "interpret"))
        got = run(a, b)
        assert got.dtype == jnp.float32 and got.shape == (3, 50)
        assert_close(got, np.einsum("...d,...d->...", f64(a), f64(b)), factor=4)
        np.testing.assert_array_equal(np.asarray(run(a[1:, 7:], b[1:, 7:])), got[1:, 7:])

    @pytest.mark.parametrize("shape,seq_pad", [((2, 5, 3, 128), 128), ((1, 130, 2, 64), 256)])
    def test_row_dot_head_major_padded(self, shape, seq_pad):
        """``row_dot(..., seq_pad=)`` (attention's Δ as its backward kernels read it): the
        plain kernel's sums, bit for bit, transposed to ``(B, H, S)`` and zero-padded."""
        a, b = rand(shape, jnp.bfloat16), rand(shape, jnp.bfloat16)
        kw = dict(interpret=self.MODE == "interpret")
        got = jax.jit(functools.partial(norms_gpu.row_dot, seq_pad=seq_pad, **kw))(a, b)
        plain = np.swapaxes(
            np.asarray(jax.jit(functools.partial(norms_gpu.row_dot, **kw))(a, b)), 1, 2
        )
        assert got.dtype == jnp.float32 and got.shape == (shape[0], shape[2], seq_pad)
        np.testing.assert_array_equal(np.asarray(got)[..., : shape[1]], plain)
        np.testing.assert_array_equal(np.asarray(got)[..., shape[1] :], 0.0)

    @pytest.mark.parametrize("op", OPS)
    def test_same_bits_with_x64(self, op):
        """:func:`assert_same_bits_with_x64` of the forward and backward kernels."""
        args, ct = _operands(op, (8, 128), jnp.bfloat16), rand((8, 128), jnp.bfloat16)

        def vjp(*args):
            y, pull = jax.vjp(functools.partial(_ts, op), *args)
            return y, pull(ct)

        kernels = {op: "pallas_rows", f"{op}_bwd": "pallas_rows"}
        assert_same_bits_with_x64(jax.jit(vjp), args, _chosen, kernels)


@pytest.mark.gpu
class TestNormKernelsGPU(_NormKernelCases):
    MODE = "pallas"


class TestNormKernelsInterpret(_NormKernelCases):
    MODE = "interpret"

    @pytest.fixture(autouse=True)
    def _sampled(self, request):
        skip_unsampled_twin(request, 4)


# --- the kernel functions themselves (CPU only) -------------------------------------------


def _backward_both_ways(op, shape, config, interpret):
    """The backward kernel's outputs with ``config`` and with its prefetch flipped, and
    the reference's."""
    x, w, ct = rand(shape, jnp.bfloat16), rand(shape[-1:], jnp.float32), rand(shape, jnp.bfloat16)
    d = shape[-1]
    params = dict(eps=EPS, has_weight=True, weight_grad_shape=(d,))
    if op == "layernorm":
        params["bias_grad_shape"] = (d,)
    spec = tuple(sorted(params.items()))
    kernel = getattr(norms_gpu, f"{op}_bwd")
    outs = []
    for cfg in (config, dataclasses.replace(config, prefetch=not config.prefetch)):
        f = functools.partial(kernel, spec, interpret=interpret, config=cfg)
        outs.append(jax.jit(f)(x, w, ct))
    ref = getattr(_norms, f"{op}_bwd_reference")(x, w, ct, **params)
    return *outs, ref


def test_row_dot_rejects_what_its_kernel_cannot_take():
    x = jnp.zeros((2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"norms_gpu.row_dot: a.shape=\(2, 8\) and b.shape"):
        norms_gpu.row_dot(x, x[:, :4])
    with pytest.raises(ValueError, match=r"norms_gpu.row_dot: seq_pad=1 needs \(B, S, H, D\)"):
        norms_gpu.row_dot(x[None, :, None], x[None, :, None], seq_pad=1)
    with pytest.raises(ValueError, match=r"norms_gpu.row_dot: seq_pad=4 needs"):
        norms_gpu.row_dot(x, x, seq_pad=4)
    with pytest.raises(ValueError, match=r"norms_gpu.row_dot: seq_pad=4.0 must be an int"):
        norms_gpu.row_dot(x[None, :, None], x[None, :, None], seq_pad=4.0)
    wide = jnp.zeros((1, 2 * norms_gpu.MAX_ROW), jnp.bfloat16)
    with pytest.raises(ValueError, match="norms_gpu.row_dot: a row of 32768 elements"):
        norms_gpu.row_dot(wide, wide)


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_parameter_gradients_sum_in_a_fixed_order(op):
    """dweight and dbias add the programs' partial column sums on the canonical tree, not
    in an XLA reduction, whose order XLA's GPU autotuner picks by timing."""
    x, w = rand((512, 128), jnp.bfloat16), rand((128,), jnp.float32)
    params = dict(eps=EPS, has_weight=True, weight_grad_shape=(128,))
    if op == "layernorm":
        params["bias_grad_shape"] = (128,)
    kernel = getattr(norms_gpu, f"{op}_bwd")
    f = functools.partial(kernel, tuple(sorted(params.items())), interpret=True)
    assert xla_ordered_sums(f, x, w, x) == []


def _assert_walk_matches(got, other, ref, op):
    """Same bits with and without prefetch; both close to the reference."""
    assert len(got) == len(other) == len(ref) == (3 if op == "layernorm" else 2)
    for g, o, r in zip(got, other, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_array_equal(f64(g), f64(o))
        assert_close(g, f64(r), rtol=2e-2 if g.dtype == jnp.bfloat16 else 1e-5)


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_backward_walks_several_blocks_per_program(op):
    """row_steps > 1 with a ragged last block: dx and the partial dw/db sums add up, and
    prefetching the next block changes no bit."""
    config = norms_gpu.RowConfig(block_rows=2, num_warps=4, row_steps=3, prefetch=True)
    _assert_walk_matches(*_backward_both_ways(op, (13, 40), config, interpret=True), op)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_backward_prefetch_gpu(op):
    """The compiled twin at a width whose default config walks and prefetches."""
    rows, d = 1000, 4096
    config = norms_gpu.RowConfig.default(rows, d, backward=True)
    assert config.prefetch and config.row_steps > 1
    _assert_walk_matches(*_backward_both_ways(op, (rows, d), config, interpret=False), op)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "op, rows, d", [("layernorm", 3001, 4096), ("rmsnorm", 1001, 8192), ("layernorm", 601, 16384)]
)
def test_forward_default_walk_gpu(op, rows, d):
    """The compiled forward where its default config walks and prefetches (a ragged last
    block, row 7 overflowing f32 when squared): the bits of one block per program, and
    close to the float64 reference. The interpreted twin is
    test_forward_walks_several_blocks_per_program."""
    args = _operands(op, (rows, d), jnp.bfloat16)
    config = norms_gpu.RowConfig.default(rows, d, backward=False, params=len(args) - 1)
    assert config.prefetch and config.row_steps > 1
    args = (args[0].at[7].multiply(1e30), *args[1:])
    kernel = functools.partial(getattr(norms_gpu, op), _fwd_spec(op))
    got = jax.jit(kernel)(*args)
    one = jax.jit(functools.partial(kernel, config=norms_gpu.RowConfig.blocks(d)))(*args)
    np.testing.assert_array_equal(f64(got), f64(one))
    with _compat.enable_x64(True):
        want = _f64(op, *map(f64, args))
    assert_close(got, want, factor=2)


@pytest.mark.parametrize("guard_zero", [False, True])
@pytest.mark.parametrize("rows", ["finite", "overflow", "zero", "inf", "nan"])
def test_statistics_branch_gives_the_same_bits(rows, guard_zero):
    """The forward's branch (the rescaled statistics only for a block with an overflowing
    row) gives the bits of the unbranched form, for a block with and without such a row.
    Op by op, as a kernel computes them: XLA's CPU fusions may round an ``rsqrt``
    differently by where they fuse it."""
    v = np.array(rand((4, 96), jnp.float32))
    v[0, 0] = 0.0
    if rows == "overflow":
        v[2] *= 1e30
    elif rows == "zero":
        v[2] = 0.0
    elif rows != "finite":
        v[2, 5] = np.inf if rows == "inf" else np.nan
    eps = 0.0 if guard_zero else EPS
    with jax.disable_jit():
        got, want = (
            norms_gpu._normalise(jnp.asarray(v), 96, eps, guard_zero=guard_zero, branch=b)
            for b in (True, False)
        )
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_forward_walks_several_blocks_per_program(op, prefetch):
    """row_steps > 1 (parameters loaded once per program) with a ragged last block and a
    program whose last block lies past the rows: every row is written once and right. Row 7
    of the norms overflows f32 when squared: its block alone takes the rescaled statistics."""
    args = _operands(op, (13, 40), jnp.bfloat16)
    if not op.endswith("softmax"):
        args = (args[0].at[7].multiply(1e30), *args[1:])
    config = norms_gpu.RowConfig(block_rows=2, num_warps=4, row_steps=3, prefetch=prefetch)
    spec = _fwd_spec(op)
    got = getattr(norms_gpu, op)(spec, *args, interpret=True, config=config)
    with _compat.enable_x64(True):
        want = _f64(op, *map(f64, args))
    assert got.dtype == args[0].dtype and got.shape == args[0].shape
    assert_close(got, want, factor=2)


@triton_lowers_here
def test_kernels_lower_to_triton_for_cuda():
    """Every kernel goes through Pallas' Triton lowering (on this CPU, for cuda)."""
    x, w = jnp.zeros((16, 200), jnp.bfloat16), jnp.zeros((200,), jnp.float32)
    soft = (("axis", 1),)
    norm = (("eps", EPS), ("has_weight", True))
    bwd = (*norm, ("weight_grad_shape", (200,)))
    cases = {
        "softmax": (lambda x: norms_gpu.softmax(soft, x), (x,)),
        "log_softmax": (lambda x: norms_gpu.log_softmax(soft, x), (x,)),
        "softmax_bwd": (lambda y, g: norms_gpu.softmax_bwd(soft, y, g), (x, x)),
        "log_softmax_bwd": (lambda y, g: norms_gpu.log_softmax_bwd(soft, y, g), (x, x)),
        "rmsnorm": (lambda x, w: norms_gpu.rmsnorm(norm, x, w), (x, w)),
        "layernorm": (
            lambda x, w: norms_gpu.layernorm((*norm, ("has_bias", True)), x, w, w),
            (x, w),
        ),
        "rmsnorm_bwd": (lambda x, w, c: norms_gpu.rmsnorm_bwd(bwd, x, w, c), (x, w, x)),
        "layernorm_bwd": (
            lambda x, w, c: norms_gpu.layernorm_bwd((*bwd, ("bias_grad_shape", (200,))), x, w, c),
            (x, w, x),
        ),
        "row_dot": (norms_gpu.row_dot, (x, x)),
    }
    for name, (f, args) in cases.items():
        text = cuda_lowering(f, *args)
        assert "__gpu$xla.gpu.triton" in text, name


def test_supports_declines_with_reasons():
    x = jax.core.ShapedArray((4, 64), jnp.bfloat16)
    assert norms_gpu.supports((("axis", 1),), [x]) is None
    assert "last axis" in norms_gpu.supports((("axis", 0),), [x])
    x64 = jax.core.ShapedArray((4, 64), np.dtype(np.float64))
    assert "float64" in norms_gpu.supports((("axis", 1),), [x64])
    long = jax.core.ShapedArray((2, norms_gpu.MAX_ROW + 1), jnp.bfloat16)
    assert "does not fit" in norms_gpu.supports((("axis", 1),), [long])
    batched_w = jax.core.ShapedArray((4, 1, 64), jnp.float32)
    spec = (("eps", EPS), ("has_weight", True))
    assert "(D,)" in norms_gpu.supports(spec, [x, batched_w])
    empty = jax.core.ShapedArray((0, 64), jnp.bfloat16)
    assert "non-empty" in norms_gpu.supports((("axis", 1),), [empty])
    huge = jax.core.ShapedArray((2**18, 2**13), jnp.bfloat16)
    assert "32-bit" in norms_gpu.supports((("axis", 1),), [huge])


@pytest.mark.parametrize(
    "shape, pair, rms, rms_pair, softmax_alone",
    [
        ((2**13, 1024), True, True, True, True),  # 2^23 elements
        ((2**12, 1024), False, True, True, True),  # the backward kernels lose below 2^23
        ((2**14, 256), False, True, True, True),  # 2^22 elements
        ((2**16, 128), False, False, False, False),  # rows shorter than measured
        ((2**10, 16384), True, True, False, True),  # rmsnorm's pair loses at 16384
        ((2**11, 8192), True, True, True, True),
        ((2**9, 4096), False, True, True, False),  # 2^21
        ((2**9, 1024), False, True, True, False),  # 2^19: the smallest measured
        ((2**8, 1024), False, False, False, False),  # 2^18 elements: unmeasured
    ],
)
def test_auto_mode_takes_kernel_pairs_where_measured(shape, pair, rms, rms_pair, softmax_alone):
    """Where a backward follows, ``auto`` takes an operator's forward and backward Triton
    kernels by one rule (a forward kernel beside the reference's backward ran slower than
    either pair); a forward alone by its own measurements. The Mosaic ports come second,
    each with its own rule."""
    x = jax.core.ShapedArray(shape, jnp.bfloat16)
    alone, diff = (("axis", 1),), (("axis", 1), ("differentiated", True))
    assert norms_gpu.prefer((), [x]) is pair
    assert norms_gpu.prefer_rmsnorm(alone, [x]) is rms
    assert norms_gpu.prefer_rmsnorm(diff, [x]) is norms_gpu.prefer_rmsnorm_bwd((), [x]) is rms_pair
    assert norms_gpu.prefer_softmax(alone, [x]) is softmax_alone
    assert norms_gpu.prefer_softmax(diff, [x]) is pair
    assert norms_gpu.prefer_layernorm(alone, [x]) is rms
    assert norms_gpu.prefer_layernorm(diff, [x]) is pair
    rules = {
        _softmax.softmax_op: norms_gpu.prefer_softmax,
        _softmax.log_softmax_op: norms_gpu.prefer_softmax,
        _norms.layernorm_op: norms_gpu.prefer_layernorm,
        _norms.rmsnorm_op: norms_gpu.prefer_rmsnorm,
        _norms.rmsnorm_bwd_op: norms_gpu.prefer_rmsnorm_bwd,
    }
    ops = (_softmax.softmax_bwd_op, _softmax.log_softmax_bwd_op, _norms.layernorm_bwd_op)
    for op in (*ops, *rules):
        triton, mosaic = op.kernels
        want = rules.get(op, norms_gpu.prefer)
        assert (triton.name, triton.prefer) == ("pallas_rows", want), op.name
        assert (mosaic.name, mosaic.prefer) == ("mosaic_rows", norms_mgpu.PREFER[op.name])


@pytest.mark.parametrize(
    "shape, softmax, layernorm_pair",
    [
        ((2**12, 2048), True, True),  # 2^23 elements
        ((2**11, 2048), False, False),  # 2^22: the pairs lost at 2^21
        ((2**13, 1024), False, False),  # rows shorter than measured
        ((2**13, 4096), True, True),
        ((2**11, 8192), True, False),  # layernorm's pair lost at 16384-wide rows
        ((2**10, 16384), True, False),
    ],
)
def test_auto_mode_takes_mosaic_kernels_where_measured(shape, softmax, layernorm_pair):
    """Without the Triton kernels ``auto`` takes the Mosaic ports by their own measurements:
    softmax's and log_softmax's from 2^23 elements at rows of 2048 to 16384, layernorm's
    forward there too but its pair only at rows up to 4096, rmsnorm's forward where no
    backward follows (its pair lost to the reference)."""
    x = jax.core.ShapedArray(shape, jnp.bfloat16)
    alone, diff = (("axis", 1),), (("axis", 1), ("differentiated", True))
    rule = norms_mgpu.PREFER
    for name in ("softmax", "log_softmax", "softmax_bwd", "log_softmax_bwd"):
        assert rule[name](alone, [x]) is rule[name](diff, [x]) is softmax, name
    assert rule["layernorm"](alone, [x]) is softmax
    assert rule["layernorm"](diff, [x]) is rule["layernorm_bwd"](diff, [x, x]) is layernorm_pair
    assert rule["rmsnorm"](alone, [x]) is softmax
    assert not rule["rmsnorm"](diff, [x]) and not rule["rmsnorm_bwd"](alone, [x, x])


def _auto_choices(op: str, shape) -> tuple[dict, tuple[str, str]]:
    """What ``auto`` mode lowers ``op`` to for a GPU on bf16 ``shape``: the forward alone
    ({operator: implementation}), and the forward and backward of a training step."""
    x, *params = _operands(op, shape, jnp.bfloat16)
    f = functools.partial(_ts, op)
    step = jax.value_and_grad(lambda *a: f(*a).astype(jnp.float32).sum())
    with ts.kernel_mode("auto"):
        alone = dict(chosen_kernels(f, x, *params, platform="cuda"))
        both = dict(chosen_kernels(step, x, *params, platform="cuda"))
    bwd = "log_softmax_bwd" if op == "log_softmax" else f"{op}_bwd"
    return alone, (both[op], both[bwd])


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layernorm", "rmsnorm"])
def test_auto_mode_without_triton_takes_mosaic_forward_and_backward_together(op, monkeypatch):
    """Where only the Mosaic ports can run (as under a jax without Pallas' Triton backend),
    ``auto`` at 2^23 elements takes each forward port alone, and under differentiation an
    operator's forward and backward ports together or neither (rmsnorm: neither), as the
    lowering would choose for a GPU."""

    def unavailable(self, mode, platform):
        return "no Triton backend" if self.name == "pallas_rows" else None

    monkeypatch.setattr(Kernel, "unavailable", unavailable)
    alone, pair = _auto_choices(op, (4096, 2048))
    kernel = "reference" if op == "rmsnorm" else "mosaic_rows"
    assert alone == {op: "mosaic_rows"}
    assert pair == (kernel, kernel)


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layernorm", "rmsnorm"])
def test_forward_under_differentiation_says_so(op):
    """The JVP rule binds the forward with ``differentiated=True`` (which ``auto`` reads);
    a forward alone carries nothing, and vmap and second derivatives keep the flag."""
    x, *params = _operands(op, (4, 256), jnp.float32)
    f = lambda x: _ts(op, x, *params).sum()

    def flags(g):
        jaxpr = jax.make_jaxpr(g)(x).jaxpr
        return [
            e.params.get("differentiated") for e in jaxpr.eqns if e.primitive.name == f"ts_{op}"
        ]

    assert flags(f) == [None]
    assert set(flags(jax.grad(f))) == {True}
    assert set(flags(jax.vmap(jax.grad(f)))) == {True}
    assert set(flags(jax.grad(lambda x: jax.grad(f)(x).sum()))) == {True}


@pytest.mark.parametrize("where", [pytest.param("gpu", marks=pytest.mark.gpu), "cpu"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layernorm", "rmsnorm"])
def test_auto_mode_takes_a_forward_alone_or_a_pair(op, where, monkeypatch):
    """At 2^22 elements ``auto`` takes each forward kernel alone; under differentiation only
    rmsnorm's, beside its backward kernel (the others' pairs start at 2^23). On the CPU:
    the choice the lowering would make for a GPU (every kernel available)."""
    if where == "cpu":
        monkeypatch.setattr(Kernel, "unavailable", lambda self, mode, platform: None)
    alone, pair = _auto_choices(op, (4096, 1024))
    assert alone == {op: "pallas_rows"}
    kernel = "pallas_rows" if op == "rmsnorm" else "reference"
    assert pair == (kernel, kernel)


def test_default_configs_walk_where_measured_faster():
    """Forward rmsnorm/layernorm programs walk rows of 8192+ (parameters loaded once per
    program), about two per multiprocessor; softmax's programs, and those of narrower rows
    with one parameter vector, do one block. Backward programs at wide rows are one per
    multiprocessor (few partial sums)."""
    default = norms_gpu.RowConfig.default
    for rows, d in ((4096, 16384), (1000, 8192)):
        walk = default(rows, d, backward=False, params=1)
        programs = norms_gpu.Problem(rows, d, walk).programs
        assert walk.row_steps > 1 and norms_gpu._SMS < programs <= 2 * norms_gpu._SMS
        assert default(rows, d, backward=False).row_steps == 1
        back = norms_gpu.Problem(rows, d, default(rows, d, backward=True))
        assert back.programs <= norms_gpu._SMS
    assert default(16384, 4096, backward=False, params=1).row_steps == 1
    assert norms_gpu.Problem(16384, 1024, default(16384, 1024, backward=True)).programs == 512


@pytest.mark.parametrize("d", [1000, 2048, 4096])
def test_default_forward_with_two_parameters_walks_and_prefetches(d):
    """A forward reading two parameter vectors (layernorm's weight and bias) at rows
    narrower than 8192 (padded) walks the one-block tile, about four programs per
    multiprocessor, prefetching; few rows give one block per program. With one vector or
    none it takes one block per program; from 8192 any take the wide rows' walk."""
    default = norms_gpu.RowConfig.default
    rows = 100_000
    got = default(rows, d, backward=False, params=2)
    tile = norms_gpu.RowConfig.blocks(d, max_rows=rows)
    assert (got.block_rows, got.num_warps) == (tile.block_rows, tile.num_warps)
    assert got.prefetch and got.row_steps > 1
    assert 3 * norms_gpu._SMS < norms_gpu.Problem(rows, d, got).programs <= 4 * norms_gpu._SMS
    assert default(100, d, backward=False, params=2).row_steps == 1
    for params in (0, 1):
        assert default(rows, d, backward=False, params=params) == tile
    assert default(rows, 5000, backward=False, params=2) == default(
        rows, 5000, backward=False, params=1
    )


@pytest.mark.parametrize("d, prefetch", [(1024, True), (8192, True), (5000, True), (16384, False)])
def test_default_backward_prefetches_where_measured_faster(d, prefetch):
    """Backward programs prefetch their next block at rows up to 8192 wide (padded); wider
    rows would hold two blocks' tiles in registers. Forward configs without parameters
    never prefetch."""
    default = norms_gpu.RowConfig.default
    assert default(4096, d, backward=True).prefetch is prefetch
    assert not default(4096, d, backward=False).prefetch


def test_vmapped_weight_falls_back_exactly():
    """A vmapped weight is (N, 1, D): the kernels decline it; the reference runs."""
    x, w = rand((3, 4, 64), jnp.bfloat16), rand((3, 64), jnp.float32)
    f = jax.vmap(lambda x, w: ts.rmsnorm(x, w, eps=EPS))
    with ts.kernel_mode("interpret"):
        assert _chosen(f, x, w) == {"rmsnorm": "reference"}
        y = jax.jit(f)(x, w)
    with _compat.enable_x64(True):
        ref = jax.vmap(functools.partial(_f64, "rmsnorm"))(f64(x), f64(w))
    assert_close(y, ref, factor=2)


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(block_rows=3, num_warps=4), "power of two"),
        (dict(block_rows=2, num_warps=64), "power of two"),
        (dict(block_rows=0, num_warps=4), "positive int"),
        (dict(block_rows=2, num_warps=4, row_steps=1.5), "positive int"),
        (dict(block_rows=2, num_warps=4, prefetch=1), "must be a bool"),
    ],
)
def test_row_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        norms_gpu.RowConfig(**kw)
