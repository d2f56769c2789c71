"""Probe: why the norm operators' XLA references (``ts[xla]``, what ``auto`` runs where the
kernels are not preferred: small arrays, rows beyond norms_gpu.MAX_ROW such as a vocabulary's
softmax, no Pallas Triton) trail the same math written in jax.numpy, and which forms of
the references close the gap with the same results. Per shape and operator: the jnp
baseline, the reference as the operator lowers it, and candidate forms, each timed in one
process (benchmarks/_common.time_interleaved) with the kernels its compiled program launches
(fusion kinds from the optimized HLO) and whether its output has the reference's bits.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/norm_references_probe.py [op ...]

With operators named, only their forward cases run (the ``chain`` rmsnorm forms were added
after the logged run).
"""

import re
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import norms as nb
from benchmarks._common import time_interleaved
from tessera_jax.primitives import norms as pn

F32, EPS = jnp.float32, nb.EPS
TINY = np.float32(np.finfo(np.float32).tiny)
LOWEST = np.float32(np.finfo(np.float32).min)


def kernels(compiled) -> str:
    """The entry computation's launches: fusion kinds and custom calls, in order."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    kinds = re.findall(r"(?:fusion\(.*?kind=(k\w+)|(custom-call)\()", entry)
    names = [k or c for k, c in kinds]
    triton = "triton" in text.lower()
    return f"{len(names)}:{','.join(names)}{' +triton' if triton else ''}"


# --- softmax forms -------------------------------------------------------------------------
def sm_init(x):
    """The maximum from the lowest finite value (an all -inf row's is then finite) and the
    sum floored at the smallest normal (an all -inf row's zero sum): no select on either."""
    xc = x.astype(F32)
    m = jnp.max(xc, axis=-1, keepdims=True, initial=LOWEST)
    e = jnp.exp(xc - m)
    s = jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), TINY)
    return (e / s).astype(x.dtype)


def sm_init_only_m(x):
    xc = x.astype(F32)
    m = jnp.max(xc, axis=-1, keepdims=True, initial=LOWEST)
    e = jnp.exp(xc - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    return (e / jnp.where(s == 0, jnp.ones_like(s), s)).astype(x.dtype)


def lsm_init(x):
    xc = x.astype(F32)
    m = jnp.max(xc, axis=-1, keepdims=True, initial=LOWEST)
    sh = xc - m
    s = jnp.maximum(jnp.sum(jnp.exp(sh), axis=-1, keepdims=True), TINY)
    return (sh - jnp.log(s)).astype(x.dtype)


# --- rmsnorm forms -------------------------------------------------------------------------
def _variadic_ms(v):
    """``(mean(v²), mean((v·c)²))`` from one two-operand reduction."""
    c = np.float32(pn._OVERFLOW_SCALE)
    vc = v * c
    add2 = lambda a, b: (a[0] + b[0], a[1] + b[1])
    z = np.float32(0)
    s, sc = jax.lax.reduce((v * v, vc * vc), (z, z), add2, (v.ndim - 1,))
    d = np.float32(v.shape[-1])
    return s[..., None] / d, sc[..., None] / d


def rms_variadic(x, w):
    v = x.astype(F32)
    c = np.float32(pn._OVERFLOW_SCALE)
    s, sc = _variadic_ms(v)
    s, sc = s + EPS, sc + EPS * c * c
    big = jnp.isinf(s)
    sc = jnp.where(jnp.isinf(sc), jnp.full_like(sc, jnp.nan), sc)
    rs = jax.lax.rsqrt(jnp.where(big, sc, jnp.ones_like(s)))
    r = jax.lax.rsqrt(jnp.where(big, jnp.ones_like(s), s))
    y = jnp.where(big, (v * rs) * c, v * r)
    return (y * nb._row(w, x)).astype(x.dtype)


def rms_rowscale(x, w):
    v = x.astype(F32)
    y, _ = pn._normalise_row_scale(v, eps=EPS, rsqrt=jax.lax.rsqrt)
    return (y * nb._row(w, x)).astype(x.dtype)


def _rms_chain(x, w, *, eps_inside: bool):
    """The row-scale form as two normalisation diamonds, the shape XLA's softmax rewriter
    fuses into one Triton kernel: the first mean square picks each row's scale cs (1, or
    c where it overflowed), the output is ``(v·cs)·rsqrt(mean((v·cs)²) + eps·cs²)``
    (``(v·c)·rs`` where the reference computes ``(v·rs)·c``). ``eps_inside`` adds
    ``eps·cs²`` to every square before the sum (no op between two row statistics; other
    bits)."""
    v = x.astype(F32)
    c = np.float32(pn._OVERFLOW_SCALE)
    cs = jnp.where(jnp.isinf(jnp.mean(v * v, -1, keepdims=True) + EPS), c, np.float32(1))
    vc = v * cs
    if eps_inside:
        sc = jnp.mean(vc * vc + EPS * cs * cs, -1, keepdims=True)
    else:
        sc = jnp.mean(vc * vc, -1, keepdims=True) + EPS * cs * cs
    sc = jnp.where(jnp.isinf(sc), jnp.full_like(sc, jnp.nan), sc)
    return (vc * jax.lax.rsqrt(sc) * nb._row(w, x)).astype(x.dtype)


def rms_chain(x, w):
    return _rms_chain(x, w, eps_inside=False)


def rms_chain_in(x, w):
    return _rms_chain(x, w, eps_inside=True)


def rms_fast(x, w):
    """One mean square, the output from it: what jnp does (no overflow path; a bound)."""
    v = x.astype(F32)
    return (v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + EPS) * nb._row(w, x)).astype(
        x.dtype
    )


