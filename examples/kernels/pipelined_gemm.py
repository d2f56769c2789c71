"""The double-buffered GEMM (seeds 000 §3 and 003): copies of step k+1 overlap step k's mma.

Two shared tiles per operand alternate: while the tensor cores multiply buffer 0, the
copies into buffer 1 are in flight, and the other way round; the K loop advances two
steps per iteration so that each buffer's role is fixed in the source. ``cp_wait_group(1)``
waits for all but the newest copy group: the buffer about to be read has landed.

The copies read inputs, so each is performed where its buffer is read, and the copy into
buffer 0 for the next iteration follows the loop index (``ts.tile.cp_async``): the loop
the GPU compiler sees loads both K steps' tiles and multiplies them, and its pipeliner
keeps ``num_stages`` iterations of copies in flight. Groups are numbered as in
``gemm_tc`` (bands of ``GROUP_M`` tile rows, for L2 reuse). An iteration holds two K steps,
so ``BK`` is half of ``gemm_tc``'s for the same shared memory per stage; its two ``mma``
are still two tensor-core dots per iteration, where ``gemm_tc`` has one
(``benchmarks/results/kernels-h100.json`` compares them).
"""

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def double_buffered_gemm(A, B, C: ts.mut, *, BM: int, BN: int, BK: int, GROUP_M: int):
    grid_n = ts.ceil_div(B.shape[1], BN)
    pid = ts.tile.linear_id()
    width = GROUP_M * grid_n  # groups per band of GROUP_M tile rows
    m0 = ((pid // width) * GROUP_M + pid % GROUP_M) * BM
    n0 = (pid % width) // GROUP_M * BN
    smem_a = [ts.tile.alloc_shared((BM, BK), A.dtype), ts.tile.alloc_shared((BM, BK), A.dtype)]
    smem_b = [ts.tile.alloc_shared((BK, BN), B.dtype), ts.tile.alloc_shared((BK, BN), B.dtype)]
    acc = ts.tile.zeros((BM, BN), jnp.float32)
    # Prefetch the first K step.
    ts.tile.cp_async(smem_a[0], A[m0 : m0 + BM, 0:BK])
    ts.tile.cp_async(smem_b[0], B[0:BK, n0 : n0 + BN])
    ts.tile.cp_commit_group()
    for k in ts.tile.range(0, A.shape[1], 2 * BK):
        ts.tile.cp_async(smem_a[1], A[m0 : m0 + BM, k + BK : k + 2 * BK])
        ts.tile.cp_async(smem_b[1], B[k + BK : k + 2 * BK, n0 : n0 + BN])
        ts.tile.cp_commit_group()
        ts.tile.cp_wait_group(1)
        ts.tile.barrier()
        acc = ts.tile.mma(smem_a[0], smem_b[0], acc)
        ts.tile.cp_async(smem_a[0], A[m0 : m0 + BM, k + 2 * BK : k + 3 * BK])
        ts.tile.cp_async(smem_b[0], B[k + 2 * BK : k + 3 * BK, n0 : n0 + BN])
        ts.tile.cp_commit_group()
        ts.tile.cp_wait_group(1)
        ts.tile.barrier()
        acc = ts.tile.mma(smem_a[1], smem_b[1], acc)
    C[m0 : m0 + BM, n0 : n0 + BN] = acc


def run(A, B, *, BM=128, BN=256, BK=32, num_warps=8, num_stages=3, out_dtype=None, GROUP_M=8):
    M, N = A.shape[0], B.shape[1]
    C = jax.ShapeDtypeStruct((M, N), out_dtype or A.dtype)  # every element is stored
    grid_m, grid_n = ts.ceil_div(M, BM), ts.ceil_div(N, BN)
    g = ts.launch.grid(
        blocks=(grid_m * grid_n,), threads=(BM, BN), num_warps=num_warps, num_stages=num_stages
    )
    group = next(h for h in (GROUP_M, 4, 2, 1) if h <= GROUP_M and grid_m % h == 0)  # whole bands
    return g(double_buffered_gemm)(A, B, C, BM=BM, BN=BN, BK=BK, GROUP_M=group)


def reference(A, B):
    return np.asarray(A, np.float64) @ np.asarray(B, np.float64)
