"""Test configuration: 8 virtual CPU devices, strict dtype promotion, rank promotion raises,
highest matmul precision."""

import os

os.environ.setdefault("XLA_FLAGS", "")

import jax

from tessera_jax import _compat

_compat.cpu_device_count_flag(8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
# Full f32 products (GPUs default to TF32) so float64-reference tolerances hold on any backend.
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Runs the test with 64-bit types on (check_grads wants float64 inputs)."""
    with _compat.enable_x64(True):
        yield
