"""The decode forward and backward in Pallas' Triton backend
(``pallas_kernels/attention_decode.py``) against the float64 reference, in the
interpreter: GQA groups folded into the rows, ragged caches split into chunks, key lengths
and a causal mask, the operator's other options, bitwise repeatability, and the lse the
backward kernels read; a shard of batch or heads keeping its bits in the backward; then
through ``ts.flash_attention``, whose forward and backward it runs at decode shapes ahead
of the Mosaic GPU kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tessera_jax.contracts.attention import AttentionExtras, AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_decode as ad
from tests._util import (
    assert_close,
    cuda_lowering,
    f64,
    rand,
    sample,
    triton_lowers_here,
)
from tests.test_attention import np_attention, np_dense
from tests.test_attention_kernels import (
    _avals,
    _check_index_masks,
    _chosen,
    _mask_bias_operands,
    np_with_lse_cotangent,
)

BF16, F16 = jnp.bfloat16, jnp.float16
# Small chunks and key blocks, so that the interpreter's short caches make several chunks.
SMALL = ad.DecodeConfig(block_kv=64, split_keys=64)
TWO = ad.DecodeConfig(split_keys=128)  # 128-key blocks, chunks of one block


def _spec(causal, d, **features):
    return AttentionSpec(causal=causal, scale=d**-0.5, config=FlashAttentionConfig(), **features)


def _case(b, sq, skv, hq, hkv, d, causal, lengths, dtype, opts):
    """Random q, k, v of the shape, the spec and the extras of the operator's options
    ``opts`` as the primitive binds them, and ``opts`` for the float64 reference."""
    q, k, v = (
        rand((b, sq, hq, d), dtype),
        rand((b, skv, hkv, d), dtype),
        rand((b, skv, hkv, d), dtype),
    )
    opts = dict(opts or {})
    ints = lambda name: None if opts.get(name) is None else jnp.asarray(opts[name], jnp.int32)
    extras = AttentionExtras(
        mask=opts.get("mask"),
        bias=opts.get("bias"),
        q_lengths=ints("query_seq_lengths"),
        kv_lengths=None if lengths is None else jnp.asarray(lengths, jnp.int32),
        q_segment_ids=ints("q_segment_ids"),
        kv_segment_ids=ints("kv_segment_ids"),
    )
    spec = _spec(causal, d, local_window_size=opts.get("local_window_size")).with_extras(extras)
    np_opts = {n: x if n == "local_window_size" else np.asarray(x) for n, x in opts.items()}
    np_opts.update(causal=causal, key_value_seq_lengths=lengths)
    return (q, k, v), spec, AttentionSpec.operands(extras), np_opts


def _check(
    b, sq, skv, hq, hkv, d, causal, config, lengths, dtype, *, interpret, opts=None, backward=False
):
    """The forward kernel's output and lse against float64, and a second run's bits; with
    ``backward``, then the backward kernel's dQ, dK and dV from that output and lse, of the
    cotangents of ``out`` and (without a mask or bias) of ``lse``, likewise. ``opts``: the
    operator's other options (``mask``, ``bias``, ``local_window_size``,
    ``query_seq_lengths``, segment ids), bound as the primitive binds them."""
    (q, k, v), spec, operands, np_opts = _case(b, sq, skv, hq, hkv, d, causal, lengths, dtype, opts)
    run = jax.jit(
        lambda q, k, v, ops: ad.flash_fwd(spec, q, k, v, *ops, config=config, interpret=interpret)
    )
    out, lse = run(q, k, v, operands)
    out2, lse2 = run(q, k, v, operands)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
    want, want_lse = np_dense(f64(q), f64(k), f64(v), np_opts)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, sq)
    empty = np.isneginf(want_lse)
    np.testing.assert_array_equal(np.isneginf(f64(lse)), empty)
    np.testing.assert_allclose(f64(lse)[~empty], want_lse[~empty], rtol=0, atol=2e-2)
    assert not np.any(f64(out)[np.swapaxes(empty, 1, 2)])
    if lengths is None and not causal and not opts:
        assert_close(out, np_attention(f64(q), f64(k), f64(v)), dtype, factor=2.0)
    assert_close(out, want, dtype, factor=2.0)
    if backward:
        _check_bwd(q, k, v, out, lse, spec, operands, np_opts, config, interpret=interpret)


def _check_bwd(q, k, v, out, lse, spec, operands, np_opts, config, *, interpret):
    do, dl = rand(q.shape, q.dtype), None
    if not (spec.has_mask or spec.has_bias):  # (the float64 reference of dlse: index masks)
        dl = rand(lse.shape, jnp.float32)
        spec = spec.replace(has_dlse=True)
    run = jax.jit(
        lambda q, k, v, out, lse, do, ops: ad.flash_bwd(
            spec, q, k, v, out, lse, do, *ops, config=config, interpret=interpret
        )
    )
    args = (q, k, v, out, lse, do, (*operands, *([] if dl is None else [dl])))
    grads = [np.asarray(x) for x in run(*args)]
    for x, y in zip(grads, run(*args)):
        np.testing.assert_array_equal(x, np.asarray(y))
    for got, like in zip(grads, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype
    if dl is None:
        want = np_dense(f64(q), f64(k), f64(v), np_opts, do=f64(do))[1][:3]
    else:
        want = np_with_lse_cotangent(f64(q), f64(k), f64(v), f64(do), f64(dl), np_opts)[2]
    for got, ref in zip(grads, want):
        assert_close(got, ref, q.dtype, factor=2.0)


def _segments(b, n, bounds):
    """int32 ``(b, n)`` segment ids: a new segment at each fraction of ``n`` in ``bounds``."""
    seg = np.searchsorted(np.asarray(bounds) * n, np.arange(n), side="right")
    return np.broadcast_to(seg.astype(np.int32), (b, n))


# The operator's options through the kernel (dims: b, sq, skv, hq, hkv, d).
OPTION_CASES = {
    # a mask per batch entry and query, a row it empties, GQA, causal, 4 chunks
    "mask-causal-gqa": (
        (2, 3, 250, 4, 2, 64),
        True,
        SMALL,
        None,
        lambda: dict(mask=_mask_bias_operands((2, 1, 3, 250), None, empty_rows=[1])[0]),
    ),
    # a bias per head and query (f32, not rounded) with a key-padding mask
    "bias-keypad": (
        (2, 2, 200, 4, 1, 64),
        False,
        SMALL,
        (200, 130),
        lambda: dict(
            bias=rand((1, 4, 2, 200), jnp.float32, scale=3.0),
            mask=np.arange(200)[None, None, None, :] < np.array([190, 40])[:, None, None, None],
        ),
    ),
    # a bias per batch entry broadcast over heads and queries
    "bias-batch": (
        (2, 1, 130, 2, 2, 128),
        False,
        None,
        None,
        lambda: dict(bias=rand((2, 1, 1, 130), jnp.float32, scale=2.0)),
    ),
    # a window whose first key lies chunks after the first: those chunks see nothing
    "window": ((2, 4, 300, 2, 1, 64), False, SMALL, None, lambda: dict(local_window_size=(100, 1))),
    "window-causal-kvlen": (
        (2, 2, 256, 2, 2, 64),
        True,
        SMALL,
        (256, 120),
        lambda: dict(local_window_size=(70, 70)),
    ),
    "qlen": (
        (3, 4, 200, 2, 1, 64),
        False,
        SMALL,
        (200, 199, 50),
        lambda: dict(query_seq_lengths=[4, 1, 0]),
    ),
    "segments": (
        (2, 3, 220, 4, 2, 64),
        True,
        SMALL,
        None,
        lambda: dict(
            q_segment_ids=np.full((2, 3), 2, np.int32),
            kv_segment_ids=_segments(2, 220, [0, 0.3, 0.6]),
        ),
    ),
}


# The interpreter's shapes (b, sq, skv, hq, hkv, d, causal, config, lengths, dtype), each in
# one input dtype, both dtypes covered (the kernels' arithmetic is f32 whatever the input's
# 16-bit type).
SHAPE_CASES = [
    (2, 1, 200, 2, 2, 64, False, SMALL, None, BF16),  # 4 chunks, the last ragged
    (1, 3, 130, 4, 1, 64, True, None, None, F16),  # MQA group folded, one chunk, causal
    (2, 2, 256, 4, 2, 128, False, TWO, (256, 97), BF16),  # key lengths end mid-chunk
    (2, 1, 192, 2, 2, 64, True, SMALL, (0, 150), F16),  # an entry with no keys
]


class TestDecodeInterpret:
    """The forward kernel, then the backward kernel from its output and lse: a program's dK
    and dV are its keys' whole gradients (the group's queries folded into its rows, the
    padding rows adding nothing), dQ sums the chunks."""

    @pytest.mark.parametrize("case", SHAPE_CASES)
    def test_matches_float64(self, case):
        _check(*case, interpret=True, backward=True)

    @pytest.mark.parametrize("name", OPTION_CASES)
    def test_options(self, name):
        dims, causal, config, lengths, opts = OPTION_CASES[name]
        _check(*dims, causal, config, lengths, BF16, interpret=True, opts=opts(), backward=True)


@pytest.mark.parametrize("d", sample([64, 128], 1))
def test_combine_columns_keep_the_bits(d, monkeypatch):
    """The forward's chunks combined by one program per kv head, or by several programs of
    a few output columns each (``COMBINE_COLS``): the same output and lse, bit for bit; a
    row no key reaches (key length 0) gets zeros and ``-inf``."""
    q, k, v = rand((2, 3, 4, d), BF16), rand((2, 300, 2, d), BF16), rand((2, 300, 2, d), BF16)
    spec = _spec(False, d)
    lengths = jnp.asarray([300, 0], jnp.int32)
    call = lambda: ad.decode_fwd(spec, q, k, v, lengths, config=TWO, interpret=True)
    outs = {}
    for cols in (d, 32, 16):
        monkeypatch.setattr(ad, "COMBINE_COLS", cols)
        outs[cols] = jax.block_until_ready(call())
    for cols in (32, 16):
        for x, y in zip(outs[cols], outs[d]):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    out, lse = outs[16]
    assert np.all(np.asarray(out[1]) == 0) and np.all(np.asarray(lse[1]) == -np.inf)
    assert np.all(np.isfinite(np.asarray(lse[0])))


def test_backward_shards_get_the_same_bits():
    """What a data- or head-sharded run computes: the last batch entry alone, and the
    last kv head's group alone, get the bits they get in the whole call."""
    _check_shards((2, 2, 200, 4, 2, 64), SMALL, interpret=True)


