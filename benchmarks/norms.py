"""Norm benchmark: ``ts.softmax`` / ``ts.log_softmax`` / ``ts.rmsnorm`` / ``ts.layernorm``
(row-wise Pallas kernels) vs the same formulas written in plain jax.numpy (XLA).

Runs on the GPU machine, one process, every implementation checked against an f32
reference before it is timed::

    PYTHONUNBUFFERED=1 python3 benchmarks/norms.py [--sweep] [--json PATH]
    python3 benchmarks/norms.py --shapes 16384x1024 1024x16384 --modes fwd fwdbwd --json P

Cases ``norm-<op>-fwd`` (the output), ``norm-<op>-fwdbwd`` (output and every gradient
through ``jax.vjp`` with a given cotangent) and ``norm-<op>-bwd`` (the gradients alone: each
implementation's pullback from the residuals its own forward saved, run beforehand, as a
training step's backward runs; :func:`pullback`), bf16 with f32 parameters. Implementations:
the XLA baseline (``jax.nn.softmax`` / ``jax.nn.log_softmax`` / the norm written as users
write it, statistics in f32), ``ts[auto]`` (what a user gets: the kernels where ``prefer``
takes them), ``ts[xla]`` (the operators' XLA references) and ``ts[pallas]`` (the kernels
wherever ``supports`` takes the case, preferred or not). ``--sweep`` first times the
kernels' row configs at the first shape, and the backward's default config with and
without prefetch at every shape (``<json stem>-sweep.json``). Records ``{suite, case,
device, jax, impl, baseline, ms, baseline_ms, ratio = baseline_ms / ms, gbps, rel_err}``;
``gbps`` counts the bytes a single pass over each array moves (the bandwidth bound),
``rel_err`` is the worst ``||out − ref|| / ||ref||`` over the outputs against the f32
reference.

``norm-rmsnorm_matmul-{fwd,fwdbwd}`` (``--only rmsnorm_matmul``): ``ts.rmsnorm_matmul`` vs
XLA's norm-then-dot (the jnp rmsnorm above, then ``jnp.dot``) at ``M×K @ K×N`` transformer
shapes, bf16: ``ts[auto]``, ``ts[pallas]`` (the fused Mosaic GPU kernel wherever it
supports the case) and ``xla:dot-only`` (``jnp.dot`` of the same x and b without the norm:
the floor any fusion can reach, so ``ratio`` of that row is the most a fused prologue can
gain). ``gbps`` there is TFLOP/s of the product (``2·M·N·K``, plus twice that for the
backward).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tessera_jax as ts  # noqa: E402
from benchmarks import _common  # noqa: E402
from benchmarks._common import (  # noqa: E402
    device_name,
    results_path,
    time_interleaved,
    write_records,
)
from benchmarks._common import normal as rand  # noqa: E402
from tessera_jax.pallas_kernels import norms_gpu  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
EPS = 1e-5
OPS = ("softmax", "log_softmax", "rmsnorm", "layernorm")
SHAPES = ((32768, 4096), (8192, 2048))
# Arrays of x's size each mode moves once: fwd reads x, writes y; bwd reads x (softmax: y)
# and the cotangent, writes dx; fwdbwd both.
PASSES = {"fwd": 2, "bwd": 3, "fwdbwd": 5}


def _row(p, x):
    return p.reshape((1,) * (x.ndim - 1) + p.shape)


def xla_op(op, x, *params):
    """The operator as users write it in jax.numpy (statistics in f32, one rounding)."""
    if op == "softmax":
        return jax.nn.softmax(x.astype(F32), axis=-1).astype(x.dtype)
    if op == "log_softmax":
        return jax.nn.log_softmax(x.astype(F32), axis=-1).astype(x.dtype)
    xf = x.astype(F32)
    if op == "rmsnorm":
        (w,) = params
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS) * _row(w, x)
        return y.astype(x.dtype)
    w, b = params
    c = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + EPS) * _row(w, x)
    return (y + _row(b, x)).astype(x.dtype)


def ts_op(op, x, *params):
    if op == "softmax":
        return ts.softmax(x)
    if op == "log_softmax":
        return ts.log_softmax(x)
    if op == "rmsnorm":
        return ts.rmsnorm(x, *params, eps=EPS)
    return ts.layernorm(x, *params, eps=EPS)


def _fwd(f, x, *params_ct):
    return f(x, *params_ct[:-1])


def _fwdbwd(f, x, *params_ct):
    *params, ct = params_ct
    y, pull = jax.vjp(f, x, *params)
    return y, pull(ct)


def _bwd(f, x, *params_ct):
    *params, ct = params_ct
    return jax.vjp(f, x, *params)[1](ct)


MODES = {"fwd": _fwd, "fwdbwd": _fwdbwd, "bwd": _bwd}


def pullback(f, args, mode="auto"):
    """``fn(*args) -> gradients``: ``f``'s pullback at ``args``'s primals applied to their
    cotangent (the last of ``args``), with the residuals from a forward run once, here. The
    backward as a training step runs it after the forward, which ``_bwd`` (``jax.vjp``
    under one jit) does not time: there XLA recomputes the residuals it needs from ``x``
    inside its backward fusion, where the operators' kernels would run their forward too.
    ``mode``: the kernel mode both programs are compiled in."""
    *primals, ct = args
    with ts.kernel_mode(mode):
        _, pull = jax.jit(lambda *p: jax.vjp(f, *p))(*primals)
    apply = in_mode(mode, lambda pull, ct: pull(ct), (pull, ct))
    return lambda *a: apply(pull, a[-1])


def in_mode(mode, f, args):
    """``f`` compiled for ``args`` under kernel mode ``mode``. The executable is called
    outside the mode: a jitted call inside ``ts.kernel_mode`` pays a host-side dispatch
    cost that hides a small kernel's time."""
    with ts.kernel_mode(mode):
        return jax.jit(f).lower(*args).compile()


