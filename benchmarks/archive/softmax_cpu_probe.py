"""Probe: ``ts.softmax`` and ``ts.log_softmax`` gradients (``jax.vjp``, forward included) on
the CPU with the statistics' guards as selects (the old form: ``where(m == -inf, 0, m)`` and
``where(s == 0, 1, s)``) and as maxima (``maximum(m, finfo.min)``, ``maximum(s, tiny)``, the
form in ``primitives/softmax.py``), beside ``jax.nn``, in one process
(``benchmarks._common.time_interleaved``, median ms per call), with the number of fusions
in each compiled program.

    JAX_PLATFORMS=cpu python3 benchmarks/archive/softmax_cpu_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tessera_jax as ts
from benchmarks._common import normal, time_interleaved
from tessera_jax.primitives import softmax as sm
from tessera_jax.primitives._core import compute_dtype


def _selects_stable_exp(x, axis):
    m = jnp.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = jnp.where(m == -np.inf, jnp.zeros_like(m), m)
    shifted = x - m
    e = jnp.exp(shifted)
    return shifted, e, jnp.sum(e, axis=axis, keepdims=True)


def _selects_softmax(x, *, axis):
    xc = x.astype(compute_dtype(x.dtype))
    _, e, s = _selects_stable_exp(xc, axis)
    return (e / jnp.where(s == 0, jnp.ones_like(s), s)).astype(x.dtype)


def _selects_log_softmax(x, *, axis):
    xc = x.astype(compute_dtype(x.dtype))
    shifted, _, s = _selects_stable_exp(xc, axis)
    return (shifted - jnp.log(jnp.where(s == 0, jnp.ones_like(s), s))).astype(x.dtype)


def _programs(x, g):
    """Jitted ``vjp`` programs of the current forms and of jax.nn, with their fusions."""

    def vjp(f):
        return jax.jit(lambda x, g: jax.vjp(f, x)[1](g)[0])

    fns = {"softmax": vjp(ts.softmax), "log_softmax": vjp(ts.log_softmax)}
    fusions = {n: f.lower(x, g).compile().as_text().count(" fusion(") for n, f in fns.items()}
    return fns, fusions


def main() -> None:
    for shape in [(4096, 1024), (1024, 4096), (256, 16384)]:
        for dt in (jnp.float32, jnp.bfloat16):
            x, g = normal(0, shape, dt), normal(1, shape, dt)
            new, new_fusions = _programs(x, g)
            # The old forms, swapped into the operators' references (re-traced by new jits).
            refs = (sm.softmax_op.reference, sm.log_softmax_op.reference)
            sm.softmax_op.reference, sm.log_softmax_op.reference = (
                _selects_softmax,
                _selects_log_softmax,
            )
            try:
                old, old_fusions = _programs(x, g)
            finally:
                sm.softmax_op.reference, sm.log_softmax_op.reference = refs
            fns = {}
            for name in ("softmax", "log_softmax"):
                fns[f"{name}[maxima]"] = new[name]
                fns[f"{name}[selects]"] = old[name]
                nn = getattr(jax.nn, name)
                fns[f"{name}[jax.nn]"] = jax.jit(lambda x, g, nn=nn: jax.vjp(nn, x)[1](g)[0])
            ms = time_interleaved(fns, (x, g), repeats=5, target_ms=30)
            for name in ("softmax", "log_softmax"):
                nn_ms = ms[f"{name}[jax.nn]"]
                print(
                    f"{shape!s:13s} {jnp.dtype(dt).name:8s} {name:11s} "
                    f"selects {ms[f'{name}[selects]']:7.3f} ms ({old_fusions[name]} fusions, "
                    f"x{nn_ms / ms[f'{name}[selects]']:.2f} of jax.nn)  "
                    f"maxima {ms[f'{name}[maxima]']:7.3f} ms ({new_fusions[name]} fusions, "
                    f"x{nn_ms / ms[f'{name}[maxima]']:.2f})  jax.nn {nn_ms:7.3f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    main()
