"""Probe: how close the NVLink all-reduce kernel is to what the links carry (4+ GPUs).

    NCCL_NVLS_ENABLE=0 python benchmarks/archive/allreduce_ceiling.py [ceiling] [plans] [small]

``ceiling``: the write bandwidth a rank gets when it pushes ``(n-1)/n`` of its message to
its peers, which is one phase of the kernel: NCCL's all_to_all and a push-only Mosaic GPU
kernel (the kernel's scatter phase and handshake alone, same tiling). Twice that time is
the floor for any two-phase all-reduce without NVLink multicast; ``bus GB/s`` is in the
all-reduce's units (``2(n-1)/n`` · bytes per rank / twice the time).
``plans``: the kernel at other tilings (tile rows x CTAs x scatter stages) than ``plan``'s.
``small``: device time per all-reduce at small messages, 50 all-reduces chained in one
program (so host dispatch is out of the figure): psum, gather, binary_tree, the kernel.
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

from benchmarks._common import time_interleaved
from benchmarks.allreduce import bus_bandwidth, canonical_digest, shard_digests, sharded_normal
from tessera_jax import _compat
from tessera_jax.pallas_kernels import allreduce_mgpu as ar
from tessera_jax.primitives.collectives import tree_all_reduce

MIB = 1 << 20
LANES = ar.LANES


def push_only(x, axis_name, n, p):
    """Phase 1 of the kernel alone: chunk q of ``x`` into rank q's receive buffer."""
    x2 = x.reshape(p.rows, LANES)
    tr, crows, nb, per, stages = p.tile_rows, p.chunk_rows, p.blocks, p.tiles_per_block, p.stages
    npeers = n - 1

    def body(x_ref, recv_ref, sems):
        d = lax.axis_index(axis_name)
        blk = lax.axis_index("blocks")
        peers = [{axis_name: lax.rem(d + k, n)} for k in range(1, n)]

        def tile_row(i):
            return (blk + i * nb) * tr

        def scatter(bufs, bars):
            def load(i, slot):
                for k in range(npeers):
                    src = x_ref.at[pl.ds(lax.rem(d + k + 1, n) * crows + tile_row(i), tr)]
                    plgpu.copy_gmem_to_smem(src, bufs.at[slot, k], bars.at[slot * npeers + k])

            for i in range(min(stages - 1, per)):
                load(i, i)

            @pl.loop(0, per)
            def _(i):
                slot = lax.rem(i, stages)
                for k in range(npeers):
                    plgpu.barrier_wait(bars.at[slot * npeers + k])
                    dst = plgpu.remote_ref(recv_ref, peers[k]).at[d, pl.ds(tile_row(i), tr)]
                    plgpu.copy_smem_to_gmem(bufs.at[slot, k], dst, commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)

                @pl.when(i + stages - 1 < per)
                def _():
                    load(i + stages - 1, lax.rem(i + stages - 1, stages))

        pl.run_scoped(
            scatter,
            plgpu.SMEM((stages, npeers, tr, LANES), x.dtype),
            plgpu.Barrier(num_barriers=stages * npeers),
        )
        sem = sems.at[0]
        plgpu.wait_smem_to_gmem(0)
        for k in range(npeers):
            pl.semaphore_signal(sem, device_id=peers[k])
        pl.semaphore_wait(sem, npeers)

    recv = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n, crows, LANES), x.dtype),
        scratch_types=[plgpu.SemaphoreType.REGULAR((1,))],
        grid=(nb,),
        grid_names=("blocks",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x2)
    return recv[0, :8]  # a sliver, so the timing is the kernel's and not a copy's


def with_plan(plan_fn, body):
    """``body()`` with ``allreduce_mgpu.plan`` replaced by ``plan_fn``."""
    saved = ar.plan
    ar.plan = plan_fn
    try:
        return body()
    finally:
        ar.plan = saved


