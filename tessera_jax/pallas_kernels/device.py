"""What the kernels ask of this process's GPU: its SM count and whether it is a Hopper; the
one rule for how many SMs a persistent kernel's grid spans; and how a kernel is traced and
run (:func:`int32_tracing`, :func:`run_mosaic`)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from tessera_jax import _compat

H100_SMS = 132  # H100 / H200 SXM: the GPUs the kernels are tuned and measured on

# CTAs of a persistent grid in interpret mode: each simulated warpgroup is a CPU thread, so
# a small grid keeps CPU tests fast while still running the persistent loop more than once.
INTERPRET_SMS = 2


def num_sms() -> int:
    """Streaming multiprocessors of the first device (``H100_SMS`` where the backend can't
    say)."""
    try:
        return int(jax.devices()[0].core_count)
    except Exception:  # pragma: no cover - backends without core_count
        return H100_SMS


class SMCounts(NamedTuple):
    """How many SMs a persistent kernel uses, and for how many its tiles are chosen."""

    grid: int  # SMs the persistent grid spans (one CTA each)
    tuned: int  # SM count the tile heuristic assumes (e.g. "one wave of tiles")


def sm_counts(*, interpret: bool, override: int | None = None) -> SMCounts:
    """The SM counts of one kernel call.

    Compiled: ``override`` (benchmarks, tests) for both when given, else this GPU's. In
    interpret mode the tiles are the ones an H100 gets, so the interpreter runs what the
    GPU would, and the grid is ``override`` or :data:`INTERPRET_SMS`.
    """
    if override is not None and (
        not isinstance(override, int) or isinstance(override, bool) or override <= 0
    ):
        raise ValueError(f"sm_counts: num_sms={override!r} must be a positive int or None")
    if interpret:
        return SMCounts(grid=override or INTERPRET_SMS, tuned=H100_SMS)
    sms = override or num_sms()
    return SMCounts(grid=sms, tuned=sms)


@functools.lru_cache(maxsize=1)
def is_sm90() -> bool:
    """Whether this process's GPUs are Hopper (compute capability 9.x)."""
    try:
        cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
    except Exception:  # no GPU backend
        return False
    return cc is not None and str(cc).split(".")[0] == "9"


def hopper_only(platform: str, kernel: str) -> str | None:
    """A kernel module's ``hardware`` for kernels compiled for Hopper only: None on a
    Hopper GPU, else why not (``kernel`` names what runs, e.g. "a Mosaic GPU kernel")."""
    if platform != "cuda":
        return f"{kernel} for cuda, not {platform}"
    if not is_sm90():
        return "not a Hopper (sm_90) GPU"
    return None


def int32_tracing():
    """The context a kernel is traced in: 64-bit types off. Kernel index arithmetic (grid
    and thread indices, offsets, barrier slots) is int32; with ``jax_enable_x64`` on, the
    Python ints beside it would become int64 and the kernels would not trace (a type
    error). The operands keep their types."""
    return _compat.enable_x64(False)


_INTERPRET_LOCK = threading.Lock()


def run_mosaic(call: Callable[..., Any], operands: Sequence[Any], *, interpret: bool) -> Any:
    """``call(*operands)`` of a Mosaic GPU kernel (``plgpu.kernel``), traced in
    :func:`int32_tracing`.

    In interpret mode the kernel runs in the Mosaic GPU interpreter behind an opaque host
    callback. The interpreter threads its simulated memory operations through *ordered* io
    callbacks; a primitive's lowering (``Operator._lower``) has no effect tokens to give
    them. So the interpreted kernel runs as its own computation inside a ``pure_callback``
    (same values, no effects outside), one at a time: the interpreter's simulated device
    state is process-global. The interpreter parameters (race detection) in force when this
    is traced are the ones used.
    """
    if not interpret:
        with int32_tracing():
            return call(*operands)
    params = _compat.gpu_interpret_current_params()
    with int32_tracing():
        out_aval = jax.eval_shape(call, *operands)
    jitted = jax.jit(call)

    def host(*xs):
        with _INTERPRET_LOCK, _compat.gpu_interpret_mode_with(params), int32_tracing():
            return jax.tree.map(np.asarray, jitted(*xs))

    return jax.pure_callback(host, out_aval, *operands)
