"""Test configuration: 8 virtual CPU devices, strict dtype promotion, rank promotion raises,
highest matmul precision.

Which backend a run uses:

* ``python -m pytest`` (the README's command) runs on the CPU whatever the machine has: the
  multi-device tests need 8 devices, which a CPU gives as virtual devices, and the Pallas
  kernels run in interpret mode there. Tests marked ``gpu`` are skipped.
* ``python -m pytest -m gpu`` runs only the ``gpu`` tests, on the default backend (a GPU):
  every compiled kernel against its reference at small shapes. Each has an interpret-mode
  twin in the CPU run. Compiling is most of their time: ``-n 4`` runs four workers on one
  GPU, each allocating device memory as it needs it rather than most of it up front.

The CPU run compiles without XLA's backend optimisations (``jax_disable_most_optimizations``)
and, where the jaxlib still has them, with XLA's older CPU fusion emitters (which compile a
small program much faster): its thousands of small programs check what is computed,
and compiling them was most of the suite's time. Tests marked ``xla_optimized`` compile as
users' programs do: bitwise (or nearly bitwise) comparisons of differently built programs
(mesh invariance, run to run, an operator against its formula, jit against eager): claims
about the optimised code users run (fused multiply-adds, vectorised loops), which
unoptimised code would not test. Setting ``JAX_DISABLE_MOST_OPTIMIZATIONS`` (``=0``: every
test optimised) leaves the choice to jax.
"""

import os
import re
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "PYTEST_XDIST_WORKER" in os.environ:  # workers share a GPU: no up-front allocation
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The suite neither reads nor writes the user's autotune cache (kernels consult it).
os.environ.setdefault("TESSERA_CACHE_DIR", tempfile.mkdtemp(prefix="tessera-test-cache-"))

import jax

from tessera_jax import _compat

_compat.cpu_device_count_flag(8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
# Full f32 products (GPUs default to TF32) so float64-reference tolerances hold on any backend.
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests import _util  # noqa: E402

# Property tests, bounded here for the whole suite: few examples, the same ones every run
# (CI must not depend on luck), no deadline (the first example of a shape compiles).
settings.register_profile("tessera", max_examples=5, deadline=None, derandomize=True)
settings.load_profile("tessera")


def _selects_gpu(markexpr: str) -> bool:
    """Whether ``-m markexpr`` asks for the gpu tests (``gpu``, ``gpu and not slow``)."""
    return re.search(r"(?<!not )\bgpu\b", markexpr or "") is not None


def pytest_configure(config):
    config._tessera_gpu_run = _selects_gpu(config.option.markexpr)
    # Whether this run switches XLA's optimisations per test (see the module docstring).
    config._tessera_switch_opt = (
        not config._tessera_gpu_run and "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ
    )
    if not config._tessera_gpu_run:
        # Before any backend starts: every other test runs on the 8 virtual CPU devices.
        jax.config.update("jax_platforms", "cpu")
    if config._tessera_switch_opt:
        _compat.compile_unoptimized_cpu_programs_quickly()
        _set_optimized(False)


def pytest_collection_modifyitems(config, items):
    if config._tessera_gpu_run:
        if not any(d.platform == "gpu" for d in jax.devices()):
            skip = pytest.mark.skip(reason="-m gpu needs a GPU (jax.devices() has none)")
            for item in items:
                item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason="GPU test: run `python -m pytest -m gpu` on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def x64():
    """Runs the test with 64-bit types on (check_grads wants float64 inputs)."""
    with _compat.enable_x64(True):
        yield


# Whether programs compiled now get XLA's backend optimisations, and whether any program was
# compiled without them since they were last switched on.
_OPTIMIZED = {"now": True, "unoptimized_since_on": False}


def _set_optimized(on: bool) -> None:
    if on and not _OPTIMIZED["now"] and _OPTIMIZED["unoptimized_since_on"]:
        # jax's executable caches ignore the setting: an unoptimised program compiled by an
        # earlier test must not stand in for the optimised one this test checks.
        jax.clear_caches()
        _OPTIMIZED["unoptimized_since_on"] = False
    jax.config.update("jax_disable_most_optimizations", not on)
    _OPTIMIZED["now"] = on


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Starts the test's random inputs at its own point (``_util.start_test``), and compiles
    ``xla_optimized`` tests of the CPU run with XLA's optimisations, the others without (see
    the module docstring); the GPU run keeps jax's defaults. A hook, not a fixture: it runs
    before the test's fixtures, module-scoped ones included, draw inputs or compile."""
    _util.start_test(item.nodeid)
    if not item.config._tessera_switch_opt:
        return
    on = item.get_closest_marker("xla_optimized") is not None
    _set_optimized(on)
    if not on:
        _OPTIMIZED["unoptimized_since_on"] = True
