"""Per-group partial sums (seed 002 §4.2): a grid-stride loop, then a group reduction.

Each of the ``G`` groups of ``T`` lanes accumulates every ``G·T``-th element from its own
offset, parks the lane sums in a shared tile, synchronises and reduces them; ``out[g]``
is group ``g``'s sum, and ``sum(out)`` the array's.
"""

import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def group_sum(x, out: ts.mut):
    T = ts.tile.group_size()
    smem = ts.tile.alloc_shared((T,), jnp.float32)
    i = ts.launch.thread_id()
    acc = ts.tile.zeros((T,), jnp.float32)
    for k in ts.tile.range(0, x.shape[0], ts.tile.num_groups() * T):
        j = i + k
        acc += ts.tile.load(x, j, mask=j < x.shape[0]).astype(jnp.float32)
    ts.tile.store(smem, ts.tile.local_id(), acc)
    ts.tile.barrier()  # every lane's sum is in smem before it is reduced
    ts.tile.store(out, ts.tile.group_id(), ts.tile.reduce_sum(smem))


def run(x, *, groups: int = 4, threads: int = 128):
    out = jnp.zeros((groups,), jnp.float32)
    return ts.launch.grid(blocks=(groups,), threads=(threads,))(group_sum)(x, out)


def reference(x, *, groups: int = 4, threads: int = 128):
    x = np.asarray(x, np.float64)
    stride = groups * threads
    pad = np.zeros(-(-x.size // stride) * stride)
    pad[: x.size] = x
    return pad.reshape(-1, groups, threads).sum(axis=(0, 2))
