"""The attention reference on the CPU before and after its two CPU forms (the fixed-point
normaliser's two-stage digit sums, the mask before the exponential), in one process, beside
``jax.nn.dot_product_attention``: milliseconds per call (median of 10 forward / 5 gradient
calls), and whether both forms give the same bits. Run on the CPU::

    JAX_PLATFORMS=cpu python3 benchmarks/archive/reference_cpu_probe.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts
from tessera_jax.primitives import attention as A
from tessera_jax.primitives import reductions as R

FORMS = {
    "before": (lambda x: R._fixed_point_sum(x, lanes=None), A._exp_then_mask),
    "after": (R.fixed_point_sum, A._mask_then_exp),
}


def ms(f, *args, n):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def use(form):
    fps, exp = FORMS[form]
    A.fixed_point_sum = fps
    A._exp_visible = lambda x, vis: jnp.exp(x) if vis is None else exp(x, vis)


def main():
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    x = jax.random.uniform(jax.random.PRNGKey(0), (16, 1024, 1024))
    one = jax.jit(lambda x: R._fixed_point_sum(x, lanes=None))
    two = jax.jit(R.fixed_point_sum)
    same = bool(jnp.array_equal(one(x), two(x)))
    print(
        f"fixed_point_sum 16x1024x1024: one reduction {ms(one, x, n=10):.1f} ms, "
        f"two stages {ms(two, x, n=10):.1f} ms, same bits {same}"
    )
    for b, s, h, d, dt in [
        (4, 512, 8, 64, jnp.float32),
        (2, 1024, 8, 64, jnp.float32),
        (1, 2048, 8, 64, jnp.float32),
        (4, 512, 8, 64, jnp.bfloat16),
    ]:
        q, k, v = (
            jax.random.normal(kk, (b, s, h, d), dt)
            for kk in jax.random.split(jax.random.PRNGKey(s), 3)
        )
        for causal in (False, True):

            def loss(f):
                return lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()

            nn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
            row = {
                "jax.nn": (
                    ms(jax.jit(nn), q, k, v, n=10),
                    ms(jax.jit(jax.grad(loss(nn), (0, 1, 2))), q, k, v, n=5),
                )
            }
            outs = {}
            for form in FORMS:
                use(form)
                t = lambda q, k, v: ts.flash_attention(q, k, v, causal=causal)
                fwd, grad = jax.jit(t), jax.jit(jax.grad(loss(t), (0, 1, 2)))
                outs[form] = [np.asarray(a, np.float32) for a in (fwd(q, k, v), *grad(q, k, v))]
                row[form] = (ms(fwd, q, k, v, n=10), ms(grad, q, k, v, n=5))
            use("after")
            same = all(np.array_equal(a, c) for a, c in zip(outs["before"], outs["after"]))
            nf, ng = row["jax.nn"]
            cells = "  ".join(
                f"{n} fwd {f:6.1f} grad {g:6.1f} (x{nf / f:.2f}, x{ng / g:.2f})"
                for n, (f, g) in row.items()
                if n != "jax.nn"
            )
            print(
                f"b{b} s{s} h{h} d{d} {jnp.dtype(dt).name} causal={causal}: jax.nn fwd "
                f"{nf:6.1f} grad {ng:6.1f} ms | {cells} | same bits {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