def _check_shards(dims, config, *, interpret):
    """The backward of the last batch entry alone, and of the last kv head's group alone,
    against the whole call's bits (out and lse from the float64 reference)."""
    b, sq, skv, hq, hkv, d = dims
    q, do = rand((b, sq, hq, d), BF16), rand((b, sq, hq, d), BF16)
    k, v = rand((b, skv, hkv, d), BF16), rand((b, skv, hkv, d), BF16)
    spec = _spec(True, d)
    out, lse = np_dense(f64(q), f64(k), f64(v), dict(causal=True))
    out, lse = jnp.asarray(out, BF16), jnp.asarray(lse, jnp.float32)
    run = jax.jit(functools.partial(ad.decode_bwd, spec, config=config, interpret=interpret))
    whole = [np.asarray(x) for x in run(q, k, v, out, lse, do)]
    entry = run(*(x[-1:] for x in (q, k, v, out, lse, do)))
    g = hq // hkv
    last = lambda x, n: x[:, -n:] if x.ndim == 3 else x[:, :, -n:]
    heads = run(*(last(x, 1 if x is k or x is v else g) for x in (q, k, v, out, lse, do)))
    for x, e, h in zip(whole, entry, heads):
        np.testing.assert_array_equal(x[-1:], np.asarray(e))
        np.testing.assert_array_equal(x[:, :, -h.shape[2] :], np.asarray(h))


