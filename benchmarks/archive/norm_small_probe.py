"""Probe: the norm kernels against the operators' XLA references and jnp below the arrays
``auto`` took the kernels from when it ran (norms_gpu.prefer's 2²² elements, prefer_bwd's
2²³; it led to prefer_norm's 2¹⁹ for rmsnorm's and layernorm's forwards), and the softmax
references at a vocabulary's rows (beyond norms_gpu.MAX_ROW). Calls are timed inside one
program (benchmarks/_common.time_in_graph: each call's output feeds the next call's x), as
a model's layers run: at these sizes a call timed from the host measures the host's
dispatch.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/norm_small_probe.py
"""

import sys

sys.path.insert(0, ".")

import functools

import jax

from benchmarks import norms as nb
from benchmarks._common import normal as rand
from benchmarks._common import rotation, time_in_graph

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
IMPLS = {
    "jnp": ("xla", nb.xla_op),
    "ts[xla]": ("xla", nb.ts_op),
    "ts[pallas]": ("pallas", nb.ts_op),
}


def fwd(op_fn, op, x, *params_ct):
    return op_fn(op, x, *params_ct[:-1])


def fwdbwd(op_fn, op, x, *params_ct):
    *params, ct = params_ct
    y, pull = jax.vjp(lambda x, *p: op_fn(op, x, *p), x, *params)
    return y + pull(ct)[0]


def chain(args, result):
    return (result.astype(args[0].dtype), *args[1:])


def case(op, shape, mode, impls):
    base = nb.operands(op, shape)
    n = rotation(base[0].nbytes * 3)
    sets = [base] + [
        (rand(10 + i, shape, base[0].dtype, scale=2.0), *base[1:]) for i in range(1, n)
    ]
    sets = tuple(tuple(s) for s in sets)
    wrap = fwd if mode == "fwd" else fwdbwd
    fns = {name: functools.partial(wrap, IMPLS[name][1], op) for name in impls}
    mode_of = {name: IMPLS[name][0] for name in impls}
    jit = lambda name, f: nb.in_mode(mode_of[name], f, (sets,))
    ms = time_in_graph(fns, sets, chain, jit=jit, repeats=5, target_ms=30, warmup_ms=100)
    row = " ".join(f"{n} {ms[n] * 1e3:7.2f}us x{ms['jnp'] / ms[n]:.3f}" for n in impls)
    print(f"{mode:6s} {op:11s} {shape[0]:>5d}x{shape[1]:<6d} {row}", flush=True)


for shape in ((512, 1024), (2048, 1024), (512, 4096), (4096, 256)):
    for op in ("rmsnorm", "softmax", "layernorm"):
        for mode in ("fwd", "fwdbwd") if op != "layernorm" else ("fwd",):
            try:
                case(op, shape, mode, tuple(IMPLS))
            except Exception as e:
                print(f"!! {op} {shape} {mode}: {type(e).__name__}: {str(e)[:200]}", flush=True)
for shape in ((2048, 32000), (256, 128256)):
    for op in ("softmax", "log_softmax"):
        case(op, shape, "fwd", ("jnp", "ts[xla]"))
        case(op, shape, "fwdbwd", ("jnp", "ts[xla]"))
