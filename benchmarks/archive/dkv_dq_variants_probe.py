"""Probe: where does the dK/dV kernel computing dQ too (``flash_bwd(dkv_dq=True)``) lose
its time against the two kernels? Rebuilds ``attention_mgpu`` from this checkout's source
with parts of the dQ path taken out (text edits; each variant's results are wrong, only
its time counts) and times the backward of each, interleaved, in one process: B4 S4096
H16 D128 bf16, non-causal and causal.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/dkv_dq_variants_probe.py

Its text edits match ``attention_mgpu.py`` as of commit d991cfc (check that out to rerun
it); later sources fail its asserts. ``dkv_dq_stage_probe.py`` reuses its helpers.

Variants, each removing one more piece:
``dkv_dq`` (as shipped: semaphore turns, TMA reduce-add), ``signal_now`` (the turn handed
on right after the partial lands, in the same step, not at the next step), ``nosem`` (no
turns: the adds in any order), ``noreduce`` (a plain TMA store), ``nostore`` (the partial
staged in shared memory, no TMA), ``nodq`` (no stage either: the rendezvous, the dSᵀ
hand-over and the dQ product remain); then, with neither turns nor TMA, the stage as the
shipped swizzled f32 tile, a plain f32 tile, a 16-bit tile, or none (the last two sets
repeat ``nostore`` and ``nodq``).
"""

import functools
import sys
import types

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

import tessera_jax.pallas_kernels.attention_mgpu as am0
from benchmarks.attention import _times, rand
from tessera_jax.contracts.attention import AttentionSpec
from tessera_jax.primitives.attention import FlashAttentionConfig

SRC = open(am0.__file__).read()
STAGE = """            plgpu.SMEM(  # the dQ partial's halves, f32, as TMA stores them
                (w, WG_ROWS, d // 2),
                jnp.float32,
                transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)),
            ),"""
STORE = """            stage[...] = dq
            plgpu.commit_smem()
"""


def edit(src: str, old: str, new: str) -> str:
    assert src.count(old) == 1, old
    return src.replace(old, new)


def module(name: str, src: str):
    mod = types.ModuleType(f"am_{name}")
    mod.__file__ = am0.__file__
    sys.modules[mod.__name__] = mod
    exec(compile(src, f"am_{name}.py", "exec"), mod.__dict__)
    return mod


def variants() -> dict[str, str]:
    nosem = edit(SRC, "if p.dkv_dq and not interpret:  # (the", "if False:  # (the")
    noreduce = edit(
        nosem,
        'plgpu.copy_smem_to_gmem(stage, out, predicate=follows, reduction_op="add")',
        "plgpu.copy_smem_to_gmem(stage, out, predicate=follows)",
    )
    nostore = edit(
        edit(noreduce, "plgpu.copy_smem_to_gmem(stage, out, predicate=follows)\n", ""),
        "plgpu.copy_smem_to_gmem(stage, out, predicate=~follows)\n",
        "",
    )
    nodq = edit(nostore, STORE, "")
    now = edit(
        SRC,
        """            plgpu.wait_smem_to_gmem(0)
            pl.when(n > 0)(lambda: hand_on(n - 1, half))
""",
        "",
    )
    now = edit(
        now,
        "plgpu.copy_smem_to_gmem(stage, out, predicate=~follows)\n",
        "plgpu.copy_smem_to_gmem(stage, out, predicate=~follows)\n"
        "            plgpu.wait_smem_to_gmem(0)\n"
        "            hand_on(n, half)\n",
    )
    now = edit(now, STORE, "            plgpu.wait_smem_to_gmem(0, wait_read_only=True)\n" + STORE)
    now = edit(
        now,
        """            plgpu.wait_smem_to_gmem(0)
            pl.when(n_steps > 0)(lambda: hand_on(n_steps - 1, wg))
""",
        "            plgpu.wait_smem_to_gmem(0)\n",
    )
    plain = edit(nostore, STAGE, "plgpu.SMEM((w, WG_ROWS, d // 2), jnp.float32),")
    half = edit(nostore, STAGE, "_smem((w, WG_ROWS, d // 2), p.dtype),")
    half = edit(half, STORE, STORE.replace("= dq\n", "= dq.astype(p.dtype)\n"))
    return {
        "signal_now": now,
        "nosem": nosem,
        "noreduce": noreduce,
        "nostore": nostore,
        "nodq": nodq,
        "stage_f32_plain": plain,
        "stage_16bit": half,
    }


def main() -> None:
    mods = {"two_kernels": (am0, False), "dkv_dq": (am0, True)}
    mods.update({name: (module(name, src), True) for name, src in variants().items()})
    b, s, h, d = 4, 4096, 16, 128
    q, k, v, do = (rand(i, (b, s, h, d), jnp.bfloat16) for i in range(4))
    for causal in (False, True):
        spec = AttentionSpec(causal=causal, scale=d**-0.5, config=FlashAttentionConfig())
        out, lse = jax.jit(functools.partial(am0.flash_fwd, spec))(q, k, v)
        args = (q, k, v, out, lse, do)
        fns = {
            name: jax.jit(functools.partial(m.flash_bwd, spec, dkv_dq=fused))
            for name, (m, fused) in mods.items()
        }
        ms = _times(fns, args)
        kind = "causal" if causal else "non-causal"
        print(f"{kind}: " + "  ".join(f"{n} {t:.3f}" for n, t in ms.items()), flush=True)


if __name__ == "__main__":
    main()