def chosen(f, args):
    """The implementation of every ts primitive in ``f``'s program, as the lowering picks."""
    ops = {op.prim: op for op in ts.op.OPERATORS.values()}
    found = {}
    for eqn in jax.make_jaxpr(f)(*args).jaxpr.eqns:
        op = ops.get(eqn.primitive)
        if op is not None:
            found[op.name] = op.select("cuda", [v.aval for v in eqn.invars], eqn.params)[0]
    return found


@jax.jit
def _rel(o, r):
    r = r.astype(F32)
    return jnp.linalg.norm((o.astype(F32) - r).ravel()) / jnp.linalg.norm(r.ravel())


def rel_err(out, ref) -> float:
    """The worst relative error over the outputs (on the device: the arrays are large)."""
    return max(float(_rel(o, r)) for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))


def record(case, impl, baseline, ms, baseline_ms, nbytes, err):
    gbps = nbytes / (ms * 1e-3) / 1e9
    return _common.record("norms", case, impl, baseline, ms, baseline_ms, gbps=gbps, rel_err=err)


def operands(op, shape):
    x = rand(1, shape, BF16, scale=2.0)
    ct = rand(2, shape, BF16)
    d = shape[-1]
    params = []
    if op in ("rmsnorm", "layernorm"):
        params.append(rand(3, (d,), F32) + 1.0)
    if op == "layernorm":
        params.append(rand(4, (d,), F32))
    return (x, *params, ct)


