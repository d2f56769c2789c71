"""What the kernels ask of this process's GPU: its SM count and whether it is a Hopper."""

from __future__ import annotations

import functools

import jax

H100_SMS = 132  # H100 / H200 SXM: the GPUs the kernels are tuned and measured on


def num_sms() -> int:
    """Streaming multiprocessors of the first device (``H100_SMS`` where the backend can't
    say)."""
    try:
        return int(jax.devices()[0].core_count)
    except Exception:  # pragma: no cover - backends without core_count
        return H100_SMS


@functools.lru_cache(maxsize=1)
def is_sm90() -> bool:
    """Whether this process's GPUs are Hopper (compute capability 9.x)."""
    try:
        cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
    except Exception:  # no GPU backend
        return False
    return cc is not None and str(cc).split(".")[0] == "9"
