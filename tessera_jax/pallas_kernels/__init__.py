"""Pallas kernels behind the ts operators (config dataclass, kernel body, wrapper per module).

* :mod:`.matmul_mgpu`: the Hopper (sm_90a) Mosaic GPU matmul with the fused epilogue.
* :mod:`.matmul_portable`: a plain ``pallas_call`` matmul for other GPUs (and interpret mode).
* :mod:`.matmul_configs`: the tile config dataclass, named candidates, heuristic, budget checks.
* :mod:`.attention_mgpu`: Hopper flash attention: forward, and a backward of separate dQ
  and dK/dV kernels with no atomics (bitwise reproducible gradients).
* :mod:`.attention_decode`: the attention forward at decode shapes (1 to 16 queries against
  a long cache) in Pallas' Triton backend, registered ahead of the Hopper forward there.
* :mod:`.allreduce_mgpu`: the deterministic all-reduce over NVLink (one Mosaic GPU kernel).
* :mod:`.norms_gpu`: row-wise softmax, log_softmax, rmsnorm and layernorm, forward and backward.
* :mod:`.norms_mgpu`: the same kernels (not ``row_dot``) in Mosaic GPU, registered after
  them for when Pallas' Triton backend is gone.
* :mod:`.device`: what the kernels ask of the GPU (SM count, Hopper or not).

Every kernel module offers the same vocabulary (``fn(spec, *operands, interpret)``,
``supports``, ``prefer``, ``hardware``; see ``primitives/_core.Kernel``). Kernels import
operator contracts (``tessera_jax/contracts/``), never ``tessera_jax.primitives``, whose
``matmul.py`` and ``collectives/`` call them; so the all-reduce kernel carries its own copy
of the canonical tree, tested bit for bit against ``primitives.reductions.pairwise_tree_sum``.
"""
