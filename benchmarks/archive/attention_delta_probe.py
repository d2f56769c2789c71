"""Attention's backward Δ = rowsum(dO∘O) three ways on one GPU, in one process: the row
kernel (``attention_mgpu.row_delta``, ``norms_gpu.row_dot``), XLA's einsum (before), and
the canonical pairwise tree in XLA; alone (ms per call, float64 error, the same bits
from a second compilation) and inside ``jax.grad`` of ``ts.flash_attention`` (the row
kernel against the einsum, swapped in), beside cuDNN's forward+backward. Timing: 30 (Δ)
or 10 (forward+backward) back-to-back calls, best of 3 — not ``benchmarks/attention.py``'s
method. Run on the GPU machine from the repository root::

    PYTHONPATH=$PWD python3 benchmarks/archive/attention_delta_probe.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts
from tessera_jax.pallas_kernels import attention_mgpu as am
from tessera_jax.primitives.reductions import pairwise_tree_sum


def rand(shape, seed, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def timeit(fn, *a, n=30):
    jax.block_until_ready(fn(*a))
    jax.block_until_ready(fn(*a))
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            r = fn(*a)
        jax.block_until_ready(r)
        best.append((time.perf_counter() - t) / n)
    return min(best) * 1e3


def einsum_delta(out, dout, interpret=False):
    return jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), dout.astype(jnp.float32))


def tree_delta(out, dout, interpret=False):
    return jnp.swapaxes(
        pairwise_tree_sum(out.astype(jnp.float32) * dout.astype(jnp.float32), -1), 1, 2
    )


kernel_delta = am.row_delta
for b, s, h, d in ((4, 4096, 16, 128), (4, 4096, 16, 64), (4, 4096, 16, 256), (1, 16384, 16, 128)):
    q, k, v, do, o = (rand((b, s, h, d), i) for i in range(5))
    ref = np.einsum("bqhd,bqhd->bhq", np.asarray(o, np.float64), np.asarray(do, np.float64))
    row = []
    for nm, fn in (("kernel", kernel_delta), ("einsum", einsum_delta), ("tree", tree_delta)):
        j = jax.jit(fn)
        got = np.asarray(j(o, do))
        err = np.abs(got - ref).max() / np.abs(ref).max()
        same = np.array_equal(got, np.asarray(jax.jit(lambda a, c: fn(a, c))(o, do)))
        row.append(
            f"Δ{nm} {timeit(j, o, do):.4f}ms err{err:.1e}{'' if same else ' NOT-REPEATABLE'}"
        )
    for causal in (False, True):
        for nm, fn in (("kernel", kernel_delta), ("einsum", einsum_delta)):
            am.row_delta = fn

            def loss(q, k, v, causal=causal):
                return jnp.sum(
                    ts.flash_attention(q, k, v, causal=causal).astype(jnp.float32)
                    * do.astype(jnp.float32)
                )

            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            row.append(f"{'c' if causal else 'nc'}-{nm} {timeit(g, q, k, v, n=10):.3f}ms")
        am.row_delta = kernel_delta

        def cl(q, k, v, causal=causal):
            return jnp.sum(
                jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn"
                ).astype(jnp.float32)
                * do.astype(jnp.float32)
            )

        try:
            row.append(
                f"{'c' if causal else 'nc'}-cudnn {timeit(jax.jit(jax.grad(cl, argnums=(0, 1, 2))), q, k, v, n=10):.3f}ms"
            )
        except Exception as e:
            row.append("cudnn ERR " + type(e).__name__)
    print((b, s, h, d), " | ".join(row), flush=True)
