"""The matmul kernels on the CPU: the Hopper Mosaic GPU kernel in Mosaic GPU interpret mode,
the portable BlockSpec kernel in Pallas interpret mode, gradients through the kernel path,
tile configs, the SM-count rule and the dispatch vocabulary (supports / prefer / hardware).
The kernels are called directly with a :class:`MatmulSpec`, as the operator calls them.
References are float64 numpy.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tessera_jax import _compat
from tessera_jax.contracts.matmul import MatmulSpec
from tessera_jax.pallas_kernels import device
from tessera_jax.pallas_kernels import matmul_configs as mc
from tessera_jax.pallas_kernels import matmul_mgpu as mg
from tessera_jax.pallas_kernels import matmul_portable as mp
from tessera_jax.primitives.matmul import matmul_op
from tests._util import (
    assert_no_serialised_wgmma,
    cuda_lowering,
    f64,
    mosaic_gpu_calls,
    np_activation,
    np_activation_derivative,
    rand,
    sample,
)

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# ||out - ref|| / ||ref|| against float64 on the same (rounded) inputs: the kernels
# accumulate in f32, so the error is the output rounding (bf16 ~2e-3, f16 ~3e-4, f32 ~1e-7).
TOL = {np.dtype(BF16): 1e-2, np.dtype(F16): 2e-3, np.dtype(F32): 1e-5}


@pytest.fixture(autouse=True)
def _watchdog():
    """The interpreter can deadlock when a simulated thread raises: fail loudly instead."""
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def spec_of(out=BF16, **kw) -> MatmulSpec:
    """The spec of a product with output ``out`` (f32 accumulation unless ``kw`` says)."""
    return MatmulSpec(out_dtype=out, **{"accumulate_dtype": F32, **kw})


def reference(spec, a, b, *extras):
    """The ts_matmul contract in float64."""
    bias, res, scale = spec.split(extras)
    a, b = f64(a), f64(b)
    if spec.transpose_a:
        a = np.swapaxes(a, -1, -2)
    if spec.transpose_b:
        b = np.swapaxes(b, -1, -2)
    z = a @ b
    if scale is not None:
        z = z * float(scale)
    if bias is not None:
        z = z + f64(bias)
    z = np_activation(z, spec.activation)
    if res is not None:
        z = z + f64(res)
    return z


def check(out, ref, out_dtype, factor=1.0):
    out = np.asarray(jnp.asarray(out).astype(F32), np.float64)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out))
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= TOL[np.dtype(out_dtype)] * factor, f"relative error {err:.3e}"


def run_mgpu(spec, *args, detect_races=False, **overrides):
    """``mg.matmul(spec, *args)`` in the Mosaic GPU interpreter, under jit."""
    with _compat.gpu_interpret_mode(detect_races=detect_races):
        out = jax.jit(lambda *xs: mg.matmul(spec, *xs, interpret=True, **overrides))(*args)
        return jax.block_until_ready(out)


# --- the Hopper kernel in Mosaic GPU interpret mode ---------------------------------------


def test_mgpu_256x256x128_no_races():
    a, b = rand((256, 128), BF16), rand((128, 256), BF16)
    spec = spec_of()
    out = run_mgpu(spec, a, b, detect_races=True)
    assert _compat.races_detected() is False
    assert out.dtype == BF16
    check(out, reference(spec, a, b), BF16)


def test_interpreter_compiles_a_kernel_body_once():
    """The interpreter's threads and CTAs share one compiled kernel body on jax 0.10 too
    (the compiles were most of the interpreter's time there:
    ``_compat._patch_gpu_interpreter_thread_compiles``)."""
    if _compat.JAX_VERSION >= (0, 11):
        pytest.skip("jax 0.11's interpreter jits a module-level runner: compiled once already")
    assert _compat._patch_gpu_interpreter(), "jax 0.10's interpreter runner changed: see _compat"
    _compat.INTERPRETER_BODIES.clear()
    a, b = rand((256, 128), BF16), rand((128, 256), BF16)
    spec = spec_of()
    check(run_mgpu(spec, a, b), reference(spec, a, b), BF16)
    (body,) = _compat.INTERPRETER_BODIES.values()
    assert body.runs >= 4  # threads × CTAs


def test_interpreter_callbacks_take_numpy_arrays_others_jax_arrays():
    """The Mosaic GPU interpreter's host callbacks get XLA's NumPy arrays as they are
    (``_compat._patch_gpu_interpreter_callback_args``); a user's ``io_callback`` still gets
    jax Arrays on a CPU device, as jax documents."""
    from jax.experimental import io_callback

    if _compat.JAX_VERSION >= (0, 11):
        pytest.skip("jax 0.11's interpreter callbacks take jax Arrays only: not patched")

    _compat._patch_gpu_interpreter()
    seen = {}

    def interpreter(x):
        seen["interpreter"] = x
        return x

    def user(x):
        seen["user"] = x
        return x

    interpreter.__module__ = _compat._INTERPRETER_CALLBACKS + "gpu_callbacks"
    out = jax.ShapeDtypeStruct((2,), jnp.int32)
    f = lambda x: (io_callback(interpreter, out, x), io_callback(user, out, x + 1))
    got = jax.jit(f)(jnp.arange(2, dtype=jnp.int32))
    assert [x.tolist() for x in got] == [[0, 1], [1, 2]]
    assert type(seen["interpreter"]) is np.ndarray
    assert isinstance(seen["user"], jax.Array)
    assert seen["user"].devices() == {jax.devices("cpu")[0]}


@pytest.mark.parametrize(
    "shape,out,pads",
    sample(
        [
            pytest.param((200, 136, 96), F16, 2, id="ragged-200x136x96"),
            pytest.param((200, 128, 64), F32, 0, id="edge-tiles-as-stored-200x128x64"),
            pytest.param((16, 256, 128), BF16, 0, id="skinny-16x256x128"),
        ],
        1,
    ),
)
def test_mgpu_edge_tiles(shape, out, pads):
    # M, N, K not multiples of the tile: TMA zero-fills the edge tiles' loads past the
    # arrays and skips their stores; only a dim over one (8, swizzle row) tile and not whole
    # tiles is padded (here A's K = 96 and B's N = 136, over the 64-column f16 tile).
    m, n, k = shape
    a, b = rand((m, k), F16), rand((k, n), F16)
    spec = spec_of(out)
    jaxpr = jax.make_jaxpr(lambda a, b: mg.matmul(spec, a, b, num_sms=132))(a, b)
    assert str(jaxpr).count(" pad[") == pads
    got = run_mgpu(spec, a, b)
    check(got, reference(spec, a, b), out, factor=100 if out == F32 else 1)


@pytest.mark.parametrize("n,out,width", [(40, BF16, 128), (64, BF16, 128), (16, F32, 64)])
def test_mgpu_narrow_output_is_two_swizzle_rows_wide(n, out, width):
    # On the H100 a bf16 output one 64-column tile wide came back unwritten (zeros): narrow
    # outputs are computed at least two swizzle rows (2 x 128 bytes) wide and cut to N.
    a, b = jax.ShapeDtypeStruct((256, 128), BF16), jax.ShapeDtypeStruct((128, n), BF16)
    jaxpr = jax.make_jaxpr(lambda a, b: mg.matmul(spec_of(out), a, b, num_sms=132))(a, b)
    assert f"out_avals=(ShapedArray({np.dtype(out).name}[1,256,{width}]),)" in str(jaxpr)


@pytest.mark.parametrize(
    "m,n,k,ta,tb,dt,out,extra",
    [
        (200, 136, 96, False, False, F16, F32, None),
        (8000, 8000, 8000, False, False, E4M3, F32, None),
        (8000, 8000, 8000, False, False, BF16, BF16, "bias"),
        (16, 8192, 1000, False, False, BF16, BF16, None),
        (5, 100, 70, True, True, BF16, BF16, "residual"),
        (300, 40, 130, True, False, E5M2, BF16, None),
    ],
)
def test_mgpu_edge_tiles_lower_for_cuda(m, n, k, ta, tb, dt, out, extra):
    # The real Mosaic GPU lowering (TMA descriptors over the arrays as passed), built on this
    # CPU: every ragged shape must reach it in tiles Mosaic accepts.
    a = jax.ShapeDtypeStruct((k, m) if ta else (m, k), dt)
    b = jax.ShapeDtypeStruct((n, k) if tb else (k, n), dt)
    xs = [a, b]
    p = dict(transpose_a=ta, transpose_b=tb)
    if extra == "bias":
        xs.append(jax.ShapeDtypeStruct((n,), BF16))
        p.update(has_bias=True, activation="gelu_tanh")
    elif extra == "residual":
        xs.append(jax.ShapeDtypeStruct((m, n), F32))
        p.update(has_residual=True)
    spec = spec_of(out, **p)
    hlo = cuda_lowering(lambda *xs: mg.matmul(spec, *xs, num_sms=132), *xs)
    assert len(mosaic_gpu_calls(hlo)) == 1


# tB alone is the same kernel path with one flag fewer (and runs on the GPU in -m gpu).
@pytest.mark.parametrize("ta,tb,shape", [(True, True, (200, 136, 96))], ids=["tA-tB-ragged"])
def test_mgpu_transposed_operands(ta, tb, shape):
    m, n, k = shape
    a = rand((k, m) if ta else (m, k), BF16)
    b = rand((n, k) if tb else (k, n), BF16)
    spec = spec_of(F32, transpose_a=ta, transpose_b=tb)
    check(run_mgpu(spec, a, b), reference(spec, a, b), F32, factor=100)


def test_mgpu_transposed_a():
    a, b = rand((128, 256), F16), rand((128, 256), F16)
    spec = spec_of(F16, transpose_a=True)
    check(run_mgpu(spec, a, b), reference(spec, a, b), F16)


def test_mgpu_scale_relu_residual_f32():
    a, b = rand((200, 128), BF16), rand((128, 136), BF16)
    res, scale = rand((200, 136), F32), jnp.float32(0.25)
    spec = spec_of(F32, has_residual=True, has_scale=True, activation="relu")
    check(run_mgpu(spec, a, b, res, scale), reference(spec, a, b, res, scale), F32, factor=100)


def test_mgpu_fp8_e4m3_scaled():
    a, b = rand((256, 128), E4M3), rand((128, 256), E4M3)
    spec = spec_of(F32, has_scale=True)
    scale = jnp.float32(0.5)
    check(run_mgpu(spec, a, b, scale), reference(spec, a, b, scale), F32)


# e5m2 × e4m3 is the same kernel with the operands' formats swapped (lowering checked below).
@pytest.mark.parametrize("da,db", [(E4M3, E5M2)], ids=["e4m3xe5m2"])
def test_mgpu_fp8_mixed(da, db):
    a, b = rand((128, 192), da), rand((192, 256), db)
    check(run_mgpu(spec_of(), a, b), reference(spec_of(), a, b), BF16)


@pytest.mark.parametrize("da,db", [(E4M3, E5M2), (E5M2, E4M3)], ids=["e4m3xe5m2", "e5m2xe4m3"])
def test_mgpu_mixed_fp8_lowering_keeps_fp8_operands(da, db):
    # The real cuda lowering (Mosaic GPU custom call, wgmma included), built on this CPU.
    # From jax 0.11 wgmma takes the e4m3/e5m2 pair as stored; on 0.10 the kernel gets
    # bf16 copies.
    a, b = jax.ShapeDtypeStruct((512, 256), da), jax.ShapeDtypeStruct((256, 512), db)
    calls = mosaic_gpu_calls(
        cuda_lowering(lambda a, b: mg.matmul(spec_of(F32), a, b, num_sms=132), a, b)
    )
    assert len(calls) == 1
    operand_types = re.findall(r": \((tensor<[^)]*)\) ->", calls[0])[0]
    mlir = {np.dtype(E4M3): "f8E4M3FN", np.dtype(E5M2): "f8E5M2"}
    if _compat.MGPU_MIXED_FP8:
        want = f"tensor<1x512x256x{mlir[np.dtype(da)]}>, tensor<1x512x256x{mlir[np.dtype(db)]}>"
    else:  # (B is brought to (N, K) for 8-bit wgmma only)
        want = "tensor<1x512x256xbf16>, tensor<1x256x512xbf16>"
    assert operand_types == want


@pytest.mark.parametrize(
    "a_shape,b_shape",
    sample(
        [
            pytest.param((2, 128, 128), (2, 128, 256), id="batched"),
            pytest.param((3, 40, 128), (128, 256), id="shared-b-folds-into-m"),
        ],
        1,
    ),
)
def test_mgpu_batched(a_shape, b_shape):
    a, b = rand(a_shape, BF16), rand(b_shape, BF16)
    out = run_mgpu(spec_of(), a, b)
    assert out.shape == (*a_shape[:-1], b_shape[-1])
    check(out, reference(spec_of(), a, b), BF16)


def test_mgpu_large_default_config_bias_gelu():
    # The large-shape default (256x128 CTAs, warpgroups along M, delay_release=1; the 2-CTA
    # cluster is dropped by the interpreter) with the bias + activation epilogue.
    cfg = mc.CANDIDATES["bf16_256x128x64_s4_dr1_cn"]
    a, b, bias = rand((512, 128), BF16), rand((128, 256), BF16), rand((256,), BF16)
    spec = spec_of(has_bias=True, activation="gelu_tanh")
    check(run_mgpu(spec, a, b, bias, config=cfg), reference(spec, a, b, bias), BF16)


@pytest.mark.parametrize(
    "activation,out,residual",
    sample([("gelu", BF16, True), ("gelu_tanh", F32, False), ("relu", BF16, True)], 1),
)
def test_mgpu_with_derivative(activation, out, residual):
    # The two-output epilogue: y and act'(z) through the second staging buffer (that y has
    # the one-output kernel's bits: tests/test_gpu_kernels.py, through the operator). An
    # f32 output with a residual needs three 32-bit staging buffers: over shared memory at
    # the default tile.
    a, b = rand((128, 64), BF16), rand((64, 128), BF16, scale=0.2)
    extras = [rand((128,), BF16)] + ([rand((128, 128), BF16)] if residual else [])
    spec = spec_of(out, has_bias=True, has_residual=residual, activation=activation)
    y, d = run_mgpu(spec, a, b, *extras, with_derivative=True)
    assert y.dtype == d.dtype == out
    factor = 100 if out == F32 else 1
    check(y, reference(spec, a, b, *extras), out, factor=factor)
    z = f64(a) @ f64(b) + f64(extras[0])
    check(d, np_activation_derivative(z, activation), out, factor=factor)


def test_portable_with_derivative():
    a, b = rand((2, 40, 48), F32), rand((2, 48, 24), F32)
    bias, res = rand((24,), F32), rand((2, 40, 24), F32)
    spec = spec_of(F32, has_bias=True, has_residual=True, activation="gelu_tanh")
    run = jax.jit(lambda *x: mp.matmul(spec, *x, interpret=True, with_derivative=True))
    y, d = run(a, b, bias, res)
    check(y, reference(spec, a, b, bias, res), F32)
    check(d, np_activation_derivative(f64(a) @ f64(b) + f64(bias), "gelu_tanh"), F32)


def test_supports_the_derivative_output_only_with_an_activation():
    avals = _avals(((256, 128), BF16), ((128, 256), BF16))
    assert "needs an activation" in mg.supports(spec_of(), avals, with_derivative=True)
    assert mg.supports(spec_of(activation="relu"), avals, with_derivative=True) is None
    assert "needs an activation" in mp.supports(spec_of(), avals, with_derivative=True)
    # The second staging buffer counts against shared memory.
    cfg = mc.CANDIDATES["bf16_128x256x64_s4"]
    one = mc.smem_bytes(cfg, BF16, BF16, BF16)
    assert mc.smem_bytes(cfg, BF16, BF16, BF16, outputs=2) - one == mc.epilogue_smem_bytes(
        cfg, BF16, None, False
    )


def test_mgpu_user_tile_shape():
    # (64, 128, 64): warpgroups split N (64 rows each would be 32 < the wgmma M of 64 along M).
    cfg = mc.config_for_tile_shape((64, 128, 64), BF16, BF16)
    assert cfg.wg_dimension == "n" and cfg.wg_tile == (64, 64)
    a, b = rand((128, 128), BF16), rand((128, 256), BF16)
    spec = spec_of(tile_shape=(64, 128, 64))
    check(run_mgpu(spec, a, b), reference(spec, a, b), BF16)


# --- the portable kernel in Pallas interpret mode -----------------------------------------


@pytest.mark.parametrize(
    "ta,tb,dtype,shape",
    [
        (False, False, BF16, (200, 136, 96)),
        (True, True, F16, (96, 72, 40)),
        (False, True, F32, (64, 80, 48)),
    ],
)
def test_portable(ta, tb, dtype, shape):
    m, n, k = shape
    a = rand((k, m) if ta else (m, k), dtype)
    b = rand((n, k) if tb else (k, n), dtype)
    spec = spec_of(F32, transpose_a=ta, transpose_b=tb)
    out = jax.jit(lambda a, b: mp.matmul(spec, a, b, interpret=True))(a, b)
    check(out, reference(spec, a, b), F32, factor=10)


def test_portable_epilogue_batched():
    a, b = rand((2, 100, 64), F32), rand((2, 64, 80), F32)
    bias, res, scale = rand((80,), F32), rand((2, 100, 80), F32), jnp.float32(0.5)
    spec = spec_of(F32, has_bias=True, has_residual=True, has_scale=True, activation="gelu")
    out = jax.jit(lambda *x: mp.matmul(spec, *x, interpret=True))(a, b, bias, res, scale)
    check(out, reference(spec, a, b, bias, res, scale), F32)


# --- the kernel path of ts.op.matmul (TESSERA_KERNELS=interpret) --------------------------


def test_interpret_mode_selects_kernels():
    avals = _avals(((256, 128), BF16), ((128, 256), BF16))
    params = {"spec": spec_of()}
    with ts.kernel_mode("interpret"):
        assert matmul_op.select("cpu", avals, params)[0] == "mosaic_gpu"
        f32 = [jax.core.ShapedArray(a.shape, F32) for a in avals]
        p32 = {"spec": spec_of(F32)}
        assert matmul_op.select("cpu", f32, p32)[0] == "pallas_portable"
    with ts.kernel_mode("auto"):
        assert matmul_op.select("cpu", avals, params)[0] == "reference"


def test_grad_through_kernels():
    # linear with bias + gelu: forward, the recomputed pre-activation and the transposed
    # products of the backward pass all run the Mosaic GPU kernel in the interpreter.
    x, w, b = rand((128, 64), BF16), rand((64, 128), BF16, scale=0.125), rand((128,), BF16)

    def loss(x, w, b):
        y = ts.op.linear(x, w, b, activation="gelu")
        return jnp.sum(y.astype(F32) ** 2)

    with ts.kernel_mode("interpret"):
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)
    with ts.kernel_mode("xla"):
        want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype
        check(g, f64(r), BF16, factor=2)


# --- configs, the SM count and the hardware checks ----------------------------------------


def test_config_is_frozen_and_validated():
    cfg = mc.MatmulConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_m = 64
    with pytest.raises(ValueError, match="register budget"):
        mc.MatmulConfig(block_m=256, block_n=256, wg_dimension="n")
    with pytest.raises(ValueError, match="wgmma M"):
        mc.MatmulConfig(block_m=64, block_n=256, wg_dimension="m")
    with pytest.raises(ValueError, match="num_stages"):
        mc.MatmulConfig(num_stages=1)
    with pytest.raises(ValueError, match="cluster_dimension"):
        mc.MatmulConfig(cluster_dimension="k")


def test_block_k_must_be_a_swizzle_row():
    with pytest.raises(ValueError, match="block_k=32 must be a multiple of 64"):
        mc.fit_stages(mc.MatmulConfig(block_k=32, num_stages=8), BF16, BF16, BF16)
    with pytest.raises(ValueError, match="block_k=64 must be a multiple of 128"):
        mc.fit_stages(mc.MatmulConfig(block_k=64), E4M3, E4M3, F32)


@pytest.mark.parametrize("name", sorted(mc.CANDIDATES))
def test_candidates_fit_the_hardware(name):
    cfg = mc.CANDIDATES[name]
    dt = E4M3 if name.startswith("fp8") else BF16
    fitted = mc.fit_stages(cfg, dt, dt, F32 if dt == E4M3 else BF16)
    assert fitted.num_stages >= 3
    assert mc.smem_bytes(fitted, dt, dt, BF16) <= mc.SMEM_BYTES
    assert cfg.block_k % mc.swizzle_elems(dt) == 0
    assert math.prod(cfg.wg_tile) <= mc.ACC_MAX_ELEMS


def test_default_config_and_candidates():
    h100 = dict(num_sms=device.H100_SMS)
    big = mc.CANDIDATES["bf16_256x128x64_s4_dr1_cn"]
    assert mc.default_config(4096, 4096, 4096, BF16, BF16, **h100) is big
    assert mc.default_config(8192, 8192, 1024, BF16, BF16, **h100) is big
    # below LARGE_MN, or not whole 256x256 cluster tiles: the 1-CTA default
    one_cta = mc.CANDIDATES["bf16_128x256x64_s4"]
    assert mc.default_config(2048, 4096, 4096, BF16, BF16, **h100) is one_cta
    assert mc.default_config(4160, 4096, 4096, BF16, BF16, **h100) is one_cta
    assert mc.default_config(8192, 8192, 8192, E4M3, E4M3, **h100).block_k == 128
    # small M: 128-column tiles while one wave of them covers N, else 256 columns
    assert mc.default_config(16, 8192, 8192, BF16, BF16, **h100).tile_shape == (64, 128, 128)
    assert mc.default_config(16, 28672, 8192, BF16, BF16, **h100).tile_shape == (64, 256, 64)
    assert mc.default_config(16, 8192, 8192, BF16, BF16, num_sms=32).tile_shape == (64, 256, 64)
    assert all(k.startswith("fp8_") for k in mc.candidates_for(E4M3, E5M2))


def test_sm_counts_is_the_one_rule():
    # Interpret mode: a small grid (each simulated warpgroup is a CPU thread), the H100's tiles.
    assert device.sm_counts(interpret=True) == (device.INTERPRET_SMS, device.H100_SMS)
    assert device.sm_counts(interpret=True, override=4) == (4, device.H100_SMS)
    # Compiled: this GPU's count (the H100's where the backend has none), or the override.
    assert device.sm_counts(interpret=False) == (device.num_sms(), device.num_sms())
    assert device.sm_counts(interpret=False, override=32) == (32, 32)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"num_sms={bad!r} must be a positive int"):
            device.sm_counts(interpret=False, override=bad)


@pytest.mark.parametrize("num_sms,grid", [(None, 64), (48, 32)])
def test_mgpu_grid_and_tiles_follow_sm_counts(num_sms, grid):
    # A decode product (M=16, N=8192): 128-column tiles while one wave of them (64) fits the
    # SMs the heuristic assumes, else 256-column ones (32 tiles); the grid is one CTA per SM,
    # at most one per tile. (On this CPU the SM count is the H100's 132.)
    a, b = jax.ShapeDtypeStruct((16, 4096), BF16), jax.ShapeDtypeStruct((4096, 8192), BF16)
    jaxpr = str(jax.make_jaxpr(lambda a, b: mg.matmul(spec_of(), a, b, num_sms=num_sms))(a, b))
    assert re.findall(r"grid=\((\d+),\)", jaxpr) == [str(grid)]


@pytest.mark.parametrize(
    "tile,dtype,out,match",
    [
        ((128, 256, 512), BF16, BF16, "shared-memory limit"),
        ((256, 128, 512), E4M3, F32, "shared-memory limit"),
        # Fits with a bf16 output, not with the larger f32 epilogue staging.
        ((128, 256, 128), BF16, F32, "shared-memory limit"),
        ((128, 512, 128), BF16, BF16, "register budget"),
        ((96, 128, 64), BF16, BF16, "multiple of the wgmma M"),
        ((32, 32, 32), BF16, BF16, "multiple of the wgmma M"),
        ((128, 128, 32), BF16, BF16, "multiple of 64"),
        ((128, 128, 64), E4M3, F32, "multiple of 128"),
        ((128, 96, 64), BF16, BF16, "BN=96 must be a multiple of 64"),
        ((256, 256, 64), BF16, BF16, "register budget"),
    ],
)
def test_supports_declines_tiles_sm90_cannot_run(tile, dtype, out, match):
    # A reason naming the hardware limit, not an exception: the operator then tries the next
    # kernel (or the reference), and names the reason only if nothing can honour the tile.
    spec = spec_of(out, tile_shape=tile)
    avals = _avals(((256, 256), dtype), ((256, 256), dtype))
    reason = mg.supports(spec, avals)
    assert isinstance(reason, str) and re.search(match, reason), reason
    with pytest.raises(ValueError, match=f"matmul_mgpu.matmul: .*{match}"):
        jax.eval_shape(lambda a, b: mg.matmul(spec, a, b), *avals)


@pytest.mark.parametrize(
    "tile,da,db,out",
    [
        ((128, 256, 64), BF16, BF16, BF16),
        ((128, 256, 128), BF16, BF16, BF16),
        ((64, 128, 64), F16, F16, F32),
        ((128, 256, 128), E4M3, E5M2, BF16),
    ],
)
def test_supports_accepts_tiles_sm90_runs(tile, da, db, out):
    avals = _avals(((256, 256), da), ((256, 256), db))
    assert mg.supports(spec_of(out, tile_shape=tile), avals) is None


# --- dispatch -----------------------------------------------------------------------------


def _avals(*shapes_dtypes):
    return [jax.core.ShapedArray(s, d) for s, d in shapes_dtypes]


def test_supports():
    s = spec_of()
    assert mg.supports(s, _avals(((64, 64), BF16), ((64, 64), BF16))) is None
    assert "dtypes" in mg.supports(s, _avals(((64, 64), F32), ((64, 64), F32)))
    assert "dtypes" in mg.supports(s, _avals(((64, 64), BF16), ((64, 64), F16)))
    assert mg.supports(s, _avals(((64, 64), E4M3), ((64, 64), E5M2))) is None


@pytest.mark.parametrize(
    "spec,shapes,match",
    [
        (spec_of(accumulate_dtype=np.float64), ((64, 64), (64, 64)), "accumulate_dtype"),
        (spec_of(np.int32), ((64, 64), (64, 64)), "out_dtype=int32"),
        (spec_of(np.float64), ((64, 64), (64, 64)), "out_dtype=float64"),
        (spec_of(), ((2, 64, 64), (3, 64, 64)), r"batch dims \(2,\) and \(3,\) differ"),
        (spec_of(), ((64,), (64, 64)), "rank 1 and 2"),
    ],
)
def test_supports_names_the_contract_parts_it_declines(spec, shapes, match):
    avals = _avals(*((s, BF16) for s in shapes))
    assert re.search(match, mg.supports(spec, avals))


@pytest.mark.parametrize(
    "shapes", [((0, 64), (64, 32)), ((48, 0), (0, 32)), ((2, 48, 64), (2, 64, 0))]
)
def test_empty_products_take_the_reference(shapes):
    """Neither kernel tiles an empty product (a -1 reshape of a zero-size operand divides by
    zero): they decline it, and the reference gives jnp's empty or zero result."""
    avals = _avals(*((s, BF16) for s in shapes))
    for kernel in (mg, mp):
        assert "empty product" in kernel.supports(spec_of(), avals)
    a, b = (jnp.ones(s, BF16) for s in shapes)
    with ts.kernel_mode("interpret"):
        out = jax.jit(ts.matmul)(a, b)
    np.testing.assert_array_equal(out, jnp.matmul(a, b))


