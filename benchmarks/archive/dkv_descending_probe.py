"""Probe: the dK/dV kernel walking each head's query blocks from the last one down
(``flash_bwd(dkv_descending=True)``) against from the first one up (the default), backward
alone, interleaved in one process (``time_interleaved``, both call orders), on one H200;
whether the gradients' bits differ. The question: is the causal backward with a
(1, 16, S, S) bias slower since the dK/dV kernel reads (queries, keys) bias tiles
(``dkv-bias-transposed-h200.txt``) because causal key tiles start at their own diagonals,
reading different query rows of the bias at any time (descending, they all start at the
last block, as non-causal ones read the same rows together)? The log says no:
descending is 8 % slower there, 4 % slower at D64 causal, 0–2 % faster at D128 causal
without a bias. The knob was removed after this run; check out commit 0e144d3, which
added this probe, to rerun it.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/dkv_descending_probe.py
"""

import functools
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import time_interleaved
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am

CASES = [  # (B, S, H, D, causal, bias)
    (4, 4096, 16, 128, True, True),
    (4, 1024, 16, 128, True, True),
    (4, 4096, 16, 128, True, False),
    (4, 4096, 16, 64, True, False),
    (16, 1024, 16, 128, True, False),
    (4, 4096, 16, 128, False, True),
]
for B, S, H, D, causal, has_bias in CASES:
    ks = jax.random.split(jax.random.key(0), 5)
    q, k, v, do = (
        jax.random.normal(kk, (B, S, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks[:4]
    )
    extras = (
        ((2 * jax.random.normal(ks[4], (1, H, S, S))).astype(jnp.bfloat16),) if has_bias else ()
    )
    spec = AttentionSpec(
        causal=causal, scale=D**-0.5, config=FlashAttentionConfig(), has_bias=has_bias
    )
    out, lse = jax.jit(functools.partial(am.flash_fwd, spec))(q, k, v, *extras)
    fns = {
        f"desc={d}": jax.jit(functools.partial(am.flash_bwd, spec, dkv_descending=d))
        for d in (False, True)
    }
    fns["default"] = jax.jit(functools.partial(am.flash_bwd, spec))
    args = (q, k, v, out, lse, do, *extras)
    a, b = fns["desc=False"](*args), fns["desc=True"](*args)
    same = [bool(jnp.array_equal(x, y)) for x, y in zip(a, b)]
    t = time_interleaved(fns, args, repeats=9)
    t2 = time_interleaved(dict(reversed(list(fns.items()))), args, repeats=9)
    r = [t["desc=False"] / t["desc=True"], t2["desc=False"] / t2["desc=True"]]
    print(
        f"B{B} S{S} H{H} D{D} causal={causal} bias={has_bias} same_bits={same} "
        + "  ".join(f"{n} {t[n]:.3f}/{t2[n]:.3f}" for n in t)
        + f"  asc/desc {r[0]:.3f} {r[1]:.3f}",
        flush=True,
    )
