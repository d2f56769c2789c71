"""Probe: recursive halving with 2-rank NCCL reduce-scatters (commutative => canonical bits)."""

import hashlib
import os
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
from tessera_jax.primitives.collectives import tree_all_reduce, tree_over_ranks

devices = jax.devices()
n = len(devices)
k = n.bit_length() - 1
assert 1 << k == n
mesh = _compat.make_mesh(np.array(devices), ("x",))
MIB = 1 << 20


def groups(l):
    return [[r, r | (1 << l)] for r in range(n) if not r & (1 << l)]


def halving(v, ag_levels=True):
    f = v.reshape(-1)
    for l in range(k):
        f = lax.psum_scatter(f, "x", scatter_dimension=0, axis_index_groups=groups(l), tiled=True)
    if ag_levels:
        for l in reversed(range(k)):
            f = lax.all_gather(f, "x", axis=0, axis_index_groups=groups(l), tiled=True)
        return f.reshape(v.shape)
    # one all_gather; chunks arrive in bit-reversed rank order: reorder (a copy)
    full = lax.all_gather(f, "x", axis=0, tiled=True).reshape(n, -1)
    perm = [int(format(r, f"0{k}b")[::-1], 2) for r in range(n)] if k else [0]
    inv = np.argsort(perm)
    return full[inv].reshape(v.shape)


VARIANTS = {
    "current": lambda v: tree_all_reduce(v, ("x",), "sum", "binary_tree"),
    "halving": halving,
    "halving-ag1": lambda v: halving(v, False),
}


def spmd(body):
    return jax.jit(
        _compat.shard_map(
            lambda v: body(v[0]), mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False
        )
    )


def digest(y):
    return {hashlib.sha256(np.asarray(s.data).tobytes()).hexdigest() for s in y.addressable_shards}


sizes = [int(float(s) * MIB) for s in os.environ.get("SIZES", "1 64 512").split()]
reps, iters = 7, 10
for nbytes in sizes:
    m = nbytes // 4
    x = jax.jit(
        lambda kk: jax.random.normal(kk, (n, m), jnp.float32),
        out_shardings=NamedSharding(mesh, P("x")),
    )(jax.random.key(nbytes))
    ref = jax.jit(tree_over_ranks)(jax.device_put(x, devices[0]))
    refd = hashlib.sha256(np.asarray(ref).tobytes()).hexdigest()
    del ref
    fns = {"psum": spmd(lambda v: lax.psum(v, "x"))}
    fns.update({kk: spmd(f) for kk, f in VARIANTS.items()})
    for name, f in fns.items():
        ds = [digest(f(x)) for _ in range(3)]
        print(
            f"{nbytes // MIB} MiB {name:12s} canonical bits: {all(d == {refd} for d in ds)}",
            flush=True,
        )
        for _ in range(3):
            f(x).block_until_ready()
    times = {kk: [] for kk in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                y = f(x)
            y.block_until_ready()
            times[name].append((time.perf_counter() - t0) / iters * 1e3)
    tp = statistics.median(times["psum"])
    for name in fns:
        t = statistics.median(times[name])
        bus = 2 * (n - 1) / n * nbytes / (t * 1e-3) / 1e9
        print(
            f"{nbytes // MIB:4d} MiB x{n} {name:12s} {t:8.4f} ms  bus {bus:6.1f} GB/s  psum/this {tp / t:.3f}",
            flush=True,
        )
