"""GPU check: grad and jvp through ts.op.all_reduce / all_gather inside shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax import _compat

n = len(jax.devices())
mesh = _compat.make_mesh(np.array(jax.devices()), ("x",))


def body(v):
    y = ts.op.all_reduce(v[0] ** 2, axis="x")
    z = ts.op.all_gather(jnp.sin(v[0]), axis="x")
    return y.sum() + ts.op.all_reduce(z.sum(), axis="x", op="mean")


f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))
x = jax.random.normal(jax.random.key(0), (n, 1000))
g = jax.jit(jax.grad(f))(x)
want = 2 * x + jnp.cos(x)
print("grad max err", float(jnp.abs(g - want).max()))
t = jax.jvp(f, (x,), (jnp.ones_like(x),))[1]
print("jvp", float(t), "want", float(want.sum()))
assert float(jnp.abs(g - want).max()) < 1e-4
assert abs(float(t) - float(want.sum())) < 1e-2 * abs(float(want.sum())) + 1e-2
print("ok")
