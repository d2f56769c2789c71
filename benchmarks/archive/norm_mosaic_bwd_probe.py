"""Probe: why the Mosaic GPU norm backward kernels (pallas_kernels/norms_mgpu.py) trail at
wide rows (rmsnorm's pair 0.25x jnp at 4096x16384 host-timed, norm-mosaic-host-h200.txt).
On one H200: ptxas's spill report for each backward kernel (Mosaic GPU prints it with
``MOSAIC_GPU_DUMP_PTXAS=1``) at rows of 4096, 8192 and 16384, then the backward kernel
alone, host-timed, with 4, 16 and 64 rows a CTA (fewer CTAs: fewer rows of f32 column
sums written for the tree) and with the default tiling (``mgpu[default]``, which this probe
led to: about a wave of resident CTAs), beside the Triton backward (``norms_gpu``), dx's
bits compared across the row counts.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/norm_mosaic_bwd_probe.py 2>&1 \\
        | grep -E "^(=====|bwd)|bytes stack frame"
"""

import functools
import os
import sys

os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import time_interleaved
from tessera_jax.pallas_kernels import norms_gpu, norms_mgpu

EPS = 1e-5
SHAPES = ((32768, 4096), (8192, 8192), (4096, 16384))
ROWS = (4, 16, 64, None)  # None: MosaicRowConfig.default


def spec(op, d):
    kw = dict(eps=EPS, has_weight=True, weight_grad_shape=(d,))
    if op == "layernorm":
        kw.update(has_bias=True, bias_grad_shape=(d,))
    return tuple(sorted(kw.items()))


def operands(shape):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], shape, jnp.bfloat16)
    w = (1 + 0.1 * jax.random.normal(k[1], shape[-1:], jnp.float32)).astype(jnp.bfloat16)
    ct = jax.random.normal(k[2], shape, jnp.bfloat16)
    return x, w, ct


print(jax.devices()[0].device_kind, jax.__version__)
for op in ("rmsnorm", "layernorm"):
    for shape in SHAPES:
        x, w, ct = operands(shape)
        s = spec(op, shape[-1])
        fns = {}
        for rows in ROWS:
            cfg = rows and norms_mgpu.MosaicRowConfig(rows=rows)
            f = jax.jit(functools.partial(getattr(norms_mgpu, f"{op}_bwd"), s, config=cfg))
            print(f"===== {op} {shape} rows={rows}", flush=True)
            jax.block_until_ready(f(x, w, ct))  # compile: ptxas reports here
            fns[f"mgpu[r{rows}]" if rows else "mgpu[default]"] = f
        fns["triton"] = jax.jit(functools.partial(getattr(norms_gpu, f"{op}_bwd"), s))
        outs = {k: f(x, w, ct) for k, f in fns.items()}
        ref = outs["triton"]
        same = all(np.array_equal(outs[k][0], outs["mgpu[r4]"][0]) for k in fns if "mgpu" in k)
        errs = {
            k: max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(o, ref)
            )
            for k, o in outs.items()
        }
        times = time_interleaved(fns, (x, w, ct), repeats=3, target_ms=30)
        base = times["triton"]
        row = "  ".join(
            f"{k} {t * 1e3:8.1f}us x{base / t:.3f} err {errs[k]:.1e}" for k, t in times.items()
        )
        print(f"bwd {op:9s} {shape[0]}x{shape[1]:<6d} {row}  dx_same_bits={same}", flush=True)
