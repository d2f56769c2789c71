"""Pallas kernels behind the ts operators (config dataclass, kernel body, wrapper per module).

* :mod:`.matmul_mgpu`: the Hopper (sm_90a) Mosaic GPU matmul with the fused epilogue.
* :mod:`.matmul_portable`: a plain ``pallas_call`` matmul for other GPUs (and interpret mode).
* :mod:`.matmul_configs`: the tile config dataclass, named candidates, heuristic, budget checks.

Kernels know nothing about primitives; ``tessera_jax/primitives/matmul.py`` registers them.
"""
