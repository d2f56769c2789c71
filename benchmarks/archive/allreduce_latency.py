"""Probe: where the NVLink all-reduce kernel's time goes at small messages (2+ GPUs).

    NCCL_NVLS_ENABLE=0 python benchmarks/archive/allreduce_latency.py [unrolled] [KiB ...]

Time per all-reduce of a program of 50 chained all-reduces (timed from the host: one
dispatch per program, so the launch of each call is out of the figure, not what XLA does
on the host for each kernel when a program starts), at each message size (default 64, 256, 1024 and 4096 KiB per rank, f32). The chain is a
``fori_loop`` (as ``benchmarks/allreduce.py``'s ``in_program`` figures), or with
``unrolled`` 20 calls written out in the program (no loop: what a training step does).

- ``psum``: NCCL's all-reduce; ``xla``: the chain's elementwise step alone, no all-reduce;
  ``gather``: all_gather + the local tree (``auto``'s path under 1 MiB);
- ``plan``: the kernel as ``allreduce_mgpu.plan`` tiles it; ``tr<t>-b<b>``: the kernel at
  ``t``-row tiles over ``b`` CTAs (the tilings that do not pad the message);
- ``oneshot-tr<t>-b<b>``: a one-phase variant: every rank pushes its whole message to
  every peer, then each rank adds the ``n`` contributions on the canonical tree itself
  (``n-1`` times the kernel's bytes out of each GPU, one data phase instead of two); a
  second semaphore round still closes the call (a peer's next call may reuse the receive
  buffer);
- ``sync<r>-b<b>``: a kernel of ``b`` CTAs that copies one tile and makes ``r`` semaphore
  rounds with every peer (the kernel's synchronisation alone); ``local-b1``: one CTA, the
  copy only (what launching a Mosaic GPU kernel costs inside a program).

The one-shot variant's bits are checked against the canonical tree on one device.
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
from benchmarks.allreduce import canonical_digest, shard_digests, sharded_normal
from tessera_jax import _compat
from tessera_jax.pallas_kernels import allreduce_mgpu as ar
from tessera_jax.primitives.collectives import tree_all_reduce

LANES = ar.LANES
WG = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _peers(axis_name, n):
    d = lax.axis_index(axis_name)
    return d, [{axis_name: lax.rem(d + k, n)} for k in range(1, n)]


def _handshake(sem, peers):
    plgpu.wait_smem_to_gmem(0)
    for p in peers:
        pl.semaphore_signal(sem, device_id=p)
    pl.semaphore_wait(sem, len(peers))


def one_shot(x, axis_name, n, tr, nb):
    """The canonical-tree sum of ``x`` over ``axis_name``, one data phase (docstring)."""
    size, dtype = x.size, x.dtype
    rows = -(-size // (LANES * tr * nb)) * tr * nb
    flat = x.reshape(-1)
    if rows * LANES != size:
        flat = jnp.pad(flat, (0, rows * LANES - size))
    x2 = flat.reshape(rows, LANES)
    per = rows // tr // nb

    def body(x_ref, out_ref, recv_ref, sems):
        d, peers = _peers(axis_name, n)
        blk = lax.axis_index("blocks")

        def tile(i):
            return pl.ds((blk + i * nb) * tr, tr)

        def push(bufs, bars):
            def load(i, slot):
                plgpu.copy_gmem_to_smem(x_ref.at[tile(i)], bufs.at[slot], bars.at[slot])

            load(0, 0)

            @pl.loop(0, per)
            def _(i):
                slot = lax.rem(i, 2)
                plgpu.barrier_wait(bars.at[slot])
                for p in peers:
                    dst = plgpu.remote_ref(recv_ref, p).at[d, tile(i)]
                    plgpu.copy_smem_to_gmem(bufs.at[slot], dst, commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)

                @pl.when(i + 1 < per)
                def _():
                    load(i + 1, 1 - slot)

        def reduce(bufs, outs, bars):
            def load(i, slot):
                for r in range(n):

                    @pl.when(d == r)
                    def _():
                        plgpu.copy_gmem_to_smem(
                            x_ref.at[tile(i)], bufs.at[slot, r], bars.at[slot * n + r]
                        )

                    @pl.when(d != r)
                    def _():
                        plgpu.copy_gmem_to_smem(
                            recv_ref.at[r, tile(i)], bufs.at[slot, r], bars.at[slot * n + r]
                        )

            load(0, 0)

            @pl.loop(0, per)
            def _(i):
                slot = lax.rem(i, 2)

                @pl.when(i + 1 < per)
                def _():
                    load(i + 1, 1 - slot)

                vals = []
                for r in range(n):
                    plgpu.barrier_wait(bars.at[slot * n + r])
                    vals.append(bufs.at[slot, r][...].astype(jnp.float32))
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                outs.at[slot][...] = ar.canonical_tree(vals).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(outs.at[slot], out_ref.at[tile(i)])

        pl.run_scoped(push, plgpu.SMEM((2, tr, LANES), dtype), plgpu.Barrier(num_barriers=2))
        _handshake(sems.at[0], peers)
        pl.run_scoped(
            reduce,
            plgpu.SMEM((2, n, tr, LANES), dtype),
            plgpu.SMEM((2, tr, LANES), dtype),
            plgpu.Barrier(num_barriers=2 * n),
        )
        _handshake(sems.at[1], peers)

    out, _ = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((rows, LANES), dtype),
            jax.ShapeDtypeStruct((n, rows, LANES), dtype),
        ),
        scratch_types=[plgpu.SemaphoreType.REGULAR((2,))],
        grid=(nb,),
        grid_names=("blocks",),
        compiler_params=WG,
    )(x2)
    return out.reshape(-1)[:size].reshape(x.shape)


def sync_only(x, axis_name, n, nb, rounds):
    """``rounds`` semaphore rounds with every peer in each of ``nb`` CTAs, after copying
    one 8-row tile of ``x`` per CTA; returns ``x`` with that tile's first value added."""
    x2 = x.reshape(-1, LANES)
    tiles = x2.shape[0] // 8

    def body(x_ref, out_ref, sems):
        blk = lax.axis_index("blocks")

        def copy(buf, bar):
            src = x_ref.at[pl.ds(lax.rem(blk, tiles) * 8, 8)]
            plgpu.copy_gmem_to_smem(src, buf, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            plgpu.copy_smem_to_gmem(buf, out_ref.at[pl.ds(blk * 8, 8)])

        pl.run_scoped(copy, plgpu.SMEM((8, LANES), x.dtype), plgpu.Barrier(num_barriers=1))
        if rounds:
            _, peers = _peers(axis_name, n)
            for r in range(rounds):
                _handshake(sems.at[r], peers)
        else:
            plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((nb * 8, LANES), x.dtype),
        scratch_types=[plgpu.SemaphoreType.REGULAR((max(rounds, 1),))],
        grid=(nb,),
        grid_names=("blocks",),
        compiler_params=WG,
    )(x2)
    return x + out[0, 0]


