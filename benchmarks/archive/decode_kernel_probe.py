"""Probe: what the decode forward's time at B1 against 4096 keys is made of (H100).

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_kernel_probe.py steps|combine|cmdbuf

Both modes profile (``ts.profile``, no command buffers) a program of calls chained through
their outputs over K/V sets larger than the L2, as ``benchmarks/attention.py`` times a
decode case, and read the kernels' device time per call.

``steps``: the forward kernel's time per keys per loop step (``block_kv``), K/V ring slots
(``_fwd_stages`` patched) and keys per chunk (``split_keys``), with XLA's whole call.
``combine``: kernels per call and their time, with ``_combine_chunks`` as it is and with a
variant that takes one exponential over all chunks (``e_c / Σ e``) instead of one per
chunk, at 4 and 16 chunks, and jax.nn's XLA path.
``cmdbuf``: in-graph times (``time_in_graph``) with XLA's command buffers on (the default)
and off, of jax.nn's XLA path, ``ts.flash_attention`` (whose lse is dead code) and the
forward kernel with 1024 and 2048 keys per chunk (its lse an output of the program).
"""

import functools
import sys

import jax
import jax.numpy as jnp

import tessera_jax as ts
from benchmarks import attention as A
from benchmarks._common import IN_GRAPH_MIN_CALLS, time_in_graph
from tessera_jax.pallas_kernels import attention_mgpu as am


def _program(fn, n):
    def run(sets):
        out, prev = [], None
        for i in range(n):
            q, k, v = sets[i % len(sets)]
            prev = fn(q if prev is None else prev, k, v)[0]
            out.append(prev)
        return out

    return run


def _xla(q, k, v):
    return (jax.nn.dot_product_attention(q, k, v),)


def steps():
    shapes = [(1, 8, 8, 1, 4096), (1, 8, 8, 16, 4096), (1, 32, 8, 1, 4096), (4, 16, 16, 1, 4096)]
    shapes += [(1, 8, 8, 1, 32768)]
    # (block_kv, ring slots (None: the default), split_keys)
    variants = [(128, None, 1024), (128, None, 2048), (64, 3, 1024), (64, 4, 1024)]
    variants += [(64, 5, 1024), (64, 4, 512), (64, 4, 2048), (128, None, 512)]
    default_stages = am._fwd_stages
    for b, h, hkv, sq, skv in shapes:
        spec, _, sets = A._decode_operands(b, sq, skv, h, hkv, 128, False)
        n = max(len(sets), IN_GRAPH_MIN_CALLS)
        pr = ts.profile(jax.jit(_program(_xla, n)), sets, steps=10)
        print(
            f"b{b} h{h}/{hkv} sq{sq} skv{skv}: xla {pr.device_s / n * 1e6:.1f}us/call", flush=True
        )
        for bkv, stages, split in variants:
            if stages is not None:
                am._fwd_stages = lambda d, block_kv, bias=None, s=stages: s
            try:
                fn = functools.partial(am.flash_fwd, spec, block_kv=bkv, split_keys=split)
                pr = ts.profile(jax.jit(_program(fn, n)), sets, steps=10)
            finally:
                am._fwd_stages = default_stages
            kernel = sum(k.time_s for k in pr.kernels if "mosaic" in k.launched) / n
            print(
                f"   bkv{bkv} st{stages or 'def'} split{split}: kernel {kernel * 1e6:.1f}us  "
                f"call {pr.device_s / n * 1e6:.1f}us",
                flush=True,
            )


def _one_exp_combine(parts, lse):
    """The variant: one exponential over every chunk, ``out = Σ_c (e_c / Σ e)·part_c``."""
    m = functools.reduce(jnp.maximum, list(lse))
    e = jnp.exp(lse - jnp.where(m == -jnp.inf, 0.0, m)[None])
    total = am._in_key_order(len(lse), lambda c: e[c])
    seen = total > 0
    lse_all = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    w = jnp.swapaxes(e / jnp.where(seen, total, 1.0)[None], 2, 3)[..., None]
    out = am._in_key_order(len(lse), lambda c: w[c] * am._chunk(parts, c))
    return out.astype(parts.dtype), lse_all


def combine():
    n = 16
    spec, _, sets = A._decode_operands(1, 16, 4096, 8, 8, 128, False)
    default = am._combine_chunks
    for split in (1024, 256):
        for name, fn in (("one-exp", _one_exp_combine), ("as is", default)):
            am._combine_chunks = fn
            try:
                f = functools.partial(am.flash_fwd, spec, split_keys=split)
                pr = ts.profile(jax.jit(_program(f, n)), sets, steps=5)
            finally:
                am._combine_chunks = default
            print(f"=== split {split} {name} combine: span {pr.device_s / n * 1e6:.1f} us/call")
            print(pr.kernel_table(8), flush=True)
    pr = ts.profile(jax.jit(_program(_xla, n)), sets, steps=5)
    print(f"=== xla: span {pr.device_s / n * 1e6:.1f} us/call")
    print(pr.kernel_table(6), flush=True)


def cmdbuf():
    off = {"xla_gpu_enable_command_buffer": ""}
    for b, h, hkv, sq, skv in [(1, 8, 8, 16, 4096), (1, 32, 8, 1, 4096), (4, 16, 16, 1, 4096)]:
        spec, _, sets = A._decode_operands(b, sq, skv, h, hkv, 128, False)
        fns = {
            "xla": _xla,
            "ts_auto": lambda q, k, v: (ts.flash_attention(q, k, v),),
            "split=1024": functools.partial(am.flash_fwd, spec, split_keys=1024),
            "split=2048": functools.partial(am.flash_fwd, spec, split_keys=2048),
        }
        for opts, tag in ((None, "cmdbuf on"), (off, "cmdbuf off")):

            def jit(name, prog, o=opts):
                return jax.jit(prog, compiler_options=o)

            chain = lambda args, res: (res[0], *args[1:])
            ms = time_in_graph(fns, sets, chain, jit=jit, repeats=5, target_ms=40)
            times = "  ".join(f"{name} {t * 1e3:.1f}us" for name, t in ms.items())
            print(f"b{b} h{h}/{hkv} sq{sq} skv{skv} {tag}: {times}", flush=True)


if __name__ == "__main__":
    {"steps": steps, "combine": combine, "cmdbuf": cmdbuf}[sys.argv[1]]()