def run_cases(selected, shapes=SHAPES, modes=tuple(MODES)):
    recs = []
    for shape in shapes:
        for op in OPS:
            args = operands(op, shape)
            f32_args = tuple(a.astype(F32) for a in args)
            for mode in modes:
                wrap = MODES[mode]
                case = f"norm-{op}-{mode}"
                if selected and not any(s in f"{case}-{shape}" for s in selected):
                    continue
                try:
                    base = functools.partial(wrap, functools.partial(xla_op, op))
                    ours = functools.partial(wrap, functools.partial(ts_op, op))
                    bname = "xla:jnp"
                    if mode == "bwd":
                        fns = {bname: pullback(functools.partial(xla_op, op), args)}
                        for n, m in (
                            ("ts[auto]", "auto"),
                            ("ts[xla]", "xla"),
                            ("ts[pallas]", "pallas"),
                        ):
                            fns[n] = pullback(functools.partial(ts_op, op), args, m)
                    else:
                        fns = {bname: jax.jit(base), "ts[auto]": jax.jit(ours)}
                        fns["ts[xla]"] = in_mode("xla", ours, args)
                        fns["ts[pallas]"] = in_mode("pallas", ours, args)
                    picked = chosen(ours, args)
                    ref = jax.jit(base)(*f32_args)
                    errs = {n: rel_err(f(*args), ref) for n, f in fns.items()}
                    ms = time_interleaved(fns, args, repeats=5, target_ms=25, warmup_ms=100)
                    nbytes = PASSES[mode] * args[0].size * args[0].dtype.itemsize
                    label = f"{case} {shape[0]}x{shape[1]}"
                    print(f"== {label}  ts[auto] runs {picked}", flush=True)
                    for n in fns:
                        r = record(case, n, bname, ms[n], ms[bname], nbytes, errs[n])
                        r["shape"] = list(shape)
                        r["dtype"] = "bfloat16"
                        if n == "ts[auto]":
                            r["kernels"] = picked
                        recs.append(r)
                        print(
                            f"   {n:10s} {ms[n]:.4f} ms {r['gbps']:7.0f} GB/s "
                            f"x{r['ratio']:.3f} err {errs[n]:.1e}",
                            flush=True,
                        )
                except Exception as e:
                    traceback.print_exc()
                    print(f"!! {case} {shape}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return recs


# Row configs timed by --sweep at the first shape: (block_rows, num_warps) forward; backward
# adds the number of programs the rows are spread over, each with and without prefetch.
FWD_SWEEP = [(1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)]
BWD_SWEEP = [(1, 8, 264), (1, 8, 528), (1, 8, 1056), (1, 16, 528), (2, 16, 528), (1, 4, 1056)]


def _specs(op, d):
    """The forward's and the backward's bind parameters of ``op`` at rows of ``d``."""
    kw = {"eps": EPS, "has_weight": True} if op != "softmax" else {"axis": 1}
    if op == "layernorm":
        kw["has_bias"] = True
    bkw = dict(kw, weight_grad_shape=(d,))
    bkw.pop("has_bias", None)
    if op == "layernorm":
        bkw["bias_grad_shape"] = (d,)
    return tuple(sorted(kw.items())), tuple(sorted(bkw.items()))


def _bwd_fns(op, bspec, params, configs):
    """XLA's backward and the kernel's at each named config, all called as f(x, w, ct)."""
    xla_bwd = jax.jit(functools.partial(_bwd, functools.partial(xla_op, op)))
    fns = {"xla:jnp": lambda x, w, ct, f=xla_bwd, p=params: f(x, *p, ct)}
    bwd = getattr(norms_gpu, f"{op}_bwd")
    for name, cfg in configs.items():
        fns[name] = jax.jit(functools.partial(bwd, bspec, config=cfg))
    return fns


def _bwd_name(cfg, default):
    pf = "+prefetch" if cfg.prefetch else ""
    star = "*" if cfg == default else ""
    return f"bwd[{cfg.block_rows}x{cfg.num_warps}x{cfg.row_steps}]{pf}{star}"


def run_sweep(shapes=SHAPES[:1]):
    """The row-config grid at the first shape; at every shape, the default backward config
    with and without prefetch."""
    recs = []
    for i, shape in enumerate(shapes):
        rows, d = shape
        x, w, b, ct = operands("layernorm", shape)
        for op in ("rmsnorm", "layernorm", "softmax"):
            params = (w, b) if op == "layernorm" else (w,) if op == "rmsnorm" else ()
            spec, bspec = _specs(op, d)
            if i == 0:
                fwd = getattr(norms_gpu, op)
                fns = {"xla:jnp": jax.jit(lambda x, *p, op=op: xla_op(op, x, *p))}
                default = norms_gpu.RowConfig.default(rows, d, backward=False, params=len(params))
                for br, nw in FWD_SWEEP:
                    cfg = norms_gpu.RowConfig(br, nw)
                    name = f"fwd[{br}x{nw}]" + ("*" if cfg == default else "")
                    fns[name] = jax.jit(functools.partial(fwd, spec, config=cfg))
                recs += _time_sweep(f"sweep-{op}-fwd", shape, fns, (x, *params), 2 * x.size * 2)
            if op == "softmax":
                continue
            default = norms_gpu.RowConfig.default(rows, d, backward=True)
            configs = [default, dataclasses.replace(default, prefetch=not default.prefetch)]
            if i == 0:
                for (br, nw, programs), pf in itertools.product(BWD_SWEEP, (False, True)):
                    steps = -(-rows // (br * programs))
                    configs.append(norms_gpu.RowConfig(br, nw, steps, prefetch=pf))
            named = {_bwd_name(c, default): c for c in configs}
            fns = _bwd_fns(op, bspec, params, named)
            recs += _time_sweep(f"sweep-{op}-bwd", shape, fns, (x, w, ct), 3 * x.size * 2)
    return recs


def _time_sweep(case, shape, fns, args, nbytes):
    ms = time_interleaved(fns, args, repeats=3, target_ms=20, warmup_ms=60)
    print(f"== {case} {shape[0]}x{shape[1]}", flush=True)
    out = []
    for n, t in ms.items():
        r = record(case, n, "xla:jnp", t, ms["xla:jnp"], nbytes, float("nan"))
        r["suite"] = "norms-sweep"
        r["shape"] = list(shape)
        out.append(r)
        print(f"   {n:18s} {t:.4f} ms {r['gbps']:7.0f} GB/s x{r['ratio']:.3f}", flush=True)
    return out


# --- rmsnorm fused into the following matmul ---------------------------------------------

MM_SHAPES = ((16384, 4096, 1024), (16384, 4096, 4096), (16384, 4096, 12288))
MM_SHAPES += ((8192, 4096, 1024), (4096, 4096, 1024))


def xla_rmsnorm_matmul(x, w, b):
    """XLA's norm-then-dot: the rmsnorm as users write it, then ``jnp.dot``."""
    return jnp.dot(xla_op("rmsnorm", x, w), b)


def ts_rmsnorm_matmul(x, w, b):
    return ts.rmsnorm_matmul(x, w, b, eps=EPS)


def dot_only(x, w, b):
    del w
    return jnp.dot(x, b)


def run_rmsnorm_matmul(selected):
    recs = []
    for m, k, n in MM_SHAPES:
        x = rand(1, (m, k), BF16, scale=2.0)
        w = rand(3, (k,), F32) + 1.0
        b = rand(5, (k, n), BF16, scale=k**-0.5)
        ct = rand(2, (m, n), BF16)
        args = (x, w, b, ct)
        f32_args = tuple(a.astype(F32) for a in args)
        for mode in ("fwd", "fwdbwd"):
            case = f"norm-rmsnorm_matmul-{mode}"
            if selected and not any(sel in f"{case}-{(m, k, n)}" for sel in selected):
                continue
            try:
                wrap = MODES[mode]
                base = functools.partial(wrap, xla_rmsnorm_matmul)
                ours = functools.partial(wrap, ts_rmsnorm_matmul)
                bname = "xla:jnp"
                fns = {bname: jax.jit(base), "ts[auto]": jax.jit(ours)}
                fns["ts[pallas]"] = in_mode("pallas", ours, args)
                fns["xla:dot-only"] = jax.jit(functools.partial(wrap, dot_only))
                picked = {
                    "ts[auto]": chosen(ours, args),
                    "ts[pallas]": _chosen_in("pallas", ours, args),
                }
                ref = jax.jit(base)(*f32_args)
                errs = {
                    name: rel_err(f(*args), ref)
                    for name, f in fns.items()
                    if name != "xla:dot-only"
                }
                ms = time_interleaved(fns, args, repeats=5, target_ms=40, warmup_ms=100)
                flops = 2 * m * n * k * (3 if mode == "fwdbwd" else 1)
                label = f"{case} {m}x{k}x{n}"
                print(f"== {label}  runs {picked}", flush=True)
                for name in fns:
                    r = record(
                        case, name, bname, ms[name], ms[bname], 0, errs.get(name, float("nan"))
                    )
                    r["gbps"] = flops / (ms[name] * 1e-3) / 1e12  # TFLOP/s here
                    r["shape"] = [m, k, n]
                    r["dtype"] = "bfloat16"
                    if name in picked:
                        r["kernels"] = picked[name]
                    recs.append(r)
                    print(
                        f"   {name:12s} {ms[name]:.4f} ms {r['gbps']:6.1f} TFLOP/s "
                        f"x{r['ratio']:.3f} err {r['rel_err']:.1e}",
                        flush=True,
                    )
            except Exception as e:
                traceback.print_exc()
                print(f"!! {case} {(m, k, n)}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return recs


def _chosen_in(mode, f, args):
    with ts.kernel_mode(mode):
        return chosen(f, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="time the kernels' row configs first")
    p.add_argument("--only", nargs="*", default=[], help="substrings of case names to run")
    p.add_argument("--json", default=None, help="output path (default $OUT/ or results/)")
    p.add_argument(
        "--shapes", nargs="*", default=[], help="ROWSxD shapes instead of the default two"
    )
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    args = p.parse_args()
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes] or SHAPES
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind}", flush=True)
    sweep = []
    if args.sweep:
        try:
            sweep = run_sweep(shapes)
        except Exception:
            traceback.print_exc()
    norm_sel = [s for s in args.only if "rmsnorm_matmul" not in s]
    mm_sel = [s for s in args.only if "rmsnorm_matmul" in s]
    recs = run_cases(norm_sel, shapes, args.modes) if norm_sel or not args.only else []
    if mm_sel or not (args.only or args.shapes):
        recs += run_rmsnorm_matmul([s for s in mm_sel if s != "rmsnorm_matmul"])
    path = Path(args.json or results_path(f"norms-{device_name(family=True)}.json"))
    write_records(path, recs)
    if sweep:
        write_records(path.with_name(path.stem + "-sweep.json"), sweep)
    print(f"\n{'case':24s} {'shape':>11s} {'impl':9s} {'ms':>8s} {'GB/s':>6s}  ratio  rel_err")
    for r in recs:
        shape = "x".join(map(str, r["shape"]))
        print(
            f"{r['case']:24s} {shape:>11s} {r['impl']:9s} {r['ms']:8.4f} {r['gbps']:6.0f}  "
            f"x{r['ratio']:.3f} {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
