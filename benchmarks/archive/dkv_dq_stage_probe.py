"""Probe: does the dkv_dq path's f32 stage cost less with fewer Q/dO ring slots, or with a
second stage slot so that a step's reduce-add overlaps the next step? Rebuilds
``attention_mgpu`` from this checkout's source with text edits (each variant's results
are wrong, only its time counts) and times the backward of each, interleaved, in one
process: B4 S4096 H16 D128 bf16, non-causal.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/dkv_dq_stage_probe.py

Variants: ``two_kernels`` and ``dkv_dq`` (as shipped); ``nosem`` (no turns: the adds in
any order), with the default 3 Q/dO ring slots and with 2 (``_s2``); ``nosem_ring2_s2``
(2 ring slots, and the stage as two slots per warpgroup: a step waits only for the
reduce-add of the step before last, for its reads of shared memory); ``nodq`` (the
hand-over and the dQ product, no stage: its result unused) at 3 and 2 slots. Also lowers
for cuda on a CPU machine (``--lower``), to check the edits before a GPU run.
"""

import argparse
import functools
import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

import tessera_jax.pallas_kernels.attention_mgpu as am0
from benchmarks.archive.dkv_dq_variants_probe import SRC, edit, module
from benchmarks.attention import _times, rand
from tessera_jax.contracts.attention import AttentionSpec
from tessera_jax.primitives.attention import FlashAttentionConfig


def variants() -> dict:
    """``{name: (module, flash_bwd keyword arguments)}``."""
    nosem = edit(
        SRC,
        "        if p.dkv_dq and not interpret:\n            n_sems",
        "        if False:\n            n_sems",
    )
    ring = edit(
        nosem,
        "                (w, WG_ROWS, d // 2),\n                jnp.float32,",
        "                (w, 2, WG_ROWS, d // 2),\n                jnp.float32,",
    )
    ring = edit(
        ring,
        "            stage = dq_stage.at[half]\n",
        "            stage = dq_stage.at[half, lax.rem(n, 2)]\n",
    )
    # (each step commits two bulk groups, one of them predicated off)
    ring = edit(
        ring,
        "            plgpu.wait_smem_to_gmem(0)\n            pl.when(n > 0)(lambda: hand_on(n - 1, half))",
        "            plgpu.wait_smem_to_gmem(2, wait_read_only=True)",
    )
    ring = edit(
        ring,
        "    return NUM_COMPUTE_WGS * WG_ROWS * WG_ROWS * 2 + NUM_COMPUTE_WGS * WG_ROWS",
        "    return NUM_COMPUTE_WGS * WG_ROWS * WG_ROWS * 2 + 2 * NUM_COMPUTE_WGS * WG_ROWS",
    )
    nodq = edit(
        nosem,
        "            stage[...] = dq\n            if interpret:",
        "            if interpret:\n                stage[...] = dq",
    )
    nodq = edit(
        nodq,
        "            out = dq_ref.at[b, pl.ds(qi * bq, bq), h, cols]\n            follows = take_turn",
        "            return\n            out = dq_ref.at[b, pl.ds(qi * bq, bq), h, cols]\n"
        "            follows = take_turn",
    )
    nosem, ring, nodq = module("nosem", nosem), module("ring", ring), module("nodq", nodq)
    return {
        "two_kernels": (am0, dict(dkv_dq=False)),
        "dkv_dq": (am0, dict(dkv_dq=True)),
        "nosem": (nosem, dict(dkv_dq=True)),
        "nosem_s2": (nosem, dict(dkv_dq=True, dkv_stages=2)),
        "nosem_ring2_s2": (ring, dict(dkv_dq=True, dkv_stages=2)),
        "nodq": (nodq, dict(dkv_dq=True)),
        "nodq_s2": (nodq, dict(dkv_dq=True, dkv_stages=2)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lower", action="store_true", help="only lower each for cuda")
    lower = parser.parse_args().lower
    b, s, h, d = (1, 512, 2, 128) if lower else (4, 4096, 16, 128)
    q, k, v, do = (rand(i, (b, s, h, d), jnp.bfloat16) for i in range(4))
    spec = AttentionSpec(causal=False, scale=d**-0.5, config=FlashAttentionConfig())
    if lower:
        from tests._util import cuda_lowering_xla_row_dot

        lse = jnp.zeros((b, h, s), jnp.float32)
        for name, (m, kw) in variants().items():
            cuda_lowering_xla_row_dot(
                functools.partial(m.flash_bwd, spec, **kw), q, k, v, q, lse, do
            )
            print(name, "lowers", flush=True)
        return
    out, lse = jax.jit(functools.partial(am0.flash_fwd, spec))(q, k, v)
    args = (q, k, v, out, lse, do)
    fns = {
        n: jax.jit(functools.partial(m.flash_bwd, spec, **kw)) for n, (m, kw) in variants().items()
    }
    ms = _times(fns, args)
    print("non-causal bwd ms: " + "  ".join(f"{n} {t:.3f}" for n, t in ms.items()), flush=True)


if __name__ == "__main__":
    main()
