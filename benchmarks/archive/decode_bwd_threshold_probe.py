"""Where ``auto`` should start the Mosaic backward kernels at decode shapes: forward+backward
of ``ts.flash_attention`` (auto mode, so the Triton decode forward) with the backward in
the kernels (``attention_mgpu.DECODE_BWD_MIN_KV`` = 256) and in the blocked reference (the
threshold patched out of reach while that program is traced), beside jax.nn's default
(XLA), in one process, timed per call inside one program
(``benchmarks/_common.time_in_graph``, as ``benchmarks/attention.py`` times decode
cases), B1 H8 and B4 H16, 1 and 16 queries, 256 and 512 keys, D128 bf16. ``mosaic calls``
counts the Mosaic GPU custom calls in each compiled program (the kernels' backward has
them; the reference's has none). Run on the GPU machine from the repository root
(``PROBE_B=1`` or ``4``: that batch size only)::

    PYTHONPATH=$PWD python3 benchmarks/archive/decode_bwd_threshold_probe.py
"""

import functools
import os

import jax
import jax.numpy as jnp

import tessera_jax as ts
from benchmarks import attention as bench
from benchmarks._common import time_in_graph
from tessera_jax.pallas_kernels import attention_mgpu as am

BF16 = jnp.bfloat16
THRESHOLDS = {"kernels": 256, "reference backward": 1 << 30}


def attend(q, k, v, do, implementation=None):
    if implementation == "ts":
        f = functools.partial(ts.flash_attention, causal=False)
    else:
        f = functools.partial(jax.nn.dot_product_attention, implementation=None)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))


calls = {}


def compile_for(name, program, *args):
    old = am.DECODE_BWD_MIN_KV
    am.DECODE_BWD_MIN_KV = THRESHOLDS.get(name, old)
    try:
        with ts.kernel_mode("auto"):
            compiled = jax.jit(program).lower(*args).compile()
    finally:
        am.DECODE_BWD_MIN_KV = old
    calls[name] = compiled.as_text().count("mosaic_gpu")
    return compiled


# PROBE_B=1 or 4 runs one batch size (one per GPU); unset, both.
SHAPES = {"1": [(1, 8)], "4": [(4, 16)]}.get(os.environ.get("PROBE_B", ""), [(1, 8), (4, 16)])
for b, h in SHAPES:
    for sq in (1, 16):
        for skv in (256, 512):
            q, do = bench.rand(0, (b, sq, h, 128), BF16), bench.rand(3, (b, sq, h, 128), BF16)
            k, v = (bench.rand(i, (b, skv, h, 128), BF16) for i in (1, 2))
            sets = [(q, ki, vi, do) for ki, vi in bench._kv_sets(k, v)]
            fns = {
                "xla": attend,
                "kernels": functools.partial(attend, implementation="ts"),
                "reference backward": functools.partial(attend, implementation="ts"),
            }
            arg = tuple(tuple(s) for s in sets)
            ms = time_in_graph(
                fns,
                sets,
                bench._chain(True),
                jit=lambda n, p: compile_for(n, p, arg),
                repeats=5,
                target_ms=40,
            )
            print(f"== B{b} H{h} sq{sq} skv{skv}")
            for name, t in ms.items():
                print(
                    f"   {name:20s} {t * 1e3:7.1f} us  x{ms['xla'] / t:.3f} of XLA"
                    f"  mosaic calls {calls[name]}"
                )
