"""Probe: the compute warpgroups' register count (setmaxnreg) in the attention kernels.

Three warpgroups launch with 168 registers each (504 per 128 threads); the compute
warpgroups raise theirs to ``c`` and the memory warpgroup lowers its to ``504 - 2c``. This
probe replaces every ``plgpu.set_max_registers`` call of ``attention_mgpu`` with its own
counts, per kernel (found by the calling kernel function's name), so it runs at commits
before and after ``Problem.compute_regs`` (it ignores the count the kernel asks for).

Variants: ``232/40`` or ``240/24`` (every kernel), or ``dkv240``, ``dq240``, ``fwd240``
joined by ``+`` (those kernels at 240, the others at 232).

    # ptxas's reports (stack frame, spills) per compile: D128 and D64, bias and causal
    MOSAIC_GPU_DUMP_PTXAS=1 python3 benchmarks/archive/compute_regs_probe.py ptxas 232/40 240/24 \\
        2>&1 | grep -E "=====|bytes stack frame"
    # forward and backward alone, interleaved in one process, both call orders; bits compared
    python3 benchmarks/archive/compute_regs_probe.py time 232/40 240/24 dkv240 dq240
"""

import functools
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks._common import time_interleaved
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am

_orig = plgpu.set_max_registers
KERNELS = ("_fwd_kernel", "_dq_kernel", "_dkv_kernel")
REGS = dict.fromkeys(KERNELS, 232)  # the compute warpgroups' count; the producer's 504 - 2c


def _patched(n, *, action):
    f = sys._getframe(1)
    while f.f_code.co_name not in KERNELS:
        f = f.f_back
    c = REGS[f.f_code.co_name]
    return _orig(c if action == "increase" else 504 - 2 * c, action=action)


plgpu.set_max_registers = _patched


def use(variant):
    if "/" in variant:
        REGS.update(dict.fromkeys(KERNELS, int(variant.split("/")[0])))
        return
    REGS.update(dict.fromkeys(KERNELS, 232))
    for part in variant.split("+"):
        name = part.rstrip("0123456789")
        REGS[f"_{name}_kernel"] = int(part[len(name) :])


def inputs(B, S, H, D, bias, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v, do = (
        jax.random.normal(kk, (B, S, H, D), jnp.float32).astype(jnp.bfloat16) for kk in ks[:4]
    )
    extras = ((2 * jax.random.normal(ks[4], (1, H, S, S))).astype(jnp.bfloat16),) if bias else ()
    return q, k, v, do, extras


def spec_of(D, causal, bias):
    return AttentionSpec(causal=causal, scale=D**-0.5, config=FlashAttentionConfig(), has_bias=bias)


def ptxas(variants):
    for variant in variants:
        use(variant)
        for D in (128, 64):
            q, k, v, do, extras = inputs(1, 1024, 2, D, True)
            lse = jnp.zeros((1, 2, 1024), jnp.float32)
            for bias in (False, True):
                for causal in (False, True):
                    e = extras if bias else ()
                    spec = spec_of(D, causal, bias)
                    print(f"===== {variant} bwd D{D} bias={bias} causal={causal}", flush=True)
                    bwd = jax.jit(functools.partial(am.flash_bwd, spec))
                    bwd.lower(q, k, v, q, lse, do, *e).compile()
                    print(f"===== {variant} fwd D{D} bias={bias} causal={causal}", flush=True)
                    jax.jit(functools.partial(am.flash_fwd, spec)).lower(q, k, v, *e).compile()


CASES = [  # (B, S, H, D, causal, bias)
    (4, 4096, 16, 128, False, False),
    (4, 4096, 16, 128, True, True),
    (4, 4096, 16, 128, True, False),
    (4, 4096, 16, 128, False, True),
    (16, 1024, 16, 128, False, False),
    (16, 1024, 16, 128, True, False),
    (4, 4096, 16, 256, False, False),
    (4, 4096, 16, 256, True, False),
    (4, 4096, 16, 64, False, False),
    (4, 4096, 16, 64, True, True),
]


def time(variants):
    for B, S, H, D, causal, bias in CASES:
        q, k, v, do, extras = inputs(B, S, H, D, bias)
        spec = spec_of(D, causal, bias)
        fwd, bwd, outs = {}, {}, {}
        for variant in variants:
            use(variant)
            if REGS["_fwd_kernel"] not in [fv for fv, _ in fwd.values()]:
                f = jax.jit(functools.partial(am.flash_fwd, spec))
                out, lse = f(q, k, v, *extras)  # traced and compiled under this variant
                fwd[variant] = (REGS["_fwd_kernel"], f)
            else:
                out, lse = outs[variants[0]][:2]
            g = jax.jit(functools.partial(am.flash_bwd, spec))
            grads = g(q, k, v, out, lse, do, *extras)
            bwd[variant], outs[variant] = g, (out, lse, *grads)
        base = outs[variants[0]]
        same = {
            v_: all(bool(jnp.array_equal(a, b)) for a, b in zip(base, outs[v_]))
            for v_ in variants[1:]
        }
        out, lse = base[:2]
        args = (q, k, v, out, lse, do, *extras)
        tf = time_interleaved({n: f for n, (_, f) in fwd.items()}, (q, k, v, *extras), repeats=7)
        tb = time_interleaved(bwd, args, repeats=7)
        tb2 = time_interleaved(dict(reversed(list(bwd.items()))), args, repeats=7)
        print(
            f"B{B} S{S} H{H} D{D} causal={causal} bias={bias} same_bits={same}\n"
            + "   fwd ms "
            + "  ".join(f"{n} {tf[n]:.3f}" for n in tf)
            + "\n   bwd ms "
            + "  ".join(f"{n} {tb[n]:.3f}/{tb2[n]:.3f}" for n in tb),
            flush=True,
        )


if __name__ == "__main__":
    {"ptxas": ptxas, "time": time}[sys.argv[1]](sys.argv[2:])
