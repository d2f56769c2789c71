"""``y = alpha·x`` (seed 002 §4.1), the output annotated ``ts.mut``."""

import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def scale(x, y: ts.mut, alpha):
    i = ts.launch.thread_id()
    m = i < x.shape[0]
    ts.tile.store(y, i, alpha * ts.tile.load(x, i, mask=m), mask=m)


def run(x, alpha, *, threads: int = 1024):
    """``alpha·x``. 1024 lanes a group give each of the 128 threads 8 consecutive elements
    (16-byte accesses); one element a thread means 4-byte accesses spread over many tiny
    groups, well short of the copy bandwidth (benchmarks/results/kernels-h100.json)."""
    y = jnp.zeros_like(x)
    return scale[ts.ceil_div(x.shape[0], threads), threads](x, y, alpha)


def reference(x, alpha):
    return float(alpha) * np.asarray(x, np.float64)
