"""One group reduces a whole array (seed 003): strided lane sums, then a tree in shared memory.

Each lane sums ``data[lane::T]``; the tree then adds lane ``i + stride`` to lane ``i`` for
``stride = T/2, T/4, …, 1``, as the seed's ``while stride > 0`` loop does (``stride`` is a
Python int, so the loop unrolls at trace time), reading the shared tile whole.
"""

import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def cooperative_reduction(data, out: ts.mut):
    T = ts.tile.group_size()
    shared_sum = ts.tile.alloc_shared((T,), jnp.float32)
    lane = ts.tile.local_id()
    local_sum = ts.tile.zeros((T,), jnp.float32)
    for i in ts.tile.range(0, data.shape[0], T):
        j = lane + i
        local_sum += ts.tile.load(data, j, mask=j < data.shape[0]).astype(jnp.float32)
    ts.tile.store(shared_sum, lane, local_sum)
    ts.tile.barrier()
    s = ts.tile.load(shared_sum)
    stride = T // 2
    while stride > 0:
        s = ts.tile.reduce_sum(s.reshape(2, stride), axis=0)  # lane i += lane i + stride
        ts.tile.barrier()
        stride //= 2
    ts.tile.store(out, 0, s.reshape(()))


def run(data, *, threads: int = 128):
    out = jnp.zeros((1,), jnp.float32)
    return ts.launch.grid(blocks=(1,), threads=(threads,))(cooperative_reduction)(data, out)


def reference(data):
    return np.asarray([np.asarray(data, np.float64).sum()])
