"""Probe: chunked variants of the canonical-tree all-reduce vs lax.psum (same bits, overlap?)."""

import collections
import hashlib
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tessera_jax import _compat
from tessera_jax.primitives.collectives import exchange, tree_all_reduce, tree_over_ranks

if os.environ.get("SMOKE"):
    pass
devices = jax.devices()
n = len(devices)
mesh = _compat.make_mesh(np.array(devices), ("x",))
AX = ("x",)
MIB = 1 << 20


def v_chunk_concat(v, C):
    flat = v.reshape(-1)
    m = flat.shape[0] // (n * C)
    parts = flat.reshape(C, n, m)
    outs = []
    for c in range(C):
        recv = exchange(parts[c], AX, "binary_tree")
        mine = tree_over_ranks(recv)
        outs.append(_compat.all_gather_invariant(mine, AX, axis=0, tiled=True))
    return jnp.concatenate(outs).reshape(v.shape)


def v_chunk_one_gather(v, C):
    # chunk c of rank j's slice: one all_gather at the end; element order: rank-major
    flat = v.reshape(-1)
    m = flat.shape[0] // (n * C)
    parts = flat.reshape(n, C, m)  # rank j's slice = parts[j] (n*... same as unchunked)
    mines = []
    for c in range(C):
        recv = exchange(parts[:, c], AX, "binary_tree")
        mines.append(tree_over_ranks(recv))
    mine = jnp.stack(mines)  # (C, m) = my slice
    return _compat.all_gather_invariant(mine.reshape(-1), AX, axis=0, tiled=True).reshape(v.shape)


def v_a2a_chunked_tree(v, C):
    flat = v.reshape(-1)
    m = flat.shape[0] // n
    recv = exchange(flat.reshape(n, m), AX, "binary_tree")
    mine = tree_over_ranks(recv)
    return _compat.all_gather_invariant(mine, AX, axis=0, tiled=True).reshape(v.shape)


VARIANTS = {
    "current": lambda v: tree_all_reduce(v, AX, "sum", "binary_tree"),
    "concat/2": lambda v: v_chunk_concat(v, 2),
    "concat/4": lambda v: v_chunk_concat(v, 4),
    "onegather/2": lambda v: v_chunk_one_gather(v, 2),
    "onegather/4": lambda v: v_chunk_one_gather(v, 4),
}


def spmd(body):
    return jax.jit(
        _compat.shard_map(
            lambda v: body(v[0]), mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=True
        )
    )


def digest(y):
    return {hashlib.sha256(np.asarray(s.data).tobytes()).hexdigest() for s in y.addressable_shards}


def hlo_summary(f, x):
    txt = f.lower(x).compile().as_text()
    ops = collections.Counter(
        re.findall(
            r"= \S+ (all-to-all-start|all-to-all|all-gather-start|all-gather|copy|fusion|concatenate|all-reduce-start|all-reduce|dynamic-slice|slice)\(",
            txt,
        )
    )
    return dict(ops)


sizes = [int(float(s) * MIB) for s in os.environ.get("SIZES", "64 512").split()]
reps, iters = 7, 10
for nbytes in sizes:
    m = nbytes // 4
    x = jax.jit(
        lambda k: jax.random.normal(k, (n, m), jnp.float32),
        out_shardings=NamedSharding(mesh, P("x")),
    )(jax.random.key(nbytes))
    fns = {"psum": spmd(lambda v: lax.psum(v, "x"))}
    fns.update({k: spmd(f) for k, f in VARIANTS.items()})
    ref = digest(fns["current"](x))
    for k, f in fns.items():
        d = digest(f(x))
        if k != "psum":
            print(
                f"{nbytes // MIB} MiB {k:14s} bits {'same' if d == ref else 'DIFFERENT'}  hlo {hlo_summary(f, x)}",
                flush=True,
            )
        for _ in range(3):
            f(x).block_until_ready()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                y = f(x)
            y.block_until_ready()
            times[k].append((time.perf_counter() - t0) / iters * 1e3)
    tp = statistics.median(times["psum"])
    for k in fns:
        t = statistics.median(times[k])
        bus = 2 * (n - 1) / n * nbytes / (t * 1e-3) / 1e9
        print(
            f"{nbytes // MIB:4d} MiB x{n} {k:14s} {t:8.4f} ms  bus {bus:6.1f} GB/s  ratio psum/this {tp / t:.3f}  (min {min(times[k]):.4f})",
            flush=True,
        )
