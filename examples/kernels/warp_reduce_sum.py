"""Warp sums by shuffles (seed 000 §3): ``Out[w]`` is the sum of the 32 elements of warp ``w``.

``val += warp_shuffle_down(val, offset)`` for offsets 16…1 leaves each warp's sum in its
lane 0 (a tree with a fixed order, so the same bits every run); ``warp_lane(val, 0)`` is
that lane of every warp, what the seed's ``if lane_id() == 0: Out[warp_id()] = val`` stores.
"""

import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def warp_reduce_sum(X, Out: ts.mut):
    tid = ts.launch.thread_id()
    val = ts.tile.load(X, tid, mask=tid < X.shape[0])
    for offset in [16, 8, 4, 2, 1]:
        val += ts.tile.warp_shuffle_down(val, offset)
    w = ts.tile.warp_id()
    ts.tile.store(Out, w, ts.tile.warp_lane(val, 0), mask=w < Out.shape[0])


def run(X, *, threads: int = 128):
    Out = jnp.zeros((ts.ceil_div(X.shape[0], 32),), X.dtype)
    return ts.launch.grid(blocks=(ts.ceil_div(X.shape[0], threads),), threads=(threads,))(
        warp_reduce_sum
    )(X, Out)


def reference(X):
    x = np.asarray(X, np.float64)
    pad = np.zeros(-(-x.size // 32) * 32)
    pad[: x.size] = x
    return pad.reshape(-1, 32).sum(axis=1)
