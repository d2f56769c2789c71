"""Probe: where does a step of the attention forward's serial loop spend its time? Mosaic
GPU's on-device profiler (``CompilerParams(profile_space=…, profile_dir=…)``) records the
kernel's ``jax.named_scope`` regions per warpgroup; this rebuilds ``attention_mgpu`` with
regions around the serial step's parts (a text edit of this checkout's source) and sums
them per compute warpgroup. B4 H16 D128 bf16 non-causal, 4096 queries, 1024 keys (eight
steps: the profile buffer shares the shared memory that the K/V ring nearly fills).

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_profile_probe.py

Regions: ``qload`` (Q's copy and wait), ``qk`` (S = Q·Kᵀ issued, the ping-pong rendezvous,
S read back), ``softmax`` (the online softmax, O's rescale, the 16-bit cast), ``handoff``
(the rendezvous and V's barrier before P·V), ``pv`` (P·V and the next K's barrier),
``epilogue`` (the output's store). The trace's times are clock cycles from each
warpgroup's first event (the ``ts`` field / 1e3).
"""

import collections
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

EDITS = [
    (
        "            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup\n"
        "        ),\n    )\n\n\n# --- backward: dQ",
        "            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup,\n"
        "            profile_space=PROFILE_SPACE, profile_dir=PROFILE_DIR,\n"
        "        ),\n    )\n\n\n# --- backward: dQ",
    ),
    (
        "            s = scores(slot)\n            m_new, pr, alpha = probs(j, s, m, masked)\n"
        "            acc = acc * rows(alpha)\n            l_ = l_ * alpha + pr.sum(axis=1)\n"
        "            if d <= 128:",
        '            with jax.named_scope("qk"):\n                s = scores(slot)\n'
        '            with jax.named_scope("softmax"):\n'
        "              m_new, pr, alpha = probs(j, s, m, masked)\n"
        "              acc = acc * rows(alpha)\n              l_ = l_ * alpha + pr.sum(axis=1)\n"
        "              if d <= 128:",
    ),
    (
        "            plgpu.barrier_arrive(sched)\n            plgpu.barrier_wait(v_bar.at[slot])\n"
        "            plgpu.barrier_wait(sched)\n            acc = _dot_acc(",
        '            with jax.named_scope("handoff"):\n                plgpu.barrier_arrive(sched)\n'
        "                plgpu.barrier_wait(v_bar.at[slot])\n                plgpu.barrier_wait(sched)\n"
        '            with jax.named_scope("pv"):\n              acc = _dot_acc(',
    ),
    (
        "                overlap=wait_next_k(j),\n            )\n"
        "            plgpu.barrier_arrive(v_done.at[slot])\n            return acc, m_new, l_",
        "                overlap=wait_next_k(j),\n              )\n"
        "            plgpu.barrier_arrive(v_done.at[slot])\n            return acc, m_new, l_",
    ),
    (
        "        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, bq), h], qs, q_bar.at[wg])\n"
        "        plgpu.barrier_wait(q_bar.at[wg])",
        '        with jax.named_scope("qload"):\n'
        "            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, bq), h], qs, q_bar.at[wg])\n"
        "            plgpu.barrier_wait(q_bar.at[wg])",
    ),
    (
        "        @pl.when(q_base < p.seq_q)  # (padded rows are cut off)\n        def _write():",
        "        @pl.when(q_base < p.seq_q)  # (padded rows are cut off)\n"
        '        @jax.named_scope("epilogue")\n        def _write():',
    ),
]

src = open(am.__file__).read()
for old, new in EDITS:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
profile_dir = tempfile.mkdtemp()
mod = types.ModuleType("attention_mgpu_profiled")
mod.__file__ = am.__file__
mod.PROFILE_SPACE, mod.PROFILE_DIR = 36, profile_dir
sys.modules[mod.__name__] = mod
exec(compile(src, "attention_mgpu_profiled.py", "exec"), mod.__dict__)

b, h, d, sq, skv = 4, 16, 128, 4096, 1024
spec = AttentionSpec(causal=False, scale=d**-0.5, config=FlashAttentionConfig())
q = normal(0, (b, sq, h, d), jnp.bfloat16)
k, v = (normal(i, (b, skv, h, d), jnp.bfloat16) for i in (1, 2))
fwd = jax.jit(lambda q, k, v, m: m.flash_fwd(spec, q, k, v, pipelined=False)[0], static_argnums=3)
same = bool(jnp.array_equal(fwd(q, k, v, mod), fwd(q, k, v, am)))
print(f"{jax.devices()[0].device_kind}: the profiled kernel gives the kernel's bits: {same}")

(trace,) = glob.glob(os.path.join(profile_dir, "*.json"))
by_wg = collections.defaultdict(list)
for e in json.load(open(trace))["traceEvents"]:
    by_wg[e["tid"]].append(e)
totals, spans = collections.defaultdict(list), []
for tid, events in by_wg.items():
    if (tid - 1) % 3 == 2:  # the memory warpgroup records no regions
        continue
    open_at, total = {}, collections.Counter()
    for e in events:
        if e["ph"] == "B":
            open_at[e["name"]] = e["ts"]
        else:
            total[e["name"]] += e["ts"] - open_at.pop(e["name"])
    for name, t in total.items():
        totals[name].append(t * 1e3)
    spans.append((events[-1]["ts"] - events[0]["ts"]) * 1e3)
span = statistics.mean(spans)
print(f"{len(spans)} compute warpgroups; mean span {span:.0f} cycles ({skv // 128} steps)")
for name, ts in sorted(totals.items()):
    t = statistics.mean(ts)
    print(f"   {name:9s} {t:8.0f} cycles per warpgroup  {t / span:6.1%} of the span")
