"""Trace-time numerics context set by ``ts.jit`` from argument policies.

``ts.jit`` reads the ``ts.accum(...)`` of annotated arguments and traces the
function body under ``accumulation(dtype)``; operators that accumulate (matmul)
read :func:`accumulate_dtype` as their default. Outside any context they use
f32 for 8-/16-bit floats.
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np

_ACCUMULATE: contextvars.ContextVar[np.dtype | None] = contextvars.ContextVar(
    "tessera_accumulate", default=None
)


def accumulate_dtype() -> np.dtype | None:
    """The accumulation dtype in force at trace time (None: the operator's default)."""
    return _ACCUMULATE.get()


@contextlib.contextmanager
def accumulation(dtype):
    """Traces the body with ``dtype`` as the default accumulation dtype."""
    from tessera_jax.numerics.dtypes import as_np_dtype

    token = _ACCUMULATE.set(None if dtype is None else as_np_dtype(dtype))
    try:
        yield
    finally:
        _ACCUMULATE.reset(token)
