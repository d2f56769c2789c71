"""Warp sums by shuffles (seed 000 §3): ``Out[w]`` is the sum of the 32 elements of warp ``w``.

``val += warp_shuffle_down(val, offset)`` for offsets 16…1 leaves each warp's sum in its
lane 0 (a tree with a fixed order, so the same bits every run); ``warp_lane(val, 0)`` is
that lane of every warp, what the seed's ``if lane_id() == 0: Out[warp_id()] = val`` stores.

On the GPU each shuffle is one Triton gather along the warp's 32 lanes, warp shuffles
between the threads that hold them. Groups of 1024 lanes over 8 warps give each thread
four elements, loaded as one vector; groups of the seed's 128 lanes leave one element per
thread and too little in flight to reach memory bandwidth.
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


def run(X, *, threads: int = 1024, num_warps: int = 8):
    Out = jnp.zeros((ts.ceil_div(X.shape[0], 32),), X.dtype)
    g = ts.launch.grid(
        blocks=(ts.ceil_div(X.shape[0], threads),), threads=(threads,), num_warps=num_warps
    )
    return g(warp_reduce_sum)(X, Out)


def reference(X):
    x = np.asarray(X, np.float64)
    pad = np.zeros(-(-x.size // 32) * 32)
    pad[: x.size] = x
    return pad.reshape(-1, 32).sum(axis=1)
