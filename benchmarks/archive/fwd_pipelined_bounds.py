"""Probe: is the pipelined forward slow with causal masks because its loops have run-time
bounds? (H100, B4 S4096 H16 D128 bf16.)

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_pipelined_bounds.py

Non-causal attention with every key length equal to the sequence (``kv_lengths``) computes
what plain non-causal attention does, but its loop bounds are read at run time, as causal
ones are. Each case times the serial and the pipelined forward in one process.
"""

import functools
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import normal, time_interleaved
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am

b, s, h, d = 4, 4096, 16, 128
q, k, v = (normal(i, (b, s, h, d), jnp.bfloat16) for i in range(3))
lengths = jnp.full((b,), s, jnp.int32)
cases = {
    "noncausal": (AttentionSpec(causal=False, scale=d**-0.5, config=FlashAttentionConfig()), ()),
    "noncausal-kvlen": (
        AttentionSpec(
            causal=False, scale=d**-0.5, config=FlashAttentionConfig(), has_kv_lengths=True
        ),
        (lengths,),
    ),
    "causal": (AttentionSpec(causal=True, scale=d**-0.5, config=FlashAttentionConfig()), ()),
}
for name, (spec, extras) in cases.items():
    fns = {
        f"pipelined={pipe}": jax.jit(functools.partial(am.flash_fwd, spec, pipelined=pipe))
        for pipe in (False, True)
    }
    ms = time_interleaved(fns, (q, k, v, *extras), repeats=5, target_ms=40)
    print(name, "  ".join(f"{n} {t:.3f} ms" for n, t in ms.items()), flush=True)
