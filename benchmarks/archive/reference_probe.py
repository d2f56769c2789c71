"""Probe: the blocked attention reference (``ts.flash_attention`` in ``xla`` kernel mode)
against jax.nn's XLA path on a GPU, per ``block_kv``, forward and forward+backward, with
the compiled program's temporary bytes.

``--case``: ``plain`` (B4 S4096 H16, no options), ``mask`` (a causal boolean mask passed
as ``mask``, as at head_dim 256 where the kernels decline it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import normal, time_interleaved

import tessera_jax as ts
from tessera_jax.contracts.attention import FlashAttentionConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--case", default="plain", choices=("plain", "mask"))
    ap.add_argument("--blocks", default="0,256,512,1024,2048,-1", help="0: default; -1: all")
    args = ap.parse_args()
    b, s, h, d = args.batch, args.seq, 16, args.d
    dt = jnp.dtype(args.dtype)
    q, k, v, do = (normal(i, (b, s, h, d), dt) for i in range(4))
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None] if args.case == "mask" else None

    def ts_fn(block):
        cfg = None if block == 0 else FlashAttentionConfig(block_kv=s if block < 0 else block)
        return lambda q, k, v, m: ts.flash_attention(q, k, v, mask=m, config=cfg)

    def xla(q, k, v, m):
        return jax.nn.dot_product_attention(q, k, v, mask=m, implementation="xla")

    fns = {"xla": xla}
    for blk in map(int, args.blocks.split(",")):
        fns[f"ref[{'default' if blk == 0 else 'all' if blk < 0 else blk}]"] = ts_fn(blk)
    for backward in (False, True):
        jitted = {}
        for name, f in fns.items():
            if backward:

                def g(q, k, v, do, m, f=f):
                    out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, m), q, k, v)
                    return (out, *vjp(do))

            else:
                g = lambda q, k, v, do, m, f=f: f(q, k, v, m)
            jitted[name] = jax.jit(g)
        a = (q, k, v, do, mask)
        with ts.kernel_mode("xla"):
            temp = {
                n: f.lower(*a).compile().memory_analysis().temp_size_in_bytes
                for n, f in jitted.items()
            }
            ms = time_interleaved(jitted, a, repeats=3, target_ms=60)
        mode = "fwdbwd" if backward else "fwd"
        for name, t in ms.items():
            print(
                f"{args.case:5s} {args.dtype:9s} d{d} {mode:6s} {name:13s} {t:8.3f} ms "
                f"x{ms['xla'] / t:.3f} of xla  temp {temp[name] / 2**20:8.1f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
