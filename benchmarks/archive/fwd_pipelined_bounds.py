"""Probe: is the pipelined forward slow with causal masks because its loops have run-time
bounds? (B4 S4096 H16 bf16, at the head dims given, default 128.)

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_pipelined_bounds.py [64 128 256]

Non-causal attention with every key length equal to the sequence (``kv_lengths``) computes
what plain non-causal attention does, but its loop bounds are read at run time, as causal
ones are. Each case times the serial and the pipelined forward in one process.
"""

import dataclasses
import functools
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import normal, time_interleaved
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am

b, s, h = 4, 4096, 16
for d in map(int, sys.argv[1:] or [128]):
    q, k, v = (normal(i, (b, s, h, d), jnp.bfloat16) for i in range(3))
    lengths = jnp.full((b,), s, jnp.int32)
    cases = {}
    for causal in (False, True):
        name = f"d{d}-{'causal' if causal else 'noncausal'}"
        spec = AttentionSpec(causal=causal, scale=d**-0.5, config=FlashAttentionConfig())
        cases[name] = (spec, ())
        cases[f"{name}-kvlen"] = (dataclasses.replace(spec, has_kv_lengths=True), (lengths,))
    for name, (spec, extras) in cases.items():
        fns = {
            f"pipelined={pipe}": jax.jit(functools.partial(am.flash_fwd, spec, pipelined=pipe))
            for pipe in (False, True)
        }
        ms = time_interleaved(fns, (q, k, v, *extras), repeats=5, target_ms=40)
        print(f"{name:22s}", "  ".join(f"{n} {t:.3f} ms" for n, t in ms.items()), flush=True)
