"""The attention reference on the CPU at its default kv block before (one rule for every
platform) and after (the CPU's rule: smaller blocks beyond 64 query rows per kv head) and,
for decoding, the block the CPU's budget alone would give, beside
``jax.nn.dot_product_attention``, in one process: milliseconds per call
(``benchmarks._common.time_interleaved``, 5 repeats of 2 calls), forward and gradient
(q, k, v). Each block runs through ``FlashAttentionConfig(block_kv=…)``. Run on the CPU
from the repository root::

    JAX_PLATFORMS=cpu python3 benchmarks/archive/reference_cpu_blocks.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp

import tessera_jax as ts
from benchmarks._common import time_interleaved
from tessera_jax.contracts.attention import FlashAttentionConfig
from tessera_jax.primitives import attention as A
from tessera_jax.primitives.attention import reference_block_kv

# (batch, seq_q, seq_kv, heads, dtype): training-like shapes, then decoding
CASES = [
    (4, 512, 512, 8, jnp.float32),
    (2, 1024, 1024, 8, jnp.float32),
    (1, 2048, 2048, 8, jnp.float32),
    (1, 4096, 4096, 4, jnp.float32),
    (2, 1024, 1024, 8, jnp.bfloat16),
    (1, 256, 4096, 8, jnp.float32),
    (1, 16, 32768, 8, jnp.float32),
    (4, 1, 8192, 8, jnp.float32),
]


def programs(f):
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))
    return [jax.jit(f), jax.jit(jax.grad(loss, (0, 1, 2)))]


def main():
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for b, sq, skv, h, dt in CASES:
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(sq), 3)
        q = jax.random.normal(kq, (b, sq, h, 64), dt)
        k, v = (jax.random.normal(key, (b, skv, h, 64), dt) for key in (kk, kv))
        blocks = {
            "before": reference_block_kv(sq, skv),
            "after": reference_block_kv(sq, skv, "cpu"),
        }
        budget = A._block_within(A.REFERENCE_BLOCK_ELEMENTS_CPU, sq, skv)
        if budget != blocks["after"]:  # decoding: the block the CPU's budget alone gives
            blocks["budget only"] = budget
        fs = programs(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
        for block in blocks.values():
            config = FlashAttentionConfig(block_kv=block)
            fs += programs(lambda q, k, v, c=config: ts.flash_attention(q, k, v, config=c))
        t = time_interleaved(dict(enumerate(fs)), (q, k, v), min_iters=2)
        cells = " | ".join(
            f"{name} block {block:5d}: fwd {t[2 + 2 * i]:7.1f} grad {t[3 + 2 * i]:7.1f} "
            f"(x{t[0] / t[2 + 2 * i]:.2f}, x{t[1] / t[3 + 2 * i]:.2f})"
            for i, (name, block) in enumerate(blocks.items())
        )
        print(
            f"b{b} sq{sq} skv{skv} h{h} d64 {jnp.dtype(dt).name}: jax.nn fwd {t[0]:7.1f} "
            f"grad {t[1]:7.1f} ms | {cells}",
            flush=True,
        )


if __name__ == "__main__":
    main()
