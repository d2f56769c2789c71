"""Probe: the Triton decode forward (``attention_decode.decode_fwd``) reading the mask
(bool) and a bf16 bias as given in the kernel, against an f32 operand folded by XLA in
the same program (one launch more) and against f32 operands made outside the program
(the kernel's f32 loads without that launch), one H200, each variant timed alone, in two
passes (first/second). Runs at commit 147f869 only (``decode_fwd(mask=...)`` and a bias
read in its own dtype; reverted after this run): the kernel's narrow loads cost far more
per key than the launch they save.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_unfolded_mask_probe.py
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import time_interleaved
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_decode as ad

for B, SQ, SKV, H in ((1, 16, 32768, 8), (1, 16, 2048, 8), (4, 1, 32768, 16)):
    D = 128
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (B, SQ, H, D)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(kk, (B, SKV, H, D)).astype(jnp.bfloat16) for kk in ks[1:3])
    m = jax.random.bernoulli(ks[3], 0.9, (B, 1, SQ, SKV))
    bias = jax.random.normal(ks[4], (1, H, SQ, SKV)).astype(jnp.bfloat16)
    sp = lambda **f: AttentionSpec(causal=False, scale=D**-0.5, config=FlashAttentionConfig(), **f)
    sm, sb = sp(has_mask=True), sp(has_bias=True)
    fold_m = jnp.where(m, 0.0, -jnp.inf).astype(jnp.float32)
    b32 = bias.astype(jnp.float32)
    fns = {
        "mask_bool_kernel": (jax.jit(lambda q, k, v, x: ad.decode_fwd(sm, q, k, v, mask=x)), m),
        "mask_fold_in_jit": (
            jax.jit(
                lambda q, k, v, x: ad.decode_fwd(
                    sb, q, k, v, bias=jnp.where(x, 0.0, -jnp.inf).astype(jnp.float32)
                )
            ),
            m,
        ),
        "mask_f32_given": (jax.jit(lambda q, k, v, x: ad.decode_fwd(sb, q, k, v, bias=x)), fold_m),
        "bias_bf16_kernel": (jax.jit(lambda q, k, v, x: ad.decode_fwd(sb, q, k, v, bias=x)), bias),
        "bias_f32_in_jit": (
            jax.jit(lambda q, k, v, x: ad.decode_fwd(sb, q, k, v, bias=x.astype(jnp.float32))),
            bias,
        ),
        "bias_f32_given": (jax.jit(lambda q, k, v, x: ad.decode_fwd(sb, q, k, v, bias=x)), b32),
    }
    res = {}
    for name, (f, x) in fns.items():
        res[name] = time_interleaved({name: f}, (q, k, v, x), repeats=7)[name]
    res2 = {}
    for name, (f, x) in reversed(list(fns.items())):
        res2[name] = time_interleaved({name: f}, (q, k, v, x), repeats=7)[name]
    print(
        f"B{B} SQ{SQ} SKV{SKV} H{H}: "
        + "  ".join(f"{n} {res[n] * 1e3:.1f}/{res2[n] * 1e3:.1f}us" for n in fns),
        flush=True,
    )
