"""Trace-time numerics context set by ``ts.jit`` from argument policies.

``ts.jit`` reads the ``ts.accum(...)`` of annotated arguments and traces the
function body under ``accumulation(dtype)``; operators that accumulate (matmul)
read :func:`accumulate_dtype` as their default. Outside any context they use
f32 for 8-/16-bit floats.

The setting is a jax config state (thread-local, like ``ts.kernel_mode``) that is
part of jax's jit cache key: a function jitted outside ``accumulation(...)`` and
called inside it is retraced with the context's dtype instead of reusing the trace
that baked in the default. Like ``TESSERA_KERNELS``, the environment variable
``TESSERA_ACCUMULATE`` (a dtype name, e.g. ``float32``) sets it at import.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np

from tessera_jax import _compat
from tessera_jax.numerics.dtypes import ALL_DTYPES, as_np_dtype

# The containers of the ts dtypes, by name: the values the config state can hold.
ACCUMULATE_DTYPES: dict[str, np.dtype] = {
    str(d.container): np.dtype(d.container) for d in ALL_DTYPES.values()
}

_accumulate_state = _compat.enum_config_state(
    name="tessera_accumulate",
    values=list(ACCUMULATE_DTYPES),
    default=None,
    help="The default accumulation dtype of tessera_jax operators traced in this context.",
)


def accumulate_dtype() -> np.dtype | None:
    """The accumulation dtype in force at trace time (None: the operator's default)."""
    name = _accumulate_state.value
    return None if name is None else ACCUMULATE_DTYPES[name]


@contextlib.contextmanager
def accumulation(dtype):
    """Traces the body with ``dtype`` as the default accumulation dtype (None: unset).

    ``dtype`` is a ts dtype, a policy, a numpy dtype or a dtype name whose container
    is one of the ts dtypes' (:data:`ACCUMULATE_DTYPES`).
    """
    name = None
    if dtype is not None:
        try:
            name = str(jnp.dtype(as_np_dtype(dtype)))
        except TypeError as e:
            raise TypeError(f"accumulation: {dtype=!r} is not a dtype: {e}") from None
        if name not in ACCUMULATE_DTYPES:
            raise ValueError(
                f"accumulation: {dtype=!r} ({name}) must be one of {sorted(ACCUMULATE_DTYPES)}"
            )
    with _accumulate_state(name):
        yield
