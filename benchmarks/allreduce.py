"""Deterministic all-reduce (``ts.op.all_reduce``) against ``lax.psum`` (NCCL).

One command, all local devices, f32 messages of 1, 64 and 512 MiB per rank::

    python benchmarks/allreduce.py            # GPU machine (nvidia-h200-x2 / -x4)
    python benchmarks/allreduce.py --smoke    # CPU, tiny sizes, 8 virtual devices

For each size it times, in the same process, the canonical-tree all-reduce
(``auto``: what ``ts.op.all_reduce`` does by default — NCCL's own all-reduce where
the order cannot change the bits (f32 over 2 parts), else one of the following;
``binary_tree``: all_to_all, local pairwise tree, all_gather; ``ring``: the
all_to_all as n-1 ppermute rounds; and at the smallest size ``gather``:
all_gather + local tree, the latency path "auto" takes for small messages)
against ``lax.psum``: each algorithm paired with its own psum measurement, their
repeats interleaved, median of repeats of back-to-back calls after ~0.2 s of warm-up
each (without it, the first algorithm timed after the host-side checks read up to
30% slower than the same code path timed next).
Bus bandwidth = 2(n-1)/n · bytes per rank / time.

Each algorithm is also timed in a program: ``k`` all-reduces written out in one jitted
program (each one's input the last one's output over n), against psum chained the same
way (``in_program_*`` fields, per all-reduce; ``in_program_form: "unrolled"``). Back-to-back
calls of a one-collective program measure, at small messages, the host's launch of a
program on every device; in a program (a training step) only the collective's device
time counts. Records without ``in_program_form`` chained them in a ``fori_loop``, whose
own cost per trip favours the NVLink kernel at small messages
(``benchmarks/archive/allreduce-latency-h200-x4.txt``).

It checks, before timing: the deterministic result is bitwise identical across
3 runs and on every rank, and equal to the canonical tree of the same data
computed on one device (``tree_over_ranks`` of the stacked ranks); it records
whether ``psum`` happened to give the same bits. Records go to
``$OUT/allreduce-<device>.json`` if ``$OUT`` is set, else
``benchmarks/results/allreduce-<device>.json``; a short table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import (  # noqa: E402
    device_name,
    normal,
    results_path,
    time_interleaved,
    write_records,
)

MIB = 1 << 20


def bus_bandwidth(n: int, nbytes: int, ms: float) -> float:
    """GB/s on the bus: an all-reduce moves 2(n-1)/n of the message per rank."""
    return 2 * (n - 1) / n * nbytes / (ms * 1e-3) / 1e9


# --- the all-reduce's data and bit checks --------------------------------------------------


def sharded_normal(mesh, nbytes: int, dtype="float32"):
    """``(n, m)`` normal values in ``dtype`` (``nbytes`` per rank), row r on rank r."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    m = nbytes // jnp.dtype(dtype).itemsize
    return normal(nbytes, (n, m), dtype, sharding=NamedSharding(mesh, P(mesh.axis_names)))


def sha(a) -> str:
    import numpy as np

    return hashlib.sha256(np.asarray(a).tobytes()).hexdigest()


def shard_digests(y) -> list[str]:
    """The digest of each addressable shard of ``y``, in device order."""
    return [sha(s.data) for s in y.addressable_shards]


def canonical_digest(x, device) -> str:
    """The digest of the canonical tree over the rows of ``x``, computed on ``device``."""
    import jax

    from tessera_jax.primitives.collectives import tree_over_ranks

    return sha(jax.jit(tree_over_ranks)(jax.device_put(x, device)))


