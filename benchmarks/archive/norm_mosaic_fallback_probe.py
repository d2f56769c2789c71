"""Probe: what the row operators run under a jax without Pallas' Triton backend, where the
Mosaic GPU kernels (pallas_kernels/norms_mgpu.py, registered after the Triton ones) take
over. The Triton modules are blocked as tests/test_core.py's no-Triton test blocks them.
Checks which kernels ``auto`` and ``pallas`` mode pick and the values against jnp, then
times jnp, ts[xla], ts[auto] and ts[pallas] (the Mosaic forward and backward) inside one
program, forward and backward with every gradient consumed (x's, the weight's and the
bias's: a training step needs them all), at the shapes norm_mosaic_probe.py timed. It
kept the Mosaic kernels out of ``auto`` below 2²³ elements (``norms_mgpu.PREFER``; above,
host timing decided: norm-mosaic-host-h200.txt). With the argument ``triton`` the Triton backend stays and
the same step is timed at 2¹⁹ to 2²² elements, where ``auto`` took the Triton forward
kernels beside the references' backward when it ran (forward kernels from 2¹⁹, backward
kernels from 2²³; it led to norms_gpu's pair rules). With ``fwd`` the forward alone is
timed (``auto``'s rules for a forward that no backward follows).

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/norm_mosaic_fallback_probe.py [triton] [fwd]
"""

import sys

TRITON = "triton" in sys.argv[1:]
FWD = "fwd" in sys.argv[1:]
for m in ("jax.experimental.pallas.triton", "jax._src.pallas.triton", "jax._src.lib.triton"):
    if not TRITON:
        sys.modules[m] = None
sys.path.insert(0, ".")

import functools

import jax
import numpy as np

import tessera_jax as ts
from benchmarks import norms as nb
from benchmarks._common import normal as rand
from benchmarks._common import rotation, time_in_graph
from tessera_jax import _compat
from tests._util import chosen_kernels

assert (_compat.pallas_triton is None) != TRITON
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
OPS = ("rmsnorm", "layernorm", "softmax")
IMPLS = {"jnp": ("xla", nb.xla_op), "ts[xla]": ("xla", nb.ts_op)}
IMPLS |= {"ts[auto]": ("auto", nb.ts_op), "ts[pallas]": ("pallas", nb.ts_op)}


def step(op_fn, op, x, *params_ct):
    """``y + dx + dw + db``: the forward and every gradient, consumed."""
    *params, ct = params_ct
    y, pull = jax.vjp(lambda x, *p: op_fn(op, x, *p), x, *params)
    out = y
    for g in pull(ct):
        out = out + g.astype(out.dtype)
    return out


def forward(op_fn, op, x, *params_ct):
    return op_fn(op, x, *params_ct[:-1])


def grads(op_fn, op, x, *params_ct):
    *params, ct = params_ct
    y, pull = jax.vjp(lambda x, *p: op_fn(op, x, *p), x, *params)
    return (y, *pull(ct))


for op in OPS:
    args = nb.operands(op, (512, 4096))
    for mode in ("auto", "pallas"):
        with ts.kernel_mode(mode):
            f = jax.jit(functools.partial(grads, nb.ts_op, op))
            print(op, mode, sorted(set(chosen_kernels(f, *args))), flush=True)
            got = f(*args)
        want = jax.jit(functools.partial(grads, nb.xla_op, op))(*args)
        for g, w in zip(got, want):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            err = np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)
            assert np.isfinite(g).all() and err < 2e-2, (op, mode, g.shape, err)
    print(op, "values match jnp", flush=True)


def chain(args, result):
    return (result.astype(args[0].dtype), *args[1:])


def case(op, shape):
    base = nb.operands(op, shape)
    n = rotation(base[0].nbytes * 3)
    sets = [base] + [
        (rand(10 + i, shape, base[0].dtype, scale=2.0), *base[1:]) for i in range(1, n)
    ]
    sets = tuple(tuple(s) for s in sets)
    wrap = forward if FWD else step
    fns = {name: functools.partial(wrap, fn, op) for name, (_, fn) in IMPLS.items()}
    jit = lambda name, f: nb.in_mode(IMPLS[name][0], f, (sets,))
    ms = time_in_graph(fns, sets, chain, jit=jit, repeats=5, target_ms=30, warmup_ms=100)
    row = " ".join(f"{n} {ms[n] * 1e3:7.2f}us x{ms['jnp'] / ms[n]:.3f}" for n in IMPLS)
    print(f"{'fwd' if FWD else 'step'} {op:11s} {shape[0]:>5d}x{shape[1]:<6d} {row}", flush=True)


SHAPES = ((512, 4096), (4096, 4096), (32768, 4096), (16384, 1024), (2048, 16384))
for shape in ((512, 1024), (512, 4096), (2048, 2048), (4096, 1024)) if TRITON else SHAPES:
    for op in OPS:
        try:
            case(op, shape)
        except Exception as e:
            print(f"!! {op} {shape}: {type(e).__name__}: {str(e)[:300]}", flush=True)
