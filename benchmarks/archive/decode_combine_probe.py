"""The Triton decode forward's combination of its key chunks (``attention_decode``'s
``_combine_kernel``) with ``cols`` output columns a program (``COMBINE_COLS``; ``cols``
equal to head_dim is one program per kv head, as before), one H200: whether the output
and lse keep their bits (``same_bits``, against one program per kv head), the kernels'
device time per call from ``ts.profile`` (calls chained in one program), then the
variants' time per call in one program (``benchmarks/attention.py``'s
``_time_variants``: the output of a call is the next call's query).

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_combine_probe.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import numpy as np

import tessera_jax as ts
from benchmarks import attention as A
from benchmarks._common import chained
from tessera_jax.pallas_kernels import attention_decode as ad

# (batch, query heads, kv heads, queries, keys, head_dim)
SHAPES = [
    (1, 8, 8, 16, 4096, 128),
    (1, 8, 8, 16, 4096, 64),
    (1, 8, 8, 1, 4096, 128),
    (1, 32, 8, 16, 4096, 128),
    (4, 16, 16, 16, 1024, 64),
    (4, 16, 16, 1, 32768, 128),
]


def _forward(spec, cols: int):
    """The decode forward traced with ``COMBINE_COLS = cols``."""

    def f(q, k, v):
        old = ad.COMBINE_COLS
        ad.COMBINE_COLS = cols
        try:
            return ad.decode_fwd(spec, q, k, v)
        finally:
            ad.COMBINE_COLS = old

    return jax.jit(f)


def _next_query(args, res):
    return (res[0], *args[1:])


def main() -> None:
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    for b, h, hkv, sq, skv, d in SHAPES:
        case = f"b{b}-h{h}-hkv{hkv}-sq{sq}-skv{skv}-d{d}"
        spec, args, sets = A._decode_operands(b, sq, skv, h, hkv, d, False)
        fns = {f"cols={c}": _forward(spec, c) for c in (d, 64, 32, 16) if c <= d}
        base = f"cols={d}"
        ref = fns[base](*args)
        calls = max(len(sets), 8)
        for name, f in fns.items():
            same = all(np.array_equal(x, y) for x, y in zip(f(*args), ref))
            run = jax.jit(chained(f, calls, _next_query))
            p = ts.profile(run, tuple(tuple(s) for s in sets), steps=10, warmup=3)
            per_kernel = {}
            for x in p.kernels:
                key = re.sub(r"\.\d+$", "", x.launched or x.name)[:40]
                per_kernel[key] = per_kernel.get(key, 0.0) + x.time_s / calls * 1e6
            times = " ".join(f"{k}={t:.2f}" for k, t in sorted(per_kernel.items()))
            print(f"   {case} {name:8s} same_bits={same} kernels: {times}", flush=True)
        A._time_variants(case, fns, args, base, None, sets, _next_query)


if __name__ == "__main__":
    main()
