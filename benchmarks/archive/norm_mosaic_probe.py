"""Probe: the Mosaic GPU row kernels (pallas_kernels/norms_mgpu.py, not dispatched yet)
against jnp, the operators' references (ts[xla]) and the Triton kernels (ts[pallas]),
forward, timed inside one program as norm_small_probe.py does, at rows that auto gives the
Triton kernels and below. Decides whether the Mosaic kernels can replace the Triton ones
(Pallas' Triton backend is deprecated), and with how many rows a CTA walks. Correctness
first: each kernel against jnp at one shape.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/norm_mosaic_probe.py
"""

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


def spec(op):
    if op.endswith("softmax"):
        return (("axis", 1),)
    kw = dict(eps=nb.EPS, has_weight=True) | (dict(has_bias=True) if op == "layernorm" else {})
    return tuple(sorted(kw.items()))


def mosaic(op, x, *params, rows):
    config = norms_mgpu.MosaicRowConfig(rows=rows)
    return getattr(norms_mgpu, op)(spec(op), x, *params, config=config)


ROWS = (1, 4, 16)
for rows in ROWS:
    IMPLS[f"mgpu[r{rows}]"] = ("xla", lambda op, x, *p, rows=rows: mosaic(op, x, *p, rows=rows))

for op in ("rmsnorm", "layernorm", "softmax"):
    x, *params, _ = nb.operands(op, (300, 4096))
    want = np.asarray(jax.jit(lambda x, *p, op=op: nb.xla_op(op, x, *p))(x, *params), np.float32)
    for rows in ROWS:
        got = jax.jit(lambda x, *p, op=op, rows=rows: mosaic(op, x, *p, rows=rows))(x, *params)
        err = np.abs(np.asarray(got, np.float32) - want).max()
        print(f"{op} mgpu[r{rows}] max abs diff from jnp {err:.4f}", flush=True)

for shape in ((512, 4096), (4096, 4096), (32768, 4096), (16384, 1024), (8192, 8192), (2048, 16384)):
    for op in ("rmsnorm", "layernorm", "softmax"):
        try:
            case(op, shape, "fwd", tuple(IMPLS))
        except Exception as e:
            print(f"!! {op} {shape}: {type(e).__name__}: {str(e)[:300]}", flush=True)
