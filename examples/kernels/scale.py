"""``y = alpha·x`` (seed 002 §4.1), the output annotated ``ts.mut``."""

import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def scale(x, y: ts.mut, alpha):
    i = ts.launch.thread_id()
    m = i < x.shape[0]
    ts.tile.store(y, i, alpha * ts.tile.load(x, i, mask=m), mask=m)


def run(x, alpha, *, threads: int = 128):
    y = jnp.zeros_like(x)
    return scale[ts.ceil_div(x.shape[0], threads), threads](x, y, alpha)


def reference(x, alpha):
    return float(alpha) * np.asarray(x, np.float64)
