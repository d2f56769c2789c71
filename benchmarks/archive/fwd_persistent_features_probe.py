"""Probe: the persistent forward grid
for the features _fwd_ctas leaves on the grid (key/query lengths, windows, masks, a bias,
segment ids), H16 D128 bf16 at B16 S1024 and B8 S2048 (the persistent grid's range), causal
and not, forward alone, as speed-ups over the grid; bits compared.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_persistent_features_probe.py
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
h, d = 16, 128
for feature in ("kvlen", "qkvlen", "window", "keypad", "mask", "bias", "segments"):
    for b, s in ((16, 1024), (8, 2048)):
        for causal in (False, True):
            q, k, v = (normal(i, (b, s, h, d), jnp.bfloat16) for i in range(3))
            kw = bench._feature_kwargs(feature, b, s, s, h, causal)
            q_, k_, v_, extras, spec = bench.prepare_feature(q, k, v, causal, kw)
            tiles = h * b * (s // am.TILE)
            variants = {
                "grid": dict(persistent=False),
                "p132": dict(persistent=True),
                "n2": dict(persistent=True, ctas=-(-tiles // 2)),
            }
            fns = {
                n: jax.jit(
                    lambda q, k, v, e, o=o, spec=spec: am.flash_fwd(spec, q, k, v, *e, **o)[0]
                )
                for n, o in variants.items()
            }
            outs = {n: np.asarray(f(q_, k_, v_, extras)) for n, f in fns.items()}
            same = all(np.array_equal(outs["grid"], o) for o in outs.values())
            ms = time_interleaved(fns, (q_, k_, v_, extras), repeats=5, target_ms=40)
            cells = " ".join(f"{n} {ms['grid'] / ms[n]:.3f}" for n in variants)
            print(
                f"{feature:9s} B{b} S{s} {'causal' if causal else 'noncausal':9s} same={same} "
                f"grid {ms['grid']:.4f} ms | speed vs grid: {cells}",
                flush=True,
            )
