"""The decode backward's dQ kernel computing dK and dV (``attention_mgpu``, ``dq_dkv``):
K/V ring slots (``DQ_DKV_STAGES``) and the wait before warpgroup 1 reuses its tiles for
the next block's dK/dV stores, forward+backward through ``ts.flash_attention`` chained 8+
calls in one program, beside XLA; then ``ts.profile``'s Mosaic kernel time per call and
whether every variant gives the old bits.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/dq_dkv_stages_probe.py

It ran on a tree whose two in-loop TMA-store waits (the dq_dkv kernel's warpgroup 1, the
dK/dV kernel's tile writes) read ``wait_smem_to_gmem(0, wait_read_only=True)``: there
``new`` was 4 slots with that wait, ``s4full`` 4 slots with the full wait (patched back),
``s3``/``s2ro`` 3 and 2 slots with it, ``old`` 2 slots with the full wait (the kernel
before). The shipped tree waits fully: run now, ``new`` and ``s4full`` are one kernel and
``s3``/``s2ro`` have the full wait too.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax
import numpy as np

import tessera_jax as ts
from benchmarks import attention as A
from benchmarks._common import chained, time_in_graph
from tessera_jax.pallas_kernels import attention_mgpu as am

D = 128
# b, sq, skv, h, hkv, causal
CASES = [
    (1, 1, 4096, 32, 8, False),
    (1, 1, 4096, 8, 8, False),
    (1, 16, 4096, 32, 8, False),
    (4, 1, 4096, 16, 16, False),
    (1, 1, 32768, 8, 8, False),
    (1, 1, 512, 8, 8, False),
]

_orig_wait = am.plgpu.wait_smem_to_gmem


@contextlib.contextmanager
def old_wait():
    am.plgpu.wait_smem_to_gmem = lambda n, wait_read_only=False: _orig_wait(n)
    try:
        yield
    finally:
        am.plgpu.wait_smem_to_gmem = _orig_wait


@contextlib.contextmanager
def stages(n, full_wait):
    old = am.DQ_DKV_STAGES
    am.DQ_DKV_STAGES = n
    try:
        with old_wait() if full_wait else contextlib.nullcontext():
            yield
    finally:
        am.DQ_DKV_STAGES = old


CTX = {
    "new": contextlib.nullcontext,
    "old": functools.partial(stages, 2, True),
    "s4full": functools.partial(stages, 4, True),
    "s3": functools.partial(stages, 3, False),
    "s2ro": functools.partial(stages, 2, False),
    "xla": contextlib.nullcontext,
}


def _operands(b, sq, skv, h, hkv):
    q, do = A.rand(0, (b, sq, h, D), A.BF16), A.rand(3, (b, sq, h, D), A.BF16)
    k, v = A.rand(1, (b, skv, hkv, D), A.BF16), A.rand(2, (b, skv, hkv, D), A.BF16)
    return q, k, v, do


def kernels(run, sets, calls):
    p = ts.profile(run, tuple(tuple(s) for s in sets), steps=10, warmup=3)
    mosaic = sum(x.time_s for x in p.kernels if "mosaic" in x.launched) / calls * 1e6
    tot = sum(x.time_s for x in p.kernels) / calls * 1e6
    return mosaic, tot, p.device_s / calls * 1e6


def main():
    for b, sq, skv, h, hkv, causal in CASES:
        case = f"b{b}-sq{sq}-skv{skv}-h{h}-hkv{hkv}" + ("-causal" if causal else "")
        q, k, v, do = _operands(b, sq, skv, h, hkv)
        sets = [(q, *kv, do) for kv in A._kv_sets(k, v)]
        ts_fn = A._fwdbwd(functools.partial(A._ts, causal=causal))
        xla_fn = A._fwdbwd(functools.partial(A._jax_nn, causal=causal, implementation="xla"))
        fns = {n: (xla_fn if n == "xla" else ts_fn) for n in CTX}
        calls = max(len(sets), 8)
        compiled = {}

        def jit(name, program):
            if name in compiled:
                return compiled[name]
            with CTX[name]():
                c = jax.jit(program).lower(tuple(tuple(s) for s in sets)).compile()
            compiled[name] = c
            return c

        for rep in range(2):
            ms = time_in_graph(fns, sets, A._chain(True), jit=jit, repeats=7, target_ms=40)
            x = ms["xla"]
            row = "  ".join(f"{n} {t * 1e3:.1f}us ({x / t:.3f}x)" for n, t in ms.items())
            print(f"{case} rep{rep}: {row}  new/old {ms['old'] / ms['new']:.3f}", flush=True)
        arg = (tuple(tuple(s) for s in sets),)
        outs = {n: jax.tree.leaves(compiled[n](*arg)) for n in CTX if n != "xla"}
        same = all(
            np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b_).view(np.uint16))
            for n in outs
            for a, b_ in zip(outs[n], outs["old"])
        )
        prof = []
        for name in ("new", "old"):
            with CTX[name]():
                run = jax.jit(chained(ts_fn, calls, A._chain(True)))
                mosaic, tot, dev = kernels(run, sets, calls)
            prof.append(f"{name}: mosaic {mosaic:.1f} kernels {tot:.1f} device {dev:.1f} us")
        print(f"{case} same bits {same} | " + " | ".join(prof), flush=True)


if __name__ == "__main__":
    main()
