"""Probe: the Mosaic GPU row kernels (pallas_kernels/norms_mgpu.py, not dispatched when it ran)
against jnp, the operators' references (ts[xla]) and the Triton kernels (ts[pallas]),
timed inside one program as norm_small_probe.py does, at rows that auto gives the Triton
kernels and below: the forward, or (argument ``fwdbwd``) forward and backward, the Mosaic
pair joined by a custom_vjp as the operators join theirs. Decides whether the Mosaic kernels
can replace the Triton ones (Pallas' Triton backend is deprecated), and with how many rows
a CTA walks. Correctness first: each forward and backward against jnp's at one shape.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/norm_mosaic_probe.py [fwd|fwdbwd]
"""

import functools
import sys

sys.path.insert(0, ".")

import jax
import numpy as np

from benchmarks import norms as nb
from tessera_jax.pallas_kernels import norms_mgpu

src = open("benchmarks/archive/norm_small_probe.py").read()
probe = {}
exec(src[: src.index("for shape in ((512, 1024)")], probe)  # its imports, IMPLS and case()
case, IMPLS = probe["case"], probe["IMPLS"]
MODE = sys.argv[1] if len(sys.argv) > 1 else "fwd"
ROWS = (1, 4, 16)
OPS = ("rmsnorm", "layernorm", "softmax")


def spec(op, d=None):
    """The kernels' bind parameters (with ``d``: the backward's)."""
    if op.endswith("softmax"):
        return (("axis", 1),)
    kw = dict(eps=nb.EPS, has_weight=True)
    if op == "layernorm":
        kw["has_bias"] = True
    if d is not None:
        kw["weight_grad_shape"] = (d,)
        if op == "layernorm":
            kw["bias_grad_shape"] = (d,)
    return tuple(sorted(kw.items()))


@functools.cache
def mosaic(op, rows):
    """The operator on the Mosaic kernels, differentiable."""
    config = norms_mgpu.MosaicRowConfig(rows=rows)
    fwd = functools.partial(getattr(norms_mgpu, op), spec(op), config=config)

    @jax.custom_vjp
    def f(x, *params):
        return fwd(x, *params)

    def f_fwd(x, *params):
        y = fwd(x, *params)
        return y, (y if op.endswith("softmax") else x, params)

    def f_bwd(res, ct):
        saved, params = res
        bwd = functools.partial(getattr(norms_mgpu, f"{op}_bwd"), config=config)
        if op.endswith("softmax"):
            return (bwd(spec(op), saved, ct),)
        dx, *dp = bwd(spec(op, saved.shape[-1]), saved, params[0], ct)
        return (dx, *(g.astype(p.dtype) for g, p in zip(dp, params)))

    f.defvjp(f_fwd, f_bwd)
    return f


for rows in ROWS:
    IMPLS[f"mgpu[r{rows}]"] = ("xla", lambda op, x, *p, rows=rows: mosaic(op, rows)(x, *p))

for op in OPS:
    x, *params, ct = nb.operands(op, (300, 4096))

    def vjp(f, x, *params):
        y, pull = jax.vjp(f, x, *params)
        return (y, *pull(ct))

    want = jax.jit(functools.partial(vjp, functools.partial(nb.xla_op, op)))(x, *params)
    for rows in ROWS:
        got = jax.jit(functools.partial(vjp, mosaic(op, rows)))(x, *params)
        diffs = [
            np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)).max()
            for g, w in zip(got, want)
        ]
        print(
            f"{op} mgpu[r{rows}] max abs diff from jnp (y, grads): {np.round(diffs, 4)}", flush=True
        )

for shape in ((512, 4096), (4096, 4096), (32768, 4096), (16384, 1024), (8192, 8192), (2048, 16384)):
    for op in OPS:
        try:
            case(op, shape, MODE, tuple(IMPLS))
        except Exception as e:
            print(f"!! {op} {shape}: {type(e).__name__}: {str(e)[:300]}", flush=True)
