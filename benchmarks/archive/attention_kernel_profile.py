"""Probe: device time per kernel of flash attention's forward+backward, ours (``pallas``
kernel mode) against cuDNN's (``jax.nn.dot_product_attention(implementation="cudnn")``),
by ``ts.profile`` (5 steps each, programs without command buffers): B4 S4096 H16 bf16 at
D128 non-causal and causal and D64 non-causal. Short runs, so the clocks are not the
power cap's sustained ones (``benchmarks/attention.py --power`` for those).

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/attention_kernel_profile.py

``--small``: tiny shapes, ours only (a smoke test of the script on the CPU, where the
``pallas`` mode runs the reference, not the kernels).
"""

import argparse
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

import tessera_jax as ts
from benchmarks._common import normal


def fwdbwd(f):
    def g(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do))

    return g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes, ours only")
    small = parser.parse_args().small
    for d, causal in [(128, False), (128, True), (64, False)]:
        b, s, h = (1, 256, 2) if small else (4, 4096, 16)
        q, k, v, do = (normal(i, (b, s, h, d), jnp.bfloat16) for i in range(4))

        def ours(q, k, v, causal=causal):
            return ts.flash_attention(q, k, v, causal=causal)

        def cudnn(q, k, v, causal=causal):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

        impls = [("ours", ours, "pallas"), ("cudnn", cudnn, "auto")][: 1 if small else 2]
        for name, f, mode in impls:
            with ts.kernel_mode(mode):
                r = ts.profile(jax.jit(fwdbwd(f)), q, k, v, do, steps=5)
            print(f"=== d{d} causal={causal} {name}", flush=True)
            print(r.kernel_table(top=14), flush=True)


if __name__ == "__main__":
    main()