@pytest.mark.gpu
class TestDecodeGPU:
    """The interpreter's cases at decode shapes, compiled."""

    @pytest.mark.parametrize(
        "b, sq, skv, hq, hkv, d, causal, config, lengths",
        [
            (1, 16, 4096, 8, 8, 128, False, None, None),
            (1, 1, 4096, 32, 8, 128, False, ad.DecodeConfig(block_kv=64, split_keys=256), None),
            (2, 1, 32768, 32, 8, 128, True, None, (32768, 20000)),
            (4, 8, 4096, 16, 16, 64, True, ad.DecodeConfig(split_keys=1024), (4096, 3000, 1, 0)),
        ],
    )
    def test_matches_float64(self, b, sq, skv, hq, hkv, d, causal, config, lengths):
        _check(b, sq, skv, hq, hkv, d, causal, config, lengths, jnp.bfloat16, interpret=False)

    @pytest.mark.parametrize(
        "dims, causal, lengths, opts",
        [
            (
                (1, 16, 4096, 8, 8, 128),
                True,
                None,
                lambda: dict(mask=_mask_bias_operands((1, 1, 16, 4096), None)[0]),
            ),
            (
                (2, 1, 32768, 32, 8, 128),
                False,
                (32768, 9000),
                lambda: dict(bias=rand((1, 32, 1, 32768), jnp.float32, scale=2.0)),
            ),
            (
                (2, 4, 32768, 16, 16, 64),
                True,
                None,
                lambda: dict(local_window_size=(4096, 0), query_seq_lengths=[4, 3]),
            ),
            (
                (1, 8, 8192, 8, 2, 128),
                False,
                None,
                lambda: dict(
                    q_segment_ids=np.full((1, 8), 1, np.int32),
                    kv_segment_ids=_segments(1, 8192, [0, 0.5, 0.7]),
                ),
            ),
        ],
    )
    def test_options(self, dims, causal, lengths, opts):
        _check(*dims, causal, None, lengths, jnp.bfloat16, interpret=False, opts=opts())

    # Through the operator: this forward, the Mosaic GPU backward; a batch entry alone
    # gets the bits it gets in the batch.
    @pytest.mark.parametrize(
        "dims, opts",
        [
            ((2, 16, 4096, 8, 8, 128), {}),
            ((3, 1, 32768, 32, 8, 128), dict(causal=True, key_value_seq_lengths=[32768, 9000, 1])),
            (
                (2, 4, 8192, 16, 16, 128),
                dict(
                    mask=np.random.default_rng(0).random((2, 1, 4, 8192)) < 0.75,
                    local_window_size=(2000, 0),
                    query_seq_lengths=[4, 2],
                ),
            ),
        ],
    )
    def test_operator(self, dims, opts):
        _check_operator(dims, opts, repeat=3)

    # The backward kernel compiled: GQA and MHA, chunks, lengths, the options.
    @pytest.mark.parametrize(
        "b, sq, skv, hq, hkv, d, causal, lengths",
        [
            (1, 1, 4096, 32, 8, 128, False, None),
            (2, 16, 4096, 8, 8, 128, True, (4096, 3000)),
            (4, 8, 32768, 16, 16, 64, False, (32768, 20000, 1, 0)),
        ],
    )
    def test_backward_matches_float64(self, b, sq, skv, hq, hkv, d, causal, lengths):
        _check(b, sq, skv, hq, hkv, d, causal, None, lengths, BF16, interpret=False, backward=True)

    @pytest.mark.parametrize("name", ["mask-causal-gqa", "bias-keypad", "window", "segments"])
    def test_backward_options(self, name):
        dims, causal, config, lengths, opts = OPTION_CASES[name]
        _check(*dims, causal, config, lengths, BF16, interpret=False, opts=opts(), backward=True)

    def test_backward_shards_get_the_same_bits(self):
        _check_shards((3, 4, 8192, 32, 8, 128), None, interpret=False)

    def test_cache_past_int32_offsets(self):
        """K and V of more than 2**32 bytes each (64-bit offsets): the last batch entry,
        whose keys lie past 2**31 elements, gets the bits it gets alone."""
        shape = (65, 32768, 8, 128)
        keys = jax.random.split(jax.random.key(1), 3)
        k, v = (jax.random.normal(x, shape, jnp.bfloat16) for x in keys[:2])
        q = jax.random.normal(keys[2], (65, 4, 8, 128), jnp.bfloat16)
        spec = _spec(False, 128)
        run = jax.jit(lambda q, k, v: ad.decode_fwd(spec, q, k, v))
        whole = run(q, k, v)
        alone = run(q[-1:], k[-1:], v[-1:])
        for x, y in zip(whole, alone):
            np.testing.assert_array_equal(np.asarray(x[-1:]), np.asarray(y))


