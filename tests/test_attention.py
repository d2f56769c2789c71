"""flash_attention: float64 references (masks, GQA/MQA), gradients, vmap/jit, errors, memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import tessera_jax as ts
from tessera_jax.primitives.attention import FlashAttentionConfig, flash_attention_fwd
from tests._util import assert_close, f64, rand

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# (batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, causal, block_kv): sampled, not crossed.
CASES = [
    (2, 16, 16, 4, 4, 8, False, 8),  # MHA, seq a multiple of the block
    (1, 37, 37, 8, 2, 16, True, 16),  # GQA 8→2, causal, seq not a multiple of the block
    (2, 20, 45, 8, 1, 8, True, 16),  # MQA 8→1, seq_q < seq_kv (kv cache), partial last block
    (1, 45, 20, 4, 2, 8, True, 8),  # seq_q > seq_kv: the first 25 queries see no key
    (2, 9, 130, 2, 2, 32, False, 128),  # one full block and a 2-key edge block
    (1, 1, 33, 8, 2, 16, True, 128),  # single-query decode, block clipped to seq_kv
]
IDS = [
    f"b{c[0]}-q{c[1]}-kv{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-bk{c[7]}"
    for c in CASES
]


def np_probs(q, k, causal, scale):
    """float64 softmax(q·kᵀ·scale + mask), (B, Hq, Sq, Skv); query head h reads kv head h // G."""
    sq, hq = q.shape[1:3]
    skv, hkv = k.shape[1:3]
    kv_head = np.arange(hq) // (hq // hkv)
    s = np.einsum("bqhd,bkhd->bhqk", q, k[:, :, kv_head]) * scale
    if causal:  # bottom-right aligned
        visible = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + (skv - sq)
        s = np.where(visible, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isneginf(m), 0.0, m))
    den = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(den == 0, 1.0, den), den, m


def np_attention(q, k, v, causal=False, scale=None):
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    p, _, _ = np_probs(q, k, causal, scale)
    kv_head = np.arange(q.shape[2]) // (q.shape[2] // k.shape[2])
    return np.einsum("bhqk,bkhd->bqhd", p, v[:, :, kv_head])


