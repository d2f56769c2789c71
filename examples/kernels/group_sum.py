"""Per-group partial sums (seed 002 §4.2): a grid-stride loop, then a group reduction.

Each of the ``G`` groups of ``T`` lanes accumulates every ``G·T``-th element from its own
offset, parks the lane sums in a shared tile, synchronises and reduces them; ``out[g]``
is group ``g``'s sum, and ``sum(out)`` the array's.

By default the grid has 8 groups of 1024 lanes per multiprocessor (fewer when the array is
smaller): a grid-stride loop reads memory only as fast as enough groups keep loads in
flight, and a handful of groups leave most of the GPU idle.
"""

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts

GROUPS_PER_SM = 8


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


def default_groups(n: int, threads: int) -> int:
    """Enough groups to fill the GPU, no more than the array has tiles of ``threads``."""
    sms = getattr(jax.devices()[0], "core_count", None) or 1  # one "SM" on the CPU
    return min(ts.ceil_div(n, threads), GROUPS_PER_SM * sms)


def run(x, *, groups: int | None = None, threads: int = 1024, num_warps: int = 8):
    groups = groups or default_groups(x.shape[0], threads)
    out = jnp.zeros((groups,), jnp.float32)
    g = ts.launch.grid(blocks=(groups,), threads=(threads,), num_warps=num_warps)
    return g(group_sum)(x, out)


def reference(x, *, groups: int | None = None, threads: int = 1024):
    groups = groups or default_groups(len(x), threads)
    x = np.asarray(x, np.float64)
    stride = groups * threads
    pad = np.zeros(-(-x.size // stride) * stride)
    pad[: x.size] = x
    return pad.reshape(-1, groups, threads).sum(axis=(0, 2))