@pytest.mark.parametrize(
    "q_shape, dtype, why",
    [
        ((1, 17, 8, 64), jnp.bfloat16, "rows"),
        ((1, 1, 2, 96), jnp.bfloat16, "head_dim 96"),
        ((1, 1, 2, 64), jnp.float32, "16-bit"),
    ],
)
def test_decode_declines(q_shape, dtype, why):
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    k = jax.ShapeDtypeStruct((1, 256, 2, q_shape[3]), dtype)
    assert why in ad.decode_reason(_spec(False, q_shape[3]), q, k)


def test_decode_takes_every_option():
    q = jax.ShapeDtypeStruct((1, 1, 2, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    for features in (
        dict(has_mask=True, has_bias=True),
        dict(local_window_size=(4, 0), has_q_lengths=True, has_segment_ids=True),
    ):
        assert ad.decode_reason(_spec(False, 64, **features), q, k) is None
    huge = jax.ShapeDtypeStruct((8, 2**21, 2, 64), jnp.bfloat16)  # offsets past 2**31
    assert ad.decode_reason(_spec(False, 64), q, huge) is None


@pytest.mark.parametrize(
    "given, what",
    [
        (dict(bias=jnp.zeros((1, 1, 1, 256))), "bias is given"),
        (dict(q_lengths=jnp.ones((1,), jnp.int32)), "q_lengths is given"),
    ],
)
def test_decode_operands_follow_the_spec(given, what):
    q, k = rand((1, 1, 2, 64), jnp.bfloat16), rand((1, 256, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=what):
        ad.decode_fwd(_spec(False, 64), q, k, k, interpret=True, **given)
    spec = _spec(False, 64, has_bias=True)
    with pytest.raises(ValueError, match=r"bias.shape=\(1, 3, 1, 256\)"):
        ad.decode_fwd(spec, q, k, k, bias=jnp.zeros((1, 3, 1, 256)), interpret=True)


@pytest.mark.parametrize(
    "given, what",
    [
        (
            dict(out=jnp.zeros((1, 2, 2, 64), BF16)),
            r"out.shape=\(1, 2, 2, 64\) must be \(1, 1, 2, 64\)",
        ),
        (dict(lse=jnp.zeros((1, 1, 2), jnp.float32)), r"lse.shape=\(1, 1, 2\) must be \(1, 2, 1\)"),
        (dict(dlse=jnp.zeros((1, 2, 1), jnp.float32)), "dlse is given, but the spec says"),
        (dict(bias=jnp.zeros((1, 1, 1, 256))), "bias is given"),
    ],
)
def test_decode_bwd_operands_follow_the_spec(given, what):
    q, k = rand((1, 1, 2, 64), BF16), rand((1, 256, 2, 64), BF16)
    args = dict(out=q, lse=jnp.zeros((1, 2, 1), jnp.float32), dout=q) | given
    extra = {n: x for n, x in given.items() if n in ("dlse", "bias")}
    with pytest.raises(ValueError, match=what):
        ad.decode_bwd(
            _spec(False, 64),
            q,
            k,
            k,
            args["out"],
            args["lse"],
            args["dout"],
            interpret=True,
            **extra,
        )


@triton_lowers_here
@pytest.mark.parametrize("d, config", sample([(64, SMALL), (128, None)], 1))
def test_decode_lowers_for_cuda(d, config):
    """The kernel goes through Pallas' Triton lowering (built on this CPU machine), with
    and without every option."""
    q, k = rand((2, 2, 8, d), jnp.bfloat16), rand((2, 4096, 2, d), jnp.bfloat16)
    lengths = jnp.asarray([4096, 1000], jnp.int32)
    spec = _spec(True, d, has_kv_lengths=True)
    text = cuda_lowering(lambda *a: ad.decode_fwd(spec, *a, config=config), q, k, k, lengths)
    # the chunks, then their combination
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2
    spec = spec.replace(
        local_window_size=(300, 0), has_q_lengths=True, has_mask=True, has_segment_ids=True
    )
    segs = (jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 4096), jnp.int32))

    def run(q, k, v, lengths, bias):
        return ad.decode_fwd(
            spec, q, k, v, lengths, q_lengths=lengths, bias=bias, segment_ids=segs, config=config
        )

    bias = jnp.zeros((2, 8, 2, 4096), jnp.float32)
    text = cuda_lowering(run, q, k, k, lengths, bias)
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2


@triton_lowers_here
@pytest.mark.parametrize("d, config", sample([(64, SMALL), (128, None)], 1))
def test_decode_bwd_lowers_for_cuda(d, config):
    """The backward kernel goes through Pallas' Triton lowering, with and without every
    option; one launch, then XLA's sum of the chunks' dQ."""
    q, k = rand((2, 2, 8, d), jnp.bfloat16), rand((2, 4096, 2, d), jnp.bfloat16)
    lse = jnp.zeros((2, 8, 2), jnp.float32)
    lengths = jnp.asarray([4096, 1000], jnp.int32)
    spec = _spec(True, d, has_kv_lengths=True)

    def plain(q, k, lse, lengths):
        return ad.decode_bwd(spec, q, k, k, q, lse, q, lengths, config=config)

    text = cuda_lowering(plain, q, k, lse, lengths)
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1
    spec = spec.replace(
        local_window_size=(300, 0),
        has_q_lengths=True,
        has_mask=True,
        has_segment_ids=True,
        has_dlse=True,
    )
    segs = (jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 4096), jnp.int32))

    def every(q, k, lse, lengths, bias):
        return ad.decode_bwd(
            spec,
            q,
            k,
            k,
            q,
            lse,
            q,
            lengths,
            q_lengths=lengths,
            bias=bias,
            segment_ids=segs,
            dlse=lse,
            config=config,
        )

    bias = jnp.zeros((2, 8, 2, 4096), jnp.float32)
    text = cuda_lowering(every, q, k, lse, lengths, bias)
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1


