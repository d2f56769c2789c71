"""Probe, after fwd_causal_ctas4_probe.py: the causal persistent forward with a CTA per four
tiles (n4) against the default (a CTA per two, FWD_CAUSAL_TILES_PER_CTA) where the first
probe did not decide: D128 B8 S2048 (its rounds disagreed), 512 and 1024 items (a CTA per
four tiles is one or two waves there) and 4096; forward alone against cuDNN, bits compared
with the default.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_causal_ctas4_confirm_probe.py
"""

import sys

sys.path.insert(0, ".")

from tessera_jax.pallas_kernels import attention_mgpu as am

src = open("benchmarks/archive/fwd_qlengths_d64_loop_probe.py").read()
probe = {}
exec(src[: src.index("for b, s in")], probe)  # its imports and run()
run = probe["run"]

cases = [
    (128, 8, 2048, "", 3),
    (64, 2, 2048, "", 2),
    (64, 8, 1024, "", 2),
    (128, 8, 1024, "", 2),
    (64, 4, 2048, "", 2),
    (128, 4, 2048, "", 2),
    (64, 32, 1024, "", 2),
    (128, 16, 2048, "", 2),
    (64, 8, 2048, "segments", 2),
]
for d, b, s, feature, rounds in cases:
    tiles = 16 * b * (s // am.TILE)
    variants = {"n4": dict(persistent=True, ctas=-(-tiles // 4))}
    for rnd in range(rounds):  # rows drift between rounds
        run(f"{feature or 'plain'} B{b} S{s} D{d} causal r{rnd}", b, s, d, feature, True, variants)
