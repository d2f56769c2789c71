"""Probe: where does a 64-key step of the decode backward's dQ kernel computing dK and dV
(``attention_mgpu``, ``dq_dkv``) spend its cycles? Mosaic GPU's on-device profiler
(``CompilerParams(profile_space=…, profile_dir=…)``) records named regions per warpgroup;
this rebuilds ``attention_mgpu`` with regions around the step's parts (a text edit of this
checkout's source, opened and closed by hand so the edit needs no re-indenting) and with
two K/V ring slots (the profile buffer's room), and sums them per warpgroup. B1, 32 query
heads on 8 kv heads (the group folded: 4 of a tile's 64 rows real), one query, 4096 keys
(4 chunks of 1024: 16 steps a CTA), D128 bf16.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/dq_dkv_profile_probe.py

Warpgroup 0: ``kwait``/``vwait`` (K's and V's barriers), ``s`` (S = Q·Kᵀ issued and
read back), ``dp`` (dP = dO·Vᵀ), ``probs`` (P and dS), ``pfree`` (the hand-over slot's
release), ``pwrite`` (P and dS into the slot), ``dqdot`` (dQ += dS·K). Warpgroup 1:
``flush`` (the step's K/V barriers), ``rwait`` (the hand-over), ``dkvdot`` (dV = Pᵀ·dO and
dK = dSᵀ·Q), ``swait`` (the last block's stores out of its tiles), ``store`` (dK, dV into
the tiles and their copies out). ``load``/``epi``: the prologue's loads, dQ's write.
The trace's times are clock cycles (the ``ts`` field / 1e3).
"""

import collections
import functools
import glob
import json
import os
import statistics
import sys
import tempfile
import types

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from benchmarks._common import normal
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am

I16 = " " * 12
I20 = " " * 16


def wrap(lines, name, ind):
    return f"{ind}_cm_{name} = _S('{name}')\n{lines}{ind}_E(_cm_{name})\n"


EDITS = [
    (
        "            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup\n"
        "        ),\n    )\n\n\n# --- backward: dK/dV",
        "            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup,\n"
        "            profile_space=PROFILE_SPACE, profile_dir=PROFILE_DIR,\n"
        "        ),\n    )\n\n\n# --- backward: dK/dV",
    ),
]
A = [
    "            plgpu.barrier_wait(k_bar.at[slot])\n",
    "            s = _dot((bq, bkv), qs, k_smem.at[slot].transpose((1, 0)))\n",
    "            plgpu.barrier_wait(v_bar.at[vslot])\n",
    "            dp = _dot((bq, bkv), dos, v_smem.at[vslot].transpose((1, 0)))\n",
]
EDITS.append(
    (
        "".join(A)
        + "            plgpu.barrier_arrive(v_done.at[vslot])\n            s = s * p.c\n",
        "".join(wrap(x, n, I16) for x, n in zip(A, ("kwait", "s", "vwait", "dp")))
        + "            plgpu.barrier_arrive(v_done.at[vslot])\n"
        + "            _cm_probs = _S('probs')\n            s = s * p.c\n",
    )
)
EDITS.append(
    (
        "            ds = pr * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))\n",
        "            ds = pr * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))\n"
        "            _E(_cm_probs)\n",
    )
)
B = [
    "                _wait_if(n >= PDS_SLOTS, [pds_free.at[hand]])()\n",
    "                pds_smem.at[hand, 0][...] = pr.astype(p.dtype)\n"
    "                pds_smem.at[hand, 1][...] = ds.astype(p.dtype)\n"
    "                plgpu.commit_smem()\n"
    "                plgpu.barrier_arrive(pds_ready.at[hand])\n",
    "            dq = _dot_acc(dq, ds.astype(p.dtype), k_smem.at[slot], stg, interpret=interpret)\n",
]
EDITS.append(
    (
        "".join(B),
        wrap(B[0], "pfree", I20) + wrap(B[1], "pwrite", I20) + wrap(B[2], "dqdot", I16),
    )
)
C = [
    "                flush(j, None)\n",
    "                hand = _slot(j - cta_first, PDS_SLOTS)\n"
    "                plgpu.barrier_wait(pds_ready.at[hand])\n",
    "                pt, dst = (pds_smem.at[hand, i].transpose((1, 0)) for i in (0, 1))\n"
    "                dv, dk = _dots((bkv, d), (pt, do_smem.at[0]), (dst, q_smem.at[0]))\n"
    "                plgpu.barrier_arrive(pds_free.at[hand])\n",
    "                plgpu.wait_smem_to_gmem(0)  # the last block's writes have left the tiles\n",
    "                qs[...] = (dk * p.scale).astype(p.dtype)\n"
    "                dos[...] = dv.astype(p.dtype)\n"
    "                plgpu.commit_smem()\n"
    "                keys = pl.ds(j * bkv, bkv)\n"
    "                plgpu.copy_smem_to_gmem(qs, dk_ref.at[b, keys, h])\n"
    "                plgpu.copy_smem_to_gmem(dos, dv_ref.at[b, keys, h])\n",
]
EDITS.append(
    (
        "".join(C),
        "".join(wrap(x, n, I20) for x, n in zip(C, ("flush", "rwait", "dkvdot", "swait", "store"))),
    )
)
EDITS.append(
    (
        "        bars = [q_bar.at[wg * 4 + i] for i in range(4)]\n",
        "        _cm_load = _S('load')\n        bars = [q_bar.at[wg * 4 + i] for i in range(4)]\n",
    )
)
EDITS.append(
    (
        "        lse = lse_smem[wg]\n        delta = delta_smem[wg]\n        q_seg = _load_q_segments(",
        "        _E(_cm_load)\n        lse = lse_smem[wg]\n        delta = delta_smem[wg]\n"
        "        q_seg = _load_q_segments(",
    )
)
EDITS.append(
    (
        "            write(dq_out)\n",
        "            _cm_epi = _S('epi')\n            write(dq_out)\n            _E(_cm_epi)\n",
    )
)

