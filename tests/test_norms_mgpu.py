"""The Mosaic GPU row kernels (``pallas_kernels/norms_mgpu.py``), forward and backward,
against float64: in the Mosaic GPU interpreter on the CPU with race detection, lowered for
cuda on this CPU machine, and compiled on a GPU (marker ``gpu``). The operators take them
only where the Triton kernels cannot run (tests/test_core.py's jax without Triton runs one
through its operator), so these tests call the kernels directly."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import tessera_jax as ts
from tessera_jax import _compat
from tessera_jax.pallas_kernels import device, norms_mgpu
from tests._util import assert_close, cuda_lowering, f64, mosaic_gpu_calls, rand
from tests.test_norm_kernels import (
    OPS,
    _f64,
    _fwd_spec,
    _nan_equal_close,
    _non_finite_operands,
    _operands,
    _ts,
)

# (shape, dtype, rows a CTA walks): a ragged last CTA in bf16 (15 rows by 4), rows of a
# length whose vectors are narrow (384 = 3 elements a thread) in f32, a single row (an x of
# the weight's shape), one row a CTA in f16. The interpreter runs the first three.
CASES = [
    ((3, 5, 256), jnp.bfloat16, 4),
    ((7, 384), jnp.float32, 3),
    ((256,), jnp.bfloat16, 2),
    ((2, 1024), jnp.float16, 1),
]


def _kernel(name: str, spec: tuple, rows: int, **config):
    """Kernel ``name`` of ``norms_mgpu`` with its bind parameters, ``rows`` a CTA."""
    config = norms_mgpu.MosaicRowConfig(rows=rows, **config)
    return functools.partial(getattr(norms_mgpu, name), spec, config=config)


def _run(call, args, *, interpret: bool):
    """``call(*args)`` jitted; in the interpreter, with race detection, asserting none."""
    run = jax.jit(lambda *a: call(*a, interpret=interpret))
    if not interpret:
        return run(*args)
    with _compat.gpu_interpret_mode(detect_races=True):
        out = jax.block_until_ready(run(*args))
        assert not _compat.races_detected()
    return out


def _check_forward(op, shape, dtype, rows, *, interpret: bool):
    args = _operands(op, shape, dtype)
    got = _run(_kernel(op, _fwd_spec(op), rows), args, interpret=interpret)
    with _compat.enable_x64(True):
        want = _f64(op, *map(f64, args))
    assert got.dtype == args[0].dtype and got.shape == args[0].shape
    assert_close(got, want, factor=2)


def _bwd_spec(op: str, d: int) -> tuple:
    """The backward kernel's bind parameters: the forward's, and the parameter gradients."""
    if op.endswith("softmax"):
        return _fwd_spec(op)
    grads = dict(weight_grad_shape=(d,)) | (dict(bias_grad_shape=(d,)) if op == "layernorm" else {})
    return tuple(sorted((dict(_fwd_spec(op)) | grads).items()))


def _check_backward(op, shape, dtype, rows, *, interpret: bool):
    """dx (and the f32 weight and bias gradients) against float64: for the norms jax's own
    derivative of the float64 formula, for softmax the formula of dx from the saved output
    (a ``y`` given in ``dtype``)."""
    args, ct = _operands(op, shape, dtype), rand(shape, dtype)
    if op.endswith("softmax"):
        with _compat.enable_x64(True):
            y = _f64(op, f64(args[0])).astype(dtype)
        operands = (y, ct)
        y64, g64 = f64(y), f64(ct)
        if op == "log_softmax":
            want = (g64 - np.exp(y64) * g64.sum(-1, keepdims=True),)
        else:
            want = (y64 * (g64 - (y64 * g64).sum(-1, keepdims=True)),)
    else:
        operands = (args[0], args[1], ct)  # x, weight, cotangent
        with _compat.enable_x64(True):
            _, pull = jax.vjp(functools.partial(_f64, op), *map(f64, args))
            want = pull(f64(ct))
    bwd = _kernel(f"{op}_bwd", _bwd_spec(op, shape[-1]), rows)
    got = _run(bwd, operands, interpret=interpret)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    assert got[0].dtype == dtype and got[0].shape == shape
    for g, w in zip(got, want):
        # f32 parameter gradients sum over the rows: allow a few roundings per element
        assert_close(g, w, factor=4 if g.dtype == jnp.bfloat16 else 20)


def _check_non_finite_rows(op, *, interpret: bool):
    """A NaN or ``±inf`` row gives a NaN row (softmax: a ``-inf`` element is fine, a fully
    ``-inf`` row gives zeros / ``-inf``), a row whose squares overflow f32 takes the
    rescaled statistics: the values of the operator's XLA reference."""
    args = _non_finite_operands(op, 128)
    got = _run(_kernel(op, _fwd_spec(op), 4), args, interpret=interpret)
    with ts.kernel_mode("xla"):
        want = jax.jit(functools.partial(_ts, op))(*args)
    _nan_equal_close(got, want, 2e-2)


