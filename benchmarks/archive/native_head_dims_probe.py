"""Probe: head dims 80 and 96 run natively by the Mosaic GPU kernels (narrower shared-memory
swizzles: 64 bytes at 96, 32 at 80, patched in here) against the shipped path, which
zero-pads them to 128 (``attention_mgpu.kernel_head_dim``), and cuDNN; B4 S4096 H16 bf16,
forward and forward+backward, causal and not, with the error against an f32 XLA reference
and whether two runs give the same bits. The patch takes the tuning of head dim 128.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/native_head_dims_probe.py

``--small``: a tiny shape without cuDNN (a smoke test on the CPU, where ``pallas`` mode
runs the reference, not the kernels).
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

import tessera_jax as ts
from benchmarks._common import normal, time_interleaved
from tessera_jax.pallas_kernels import attention_mgpu as am

NATIVE = (80, 96)
SHIPPED = (am._smem, am.HEAD_DIMS)


def _smem(shape, dtype):
    """``am._smem`` with the widest swizzle that divides a row (128 bytes at 64/128/256)."""
    row = shape[-1] * 2
    swizzle = next(s for s in (128, 64, 32) if row % s == 0)
    transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def native(on: bool) -> None:
    if not on:
        am._smem, am.HEAD_DIMS = SHIPPED
        return
    am._smem, am.HEAD_DIMS = _smem, tuple(sorted({*SHIPPED[1], *NATIVE}))
    for table in (am.FWD_BLOCK_KV, am.FWD_PIPELINED, am.FWD_PINGPONG, am.DQ_BLOCK_KV):
        table.update({d: table[128] for d in NATIVE})
    for table in (am.DKV_STAGES, am.DKV_PAIRED):
        table.update({d: table[128] for d in NATIVE})


def build(f, backward, do):
    if not backward:
        return jax.jit(f)

    def g(q, k, v):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do))

    return jax.jit(g)


def main() -> None:
    small = "--small" in sys.argv
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for d in (96, 80):
        shape = (1, 256, 2, d) if small else (4, 4096, 16, d)
        q, k, v, do = (normal(i, shape, jnp.bfloat16) for i in range(4))
        for backward in (False, True):
            for causal in (False, True):

                def ours(q, k, v, causal=causal):
                    return ts.flash_attention(q, k, v, causal=causal)

                def cudnn(q, k, v, causal=causal):
                    return jax.nn.dot_product_attention(
                        q, k, v, is_causal=causal, implementation="cudnn"
                    )

                def xla(q, k, v, causal=causal):
                    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
                    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

                fns, notes = {}, []
                with jax.default_matmul_precision("highest"):
                    want = jax.tree.leaves(build(xla, backward, do.astype(jnp.float32))(q, k, v))
                for name in ("native", "padded"):
                    native(name == "native")
                    f = build(ours, backward, do)
                    with ts.kernel_mode("pallas"):
                        runs = [jax.tree.leaves(f(q, k, v)) for _ in range(2)]
                    native(False)
                    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(*runs))
                    err = max(
                        float(jnp.linalg.norm((a.astype(jnp.float32) - b).ravel()))
                        / float(jnp.linalg.norm(b.ravel()))
                        for a, b in zip(runs[0], want)
                    )
                    fns[name] = f
                    notes.append(f"{name}: err {err:.1e} repeat {same}")
                if not small:
                    fns["cudnn"] = build(cudnn, backward, do)
                t = time_interleaved(fns, (q, k, v), repeats=7)
                base = t.get("cudnn", t["padded"])
                tag = f"{'fwdbwd' if backward else 'fwd'} {'causal' if causal else 'noncausal'}"
                print(
                    f"{tag:18s} d{d} native {t['native']:.4f} padded {t['padded']:.4f} ms"
                    f" cudnn {t.get('cudnn', 0):.4f} ms | vs cudnn: native"
                    f" {base / t['native']:.3f} padded {base / t['padded']:.3f} | "
                    + " | ".join(notes),
                    flush=True,
                )


if __name__ == "__main__":
    main()