def np_attention_grads(q, k, v, do, causal=False, scale=None):
    """float64 (dq, dk, dv) of sum(out·do); dk/dv summed over each kv head's query heads."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    hq, hkv = q.shape[2], k.shape[2]
    kv_head = np.arange(hq) // (hq // hkv)
    p, _, _ = np_probs(q, k, causal, scale)
    kk, vv = k[:, :, kv_head], v[:, :, kv_head]
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk_h = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv_h = np.einsum("bhqk,bqhd->bkhd", p, do)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for h in range(hq):
        dk[:, :, kv_head[h]] += dk_h[:, :, h]
        dv[:, :, kv_head[h]] += dv_h[:, :, h]
    return dq, dk, dv


def inputs(case, dtype=jnp.float32):
    b, sq, skv, hq, hkv, d, _, _ = case
    return rand((b, sq, hq, d), dtype), rand((b, skv, hkv, d), dtype), rand((b, skv, hkv, d), dtype)


def attend(case, q, k, v, **kw):
    causal, bk = case[6], case[7]
    return ts.flash_attention(
        q, k, v, causal=causal, config=FlashAttentionConfig(block_kv=bk), **kw
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_float64(case, dtype):
    q, k, v = inputs(case, dtype)
    out = attend(case, q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, np_attention(f64(q), f64(k), f64(v), case[6]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES[1:4], ids=IDS[1:4])
def test_gradients_match_float64(case, dtype):
    q, k, v = inputs(case, dtype)
    do = rand(q.shape, dtype)
    _, vjp = jax.vjp(lambda q, k, v: attend(case, q, k, v), q, k, v)
    got = vjp(do)
    want = np_attention_grads(f64(q), f64(k), f64(v), f64(do), case[6])
    for name, g, w, x in zip("qkv", got, want, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape, name
        assert_close(g, w)


def test_lse_and_custom_scale():
    case = CASES[1]
    q, k, v = inputs(case)
    out, lse = flash_attention_fwd(q, k, v, causal=True, scale=0.3)
    _, den, m = np_probs(f64(q), f64(k), True, 0.3)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == jnp.float32
    assert_close(lse, (np.log(den) + m)[..., 0])
    assert_close(out, np_attention(f64(q), f64(k), f64(v), True, 0.3))


def test_causal_square_is_the_lower_triangle():
    q, k, v = inputs((1, 12, 12, 2, 2, 8, True, 4))
    out = ts.flash_attention(q, k, v, causal=True, config=FlashAttentionConfig(block_kv=4))
    for i in (0, 5, 11):  # query i attends to keys 0..i only
        want = ts.flash_attention(q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1])
        np.testing.assert_allclose(out[:, i : i + 1], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_give_zeros_and_zero_gradients(dtype):
    case = (1, 10, 4, 4, 2, 8, True, 2)  # queries 0..5 see no key (bottom-right alignment)
    q, k, v = inputs(case, dtype)
    out, lse = flash_attention_fwd(q, k, v, causal=True, config=FlashAttentionConfig(block_kv=2))
    np.testing.assert_array_equal(f64(out[:, :6]), np.zeros((1, 6, 4, 8)))
    assert np.all(np.isneginf(f64(lse[:, :, :6]))) and np.all(np.isfinite(f64(lse[:, :, 6:])))
    assert np.all(np.isfinite(f64(out)))
    dq, dk, dv = jax.grad(
        lambda q, k, v: jnp.sum(attend(case, q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)
    )(q, k, v)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(f64(g)))
    np.testing.assert_array_equal(f64(dq[:, :6]), np.zeros((1, 6, 4, 8)))


@pytest.mark.parametrize("b,sq,skv", [(0, 4, 4), (1, 0, 4), (1, 4, 0)])
def test_empty_batch_or_sequences(b, sq, skv):
    q, k = rand((b, sq, 2, 8)), rand((b, skv, 1, 8))
    out = ts.flash_attention(q, k, k, causal=True)
    np.testing.assert_array_equal(out, np.zeros(q.shape))  # no key visible: zeros
    dq, dk = jax.grad(lambda q, k: jnp.sum(ts.flash_attention(q, k, k)), argnums=(0, 1))(q, k)
    assert dq.shape == q.shape and dk.shape == k.shape


def test_check_grads_reverse_mode(x64):
    for case in (CASES[1], CASES[3]):
        q, k, v = (x.astype(jnp.float64) for x in inputs(case))
        check_grads(lambda q, k, v, c=case: attend(c, q, k, v), (q, k, v), order=1, modes=("rev",))


def test_forward_mode_raises_a_clear_error():
    q, k, v = inputs(CASES[0])
    with pytest.raises(TypeError, match="flash_attention is differentiable in reverse mode only"):
        jax.jvp(lambda q: ts.flash_attention(q, k, v), (q,), (q,))
    with pytest.raises(TypeError, match="reverse mode only"):
        jax.jacfwd(lambda q: ts.flash_attention(q, k, v))(q)


def test_vmap_jit_and_vmap_of_grad():
    case = CASES[2]
    b, sq, skv, hq, hkv, d, causal, _ = case
    qs = rand((3, b, sq, hq, d))
    k, v = rand((b, skv, hkv, d)), rand((b, skv, hkv, d))
    f = lambda q, k, v: attend(case, q, k, v)
    want = np.stack([np_attention(f64(qs[i]), f64(k), f64(v), causal) for i in range(3)])
    assert_close(jax.vmap(f, in_axes=(0, None, None))(qs, k, v), want)
    # the mapped dimension anywhere, on any operand
    q_last = jnp.moveaxis(qs, 0, -1)
    got = jax.vmap(f, in_axes=(4, None, None), out_axes=2)(q_last, k, v)
    assert_close(jnp.moveaxis(got, 2, 0), want)
    ks, vs = rand((b, 3, skv, hkv, d)), rand((b, skv, hkv, d, 3))
    got = jax.vmap(f, in_axes=(0, 1, 4))(qs, ks, vs)
    want_kv = [np_attention(f64(qs[i]), f64(ks[:, i]), f64(vs[..., i]), causal) for i in range(3)]
    assert_close(got, np.stack(want_kv))
    assert_close(jax.jit(f)(qs[0], k, v), want[0])
    # vmap of grad: per-example dk (k unbatched) equals the single-example grads
    loss = lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
    gq, gk = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None, None))(qs, k, v)
    assert gk.shape == (3, *k.shape)
    for i in range(3):
        eq, ek = jax.grad(loss, argnums=(0, 1))(qs[i], k, v)
        np.testing.assert_allclose(gq[i], eq, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gk[i], ek, rtol=1e-5, atol=1e-6)
    # grad of vmap sums the per-example dk
    gk_sum = jax.grad(lambda k: jnp.sum(jax.vmap(loss, in_axes=(0, None, None))(qs, k, v)))(k)
    np.testing.assert_allclose(gk_sum, jnp.sum(gk, 0), rtol=1e-5, atol=1e-5)


def test_jaxpr_shows_the_primitives():
    q, k, v = inputs(CASES[1])
    f = lambda q: ts.flash_attention(q, k, v, causal=True)
    assert "ts_flash_attention_fwd" in str(jax.make_jaxpr(f)(q))
    grad_jaxpr = str(jax.make_jaxpr(jax.grad(lambda q: jnp.sum(f(q))))(q))
    assert "ts_flash_attention_fwd" in grad_jaxpr and "ts_flash_attention_bwd" in grad_jaxpr


def _temp_bytes(f, s):
    x = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.float32)
    stats = jax.jit(f).lower(x, x, x).compile().memory_analysis()
    if stats is None:
        pytest.skip("memory_analysis() is unavailable on this backend")
    return stats.temp_size_in_bytes


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_memory_is_linear_in_seq(causal):
    fwd = lambda q, k, v: ts.flash_attention(q, k, v, causal=causal)
    bwd = jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v)), argnums=(0, 1, 2))
    s = 4096
    for f in (fwd, bwd):
        big, small = _temp_bytes(f, s), _temp_bytes(f, s // 2)
        assert big < s * s * 4, f"temp {big} bytes holds an S×S f32 buffer ({s * s * 4} bytes)"
        # O(S·block): doubling S grows the scratch by O(S); one S×S f32 buffer would
        # grow it by 4·(S² − (S/2)²) bytes (backends add a constant workspace, e.g. cuBLAS's).
        growth = big - small
        assert growth < (s * s - (s // 2) ** 2) * 4 // 4, f"scratch grew by {growth} bytes"


def test_memory_check_catches_a_materialised_score_matrix():
    # The control: attention that builds S×S scores fails the check above.
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")
    s = 4096
    assert _temp_bytes(plain, s) - _temp_bytes(plain, s // 2) >= (s * s - (s // 2) ** 2) * 4


def test_bad_inputs():
    q, k, v = inputs((2, 8, 8, 4, 2, 16, False, 8))
    fa = ts.flash_attention
    with pytest.raises(ValueError, match=r"flash_attention: q.shape=\(8, 4, 16\) must have rank 4"):
        fa(q[0], k, v)
    with pytest.raises(
        ValueError, match=r"flash_attention: k.shape\[0\]=1 \(batch\) must equal q.shape\[0\]=2"
    ):
        fa(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"k.shape\[3\]=8 \(head_dim\) must equal q.shape\[3\]=16"):
        fa(q, k[..., :8], v[..., :8])
    with pytest.raises(
        ValueError, match=r"k.shape=\(2, 8, 2, 16\) must equal v.shape=\(2, 7, 2, 16\)"
    ):
        fa(q, k, v[:, :7])
    with pytest.raises(
        ValueError,
        match=r"query heads q.shape\[2\]=4 must be a multiple of the kv heads k.shape\[2\]=3",
    ):
        fa(q, rand((2, 8, 3, 16)), rand((2, 8, 3, 16)))
    with pytest.raises(
        TypeError, match="q.dtype=float32, k.dtype=bfloat16, v.dtype=float32 must be equal"
    ):
        fa(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(TypeError, match="flash_attention: q.dtype=int32 is not supported"):
        fa(q.astype(jnp.int32), k, v)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(
            ValueError, match="flash_attention: scale=.* must be a positive finite float"
        ):
            fa(q, k, v, scale=bad)
    with pytest.raises(TypeError, match="flash_attention: scale=.* must be a Python float"):
        fa(q, k, v, scale=jnp.float32(0.5) * jnp.ones(()))
    with pytest.raises(TypeError, match="flash_attention: causal=1 must be a bool"):
        fa(q, k, v, causal=1)
    with pytest.raises(TypeError, match="config=.* must be a FlashAttentionConfig"):
        fa(q, k, v, config={"block_kv": 64})
    with pytest.raises(ValueError, match="FlashAttentionConfig: block_kv=0 must be ≥ 1"):
        FlashAttentionConfig(block_kv=0)
    with pytest.raises(TypeError, match="FlashAttentionConfig: block_q=64.0 must be an int"):
        FlashAttentionConfig(block_q=64.0)