def _check_operator(dims, opts, repeat):
    """``ts.flash_attention``'s forward and gradients with these kernels (against float64,
    ``repeat`` runs bit for bit), and the last batch entry alone gets the same bits."""
    _check_index_masks(dims, opts, jnp.bfloat16, repeat=repeat, kernel="triton_decode")
    b, sq, skv, hq, hkv, d = dims
    q, k, v = rand((b, sq, hq, d)), rand((b, skv, hkv, d)), rand((b, skv, hkv, d))
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    lengths = opts.get("key_value_seq_lengths")
    kw = dict(causal=opts.get("causal", False))

    def f(q, k, v, n):
        return ts.flash_attention(q, k, v, key_value_seq_lengths=n, **kw)

    n = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    whole = jax.jit(f)(q, k, v, n)
    alone = jax.jit(f)(q[-1:], k[-1:], v[-1:], None if n is None else n[-1:])
    np.testing.assert_array_equal(np.asarray(whole[-1:]), np.asarray(alone))


# One case per run: each takes the same path through the operator, and the kernel-level
# tests above check every option (the suite has 10 minutes on 2 cores).
@pytest.mark.parametrize(
    "dims, opts",
    sample(
        [
            ((2, 3, 700, 2, 1, 64), dict(key_value_seq_lengths=[700, 260])),  # 2 chunks
            ((2, 1, 600, 8, 1, 128), dict(causal=True)),
            (
                (2, 2, 300, 2, 1, 64),
                dict(
                    local_window_size=(100, 0),
                    query_seq_lengths=[2, 1],
                    key_value_seq_lengths=[300, 180],
                ),
            ),
        ],
        1,
    ),
)
def test_operator_runs_it(dims, opts):
    with ts.kernel_mode("interpret"):
        _check_operator(dims, opts, repeat=2)


