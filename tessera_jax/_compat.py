"""Every jax-version difference and every private-API import lives here.

The project supports jax 0.10.x (the CPU machines) through 0.12.x (the GPU
machines run 0.11.2). Anything reached through ``jax._src`` or through a name
that moved between releases is imported once, in this module, so a jax upgrade
touches one file.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = [
    "JAX_VERSION",
    "Primitive",
    "ad",
    "apply_primitive",
    "batching",
    "custom_partitioning",
    "enum_config_state",
    "gpu_interpret_mode",
    "gpu_interpret_params",
    "mlir",
    "not_mapped",
    "shard_map",
]

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# Eager application of a primitive: jit-compile the single primitive (the same
# path jax.lax ops take), so the per-platform lowering (kernel or reference) is
# used outside jit too.
from jax._src.dispatch import apply_primitive  # noqa: E402
from jax.experimental.custom_partitioning import custom_partitioning  # noqa: E402

shard_map = jax.shard_map

# The batch-dimension marker of an unbatched operand in a batching rule
# (``batching.not_mapped`` was removed from the public module; it is None).
not_mapped = None


def enum_config_state(name: str, values: list[str], default: str, help: str) -> Any:
    """A jax config option that is part of the jit cache key.

    Read from the environment variable ``name.upper()`` at import. Part of the
    jit key and of the trace context (the lowering cache's key), so changing it
    (``with state(value):``) retraces and relowers instead of reusing a function
    compiled under the other setting.
    """
    from jax._src import config as _config

    return _config.enum_state(
        name=name,
        enum_values=values,
        default=default,
        help=help,
        include_in_jit_key=True,
        include_in_trace_context=True,
    )


def gpu_interpret_params(detect_races: bool = False) -> Any:
    """Parameters that run a Mosaic GPU kernel in the CPU interpreter."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(detect_races=detect_races)


@contextlib.contextmanager
def gpu_interpret_mode(detect_races: bool = False):
    """Runs every Mosaic GPU kernel traced inside in the CPU interpreter."""
    from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

    with force_gpu_interpret_mode(gpu_interpret_params(detect_races)):
        yield


def races_detected() -> bool | None:
    """Whether the last Mosaic GPU interpret run saw a data race (None if unknown)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    except ImportError:  # pragma: no cover - layout moved
        return None
    fn = getattr(ipc, "get_races", None)
    if fn is None:
        return None
    return bool(fn().races_found)


def cpu_device_count_flag(n: int) -> None:
    """Asks XLA for ``n`` virtual CPU devices (must run before the backend starts)."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # pragma: no cover - older jax
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"


def enable_x64(enabled: bool = True):
    """Context manager turning 64-bit types on (``jax.enable_x64`` in jax >= 0.9)."""
    fn = getattr(jax, "enable_x64", None)
    if fn is None:  # pragma: no cover - older jax
        from jax.experimental import enable_x64 as fn
    return fn(enabled)


def zero_tangent(primal: Any) -> Any:
    """A symbolic-zero tangent for ``primal`` (``ad.Zero.from_primal_value`` in newer jax)."""
    return ad.Zero(jax.typeof(primal).to_tangent_aval())
