"""The memory hierarchy (seed 003): registers, shared tiles, global arrays, async copies.

``memory_hierarchy``: each ``T×T`` tile of ``A`` is copied into a shared tile
(``cp_async`` / commit / wait), its mean over the elements inside ``A`` accumulated in a
register, and the tile written back centred: ``Out = A - mean(tile)``.

``optimized_memory_access``: a copy of ``src`` to ``dst`` in strips of ``ROWS`` rows,
each strip one vectorised load and store of ``TILE_N``-wide rows (``load_vector``).
"""

import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def memory_hierarchy(A, Out: ts.mut, *, T: int):
    reg = ts.tile.alloc_register(jnp.float32)
    smem = ts.tile.alloc_shared((T, T), jnp.float32, swizzle="xor")
    bm, bn = ts.tile.group_id(0) * T, ts.tile.group_id(1) * T
    ts.tile.cp_async(smem, A[bm : bm + T, bn : bn + T])
    ts.tile.cp_commit_group()
    ts.tile.cp_wait_group(0)
    rows, cols = ts.tile.lanes(bm, T), ts.tile.lanes(bn, T)
    inside = (rows < A.shape[0])[:, None] & (cols < A.shape[1])[None, :]
    count = ts.tile.reduce_sum(ts.tile.where(inside, 1.0, 0.0))
    reg = reg + ts.tile.reduce_sum(smem) / count
    Out[bm : bm + T, bn : bn + T] = smem - reg


@ts.kernel
def optimized_memory_access(src, dst: ts.mut, *, TILE_M: int, TILE_N: int, ROWS: int):
    bm, bn = ts.tile.group_id(0) * TILE_M, ts.tile.group_id(1) * TILE_N
    for i in ts.tile.range(0, TILE_M, ROWS):
        strip = ts.tile.lanes(bm + i, ROWS)
        vec = ts.tile.load_vector(src, (strip, bn), width=TILE_N)
        ts.tile.store_vector(dst, vec, (strip, bn))


def run_memory_hierarchy(A, *, T=32):
    Out = jnp.zeros(A.shape, jnp.float32)
    g = ts.launch.grid(
        blocks=(ts.ceil_div(A.shape[0], T), ts.ceil_div(A.shape[1], T)), threads=(T, T)
    )
    return g(memory_hierarchy)(A, Out, T=T)


def run_optimized_memory_access(src, *, TILE_M=64, TILE_N=64, ROWS=4):
    dst = jnp.zeros_like(src)
    blocks = (ts.ceil_div(src.shape[0], TILE_M), ts.ceil_div(src.shape[1], TILE_N))
    g = ts.launch.grid(blocks=blocks, threads=(ROWS, TILE_N))
    return g(optimized_memory_access)(src, dst, TILE_M=TILE_M, TILE_N=TILE_N, ROWS=ROWS)


def reference_memory_hierarchy(A, *, T=32):
    a = np.asarray(A, np.float64)
    out = np.empty_like(a)
    for i in range(0, a.shape[0], T):
        for j in range(0, a.shape[1], T):
            t = a[i : i + T, j : j + T]
            out[i : i + T, j : j + T] = t - t.mean()
    return out
