"""Tiled GEMM on the tensor cores (seed 000 §2): ``C = A @ B``, f32 accumulation.

Group ``(i, j)`` owns the ``BM×BN`` tile of ``C`` at ``(i·BM, j·BN)`` and walks K in steps
of ``BK``, multiplying an ``A`` and a ``B`` tile into an f32 accumulator per step. The K
loop is one ``scf.for``, which Triton software-pipelines ``num_stages`` deep (the loads of
later steps in flight during this step's ``mma``). Ragged edges are masked; tiles the
index bounds prove inside the arrays are not.
"""

import jax.numpy as jnp
import numpy as np

import tessera_jax as ts


@ts.kernel
def gemm_tc(A, B, C: ts.mut, *, BM: int, BN: int, BK: int):
    m0 = ts.tile.group_id(0) * BM
    n0 = ts.tile.group_id(1) * BN
    acc = ts.tile.zeros((BM, BN), jnp.float32)
    for k in ts.tile.range(0, A.shape[1], BK):
        acc = ts.tile.mma(A[m0 : m0 + BM, k : k + BK], B[k : k + BK, n0 : n0 + BN], acc)
    C[m0 : m0 + BM, n0 : n0 + BN] = acc


def run(A, B, *, BM=128, BN=128, BK=64, num_warps=8, num_stages=3, out_dtype=None):
    M, N = A.shape[0], B.shape[1]
    C = jnp.zeros((M, N), out_dtype or A.dtype)
    g = ts.launch.grid(
        blocks=(ts.ceil_div(M, BM), ts.ceil_div(N, BN)),
        threads=(BM, BN),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return g(gemm_tc)(A, B, C, BM=BM, BN=BN, BK=BK)


def reference(A, B):
    return np.asarray(A, np.float64) @ np.asarray(B, np.float64)
