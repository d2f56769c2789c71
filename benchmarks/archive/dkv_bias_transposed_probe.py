"""Probe: the dK/dV kernel reading a bias tile transposed from shared memory (this
checkout) against reading tiles of an XLA transpose of the whole bias (``attention_mgpu``
as of commit 0a67392, rebuilt from ``git show``). Times the backward alone
(``attention_mgpu.flash_bwd``, the dQ and dK/dV kernels and what XLA runs around them),
interleaved in one process, both orders, and checks that the two give the same bits:
B4 H16 D128 bf16 with a (1, 16, S, S) bf16 bias, S 4096 and 1024, causal and not.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/dkv_bias_transposed_probe.py
"""

import functools
import subprocess
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import time_interleaved
from benchmarks.archive.dkv_dq_variants_probe import module
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am

BEFORE = "0a67392"


def module_at(commit: str):
    path = "tessera_jax/pallas_kernels/attention_mgpu.py"
    src = subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True)
    return module(commit, src.stdout.decode())


def main():
    old = module_at(BEFORE)
    b, h, d = 4, 16, 128
    for s in (4096, 1024):
        keys = jax.random.split(jax.random.key(0), 5)
        q, k, v, do = (
            jax.random.normal(x, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for x in keys[:4]
        )
        bias = (2 * jax.random.normal(keys[4], (1, h, s, s))).astype(jnp.bfloat16)
        for causal in (False, True):
            spec = AttentionSpec(
                causal=causal, scale=d**-0.5, config=FlashAttentionConfig(), has_bias=True
            )
            out, lse = jax.jit(functools.partial(am.flash_fwd, spec))(q, k, v, bias)
            fns = {
                n: jax.jit(functools.partial(m.flash_bwd, spec))
                for n, m in (("old", old), ("new", am))
            }
            args = (q, k, v, out, lse, do, bias)
            same = all(
                bool(jnp.array_equal(x, y)) for x, y in zip(fns["old"](*args), fns["new"](*args))
            )
            t = time_interleaved(fns, args, repeats=9)
            t2 = time_interleaved(dict(reversed(list(fns.items()))), args, repeats=9)
            print(
                f"S{s} causal={causal} same_bits={same} old {t['old']:.3f} {t2['old']:.3f} ms"
                f"  new {t['new']:.3f} {t2['new']:.3f} ms"
                f"  old/new {t['old'] / t['new']:.3f} {t2['old'] / t2['new']:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
