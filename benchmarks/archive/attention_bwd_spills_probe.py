"""Probe: ptxas's register spills in the attention backward's kernels (Mosaic GPU prints
ptxas's report with ``MOSAIC_GPU_DUMP_PTXAS=1``: per kernel its stack frame and spill
stores/loads). Compiles only, on one H200:

1. the backward with a (1, 2, 1024, 1024) bf16 bias at D128, causal and not, as this
   checkout builds it and as ``attention_mgpu`` did at commit 0a67392 (its dK/dV kernel
   read tiles of an XLA transpose of the bias; rebuilt with
   ``dkv_bias_transposed_probe.module_at``);
2. this checkout's backward at D128 and D64, with and without that bias, causal and not,
   with the dK/dV kernel's paired schedule on and off (``dkv_paired``).

Each compile prints two reports: the dK/dV kernel's first (it is the one that moves with
``dkv_paired``, a knob of that kernel only), then the dQ kernel's.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/attention_bwd_spills_probe.py 2>&1 \\
        | grep -E "=====|bytes stack frame"
"""

import functools
import os
import sys

os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks.archive.dkv_bias_transposed_probe import module_at
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am


def compile_bwd(mod, d, causal, has_bias, **knobs):
    s, h = 1024, 2
    q = jnp.ones((1, s, h, d), jnp.bfloat16)
    lse = jnp.zeros((1, h, s), jnp.float32)
    extras = (jnp.ones((1, h, s, s), jnp.bfloat16),) if has_bias else ()
    spec = AttentionSpec(
        causal=causal, scale=d**-0.5, config=FlashAttentionConfig(), has_bias=has_bias
    )
    bwd = jax.jit(functools.partial(mod.flash_bwd, spec, **knobs))
    bwd.lower(q, q, q, q, lse, q, *extras).compile()


def main():
    for name, mod in (("new", am), ("old", module_at("0a67392"))):
        for causal in (False, True):
            print(f"===== {name} causal={causal}", flush=True)
            compile_bwd(mod, 128, causal, True)
    for d in (128, 64):
        for has_bias in (True, False):
            for causal in (False, True):
                for paired in (True, False):
                    print(f"===== D{d} bias={has_bias} {causal=} dkv_paired={paired}", flush=True)
                    compile_bwd(am, d, causal, has_bias, dkv_paired=paired)


if __name__ == "__main__":
    main()
