"""Probe: the rmsnorm and layernorm backward kernels at rows of 16384, where rmsnorm's
trails XLA's backward compiled with its forward (``jax.vjp`` in one program: XLA recomputes
the statistics from x in its backward fusion), against that and the default config.

At rows of 16384 the default backward config runs one row per step on 16 warps (32
elements a thread in each tile), one program per multiprocessor, without prefetching the
next row. Two sets of variants, each timed interleaved in one process on one GPU in both
call orders against XLA's backward (``benchmarks/norms.py``'s ``xla_op`` through
``jax.vjp``), with dx's bits compared with the default's (dx does not depend on how many
row blocks a program walks, only on the tile):

- ``--set configs``: the configs (prefetch on/off, 32 warps, two programs per
  multiprocessor on 16 or 8 warps) and Triton's ``num_stages`` 2 and 3 (software
  pipelining of the loop's loads; the kernels compile with 1);
- ``--set kernel``: the kernel body with the weight reloaded each step (``-wr``: fewer
  registers held across the loop) and the overflow statistics behind a branch (``-br``:
  ``_normalise``'s ``branch``), at the default, prefetch and 32-warp configs.

bf16 rows of ``3 + 2·N(0, 1)`` and an ``N(0, 1)`` cotangent, f32 weight and bias.

    python3 benchmarks/archive/norms_wide_bwd_probe.py --set configs|kernel [ROWSxD ...]
"""

import functools
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks._common import time_interleaved
from benchmarks.norms import _bwd, _specs, xla_op
from tessera_jax.pallas_kernels import device
from tessera_jax.pallas_kernels import norms_gpu as m

# The knobs a variant sets while it is traced.
KNOBS = {"stages": 1, "wreload": False, "branch": False}


def _call(kernel, p, out_shape, operands, interpret, name):
    params = plgpu.CompilerParams(num_warps=p.config.num_warps, num_stages=KNOBS["stages"])
    with device.int32_tracing():
        return pl.pallas_call(
            kernel,
            grid=(p.programs,),
            out_shape=out_shape,
            compiler_params=params,
            interpret=interpret,
            name=name,
        )(*operands)


def _bwd_kernel(*refs, p, op, eps, has_weight, want_dw, want_db):
    """``norms_gpu._norm_bwd_kernel`` with the ``wreload`` and ``branch`` knobs."""
    refs = list(refs)
    x_ref = refs.pop(0)
    w_ref = refs.pop(0) if has_weight else None
    g_ref, dx_ref = refs.pop(0), refs.pop(0)
    dw_ref = refs.pop(0) if want_dw else None
    db_ref = refs.pop(0) if want_db else None
    cols = jnp.arange(p.d_pad)
    wreload, branch = KNOBS["wreload"], KNOBS["branch"]
    w_once = m._load_vec(w_ref, p, cols) if w_ref is not None and not wreload else None

    def block(_, loaded, acc):
        dw, db = acc
        rows, mask, (x, ct) = loaded
        xhat, r = m._stats(p, x, mask, op, eps, branch=branch)
        w = m._load_vec(w_ref, p, cols) if w_ref is not None and wreload else w_once
        g = ct if w is None else ct * w
        u = g - xhat * m._mean(xhat * g, p.d)
        if op == "layernorm":
            u = jnp.where(mask, u - m._mean(u, p.d), 0.0)
        m._store(dx_ref, rows, cols, mask, r * u)
        dw = dw + jnp.sum(ct * xhat, axis=0, keepdims=True)
        db = db + jnp.sum(ct, axis=0, keepdims=True)
        return dw, db

    zeros = jnp.zeros((1, p.d_pad), jnp.float32)
    load = m._loader(p, (x_ref, 0.0), (g_ref, 0.0))
    dw, db = m._walk(p, load, block, (zeros, zeros))
    prow = jnp.full((1,), pl.program_id(0), jnp.int32)
    cmask = cols[None, :] < p.d
    for ref, val in ((dw_ref, dw), (db_ref, db)):
        if ref is not None:
            plgpu.store(ref.at[prow[:, None], cols[None, :]], val, mask=cmask)


