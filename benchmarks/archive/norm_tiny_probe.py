"""Probe: rmsnorm's and layernorm's forward kernels against jnp and the references below
norms_gpu.prefer_norm's 2^19 elements, at decoding's sizes (1 to 256 tokens of 1024 to 8192
features), timed inside one program as norm_small_probe.py does. Asked whether
prefer_norm's floor can come down. Its log (norm-tiny-h200.txt): every call took 7-21 us
whatever its size (launch-bound), and the kernels ran 0.70-1.39x jnp with no trend in
size (64x4096 0.70-0.78x, 1x4096 1.24-1.39x, 8x4096 0.96-1.00x), so the floor stays.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/norm_tiny_probe.py
"""

import sys

sys.path.insert(0, ".")

src = open("benchmarks/archive/norm_small_probe.py").read()
probe = {}
exec(src[: src.index("for shape in ((512, 1024)")], probe)  # its imports, IMPLS and case()
case, IMPLS = probe["case"], probe["IMPLS"]

for shape in ((1, 4096), (8, 4096), (64, 4096), (256, 1024), (16, 8192), (128, 2048)):
    for op in ("rmsnorm", "layernorm"):
        case(op, shape, "fwd", tuple(IMPLS))
