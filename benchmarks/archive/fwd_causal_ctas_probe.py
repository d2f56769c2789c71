"""Probe: the causal persistent forward's CTA count at short rows of keys, forward alone
against cuDNN, bits compared with the default of dbed37e (a CTA per two tiles, n2).
``sweep``: one wave (132 CTAs), two, 528, a CTA per four tiles and the grid, D64 at B32
S512, B16 S1024, B8 S2048 and D128 at B16 S1024 (each 2048 tiles of 128 queries);
``confirm``: one and two waves at 256-768 keys, D64 and D128, and with key lengths.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/fwd_causal_ctas_probe.py [sweep|confirm]
"""

import sys

sys.path.insert(0, ".")

from tessera_jax.pallas_kernels import attention_mgpu as am

src = open("benchmarks/archive/fwd_qlengths_d64_loop_probe.py").read()
probe = {}
exec(src[: src.index("for b, s in")], probe)  # its imports and run()
run = probe["run"]
parts = sys.argv[1:] or ["sweep", "confirm"]

if "sweep" in parts:
    for d, shapes in ((64, ((32, 512), (16, 1024), (8, 2048))), (128, ((16, 1024),))):
        for b, s in shapes:
            tiles = 16 * b * (s // am.TILE)
            counts = (132, 264, 528, tiles // 4)
            variants = {f"ctas{c}": dict(persistent=True, ctas=c) for c in counts}
            variants["grid"] = dict(persistent=False)
            run(f"B{b} S{s} D{d} causal", b, s, d, "", True, variants)
if "confirm" in parts:
    shapes = (
        (64, 32, 512),
        (64, 8, 512),
        (64, 64, 256),
        (128, 32, 512),
        (128, 8, 512),
        (64, 32, 768),
    )
    for d, b, s in shapes:
        variants = {f"ctas{c}": dict(persistent=True, ctas=c) for c in (132, 264)}
        run(f"B{b} S{s} D{d} causal", b, s, d, "", True, variants)
    one = {"ctas132": dict(persistent=True, ctas=132)}
    run("kvlen B32 S512 D64 causal", 32, 512, 64, "kvlen", True, one)
