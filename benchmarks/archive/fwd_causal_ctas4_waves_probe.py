"""Probe, after fwd_causal_ctas4_confirm_probe.py: where a CTA per four tiles (n4) stops
paying at head_dim 64 causal as the items shrink toward one wave of CTAs
(attention_mgpu.FWD_CAUSAL_MIN_WAVES): 640 to 896 items, n4 and n2 against the default,
forward alone against cuDNN, bits compared with the default.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_causal_ctas4_waves_probe.py
"""

import sys

sys.path.insert(0, ".")

from tessera_jax.pallas_kernels import attention_mgpu as am

src = open("benchmarks/archive/fwd_qlengths_d64_loop_probe.py").read()
probe = {}
exec(src[: src.index("for b, s in")], probe)  # its imports and run()
run = probe["run"]

for b, s in ((5, 1024), (6, 1024), (3, 2048), (7, 1024)):
    tiles = 16 * b * (s // am.TILE)
    variants = {f"n{t}": dict(persistent=True, ctas=-(-tiles // t)) for t in (2, 4)}
    for rnd in range(2):  # rows drift between rounds
        run(f"plain B{b} S{s} D64 causal r{rnd}", b, s, 64, "", True, variants)
