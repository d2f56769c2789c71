"""The decode forward at head_dim 64 (and one head_dim 128 case beside it): ``auto`` mode
(``ts_auto``: the Triton decode forward, ``attention_decode.decode_fwd``) against
``jax.nn.dot_product_attention``'s default (XLA, baseline), and the Triton forward called
directly with other keys per chunk (``split=<keys>``; ``split`` equal to the key count is
one chunk, no combination), 2 or 8 warps, or 64 keys a step, at B1 H8 and B4 H16, 1 and 16
queries, 1024 and 4096 keys. Calls are chained inside one program, the output of a call the
next call's query, over several K/V caches (``benchmarks/attention.py``'s
``_time_variants``); each case is timed in two rounds (``#0``, ``#1``) to show the noise of
such short calls. Arguments select cases by substring.

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/decode_d64_probe.py d64 b1-h8-sq16-skv4096-d128
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax

import tessera_jax as ts
from benchmarks import attention as ba
from tessera_jax.pallas_kernels import attention_decode as ad

SHAPES = [
    (b, h, sq, skv, d)
    for d in (64, 128)
    for (b, h) in ((1, 8), (4, 16))
    for sq in (1, 16)
    for skv in (1024, 4096)
]


def _next_query(args, res):
    return (res[0], *args[1:])


def main(only: list[str]) -> None:
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    for b, h, sq, skv, d in SHAPES:
        case = f"b{b}-h{h}-sq{sq}-skv{skv}-d{d}"
        if only and not any(o in case for o in only):
            continue
        spec, args, sets = ba._decode_operands(b, sq, skv, h, h, d, False)
        fns = {
            "xla": jax.jit(lambda q, k, v: (jax.nn.dot_product_attention(q, k, v),)),
            "ts_auto": jax.jit(lambda q, k, v: (ts.flash_attention(q, k, v),)),
        }
        configs = {
            f"triton[split={n}]": ad.DecodeConfig(split_keys=n)
            for n in (skv // 16, skv // 8, skv // 4, skv // 2, skv)
            if n >= 128
        }
        configs.update({f"triton[warps={w}]": ad.DecodeConfig(num_warps=w) for w in (2, 8)})
        configs["triton[bkv=64]"] = ad.DecodeConfig(block_kv=64)
        for name, cfg in configs.items():
            fns[name] = jax.jit(functools.partial(ad.decode_fwd, spec, config=cfg))
        for rnd in range(2):
            try:
                ba._time_variants(f"{case}#{rnd}", fns, args, "xla", None, sets, _next_query)
            except Exception as e:
                print("FAIL", case, str(e).splitlines()[0][:300], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