@pytest.mark.parametrize("backward", [False, True])
def test_prefer_and_supports(backward):
    """Decode shapes, any GQA group up to MAX_ROWS rows, from ``MIN_KV`` keys
    (``BWD_MIN_KV`` for the backward: the key count only); more queries, more rows, an
    explicit config or the bias's gradient are declined."""
    spec = _spec(False, 128)
    avals = lambda sq, skv, hq=8: _avals(1, sq, skv, hq, 8, 128, BF16, backward)
    least = ad.BWD_MIN_KV if backward else ad.MIN_KV
    assert ad.supports(spec, avals(16, 4096)) is None and ad.prefer(spec, avals(16, 4096))
    assert ad.prefer(spec, avals(1, least)) and not ad.prefer(spec, avals(16, least - 1))
    assert ad.supports(spec, avals(2, 4096, hq=256)) is None  # a group of 32, 64 rows
    assert "rows" in ad.supports(spec, avals(4, 4096, hq=256))
    assert "seq_q 17" in ad.supports(spec, avals(17, 4096))
    assert "config" in ad.supports(
        spec.replace(config=FlashAttentionConfig(block_kv=64)), avals(1, 4096)
    )
    assert "operands" in ad.supports(spec, avals(1, 4096)[:2])
    if backward:
        bias = jax.ShapeDtypeStruct((1, 8, 1, 4096), jnp.float32)
        spec = spec.replace(has_bias=True, bias_grad=True)
        assert "bias_grad" in ad.supports(spec, (*avals(1, 4096), bias))


