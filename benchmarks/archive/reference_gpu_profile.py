"""Probe: where the blocked attention reference's time goes on a GPU, kernel by kernel
(``ts.profile``), beside jax.nn's XLA path, forward and forward+backward; writes each
program's optimised HLO to ``--hlo-dir``.

    python3 benchmarks/archive/reference_gpu_profile.py [--dtype float32] [--hlo-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import normal

import tessera_jax as ts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", default="4,4096,16,128", help="B,S,H,D")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--hlo-dir", default=None)
    args = ap.parse_args()
    b, s, h, d = map(int, args.shape.split(","))
    q, k, v, do = (normal(i, (b, s, h, d), jax.numpy.dtype(args.dtype)) for i in range(4))
    fns = {
        "ts_reference": lambda q, k, v: ts.flash_attention(q, k, v),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
    }
    for backward in (False, True):
        for name, f in fns.items():
            if backward:

                def g(q, k, v, do, f=f):
                    out, vjp = jax.vjp(f, q, k, v)
                    return (out, *vjp(do))

            else:
                g = lambda q, k, v, do, f=f: f(q, k, v)
            mode = "fwdbwd" if backward else "fwd"
            with ts.kernel_mode("xla"):
                jitted = jax.jit(g)
                if args.hlo_dir:
                    text = jitted.lower(q, k, v, do).compile().as_text()
                    Path(args.hlo_dir, f"{name}-{mode}.hlo.txt").write_text(text)
                prof = ts.profile(jitted, q, k, v, do, steps=3)
            print(f"== {name} {mode} {args.dtype} {args.shape}: {prof.device_s * 1e3:.3f} ms")
            print(prof.kernel_table(top=args.top), flush=True)


if __name__ == "__main__":
    main()
