"""rmsnorm and layernorm on the CPU with each form of their statistics (``before``: both
mean squares of every row, then a select; ``after``: a per-row scale, the CPU form), beside
the plain jax.numpy formulas (no overflow guard), in one process: milliseconds per call
(``benchmarks._common.time_interleaved``), forward and gradient (x, weight and bias), and
whether both forms give the same bits. Run on the CPU from the repository root::

    JAX_PLATFORMS=cpu python3 benchmarks/archive/norms_cpu_probe.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts
from benchmarks._common import time_interleaved
from tessera_jax.primitives import norms as N

ROW_SCALE = N._normalise_row_scale


def use(form):
    N._normalise_row_scale = ROW_SCALE if form == "after" else N._normalise_select
    jax.clear_caches()


def jnp_rmsnorm(x, w, b):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
    return (xf * r * w.astype(jnp.float32)).astype(x.dtype)


def jnp_layernorm(x, w, b):
    xf = x.astype(jnp.float32)
    c = xf - jnp.mean(xf, -1, keepdims=True)
    r = jax.lax.rsqrt(jnp.mean(c * c, -1, keepdims=True) + 1e-5)
    return (c * r * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


OPS = {
    "rmsnorm": (lambda x, w, b: ts.rmsnorm(x, w), jnp_rmsnorm, (0, 1)),
    "layernorm": (lambda x, w, b: ts.layernorm(x, w, b), jnp_layernorm, (0, 1, 2)),
}


def programs(f, argnums, args):
    """The forward and gradient programs, compiled now (so that a later form's patch and
    cache clearing leave them as they are)."""
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * jnp.float32(0.5))
    return [jax.jit(g).lower(*args).compile() for g in (f, jax.grad(loss, argnums))]


def main():
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    key = jax.random.PRNGKey(0)
    for rows, d in [(4096, 1024), (1024, 4096), (256, 16384)]:
        for dt in (jnp.float32, jnp.bfloat16):
            kx, kw, kb = jax.random.split(key, 3)
            args = (
                jax.random.normal(kx, (rows, d), dt),
                jax.random.normal(kw, (d,), dt),
                jax.random.normal(kb, (d,), dt),
            )
            for name, (op, plain, argnums) in OPS.items():
                bits = []
                progs = {}
                for form in ("before", "after"):
                    use(form)
                    progs[form] = programs(op, argnums, args)
                    bits.append(
                        [np.asarray(y) for y in jax.tree.leaves([f(*args) for f in progs[form]])]
                    )
                progs["jnp"] = programs(plain, argnums, args)
                fns = {(form, i): f for form, fs in progs.items() for i, f in enumerate(fs)}
                t = time_interleaved(fns, args)
                row = {form: (t[form, 0], t[form, 1]) for form in progs}
                same = all(np.array_equal(a, b) for a, b in zip(*bits))
                cells = " | ".join(
                    f"{form} fwd {row[form][0]:6.2f} grad {row[form][1]:6.2f} "
                    f"(x{row['jnp'][0] / row[form][0]:.2f}, x{row['jnp'][1] / row[form][1]:.2f})"
                    for form in ("before", "after")
                )
                print(
                    f"{rows}x{d} {jnp.dtype(dt).name:8s} {name:9s}: jnp fwd {row['jnp'][0]:6.2f} "
                    f"grad {row['jnp'][1]:6.2f} ms | {cells} | same bits {same}",
                    flush=True,
                )
    use("after")


if __name__ == "__main__":
    main()