def test_operator_dispatch():
    """Decode shapes take this forward and backward in every kernel mode that runs kernels,
    with any option, and the bias's gradient the reference's backward."""
    q = rand((1, 2, 4, 64), jnp.bfloat16)
    k = rand((1, 300, 2, 64), jnp.bfloat16)
    grad = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)))
    with ts.kernel_mode("interpret"):
        assert _chosen(grad(ts.flash_attention), q, k, k) == ["triton_decode"] * 2
        mask = jnp.ones((1, 1, 2, 300), bool)
        with_mask = lambda q, k, v: ts.flash_attention(q, k, v, mask=mask, local_window_size=9)
        assert _chosen(grad(with_mask), q, k, k) == ["triton_decode"] * 2
        bias = rand((1, 4, 2, 300), jnp.float32)
        with_bias = lambda q, k, v, b: ts.flash_attention(q, k, v, bias=b)
        dbias = jax.grad(lambda *a: jnp.sum(with_bias(*a).astype(jnp.float32)), argnums=3)
        assert _chosen(dbias, q, k, k, bias) == ["triton_decode", "reference"]
        assert (
            _chosen(grad(ts.flash_attention), rand((1, 17, 4, 64), BF16), k, k)
            == ["mosaic_gpu"] * 2
        )


@pytest.mark.parametrize(
    "seq_kv, block_kv, chunks, keys",
    [
        (4096, 128, ad.SPLIT_CHUNKS, 512),
        (32768, 128, ad.SPLIT_CHUNKS, 4096),
        (700, 128, ad.SPLIT_CHUNKS, 512),
        (5000, 128, ad.SPLIT_CHUNKS, 640),
        (4096, 64, ad.SPLIT_CHUNKS_BWD, 512),  # at least SPLIT_KEYS_MIN
        (32768, 64, ad.SPLIT_CHUNKS_BWD, 2048),
        (5000, 64, ad.SPLIT_CHUNKS_BWD, 512),
    ],
)
def test_default_split_keys(seq_kv, block_kv, chunks, keys):
    assert ad.default_split_keys(seq_kv, block_kv, chunks) == keys


@pytest.mark.parametrize("backward", [False, True])
def test_configs_that_overflow_shared_memory_are_refused(backward):
    """Every default fits at every row count and head_dim; a ring too deep for 64 rows is
    refused when the call is traced, naming the config, before Triton would fail to
    launch it."""
    # the model's figure for the allocation Triton asked for and the H200 refused
    assert ad.smem_bytes(ad.DecodeConfig(), 64, 128, backward=True) == 245760
    default = ad.BWD_CONFIG if backward else ad.DecodeConfig()
    for rows in (ad.MIN_ROWS, ad.MAX_ROWS):
        for d in (64, 128):
            assert ad.smem_bytes(default, rows, d, backward) <= ad._mgpu.SMEM_BYTES
    deep = ad.DecodeConfig(block_kv=128, num_stages=4 if not backward else 3)
    q, k = rand((1, 16, 8, 128), BF16), rand((1, 1024, 2, 128), BF16)  # 64 rows
    lse = jnp.zeros((1, 8, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"decode_(fwd|bwd): config=.* shared memory"):
        if backward:
            ad.decode_bwd(_spec(False, 128), q, k, k, q, lse, q, config=deep, interpret=True)
        else:
            ad.decode_fwd(_spec(False, 128), q, k, k, config=deep, interpret=True)


@pytest.mark.parametrize(
    "kw, what",
    [
        (dict(block_kv=48), "power of two"),
        (dict(block_kv=8), "power of two"),
        (dict(num_warps=3), "power of two"),
        (dict(num_stages=0), "positive int"),
        (dict(split_keys=100), "multiple"),
        (dict(split_keys=True), "multiple"),
    ],
)
def test_config_validation(kw, what):
    with pytest.raises(ValueError, match=what):
        ad.DecodeConfig(**kw)
