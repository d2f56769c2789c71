"""Probe: why ``ts.log_softmax`` trails ``jax.nn.log_softmax`` on the CPU, and what the
faster form would cost in bits.

    JAX_PLATFORMS=cpu python3 benchmarks/archive/log_softmax_cpu_fusion_probe.py

``forms``: the forward at 4096x1024 f32 in the form ``primitives/softmax.py`` lowers
(``guards``: the row maximum of an all ``-inf`` row set to 0 and an empty normaliser to 1,
both by selects), without the normaliser's guard, without the maximum's guard, and without
either (``jax.nn``'s form), with the number of fusions XLA's CPU backend makes of each and
their median ms per call (one process, ``time_interleaved``).
``bits``: for rows of 1024 f32, the batch sizes 1..39 whose rows round differently from
the same rows in a batch of 64, and which of 16, 128, 1024, 4096 from a batch of 8192, for ``ts.log_softmax``, ``ts.softmax``, ``ts.rmsnorm`` and
``jax.nn.log_softmax``: where XLA fuses a row's whole computation differs with the batch,
and with it the order of the row's sums.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tessera_jax as ts
from benchmarks._common import normal, time_interleaved

NINF = -np.inf


def _form(guard_max: bool, guard_sum: bool):
    def f(x):
        m = jnp.max(x, axis=1, keepdims=True, initial=NINF)
        if guard_max:
            m = jnp.where(m == NINF, 0.0, m)
        shifted = x - m
        s = jnp.sum(jnp.exp(shifted), axis=1, keepdims=True)
        if guard_sum:
            s = jnp.where(s == 0, 1.0, s)
        return shifted - jnp.log(s)

    return jax.jit(f)


def _fusions(f, x) -> int:
    return sum(" fusion(" in ln for ln in f.lower(x).compile().as_text().splitlines())


def forms():
    x = normal(1, (4096, 1024), jnp.float32)
    fns = {
        "guards": _form(True, True),
        "max guard only": _form(True, False),
        "sum guard only": _form(False, True),
        "no guards": _form(False, False),
        "ts.log_softmax": jax.jit(ts.log_softmax),
        "jax.nn.log_softmax": jax.jit(jax.nn.log_softmax),
    }
    count = {k: _fusions(f, x) for k, f in fns.items()}
    time_interleaved(fns, (x,), repeats=1, min_iters=20)  # the CPU's timing has no warm-up
    t = time_interleaved(fns, (x,), repeats=5, min_iters=20)
    print("forward, (4096, 1024) f32:")
    for k in fns:
        print(f"  {k:<20} {count[k]} fusions  {t[k]:.2f} ms", flush=True)


def bits():
    n = 1024
    x = np.asarray(normal(3, (8192, n), jnp.float32))
    fns = {
        "ts.log_softmax": ts.log_softmax,
        "ts.softmax": ts.softmax,
        "ts.rmsnorm": lambda v: ts.rmsnorm(v, jnp.ones((n,), v.dtype)),
        "jax.nn.log_softmax": jax.nn.log_softmax,
    }
    print(f"rows of {n} f32: batch sizes whose rows differ from a larger batch's")
    for name, f in fns.items():
        f = jax.jit(f)
        bad = {}
        for whole, sizes in ((64, range(1, 40)), (8192, (16, 128, 1024, 4096))):
            full = np.asarray(f(x[:whole]))
            bad[whole] = [b for b in sizes if not (np.asarray(f(x[:b])) == full[:b]).all()]
        print(f"  {name:<20} vs 64: {bad[64]}  vs 8192: {bad[8192]}", flush=True)


if __name__ == "__main__":
    modes = sys.argv[1:] or ["forms", "bits"]
    print(jax.__version__, jax.devices()[0].device_kind)
    if "forms" in modes:
        forms()
    if "bits" in modes:
        bits()
