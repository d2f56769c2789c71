"""flash_attention: float64 references (masks, bias, lengths, window, segments, GQA/MQA,
decode), gradients, forward mode, vmap/jit, errors, memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import tessera_jax as ts
from tessera_jax.contracts import attention as contracts
from tessera_jax.primitives import attention as _attention
from tessera_jax.primitives.attention import FlashAttentionConfig, flash_attention_fwd
from tests._util import assert_close, f64, key, rand, sample

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
    p, _, _ = np_probs(q, k, causal, scale)
    return np_backward(p, q, k, v, do, scale)[:3]


def np_backward(p, q, k, v, do, scale):
    """float64 ``(dq, dk, dv, ds)`` from the probabilities ``p: (B, Hq, Sq, Skv)``; dk/dv
    summed over each kv head's query heads."""
    hq = q.shape[2]
    kv_head = np.arange(hq) // (hq // k.shape[2])
    dp = np.einsum("bqhd,bkhd->bhqk", do, v[:, :, kv_head])
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k[:, :, kv_head]) * scale
    dk_h = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv_h = np.einsum("bhqk,bqhd->bkhd", p, do)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for h in range(hq):
        dk[:, :, kv_head[h]] += dk_h[:, :, h]
        dv[:, :, kv_head[h]] += dv_h[:, :, h]
    return dq, dk, dv, ds


def inputs(case, dtype=jnp.float32):
    b, sq, skv, hq, hkv, d, _, _ = case
    return rand((b, sq, hq, d), dtype), rand((b, skv, hkv, d), dtype), rand((b, skv, hkv, d), dtype)


def attend(case, q, k, v, **kw):
    causal, bk = case[6], case[7]
    return ts.flash_attention(
        q, k, v, causal=causal, config=FlashAttentionConfig(block_kv=bk), **kw
    )


@pytest.mark.parametrize("case,dtype", sample([(c, d) for c in CASES for d in DTYPES], 4))
def test_forward_matches_float64(case, dtype):
    q, k, v = inputs(case, dtype)
    out = attend(case, q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, np_attention(f64(q), f64(k), f64(v), case[6]))


@pytest.mark.parametrize("case,dtype", sample([(c, d) for c in CASES[1:4] for d in DTYPES], 2))
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


@pytest.mark.parametrize("dtype", sample(DTYPES, 1))
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


# (more than 32 keys: the CPU's fixed-point normaliser sums them in two stages)
@pytest.mark.parametrize("b,sq,skv", [(0, 4, 4), (1, 0, 4), (1, 4, 0), (0, 4, 40), (1, 0, 40)])
def test_empty_batch_or_sequences(b, sq, skv):
    q, k = rand((b, sq, 2, 8)), rand((b, skv, 1, 8))
    out = ts.flash_attention(q, k, k, causal=True)
    np.testing.assert_array_equal(out, np.zeros(q.shape))  # no key visible: zeros
    dq, dk = jax.grad(lambda q, k: jnp.sum(ts.flash_attention(q, k, k)), argnums=(0, 1))(q, k)
    assert dq.shape == q.shape and dk.shape == k.shape
    # every option, with empty operands of its own
    kw = dict(
        mask=jnp.ones((b, 1, sq, skv), bool),
        query_seq_lengths=jnp.full((b,), sq, jnp.int32),
        key_value_seq_lengths=jnp.full((b,), skv, jnp.int32),
        local_window_size=1,
        q_segment_ids=jnp.zeros((b, sq), jnp.int32),
        kv_segment_ids=jnp.zeros((b, skv), jnp.int32),
    )
    f = lambda q, k, bias: ts.flash_attention(q, k, k, bias, causal=True, **kw)
    bias = rand((1, 2, sq, skv))
    out, grads = jax.jit(lambda *a: jax.value_and_grad(lambda *a: jnp.sum(f(*a)), (0, 1, 2))(*a))(
        q, k, bias
    )
    assert [g.shape for g in grads] == [q.shape, k.shape, bias.shape] and out == 0


def test_check_grads_forward_and_reverse_mode(x64):
    for case in (CASES[1], CASES[3]):
        q, k, v = (x.astype(jnp.float64) for x in inputs(case))
        f = lambda q, k, v, c=case: attend(c, q, k, v)
        check_grads(jax.jit(f), (q, k, v), order=1, modes=("fwd", "rev"))


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


