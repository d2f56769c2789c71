"""Probe: rmsnorm_matmul_rms_probe.py with A fed to wgmma from the registers its row
squares are summed from (matmul-row-rms-regs.patch, on top of matmul-row-rms.patch: A
leaves shared memory once instead of twice), against the shipped form, one H200, M x 4096
@ 4096 x N bf16, at three shapes, two timed rounds in opposite orders.

    git apply benchmarks/archive/matmul-row-rms.patch
    git apply benchmarks/archive/matmul-row-rms-regs.patch
    PYTHONUNBUFFERED=1 python3 benchmarks/archive/rmsnorm_matmul_rms_regs_probe.py
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import normal, time_interleaved
from benchmarks.norms import xla_op
from tessera_jax.pallas_kernels import matmul_mgpu, norms_gpu
from tessera_jax.primitives import rmsnorm_matmul as rmm

print(jax.devices()[0].device_kind, flush=True)
EPS = 1e-5
spec = rmm.RMSNormMatmulSpec(EPS, jnp.bfloat16, jnp.float32)
K = 4096


def wb_of(w, b):
    return (w[:, None] * b.astype(jnp.float32)).astype(b.dtype)


def old(x, w, b):
    r = jax.lax.rsqrt(norms_gpu.row_dot(x, x) / np.float32(K) + np.float32(EPS))
    return matmul_mgpu.matmul(spec.product, x, wb_of(w, b), row_scale=r), r


def new(x, w, b):
    return matmul_mgpu.matmul(spec.product, x, wb_of(w, b), row_rms_eps=EPS)


for m, n in ((16384, 1024), (16384, 4096), (8192, 1024)):
    x = normal(0, (m, K), jnp.bfloat16)
    w = normal(1, (K,), jnp.float32) + 1.0
    b = (normal(2, (K, n), jnp.float32) / 64).astype(jnp.bfloat16)
    fo, fn = jax.jit(old), jax.jit(new)
    (oo, ro), (on, rn) = fo(x, w, b), fn(x, w, b)
    xs = np.asarray(x[:512], np.float64)
    r64 = 1 / np.sqrt(np.mean(xs * xs, -1) + EPS)
    ref = np.asarray(
        jax.jit(lambda x, w, b: rmm.rmsnorm_matmul_reference(x, w, b, spec=spec))(x, w, b),
        np.float64,
    )
    scale = np.max(np.abs(ref))
    same = all(np.array_equal(np.asarray(a), np.asarray(c)) for a, c in zip(fn(x, w, b), (on, rn)))
    print(
        f"M{m} N{n}: r err old {np.max(np.abs(np.asarray(ro[:512]) - r64) / r64):.2e} "
        f"new {np.max(np.abs(np.asarray(rn[:512]) - r64) / r64):.2e}; out err vs unfused "
        f"old {np.max(np.abs(np.asarray(oo, np.float64) - ref)) / scale:.2e} "
        f"new {np.max(np.abs(np.asarray(on, np.float64) - ref)) / scale:.2e}; "
        f"new repeats bits {same}; old==new out bits {np.array_equal(np.asarray(oo), np.asarray(on))}",
        flush=True,
    )
    fns = {
        "xla norm-then-dot": jax.jit(lambda x, w, b: xla_op("rmsnorm", x, w) @ b),
        "cublas dot": jax.jit(lambda x, w, b: x @ b),
        "fused old": jax.jit(lambda x, w, b: old(x, w, b)[0]),
        "fused new": jax.jit(lambda x, w, b: new(x, w, b)[0]),
    }
    for rnd in range(2):
        ms = time_interleaved(fns, (x, w, b), repeats=5, target_ms=30)
        base = ms["xla norm-then-dot"]
        print(
            f"M{m} N{n} round {rnd}: "
            + "  ".join(f"{k} {v * 1e3:.1f}us ({base / v:.3f})" for k, v in ms.items()),
            flush=True,
        )
        fns = dict(reversed(list(fns.items())))  # the other order: a drift within a round shows
