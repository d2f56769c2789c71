"""Probe: variants of the canonical-tree all-reduce against lax.psum (docs/DISTRIBUTION.md,
"All-reduce speed"). Run on nvidia-h200-x4 with NVLS off::

    GROUP=chunks|halving|components SIZES="64 512" python3 benchmarks/archive/allreduce_variants.py

* chunks: 2/4 independent all_to_all -> tree -> all_gather chains (overlap?), with the
  outputs concatenated or one all_gather at the end;
* halving: recursive halving on 2-rank NCCL reduce-scatters (axis_index_groups): each level
  is one commutative addition, so the bits are the canonical tree's; all_gather by levels or
  once plus a reorder;
* components: all_to_all, all_to_all + tree, tree, all_gather, psum_scatter alone.
Every full all-reduce variant is checked bit for bit against the 1-device canonical tree.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from benchmarks._common import time_interleaved
from benchmarks.allreduce import (
    bus_bandwidth,
    canonical_digest,
    shard_digests,
    sharded_normal,
)
from tessera_jax import _compat
from tessera_jax.primitives.collectives import exchange, tree_all_reduce, tree_over_ranks

devices = jax.devices()
n = len(devices)
k = n.bit_length() - 1
mesh = _compat.make_mesh(np.array(devices), ("x",))
AX = ("x",)
MIB = 1 << 20


def chunked(v, c, one_gather):
    flat = v.reshape(-1)
    m = flat.shape[0] // (n * c)
    if one_gather:  # rank j's slice is parts[j]: one all_gather of the stacked trees
        parts = flat.reshape(n, c, m)
        mine = jnp.stack(
            [tree_over_ranks(exchange(parts[:, i], AX, "binary_tree")) for i in range(c)]
        )
        return _compat.all_gather_invariant(mine.reshape(-1), AX, axis=0, tiled=True).reshape(
            v.shape
        )
    parts = flat.reshape(c, n, m)
    outs = [
        _compat.all_gather_invariant(
            tree_over_ranks(exchange(parts[i], AX, "binary_tree")), AX, axis=0, tiled=True
        )
        for i in range(c)
    ]
    return jnp.concatenate(outs).reshape(v.shape)


def pair_groups(level):
    return [[r, r | (1 << level)] for r in range(n) if not r & (1 << level)]


def halving(v, gather_by_levels):
    f = v.reshape(-1)
    for lv in range(k):
        f = lax.psum_scatter(
            f, "x", scatter_dimension=0, axis_index_groups=pair_groups(lv), tiled=True
        )
    if gather_by_levels:
        for lv in reversed(range(k)):
            f = lax.all_gather(f, "x", axis=0, axis_index_groups=pair_groups(lv), tiled=True)
        return f.reshape(v.shape)
    # one all_gather: the chunks arrive in bit-reversed rank order, reordered by a copy
    full = lax.all_gather(f, "x", axis=0, tiled=True).reshape(n, -1)
    perm = [int(format(r, f"0{k}b")[::-1], 2) for r in range(n)] if k else [0]
    return full[np.argsort(perm)].reshape(v.shape)


def a2a(v):
    return lax.all_to_all(v.reshape(n, -1), "x", 0, 0, tiled=True)


# name -> (body, is a full all-reduce, out spec)
GROUPS = {
    "chunks": {
        "concat/2": (lambda v: chunked(v, 2, False), True, P()),
        "concat/4": (lambda v: chunked(v, 4, False), True, P()),
        "onegather/2": (lambda v: chunked(v, 2, True), True, P()),
        "onegather/4": (lambda v: chunked(v, 4, True), True, P()),
    },
    "halving": {
        "halving": (lambda v: halving(v, True), True, P()),
        "halving-ag1": (lambda v: halving(v, False), True, P()),
    },
    "components": {
        "a2a only": (a2a, False, P("x")),
        "a2a+tree": (lambda v: tree_over_ranks(a2a(v)), False, P("x")),
        "tree only": (lambda v: tree_over_ranks(v.reshape(n, -1)), False, P("x")),
        "ag only": (
            lambda v: lax.all_gather(v[: v.shape[0] // n], "x", axis=0, tiled=True),
            False,
            P("x"),
        ),
        "psum_scatter": (lambda v: lax.psum_scatter(v, "x", tiled=True), False, P("x")),
    },
}


def spmd(body, out):
    return jax.jit(
        _compat.shard_map(
            lambda v: body(v[0]), mesh=mesh, in_specs=P("x"), out_specs=out, check_vma=False
        )
    )


def main():
    variants = {
        "psum": (lambda v: lax.psum(v, "x"), False, P()),
        "current": (lambda v: tree_all_reduce(v, AX, "sum", "binary_tree"), True, P()),
        **GROUPS[os.environ.get("GROUP", "components")],
    }
    for nbytes in [int(float(s) * MIB) for s in os.environ.get("SIZES", "64").split()]:
        x = sharded_normal(mesh, nbytes)
        refd = canonical_digest(x, devices[0])
        fns = {name: spmd(body, out) for name, (body, _, out) in variants.items()}
        for name, f in fns.items():
            if variants[name][1]:
                same = all(set(shard_digests(f(x))) == {refd} for _ in range(3))
                print(f"{nbytes // MIB} MiB {name:14s} canonical bits: {same}", flush=True)
        times = time_interleaved(
            fns, (x,), repeats=7, target_ms=20
        )  # interleaved: drift hits all alike
        for name, t in times.items():
            bus = bus_bandwidth(n, nbytes, t)
            print(
                f"{nbytes // MIB:4d} MiB x{n} {name:14s} {t:8.4f} ms  bus {bus:6.1f} GB/s  "
                f"psum/this {times['psum'] / t:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
