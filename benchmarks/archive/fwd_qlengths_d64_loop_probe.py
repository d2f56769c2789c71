"""Probe: two choices of the attention forward's defaults, forward alone against cuDNN,
bits compared with the default (the defaults of 9c686bd).
1. query lengths on the persistent grid, causal (two tiles per CTA, n2) against the grid,
   D128 H16 at B4 S1024, B16 S1024 and B8 S2048;
2. D64 causal with key lengths or segment ids at 128 keys a step: the serial loop against
   the pipelined one on the persistent grid, at 512-2048 keys.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_qlengths_d64_loop_probe.py
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import attention as bench
from benchmarks._common import normal, time_interleaved
from tessera_jax.pallas_kernels import attention_mgpu as am

print(jax.devices()[0].device_kind, flush=True)


def run(label, b, s, d, feature, causal, variants):
    q, k, v = (normal(i, (b, s, 16, d), jnp.bfloat16) for i in range(3))
    kw = bench._feature_kwargs(feature, b, s, s, 16, causal)
    q_, k_, v_, extras, spec = bench.prepare_feature(q, k, v, causal, kw)
    fns = {
        n: jax.jit(lambda q, k, v, e, o=o, spec=spec: am.flash_fwd(spec, q, k, v, *e, **o)[0])
        for n, o in {"default": {}, **variants}.items()
    }
    nn_kw = bench._jax_nn_kwargs(kw, s, s)
    fns["cudnn"] = jax.jit(
        lambda q, k, v, e: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn", **nn_kw
        )
    )
    ref = np.asarray(fns["default"](q_, k_, v_, extras))
    ms = time_interleaved(fns, (q_, k_, v_, extras), repeats=5, target_ms=40)
    for n in fns:
        same = n == "cudnn" or np.array_equal(ref, np.asarray(fns[n](q_, k_, v_, extras)))
        print(
            f"{label} {n:12s} {ms[n] * 1e3:8.1f} us vs cudnn {ms['cudnn'] / ms[n]:.3f} same={same}",
            flush=True,
        )


for b, s in ((4, 1024), (16, 1024), (8, 2048)):
    tiles = 16 * b * (s // am.TILE)
    n2 = dict(persistent=True, ctas=-(-tiles // 2))
    run(f"qkvlen B{b} S{s} D128 causal", b, s, 128, "qkvlen", True, {"n2": n2})
for feature in ("kvlen", "segments"):
    for b, s in ((16, 1024), (8, 2048), (32, 512)):
        variants = {"serial": dict(pipelined=False), "pipelined": dict(pipelined=True)}
        run(f"{feature} B{b} S{s} D64 causal", b, s, 64, feature, True, variants)
