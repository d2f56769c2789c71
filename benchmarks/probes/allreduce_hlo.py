import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tessera_jax import _compat
from tessera_jax.primitives.collectives import tree_all_reduce

devices = jax.devices()
n = len(devices)
mesh = _compat.make_mesh(np.array(devices), ("x",))
m = (64 << 20) // 4
x = jax.ShapeDtypeStruct((n, m), jnp.float32, sharding=NamedSharding(mesh, P("x")))
f = jax.jit(
    _compat.shard_map(
        lambda v: tree_all_reduce(v[0], ("x",), "sum", "binary_tree"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P(),
        check_vma=True,
    )
)
import statistics
import time

from jax import lax

from tessera_jax.primitives.collectives import tree_over_ranks

xs = jax.jit(
    lambda k: jax.random.normal(k, (n, m), jnp.float32), out_shardings=NamedSharding(mesh, P("x"))
)(jax.random.key(0))


def sm(body, out=P()):
    return jax.jit(
        _compat.shard_map(
            lambda v: body(v[0]), mesh=mesh, in_specs=P("x"), out_specs=out, check_vma=False
        )
    )


parts = {
    "psum": sm(lambda v: lax.psum(v, "x")),
    "ours": f,
    "a2a only": sm(lambda v: lax.all_to_all(v.reshape(n, -1), "x", 0, 0, tiled=True), P("x")),
    "a2a+tree": sm(
        lambda v: tree_over_ranks(lax.all_to_all(v.reshape(n, -1), "x", 0, 0, tiled=True)), P("x")
    ),
    "tree only": sm(lambda v: tree_over_ranks(v.reshape(n, -1)), P("x")),
    "ag only": sm(lambda v: lax.all_gather(v[: m // n], "x", axis=0, tiled=True), P("x")),
    "psum_scatter": sm(lambda v: lax.psum_scatter(v, "x", tiled=True), P("x")),
}
for k, g in parts.items():
    for _ in range(3):
        g(xs).block_until_ready()
ts = {k: [] for k in parts}
for _ in range(7):
    for k, g in parts.items():
        t0 = time.perf_counter()
        for _ in range(10):
            y = g(xs)
        y.block_until_ready()
        ts[k].append((time.perf_counter() - t0) / 10 * 1e3)
for k in parts:
    print(f"{os.environ.get('TAG', ''):28s} {k:14s} {statistics.median(ts[k]):.4f} ms", flush=True)