def main(modes):
    devs = np.array(jax.devices())
    n = len(devs)
    mesh = _compat.make_mesh(devs, ("x",))
    num_sms = int(devs[0].core_count)
    print(jax.__version__, n, devs[0].device_kind, "SMs", num_sms, flush=True)

    def spmd(body, out=P()):
        return jax.jit(
            _compat.shard_map(
                lambda v: body(v[0]), mesh=mesh, in_specs=P("x"), out_specs=out, check_vma=False
            )
        )

    psum = spmd(lambda v: lax.psum(v, "x"))
    kern = spmd(lambda v: ar.all_reduce(v, "x", n, num_sms))

    if "ceiling" in modes:
        for mib in (64, 512):
            nbytes = mib * MIB
            m = nbytes // 4
            x = sharded_normal(mesh, nbytes)
            p = ar.plan(m, n, jnp.float32, num_sms)
            a2a = spmd(
                lambda v: lax.all_to_all(v.reshape(n, -1), "x", 0, 0, tiled=True)[:1, :8],
                out=P("x"),
            )
            push = spmd(lambda v, p=p: push_only(v, "x", n, p)[None], out=P("x"))
            t = time_interleaved(
                {"kernel": kern, "push": push, "a2a": a2a, "psum": psum}, (x,), target_ms=20
            )
            row = {
                k: (v, bus_bandwidth(n, nbytes, 2 * v if k in ("push", "a2a") else v))
                for k, v in t.items()
            }
            print(
                f"ceiling n={n} {mib} MiB {p}: "
                + "  ".join(f"{k} {ms:.3f} ms {bw:.0f} GB/s" for k, (ms, bw) in row.items()),
                flush=True,
            )

    if "plans" in modes:
        for mib in (64, 512):
            nbytes = mib * MIB
            m = nbytes // 4
            x = sharded_normal(mesh, nbytes)
            ref = canonical_digest(x, devs[0])
            base = ar.plan(m, n, jnp.float32, num_sms)
            fns = {"plan": kern}
            for tr in (4, 8, 16):
                for nb in (num_sms // 4, num_sms // 2, num_sms):
                    for st in (2, 4):
                        rows = -(-m // (n * LANES * tr * nb)) * (n * tr * nb)
                        if (2 * n + 2) * tr * LANES * 4 > ar.SMEM_BUDGET:
                            continue
                        if st * (n - 1) * tr * LANES * 4 > ar.SMEM_BUDGET:
                            continue
                        q = ar.Plan(n=n, rows=rows, tile_rows=tr, blocks=nb, stages=st)
                        fns[f"tr{tr}-b{nb}-s{st}"] = with_plan(
                            lambda *a, q=q, **k: q,
                            lambda: (
                                spmd(lambda v: ar.all_reduce(v, "x", n, num_sms)).lower(x).compile()
                            ),
                        )
            bad = [k for k, f in fns.items() if shard_digests(f(x))[0] != ref]
            t = time_interleaved(fns, (x,), target_ms=20, repeats=3)
            print(f"plans n={n} {mib} MiB (plan: {base}); bits differ: {bad or 'none'}")
            for k, v in sorted(t.items(), key=lambda kv: kv[1]):
                print(f"  {k:<16} {v:.3f} ms {bus_bandwidth(n, nbytes, v):.0f} GB/s", flush=True)

    if "small" in modes:
        reps = 50

        def chained(f):
            def body(v):
                return lax.fori_loop(0, reps, lambda i, y: f(y) * (1.0 / n), v)

            return spmd(body)

        for kib in (64, 256, 1024, 4096):
            nbytes = kib << 10
            x = sharded_normal(mesh, nbytes)
            fns = {
                "psum": chained(lambda v: lax.psum(v, "x")),
                "gather": chained(lambda v: tree_all_reduce(v, ("x",), "sum", "gather")),
                "binary_tree": chained(lambda v: tree_all_reduce(v, ("x",), "sum", "binary_tree")),
                "nvlink": chained(lambda v: ar.all_reduce(v, "x", n, num_sms)),
            }
            t = time_interleaved(fns, (x,), target_ms=20, repeats=3)
            print(
                f"small n={n} {kib} KiB, us per all-reduce: "
                + "  ".join(f"{k} {v / reps * 1e3:.1f}" for k, v in t.items()),
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["ceiling", "plans", "small"])
