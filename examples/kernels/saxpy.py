"""SAXPY, ``Out = a·X + Y`` (seed 000 §1): one lane per element, the ragged tail masked."""

import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def saxpy(a, X, Y, Out: ts.mut):
    i = ts.launch.thread_id()
    m = i < X.shape[0]
    ts.tile.store(Out, i, a * ts.tile.load(X, i, mask=m) + ts.tile.load(Y, i, mask=m), mask=m)


def run(a, X, Y, *, threads: int = 256):
    N = X.shape[0]
    Out = jnp.empty_like(X)
    return ts.launch.grid(blocks=(ts.ceil_div(N, threads),), threads=(threads,))(saxpy)(
        a, X, Y, Out
    )


def reference(a, X, Y):
    return float(a) * np.asarray(X, np.float64) + np.asarray(Y, np.float64)
