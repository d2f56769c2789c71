"""Probe (run on the GPU host, jax 0.11.2): which persistent-grid forwards jax 0.11.2's
Mosaic GPU interpreter reports a race in, with the producer's proxy fence before refilling
a generically read ring slot (attention_mgpu.FENCE_GENERIC_REFILLS) on or off. Matrix:
head_dim 64/128 x causal or not x feature x tiles a CTA (1 = one CTA per tile on the
persistent grid, 2, 4), interpret mode with race detection, B1 S512 H2. One case per
process (each takes minutes in the interpreter), so a host's cores run them side by side:

    python3 benchmarks/archive/fwd_persistent_race_probe.py 128 causal segments 2 on
    python3 benchmarks/archive/fwd_persistent_race_probe.py --all | xargs -P 14 -L 1 python3
"""

import sys

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from tessera_jax import _compat
from tessera_jax.pallas_kernels import attention_mgpu as am
from tests._util import rand
from tests.test_attention_kernels import _spec

B, S, H = 1, 512, 2
FEATURES = ("segments", "bias", "plain", "window", "kvlen")


def case(d, causal, feature, per_cta):
    q, k, v = (rand((B, S, H, d), jnp.bfloat16) for _ in range(3))
    extras, kw = (), dict(causal=causal)
    if feature == "segments":
        seg = jnp.broadcast_to((jnp.arange(S) >= 3 * S // 4).astype(jnp.int32), (B, S))
        extras, kw = (seg, seg), dict(kw, has_segment_ids=True)
    elif feature == "bias":
        extras, kw = (rand((1, H, S, S), jnp.bfloat16),), dict(kw, has_bias=True)
    elif feature == "window":
        kw = dict(kw, local_window_size=(100, 0))
    elif feature == "kvlen":
        extras, kw = (jnp.array([S - 70], jnp.int32),), dict(kw, has_kv_lengths=True)
    spec = _spec(**kw)
    p = am._with_features(am._fwd_problem(q, k, causal, spec.scale), spec, None)
    ctas = max(1, p.fwd_work // per_cta)
    with _compat.gpu_interpret_mode(detect_races=True):
        out = am.flash_fwd(spec, q, k, v, *extras, interpret=True, persistent=True, ctas=ctas)
        jax.block_until_ready(out)
    return _compat.races_detected()


if sys.argv[1:] == ["--all"]:
    for d in (128, 64):
        for causal in ("causal", "full"):
            for feature in FEATURES:
                for per_cta in (1, 2, 4):
                    print(sys.argv[0], d, causal, feature, per_cta, "on")
    sys.exit()
d, causal, feature, per_cta, fence = sys.argv[1:]
am.FENCE_GENERIC_REFILLS = fence == "on"
try:
    r = case(int(d), causal == "causal", feature, int(per_cta))
except Exception as e:
    r = f"{type(e).__name__}: {str(e)[:160]}"
print(f"jax {jax.__version__} D{d} {causal} {feature} tiles/CTA={per_cta} fence={fence} race={r}")
