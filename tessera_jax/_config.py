"""The ``TESSERA_KERNELS`` switch: which lowering every operator takes.

* ``auto`` (default): on cuda, an operator's Pallas kernel where one exists,
  supports the case and is expected to be faster; XLA (the reference) elsewhere.
* ``xla``: the reference lowering (jax.numpy / lax) everywhere.
* ``pallas``: the Pallas kernel wherever one supports the case, on any platform
  it compiles for (no speed heuristic).
* ``interpret``: the Pallas kernels in interpret mode (Pallas interpret for
  plain kernels, the Mosaic GPU interpreter for Hopper kernels) on any platform;
  this is how the CPU test-suite runs kernel bodies.

Set it with the environment variable before import, or in code with
``with ts.kernel_mode("interpret"): ...``. The setting is part of jax's jit
cache key, so a function jitted under one mode is relowered under another.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from tessera_jax import _compat

KERNEL_MODES = ("auto", "xla", "pallas", "interpret")

_kernel_mode_state = _compat.enum_config_state(
    name="tessera_kernels",
    values=list(KERNEL_MODES),
    default="auto",
    help="Which lowering tessera_jax operators take: auto, xla, pallas or interpret.",
)


def get_kernel_mode() -> str:
    """The kernel mode in force (``auto``, ``xla``, ``pallas`` or ``interpret``)."""
    return _kernel_mode_state.value


@contextlib.contextmanager
def kernel_mode(mode: str):
    """Context manager selecting the lowering of every ts operator traced inside."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel_mode: {mode=!r} must be one of {KERNEL_MODES}")
    with _kernel_mode_state(mode):
        yield


def set_kernel_mode(mode: str) -> None:
    """Sets the process-wide kernel mode (what ``TESSERA_KERNELS`` sets at import)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"set_kernel_mode: {mode=!r} must be one of {KERNEL_MODES}")
    jax.config.update("tessera_kernels", mode)


# --- XLA command buffers (ts.graph capture, ts.jit(capture_graph=...)) ---------------

# What ``command_buffer=True`` records into command buffers: fused kernels, cuBLAS/cuBLASLt
# and cuDNN calls, and custom calls (Pallas and Mosaic GPU kernels, where their handlers
# allow it). XLA's DebugOptions.CommandBufferCmdType names them.
COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN")


def command_buffer_options(enabled: bool) -> dict[str, str]:
    """The XLA compile option turning GPU command buffers (CUDA graphs) on or off.

    ``{"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"}`` when
    ``enabled``, ``{"xla_gpu_enable_command_buffer": ""}`` (every kernel launched on its
    own) otherwise; pass it as ``jax.jit(f, compiler_options=...)`` or to
    ``.lower(...).compile(compiler_options=...)``. It is the per-compile form of
    ``XLA_FLAGS=--xla_gpu_enable_command_buffer=...``. XLA wraps runs of at least
    ``xla_gpu_graph_min_graph_size`` (default 5) such kernels into a command buffer,
    recorded at the first execution and replayed as one CUDA graph launch afterwards; the
    option only affects GPU compilations.
    """
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"ts.graph.command_buffer_options: {enabled=!r} must be a bool")
    return {"xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER_TYPES) if enabled else ""}


# --- Run-to-run reproducibility of XLA's own GPU kernels ------------------------------


def deterministic_compile_options() -> dict[str, bool]:
    """XLA compile options for programs whose bits must not change from one process to
    the next: pass as ``jax.jit(f, compiler_options=...)``.

    XLA's GPU compiler times candidate kernels for its GEMMs and fusions (autotuning) and
    keeps the fastest; near-ties go either way in different processes, and different
    kernels block a contraction differently, so two runs of one program can differ in the
    last bits. ``xla_gpu_deterministic_ops`` turns autotuning off (the compiler's default
    choice is a function of the program) and excludes kernels with atomic accumulation.
    Only GPU compilations read it.

    ``xla_allow_excess_precision=False`` makes every bf16/f16 value round where the
    program says: otherwise XLA may keep one in f32 inside a fusion, and whether it does
    depends on how the rest of the program fuses (a loop of one trip or two, a layer split
    over one device or two), so a mesh change could change the bits.
    """
    return {"xla_gpu_deterministic_ops": True, "xla_allow_excess_precision": False}
