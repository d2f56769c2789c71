"""Matmul benchmark: ``ts.op.matmul`` (Hopper Mosaic GPU kernel / auto dispatch) vs XLA.

Runs on the GPU machine, one process, every case checked against an f32 reference
before it is timed::

    PYTHONUNBUFFERED=1 python3 benchmarks/matmul.py [--sweep] [--json PATH]

For each case it times the XLA baseline (``jnp.dot`` → cuBLAS / cuBLASLt, or XLA's
fused expression), the Mosaic GPU kernel with its heuristic config
(``impl = "mosaic_gpu"``) and ``ts.op.matmul`` in the default ``auto`` mode (what a
user gets: the kernel where ``prefer`` picks it, XLA elsewhere). ``--sweep`` first
times every named candidate config (``matmul_configs.CANDIDATES``) on the large shapes.
Timing: ``benchmarks/_common.time_interleaved`` (a timed warm-up, then all
implementations in turn in each of 5 repeats, the median).
Prints a table last and writes JSON records ``{suite, case, device, jax, impl, baseline,
ms, baseline_ms, ratio = baseline_ms / ms, tflops, rel_err}``.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import tessera_jax as ts  # noqa: E402
from benchmarks import _common  # noqa: E402
from benchmarks._common import (  # noqa: E402
    device_name,
    results_path,
    time_interleaved,
    write_records,
)
from benchmarks._common import normal as rand  # noqa: E402
from tessera_jax.contracts.matmul import MatmulSpec  # noqa: E402
from tessera_jax.pallas_kernels import matmul_configs as mc  # noqa: E402
from tessera_jax.pallas_kernels import matmul_mgpu as mg  # noqa: E402
from tessera_jax.primitives.matmul import matmul_op  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def telemetry() -> str:
    """SM clock, power and temperature of GPU 0 (empty if NVML is unavailable)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        clk = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        pw = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
        tmp = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
        return f"[sm {clk} MHz, {pw:.0f} W, {tmp} C]"
    except Exception:
        return ""