m._call = _call
m._norm_bwd_kernel = _bwd_kernel


def knobs(f, **kw):
    """``f`` traced with ``KNOBS`` updated by ``kw``."""

    def traced(*a):
        old = dict(KNOBS)
        KNOBS.update(kw)
        try:
            return f(*a)
        finally:
            KNOBS.update(old)

    return traced


def variants(which, rows, dflt):
    """name -> (RowConfig or None for the default, knobs)."""

    def walk(warps, per_sm, prefetch=False):
        steps = max(1, -(-rows // (per_sm * m._SMS)))
        return m.RowConfig(1, warps, steps, prefetch=prefetch)

    flip = m.RowConfig(dflt.block_rows, dflt.num_warps, dflt.row_steps, not dflt.prefetch)
    if which == "configs":
        out = {"default": (None, {}), "pf": (flip, {})}
        out |= {"w32": (walk(32, 1), {}), "w32p": (walk(32, 1, True), {})}
        out |= {"w8x2": (walk(8, 2), {}), "p264": (walk(16, 2), {})}
        out |= {"p264p": (walk(16, 2, True), {})}
        for st in (2, 3):
            out[f"st{st}"] = (None, {"stages": st})
            out[f"w32st{st}"] = (walk(32, 1), {"stages": st})
        return out
    out = {}
    bases = {"default": None, "pf": flip, "w32": walk(32, 1), "w32p": walk(32, 1, True)}
    for name, cfg in bases.items():
        for wr in (False, True):
            for br in (False, True):
                label = f"{name}{'-wr' if wr else ''}{'-br' if br else ''}"
                out[label] = (cfg, {"wreload": wr, "branch": br})
    return out


def main(which, shapes, ops=("rmsnorm", "layernorm")):
    for rows, d in shapes:
        ks = jax.random.split(jax.random.key(1), 4)
        x = (3 + 2 * jax.random.normal(ks[0], (rows, d), jnp.float32)).astype(jnp.bfloat16)
        ct = jax.random.normal(ks[3], (rows, d), jnp.float32).astype(jnp.bfloat16)
        w = 1 + 0.1 * jax.random.normal(ks[1], (d,), jnp.float32)
        b = 0.1 * jax.random.normal(ks[2], (d,), jnp.float32)
        dflt = m.RowConfig.default(rows, d, backward=True)
        for op in ops:
            params = (w, b) if op == "layernorm" else (w,)
            bwd = functools.partial(getattr(m, f"{op}_bwd"), _specs(op, d)[1])
            xla_bwd = jax.jit(functools.partial(_bwd, functools.partial(xla_op, op)))
            fns = {"xla": lambda x, w, ct, f=xla_bwd, p=params: f(x, *p, ct)}
            for name, (cfg, kw) in variants(which, rows, dflt).items():
                fns[name] = jax.jit(knobs(functools.partial(bwd, config=cfg), **kw))
            args = (x, w, ct)
            dx = {n: f(*args)[0] for n, f in fns.items() if n != "xla"}
            t = time_interleaved(fns, args, repeats=5)
            t2 = time_interleaved(dict(reversed(list(fns.items()))), args, repeats=5)
            gb = 3 * x.size * x.dtype.itemsize / 1e9
            print(f"{rows}x{d} {op} bwd default={dflt}", flush=True)
            for n in fns:
                us = min(t[n], t2[n]) * 1e3
                same = bool(jnp.array_equal(dx[n], dx["default"])) if n in dx else None
                print(
                    f"   {n:12s} {us:7.1f} us {gb / (us * 1e-6):6.0f} GB/s xla/it "
                    f"{t['xla'] / t[n]:.3f}|{t2['xla'] / t2[n]:.3f} dx-same={same}",
                    flush=True,
                )


if __name__ == "__main__":
    argv = sys.argv[1:]
    which = argv[argv.index("--set") + 1] if "--set" in argv else "configs"
    picked = [tuple(map(int, a.split("x"))) for a in argv if "x" in a and a[0].isdigit()]
    main(which, picked or [(4096, 16384), (2048, 16384), (16384, 8192)])
