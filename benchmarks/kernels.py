"""Kernel-language benchmark: the seed examples (examples/kernels/) on the GPU.

Runs on the GPU machine, one process::

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels.py [--only SUBSTR ...] [--json PATH]

First every example runs at a small ragged size against its float64 reference (the
table's ``check`` rows); then the timed cases, each checked again at its own size:

* ``gemm_tc`` and ``double_buffered_gemm`` (bf16 in, f32 accumulation, bf16 out) at
  4096³ against cuBLAS (``jnp.dot`` with bf16 output): ``ratio = cublas_ms / ms``, target
  ≥ 0.8;
* the memory-bound examples (saxpy, scale, group_sum, warp_reduce_sum,
  cooperative_reduction, axpy_tiled, memory_hierarchy, optimized_memory_access; 2^26 f32
  elements, f16 for axpy_tiled) against the copy bandwidth of their input measured in the
  same process (``x + 1`` in XLA, timed interleaved with the kernel): ``gbps`` counts the
  bytes the kernel must read and write, ``ratio`` is the fraction of the copy's bandwidth,
  target ≥ 0.85. Each runs in its example's default launch geometry and in others (the
  seed-sized ones show why the defaults are what they are). Outputs are given by shape
  (``jax.ShapeDtypeStruct``), so no input copy is timed; axpy_tiled's ``Y`` is updated in
  place, each launch donating the previous one's result. cooperative_reduction runs one group
  by design, so it measures what one multiprocessor can stream, not the GPU;
* ``flash_attention`` (bf16, non-causal, batch·heads 64, S 4096, D 128) against
  ``ts.flash_attention``'s Hopper kernel (``TESSERA_KERNELS=pallas``): target ratio ≥ 0.5.

Records ``{suite: "kernels", case, device, jax, impl, baseline, ms, baseline_ms, ratio,
tflops | gbps, rel_err}`` (memory cases add ``baseline_gbps`` and ``bytes_moved``) go to
``benchmarks/results/kernels-<device>.json`` (``$OUT`` on the GPU machines). Timing:
``benchmarks/_common.time_interleaved``.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "kernels"))

import axpy_tiled  # noqa: E402
import cooperative_reduction  # noqa: E402
import flash_attention  # noqa: E402
import fused_mlp  # noqa: E402
import gemm_tc  # noqa: E402
import group_sum  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import memory_hierarchy  # noqa: E402
import numpy as np  # noqa: E402
import pipelined_gemm  # noqa: E402
import saxpy  # noqa: E402
import scale  # noqa: E402
import warp_reduce_sum  # noqa: E402

import tessera_jax as ts  # noqa: E402
from benchmarks._common import (  # noqa: E402
    device_name,
    record,
    results_path,
    time_interleaved,
    write_records,
)
from benchmarks._common import normal as rand  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, F32), np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


def checks() -> list[tuple[str, float, float]]:
    """``(example, rel_err, tolerance)`` of every example at a small ragged size."""
    x, y = rand(1, (1000,)), rand(2, (1000,))
    a, b = rand(3, (200, 136)), rand(4, (136, 72))
    q, k, v = (rand(5 + i, (2, 200, 64)) for i in range(3))
    mlp = (
        rand(8, (100, 32)),
        rand(9, (32, 64)),
        rand(10, (64,)),
        rand(11, (64, 32)),
        rand(12, (32,)),
    )
    m2 = rand(13, (100, 140))
    xh, yh = rand(14, (3000,), jnp.float16), rand(15, (3000,), jnp.float16)
    cases = [
        (
            "axpy_tiled (autotuned)",
            lambda: axpy_tiled.run(xh, yh, 0.5),
            lambda: axpy_tiled.reference(xh, yh, 0.5),
        ),
        ("saxpy", lambda: saxpy.run(2.0, x, y), lambda: saxpy.reference(2.0, x, y)),
        ("scale", lambda: scale.run(x, 3.0), lambda: scale.reference(x, 3.0)),
        ("group_sum", lambda: group_sum.run(x), lambda: group_sum.reference(x)),
        ("warp_reduce_sum", lambda: warp_reduce_sum.run(x), lambda: warp_reduce_sum.reference(x)),
        (
            "cooperative_reduction",
            lambda: cooperative_reduction.run(x),
            lambda: cooperative_reduction.reference(x),
        ),
        (
            "gemm_tc",
            lambda: gemm_tc.run(a, b, BM=64, BN=64, BK=32),
            lambda: gemm_tc.reference(a, b),
        ),
        (
            "double_buffered_gemm",
            lambda: pipelined_gemm.run(a, b, BM=64, BN=64, BK=32),
            lambda: pipelined_gemm.reference(a, b),
        ),
        (
            "flash_attention",
            lambda: flash_attention.run(q, k, v, BQ=64, BKV=32),
            lambda: flash_attention.reference(q, k, v),
        ),
        ("fused_mlp", lambda: fused_mlp.run(*mlp, BM=32), lambda: fused_mlp.reference(*mlp)),
        (
            "memory_hierarchy",
            lambda: memory_hierarchy.run_memory_hierarchy(m2, T=32),
            lambda: memory_hierarchy.reference_memory_hierarchy(m2, T=32),
        ),
        (
            "optimized_memory_access",
            lambda: memory_hierarchy.run_optimized_memory_access(m2, TILE_M=32, TILE_N=64, ROWS=8),
            lambda: np.asarray(m2, np.float64),
        ),
    ]
    out = []
    for name, run, ref in cases:
        try:
            with jax.default_matmul_precision("highest"):  # f32 dots in IEEE f32, not TF32
                err = rel_err(run(), ref())
        except Exception:
            traceback.print_exc()
            err = float("nan")
        out.append((name, err, 1e-3 if name.startswith("axpy") else 1e-5))
        print(f"check {name:26s} rel_err {err:.2e}", flush=True)
    return out


def _record(case, impl, baseline, ms, baseline_ms, err, **extra):
    return record("kernels", case, impl, baseline, ms, baseline_ms, rel_err=err, **extra)


GEMM_CONFIGS = [
    dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
    dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=4),
    dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=3),
    dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4),
    dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, GROUP_M=1),
]
# The double-buffered GEMM's loop holds two K steps, so a pipeline stage is twice gemm_tc's.
DOUBLE_BUFFERED_CONFIGS = [
    dict(BM=128, BN=256, BK=32, num_warps=8, num_stages=3),
    dict(BM=128, BN=256, BK=32, num_warps=8, num_stages=4),
    dict(BM=256, BN=128, BK=32, num_warps=8, num_stages=3),
    dict(BM=256, BN=128, BK=32, num_warps=8, num_stages=4),
]


def bench_gemm(n: int = 4096) -> list[dict]:
    a, b = rand(20, (n, n), BF16), rand(21, (n, n), BF16)
    ref = np.asarray(jnp.dot(a, b, preferred_element_type=F32), np.float64)
    flops = 2.0 * n**3
    fns = {"cublas": jax.jit(lambda a, b: jnp.dot(a, b))}
    for i, c in enumerate(GEMM_CONFIGS):
        fns[f"gemm_tc{i}"] = jax.jit(lambda a, b, c=c: gemm_tc.run(a, b, **c))
    for i, c in enumerate(DOUBLE_BUFFERED_CONFIGS):
        fns[f"double_buffered_gemm{i}"] = jax.jit(lambda a, b, c=c: pipelined_gemm.run(a, b, **c))
    errs = {}
    for name, f in list(fns.items()):
        try:
            errs[name] = rel_err(f(a, b), ref)
        except Exception:
            traceback.print_exc()
            del fns[name]
    t = time_interleaved(fns, (a, b))
    recs = []
    for name, ms in t.items():
        if name == "cublas":
            continue
        configs = GEMM_CONFIGS if name.startswith("gemm_tc") else DOUBLE_BUFFERED_CONFIGS
        impl = f"ts.kernel:{name[:-1]}{configs[int(name[-1])]}"
        recs.append(
            _record(
                f"bf16-{n}x{n}x{n}",
                impl,
                "xla:jnp.dot",
                ms,
                t["cublas"],
                errs[name],
                tflops=flops / ms / 1e9,
            )
        )
    return recs


def _bandwidth_case(
    name: str, config: dict, kernel, out, ref, moved: int, src: jax.Array, tol: float
) -> dict:
    """One memory-bound case: ``out`` (a launch's result) checked against its float64
    reference ``ref``, then ``kernel()`` (one launch) timed interleaved with the copy
    bandwidth of ``src`` (``src + 1`` in XLA: one read and one write of it). ``moved``: the
    bytes the kernel must read and write; ``ratio`` is its bandwidth over the copy's."""
    err = rel_err(out, ref)
    if not err <= tol:
        raise AssertionError(f"{name} {config}: rel_err {err:.2e} > {tol:.0e}")
    copy = jax.jit(lambda x: x + 1)
    t = time_interleaved({"kernel": kernel, "copy": lambda: copy(src)}, ())
    gbps = moved / t["kernel"] / 1e6
    copy_gbps = 2 * src.size * src.dtype.itemsize / t["copy"] / 1e6
    case = f"{src.dtype}-{'x'.join(map(str, src.shape))}"
    impl = f"ts.kernel:{name}{config}"
    rec = _record(case, impl, "xla:x+1 copy bandwidth", t["kernel"], t["copy"], err)
    rec.update(gbps=gbps, baseline_gbps=copy_gbps, ratio=gbps / copy_gbps, bytes_moved=moved)
    return rec


def _fresh(x) -> jax.ShapeDtypeStruct:
    """An output given by shape alone: the launch writes a new array (no copy of an input)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _donated(step, *args):
    """``step(*args, out)`` over and over, each launch's ``out`` the previous one's result,
    donated, so an output aliased to its input is written in place (no copy is timed)."""
    state = [jnp.zeros_like(args[-1])]

    def run():
        state[0] = step(*args[:-1], state[0])
        return state[0]

    return run


def bench_memory(n: int = 1 << 26, only: list[str] | None = None) -> list[dict]:
    """Every memory-bound example at ``n`` f32 elements (f16 for axpy_tiled), in its
    example's launch geometry and in wider ones; bytes moved are the reads and writes the
    kernel must do (a reduction's output is counted, its re-reads of shared tiles are not).
    ``only``: the examples to run (substrings of their names; all by default)."""
    x, y = rand(30, (n,)), rand(31, (n,))
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    f32 = 4 * n
    recs: list[dict] = []

    def case(name, cfg, f, args, ref, moved, src, tol, kernel=None):
        if only and not any(o in name for o in only):
            return
        try:
            kernel = kernel or (lambda: f(*args))
            rec = _bandwidth_case(name, cfg, kernel, f(*args), ref, moved, src, tol)
        except Exception:
            traceback.print_exc()
            return
        recs.append(rec)
        print(f"{rec['impl'][:72]:72s} {rec['gbps']:6.0f} GB/s {rec['ratio']:6.3f}", flush=True)

    for t, nw in ((256, None), (1024, 4)):
        g = ts.launch.grid(blocks=(ts.ceil_div(n, t),), threads=(t,), num_warps=nw)
        f = jax.jit(lambda x, y, g=g: g(saxpy.saxpy)(1.5, x, y, _fresh(x)))
        ref = 1.5 * x64 + y64
        case("saxpy", dict(threads=t, num_warps=nw), f, (x, y), ref, 3 * f32, x, 1e-6)
    for t, nw in ((128, None), (1024, 4)):
        g = ts.launch.grid(blocks=(ts.ceil_div(n, t),), threads=(t,), num_warps=nw)
        f = jax.jit(lambda x, g=g: g(scale.scale)(x, _fresh(x), 3.0))
        case("scale", dict(threads=t, num_warps=nw), f, (x,), 3.0 * x64, 2 * f32, x, 1e-6)
    for groups, t, nw in ((4, 128, None), (528, 1024, 4), (1056, 1024, 8), (1056, 512, 4)):
        g = ts.launch.grid(blocks=(groups,), threads=(t,), num_warps=nw)
        f = jax.jit(
            lambda x, g=g, k=groups: g(group_sum.group_sum)(x, jax.ShapeDtypeStruct((k,), F32))
        )
        ref = group_sum.reference(x64, groups=groups, threads=t)
        cfg = dict(groups=groups, threads=t, num_warps=nw)
        case("group_sum", cfg, f, (x,), ref, f32 + 4 * groups, x, 1e-4)
    for t, nw in ((128, None), (1024, 4), (1024, 8)):
        g = ts.launch.grid(blocks=(ts.ceil_div(n, t),), threads=(t,), num_warps=nw)
        out = jax.ShapeDtypeStruct((ts.ceil_div(n, 32),), x.dtype)
        f = jax.jit(lambda x, g=g, out=out: g(warp_reduce_sum.warp_reduce_sum)(x, out))
        ref = warp_reduce_sum.reference(x64)
        cfg = dict(threads=t, num_warps=nw)
        case("warp_reduce_sum", cfg, f, (x,), ref, f32 + f32 // 32, x, 1e-5)
    for t, nw in ((128, None), (1024, 8)):
        g = ts.launch.grid(blocks=(1,), threads=(t,), num_warps=nw)
        kern = cooperative_reduction.cooperative_reduction
        f = jax.jit(lambda x, g=g, kern=kern: g(kern)(x, jax.ShapeDtypeStruct((1,), F32)))
        ref = np.asarray([x64.sum()])
        case("cooperative_reduction", dict(threads=t, num_warps=nw), f, (x,), ref, f32 + 4, x, 1e-3)

    xh, yh = rand(32, (n,), jnp.float16), rand(33, (n,), jnp.float16)
    refh = 0.5 * np.asarray(xh, np.float64) + np.asarray(yh, np.float64)
    for cfg in ({}, dict(BM=256, stages=3), dict(BM=128, stages=2)):
        f = jax.jit(lambda X, Y, cfg=cfg: axpy_tiled.run(X, Y, 0.5, **cfg))
        step = jax.jit(lambda X, Y, cfg=cfg: axpy_tiled.run(X, Y, 0.5, **cfg), donate_argnums=1)
        if not cfg:  # the autotuned launch: its record names the configuration it chose
            jax.block_until_ready(f(xh, yh))
            cfg = dict(next(iter(axpy_tiled.axpy_tiled.tuned.values())), tuned=True)
        kernel = _donated(step, xh, yh)
        case("axpy_tiled", cfg, f, (xh, yh), refh, 3 * 2 * n, xh, 1e-3, kernel=kernel)

    side = 1 << (n.bit_length() // 2)
    a = x.reshape(side, n // side)
    a64 = np.asarray(a, np.float64)
    for T, nw in ((32, None), (64, 4), (64, 8)):
        blocks = (ts.ceil_div(a.shape[0], T), ts.ceil_div(a.shape[1], T))
        g = ts.launch.grid(blocks=blocks, threads=(T, T), num_warps=nw)
        kern = memory_hierarchy.memory_hierarchy
        f = jax.jit(lambda a, g=g, T=T, kern=kern: g(kern)(a, _fresh(a), T=T))
        ref = memory_hierarchy.reference_memory_hierarchy(a64, T=T)
        case("memory_hierarchy", dict(T=T, num_warps=nw), f, (a,), ref, 2 * f32, a, 1e-5)
    for tm, tn, rows in ((64, 64, 4), (64, 256, 8), (128, 256, 16)):
        blocks = (ts.ceil_div(a.shape[0], tm), ts.ceil_div(a.shape[1], tn))
        g = ts.launch.grid(blocks=blocks, threads=(rows, tn))
        kw = dict(TILE_M=tm, TILE_N=tn, ROWS=rows)
        kern = memory_hierarchy.optimized_memory_access
        f = jax.jit(lambda a, g=g, kw=kw, kern=kern: g(kern)(a, _fresh(a), **kw))
        case("optimized_memory_access", kw, f, (a,), a64, 2 * f32, a, 0.0)
    return recs


def bench_flash(bh: int = 64, s: int = 4096, d: int = 128) -> list[dict]:
    heads = 16
    q, k, v = (rand(40 + i, (bh, s, d), BF16) for i in range(3))
    to_op = lambda t: t.reshape(bh // heads, heads, s, d).transpose(0, 2, 1, 3)
    qo, ko, vo = to_op(q), to_op(k), to_op(v)
    with ts.kernel_mode("pallas"):
        op = jax.jit(lambda q, k, v: ts.flash_attention(q, k, v))
        ref_op = op(qo, ko, vo)
    ours = jax.jit(lambda q, k, v: flash_attention.run(q, k, v, BQ=128, BKV=64, num_warps=8))
    out = ours(q, k, v)
    err = rel_err(to_op(out), np.asarray(jnp.asarray(ref_op, F32), np.float64))
    with ts.kernel_mode("pallas"):
        t_op = time_interleaved({"op": op}, (qo, ko, vo))["op"]
    t = time_interleaved({"ours": ours}, (q, k, v))["ours"]
    flops = 4.0 * bh * s * s * d
    return [
        _record(
            f"bf16-bh{bh}-s{s}-d{d}",
            "ts.kernel:flash_attention",
            "ts.flash_attention[pallas]",
            t,
            t_op,
            err,
            tflops=flops / t / 1e9,
        )
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--elements", type=int, default=1 << 26, help="memory-bound cases' size")
    p.add_argument("--cases", nargs="*", default=None, help="memory-bound examples to run")
    args = p.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    records: list[dict] = []
    bad = [(n, e) for n, e, tol in checks() if not e <= tol]
    if bad:
        print(f"FAILED checks: {bad}", flush=True)
    benches = (
        ("gemm", bench_gemm),
        ("memory", lambda: bench_memory(args.elements, args.cases)),
        ("flash", bench_flash),
    )
    for name, fn in benches:
        if args.only and not any(o in name for o in args.only):
            continue
        try:
            records += fn()
        except Exception:
            traceback.print_exc()
        print(f"done {name}", flush=True)
    print(f"{'case':24s} {'impl':60s} {'ms':>9s} {'base ms':>9s} {'ratio':>6s} {'err':>8s}")
    for r in records:
        print(
            f"{r['case']:24s} {r['impl'][:60]:60s} {r['ms']:9.4f} {r['baseline_ms']:9.4f} "
            f"{r['ratio']:6.3f} {r['rel_err']:8.1e}"
        )
    path = args.json or results_path(f"kernels-{device_name(family=True)}.json")
    print("wrote", write_records(path, records))


if __name__ == "__main__":
    main()
