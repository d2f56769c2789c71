"""Probe: D64 causal short rows whose every block may be masked (segment ids, a key-padding
mask, a mask or a bias of a row per query), 128 keys a step on the grid the default picks
(persistent but for the mask and bias): the serial loop (the default of f45f527) against
the pipelined one, forward alone against cuDNN, bits compared. It decided that
_fwd_pipelined's short-causal rule takes segment ids. Reuses
fwd_qlengths_d64_loop_probe.py's run(); cuDNN takes no key-padding mask, so that case's
baseline is cuDNN with the equivalent key lengths (less work: it skips the padded
blocks).

    PYTHONUNBUFFERED=1 python3 benchmarks/archive/d64_masked_loop_probe.py
"""

import sys

sys.path.insert(0, ".")

import jax.numpy as jnp

from benchmarks import attention as bench

src = open("benchmarks/archive/fwd_qlengths_d64_loop_probe.py").read()
probe = {}
exec(src[: src.index("for b, s in")], probe)  # its imports and run()
run = probe["run"]

_nn_kwargs = bench._jax_nn_kwargs


def _cudnn_kwargs(kw, sq, skv):
    # cuDNN takes no (B, 1, 1, S) mask: the key-padding case's baseline gets the
    # equivalent key lengths.
    m = kw.get("mask")
    if m is not None and m.shape[2] == 1:
        return dict(key_value_seq_lengths=m[:, 0, 0, :].sum(-1).astype(jnp.int32))
    return _nn_kwargs(kw, sq, skv)


bench._jax_nn_kwargs = _cudnn_kwargs

for feature in ("segments", "keypad", "mask", "bias"):
    for b, s in ((16, 1024), (8, 2048), (32, 512)):
        variants = {"serial": dict(pipelined=False), "pipelined": dict(pipelined=True)}
        run(f"{feature} B{b} S{s} D64 causal", b, s, 64, feature, True, variants)
