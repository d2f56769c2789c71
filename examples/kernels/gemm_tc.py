"""Tiled GEMM on the tensor cores (seed 000 §2): ``C = A @ B``, f32 accumulation.

Each group owns one ``BM×BN`` tile of ``C`` and walks K in steps of ``BK``, multiplying an
``A`` and a ``B`` tile into an f32 accumulator per step. The K loop is one ``scf.for``,
which Triton software-pipelines ``num_stages`` deep (the loads of later steps in flight
during this step's ``mma``). Groups are numbered so that ``GROUP_M`` consecutive ones
share a column band of ``B`` and a row band of ``A`` (tiles in L2 while they are reused).
Ragged edges are masked; tiles whose index bounds prove them inside the arrays are not.
"""

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def gemm_tc(A, B, C: ts.mut, *, BM: int, BN: int, BK: int, GROUP_M: int):
    grid_n = ts.ceil_div(B.shape[1], BN)
    pid = ts.tile.linear_id()
    width = GROUP_M * grid_n  # groups per band of GROUP_M tile rows
    m0 = ((pid // width) * GROUP_M + pid % GROUP_M) * BM
    n0 = (pid % width) // GROUP_M * BN
    acc = ts.tile.zeros((BM, BN), jnp.float32)
    for k in ts.tile.range(0, A.shape[1], BK):
        acc = ts.tile.mma(A[m0 : m0 + BM, k : k + BK], B[k : k + BK, n0 : n0 + BN], acc)
    C[m0 : m0 + BM, n0 : n0 + BN] = acc


def group_m(grid_m: int, want: int = 8) -> int:
    """The largest band height ≤ ``want`` dividing ``grid_m`` (so every band is whole)."""
    return next(g for g in (want, 4, 2, 1) if g <= want and grid_m % g == 0)


def run(A, B, *, BM=128, BN=128, BK=64, num_warps=8, num_stages=3, out_dtype=None, GROUP_M=8):
    M, N = A.shape[0], B.shape[1]
    C = jax.ShapeDtypeStruct((M, N), out_dtype or A.dtype)  # every element is stored
    grid_m, grid_n = ts.ceil_div(M, BM), ts.ceil_div(N, BN)
    g = ts.launch.grid(
        blocks=(grid_m * grid_n,), threads=(BM, BN), num_warps=num_warps, num_stages=num_stages
    )
    return g(gemm_tc)(A, B, C, BM=BM, BN=BN, BK=BK, GROUP_M=group_m(grid_m, GROUP_M))


def reference(A, B):
    return np.asarray(A, np.float64) @ np.asarray(B, np.float64)