def main(kibs, unrolled):
    devs = np.array(jax.devices())
    n = len(devs)
    mesh = _compat.make_mesh(devs, ("x",))
    num_sms = int(devs[0].core_count)
    print(jax.__version__, n, devs[0].device_kind, "SMs", num_sms, flush=True)
    reps = 20 if unrolled else 50

    def chained(f):
        def body(v):
            if unrolled:
                y = v[0]
                for _ in range(reps):
                    y = f(y) * (1.0 / n)
                return y[None]
            return lax.fori_loop(0, reps, lambda i, y: f(y) * (1.0 / n), v[0])[None]

        return jax.jit(
            _compat.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        )

    def single(f):
        return jax.jit(
            _compat.shard_map(
                lambda v: f(v[0])[None],
                mesh=mesh,
                in_specs=P("x"),
                out_specs=P("x"),
                check_vma=False,
            )
        )

    for kib in kibs:
        nbytes = kib << 10
        m = nbytes // 4
        x = sharded_normal(mesh, nbytes)
        ref = canonical_digest(x, devs[0])
        base = ar.plan(m, n, jnp.float32, num_sms)
        fns = {
            "psum": chained(lambda v: lax.psum(v, "x")),
            "xla": chained(lambda v: v),
            "gather": chained(lambda v: tree_all_reduce(v, ("x",), "sum", "gather")),
            "plan": chained(lambda v: ar.all_reduce(v, "x", n, num_sms)),
        }
        bad = []
        if not unrolled:  # the tilings and the one-shot variant: fori_loop only
            chunk = -(-m // (n * LANES))
            saved = ar.plan
            try:
                for tr in (1, 4, 16):
                    for nb in (8, 32, 128):
                        if chunk % (tr * nb) or (tr, nb) == (base.tile_rows, base.blocks):
                            continue
                        q = ar.Plan(n=n, rows=chunk * n, tile_rows=tr, blocks=nb, stages=2)
                        ar.plan = lambda *a, q=q, **k: q
                        f = chained(lambda v: ar.all_reduce(v, "x", n, num_sms))
                        f.lower(x).compile()
                        fns[f"tr{tr}-b{nb}"] = f
            finally:
                ar.plan = saved
            rows = -(-m // LANES)
            shots = []
            for tr in (4, 8, 16):
                for nb in (8, 32, 128):
                    if rows % (tr * nb) == 0 and rows // (tr * nb) <= 64:
                        shots.append((tr, nb))
            for tr, nb in shots:
                name = f"oneshot-tr{tr}-b{nb}"
                one = single(lambda v, tr=tr, nb=nb: one_shot(v, "x", n, tr, nb))
                if shard_digests(one(x))[0] != ref:
                    bad.append(name)
                fns[name] = chained(lambda v, tr=tr, nb=nb: one_shot(v, "x", n, tr, nb))
        for r, nb in ((1, 1), (1, 32), (1, 128), (2, 32), (2, 128)):
            fns[f"sync{r}-b{nb}"] = chained(lambda v, r=r, nb=nb: sync_only(v, "x", n, nb, r))
        fns["local-b1"] = chained(lambda v: sync_only(v, "x", n, 1, 0))
        t = time_interleaved(fns, (x,), target_ms=20, repeats=3)
        form = "unrolled" if unrolled else "fori_loop"
        bits = "" if unrolled else f"; one-shot bits differ: {bad or 'none'}"
        print(f"n={n} {kib} KiB {form} (plan {base}){bits}")
        for k, v in sorted(t.items(), key=lambda kv: kv[1]):
            print(f"  {k:<20} {v / reps * 1e3:6.1f} us", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([int(a) for a in args if a != "unrolled"] or [64, 256, 1024, 4096], "unrolled" in args)
