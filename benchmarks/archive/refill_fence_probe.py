"""Probe: the cost of the producer's proxy fence before it refills a ring slot that the
compute warpgroups read with generic loads (attention_mgpu.FENCE_GENERIC_REFILLS): key
segment ids and the bias in the forward and the dQ kernel's K/V stream, the log-sum-exp,
delta and query ids in the dK/dV kernel's query stream (so every backward). Each case is
compiled with the fence off and on, timed interleaved from the host, bits compared.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/refill_fence_probe.py
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts
from benchmarks import attention as bench
from benchmarks._common import normal, time_interleaved
from tessera_jax.pallas_kernels import attention_mgpu as am

print(jax.devices()[0].device_kind, jax.__version__, flush=True)


def compiled(fn, args):
    out = {}
    for fence in (False, True):
        am.FENCE_GENERIC_REFILLS = fence
        with ts.kernel_mode("pallas"):
            out["on" if fence else "off"] = jax.jit(fn).lower(*args).compile()
    am.FENCE_GENERIC_REFILLS = True
    return out


def run(b, s, d, feature, causal, backward, n4=False):
    q, k, v, do = (normal(i, (b, s, 16, d), jnp.bfloat16) for i in range(4))
    kw = bench._feature_kwargs(feature, b, s, s, 16, causal)
    static = {n: kw.pop(n) for n in ("local_window_size",) if n in kw}
    if backward:

        def fn(q, k, v, do, kw):
            f = lambda q, k, v: ts.flash_attention(q, k, v, causal=causal, **kw, **static)
            out, vjp = jax.vjp(f, q, k, v)
            return (out, *vjp(do))

        args = (q, k, v, do, kw)
    else:
        q, k, v, extras, spec = bench.prepare_feature(q, k, v, causal, {**kw, **static})
        opts = {}
        if n4:
            opts = dict(persistent=True, ctas=-(-16 * b * (s // am.TILE) // 4))

        def fn(q, k, v, extras):
            return am.flash_fwd(spec, q, k, v, *extras, **opts)[0]

        args = (q, k, v, extras)
    fns = compiled(fn, args)
    outs = {n: jax.tree.leaves(f(*args)) for n, f in fns.items()}
    same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(*outs.values()))
    ms = time_interleaved(fns, args, repeats=7, target_ms=40)
    label = f"{'fwd+bwd' if backward else 'fwd'} {feature or 'plain'} B{b} S{s} D{d}"
    label += f" {'causal' if causal else 'full'}{' n4' if n4 else ''}"
    print(
        f"{label:44s} off {ms['off'] * 1e3:8.1f} us  on {ms['on'] * 1e3:8.1f} us"
        f"  on/off {ms['on'] / ms['off']:.3f} same={same}",
        flush=True,
    )


for rnd in range(2):
    run(16, 1024, 128, "segments", True, False)
    run(16, 1024, 128, "segments", True, False, n4=True)
    run(8, 2048, 128, "segments", True, False, n4=True)
    run(16, 1024, 64, "segments", True, False)
    run(8, 1024, 128, "bias", False, False)
    run(4, 4096, 128, "", False, True)
    run(8, 2048, 128, "", True, True)
    run(8, 2048, 64, "", True, True)
    run(8, 1024, 128, "segments", True, True)
    run(4, 1024, 128, "bias", True, True)
