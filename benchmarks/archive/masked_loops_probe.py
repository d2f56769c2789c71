"""Probe: one masked loop against two where every block of a kernel is masked.

With a bias, a mask or segment ids every block the kernels see is masked
(``Problem.every_block_masked``). The dK/dV kernel's head loop (causal) and the forward's
and dQ kernel's key loop (a window) still ran the masked step in two loops, one each side
of an empty unmasked range: two copies of the masked body, each with its loop-invariant
values. This probe times the backward (and the forward with ``fwd``) of another tree's
``attention_mgpu.py`` (the ``--old`` file, e.g. ``git show 5d1c3e7:...`` saved to a path)
against the working tree's, interleaved in one process on one GPU, both call orders, and
compares their bits.

Cases: ``D-kind-feature``: kind ``c`` (causal) or ``w`` (window (512, 0)), feature ``bias``
((1, H, S, S) bf16), ``mask`` ((1, 1, S, S), 90 % kept), ``seg`` (four segments) or
``none``; B4 S4096 H16.

    git show d33e858:tessera_jax/pallas_kernels/attention_mgpu.py > /tmp/am_old.py
    python3 benchmarks/archive/masked_loops_probe.py --old /tmp/am_old.py \\
        128-c-bias 128-c-seg 128-c-mask 64-c-bias
    python3 benchmarks/archive/masked_loops_probe.py --old /tmp/am_old.py fwd 128-w-bias

``sites FILE``: each spill store and load (STL/LDL) of ``nvdisasm -g`` output with the
kernel source line it carries (``ptxas -lineinfo`` of a ``MOSAIC_GPU_DUMP_PTX`` dump).
"""

import functools
import re
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import module_from_file, time_interleaved
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as new

B, S, H = 4, 4096, 16


def operands(case):
    d, kind, feat = case.split("-")
    d = int(d)
    ks = jax.random.split(jax.random.key(0), 6)
    q, k, v, do = (
        jax.random.normal(kk, (B, S, H, d), jnp.float32).astype(jnp.bfloat16) for kk in ks[:4]
    )
    kw = dict(causal=kind == "c", scale=d**-0.5, config=FlashAttentionConfig())
    if kind == "w":
        kw["local_window_size"] = (512, 0)
    if feat == "bias":
        kw["has_bias"] = True
        extras = ((2 * jax.random.normal(ks[4], (1, H, S, S))).astype(jnp.bfloat16),)
    elif feat == "seg":
        kw["has_segment_ids"] = True
        seg = jnp.broadcast_to((jnp.arange(S) // (S // 4 + 7)).astype(jnp.int32), (B, S))
        extras = (seg, seg)
    elif feat == "mask":
        kw["has_mask"] = True
        extras = (jax.random.bernoulli(ks[5], 0.9, (1, 1, S, S)),)
    else:
        extras = ()
    return AttentionSpec(**kw), (q, k, v, do), extras


def ab(old, cases, with_fwd):
    mods = {"old": old, "new": new}
    for case in cases:
        spec, (q, k, v, do), extras = operands(case)
        fwd = {n: jax.jit(functools.partial(m.flash_fwd, spec)) for n, m in mods.items()}
        outs = {n: f(q, k, v, *extras) for n, f in fwd.items()}
        out, lse = outs["old"]
        bwd = {n: jax.jit(functools.partial(m.flash_bwd, spec)) for n, m in mods.items()}
        grads = {n: g(q, k, v, out, lse, do, *extras) for n, g in bwd.items()}
        same_f = all(bool(jnp.array_equal(a, b)) for a, b in zip(outs["old"], outs["new"]))
        same_b = all(bool(jnp.array_equal(a, b)) for a, b in zip(grads["old"], grads["new"]))
        args = (q, k, v, out, lse, do, *extras)
        tb = time_interleaved(bwd, args, repeats=7)
        tb2 = time_interleaved(dict(reversed(list(bwd.items()))), args, repeats=7)
        line = f"{case}: same fwd {same_f} bwd {same_b} | bwd ms " + "  ".join(
            f"{n} {tb[n]:.3f}/{tb2[n]:.3f}" for n in tb
        )
        if with_fwd:
            tf = time_interleaved(fwd, (q, k, v, *extras), repeats=7)
            line += " | fwd ms " + "  ".join(f"{n} {tf[n]:.3f}" for n in tf)
        print(line, flush=True)


def sites(path):
    """``address instruction <- source line`` for each STL/LDL of an ``nvdisasm -g`` listing."""
    line = "?"
    for text in open(path):
        if m := re.search(r'//## File "[^"]+", line (\d+)', text):
            if "inlined at" not in text:
                line = m.group(1)
        elif "STL" in text or "LDL" in text:
            print(re.sub(r"\s+", " ", text.split(";")[0]).strip(), "<- line", line)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[0] == "sites":
        sites(argv[1])
    else:
        assert argv[0] == "--old", __doc__
        old, rest = module_from_file(argv[1], "attention_mgpu_old"), argv[2:]
        with_fwd = rest[:1] == ["fwd"]
        ab(old, rest[with_fwd:], with_fwd)
