"""Probe: why the Mosaic GPU norm backward kernels (pallas_kernels/norms_mgpu.py) trail at
wide rows (rmsnorm's pair 0.25x jnp at 4096x16384 host-timed, norm-mosaic-host-h200.txt).
On one H200: ptxas's spill report for each backward kernel (Mosaic GPU prints it with
``MOSAIC_GPU_DUMP_PTXAS=1``) at rows of 4096, 8192 and 16384, then the backward kernel
alone, host-timed, with 4, 16 and 64 rows a CTA (fewer CTAs: fewer rows of f32 column
sums written for the tree) and with the default tiling (``mgpu[default]``, which this probe
led to: about a wave of resident CTAs), beside the Triton backward (``norms_gpu``), dx's
bits compared across the row counts. With ``fwd`` the forward kernels instead, by rows a CTA. Either
way ``+pp`` marks a config that loads the weight and bias for each row
(``MosaicRowConfig.params_per_row``) and ``+smem`` one that keeps the backward's column sums
in shared memory (``sums_in_smem``): both hold fewer registers across the walk.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/norm_mosaic_bwd_probe.py [fwd] 2>&1 \\
        | grep -E "^(=====|bwd|fwd)|bytes stack frame"
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
MODE = "fwd" if sys.argv[1:] == ["fwd"] else "bwd"
# (rows a CTA, params_per_row, sums_in_smem); rows None: MosaicRowConfig.default's
CONFIGS = [(4, False, False), (16, False, False), (64, False, False)]
CONFIGS += [(None, pp, smem) for smem in (False, True) for pp in (False, True)]
if MODE == "fwd":
    CONFIGS = [(1, False, False), (4, False, False), (4, True, False), (16, True, False)]


def spec(op, d):
    kw = dict(eps=EPS, has_weight=True)
    if op == "layernorm":
        kw["has_bias"] = True
    if MODE == "bwd":
        kw["weight_grad_shape"] = (d,)
        if op == "layernorm":
            kw["bias_grad_shape"] = (d,)
    return tuple(sorted(kw.items()))


def operands(op, shape):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], shape, jnp.bfloat16)
    w = (1 + 0.1 * jax.random.normal(k[1], shape[-1:], jnp.float32)).astype(jnp.bfloat16)
    if MODE == "bwd":
        return x, w, jax.random.normal(k[2], shape, jnp.bfloat16)
    b = jax.random.normal(k[2], shape[-1:], jnp.bfloat16)
    return (x, w, b) if op == "layernorm" else (x, w)


def config(rows, pp, smem, n, d):
    if rows is None:
        rows = norms_mgpu.MosaicRowConfig.default(n, d, partials=MODE == "bwd").rows
    return norms_mgpu.MosaicRowConfig(rows=rows, params_per_row=pp, sums_in_smem=smem)


print(jax.devices()[0].device_kind, jax.__version__)
for op in ("rmsnorm", "layernorm"):
    name = op if MODE == "fwd" else f"{op}_bwd"
    for shape in SHAPES:
        args = operands(op, shape)
        s = spec(op, shape[-1])
        fns = {}
        for rows, pp, smem in CONFIGS:
            cfg = config(rows, pp, smem, *shape)
            f = jax.jit(functools.partial(getattr(norms_mgpu, name), s, config=cfg))
            tag = "default" if rows is None else f"r{rows}"
            key = f"mgpu[{tag}{'+pp' if pp else ''}{'+smem' if smem else ''}]"
            print(f"===== {name} {shape} {key} rows={cfg.rows}", flush=True)
            jax.block_until_ready(f(*args))  # compile: ptxas reports here
            fns[key] = f
        fns["triton"] = jax.jit(functools.partial(getattr(norms_gpu, name), s))
        outs = {k: jax.tree.leaves(f(*args)) for k, f in fns.items()}
        ref, first = outs["triton"], outs[next(iter(fns))]
        same = all(np.array_equal(outs[k][0], first[0]) for k in fns if "mgpu" in k)
        errs = {
            k: max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(o, ref)
            )
            for k, o in outs.items()
        }
        times = time_interleaved(fns, args, repeats=3, target_ms=30)
        base = times["triton"]
        row = "  ".join(
            f"{k} {t * 1e3:8.1f}us x{base / t:.3f} err {errs[k]:.1e}" for k, t in times.items()
        )
        print(f"{MODE} {op:9s} {shape[0]}x{shape[1]:<6d} {row}  same_bits={same}", flush=True)