def test_supports_declines_an_integer_residual():
    spec = spec_of(has_bias=True, has_residual=True)
    avals = _avals(((64, 64), BF16), ((64, 64), BF16), ((64,), BF16), ((64, 64), np.int32))
    assert "residual dtype int32" in mg.supports(spec, avals)


def test_hardware():
    assert "not cpu" in mg.hardware("cpu")
    assert mg.hardware("cuda") == (None if device.is_sm90() else "not a Hopper (sm_90) GPU")


def test_portable_supports():
    s = spec_of()
    assert "dtypes" in mp.supports(s, _avals(((64, 64), E4M3), ((64, 64), E4M3)))
    assert mp.supports(s, _avals(((64, 64), F32), ((64, 64), F32))) is None


def test_prefer_follows_the_measurements():
    big = _avals(((8192, 8192), BF16), ((8192, 8192), BF16))
    assert not mg.prefer(spec_of(), big)  # plain bf16: parity with cuBLAS -> XLA
    assert mg.prefer(spec_of(has_bias=True, activation="gelu"), big + _avals(((8192,), BF16)))
    f8 = _avals(((4096, 4096), E4M3), ((4096, 4096), E4M3))
    assert mg.prefer(spec_of(F32), f8)
    mixed = _avals(((4096, 4096), E4M3), ((4096, 4096), E5M2))
    assert not mg.prefer(spec_of(F32), mixed)  # XLA's mixed path is faster
    skinny = _avals(((16, 8192), E4M3), ((8192, 8192), E4M3))
    assert not mg.prefer(spec_of(F32), skinny)
    ragged = _avals(((4000, 4096), E4M3), ((4096, 4100), E4M3))
    assert mg.prefer(spec_of(F32), ragged)  # fp8 edge tiles
    bias = _avals(((8192,), BF16))
    ragged16 = _avals(((8000, 8192), BF16), ((8192, 8192), BF16)) + bias
    assert not mg.prefer(spec_of(has_bias=True), ragged16)  # a tie with XLA: XLA
    # decode (M <= 64): ahead at 4096 <= K <= 8192 with one wave of tiles over N
    assert mg.prefer(spec_of(), _avals(((16, 8192), BF16), ((8192, 8192), BF16)))
    assert mg.prefer(spec_of(), _avals(((4, 16, 8192), BF16), ((8192, 8192), BF16)))
    assert not mg.prefer(spec_of(), _avals(((16, 28672), BF16), ((28672, 8192), BF16)))
    assert not mg.prefer(spec_of(), _avals(((16, 8192), BF16), ((8192, 28672), BF16)))
    assert not mg.prefer(spec_of(), _avals(((16, 8192), BF16), ((8192, 1024), BF16)))
    assert not mp.prefer(spec_of(), big)


