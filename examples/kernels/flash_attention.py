"""Flash attention (seed 000 §2) for ``(batch·heads, S, D)`` arrays, non-causal.

Group ``(i, b)`` holds ``BQ`` query rows of head ``b`` and streams K and V in blocks of
``BKV`` with the online softmax: a running row maximum ``m``, row sum ``l`` and f32
output accumulator, rescaled when the maximum grows, so the ``S×S`` scores never exist.
Key columns past ``S`` get ``-inf`` scores. ``D`` is a power of two.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def flash_attention(Q, K, V, O: ts.mut, *, BQ: int, BKV: int, scale: float):
    b = ts.tile.group_id(1)
    q0 = ts.tile.group_id(0) * BQ
    S = K.shape[1]
    q = ts.tile.load(Q[b, q0 : q0 + BQ, :])
    m = ts.tile.full((BQ,), -jnp.inf)
    l = ts.tile.zeros((BQ,))
    acc = ts.tile.zeros((BQ, Q.shape[2]))
    for j in ts.tile.range(0, S, BKV):
        k = ts.tile.load(K[b, j : j + BKV, :])
        v = ts.tile.load(V[b, j : j + BKV, :])
        s = ts.tile.dot(q, k.T) * scale
        cols = ts.tile.lanes(j, BKV)
        s = ts.tile.where((cols < S)[None, :], s, -jnp.inf)
        m_new = ts.tile.maximum(m, ts.tile.max(s, axis=1))
        p = ts.tile.exp(s - m_new[:, None])
        alpha = ts.tile.exp(m - m_new)
        l = l * alpha + ts.tile.reduce_sum(p, axis=1)
        acc = acc * alpha[:, None] + ts.tile.dot(p.astype(v.dtype), v)
        m = m_new
    O[b, q0 : q0 + BQ, :] = acc / l[:, None]


def run(Q, K, V, *, BQ=128, BKV=64, num_warps=8, num_stages=2):
    BH, S, D = Q.shape
    O = jax.ShapeDtypeStruct(Q.shape, Q.dtype)  # every element is stored
    g = ts.launch.grid(
        blocks=(ts.ceil_div(S, BQ), BH), threads=(BQ,), num_warps=num_warps, num_stages=num_stages
    )
    return g(flash_attention)(Q, K, V, O, BQ=BQ, BKV=BKV, scale=1.0 / math.sqrt(D))


def reference(Q, K, V):
    q, k, v = (np.asarray(x, np.float64) for x in (Q, K, V))
    s = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v
