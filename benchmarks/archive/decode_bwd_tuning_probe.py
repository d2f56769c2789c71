"""The Triton decode backward (``attention_decode.flash_bwd``) against the Mosaic GPU
backward at decode shapes, kernel calls chained inside one program (the dQ of a call is the
next call's dO, over several K/V caches: ``benchmarks/attention.py``'s ``_time_variants``).

``tuning``: the Mosaic dQ kernel computing dK and dV (``dq_dkv``, baseline) beside the
Triton backward with 64 or 128 keys a step (``tri<keys>s<stages>``), two or three pipeline
stages, 2 warps (``w2``) and keys per chunk (``k<keys>``; otherwise ``default_split_keys``
with the forward's 8 chunks), B1 and B4, 1 and 16 queries, GQA or not, 4096 and 32768 keys,
head_dim 128. A configuration that does not compile prints ``FAIL`` with Triton's message.
``threshold``: the Mosaic backward ``auto`` ran (baseline) beside the Triton backward with
its shipped defaults (``BWD_CONFIG``, 16 chunks), at 256 to 2048 keys and at head_dim 64.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_bwd_tuning_probe.py tuning
    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_bwd_tuning_probe.py threshold

The tuning part ran before the defaults changed (``DecodeConfig()`` was the backward's
default then: 128 keys a step, three stages, 8 chunks).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax

from benchmarks import attention as ba
from tessera_jax.pallas_kernels import attention_decode as ad
from tessera_jax.pallas_kernels import attention_mgpu as am

# (batch, query heads, kv heads, queries, keys[, head_dim])
TUNING = [
    (1, 32, 8, 1, 4096),
    (1, 8, 8, 1, 4096),
    (1, 32, 8, 16, 4096),
    (1, 8, 8, 1, 32768),
    (1, 32, 8, 1, 32768),
    (4, 16, 16, 1, 4096),
    (4, 32, 8, 1, 32768),
]
THRESHOLD = [
    *(
        (b, h, h, sq, skv, 128)
        for b, h in ((1, 8), (4, 16))
        for sq in (1, 16)
        for skv in (256, 512, 1024, 2048)
    ),
    (1, 8, 8, 1, 4096, 64),
    (4, 16, 16, 16, 4096, 64),
]


def _configs(skv: int) -> dict:
    cfgs = {
        f"tri{bkv}s{st}": ad.DecodeConfig(block_kv=bkv, num_stages=st)
        for bkv in (64, 128)
        for st in (2, 3)
    }
    if skv >= 32768:
        for sk in (2048, 1024):
            cfgs[f"tri64s3k{sk}"] = ad.DecodeConfig(block_kv=64, split_keys=sk)
            cfgs[f"tri64s2k{sk}"] = ad.DecodeConfig(block_kv=64, num_stages=2, split_keys=sk)
    else:
        cfgs["tri64s3k1024"] = ad.DecodeConfig(block_kv=64, split_keys=1024)
        cfgs["tri64w2"] = ad.DecodeConfig(block_kv=64, num_warps=2)
    return cfgs


def main(part: str):
    print(jax.__version__, jax.devices()[0].device_kind)
    for b, h, hkv, sq, skv, *d in TUNING if part == "tuning" else THRESHOLD:
        d = d[0] if d else 128
        case = f"b{b}-h{h}-hkv{hkv}-sq{sq}-skv{skv}-d{d}"
        spec, args, sets = ba._decode_operands(b, sq, skv, h, hkv, d, True)
        if part == "tuning":
            base = "dq_dkv"
            fns = {base: jax.jit(functools.partial(am.flash_bwd, spec, dq_dkv=True))}
            for name, cfg in _configs(skv).items():
                fns[name] = jax.jit(functools.partial(ad.flash_bwd, spec, config=cfg))
        else:
            base = "mosaic"
            fns = {
                base: jax.jit(functools.partial(am.flash_bwd, spec)),
                "triton": jax.jit(functools.partial(ad.flash_bwd, spec)),
            }
        ok = {}
        for name, f in fns.items():
            try:
                jax.block_until_ready(f(*args))
                ok[name] = f
            except Exception as e:  # a configuration over the shared memory
                print(f"FAIL {case} {name}: {str(e).splitlines()[0][:200]}")
        ba._time_variants(case, ok, args, base, None, sets, ba._next_do)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tuning")