# The matmul kernel's forms: plain, both transposes, the full epilogue, the activation's
# derivative, the rmsnorm row scale, 8-bit operands and a few-row (decode) product.
_PTXAS_CHILD = """
import jax, jax.numpy as jnp, numpy as np
from tessera_jax.contracts.matmul import MatmulSpec
from tessera_jax.pallas_kernels import matmul_mgpu as mg
bf, f32, e4 = jnp.bfloat16, np.float32, jnp.float8_e4m3fn
def spec(**kw):
    return MatmulSpec(out_dtype=bf, accumulate_dtype=f32, **kw)
def compile_(s, shapes, dtype=bf, **kw):
    args = [jnp.ones(x, dtype if i < 2 else f32) for i, x in enumerate(shapes)]
    jax.jit(lambda *x: mg.matmul(s, *x, **kw)).lower(*args).compile()
compile_(spec(), [(4096, 4096), (4096, 4096)])
compile_(spec(transpose_a=True, transpose_b=True), [(1024, 2048), (4096, 1024)])
full = spec(activation="gelu", has_bias=True, has_residual=True, has_scale=True)
compile_(full, [(2048, 1024), (1024, 4096), (4096,), (2048, 4096), ()])
compile_(spec(activation="relu"), [(2048, 1024), (1024, 4096)], with_derivative=True)
compile_(spec(), [(2048, 1024), (1024, 4096)], row_scale=jnp.ones((2048,), f32))
compile_(spec(transpose_b=True), [(4096, 4096), (4096, 4096)], dtype=e4)
compile_(spec(), [(64, 4096), (4096, 8192)])
print("compiled")
"""


@pytest.mark.gpu
def test_no_kernel_serialises_its_wgmmas():
    """ptxas serialises a kernel's wgmma products when other instructions write registers
    that an in-flight product reads (warning C7513; see test_attention_kernels.py). The
    matmul kernel's forms may not draw it either: the epilogues read the accumulator."""
    assert_no_serialised_wgmma(_PTXAS_CHILD, kernels=7)
