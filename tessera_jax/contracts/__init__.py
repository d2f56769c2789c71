"""Operator contracts shared by an operator module, its reference and its kernels.

A contract module holds an operator's frozen spec (its static parameters, decoded once
by the operator) and the math that every implementation must agree on. Kernels import
contracts, never ``tessera_jax.primitives``.
"""
