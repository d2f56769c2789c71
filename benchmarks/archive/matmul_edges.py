"""Probe: the Hopper matmul kernel where the shapes are awkward — skinny M (decode), ragged
M/N/K (edge tiles through TMA's out-of-bounds fill, no padding copies) and mixed fp8
(e4m3 × e5m2 on the fp8 tensor cores) — against XLA in the same process.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/matmul_edges.py [skinny ragged mixed]

Prints one line per implementation (ms, TF/s or TB/s of B read, ratio = XLA ms / ms,
relative error against an f32 reference). No JSON record: the printed output of the runs
quoted in benchmarks/NOTES-matmul.md (v7) is kept as
benchmarks/archive/matmul-edges-h100-run*.txt.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import jax
import jax.numpy as jnp

import tessera_jax as ts
from benchmarks.matmul import (
    BF16,
    E4M3,
    E5M2,
    F32,
    checked,
    gelu_tanh,
    rand,
    ref_dot,
    rel_err,
    telemetry,
    time_interleaved,
)
from tessera_jax.pallas_kernels import matmul_configs as mc
from tessera_jax.pallas_kernels import matmul_mgpu as mg

SKINNY_CONFIGS = {
    "64x256x64_s6": mc.CANDIDATES["bf16_64x256x64_s6"],
    "64x128x128_s4": mc.CANDIDATES["bf16_64x128x128_s4"],
    "64x128x64_s8": mc.MatmulConfig(64, 128, 64, 8, "n", "n", 4),
    "64x256x128_s3": mc.MatmulConfig(64, 256, 128, 3, "n", "n", 4),
}


def report(title, fns, args, ref, work, unit):
    errs = checked(fns, args, ref, title)
    ms = time_interleaved(fns, args)
    print(f"== {title} {telemetry()}", flush=True)
    for name, t in ms.items():
        rate = work / (t * 1e-3) / 1e12
        print(
            f"   {name:24s} {t:8.4f} ms {rate:8.2f} {unit}  x{ms['xla'] / t:.3f}  "
            f"err {errs[name]:.1e}",
            flush=True,
        )


def skinny():
    for m, n, k in [(16, 8192, 8192), (64, 8192, 8192), (16, 28672, 8192), (16, 8192, 28672)]:
        a, b = rand(1, (m, k), BF16), rand(2, (k, n), BF16)
        fns = {
            "xla": jax.jit(jnp.dot),
            "ts.op.matmul": jax.jit(ts.op.matmul),
            "default": jax.jit(lambda a, b: mg.matmul(a, b)),
        }
        for name, cfg in SKINNY_CONFIGS.items():
            fns[name] = jax.jit(lambda a, b, cfg=cfg: mg.matmul(a, b, config=cfg))
        report(f"skinny bf16 {m}x{n}x{k}", fns, (a, b), ref_dot(a, b), 2.0 * k * n, "TB/s")


EDGE_SHAPES = [  # (M, N, K, transpose_a, transpose_b, operand dtype, out dtype)
    (200, 136, 96, False, False, jnp.float16, F32),
    (1000, 1000, 1000, False, False, BF16, BF16),
    (5, 100, 70, True, True, BF16, BF16),
    (300, 40, 130, True, False, E5M2, BF16),
    (16, 8192, 1000, False, False, BF16, BF16),
    (4100, 2052, 3000, False, True, E4M3, F32),
    (256, 40, 128, False, False, E4M3, BF16),  # bf16 rows of one tile came back as zeros
    (256, 64, 128, False, False, BF16, BF16),  # (before outputs got >= 2 swizzle rows)
    (256, 16, 128, False, False, BF16, F32),
]


def edge_correctness():
    # Edge tiles through TMA's out-of-bounds fill on the GPU (the CPU interpreter of jax 0.10
    # cannot run them; the CPU tests lower them for cuda and run them on 0.11's interpreter).
    for m, n, k, ta, tb, dt, odt in EDGE_SHAPES:
        a = rand(10, (k, m) if ta else (m, k), dt)
        b = rand(11, (n, k) if tb else (k, n), dt)
        res = rand(12, (m, n), F32)
        out = mg.matmul(a, b, res, transpose_a=ta, transpose_b=tb, out_dtype=odt, has_residual=True)
        ref = ref_dot(a, b, ta, tb) + res
        print(
            f"   edge {m}x{n}x{k} tA={ta} tB={tb} {jnp.dtype(dt).name}->{jnp.dtype(odt).name}"
            f" + residual: rel err {rel_err(out, ref):.1e}",
            flush=True,
        )


def ragged():
    edge_correctness()
    m = n = k = 8000  # not a multiple of any tile; rows of whole 16-byte units
    a, b = rand(3, (m, k), BF16), rand(4, (k, n), BF16)
    bias = rand(5, (n,), BF16)
    flops = 2.0 * m * n * k
    fns = {
        "xla": jax.jit(lambda a, b, c: gelu_tanh(jnp.dot(a, b) + c)),
        "kernel": jax.jit(
            lambda a, b, c: mg.matmul(a, b, c, has_bias=True, activation="gelu_tanh")
        ),
    }
    ref = gelu_tanh(ref_dot(a, b) + bias.astype(F32))
    report(f"ragged bias-gelu bf16 {m}^3", fns, (a, b, bias), ref, flops, "TF/s")
    fns = {"xla": jax.jit(jnp.dot), "kernel": jax.jit(lambda a, b: mg.matmul(a, b))}
    report(f"ragged bf16 {m}^3", fns, (a, b), ref_dot(a, b), flops, "TF/s")
    a8, b8 = a.astype(E4M3), b.astype(E4M3)
    fns = {
        "xla": jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32)),
        "kernel": jax.jit(lambda a, b: mg.matmul(a, b, out_dtype=F32)),
    }
    report(f"ragged fp8 e4m3 {m}^3", fns, (a8, b8), ref_dot(a8, b8), flops, "TF/s")


def mixed():
    for s in (4096, 8192):
        a, b = rand(6, (s, s), E4M3), rand(7, (s, s), E5M2)
        fns = {
            "xla": jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32)),
            "kernel": jax.jit(lambda a, b: mg.matmul(a, b, out_dtype=F32)),
            "ts.op.matmul": jax.jit(lambda a, b: ts.op.matmul(a, b, out_dtype=F32)),
        }
        report(f"mixed e4m3 x e5m2 {s}^3", fns, (a, b), ref_dot(a, b), 2.0 * s**3, "TF/s")


def grid_order():
    # bf16 8192^3 at the power cap: does a narrower planar snake (fewer L2 misses, less
    # HBM power) buy clock? Width 16 cost 4% in session 2's power probe.
    s = 8192
    a, b = rand(8, (s, s), BF16), rand(9, (s, s), BF16)
    base = mc.CANDIDATES["bf16_256x128x64_s4_dr1_cn"]
    fns = {"xla": jax.jit(jnp.dot)}
    for minor in ("n", "m"):
        for w in (4, 6, 8, 12):
            cfg = base.replace(grid_minor_dim=minor, grid_tile_width=w)
            fns[f"{minor}{w}"] = jax.jit(lambda a, b, cfg=cfg: mg.matmul(a, b, config=cfg))
    report(f"grid order bf16 {s}^3", fns, (a, b), ref_dot(a, b), 2.0 * s**3, "TF/s")


def main():
    parts = sys.argv[1:] or ["skinny", "ragged", "mixed", "grid_order"]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    for p in parts:
        {"skinny": skinny, "ragged": ragged, "mixed": mixed, "grid_order": grid_order}[p]()


if __name__ == "__main__":
    main()
