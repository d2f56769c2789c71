"""Probe: the norm kernels' rescaled statistics behind a branch, against always computed.

rmsnorm's and layernorm's statistics guard against a row whose mean square overflows f32
with a second, rescaled mean square (``norms_gpu._normalise``). This probe times another
tree's ``norms_gpu.py`` (``--old``: at d33e858 every kernel computed both mean squares)
against the working tree's, forward and backward kernels called directly, interleaved in
one process on one GPU in both call orders, and compares their bits. Weight and bias in
f32, bf16 rows of standard normals.

    git show d33e858:tessera_jax/pallas_kernels/norms_gpu.py > /tmp/norms_old.py
    python3 benchmarks/archive/norms_branch_probe.py --old /tmp/norms_old.py
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import module_from_file, time_interleaved
from tessera_jax.pallas_kernels import norms_gpu as new

EPS = 1e-6
SHAPES = ((32768, 4096), (8192, 2048), (16384, 1024))


def kernels(d):
    """name -> (module -> fn(x, w, b, ct))."""
    ln = (("eps", EPS), ("has_bias", True), ("has_weight", True))
    rm = (("eps", EPS), ("has_weight", True))
    grads = (("weight_grad_shape", (d,)),)
    lnb = (("bias_grad_shape", (d,)), ("eps", EPS), ("has_weight", True), *grads)
    rmb = (("eps", EPS), ("has_weight", True), *grads)
    return {
        "layernorm fwd": lambda m: lambda x, w, b, ct: m.layernorm(ln, x, w, b),
        "rmsnorm fwd": lambda m: lambda x, w, b, ct: m.rmsnorm(rm, x, w),
        "layernorm bwd": lambda m: lambda x, w, b, ct: m.layernorm_bwd(lnb, x, w, ct),
        "rmsnorm bwd": lambda m: lambda x, w, b, ct: m.rmsnorm_bwd(rmb, x, w, ct),
    }


def main(old):
    for rows, d in SHAPES:
        ks = jax.random.split(jax.random.key(1), 4)
        x = jax.random.normal(ks[0], (rows, d), jnp.float32).astype(jnp.bfloat16)
        w = 1 + 0.1 * jax.random.normal(ks[1], (d,), jnp.float32)
        b = 0.1 * jax.random.normal(ks[2], (d,), jnp.float32)
        ct = jax.random.normal(ks[3], (rows, d), jnp.float32).astype(jnp.bfloat16)
        args = (x, w, b, ct)
        for name, make in kernels(d).items():
            fns = {"old": jax.jit(make(old)), "new": jax.jit(make(new))}
            outs = {n: jax.tree.leaves(f(*args)) for n, f in fns.items()}
            same = all(bool(jnp.array_equal(a, c)) for a, c in zip(outs["old"], outs["new"]))
            t = time_interleaved(fns, args, repeats=9)
            t2 = time_interleaved(dict(reversed(list(fns.items()))), args, repeats=9)
            print(
                f"{rows}x{d} {name:14s} same {same} | old {t['old']:.4f}/{t2['old']:.4f}  "
                f"new {t['new']:.4f}/{t2['new']:.4f} ms  new/old {t['new'] / t['old']:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    assert sys.argv[1:2] == ["--old"], __doc__
    main(module_from_file(sys.argv[2], "norms_gpu_old"))
