"""Eager dispatch: the cost of calling a ts operator outside jit, against its jnp counterpart.

Notebooks call operators one by one on concrete arrays. There, the time of a call on a small
input is almost all dispatch (Python, argument checks, the executable cache lookup), and a
ts operator must cost at most 1.5x its jnp counterpart (``ratio`` = jnp time / ts time, so
the target is ratio >= 0.67).

    python benchmarks/eager_dispatch.py        # records: benchmarks/results/eager-<device>.json

Each case alternates the two calls (ts, then jnp) over repeats and reports the medians.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import tessera_jax as ts
from benchmarks._common import device_name, results_path, time_interleaved, write_records

N = 64


def cases():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (N, N))
    w = jax.random.normal(k[1], (N,))
    xb = x.astype(jnp.bfloat16)
    return {
        f"matmul-{N}x{N}x{N}": (lambda: ts.matmul(x, x), lambda: jnp.dot(x, x), "jnp.dot"),
        f"matmul-bf16-{N}x{N}x{N}": (lambda: ts.matmul(xb, xb), lambda: jnp.dot(xb, xb), "jnp.dot"),
        f"sum-{N}x{N}": (lambda: ts.sum(x), lambda: jnp.sum(x), "jnp.sum"),
        f"max-{N}x{N}": (lambda: ts.max(x, axis=1), lambda: jnp.max(x, axis=1), "jnp.max"),
        f"relu-{N}x{N}": (lambda: ts.relu(x), lambda: jnp.maximum(x, 0.0), "jnp.maximum"),
        f"exp-{N}x{N}": (lambda: ts.exp(x), lambda: jnp.exp(x), "jnp.exp"),
        f"softmax-{N}x{N}": (lambda: ts.softmax(x), lambda: jax.nn.softmax(x), "jax.nn.softmax"),
        f"rmsnorm-{N}x{N}": (
            lambda: ts.rmsnorm(x, w),
            lambda: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w,
            "jnp expression",
        ),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="the record file (default: results/eager-<device>.json)")
    p.add_argument("--number", type=int, default=300, help="calls per timing")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    device = device_name()
    records = []
    for name, (ours, theirs, baseline) in cases().items():
        t = time_interleaved(
            {"ts": ours, "jnp": theirs}, (), repeats=args.repeats, min_iters=args.number
        )
        ms, base_ms = t["ts"], t["jnp"]
        records.append(
            dict(
                suite="eager",
                case=name,
                device=device,
                jax=jax.__version__,
                impl="ts",
                baseline=baseline,
                ms=ms,
                baseline_ms=base_ms,
                ratio=base_ms / ms,
            )
        )
    print(f"{'case':28s} {'ts us':>8s} {'jnp us':>8s} {'ratio':>6s}  baseline")
    for r in records:
        print(
            f"{r['case']:28s} {r['ms'] * 1e3:8.1f} {r['baseline_ms'] * 1e3:8.1f} "
            f"{r['ratio']:6.2f}  {r['baseline']}"
        )
    print("written:", write_records(args.json or results_path(f"eager-{device}.json"), records))


if __name__ == "__main__":
    main()
