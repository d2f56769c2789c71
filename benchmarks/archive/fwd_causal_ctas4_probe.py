"""Probe: the causal persistent forward
at 1024-2048 keys with a CTA per four tiles against the default (a CTA per two tiles,
FWD_CAUSAL_TILES_PER_CTA), D64 and D128, plain and with key lengths, segment ids and a
window; forward alone against cuDNN, bits compared with the default. Decides whether
FWD_CAUSAL_TILES_PER_CTA should be 4 (fwd-causal-ctas-h200.txt: 1.05x at D64 S1024/S2048,
level at D128 S1024, one run).

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_causal_ctas4_probe.py
"""

import sys

sys.path.insert(0, ".")

from tessera_jax.pallas_kernels import attention_mgpu as am

src = open("benchmarks/archive/fwd_qlengths_d64_loop_probe.py").read()
probe = {}
exec(src[: src.index("for b, s in")], probe)  # its imports and run()
run = probe["run"]

cases = [
    (64, 16, 1024, ""),
    (64, 8, 2048, ""),
    (128, 16, 1024, ""),
    (128, 8, 2048, ""),
    (128, 4, 1024, ""),
    (128, 16, 1024, "kvlen"),
    (128, 16, 1024, "segments"),
    (128, 8, 2048, "window"),
    (64, 16, 1024, "kvlen"),
]
for d, b, s, feature in cases:
    tiles = 16 * b * (s // am.TILE)
    variants = {f"n{t}": dict(persistent=True, ctas=-(-tiles // t)) for t in (3, 4)}
    for rnd in range(2):  # two rounds: single rows drift between them
        run(f"{feature or 'plain'} B{b} S{s} D{d} causal r{rnd}", b, s, d, feature, True, variants)
