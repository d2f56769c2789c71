"""Probe: why the decode forward trails XLA at B1 against 4096 keys (H100).

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_probe.py [profile] [splits]

``profile``: ``ts.profile``'s kernel table of the in-graph program that
``benchmarks/attention.py`` times for a decode forward case (calls chained through their
outputs, K/V rotating through sets larger than the L2), for ``ts.flash_attention`` in
``auto`` mode and jax.nn's XLA path: B1, one or 16 queries, 4096 keys, 8 heads or 32 query
heads on 8 kv heads. The profiler runs without XLA's command buffers (``ts.profile``), so
each kernel pays its own launch. ``splits``: the forward kernel alone with each
``split_keys``, against XLA and ``ts.flash_attention``, timed in one program.
"""

import functools
import sys

import jax

import tessera_jax as ts
from benchmarks import attention as A
from benchmarks._common import IN_GRAPH_MIN_CALLS
from tessera_jax.pallas_kernels import attention_mgpu as am


def _next_query(args, res):
    return (res[0], *args[1:])


def profile():
    def program(fn, n):
        def run(sets):
            out, prev = [], None
            for i in range(n):
                a = sets[i % len(sets)]
                prev = fn(*(a if prev is None else A._chain(False)(a, prev)))
                out.append(prev)
            return out

        return run

    for b, sq, skv, h, hkv in [
        (1, 1, 4096, 8, 8),
        (1, 16, 4096, 8, 8),
        (1, 16, 4096, 32, 8),
        (1, 1, 4096, 32, 8),
    ]:
        q = A.rand(0, (b, sq, h, 128), A.BF16)
        k, v = (A.rand(i, (b, skv, hkv, 128), A.BF16) for i in (1, 2))
        do = A.rand(3, (b, sq, h, 128), A.BF16)
        sets = [(q, *kv, do, {}) for kv in A._kv_sets(k, v)]
        n = max(len(sets), IN_GRAPH_MIN_CALLS)
        ts_f = A._fwd_only(lambda q, k, v, kw: ts.flash_attention(q, k, v))
        nn_f = A._fwd_only(lambda q, k, v, kw: jax.nn.dot_product_attention(q, k, v))
        for name, f in (("ts_auto", ts_f), ("xla", nn_f)):
            pr = ts.profile(jax.jit(program(f, n)), sets, steps=10)
            print(f"=== b{b} sq{sq} skv{skv} h{h}/{hkv} {name} calls={n}", flush=True)
            print(pr.kernel_table(14), flush=True)


def splits():
    for b, h, hkv, sq, skv in [
        (1, 8, 8, 16, 4096),
        (1, 8, 8, 1, 4096),
        (1, 32, 8, 16, 4096),
        (1, 32, 8, 1, 4096),
        (4, 16, 16, 1, 4096),
        (4, 16, 16, 16, 4096),
        (1, 8, 8, 1, 32768),
        (1, 32, 8, 1, 32768),
    ]:
        case = f"probe-fwd-b{b}-sq{sq}-skv{skv}-h{h}-hkv{hkv}"
        spec, args, sets = A._decode_operands(b, sq, skv, h, hkv, 128, False)
        fns = {
            f"split={n}": jax.jit(functools.partial(am.flash_fwd, spec, split_keys=n))
            for n in (256, 512, 1024, 2048, skv)
            if n <= skv
        }
        fns["xla"] = jax.jit(lambda q, k, v: (jax.nn.dot_product_attention(q, k, v),))
        fns["ts_auto"] = jax.jit(lambda q, k, v: (ts.flash_attention(q, k, v),))
        A._time_variants(case, fns, args, "xla", None, sets, _next_query)


if __name__ == "__main__":
    modes = sys.argv[1:] or ["profile", "splits"]
    for mode in modes:
        {"profile": profile, "splits": splits}[mode]()
