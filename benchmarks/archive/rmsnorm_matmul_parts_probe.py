"""Probe: the Mosaic GPU matmul plain and row-scaled (the heuristic's config) against
cuBLAS's dot, and the fused forward's other parts (row statistics, the weight·b pass),
M 16384 K 4096 bf16, N 1024 / 4096 / 12288, one H200; three rounds, the second in reverse
order, the third rotated, so that a drift within a round shows.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/rmsnorm_matmul_parts_probe.py
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import normal, time_interleaved
from benchmarks.norms import xla_op
from tessera_jax.pallas_kernels import matmul_mgpu
from tessera_jax.primitives import rmsnorm_matmul as rmm

print(jax.devices()[0].device_kind, flush=True)
M, K = 16384, 4096
spec = rmm.RMSNormMatmulSpec(1e-5, jnp.bfloat16, jnp.float32)
for n in (1024, 4096, 12288):
    x = normal(0, (M, K), jnp.bfloat16)
    w = normal(1, (K,), jnp.float32) + 1.0
    b = (normal(2, (K, n), jnp.float32) / 64).astype(jnp.bfloat16)
    r = jax.random.uniform(jax.random.key(3), (M,), jnp.float32, 0.5, 1.5)
    fns = {
        "xla norm-then-dot": jax.jit(lambda x, w, b, r: xla_op("rmsnorm", x, w) @ b),
        "cublas dot": jax.jit(lambda x, w, b, r: x @ b),
        "mgpu plain": jax.jit(lambda x, w, b, r: matmul_mgpu.matmul(spec.product, x, b)),
        "mgpu row-scaled": jax.jit(
            lambda x, w, b, r: matmul_mgpu.matmul(spec.product, x, b, row_scale=r)
        ),
        "stats": jax.jit(lambda x, w, b, r: rmm.mean_square(x)),
        "weight*b": jax.jit(
            lambda x, w, b, r: (w[:, None] * b.astype(jnp.float32)).astype(b.dtype)
        ),
        "fused (pallas)": jax.jit(lambda x, w, b, r: rmm.fused_kernel(spec, x, w, b)),
    }
    names = list(fns)
    orders = [names, names[::-1], names[3:] + names[:3]]
    res = {k: [] for k in names}
    for order in orders:
        ms = time_interleaved({k: fns[k] for k in order}, (x, w, b, r), repeats=5, target_ms=30)
        for k, v in ms.items():
            res[k].append(v * 1e3)
    base = res["xla norm-then-dot"]
    for k in names:
        print(
            f"N{n:6d} {k:20s} "
            + " ".join(f"{t:8.1f}" for t in res[k])
            + "  xla/this "
            + " ".join(f"{b_ / t:.3f}" for b_, t in zip(base, res[k])),
            flush=True,
        )