# Long enough that an S×S buffer dwarfs the reference's per-head block of scores
# (REFERENCE_BLOCK_ELEMENTS, 256 keys at this length; on the CPU 128).
MEMORY_SEQ = 16384


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
    s = MEMORY_SEQ
    for f in (fwd, bwd):
        big, small = _temp_bytes(f, s), _temp_bytes(f, s // 2)
        assert big < s * s * 4, f"temp {big} bytes holds an S×S f32 buffer ({s * s * 4} bytes)"
        # O(S·block): doubling S grows the scratch by O(S); one S×S f32 buffer would
        # grow it by 4·(S² − (S/2)²) bytes (backends add a constant workspace, e.g. cuBLAS's).
        growth = big - small
        assert growth < (s * s - (s // 2) ** 2) * 4 // 4, f"scratch grew by {growth} bytes"


def _option_temp_bytes(f, s):
    x = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 1, s, s), jnp.bool_)
    bias = jax.ShapeDtypeStruct((1, 1, 1, s), jnp.float32)
    stats = jax.jit(f).lower(x, x, x, mask, bias).compile().memory_analysis()
    if stats is None:
        pytest.skip("memory_analysis() is unavailable on this backend")
    return stats.temp_size_in_bytes


def _attend_all_options(q, k, v, mask, bias):
    n = jnp.full((1,), q.shape[1] - 3, jnp.int32)
    kw = dict(causal=True, local_window_size=(512, 0), key_value_seq_lengths=n)
    return ts.flash_attention(q, k, v, bias, mask, **kw)


@pytest.mark.parametrize("mode", ["fwd", "rev", "jvp"])
def test_compiled_memory_with_options_is_linear_in_seq(mode):
    """A user's S×S mask is read per block: no S×S copy (not even of bools) in any mode."""
    f = {
        "fwd": _attend_all_options,
        "rev": jax.grad(lambda *a: jnp.sum(_attend_all_options(*a)), argnums=(0, 1, 2, 4)),
        "jvp": lambda q, k, v, m, b: jax.jvp(
            lambda q, k, b: _attend_all_options(q, k, v, m, b), (q, k, b), (q, k, b)
        )[1],
    }[mode]
    s = MEMORY_SEQ
    big, small = _option_temp_bytes(f, s), _option_temp_bytes(f, s // 2)
    assert big < s * s, f"temp {big} bytes holds an S×S bool buffer ({s * s} bytes)"
    assert big - small < (s * s - (s // 2) ** 2), f"scratch grew by {big - small} bytes"


def test_memory_check_catches_a_materialised_score_matrix():
    # The control: attention that builds S×S scores fails the check above.
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")
    s = MEMORY_SEQ
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


# --- jax.nn.dot_product_attention's options ---------------------------------------------


def np_visible(b, sq, skv, hq, opts):
    """float64-reference visibility ``(B, Hq, Sq, Skv)`` of the options in ``opts``."""
    qi = np.arange(sq)[:, None]
    kj = np.arange(skv)[None, :]
    diag = qi + (skv - sq)  # bottom-right alignment
    vis = np.ones((b, hq, sq, skv), bool)
    if opts.get("causal"):
        vis &= kj <= diag
    if opts.get("local_window_size") is not None:
        w = opts["local_window_size"]
        left, right = (w, w) if isinstance(w, int) else w
        vis &= (kj >= diag - left) & (kj <= diag + right)
    if opts.get("query_seq_lengths") is not None:
        vis &= (np.arange(sq)[None, :] < np.asarray(opts["query_seq_lengths"])[:, None])[
            :, None, :, None
        ]
    if opts.get("key_value_seq_lengths") is not None:
        vis &= (np.arange(skv)[None, :] < np.asarray(opts["key_value_seq_lengths"])[:, None])[
            :, None, None, :
        ]
    if opts.get("q_segment_ids") is not None:
        qs, ks = np.asarray(opts["q_segment_ids"]), np.asarray(opts["kv_segment_ids"])
        vis &= (qs[:, :, None] == ks[:, None, :])[:, None]
    if opts.get("mask") is not None:
        m = np.asarray(opts["mask"])
        vis &= m.reshape((1,) * (4 - m.ndim) + m.shape)
    return vis


def np_dense(q, k, v, opts, *, do=None, tangents=None):
    """float64 dense attention with ``opts``: ``(out, lse)``, plus ``(dq, dk, dv, dbias)``
    of ``sum(out·do)`` when ``do`` is given, or ``(t_out, t_lse)`` for ``tangents``."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1:3]
    scale = opts.get("scale") or 1 / np.sqrt(d)
    kv_head = np.arange(hq) // (hq // hkv)
    kk, vv = k[:, :, kv_head], v[:, :, kv_head]
    bias = opts.get("bias")
    bias = None if bias is None else f64(bias).reshape((1,) * (4 - np.ndim(bias)) + bias.shape)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale + (0 if bias is None else bias)
    vis = np_visible(b, sq, skv, hq, opts)
    s = np.where(vis, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True) if skv else np.full((b, hq, sq, 1), -np.inf)
    e = np.exp(s - np.where(np.isneginf(m), 0.0, m))
    den = np.sum(e, axis=-1, keepdims=True)
    p = e / np.where(den == 0, 1.0, den)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)
    with np.errstate(divide="ignore"):
        lse = (np.log(den) + np.where(np.isneginf(m), 0.0, m))[..., 0]
    if tangents is not None:
        tq, tk, tv, tb = tangents
        ts_ = np.einsum("bqhd,bkhd->bhqk", tq, kk) + np.einsum(
            "bqhd,bkhd->bhqk", q, tk[:, :, kv_head]
        )
        ts_ = ts_ * scale + (0 if tb is None else tb.reshape((1,) * (4 - tb.ndim) + tb.shape))
        t_lse = np.sum(p * ts_, axis=-1, keepdims=True)
        t_out = np.einsum("bhqk,bkhd->bqhd", p * (ts_ - t_lse), vv)
        t_out += np.einsum("bhqk,bkhd->bqhd", p, tv[:, :, kv_head])
        return (out, lse), (t_out, t_lse[..., 0])
    if do is None:
        return out, lse
    dq, dk, dv, ds = np_backward(p, q, k, v, do, scale)
    dbias = None
    if bias is not None:
        axes = tuple(a for a in range(4) if bias.shape[a] == 1)
        dbias = np.sum(ds, axis=axes, keepdims=True).reshape(opts["bias"].shape)
    return (out, lse), (dq, dk, dv, dbias)


def _rand_mask(shape, density=0.7):
    return jax.random.uniform(key(), shape) < density


def _rand_lengths(b, n, lo):
    return jnp.asarray(np.linspace(lo, n, b).round().astype(np.int32))


def _option_cases():
    """(name, (b, sq, skv, hq, hkv, d, block), option factory): sampled, not crossed."""

    def opts(**kw):
        return lambda: kw

    return [
        (
            "mask-B1TS-bias-1HTS-causal-gqa",
            (2, 24, 24, 4, 2, 8, 8),
            lambda: dict(mask=_rand_mask((2, 1, 24, 24)), bias=rand((1, 4, 24, 24)), causal=True),
        ),
        (
            "bias-B11S-mask-TS",
            (2, 16, 24, 2, 1, 8, 16),
            lambda: dict(bias=rand((2, 1, 1, 24)), mask=_rand_mask((16, 24), 0.8)),
        ),
        (
            "ragged-lengths-s200-b64-causal",
            (3, 200, 200, 2, 1, 8, 64),
            lambda: dict(
                causal=True,
                query_seq_lengths=_rand_lengths(3, 200, 90),
                key_value_seq_lengths=_rand_lengths(3, 200, 130),
            ),
        ),
        ("window-3-2", (1, 30, 30, 2, 2, 8, 8), opts(local_window_size=(3, 2))),
        (
            "segments-window-causal-gqa",
            (2, 24, 24, 4, 2, 8, 8),
            lambda: dict(
                causal=True,
                local_window_size=5,
                q_segment_ids=jnp.asarray(np.repeat([[0, 1, 1, 2]], 2, 0).repeat(6, 1)),
                kv_segment_ids=jnp.asarray(np.repeat([[0, 1, 1, 2]], 2, 0).repeat(6, 1)),
            ),
        ),
        (
            "decode-q4-kv150-lengths-causal",
            (2, 4, 150, 8, 2, 16, 64),
            lambda: dict(causal=True, key_value_seq_lengths=jnp.asarray([150, 97], jnp.int32)),
        ),
        (
            "decode-q1-mqa-window-bias",
            (2, 1, 70, 4, 1, 8, 32),
            lambda: dict(local_window_size=(20, 0), bias=rand((1, 4, 1, 70))),
        ),
        (
            "everything",
            (2, 40, 48, 4, 2, 8, 16),
            lambda: dict(
                causal=True,
                mask=_rand_mask((2, 4, 40, 48), 0.9),
                bias=rand((4, 1, 48)),
                query_seq_lengths=jnp.asarray([40, 33], jnp.int32),
                key_value_seq_lengths=jnp.asarray([41, 48], jnp.int32),
                local_window_size=(30, 4),
                q_segment_ids=jnp.asarray(np.repeat([[0] * 25 + [1] * 15], 2, 0)),
                kv_segment_ids=jnp.asarray(np.repeat([[0] * 30 + [1] * 18], 2, 0)),
            ),
        ),
    ]


OPTION_CASES = _option_cases()
OPTION_IDS = [c[0] for c in OPTION_CASES]


def _option_inputs(dims, dtype):
    b, sq, skv, hq, hkv, d, _ = dims
    return rand((b, sq, hq, d), dtype), rand((b, skv, hkv, d), dtype), rand((b, skv, hkv, d), dtype)


def _attend_opts(dims, opts):
    cfg = FlashAttentionConfig(block_kv=dims[6])
    return lambda q, k, v, bias=None: ts.flash_attention(
        q, k, v, **{**opts, "bias": bias if bias is not None else opts.get("bias")}, config=cfg
    )


def _attend_and_vjp(dims, opts):
    """One jitted function: the output and the gradients of ``sum(out·do)`` with respect to
    ``q, k, v`` (and the bias when there is one)."""
    f = _attend_opts(dims, opts)
    bias = opts.get("bias")
    primals = (lambda q, k, v: (q, k, v)) if bias is None else (lambda q, k, v: (q, k, v, bias))

    def run(q, k, v, do):
        out, vjp = jax.vjp(f, *primals(q, k, v))
        return out, vjp(do)

    return jax.jit(run)


# Every case in f32, the one with every option in bf16 too.
OPTION_GRID = [(*c, jnp.float32) for c in OPTION_CASES] + [(*OPTION_CASES[-1], jnp.bfloat16)]


# The case with every option (f32 and bf16) always runs; a sample of the others.
_OPTION_PARAMS = [pytest.param(*c, id=f"{c[0]}-{np.dtype(c[3]).name}") for c in OPTION_GRID]


@pytest.mark.parametrize(
    "name,dims,make,dtype", [*sample(_OPTION_PARAMS[:-2], 1), *_OPTION_PARAMS[-2:]]
)
def test_options_forward_and_gradients_match_float64(name, dims, make, dtype):
    opts = make()
    q, k, v = _option_inputs(dims, dtype)
    do = rand(q.shape, dtype)
    out, got = _attend_and_vjp(dims, opts)(q, k, v, do)
    (want_out, _), want_grads = np_dense(f64(q), f64(k), f64(v), opts, do=f64(do))
    assert out.dtype == dtype
    assert_close(out, want_out)
    for g, w, x in zip(got, want_grads, (q, k, v, opts.get("bias"))):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(g, w, dtype)


@pytest.mark.parametrize(
    "name,dims,make",
    [c for c in OPTION_CASES if c[0] in ("bias-B11S-mask-TS", "everything")],
    ids=["bias-B11S-mask-TS", "everything"],
)
def test_options_forward_mode_and_lse_match_float64(name, dims, make):
    opts = make()
    q, k, v = _option_inputs(dims, jnp.float32)
    tq, tk, tv = _option_inputs(dims, jnp.float32)
    bias = opts.get("bias")
    tb = None if bias is None else rand(bias.shape)
    cfg = FlashAttentionConfig(block_kv=dims[6])
    rest = {n: x for n, x in opts.items() if n != "bias"}
    f = lambda q, k, v, bias: flash_attention_fwd(q, k, v, bias, config=cfg, **rest)
    c = rand((dims[0], dims[3], dims[1]))  # a cotangent of lse

    @jax.jit
    def run(q, k, v, bias, tq, tk, tv, tb):
        primals_out, tangents_out = jax.jvp(f, (q, k, v, bias), (tq, tk, tv, tb))
        lse_loss = lambda *a: jnp.sum(jnp.where(jnp.isfinite(f(*a)[1]), f(*a)[1], 0) * c)
        return primals_out, tangents_out, jax.grad(lse_loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    (out, lse), (t_out, t_lse), lse_grads = run(q, k, v, bias, tq, tk, tv, tb)
    tans = (f64(tq), f64(tk), f64(tv), None if tb is None else f64(tb))
    (w_out, w_lse), (w_tout, w_tlse) = np_dense(f64(q), f64(k), f64(v), opts, tangents=tans)
    assert_close(out, w_out)
    finite = np.isfinite(w_lse)
    np.testing.assert_array_equal(np.isfinite(f64(lse)), finite)
    assert_close(np.where(finite, f64(lse), 0), np.where(finite, w_lse, 0))
    assert_close(t_out, w_tout)
    assert_close(t_lse, w_tlse)
    # The lse cotangent (the backward primitive's dlse operand): <grad, t> = <c, t_lse>.
    inner = sum(np.vdot(f64(g), t) for g, t in zip(lse_grads, tans) if t is not None)
    np.testing.assert_allclose(inner, np.vdot(f64(c), np.where(finite, w_tlse, 0)), rtol=1e-4)


@pytest.mark.parametrize("causal", sample([True, False], 1))
def test_options_match_jax_nn_dot_product_attention(causal):
    """Where both define the result (Sq == Skv, every row sees a key), ours is jax.nn's."""
    b, s, hq, hkv, d = 2, 24, 4, 2, 8
    q, k, v = _option_inputs((b, s, s, hq, hkv, d, 8), jnp.float32)
    mask = _rand_mask((b, 1, s, s), 0.6) | jnp.eye(s, dtype=bool)[None, None]
    kw = dict(
        bias=rand((1, hq, s, s)),
        mask=mask,
        query_seq_lengths=jnp.asarray([24, 17], jnp.int32),
        key_value_seq_lengths=jnp.asarray([24, 19], jnp.int32),
        local_window_size=(6, 3),
    )
    want = jax.nn.dot_product_attention(q, k, v, **kw, is_causal=causal)
    got = ts.flash_attention(q, k, v, **kw, causal=causal, config=FlashAttentionConfig(block_kv=8))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_check_grads_with_options_forward_and_reverse(x64):
    dims = (1, 12, 20, 4, 2, 8, 8)
    q, k, v = (x.astype(jnp.float64) for x in _option_inputs(dims, jnp.float32))
    bias = rand((1, 4, 12, 1), jnp.float32).astype(jnp.float64)
    opts = dict(
        causal=True, mask=_rand_mask((12, 20), 0.8), key_value_seq_lengths=jnp.asarray([17])
    )
    f = lambda q, k, v, bias: ts.flash_attention(
        q, k, v, bias, **opts, local_window_size=(9, 1), config=FlashAttentionConfig(block_kv=8)
    )
    check_grads(jax.jit(f), (q, k, v, bias), order=1, modes=("fwd", "rev"))


def test_jacfwd_equals_jacrev_and_jaxprs():
    dims = (1, 5, 7, 2, 1, 4, 4)
    q, k, v = _option_inputs(dims, jnp.float32)
    bias = rand((1, 1, 5, 7))
    f = lambda q, bias: ts.flash_attention(
        q, k, v, bias, causal=True, config=FlashAttentionConfig(block_kv=4)
    )
    jf = jax.jit(jax.jacfwd(f, argnums=(0, 1)))(q, bias)
    jr = jax.jit(jax.jacrev(f, argnums=(0, 1)))(q, bias)
    for a, b in zip(jf, jr):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # jvp runs the blocked JVP primitive; grad transposes it into the backward primitive.
    jvp_jaxpr = str(jax.make_jaxpr(lambda q: jax.jvp(lambda q: f(q, bias), (q,), (q,)))(q))
    assert "ts_flash_attention_jvp" in jvp_jaxpr and "ts_flash_attention_bwd" not in jvp_jaxpr
    grad_jaxpr = str(jax.make_jaxpr(jax.grad(lambda q: jnp.sum(f(q, bias))))(q))
    assert "ts_flash_attention_bwd" in grad_jaxpr and "ts_flash_attention_jvp" not in grad_jaxpr
    with pytest.raises(NotImplementedError, match="flash_attention: second derivatives"):
        jax.hessian(lambda q: jnp.sum(f(q, bias)))(q)


def test_spec_names_the_features_a_kernel_may_decline():
    q, k, v = _option_inputs((1, 8, 8, 2, 2, 8, 8), jnp.float32)
    eqn = lambda f: jax.make_jaxpr(f)(q).eqns[-1]
    plain = eqn(lambda q: ts.flash_attention(q, k, v, causal=True)).params["spec"]
    assert plain.features == () and plain.causal
    spec = eqn(
        lambda q: ts.flash_attention(
            q, k, v, mask=jnp.ones((8, 8), bool), local_window_size=2, query_seq_lengths=[8]
        )
    ).params["spec"]
    assert spec.features == ("mask", "query_seq_lengths", "local_window_size")
    assert spec.local_window_size == (2, 2) and hash(spec) == hash(spec.replace())
    # grad wrt the bias asks the backward for dbias; grad wrt q alone does not
    bias = rand((1, 2, 8, 8))
    loss = lambda q, bias: jnp.sum(ts.flash_attention(q, k, v, bias))
    bwd = lambda jaxpr: next(e for e in jaxpr.eqns if "flash_attention_bwd" in str(e.primitive))
    assert bwd(jax.make_jaxpr(jax.grad(loss, argnums=1))(q, bias)).params["spec"].bias_grad
    assert not bwd(jax.make_jaxpr(jax.grad(loss))(q, bias)).params["spec"].bias_grad


@pytest.mark.parametrize("sq, skv", [(3, 20), (20, 3), (8, 8)])
def test_window_sides_past_the_sequence_see_every_key(sq, skv):
    """A side longer than the keys (left) or queries (right) stays in int32, clipped to
    where it stops hiding keys; a window neither side of which hides a key is no window:
    the same spec, hence bits, as without one."""
    q, k, v = rand((1, sq, 2, 8)), rand((1, skv, 2, 8)), rand((1, skv, 2, 8))

    def spec(w):
        f = lambda q: ts.flash_attention(q, k, v, causal=True, local_window_size=w)
        return jax.make_jaxpr(f)(q).eqns[-1].params["spec"]

    assert spec((1, 2**40)).local_window_size == (min(1, skv), sq)
    assert spec((2**40, 0)).local_window_size == (skv, 0)
    assert spec((2**40, 2**40)) == spec((skv, sq)) == spec(None)
    huge = ts.flash_attention(q, k, v, local_window_size=(2**40, 2**40))
    want, _ = np_dense(f64(q), f64(k), f64(v), {})
    assert_close(huge, want, factor=2.0)
    np.testing.assert_array_equal(np.asarray(huge), np.asarray(ts.flash_attention(q, k, v)))
    left = ts.flash_attention(q, k, v, local_window_size=(2**40, 1))
    want, _ = np_dense(f64(q), f64(k), f64(v), dict(local_window_size=(skv, 1)))
    assert_close(left, want, factor=2.0)


@pytest.mark.parametrize(
    "window, sq, skv, dropped",
    [
        (None, 1, 4096, 0),
        ((5000, 0), 1, 4096, 0),  # the window hides no key
        ((25, 0), 3, 100, 0),  # 28 seen keys, kept as 128: more than the cache
        ((25, 0), 3, 200, 72),
        ((240, 0), 16, 1000, 744),  # 256 seen keys: a whole multiple, none kept before
        ((4096, 0), 1, 32768, 32768 - 4224),  # 4097 seen keys, kept as 33 tiles
        ((4096, 4096), 1, 32768, 32768 - 4224),  # the right side hides nothing more
    ],
)
def test_dropped_keys_keep_whole_tiles(window, sq, skv, dropped):
    got = contracts.dropped_keys(window, sq, skv, 128)
    assert got == dropped
    assert got <= contracts.first_seen_key(window, sq, skv)
    assert got == 0 or (skv - got) % 128 == 0


def test_keys_before_every_window_are_not_read():
    """Decoding with a window: the keys before the first query's window reach no
    implementation but for those that keep the rest a multiple of 128 (the primitive
    binds the rest, with the key lengths shifted and the masks' key columns sliced); the
    result and every gradient are still the float64 ones, and the gradients of every key
    before the window are exact zeros. The second sequence's keys all lie before the
    window: its rows see no key."""
    b, sq, skv, hq, hkv, d, left = 2, 3, 300, 4, 2, 8, 25
    first = skv - sq - left  # 272: the 28 keys the queries see are kept as 128
    dims = (b, sq, skv, hq, hkv, d, 16)
    seg = np.repeat([[0] * 280 + [1] * 20], b, 0)
    opts = dict(
        causal=True,
        local_window_size=(left, 0),
        mask=_rand_mask((b, 1, sq, skv), 0.8),
        bias=rand((1, hq, sq, skv)),
        key_value_seq_lengths=jnp.asarray([skv, first - 5], jnp.int32),
        q_segment_ids=jnp.asarray(np.repeat([[1] * sq], b, 0)),
        kv_segment_ids=jnp.asarray(seg),
    )
    q, k, v = _option_inputs(dims, jnp.float32)
    f = _attend_opts(dims, opts)
    bound = jax.make_jaxpr(f)(q, k, v).eqns[-1]
    assert bound.primitive.name == "ts_flash_attention_fwd"
    assert [x.aval.shape[1] for x in bound.invars[1:3]] == [128] * 2
    do = rand(q.shape)
    out, got = _attend_and_vjp(dims, opts)(q, k, v, do)
    (want_out, _), want_grads = np_dense(f64(q), f64(k), f64(v), opts, do=f64(do))
    assert_close(out, want_out)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    for g, w in zip(got, want_grads):
        assert_close(g, w)
    dk, dv, dbias = got[1:]
    for g in (dk[:, :first], dv[:, :first], dbias[..., :first]):  # the dropped keys'
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_vmap_over_options():
    dims = (2, 9, 12, 2, 1, 8, 8)
    q, k, v = _option_inputs(dims, jnp.float32)
    biases = rand((2, 2, 1, 9, 12))
    lengths = jnp.asarray([[12, 5], [1, 3]], jnp.int32)
    mask = _rand_mask((9, 12), 0.8)
    f = lambda q, bias, kvl: ts.flash_attention(
        q, k, v, bias, mask, key_value_seq_lengths=kvl, config=FlashAttentionConfig(block_kv=8)
    )
    got = jax.jit(jax.vmap(f, in_axes=(None, 0, 0)))(q, biases, lengths)
    for i in range(2):
        opts = dict(bias=biases[i], mask=mask, key_value_seq_lengths=lengths[i])
        assert_close(got[i], np_dense(f64(q), f64(k), f64(v), opts)[0])
    # per-example gradients of a bias broadcast over the batch (B=1): sum(out²) has do = 2·out
    loss = lambda q, bias, kvl: jnp.sum(f(q, bias, kvl) ** 2)
    g = jax.jit(jax.vmap(jax.grad(loss, argnums=1), in_axes=(None, 0, 0)))(
        q, biases[:, :1], lengths
    )
    for i in range(2):
        opts = dict(bias=biases[i, :1], mask=mask, key_value_seq_lengths=lengths[i])
        out = np_dense(f64(q), f64(k), f64(v), opts)[0]
        assert_close(g[i], np_dense(f64(q), f64(k), f64(v), opts, do=2 * out)[1][3])


def _fa_opts(**kw):
    q, k = jnp.ones((2, 8, 4, 16)), jnp.ones((2, 6, 2, 16))
    return lambda: ts.flash_attention(q, k, k, **kw)


BAD_OPTIONS = [
    (
        "mask-float",
        _fa_opts(mask=jnp.ones((8, 6))),
        TypeError,
        r"flash_attention: mask.dtype=float32 is not supported",
    ),
    (
        "mask-shape",
        _fa_opts(mask=jnp.ones((2, 4, 8, 5), bool)),
        ValueError,
        r"mask.shape=\(2, 4, 8, 5\) does not broadcast to "
        r"\(batch, heads_q, seq_q, seq_kv\)=\(2, 4, 8, 6\)",
    ),
    (
        "mask-layout",
        _fa_opts(mask=jnp.ones((2, 8, 4, 6), bool)),
        ValueError,
        r"heads before sequence",
    ),
    (
        "mask-rank",
        _fa_opts(mask=jnp.ones((1, 2, 4, 8, 6), bool)),
        ValueError,
        r"mask.shape=\(1, 2, 4, 8, 6\) must have rank ≤ 4",
    ),
    (
        "bias-int",
        _fa_opts(bias=jnp.ones((8, 6), jnp.int32)),
        TypeError,
        r"bias.dtype=int32 is not supported",
    ),
    (
        "bias-shape",
        _fa_opts(bias=jnp.ones((3, 1, 1, 6))),
        ValueError,
        r"bias.shape=\(3, 1, 1, 6\) does not broadcast",
    ),
    (
        "qlen-shape",
        _fa_opts(query_seq_lengths=jnp.ones((3,), jnp.int32)),
        ValueError,
        r"query_seq_lengths.shape=\(3,\) must be \(batch,\)=\(2,\)",
    ),
    (
        "qlen-float",
        _fa_opts(query_seq_lengths=jnp.ones((2,))),
        TypeError,
        r"query_seq_lengths.dtype=float32",
    ),
    (
        "qlen-range",
        _fa_opts(query_seq_lengths=[8, 9]),
        ValueError,
        r"query_seq_lengths has values in \[8, 9\], outside \[0, seq_q=8\]",
    ),
    (
        "kvlen-neg",
        _fa_opts(key_value_seq_lengths=[-1, 6]),
        ValueError,
        r"key_value_seq_lengths has values in \[-1, 6\], outside \[0, seq_kv=6\]",
    ),
    (
        "window-neg",
        _fa_opts(local_window_size=(-1, 2)),
        ValueError,
        r"local_window_size=\(-1, 2\) must not be negative",
    ),
    (
        "window-float",
        _fa_opts(local_window_size=2.0),
        TypeError,
        r"local_window_size=2.0 must be None, an int or a \(left, right\)",
    ),
    (
        "window-triple",
        _fa_opts(local_window_size=(1, 2, 3)),
        TypeError,
        r"local_window_size=\(1, 2, 3\)",
    ),
    (
        "segments-one",
        _fa_opts(q_segment_ids=jnp.zeros((2, 8), jnp.int32)),
        ValueError,
        r"q_segment_ids was given without the other",
    ),
    (
        "segments-shape",
        _fa_opts(
            q_segment_ids=jnp.zeros((2, 8), jnp.int32), kv_segment_ids=jnp.zeros((2, 8), jnp.int32)
        ),
        ValueError,
        r"kv_segment_ids.shape=\(2, 8\) must be \(batch, seq_kv\)=\(2, 6\)",
    ),
    (
        "segments-float",
        _fa_opts(q_segment_ids=jnp.zeros((2, 8)), kv_segment_ids=jnp.zeros((2, 6))),
        TypeError,
        r"q_segment_ids.dtype=float32",
    ),
]


@pytest.mark.parametrize(
    "call,exc,match", [c[1:] for c in BAD_OPTIONS], ids=[c[0] for c in BAD_OPTIONS]
)
def test_bad_option_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_traced_lengths_are_not_range_checked_but_work_under_jit():
    q, k, v = _option_inputs((2, 8, 8, 2, 2, 8, 8), jnp.float32)
    f = jax.jit(lambda n: ts.flash_attention(q, k, v, key_value_seq_lengths=n))
    n = jnp.asarray([8, 3], jnp.int32)
    assert_close(f(n), np_dense(f64(q), f64(k), f64(v), dict(key_value_seq_lengths=n))[0])


@pytest.mark.xla_optimized
def test_bits_do_not_depend_on_the_loop_around_the_call():
    """The same attention in a 1-trip ``lax.map`` (inlined: its causal mask a constant)
    and as the first trip of a 2-trip one: the same output and gradients, bit for bit
    (the demo model's tensor-parallel chunks run so, by the mesh). Both the scores'
    rounding and the tree's row sums are needed for these shapes."""
    qkv = rand((2, 4, 8, 3, 8))
    ct = rand((2, 4, 8, 1, 8))

    def att(x):
        return ts.flash_attention(*jnp.split(x, 3, axis=2), causal=True)

    @jax.jit
    def out_and_grad(x, c):
        y, vjp = jax.vjp(lambda x: jax.lax.map(att, x), x)
        return y[0], vjp(c)[0][0]

    for one, two in zip(out_and_grad(qkv[:1], ct[:1]), out_and_grad(qkv, ct)):
        np.testing.assert_array_equal(one, two)


def test_masked_exponential_forms_agree():
    """The reference's CPU form (the exponential of -inf where a score is hidden) and its
    other form (the exponentials masked afterwards) give the same values, a hidden NaN or
    inf included, and a visible NaN stays NaN."""
    x = jnp.array([[0.0, -1.5, jnp.nan, jnp.inf, -jnp.inf, 3.0, jnp.nan, 88.0]], jnp.float32)
    vis = jnp.array([[True, False, False, False, True, True, True, False]])
    a, b = _attention._mask_then_exp(x, vis), _attention._exp_then_mask(x, vis)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isnan(np.asarray(a)[0, 6]) and np.asarray(a)[0, 2] == 0.0