def ts_fwd(op):
    return lambda x, *p: nb.ts_op(op, x, *p)


FORMS = {
    "softmax": {"init": sm_init, "init_m": sm_init_only_m},
    "log_softmax": {"init": lsm_init},
    "rmsnorm": {
        "variadic": rms_variadic,
        "rowscale": rms_rowscale,
        "chain": rms_chain,
        "chain_in": rms_chain_in,
        "fast": rms_fast,
    },
    "layernorm": {},
}
SHAPES = ((512, 1024), (4096, 1024), (16384, 1024), (1024, 4096), (2048, 32000), (256, 128256))


def fwd_case(op, shape):
    x, *params, _ = nb.operands(op, shape)
    args = (x, *params)
    fns = {"jnp": jax.jit(lambda *a: nb.xla_op(op, *a)).lower(*args).compile()}
    fns["ts[xla]"] = nb.in_mode("xla", ts_fwd(op), args)
    for name, f in FORMS[op].items():
        fns[name] = jax.jit(f).lower(*args).compile()
    ref = np.asarray(fns["ts[xla]"](*args))
    ms = time_interleaved(fns, args, repeats=5, target_ms=25, warmup_ms=100)
    for n, f in fns.items():
        out = np.asarray(f(*args))
        same = np.array_equal(out, ref, equal_nan=True)
        err = float(nb.rel_err(f(*args), fns["jnp"](*args)))
        print(
            f"fwd {op:11s} {shape[0]}x{shape[1]:<6d} {n:9s} {ms[n] * 1e3:8.1f} us "
            f"x{ms['jnp'] / ms[n]:.3f} same_as_ref={same} err_vs_jnp={err:.1e} "
            f"launches {kernels(f)}",
            flush=True,
        )


def bwd_case(op, shape):
    args = nb.operands(op, shape)
    fns = {
        "jnp": nb.pullback(lambda *a: nb.xla_op(op, *a), args, "xla"),
        "ts[xla]": nb.pullback(ts_fwd(op), args, "xla"),
    }
    ms = time_interleaved(fns, args, repeats=5, target_ms=25, warmup_ms=100)
    for n in fns:
        print(
            f"bwd {op:11s} {shape[0]}x{shape[1]:<6d} {n:9s} {ms[n] * 1e3:8.1f} us "
            f"x{ms['jnp'] / ms[n]:.3f}",
            flush=True,
        )


OPS = sys.argv[1:] or nb.OPS  # e.g. ``rmsnorm``: its forward cases only
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
for shape in SHAPES:
    for op in OPS:
        if shape[1] > 32000 and op in ("rmsnorm", "layernorm"):
            continue
        fwd_case(op, shape)
if not sys.argv[1:]:
    for shape in ((4096, 1024), (1024, 4096), (2048, 32000)):
        for op in nb.OPS:
            bwd_case(op, shape)
