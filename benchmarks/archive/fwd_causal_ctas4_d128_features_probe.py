"""Probe: the causal persistent forward at head_dim 128 with a CTA per four tiles (n4)
against the default (two then, FWD_CAUSAL_TILES_PER_CTA[128])
with each feature that ran 1.02-1.04x faster with four in fwd-causal-ctas4-h200.txt (key
lengths, segment ids, a window; one shape each) and the others persistent causal rows
take (a key-padding mask, query lengths), at 2048 and 4096 items; forward alone against
cuDNN, bits compared with the default. Decides whether FWD_CAUSAL_TILES_PER_CTA should
depend on the features at 128. Its log (fwd-causal-ctas4-d128-features-h200.txt) ends at the
key-padding mask, which cuDNN's fused attention refused as a baseline here; the plain rows
are in fwd-causal-ctas4-h200.txt and its -confirm log.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_causal_ctas4_d128_features_probe.py
"""

import sys

sys.path.insert(0, ".")

from tessera_jax.pallas_kernels import attention_mgpu as am

src = open("benchmarks/archive/fwd_qlengths_d64_loop_probe.py").read()
probe = {}
exec(src[: src.index("for b, s in")], probe)  # its imports and run()
run = probe["run"]

for feature in ("kvlen", "segments", "window", "keypad", "qkvlen", ""):
    for b, s in ((16, 1024), (8, 2048), (32, 1024)):
        tiles = 16 * b * (s // am.TILE)
        variants = {"n4": dict(persistent=True, ctas=-(-tiles // 4))}
        for rnd in range(2):  # rows drift between rounds
            label = f"{feature or 'plain'} B{b} S{s} D128 causal r{rnd}"
            run(label, b, s, 128, feature, True, variants)
