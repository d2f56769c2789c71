"""The decode forward through ``ts.flash_attention`` (``ts_auto``) and
``jax.nn.dot_product_attention``'s default (``xla``), one H200: time per call inside one
program (``benchmarks/_common.time_in_graph``, the output of a call the next call's
query) beside ``ts.profile``'s device span and kernel time per call of the same chained
program, and each kernel's time per call. At B1 the kernels take a fraction of the time
per call: the rest is the device waiting between launches.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_kernel_time_probe.py
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax

import tessera_jax as ts
from benchmarks import attention as A
from benchmarks._common import chained, time_in_graph

# (batch, heads, queries, keys, head_dim)
SHAPES = [(1, 8, 16, 1024, 64), (1, 8, 16, 4096, 64), (1, 8, 16, 4096, 128)]
SHAPES += [(4, 16, 16, 1024, 64), (1, 8, 1, 1024, 64)]


def main() -> None:
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    impls = {
        "ts_auto": A._fwd_only(functools.partial(A._ts, causal=False)),
        "xla": A._fwd_only(functools.partial(A._jax_nn, causal=False, implementation="xla")),
    }
    for b, h, sq, skv, d in SHAPES:
        q, do = A.rand(0, (b, sq, h, d), A.BF16), A.rand(3, (b, sq, h, d), A.BF16)
        k, v = A.rand(1, (b, skv, h, d), A.BF16), A.rand(2, (b, skv, h, d), A.BF16)
        sets = [(q, *kv, do) for kv in A._kv_sets(k, v)]
        calls = max(len(sets), 8)
        for name, fn in impls.items():
            run = jax.jit(chained(fn, calls, A._chain(False)))
            p = ts.profile(run, tuple(tuple(s) for s in sets), steps=10, warmup=3)
            ms = time_in_graph({name: fn}, sets, A._chain(False), repeats=5, target_ms=40)[name]
            kernels = sum(x.time_s for x in p.kernels) / calls * 1e6
            n = sum(x.calls for x in p.kernels) / calls
            print(
                f"b{b} h{h} sq{sq} skv{skv} d{d} {name:8s} in_graph {ms * 1e3:6.1f} us/call"
                f" | device {p.device_s / calls * 1e6:6.1f} kernels {kernels:6.1f} us,"
                f" {n:.1f} kernels/call",
                flush=True,
            )
            per_kernel = {}
            for x in p.kernels:
                key = re.sub(r"\.\d+$", "", x.launched or x.name)[:60]
                t, c = per_kernel.get(key, (0.0, 0.0))
                per_kernel[key] = (t + x.time_s, c + x.calls)
            for key, (t, c) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:8]:
                print(f"      {t / calls * 1e6:6.2f} us x{c / calls:.1f} {key}", flush=True)


if __name__ == "__main__":
    main()
