"""Tuning probe of the Triton decode forward (``pallas_kernels/attention_decode.py``), H100.

Kernel time per call (``ts.profile`` of a jitted chain of 16 calls, each call's output the
next one's query, over K/V caches rotating past the L2) of XLA's attention, the Mosaic GPU
forward at its default chunks, and the Triton decode forward per ``DecodeConfig`` (keys per
step, warps, pipeline stages) and keys per chunk. ``span`` is first kernel start to last
kernel end per call, which the profiler's own gaps inflate; ``kernels`` sums the kernels'
time and is the column to compare.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_triton_tuning.py first
    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_triton_tuning.py second

It ran with the prototype's module constants set per variant; the calls below are ported to
``DecodeConfig``.
"""

import functools
import itertools
import sys

import jax

import tessera_jax as ts
from benchmarks import attention as A
from tessera_jax.pallas_kernels import attention_decode as ad
from tessera_jax.pallas_kernels import attention_mgpu as am

N = 16
# (batch, seq_q, seq_kv, heads_q, heads_kv), (block_kv, num_warps, num_stages), split_keys
RUNS = {
    "first": (
        [(1, 16, 4096, 8, 8), (1, 1, 4096, 32, 8), (1, 1, 4096, 8, 8), (4, 16, 4096, 16, 16)],
        [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3), (64, 8, 4)],
        {4096: (256, 512, 1024)},
    ),
    "second": (
        [
            (1, 16, 4096, 32, 8),
            (4, 1, 4096, 32, 8),
            (1, 16, 32768, 8, 8),
            (1, 1, 32768, 32, 8),
            (4, 16, 32768, 16, 16),
        ],
        [(128, 8, 3), (128, 4, 3), (64, 4, 3)],
        {4096: (512, 1024), 32768: (1024, 2048, 4096)},
    ),
}


def program(fn):
    def run(sets):
        out, prev = [], None
        for i in range(N):
            q, k, v = sets[i % len(sets)]
            prev = fn(q if prev is None else prev, k, v)[0]
            out.append(prev)
        return out

    return run


def profile(name, fn, sets):
    try:
        pr = ts.profile(jax.jit(program(fn)), sets, steps=5)
    except Exception as e:
        print(f"  {name:34s} !! {type(e).__name__}: {str(e)[:150]}", flush=True)
        return
    kernels = sum(k.time_s for k in pr.kernels) / N * 1e6
    top = ", ".join(f"{k.name[:24]} {k.time_s / N * 1e6:.1f}" for k in pr.kernels[:3])
    span = pr.device_s / N * 1e6
    print(f"  {name:34s} span {span:6.1f} us  kernels {kernels:6.1f} us  [{top}]", flush=True)


def main(run: str):
    shapes, variants, splits = RUNS[run]
    for b, sq, skv, h, hkv in shapes:
        spec, _, sets = A._decode_operands(b, sq, skv, h, hkv, 128, False)
        print(f"== b{b} sq{sq} skv{skv} h{h}/{hkv}", flush=True)
        profile("xla", lambda q, k, v: (jax.nn.dot_product_attention(q, k, v),), sets)
        profile("mosaic_gpu (default split)", functools.partial(am.flash_fwd, spec), sets)
        for (bkv, nw, ns), split in itertools.product(variants, splits[skv]):
            cfg = ad.DecodeConfig(block_kv=bkv, num_warps=nw, num_stages=ns, split_keys=split)
            fn = functools.partial(ad.decode_fwd, spec, config=cfg)
            profile(f"triton bkv{bkv} w{nw} s{ns} split{split}", fn, sets)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "first")
