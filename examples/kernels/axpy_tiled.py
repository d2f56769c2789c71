"""Tiled, pipelined AXPY with autotuning (seed 002 §4.3): ``Y ← alpha·X + Y`` in f16.

Each group walks the array in tiles of ``BM`` lanes with a grid stride, copying the next
``X`` tile into a shared tile while it updates ``Y`` from the current one; the loop is
pipelined ``stages`` deep (``prefetch=stages - 1``). ``BM`` and ``stages`` are tuned on the
first launch for each shape (``@ts.kernel.autotune``); the launch's lane count follows
``BM`` (``threads=lambda c: (c["BM"],)``).

The grid is as wide as the GPU holds groups (up to 32 one-warp groups per multiprocessor)
and no wider than the array has tiles: a tile is a few hundred bytes, so only many groups
in flight at once keep enough loads outstanding to saturate memory bandwidth. One warp per
group gives each lane 4 or 8 consecutive f16 elements, i.e. 8- or 16-byte accesses.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts

# Resident groups per multiprocessor (CUDA's limit on Hopper and Ampere).
GROUPS_PER_SM = 32


@ts.kernel.autotune(space=dict(BM=[128, 256], stages=[2, 3]))
def axpy_tiled(X, Y: ts.mut, alpha, *, BM: int, stages: int):
    s0 = ts.tile.alloc_shared((BM,), X.dtype)
    lanes = ts.launch.thread_id()
    for t in ts.tile.range(0, X.shape[0], ts.tile.num_groups() * BM, prefetch=stages - 1):
        i = lanes + t
        m = i < X.shape[0]
        ts.tile.cp_async(s0, X[i])  # prefetched by the pipeliner `stages - 1` tiles ahead
        ts.tile.barrier()
        yv = alpha * s0.astype(jnp.float32) + ts.tile.load(Y, i, mask=m).astype(jnp.float32)
        ts.tile.store(Y, i, yv, mask=m)
    ts.tile.barrier()


@functools.cache
def launch(n: int):
    """The launch for arrays of ``n`` elements: as many groups as the GPU holds at once, but
    no more than there are tiles of ``BM`` elements."""
    sms = getattr(jax.devices()[0], "core_count", None) or 1  # one "SM" on the CPU
    return ts.launch.grid(
        blocks=lambda c: (min(ts.ceil_div(n, c["BM"]), GROUPS_PER_SM * sms),),
        threads=lambda c: (c["BM"],),
        num_warps=1,
    )(axpy_tiled)


def run(X, Y, alpha, **config):
    """``alpha·X + Y`` (``config``: BM and stages to fix instead of tuning them)."""
    return launch(X.shape[0])(X, Y, alpha, **config)


def reference(X, Y, alpha):
    return float(alpha) * np.asarray(X, np.float64) + np.asarray(Y, np.float64)
