"""Probe: what ``ts.flash_attention`` (operator path, ``pallas`` mode) adds over calling
the forward kernel directly (``attention_mgpu.flash_fwd``), B4 S4096 H16 bf16 forward;
cuDNN alongside. Writes both optimised HLOs to ``$OUT``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import normal, time_interleaved

import tessera_jax as ts
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am


def main() -> None:
    b, s, h = 4, 4096, 16
    for d in (128, 64):
        q, k, v = (normal(i, (b, s, h, d), jax.numpy.bfloat16) for i in range(3))
        spec = AttentionSpec(causal=False, scale=d**-0.5, config=FlashAttentionConfig())
        fns = {
            "cudnn": jax.jit(
                lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
            ),
            "direct": jax.jit(lambda q, k, v: am.flash_fwd(spec, q, k, v)[0]),
            "direct+lse": jax.jit(lambda q, k, v: am.flash_fwd(spec, q, k, v)),
            "operator": jax.jit(lambda q, k, v: ts.flash_attention(q, k, v)),
        }
        with ts.kernel_mode("pallas"):
            ms = time_interleaved(fns, (q, k, v), repeats=7, target_ms=60)
            for name, f in fns.items():
                print(
                    f"d{d} {name:10s} {ms[name]:7.3f} ms  cudnn/ours {ms['cudnn'] / ms[name]:.3f}"
                )
            out = os.environ.get("OUT")
            if out:
                for name in ("direct", "operator"):
                    text = fns[name].lower(q, k, v).compile().as_text()
                    Path(out, f"op-path-{name}-d{d}.txt").write_text(text)


if __name__ == "__main__":
    main()
