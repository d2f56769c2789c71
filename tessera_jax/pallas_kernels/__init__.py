"""Pallas kernels behind the ts operators (config dataclass, kernel body, wrapper per module).

* :mod:`.matmul_mgpu`: the Hopper (sm_90a) Mosaic GPU matmul with the fused epilogue.
* :mod:`.matmul_portable`: a plain ``pallas_call`` matmul for other GPUs (and interpret mode).
* :mod:`.matmul_configs`: the tile config dataclass, named candidates, heuristic, budget checks.
* :mod:`.allreduce_mgpu`: the deterministic all-reduce over NVLink (one Mosaic GPU kernel).
* :mod:`.device`: what the kernels ask of the GPU (SM count, Hopper or not).

Kernels know nothing about primitives; ``tessera_jax/primitives/matmul.py`` and
``collectives.py`` call them. (So the all-reduce kernel carries its own copy of the
canonical tree, tested bit for bit against ``primitives.reductions.pairwise_tree_sum``.)
"""
