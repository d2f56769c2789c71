"""Probe: is the pipelined forward slow with causal masks because its loops have run-time
bounds? (H100, B4 S4096 H16 bf16.)

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

b, s, h = 4, 4096, 16
lengths = jnp.full((b,), s, jnp.int32)
for d in (64, 128, 256):
    q, k, v = (normal(i, (b, s, h, d), jnp.bfloat16) for i in range(3))
    for causal in (False, True):
        for kvlen in (False, True):
            spec = AttentionSpec(
                causal=causal, scale=d**-0.5, config=FlashAttentionConfig(), has_kv_lengths=kvlen
            )
            fns = {
                f"pipelined={pipe}": jax.jit(functools.partial(am.flash_fwd, spec, pipelined=pipe))
                for pipe in (False, True)
            }
            args = (q, k, v, *((lengths,) if kvlen else ()))
            ms = time_interleaved(fns, args, repeats=5, target_ms=40)
            name = f"d{d}-{'causal' if causal else 'noncausal'}{'-kvlen' if kvlen else ''}"
            print(f"{name:22s}", "  ".join(f"{n} {t:.3f} ms" for n, t in ms.items()), flush=True)