def in_program_reps(nbytes: int) -> int:
    """How many all-reduces one timed program writes out: about 256 MiB per rank in all,
    at most 20 (each is compiled)."""
    return max(2, min(20, (256 * MIB) // nbytes))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on 8 CPU devices")
    p.add_argument("--sizes-mib", type=float, nargs="*", help="per-rank sizes in MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--algos", nargs="*", default=["auto", "binary_tree", "ring", "nvlink"])
    return p.parse_args()


def main() -> int:
    args = _parse()
    import jax

    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        from tessera_jax import _compat

        _compat.cpu_device_count_flag(8)
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import tessera_jax as ts
    from tessera_jax import _compat
    from tessera_jax.primitives.collectives import tree_all_reduce

    devices = jax.devices()
    n = len(devices)
    mesh = _compat.make_mesh(np.array(devices), ("x",))
    device = device_name(count=True)
    if args.sizes_mib:
        sizes = [int(s * MIB) for s in args.sizes_mib]
    elif args.smoke:
        sizes = [4 << 10, 64 << 10, 1 * MIB]
    else:
        sizes = [1 * MIB, 64 * MIB, 512 * MIB]
    repeats, iters = (2, 3) if args.smoke else (args.repeats, args.iters)

    def label(nbytes: int) -> str:
        return f"{nbytes // MIB}MiB" if nbytes % MIB == 0 else f"{nbytes >> 10}KiB"

    def spmd(body, check_vma=True):
        f = _compat.shard_map(
            lambda v: body(v[0]), mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=check_vma
        )
        return jax.jit(f)

    def chained(body, reps):  # reps all-reduces written out in one program, as in a step
        def run(v):
            for _ in range(reps):
                v = body(v) * (1.0 / n)
            return v

        return spmd(run, check_vma=False)

    psum_body = lambda v: jax.lax.psum(v, "x")
    psum = spmd(psum_body)
    records, rows = [], []
    for nbytes in sizes:
        x = sharded_normal(mesh, nbytes)
        ref_digest = canonical_digest(x, devices[0])  # the same data's tree on one device
        psum_same = set(shard_digests(psum(x))) == {ref_digest}
        algos = list(args.algos) + (["gather"] if nbytes == sizes[0] else [])
        reps = 2 if args.smoke else in_program_reps(nbytes)  # smoke: the compile is the time
        for algo in algos:
            if algo == "gather":  # not a public algo: the path "auto" takes for small messages
                body = lambda v: tree_all_reduce(v, ("x",), "sum", "gather")
            else:  # what users call: the ts_all_reduce primitive
                body = lambda v, a=algo: ts.op.all_reduce(v, axis="x", algo=a)
            ours = spmd(body)
            runs = [shard_digests(ours(x)) for _ in range(3)]
            per_rank = all(len(set(r)) == 1 for r in runs)
            across = len({r[0] for r in runs}) == 1
            canonical = runs[0][0] == ref_digest
            # Each algorithm against its own psum timing, repeats interleaved.
            t = time_interleaved(
                {"ours": ours, "psum": psum},
                (x,),
                repeats=repeats,
                min_iters=iters,
                target_ms=20,
            )
            t, t_psum = t["ours"], t["psum"]
            tc = time_interleaved(
                {"ours": chained(body, reps), "psum": chained(psum_body, reps)},
                (x,),
                repeats=repeats,
                min_iters=3,
                target_ms=20,
            )
            tc, tc_psum = tc["ours"] / reps, tc["psum"] / reps
            bus = functools.partial(bus_bandwidth, n, nbytes)
            rec = {
                "suite": "allreduce",
                "case": f"f32-{label(nbytes)}-x{n}-{algo}",
                "device": device,
                "jax": jax.__version__,
                "impl": f"ts.op.all_reduce(deterministic=True, algo={algo!r})",
                "baseline": "lax.psum",
                "n_devices": n,
                "bytes_per_rank": nbytes,
                "ms": round(t, 4),
                "baseline_ms": round(t_psum, 4),
                "ratio": round(t_psum / t, 4),
                "busbw_gbs": round(bus(t), 2),
                "baseline_busbw_gbs": round(bus(t_psum), 2),
                "in_program_reps": reps,
                "in_program_form": "unrolled",
                "in_program_ms": round(tc, 4),
                "in_program_baseline_ms": round(tc_psum, 4),
                "in_program_ratio": round(tc_psum / tc, 4),
                "in_program_busbw_gbs": round(bus(tc), 2),
                "bitwise_equal_3_runs": across,
                "bitwise_equal_all_ranks": per_rank,
                "equals_1device_canonical_tree": canonical,
                "psum_equals_canonical_tree": psum_same,
            }
            records.append(rec)
            rows.append(rec)
            # After every case, so a run cut short keeps what it measured.
            path = write_records(results_path(f"allreduce-{device}.json"), records)

    print(f"\nwrote {path}")
    head = (
        f"{'case':<28}{'ours ms':>10}{'psum ms':>10}{'ratio':>8}{'bus GB/s':>10}{'psum':>8}"
        f"{'in-prog us':>11}{'psum us':>9}{'ratio':>7}  bits"
    )
    print(head)
    for r in rows:
        bits = (
            "ok"
            if (
                r["bitwise_equal_3_runs"]
                and r["bitwise_equal_all_ranks"]
                and r["equals_1device_canonical_tree"]
            )
            else "MISMATCH"
        )
        print(
            f"{r['case']:<28}{r['ms']:>10.3f}{r['baseline_ms']:>10.3f}{r['ratio']:>8.3f}"
            f"{r['busbw_gbs']:>10.1f}{r['baseline_busbw_gbs']:>8.1f}"
            f"{r['in_program_ms'] * 1e3:>11.1f}{r['in_program_baseline_ms'] * 1e3:>9.1f}"
            f"{r['in_program_ratio']:>7.3f}  {bits}"
        )
    ok = all(
        r["bitwise_equal_3_runs"]
        and r["bitwise_equal_all_ranks"]
        and r["equals_1device_canonical_tree"]
        for r in rows
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