def rel_err(out, ref) -> float:
    out = out.astype(F32)
    ref = ref.astype(F32)
    return float(jnp.linalg.norm((out - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def checked(fns: dict, args, ref, label: str) -> dict:
    """Relative error of each function's result against ``ref``; a function that fails
    (a config the hardware or the lowering refuses) is reported and dropped from ``fns``,
    so the rest are still timed."""
    errs = {}
    for name in list(fns):
        try:
            errs[name] = rel_err(fns[name](*args), ref)
        except Exception as e:
            traceback.print_exc()
            print(f"!! {label} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            del fns[name]
    return errs


def ref_dot(a, b, ta=False, tb=False):
    a = a.astype(F32)
    b = b.astype(F32)
    if ta:
        a = a.T
    if tb:
        b = b.T
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST)


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


# --- cases ----------------------------------------------------------------------------------
# (case, M, N, K, kind); kinds: plain bf16, transposed (tn / nt), bias_gelu, fp8, fp8_mixed.
CASES = [
    ("bf16-4096x4096x4096", 4096, 4096, 4096, "bf16"),
    ("bf16-8192x8192x8192", 8192, 8192, 8192, "bf16"),
    ("bf16-8192x8192x1024", 8192, 8192, 1024, "bf16"),
    ("bf16-skinny-16x8192x8192", 16, 8192, 8192, "bf16"),
    ("bf16-nt-4096x4096x4096", 4096, 4096, 4096, "bf16_nt"),  # A·Bᵀ (dA = dC·Bᵀ)
    ("bf16-tn-4096x4096x4096", 4096, 4096, 4096, "bf16_tn"),  # Aᵀ·B (dB = Aᵀ·dC)
    ("bias-gelu-8192x8192x8192", 8192, 8192, 8192, "bias_gelu"),
    ("fp8-8192x8192x8192", 8192, 8192, 8192, "fp8"),
    ("fp8-8192x8192x8192-vs-bf16", 8192, 8192, 8192, "fp8_vs_bf16"),
    ("fp8-mixed-e4m3xe5m2-4096", 4096, 4096, 4096, "fp8_mixed"),
    ("fp8-mixed-e4m3xe5m2-8192", 8192, 8192, 8192, "fp8_mixed"),
]


def make_case(kind, m, n, k):
    """(operands, kernel_fn, ts_fn, baseline_fn, baseline_name, reference, flops)."""
    flops = 2.0 * m * n * k
    if kind in ("bf16", "bf16_nt", "bf16_tn"):
        ta, tb = kind == "bf16_tn", kind == "bf16_nt"
        a = rand(1, (k, m) if ta else (m, k), BF16)
        b = rand(2, (n, k) if tb else (k, n), BF16)

        def base(a, b):
            return jnp.dot(a.T if ta else a, b.T if tb else b)

        spec = MatmulSpec(BF16, F32, transpose_a=ta, transpose_b=tb)

        def kern(a, b):
            return mg.matmul(spec, a, b)

        if ta or tb:
            # The backward products: ts_matmul with transpose flags, as the adjoints bind it
            # (``ts.op.matmul(a, b.T)`` on a user-transposed array is a copy plus a product).

            def tsf(a, b):
                return matmul_op.bind(a, b, spec=spec)
        else:

            def tsf(a, b):
                return ts.op.matmul(a, b)

        return (a, b), kern, tsf, base, "xla:jnp.dot", ref_dot(a, b, ta, tb), flops
    if kind == "bias_gelu":
        a, b, bias = rand(1, (m, k), BF16), rand(2, (k, n), BF16), rand(3, (n,), BF16)

        def base(a, b, bias):
            return gelu_tanh(jnp.dot(a, b) + bias)

        def kern(a, b, bias):
            spec = MatmulSpec(BF16, F32, activation="gelu_tanh", has_bias=True)
            return mg.matmul(spec, a, b, bias)

        def tsf(a, b, bias):
            return ts.op.linear(a, b, bias, activation="gelu_tanh")

        ref = gelu_tanh(ref_dot(a, b) + bias.astype(F32))
        return (a, b, bias), kern, tsf, base, "xla:gelu(dot+bias)", ref, flops
    if kind in ("fp8", "fp8_vs_bf16", "fp8_mixed"):
        db = E5M2 if kind == "fp8_mixed" else E4M3
        a, b = rand(1, (m, k), E4M3), rand(2, (k, n), db)

        def kern(a, b):
            return mg.matmul(MatmulSpec(F32, F32), a, b)

        def tsf(a, b):
            return ts.op.matmul(a, b)

        ref = ref_dot(a, b)
        if kind == "fp8_vs_bf16":
            ab, bb = a.astype(BF16), b.astype(BF16)

            def base(a, b):  # bf16 cuBLAS on the same values (operands prepared outside)
                return jnp.dot(ab, bb)

            return (a, b), kern, tsf, base, "xla:jnp.dot bf16", ref, flops

        def base(a, b):
            return jnp.dot(a, b, preferred_element_type=F32)

        return (a, b), kern, tsf, base, "xla:jnp.dot fp8", ref, flops
    raise ValueError(kind)


def record(case, impl, baseline, ms, baseline_ms, flops, err):
    tflops = flops / (ms * 1e-3) / 1e12
    return _common.record(
        "matmul", case, impl, baseline, ms, baseline_ms, tflops=tflops, rel_err=err
    )


def run_cases(selected):
    recs = []
    for case, m, n, k, kind in CASES:
        if selected and not any(x in case for x in selected):
            continue
        try:
            ops, kern, tsf, base, bname, ref, flops = make_case(kind, m, n, k)
            fns = {bname: jax.jit(base), "mosaic_gpu": jax.jit(kern)}
            if tsf is not None:
                fns["ts.op.matmul[auto]"] = jax.jit(tsf)
            errs = checked(fns, ops, ref, case)
            ms = time_interleaved(fns, ops, target_ms=40)
            base_ms = ms[bname]
            print(f"   {case} {telemetry()}", flush=True)
            for name in fns:
                r = record(case, name, bname, ms[name], base_ms, flops, errs[name])
                recs.append(r)
                print(
                    f"   {name:22s} {r['ms']:.4f} ms  {r['tflops']:7.1f} TF/s  "
                    f"x{r['ratio']:.3f}  err {r['rel_err']:.2e}",
                    flush=True,
                )
            del ops, ref
        except Exception as e:
            traceback.print_exc()
            print(f"!! case {case}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return recs


SWEEP = [
    ("bf16", (4096, 4096, 4096)),
    ("bf16", (8192, 8192, 8192)),
    ("bf16", (8192, 8192, 1024)),
    ("fp8", (8192, 8192, 8192)),
]
SWEEP_SKIP = (
    "bf16_128x128x64_s6",
    "bf16_64x256x64_s6",
    "bf16_64x128x128_s4",
    "bf16_128x256x64_s4_w16",
    "fp8_128x256x128_s4_dr1",
)


def run_sweep():
    recs = []
    for dt_name, (m, n, k) in SWEEP:
        dt = BF16 if dt_name == "bf16" else E4M3
        odt = BF16 if dt_name == "bf16" else F32
        a, b = rand(11, (m, k), dt), rand(12, (k, n), dt)
        fns = {"xla": jax.jit(lambda a, b, odt=odt: jnp.dot(a, b, preferred_element_type=odt))}
        for cname, cfg in mc.candidates_for(dt, dt).items():
            if cname not in SWEEP_SKIP:
                fns[cname] = jax.jit(
                    lambda a, b, cfg=cfg, odt=odt: mg.matmul(MatmulSpec(odt, F32), a, b, config=cfg)
                )
        ref = ref_dot(a, b)
        errs = checked(fns, (a, b), ref, "sweep")
        ms = time_interleaved(fns, (a, b), repeats=3, target_ms=30)
        flops = 2.0 * m * n * k
        case = f"sweep-{dt_name}-{m}x{n}x{k}"
        print(f"== {case} {telemetry()}", flush=True)
        for name in fns:
            r = record(
                case,
                name if name == "xla" else f"mosaic_gpu[{name}]",
                "xla",
                ms[name],
                ms["xla"],
                flops,
                errs[name],
            )
            r["suite"] = "matmul-sweep"
            recs.append(r)
            print(
                f"   {name:28s} {ms[name]:.4f} ms {r['tflops']:7.1f} TF/s x{r['ratio']:.3f} "
                f"err {errs[name]:.1e}",
                flush=True,
            )
        del a, b, ref
    return recs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="time every candidate config first")
    p.add_argument("--only", nargs="*", default=[], help="substrings of case names to run")
    p.add_argument(
        "--json", default=None, help="output path (default $OUT/ or benchmarks/results/)"
    )
    p.add_argument("--no-cases", action="store_true")
    args = p.parse_args()
    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {dev.device_kind} ({getattr(dev, 'core_count', '?')} SMs)",
        flush=True,
    )
    sweep = run_sweep() if args.sweep else []
    recs = [] if args.no_cases else run_cases(args.only)
    path = Path(args.json or results_path(f"matmul-{device_name(family=True)}.json"))
    write_records(path, recs)
    if sweep:
        write_records(path.with_name(path.stem + "-sweep.json"), sweep)
    print(f"\n{'case':29s} {'impl':22s} {'ms':>8s} {'TF/s':>7s}  vs-baseline  rel_err")
    for r in recs:
        print(
            f"{r['case']:29s} {r['impl']:22s} {r['ms']:8.4f} {r['tflops']:7.1f}  "
            f"x{r['ratio']:.3f}      {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