def _check_rows_keep_their_bits(op, *, interpret: bool):
    """A row's bits, forward and dx, do not depend on how many rows the launch has, nor
    where the row falls in a CTA's walk (a mesh's shard of rows gets the same bits); the
    backward repeats bit for bit."""
    args = _operands(op, (9, 512), jnp.bfloat16)
    whole = np.asarray(_run(_kernel(op, _fwd_spec(op), 4), args, interpret=interpret))
    part_args = (args[0][2:7], *args[1:])
    part = np.asarray(_run(_kernel(op, _fwd_spec(op), 3), part_args, interpret=interpret))
    np.testing.assert_array_equal(part, whole[2:7])
    # The backward: dx likewise, and every output (the parameter gradients' per-CTA sums
    # and their tree included) the same bits in a second run.
    ct = rand((9, 512), jnp.bfloat16)
    saved = whole if op.endswith("softmax") else args[0]
    operands = (saved, ct) if op.endswith("softmax") else (saved, args[1], ct)
    # (the default tiling, which walks as many rows a CTA as one wave needs)
    bwd = functools.partial(getattr(norms_mgpu, f"{op}_bwd"), _bwd_spec(op, 512))
    runs = [jax.tree.leaves(_run(bwd, operands, interpret=interpret)) for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    part_ops = tuple(o[2:7] if o.shape == ct.shape else o for o in operands)
    part_dx = jax.tree.leaves(
        _run(_kernel(f"{op}_bwd", _bwd_spec(op, 512), 3), part_ops, interpret=interpret)
    )[0]
    np.testing.assert_array_equal(np.asarray(part_dx), np.asarray(runs[0][0])[2:7])


@pytest.mark.parametrize("shape, dtype, rows", CASES[:3])
@pytest.mark.parametrize("op", OPS)
def test_forward_interpret(op, shape, dtype, rows):
    _check_forward(op, shape, dtype, rows, interpret=True)


@pytest.mark.parametrize("shape, dtype, rows", CASES[:3])
@pytest.mark.parametrize("op", OPS)
def test_backward_interpret(op, shape, dtype, rows):
    _check_backward(op, shape, dtype, rows, interpret=True)


@pytest.mark.parametrize("op", OPS)
def test_non_finite_rows_interpret(op):
    _check_non_finite_rows(op, interpret=True)


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "softmax"])
def test_rows_keep_their_bits_interpret(op):
    _check_rows_keep_their_bits(op, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype, rows", CASES)
@pytest.mark.parametrize("op", OPS)
def test_forward(op, shape, dtype, rows):
    _check_forward(op, shape, dtype, rows, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype, rows", CASES)
@pytest.mark.parametrize("op", OPS)
def test_backward(op, shape, dtype, rows):
    _check_backward(op, shape, dtype, rows, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_non_finite_rows(op):
    _check_non_finite_rows(op, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_rows_keep_their_bits(op):
    _check_rows_keep_their_bits(op, interpret=False)


@pytest.mark.parametrize("d", [768, 4096])
@pytest.mark.parametrize("op", OPS)
def test_kernels_lower_for_cuda(op, d):
    """Each kernel, forward and backward, goes through Mosaic GPU's lowering (layouts,
    reductions, loop carries) on this CPU."""
    args = _operands(op, (16, d), jnp.bfloat16)
    text = cuda_lowering(_kernel(op, _fwd_spec(op), 4), *args)
    assert len(mosaic_gpu_calls(text)) == 1, op
    ct = args[0]
    operands = (args[0], ct) if op.endswith("softmax") else (args[0], args[1], ct)
    text = cuda_lowering(_kernel(f"{op}_bwd", _bwd_spec(op, d), 4), *operands)
    assert len(mosaic_gpu_calls(text)) == 1, f"{op}_bwd"


def test_supports_declines_with_reasons():
    spec = (("eps", 1e-5), ("has_weight", True))
    x, w = jax.ShapeDtypeStruct((4, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256,), jnp.float32)
    assert norms_mgpu.supports(spec, [x, w]) is None
    odd = jax.ShapeDtypeStruct((4, 200), jnp.bfloat16)
    w_odd = jax.ShapeDtypeStruct((200,), jnp.float32)
    assert "multiples of 128" in norms_mgpu.supports(spec, [odd, w_odd])
    wide = jax.ShapeDtypeStruct((4, 32768), jnp.bfloat16)
    w_wide = jax.ShapeDtypeStruct((32768,), jnp.float32)
    assert "does not fit" in norms_mgpu.supports(spec, [wide, w_wide])  # norms_gpu's reason
    f64_x = jax.ShapeDtypeStruct((4, 256), np.float64)
    assert "bf16, f16 and f32" in norms_mgpu.supports(spec, [f64_x, w])


@pytest.mark.parametrize("rows", [0, -1, 2.0, True])
def test_config_validation(rows):
    with pytest.raises(ValueError, match=f"MosaicRowConfig: rows={rows!r} must be a positive"):
        norms_mgpu.MosaicRowConfig(rows=rows)
    for knob in ("params_per_row", "sums_in_smem"):
        with pytest.raises(TypeError, match=f"MosaicRowConfig: {knob}=1 must be a bool"):
            norms_mgpu.MosaicRowConfig(**{knob: 1})


def _check_knobs_keep_the_bits(op, shape, *, interpret: bool):
    """The weight and bias loaded for each row (forward and backward), and the backward's
    column sums kept in shared memory, give the bits of the default forms (the parameter
    gradients too); in the interpreter those forms also lower for cuda."""
    args = _operands(op, shape, jnp.bfloat16)
    ct = rand(shape, jnp.bfloat16)
    bwd = (f"{op}_bwd", _bwd_spec(op, shape[-1]), (args[0], args[1], ct))
    for name, spec, operands, knobs in (
        (op, _fwd_spec(op), args, dict(params_per_row=True)),
        (*bwd, dict(params_per_row=True)),
        (*bwd, dict(sums_in_smem=True)),
        (*bwd, dict(params_per_row=True, sums_in_smem=True)),
    ):
        base, other = (
            _run(_kernel(name, spec, 3, **k), operands, interpret=interpret) for k in ({}, knobs)
        )
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(other), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if interpret:
            text = cuda_lowering(_kernel(name, spec, 3, **knobs), *operands)
            assert len(mosaic_gpu_calls(text)) == 1, (name, knobs)


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_config_knobs_keep_the_bits_interpret(op):
    _check_knobs_keep_the_bits(op, (7, 256), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(40, 4096), (20, 16384)])
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_config_knobs_keep_the_bits(op, shape):
    """On the GPU, at rows whose sums take 16-64 KB of shared memory each."""
    _check_knobs_keep_the_bits(op, shape, interpret=False)


@pytest.mark.parametrize(
    "op, weight, want",
    [
        ("rmsnorm", True, ()),  # x's gradient alone
        ("rmsnorm", False, ()),
        ("layernorm", True, ("weight",)),
        ("layernorm", True, ("bias",)),
        ("layernorm", False, ("bias",)),
    ],
)
def test_backward_returns_the_gradients_asked_for_interpret(op, weight, want):
    """The backward returns dx and only the parameter gradients its bind asks for (the
    others are neither carried nor written), each against float64, with the default tiling;
    each such kernel lowers for cuda."""
    d = 256
    x, w, *b = _operands(op, (5, d), jnp.float32)
    ct = rand(x.shape, x.dtype)
    kw = dict(_bwd_spec(op, d)) | dict(has_weight=weight)
    for p in ("weight", "bias"):
        if f"{p}_grad_shape" in kw and p not in want:
            kw[f"{p}_grad_shape"] = None
    bwd = functools.partial(getattr(norms_mgpu, f"{op}_bwd"), tuple(sorted(kw.items())))
    operands = (x, w, ct) if weight else (x, ct)
    got = _run(bwd, operands, interpret=True)
    assert len(mosaic_gpu_calls(cuda_lowering(bwd, *operands))) == 1  # and it lowers
    params = [w if weight else jnp.ones_like(w), *b]
    with _compat.enable_x64(True):
        _, pull = jax.vjp(functools.partial(_f64, op), *map(f64, [x, *params]))
        dx, dw, *db = pull(f64(ct))
    want_grads = [dx] + [dw] * ("weight" in want) + db * ("bias" in want)
    assert len(got) == len(want_grads)
    for g, r in zip(got, want_grads):
        assert_close(g, r, factor=20)


def test_default_tiling_launches_about_a_wave_for_column_sums():
    """Without a config, kernels that write column sums walk enough rows a CTA for about
    one wave of resident CTAs (wider rows: fewer fit); the others walk 4 rows a CTA."""
    default, sms = norms_mgpu.MosaicRowConfig.default, device.H100_SMS
    assert default(32768, 4096, partials=False).rows == 4
    for n, d, per_sm in ((32768, 4096, 4), (8192, 8192, 4), (4096, 16384, 4), (65536, 1024, 16)):
        rows = default(n, d, partials=True).rows
        assert pl.cdiv(n, rows) <= sms * per_sm < pl.cdiv(n, rows - 1), (n, d)
    assert default(16384, 2048, partials=True).rows == pl.cdiv(16384, sms * 8)
    assert default(3, 256, partials=True).rows == 1
