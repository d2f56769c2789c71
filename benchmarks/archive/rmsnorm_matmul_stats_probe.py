"""``ts.rmsnorm_matmul``'s fused kernel with its row statistics from the row kernel
(``rmsnorm_matmul.mean_square`` on ``norms_gpu.row_dot``) against XLA's ``jnp.mean`` (what
the kernel used before), swapped in, in one process; beside XLA's norm-then-dot and the
statistics alone. Also whether the statistics keep their bits for a launch of the first
half of the rows and from a second compilation. Timing: ``benchmarks/_common``'s
``time_interleaved``. Run on the GPU machine from the repository root::

    PYTHONPATH=$PWD python3 benchmarks/archive/rmsnorm_matmul_stats_probe.py
"""

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts
from benchmarks._common import time_interleaved
from tessera_jax.primitives import rmsnorm_matmul as rm

BF16, F32 = jnp.bfloat16, jnp.float32
row_kernel = rm.mean_square


def xla_mean(x2, *, interpret=False):
    xc = x2.astype(F32)
    return jnp.mean(xc * xc, axis=-1)


def rand(seed, shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape, F32) * scale).astype(dtype)


def norm_then_dot(x, w, b):
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w
    return jnp.dot(y.astype(BF16), b)


for m, k, n in ((16384, 4096, 1024), (16384, 4096, 4096), (8192, 8192, 1024), (16384, 2048, 1024)):
    x, w, b = rand(1, (m, k), BF16, 2.0), rand(3, (k,), F32) + 1.0, rand(5, (k, n), BF16, k**-0.5)
    ms_full = jax.jit(row_kernel)(x)
    same_half = np.array_equal(
        np.asarray(ms_full[: m // 2]), np.asarray(jax.jit(row_kernel)(x[: m // 2]))
    )
    same_again = np.array_equal(
        np.asarray(ms_full), np.asarray(jax.jit(lambda a: row_kernel(a))(x))
    )
    ref = np.mean(np.asarray(x, np.float64) ** 2, -1)
    err = float(np.max(np.abs(np.asarray(ms_full) - ref) / ref))
    fns = {}
    with ts.kernel_mode("pallas"):
        rm.mean_square = row_kernel
        fns["fused[row kernel]"] = (
            jax.jit(functools.partial(ts.rmsnorm_matmul, eps=1e-6)).lower(x, w, b).compile()
        )
        rm.mean_square = xla_mean
        fns["fused[jnp.mean]"] = (
            jax.jit(functools.partial(ts.rmsnorm_matmul, eps=1e-6)).lower(x, w, b).compile()
        )
        rm.mean_square = row_kernel
    fns["xla norm-then-dot"] = jax.jit(norm_then_dot)
    fns["stats row kernel"] = jax.jit(lambda x, w, b: row_kernel(x))
    fns["stats jnp.mean"] = jax.jit(lambda x, w, b: xla_mean(x))
    ms = time_interleaved(fns, (x, w, b), repeats=5, target_ms=40, warmup_ms=100)
    base = ms["xla norm-then-dot"]
    print(
        f"== {m}x{k}x{n}: stats err {err:.1e}, same bits for half the rows {same_half}, second compile {same_again}"
    )
    for nm, t in ms.items():
        print(f"   {nm:20s} {t:.4f} ms  x{base / t:.3f} of XLA norm-then-dot")
