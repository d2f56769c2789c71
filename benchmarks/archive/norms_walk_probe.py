"""Probe: the norm forwards' programs walking row blocks with prefetch, against one block
per program, by row shape.

A forward program that takes one block (``RowConfig.blocks``) loads its weight and bias
and its rows, reduces them and stores them, with no loads in flight while it reduces.
Walking several blocks per program, ``k`` programs per multiprocessor, with (``p``) and
without prefetching the next block, loads the parameters once per program and changes
when the rows' loads are issued, but not the tile, so not the bits. This probe times
each against XLA's jax.numpy formula (``benchmarks/norms.py``'s ``xla_op``) and the
tree's default config, interleaved in one process on one GPU in both call orders, for
layernorm and rmsnorm (f32 weight and bias; ``--bare``: neither) and softmax. bf16 rows
of ``3 + 2·N(0, 1)``.

    python3 benchmarks/archive/norms_walk_probe.py [--bare] [--ops OP,...] [ROWSxD ...]
"""

import functools
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import time_interleaved
from benchmarks.norms import xla_op
from tessera_jax.pallas_kernels import norms_gpu as m

EPS = 1e-5
SHAPES = ((32768, 4096), (16384, 4096), (8192, 4096), (65536, 2048), (8192, 2048))
SHAPES += ((131072, 1024), (16384, 1024), (16384, 8192), (4096, 4096))


def specs(bare):
    return {
        "layernorm": (("eps", EPS), ("has_bias", not bare), ("has_weight", not bare)),
        "rmsnorm": (("eps", EPS), ("has_weight", not bare)),
        "softmax": (("axis", 1),),
    }


def configs(rows, d):
    """name -> RowConfig: one block per program, and walks of k programs per SM."""
    one = m.RowConfig.blocks(d, max_rows=rows)
    out = {"one": one}
    for k in (2, 4):
        steps = max(1, -(-rows // (one.block_rows * k * m._SMS)))
        for pf in (True, False):
            out[f"walk{k}{'p' if pf else ''}"] = m.RowConfig(
                one.block_rows, one.num_warps, steps, prefetch=pf
            )
    return out


def main(shapes, bare, ops=("layernorm", "rmsnorm", "softmax")):
    for rows, d in shapes:
        ks = jax.random.split(jax.random.key(1), 3)
        x = (3 + 2 * jax.random.normal(ks[0], (rows, d), jnp.float32)).astype(jnp.bfloat16)
        w = 1 + 0.1 * jax.random.normal(ks[1], (d,), jnp.float32)
        b = 0.1 * jax.random.normal(ks[2], (d,), jnp.float32)
        for op, spec in specs(bare).items():
            params = () if bare else {"layernorm": (w, b), "rmsnorm": (w,)}.get(op, ())
            if op not in ops or (bare and op == "softmax"):
                continue
            kern = functools.partial(getattr(m, op), spec)
            # xla_op takes the parameters: without them, ones and zeros stand in
            unit = {"layernorm": (jnp.ones(d), jnp.zeros(d)), "rmsnorm": (jnp.ones(d),)}
            fill = unit[op] if bare else ()
            fns = {
                "xla": jax.jit(lambda x, *p, op=op, fill=fill: xla_op(op, x, *p, *fill)),
                "default": jax.jit(kern),
            }
            for name, c in configs(rows, d).items():
                fns[name] = jax.jit(functools.partial(kern, config=c))
            args = (x, *params)
            outs = {n: f(*args) for n, f in fns.items()}
            same = all(bool(jnp.array_equal(o, outs["one"])) for n, o in outs.items() if n != "xla")
            t = time_interleaved(fns, args, repeats=7)
            t2 = time_interleaved(dict(reversed(list(fns.items()))), args, repeats=7)
            dflt = m.RowConfig.default(rows, d, backward=False, params=len(params))
            cells = " ".join(
                f"{n} {min(t[n], t2[n]) * 1e3:.1f}({t['xla'] / t[n]:.3f}|{t2['xla'] / t2[n]:.3f})"
                for n in fns
            )
            print(
                f"{rows}x{d} {op}{' bare' if bare else ''} default={dflt.block_rows}x"
                f"{dflt.num_warps}x{dflt.row_steps}{'p' if dflt.prefetch else ''} "
                f"same={same} | us (xla/it, both orders) {cells}",
                flush=True,
            )


if __name__ == "__main__":
    argv = sys.argv[1:]
    bare = "--bare" in argv
    ops = argv[argv.index("--ops") + 1].split(",") if "--ops" in argv else None
    picked = [tuple(map(int, a.split("x"))) for a in argv if "x" in a and a[0].isdigit()]
    main(picked or SHAPES, bare, *([ops] if ops else []))
