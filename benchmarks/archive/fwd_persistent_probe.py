"""Probe: the attention forward on a persistent grid (``Problem.fwd_ctas``) against one CTA
per query tile and against cuDNN, forward alone, bf16, in one process; the outputs' bits
are compared between the grids.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_persistent_probe.py [variants|policy]

``variants``: the grid, one CTA per SM (``p132`` on an H200), and CTAs of 2 and 4 tiles
each (``n2``, ``n4``; the hardware's scheduler places the CTAs), as ratios to cuDNN.
``policy``: the default (``flash_fwd``'s ``_fwd_ctas``) against the grid at shapes the
variants did not time.
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import normal, time_interleaved
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am

# (batch, seq, heads_q, heads_kv, head_dim, causal)
VARIANT_CASES = [
    (b, s, 16, 16, d, causal)
    for b, s, d in [
        (4, 4096, 128),
        (16, 1024, 128),
        (8, 2048, 128),
        (1, 16384, 128),
        (16, 1024, 64),
        (4, 4096, 64),
        (4, 4096, 256),
    ]
    for causal in (False, True)
]
POLICY_CASES = [
    (16, 1024, 16, 16, 64, True),
    (8, 2048, 16, 16, 64, True),
    (8, 2048, 16, 16, 128, False),
    (8, 2048, 16, 16, 128, True),
    (4, 512, 16, 16, 128, True),
    (4, 512, 16, 16, 128, False),
    (8, 2048, 32, 8, 128, False),
    (16, 1024, 32, 8, 128, True),
]


def run(case, variants):
    b, s, h, hkv, d, causal = case
    name = f"B{b} S{s} H{h}/{hkv} D{d} {'causal' if causal else 'noncausal'}"
    spec = AttentionSpec(causal=causal, scale=d**-0.5, config=FlashAttentionConfig())
    q = normal(0, (b, s, h, d), jnp.bfloat16)
    k, v = (normal(i, (b, s, hkv, d), jnp.bfloat16) for i in (1, 2))
    fns = {
        key: jax.jit(lambda q, k, v, kw=kw: am.flash_fwd(spec, q, k, v, **kw)[0])
        for key, kw in variants.items()
    }
    fns["cudnn"] = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"
        )
    )
    ref = np.asarray(fns["grid"](q, k, v))
    same = all(np.array_equal(ref, np.asarray(fns[key](q, k, v))) for key in variants)
    ms = time_interleaved(fns, (q, k, v), repeats=5, target_ms=40)
    cells = " ".join(f"{key} {ms['cudnn'] / ms[key]:.3f}" for key in variants)
    print(f"{name:30s} same={same} cudnn {ms['cudnn']:.4f} ms | vs cudnn: {cells}", flush=True)


print(jax.devices()[0].device_kind, flush=True)
part = sys.argv[1] if len(sys.argv) > 1 else "variants"
if part == "variants":
    for case in VARIANT_CASES:
        b, s, h, _, _, _ = case
        tiles = h * b * (s // am.TILE)
        variants = {"grid": dict(persistent=False), "p132": dict(persistent=True)}
        for per in (2, 4):
            variants[f"n{per}"] = dict(persistent=True, ctas=-(-tiles // per))
        run(case, variants)
else:
    for case in POLICY_CASES:
        run(case, {"grid": dict(persistent=False), "auto": {}})