HELPERS = """

def _S(name):
    cm = jax.named_scope(name)
    cm.__enter__()
    return cm


def _E(cm):
    cm.__exit__(None, None, None)
"""


def module(stages):
    src = open(am.__file__).read()
    for old, new in EDITS:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    src += HELPERS
    profile_dir = tempfile.mkdtemp()
    mod = types.ModuleType(f"attention_mgpu_profiled{stages}")
    mod.__file__ = am.__file__
    mod.PROFILE_SPACE, mod.PROFILE_DIR = 160, profile_dir
    sys.modules[mod.__name__] = mod
    exec(compile(src, f"{mod.__name__}.py", "exec"), mod.__dict__)
    mod.DQ_DKV_STAGES = stages
    return mod, profile_dir


def summarise(tag, profile_dir):
    (trace,) = glob.glob(os.path.join(profile_dir, "*.json"))
    by_wg = collections.defaultdict(list)
    for e in json.load(open(trace))["traceEvents"]:
        by_wg[e["tid"]].append(e)
    totals = {0: collections.defaultdict(list), 1: collections.defaultdict(list)}
    spans = {0: [], 1: []}
    for tid, events in by_wg.items():
        wg = (tid - 1) % 3
        if wg == 2:
            continue
        open_at, total = {}, collections.Counter()
        for e in events:
            if e["ph"] == "B":
                open_at[e["name"]] = e["ts"]
            else:
                total[e["name"]] += e["ts"] - open_at.pop(e["name"])
        for name, t in total.items():
            totals[wg][name].append(t * 1e3)
        spans[wg].append((events[-1]["ts"] - events[0]["ts"]) * 1e3)
    for wg in (0, 1):
        span = statistics.mean(spans[wg])
        print(f"[{tag}] wg{wg}: {len(spans[wg])} traces, mean span {span:.0f} cycles", flush=True)
        for name, ts in sorted(totals[wg].items(), key=lambda kv: -statistics.mean(kv[1])):
            t = statistics.mean(ts)
            print(f"   {name:8s} {t:8.0f} cycles  {t / span:6.1%}", flush=True)


def main():
    b, hq, hkv, d, sq, skv = 1, 32, 8, 128, 1, 4096
    spec = AttentionSpec(causal=False, scale=d**-0.5, config=FlashAttentionConfig())
    q, do = (normal(i, (b, sq, hq, d), jnp.bfloat16) for i in (0, 3))
    k, v = (normal(i, (b, skv, hkv, d), jnp.bfloat16) for i in (1, 2))
    out, lse = jax.jit(functools.partial(am.flash_fwd, spec))(q, k, v)

    def bwd(m):
        return jax.jit(functools.partial(m.flash_bwd, spec))(q, k, v, out, lse, do)

    ref = bwd(am)
    for stages in (2,):
        mod, profile_dir = module(stages)
        got = bwd(mod)
        same = all(bool(jnp.array_equal(x, y)) for x, y in zip(got, ref))
        print(f"stages {stages}: the profiled kernel gives the kernel's bits: {same}", flush=True)
        summarise(f"b{b} hq{hq} hkv{hkv} sq{sq} skv{skv} stages{stages}", profile_dir)


if __name__ == "__main__":
    main()
