"""Decoding with a window (H200): where a forward+backward's device time goes.

``ts.profile``'s kernel table of one call of ``ts.flash_attention``'s forward+backward
with ``local_window_size=(Skv // 8, 0)``: B4 H16, one query against 32768 keys, and B1
H8, 16 queries against 2048; D128, bf16. Each in ``auto`` mode and in the blocked
reference with one block of all keys (``xla`` mode, ``block_kv=Skv``). The operator
slices off the keys before the window (``contracts.attention.dropped_keys``); the table
shows what the slice, the kernels' padding and the gradients' way back to the whole
cache cost.

    python benchmarks/archive/decode_window_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax

import tessera_jax as ts
from benchmarks import attention as A
from tessera_jax.primitives.attention import FlashAttentionConfig


def main():
    for b, sq, skv, h in [(4, 1, 32768, 16), (1, 16, 2048, 8)]:
        q, do = A.rand(0, (b, sq, h, 128), A.BF16), A.rand(3, (b, sq, h, 128), A.BF16)
        k, v = A.rand(1, (b, skv, h, 128), A.BF16), A.rand(2, (b, skv, h, 128), A.BF16)
        window = (skv // 8, 0)
        paths = (("auto", "auto", None), ("ref_all", "xla", FlashAttentionConfig(block_kv=skv)))
        for name, mode, config in paths:

            def fwdbwd(q, k, v, do, config=config):
                attend = lambda q, k, v: ts.flash_attention(
                    q, k, v, local_window_size=window, config=config
                )
                out, vjp = jax.vjp(attend, q, k, v)
                return (out, *vjp(do))

            with ts.kernel_mode(mode):
                p = ts.profile(jax.jit(fwdbwd), q, k, v, do, steps=5, warmup=2)
            print(f"=== b{b} sq{sq} skv{skv} {name}: device {p.device_s * 1e6:.1f} us", flush=True)
            print(p.kernel_table(), flush=True)


if __name__ == "__main__":
    main()
