"""Probe: how much of the attention forward's time is a fixed cost per CTA (launch, the Q
load, the first K/V blocks' latency, the epilogue's store) rather than per key block?
B4 H16 D128 bf16 non-causal, ours (``am.flash_fwd``) and cuDNN in one process.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_cta_overhead_probe.py [head_dim]

Part 1 keeps the queries (4096: the same CTAs and waves) and varies the keys: a line
``ms = fixed + slope · keys`` through the points puts the per-CTA fixed cost in ``fixed``.
Part 2 varies the queries at 4096 keys: the CTA count, so the last wave's fill.
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import normal, time_interleaved
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am

b, h = 4, 16
d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
spec = AttentionSpec(causal=False, scale=d**-0.5, config=FlashAttentionConfig())
sms = jax.devices()[0].core_count
ours = jax.jit(lambda q, k, v: am.flash_fwd(spec, q, k, v)[0])
cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))


def row(sq, skv):
    q = normal(0, (b, sq, h, d), jnp.bfloat16)
    k, v = (normal(i, (b, skv, h, d), jnp.bfloat16) for i in (1, 2))
    ms = time_interleaved({"ours": ours, "cudnn": cudnn}, (q, k, v), repeats=7, target_ms=60)
    ctas = b * h * (sq // am.TILE)
    flops = 4 * b * h * sq * skv * d
    print(
        f"sq {sq:6d} skv {skv:6d} ctas {ctas:5d} waves {ctas / sms:6.2f}  "
        f"ours {ms['ours']:.4f} ms {flops / ms['ours'] / 1e9:5.0f} TF/s  "
        f"cudnn {ms['cudnn']:.4f} ms {flops / ms['cudnn'] / 1e9:5.0f} TF/s  "
        f"ratio {ms['cudnn'] / ms['ours']:.3f}",
        flush=True,
    )
    return ms


print(f"{jax.devices()[0].device_kind}, {sms} SMs, D{d}")
keys = (1024, 2048, 4096, 8192, 16384)
pts = {s: row(4096, s) for s in keys}
for impl in ("ours", "cudnn"):
    slope, fixed = np.polyfit(keys, [pts[s][impl] for s in keys], 1)
    per_cta = fixed / (b * h * 4096 // am.TILE / sms) * 1e3
    print(
        f"{impl:5s} fit: fixed {fixed:.4f} ms ({per_cta:.2f} us per CTA wave), "
        f"{slope * 1e6:.3f} ns per key; fixed share at 4096 keys "
        f"{fixed / pts[4096][impl]:.1%}"
    )
for sq in (2048, 3072, 8192):
    row(sq, 4096)
