"""Probe: ``ts.softmax`` and ``ts.log_softmax`` gradients (``jax.vjp``, forward included) on
the CPU with the statistics' guards as selects (``where(m == -inf, 0, m)``, ``where(s == 0,
1, s)``: the form in ``primitives/softmax.py``) and as maxima (``maximum(m, finfo.min)``,
``maximum(s, tiny)``: the same values, tried and not kept), beside ``jax.nn``, in one process
(``benchmarks._common.time_interleaved``, median ms per call), with the number of fusions in
each compiled program and whether the two forms' programs give the same bits (output and
input gradient).

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


def _maxima_stable_exp(x, axis):
    m = jnp.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = jnp.maximum(m, jnp.finfo(x.dtype).min)
    shifted = x - m
    e = jnp.exp(shifted)
    return shifted, e, jnp.sum(e, axis=axis, keepdims=True)


def _maxima_softmax(x, *, axis):
    xc = x.astype(compute_dtype(x.dtype))
    _, e, s = _maxima_stable_exp(xc, axis)
    return (e / jnp.maximum(s, jnp.finfo(s.dtype).tiny)).astype(x.dtype)


def _maxima_log_softmax(x, *, axis):
    xc = x.astype(compute_dtype(x.dtype))
    shifted, _, s = _maxima_stable_exp(xc, axis)
    return (shifted - jnp.log(jnp.maximum(s, jnp.finfo(s.dtype).tiny))).astype(x.dtype)


def _vjp(f):
    """``(y, dx)``: the output and the input gradient of ``f`` at ``x`` for cotangent ``g``."""

    def run(x, g):
        y, vjp = jax.vjp(f, x)
        return y, vjp(g)[0]

    return jax.jit(run)


def _programs(x, g):
    """Jitted ``(y, dx)`` programs of the operators as they lower now, with their fusions."""
    fns = {"softmax": _vjp(ts.softmax), "log_softmax": _vjp(ts.log_softmax)}
    fusions = {n: f.lower(x, g).compile().as_text().count(" fusion(") for n, f in fns.items()}
    return fns, fusions


def _same_bits(a, b) -> tuple[bool, ...]:
    """Whether two ``(y, dx)`` results agree bit for bit, output and gradient."""
    return tuple(
        bool(np.array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8)))
        for u, v in zip(a, b)
    )


def main() -> None:
    for shape in [(4096, 1024), (1024, 4096), (256, 16384)]:
        for dt in (jnp.float32, jnp.bfloat16):
            x, g = normal(0, shape, dt), normal(1, shape, dt)
            # Each program is called (traced, cached) while its form is the operators'.
            old, old_fusions = _programs(x, g)
            got = {n: f(x, g) for n, f in old.items()}
            refs = (sm.softmax_op.reference, sm.log_softmax_op.reference)
            sm.softmax_op.reference, sm.log_softmax_op.reference = (
                _maxima_softmax,
                _maxima_log_softmax,
            )
            try:
                new, new_fusions = _programs(x, g)
                same = {n: _same_bits(got[n], f(x, g)) for n, f in new.items()}
            finally:
                sm.softmax_op.reference, sm.log_softmax_op.reference = refs
            fns = {}
            for name in ("softmax", "log_softmax"):
                fns[f"{name}[maxima]"] = new[name]
                fns[f"{name}[selects]"] = old[name]
                fns[f"{name}[jax.nn]"] = _vjp(getattr(jax.nn, name))
            ms = time_interleaved(fns, (x, g), repeats=5, target_ms=30)
            for name in ("softmax", "log_softmax"):
                nn_ms = ms[f"{name}[jax.nn]"]
                print(
                    f"{shape!s:13s} {jnp.dtype(dt).name:8s} {name:11s} "
                    f"selects {ms[f'{name}[selects]']:7.3f} ms ({old_fusions[name]} fusions, "
                    f"x{nn_ms / ms[f'{name}[selects]']:.2f} of jax.nn)  "
                    f"maxima {ms[f'{name}[maxima]']:7.3f} ms ({new_fusions[name]} fusions, "
                    f"x{nn_ms / ms[f'{name}[maxima]']:.2f})  jax.nn {nn_ms:7.3f} ms  "
                    f"same bits (y, dx): {same[name]}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
