"""Probe: the NVLink all-reduce kernel (pallas_kernels/allreduce_mgpu.py).

    NCCL_NVLS_ENABLE=0 timeout 300 python benchmarks/archive/allreduce_nvlink.py [MiB ...]
    NCCL_NVLS_ENABLE=0 timeout 300 python benchmarks/archive/allreduce_nvlink.py 2d

Sizes: the kernel called directly on all local GPUs (and on the first 2 when there are
more): bits against the 1-device canonical tree and 3 runs, then the time against
lax.psum and the XLA binary_tree path. ``2d``: ``ts.op.all_reduce(algo="nvlink")`` over
each axis of a 2x2 mesh (4 GPUs) and on a ragged message, bits against the tree.
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks._common import time_interleaved
from benchmarks.allreduce import (
    bus_bandwidth,
    canonical_digest,
    shard_digests,
    sharded_normal,
)
from tessera_jax import _compat
from tessera_jax.pallas_kernels import allreduce_mgpu as ar
from tessera_jax.primitives.collectives import tree_all_reduce, tree_over_ranks

MIB = 1 << 20
print(jax.__version__, jax.devices(), flush=True)


def mesh2d():
    import tessera_jax as ts

    devs = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = _compat.make_mesh(devs, ("dp", "tp"))
    for axis, shape in (("dp", (3 << 20,)), ("tp", (3 << 20,)), ("tp", (1000, 4099))):
        f = jax.jit(
            _compat.shard_map(
                lambda v, a=axis: ts.op.all_reduce(v[0, 0], axis=a, algo="nvlink")[None, None],
                mesh=mesh,
                in_specs=P("dp", "tp"),
                out_specs=P("dp", "tp"),
                check_vma=False,
            )
        )
        x = jax.random.normal(jax.random.key(len(shape)), (2, 2, *shape), jnp.float32)
        y = np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))))
        xs = np.asarray(x)
        ok = True
        for i in range(2):
            for j in range(2):
                parts = xs[:, j] if axis == "dp" else xs[i, :]
                want = np.asarray(tree_over_ranks(jnp.asarray(parts)))
                ok &= y[i, j].tobytes() == want.tobytes()
        hlo = f.lower(jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))).as_text()
        print(
            f"2x2 mesh, axis {axis}, {shape}: bits {'ok' if ok else 'BAD'}, "
            f"kernel {'yes' if 'mosaic_gpu' in hlo else 'NO'}",
            flush=True,
        )


if sys.argv[1:] == ["2d"]:
    mesh2d()
    sys.exit(0)
sizes = [float(s) for s in sys.argv[1:]] or [1, 64, 512]


for n in sorted({len(jax.devices()), 2}, reverse=True):
    devs = np.array(jax.devices()[:n])
    mesh = _compat.make_mesh(devs, ("x",))
    num_sms = int(devs[0].core_count)

    def spmd(body):
        return jax.jit(
            _compat.shard_map(
                lambda v: body(v[0]), mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False
            )
        )

    kern = spmd(lambda v: ar.all_reduce(v, "x", n, num_sms))
    xla = spmd(lambda v: tree_all_reduce(v, ("x",), "sum", "binary_tree"))
    psum = spmd(lambda v: jax.lax.psum(v, "x"))
    for mib in sizes:
        for dtype in (jnp.float32, jnp.bfloat16):
            nbytes = int(mib * MIB)
            m = nbytes // jnp.dtype(dtype).itemsize
            x = sharded_normal(mesh, nbytes, dtype)
            ref = canonical_digest(x, devs[0])
            print(
                f"n={n} {mib} MiB {jnp.dtype(dtype).name}: {ar.plan(m, n, dtype, num_sms)}",
                flush=True,
            )
            ys = [kern(x) for _ in range(3)]
            ok = all(d == ref for y in ys for d in shard_digests(y))
            if not ok:
                y0 = np.asarray(ys[0].addressable_shards[0].data, np.float32)
                r0 = np.asarray(jax.jit(tree_over_ranks)(jax.device_put(x, devs[0])), np.float32)
                bad = np.flatnonzero(y0 != r0)
                print(f"  MISMATCH: {len(bad)} of {y0.size} differ; first {bad[:8]}", flush=True)
            xd = shard_digests(xla(x))[0]
            t = time_interleaved({"kernel": kern, "xla": xla, "psum": psum}, (x,), target_ms=20)
            tk, tx, tp = t["kernel"], t["xla"], t["psum"]
            print(
                f"  bits {'ok' if ok else 'BAD'} (xla path {'same' if xd == ref else 'DIFF'})  "
                f"kernel {tk:.3f} ms ({bus_bandwidth(n, nbytes, tk):.0f} GB/s) {tp / tk:.3f}x psum"
                f" | binary_tree {tx:.3f} ms {tp / tx:.3f}x | psum {tp:.3f} ms "
                f"({bus_bandwidth(n, nbytes, tp):.0f} GB/s)",
                flush=True,
            )
