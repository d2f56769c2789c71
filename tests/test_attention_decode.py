"""The decode forward in Pallas' Triton backend (``pallas_kernels/attention_decode.py``)
against the float64 reference, in the interpreter: GQA groups folded into the rows, ragged
caches split into chunks, key lengths and a causal mask, bitwise repeatability, and the
lse the backward kernels read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_decode as ad
from tests._util import assert_close, cuda_lowering, f64, rand
from tests.test_attention import np_attention


def _spec(causal, d, **features):
    return AttentionSpec(causal=causal, scale=d**-0.5, config=FlashAttentionConfig(), **features)


def _np_lse(q, k, causal, scale, lengths):
    g = q.shape[2] // k.shape[2]
    kk = np.repeat(k, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    sq, skv = q.shape[1], k.shape[1]
    vis = np.arange(skv)[None, None, None, :] < lengths[:, None, None, None]
    if causal:
        vis = vis & (np.arange(skv)[None, :] <= np.arange(sq)[:, None] + skv - sq)
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
    with np.errstate(divide="ignore"):
        return p, np.log(p.sum(-1)) + np.where(np.isfinite(m), m, 0)[..., 0]


def _check(b, sq, skv, hq, hkv, d, causal, split, lengths, dtype, *, interpret):
    """The kernel's output and lse against float64, and a second run's bits."""
    q, k, v = (
        rand((b, sq, hq, d), dtype),
        rand((b, skv, hkv, d), dtype),
        rand((b, skv, hkv, d), dtype),
    )
    kv_len = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    spec = _spec(causal, d, has_kv_lengths=kv_len is not None)
    run = jax.jit(lambda *a: ad.decode_fwd(spec, *a, split_keys=split, interpret=interpret))
    out, lse = run(q, k, v, kv_len)
    out2, lse2 = run(q, k, v, kv_len)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
    n = np.full((b,), skv) if lengths is None else np.asarray(lengths)
    p, want_lse = _np_lse(f64(q), f64(k), causal, d**-0.5, n)
    g = hq // hkv
    want = np.einsum(
        "bhqk,bkhd->bqhd",
        p / np.maximum(p.sum(-1, keepdims=True), 1e-300),
        np.repeat(f64(v), g, axis=2),
    )
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, sq)
    empty = np.isneginf(want_lse)
    np.testing.assert_array_equal(np.isneginf(f64(lse)), empty)
    np.testing.assert_allclose(f64(lse)[~empty], want_lse[~empty], rtol=0, atol=2e-2)
    assert not np.any(f64(out)[np.swapaxes(empty, 1, 2)])
    if lengths is None and not causal:
        assert_close(out, np_attention(f64(q), f64(k), f64(v)), dtype, factor=2.0)
    assert_close(out, want, dtype, factor=2.0)


class TestDecodeInterpret:
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    @pytest.mark.parametrize(
        "b, sq, skv, hq, hkv, d, causal, split, lengths",
        [
            (2, 1, 200, 2, 2, 64, False, 64, None),  # 4 chunks, the last ragged
            (1, 3, 130, 4, 1, 64, True, None, None),  # MQA group folded, one chunk, causal
            (2, 2, 256, 4, 2, 128, False, 128, (256, 97)),  # key lengths end mid-chunk
            (2, 1, 192, 2, 2, 64, True, 64, (0, 150)),  # an entry with no keys
        ],
    )
    def test_matches_float64(self, b, sq, skv, hq, hkv, d, causal, split, lengths, dtype):
        _check(b, sq, skv, hq, hkv, d, causal, split, lengths, dtype, interpret=True)


@pytest.mark.gpu
class TestDecodeGPU:
    """The interpreter's cases at decode shapes, compiled."""

    @pytest.mark.parametrize(
        "b, sq, skv, hq, hkv, d, causal, split, lengths",
        [
            (1, 16, 4096, 8, 8, 128, False, None, None),
            (1, 1, 4096, 32, 8, 128, False, 256, None),
            (2, 1, 32768, 32, 8, 128, True, None, (32768, 20000)),
            (4, 8, 4096, 16, 16, 64, True, 512, (4096, 3000, 1, 0)),
        ],
    )
    def test_matches_float64(self, b, sq, skv, hq, hkv, d, causal, split, lengths):
        _check(b, sq, skv, hq, hkv, d, causal, split, lengths, jnp.bfloat16, interpret=False)


@pytest.mark.parametrize(
    "features, why",
    [
        (dict(has_mask=True), "a mask"),
        (dict(local_window_size=(4, 0)), "a window"),
    ],
)
def test_decode_declines(features, why):
    q = jax.ShapeDtypeStruct((1, 1, 2, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    assert why in ad.decode_reason(_spec(False, 64, **features), q, k)
    huge = jax.ShapeDtypeStruct((8, 2**21, 2, 64), jnp.bfloat16)
    assert "int32" in ad.decode_reason(_spec(False, 64), q, huge)
    assert "rows" in ad.decode_reason(
        _spec(False, 64), jax.ShapeDtypeStruct((1, 17, 8, 64), jnp.bfloat16), k
    )


@pytest.mark.parametrize("d, split", [(64, 64), (128, None)])
def test_decode_lowers_for_cuda(d, split):
    """The kernel goes through Pallas' Triton lowering (built on this CPU machine)."""
    spec = _spec(True, d, has_kv_lengths=True)
    q, k = rand((2, 2, 8, d), jnp.bfloat16), rand((2, 4096, 2, d), jnp.bfloat16)
    lengths = jnp.asarray([4096, 1000], jnp.int32)
    text = cuda_lowering(lambda *a: ad.decode_fwd(spec, *a, split_keys=split), q, k, k, lengths)
    assert "__gpu$xla.gpu.triton" in text
