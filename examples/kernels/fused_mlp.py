"""A fused two-layer MLP (seed 000 §5): ``relu(X W1 + b1) W2 + b2`` without writing ``H``.

Each group takes ``BM`` rows of ``X``; the hidden tile stays on chip between the dots.
The weights are loaded whole, so ``D``, ``H`` and ``F`` are powers of two (≥ 16).
"""

import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def fused_mlp(X, W1, b1, W2, b2, Out: ts.mut, *, BM: int):
    m0 = ts.tile.group_id(0) * BM
    H = ts.tile.dot(X[m0 : m0 + BM, :], W1) + ts.tile.load(b1)[None, :]
    H = ts.tile.relu(H)
    Out[m0 : m0 + BM, :] = ts.tile.dot(H.astype(W2.dtype), W2) + ts.tile.load(b2)[None, :]


def run(X, W1, b1, W2, b2, *, BM=64):
    Out = jnp.zeros((X.shape[0], W2.shape[1]), X.dtype)
    g = ts.launch.grid(blocks=(ts.ceil_div(X.shape[0], BM),), threads=(BM,))
    return g(fused_mlp)(X, W1, b1, W2, b2, Out, BM=BM)


def reference(X, W1, b1, W2, b2):
    f = lambda a: np.asarray(a, np.float64)
    h = np.maximum(f(X) @ f(W1) + f(b1), 0.0)
    return h @ f(W2) + f(b2)
