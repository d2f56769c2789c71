"""What the kernels ask of this process's GPU: its SM count and whether it is a Hopper."""

from __future__ import annotations

import functools

import jax


def num_sms() -> int:
    """Streaming multiprocessors of the first device (132 where the backend can't say)."""
    try:
        return int(jax.devices()[0].core_count)
    except Exception:  # pragma: no cover - backends without core_count
        return 132


@functools.lru_cache(maxsize=1)
def is_sm90() -> bool:
    """Whether this process's GPUs are Hopper (compute capability 9.x)."""
    try:
        cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
    except Exception:  # no GPU backend
        return False
    return cc is not None and str(cc).split(".")[0] == "9"
