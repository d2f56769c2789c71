"""The Hopper flash-attention kernels (forward, dQ, dK/dV) against the float64 reference.

``TestAttentionKernelsInterpret`` runs the kernels in the Mosaic GPU interpreter on the CPU
(``TESSERA_KERNELS=interpret``) at small shapes, sampled to keep the interpreter's time
small: a ragged causal GQA case through forward and backward, a non-causal case with
the interpreter's race detection on, run twice for bitwise repeatability, index masks,
and a mask and bias in each form the kernels stream them (vectors of keys, tiles).
``TestAttentionKernelsGPU`` (``-m gpu``) runs the compiled kernels at real shapes. Each case
first asserts that the operators chose the kernel, so a kernel that silently declined would
fail the test instead of testing the reference.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax import _compat
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am
from tessera_jax.pallas_kernels import device
from tessera_jax.primitives.attention import (
    flash_attention_bwd_op,
    flash_attention_fwd,
    flash_attention_fwd_op,
    reference_block_kv,
)
from tests._util import (
    assert_close,
    assert_no_serialised_wgmma,
    assert_same_bits_with_x64,
    chosen_kernels,
    cuda_lowering,
    cuda_lowering_xla_row_dot,
    f64,
    mosaic_gpu_calls,
    rand,
    sample,
    sampled_tests,
    triton_lowers_here,
    xla_ordered_sums,
)
from tests.test_attention import np_attention, np_attention_grads, np_dense, np_visible


def _chosen(f, *args) -> list[str]:
    """The implementation each flash-attention primitive in ``f``'s program lowers to."""
    ops = ("flash_attention_fwd", "flash_attention_bwd")
    return [impl for _, impl in chosen_kernels(f, *args, ops=ops)]


@functools.partial(jax.jit, static_argnames="causal")
def _fwd_bwd(q, k, v, do, causal):
    """``(out, dq, dk, dv)`` of ``ts.flash_attention`` (jitted once per shape and mode)."""
    out, vjp = jax.vjp(functools.partial(ts.flash_attention, causal=causal), q, k, v)
    return (out, *vjp(do))


def _check(case, dtype, *, repeat: int = 1, factor: float = 2.0):
    """Forward and gradients through the kernels vs float64; ``repeat`` runs must agree
    bit for bit."""
    b, sq, skv, hq, hkv, d, causal = case
    q, k, v = (
        rand((b, sq, hq, d), dtype),
        rand((b, skv, hkv, d), dtype),
        rand((b, skv, hkv, d), dtype),
    )
    do = rand((b, sq, hq, d), dtype)
    f = functools.partial(_fwd_bwd, causal=causal)
    assert _chosen(f, q, k, v, do) == ["mosaic_gpu", "mosaic_gpu"]
    runs = [_fwd_bwd(q, k, v, do, causal=causal) for _ in range(repeat)]
    for later in runs[1:]:
        for x, y in zip(runs[0], later):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    out, dq, dk, dv = runs[0]
    assert_close(out, np_attention(f64(q), f64(k), f64(v), causal), factor=factor)
    want = np_attention_grads(f64(q), f64(k), f64(v), f64(do), causal)
    for got, ref in zip((dq, dk, dv), want):
        assert_close(got, ref, factor=factor)


def _check_x64(case, *, backward: bool, kernels: list[str]):
    """:func:`assert_same_bits_with_x64` of the forward (and gradients) at ``case``."""
    b, sq, skv, hq, hkv, d, causal = case
    q, do = rand((b, sq, hq, d), jnp.bfloat16), rand((b, sq, hq, d), jnp.bfloat16)
    k, v = rand((b, skv, hkv, d), jnp.bfloat16), rand((b, skv, hkv, d), jnp.bfloat16)
    if backward:
        f, args = functools.partial(_fwd_bwd, causal=causal), (q, k, v, do)
    else:
        f, args = jax.jit(functools.partial(ts.flash_attention, causal=causal)), (q, k, v)
    assert_same_bits_with_x64(f, args, _chosen, kernels)


def np_with_lse_cotangent(q, k, v, do, dl, opts):
    """float64 ``out``, ``lse`` and the ``(dq, dk, dv)`` of the cotangents ``(do, dl)`` of
    ``(out, lse)``: ``d lse / dS = P`` adds ``P·dl`` to ``dS``."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1:3]
    scale = 1 / np.sqrt(d)
    kv_head = np.arange(hq) // (hq // hkv)
    kk, vv = k[:, :, kv_head], v[:, :, kv_head]
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = np.where(np_visible(b, sq, skv, hq, opts), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isneginf(m), 0.0, m))
    den = np.sum(e, axis=-1, keepdims=True)
    p = e / np.where(den == 0, 1.0, den)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True) + dl[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    dk_h = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv_h = np.einsum("bhqk,bqhd->bkhd", p, do)
    for h in range(hq):
        dk[:, :, kv_head[h]] += dk_h[:, :, h]
        dv[:, :, kv_head[h]] += dv_h[:, :, h]
    with np.errstate(divide="ignore"):
        lse = (np.log(den) + np.where(np.isneginf(m), 0.0, m))[..., 0]
    return np.einsum("bhqk,bkhd->bqhd", p, vv), lse, (dq, dk, dv)


@contextlib.contextmanager
def without_kernel(name: str):
    """``flash_attention_fwd`` and ``_bwd`` without their kernel ``name``, and no program
    compiled with or without it before (jit caches do not see the kernel lists)."""
    ops = (flash_attention_fwd_op, flash_attention_bwd_op)
    kernels = [op.kernels for op in ops]
    jax.clear_caches()
    for op in ops:
        op.kernels = [k for k in op.kernels if k.name != name]
    try:
        yield
    finally:
        for op, ks in zip(ops, kernels):
            op.kernels = ks
        jax.clear_caches()


def _attention_inputs(dims, dtype):
    """Random ``(q, k, v, do)`` of ``dims = (b, sq, skv, hq, hkv, d)`` in ``dtype``."""
    b, sq, skv, hq, hkv, d = dims
    q, do = rand((b, sq, hq, d), dtype), rand((b, sq, hq, d), dtype)
    k, v = rand((b, skv, hkv, d), dtype), rand((b, skv, hkv, d), dtype)
    return q, k, v, do


def _check_index_masks(dims, opts, dtype, *, repeat: int = 1, kernel: str = "mosaic_gpu"):
    """Forward and the gradients of ``(out, lse)``'s cotangents through the kernels
    (``kernel``'s), with lengths and a window (``opts``), vs float64; ``repeat`` runs agree
    bit for bit."""
    b, sq, _, hq, _, _ = dims
    q, k, v, do = _attention_inputs(dims, dtype)
    dl = rand((b, hq, sq), jnp.float32)

    @jax.jit
    def f(q, k, v, do, dl):
        (out, lse), vjp = jax.vjp(lambda *a: flash_attention_fwd(*a, **opts), q, k, v)
        return (out, lse, *vjp((do, dl)))

    assert _chosen(f, q, k, v, do, dl) == [kernel, kernel]
    runs = [f(q, k, v, do, dl) for _ in range(repeat)]
    for later in runs[1:]:
        for x, y in zip(runs[0], later):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np_opts = {
        n: x if n == "causal" or n.endswith("size") else np.asarray(x) for n, x in opts.items()
    }
    out, lse, grads = np_with_lse_cotangent(f64(q), f64(k), f64(v), f64(do), f64(dl), np_opts)
    got_lse = f64(runs[0][1])
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(lse))  # unseen queries
    seen = np.isfinite(lse)
    np.testing.assert_allclose(got_lse[seen], lse[seen], rtol=0, atol=1e-4)
    for got, want in zip((runs[0][0], *runs[0][2:]), (out, *grads)):
        assert_close(got, want, factor=2.0)


def _mask_bias_operands(mask_shape, bias_shape, empty_rows=()):
    """A random mask (70% visible; the query rows ``empty_rows`` see nothing) and a random
    f32 bias of the given shapes (None each where the shape is)."""
    mask = bias = None
    if mask_shape is not None:
        mask = np.array(jax.random.uniform(jax.random.key(7), mask_shape) < 0.7)
        mask[:, :, list(empty_rows)] = False
        mask = jnp.asarray(mask)
    if bias_shape is not None:
        bias = rand(bias_shape, jnp.float32, scale=2.0)
    return mask, bias


def _check_exact_bias(dims, bias_shape, dtype):
    """The forward kernel with a large bias in the inputs' dtype: lse to 1e-4 of float64
    (a bias rounded again in the kernel misses it by about 1e-2)."""
    q, k, v = (rand(dims, dtype) for _ in range(3))
    bias = rand(bias_shape, dtype, scale=8.0)
    f = jax.jit(lambda q, k, v, bias: flash_attention_fwd(q, k, v, bias=bias))
    assert _chosen(f, q, k, v, bias) == ["mosaic_gpu"]
    out, lse = f(q, k, v, bias)
    want_out, want_lse = np_dense(f64(q), f64(k), f64(v), dict(bias=f64(bias)))
    np.testing.assert_allclose(f64(lse), want_lse, rtol=0, atol=1e-4)
    assert_close(out, want_out, dtype, factor=2.0)


def _check_bias_dtype_bits(dims, bias_shape, dtype, bias_dtype):
    """A bias alone in ``bias_dtype`` (16-bit), which the kernels read as it is where it is
    their dtype and convert where not, gives the bits of the same values passed in f32:
    output, lse and the three gradients through the kernels."""
    q, k, v, do = _attention_inputs(dims, dtype)
    bias = rand(bias_shape, bias_dtype, scale=2.0)

    @jax.jit
    def f(q, k, v, do, bias):
        attend = lambda q, k, v: flash_attention_fwd(q, k, v, bias=bias, causal=True)
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, lse, *vjp((do, jnp.zeros_like(lse))))

    assert _chosen(f, q, k, v, do, bias) == ["mosaic_gpu", "mosaic_gpu"]
    got, want = f(q, k, v, do, bias), f(q, k, v, do, bias.astype(jnp.float32))
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _check_mask_bias(
    dims, mask_shape, bias_shape, opts, dtype, *, repeat=1, empty_rows=(), dbias=False
):
    """Forward (``out``, ``lse``) and ``(dq, dk, dv)`` through the kernels with a mask and
    a bias vs float64; ``repeat`` runs agree bit for bit. ``dbias``: the bias is
    differentiated too, so the backward runs the reference (from the kernel's ``lse``)."""
    q, k, v, do = _attention_inputs(dims, dtype)
    mask, bias = _mask_bias_operands(mask_shape, bias_shape, empty_rows)

    @jax.jit
    def f(q, k, v, do, mask, bias):
        def attend(q, k, v, bias):
            return flash_attention_fwd(q, k, v, bias=bias, mask=mask, **opts)

        if dbias:
            (out, lse), vjp = jax.vjp(attend, q, k, v, bias)
        else:
            (out, lse), vjp = jax.vjp(functools.partial(attend, bias=bias), q, k, v)
        return (out, lse, *vjp((do, jnp.zeros_like(lse))))

    backward = "reference" if dbias else "mosaic_gpu"
    assert _chosen(f, q, k, v, do, mask, bias) == ["mosaic_gpu", backward]
    runs = [f(q, k, v, do, mask, bias) for _ in range(repeat)]
    for later in runs[1:]:
        for x, y in zip(runs[0], later):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np_opts = {n: np.asarray(x) if isinstance(x, list) else x for n, x in opts.items()}
    np_opts.update({n: np.asarray(x) for n, x in (("mask", mask), ("bias", bias)) if x is not None})
    (out, lse), grads = np_dense(f64(q), f64(k), f64(v), np_opts, do=f64(do))
    got_lse = f64(runs[0][1])
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(lse))  # rows seeing none
    seen = np.isfinite(lse)
    np.testing.assert_allclose(got_lse[seen], lse[seen], rtol=0, atol=3e-2)
    for got, want in zip((runs[0][0], *runs[0][2:]), (out, *grads)):
        assert_close(got, want, dtype, factor=2.0)


# (batch, seq_q, seq_kv, heads_q, heads_kv, head_dim), the mask's and the bias's shapes,
# the other options and the query rows the mask empties (each case has few CTAs: the
# interpreter's time grows with them). With a query dim of 1 the kernels stream a vector of
# keys per block ("rows"), else a tile of the scores: a bias per batch entry and head
# (tiles); a key-padding mask (B, 1, 1, Skv) with a bias broadcast over the batch, ragged
# and causal (rows); a key bias per head of a GQA group (rows); a mask broadcast over the
# group's heads, emptying rows, beside a bias per head, key lengths and a window (tiles).
MASK_BIAS = [
    pytest.param(
        (2, 128, 128, 2, 1, 64), None, (2, 2, 128, 128), {}, (), id="tiles-per-batch-and-head"
    ),
    pytest.param(
        (2, 100, 200, 1, 1, 64),
        (2, 1, 1, 200),
        (1, 1, 1, 200),
        dict(causal=True),
        (),
        id="rows-keypad-causal-ragged",
    ),
    pytest.param(
        (1, 100, 300, 2, 1, 64), None, (1, 2, 1, 300), dict(causal=True), (), id="rows-per-head"
    ),
    pytest.param(
        (1, 100, 200, 2, 1, 64),
        (1, 1, 100, 200),
        (1, 2, 100, 200),
        dict(local_window_size=(90, 40), key_value_seq_lengths=[180]),
        (0, 77, 99),
        id="tiles-empty-rows-window-lengths",
    ),
]


# (batch, seq_q, seq_kv, heads_q, heads_kv, head_dim) and the options: a two-sided window
# (masked blocks before and after the visible ones) with padded queries and keys; a causal
# window over a kv cache longer than the queries (the forward skips its first key block),
# keys cut by a length (the dK/dV kernel's CTAs past it run empty).
INDEX_MASKS = [
    pytest.param(
        (1, 100, 200, 2, 1, 64),
        dict(local_window_size=(60, 9), query_seq_lengths=[90], key_value_seq_lengths=[150]),
        id="window-lengths",
    ),
    pytest.param(
        (1, 72, 440, 1, 1, 64),
        dict(causal=True, local_window_size=(100, 5), key_value_seq_lengths=[430]),
        id="causal-window-kvcache",
    ),
    pytest.param(
        (1, 100, 130, 2, 1, 64),
        dict(
            causal=True,
            q_segment_ids=[[0] * 40 + [1] * 25 + [2] * 35],
            kv_segment_ids=[[0] * 60 + [1] * 30 + [2] * 40],
        ),
        id="causal-segments",
    ),
]

# Decoding: the forward and dQ kernels split the keys into chunks, one CTA each (shortened
# to 256 keys in the interpreter, so that a few blocks make several chunks, the last one
# short): a GQA group; a causal window with a key length (the chunks before the window
# run empty); segment ids.
DECODE_MASKS = [
    pytest.param((2, 3, 700, 2, 1, 64), {}, id="gqa"),
    pytest.param(
        (1, 5, 900, 2, 2, 64),
        dict(causal=True, local_window_size=(300, 0), key_value_seq_lengths=[850]),
        id="causal-window-lengths",
    ),
    pytest.param(
        (1, 4, 400, 1, 1, 64),
        dict(q_segment_ids=[[1, 1, 2, 2]], kv_segment_ids=[[1] * 250 + [2] * 150]),
        id="segments",
    ),
    # A batch entry with no keys (every chunk empty: zeros, lse = -inf) and one padded query.
    pytest.param(
        (2, 2, 600, 1, 1, 64),
        dict(key_value_seq_lengths=[0, 600], query_seq_lengths=[2, 1]),
        id="empty-cache-lengths",
    ),
    # A key-padding mask (a vector of keys per block) and a bias per query (tiles): the
    # chunks stream their own part of each.
    pytest.param(
        (1, 4, 600, 2, 1, 64),
        dict(mask_shape=(1, 1, 1, 600), bias_shape=(1, 2, 4, 600)),
        id="mask-bias",
    ),
]


def _check_decode(dims, opts, dtype, *, repeat: int = 1, batch_alone: bool = False):
    """:func:`_check_index_masks` (or :func:`_check_mask_bias`, for ``opts`` naming a
    mask's and a bias's shapes) on a decode shape whose forward and dQ kernels split the
    keys; ``batch_alone`` (and no ``opts``): the last batch entry alone gets the same bits
    as in the batch (the chunks depend on the sequence lengths only, so a sharded batch
    computes the same sums; :func:`test_key_chunks_depend_on_the_lengths_only` checks the
    rule on the CPU, where compiling the two programs in the interpreter is slow). The
    Mosaic GPU forward runs, not the Triton decode forward that would take some cases."""
    with without_kernel("triton_decode"):
        _check_decode_chunks(dims, opts, dtype, repeat, batch_alone)


def _check_decode_chunks(dims, opts, dtype, repeat, batch_alone):
    chunks = {"fwd": [], "dq": []}
    combine, sum_chunks = am._combine_chunks, am._sum_chunks

    def spy_fwd(parts, lse):
        chunks["fwd"].append(parts.shape[1])
        return combine(parts, lse)

    def spy_dq(parts):
        chunks["dq"].append(parts.shape[1])
        return sum_chunks(parts)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(am, "_combine_chunks", spy_fwd)
        mp.setattr(am, "_sum_chunks", spy_dq)
        if "mask_shape" in opts:
            _check_mask_bias(dims, opts["mask_shape"], opts["bias_shape"], {}, dtype, repeat=repeat)
        else:
            _check_index_masks(dims, opts, dtype, repeat=repeat)
        assert all(seen and min(seen) > 1 for seen in chunks.values()), chunks
        if not batch_alone or dims[0] == 1 or opts:
            return
        q, k, v, do = _attention_inputs(dims, dtype)
        whole = _fwd_bwd(q, k, v, do, causal=False)
        alone = _fwd_bwd(*(x[-1:] for x in (q, k, v, do)), causal=False)
        for x, y in zip(whole, alone):
            np.testing.assert_array_equal(np.asarray(x[-1:]), np.asarray(y))


def _bwd_with_lengths(dims, causal, lengths, *, interpret, window=None):
    """``flash_bwd`` bound to f16 operands with key ``lengths``, an lse cotangent and a
    local ``window`` (None: none; its knobs left to the caller), and the float64 gradients
    it should give."""
    b, sq, _, hq, _, d = dims
    dtype = jnp.float16
    q, k, v, do = _attention_inputs(dims, dtype)
    dl = rand((b, hq, sq), jnp.float32)
    n = jnp.array(lengths, jnp.int32)
    spec = AttentionSpec(
        causal=causal,
        scale=d**-0.5,
        config=FlashAttentionConfig(),
        has_kv_lengths=True,
        local_window_size=window,
    )
    # (the forward from the reference: the backward kernels are under test, and the
    # interpreter's forward kernel would cost as much as they do)
    with ts.kernel_mode("xla"):
        out, lse = flash_attention_fwd(
            q, k, v, causal=causal, key_value_seq_lengths=n, local_window_size=window
        )
    bwd = functools.partial(
        am.flash_bwd, spec.replace(has_dlse=True), q, k, v, out, lse, do, n, dl, interpret=interpret
    )
    opts = dict(causal=causal, key_value_seq_lengths=np.asarray(n), local_window_size=window)
    return bwd, np_with_lse_cotangent(f64(q), f64(k), f64(v), f64(do), f64(dl), opts)[2]


def _check_dq_dkv(dims, causal, lengths, *, interpret, split_keys=None, repeat=1, window=None):
    """dQ, dK and dV from the dQ kernel alone (``flash_bwd(dq_dkv=True)``) with key lengths,
    an lse cotangent and a ``window`` vs float64; ``repeat`` runs agree bit for bit."""
    bwd, want = _bwd_with_lengths(dims, causal, lengths, interpret=interpret, window=window)
    runs = [
        [np.asarray(g) for g in bwd(dq_dkv=True, dq_split_keys=split_keys)] for _ in range(repeat)
    ]
    for later in runs[1:]:
        for x, y in zip(runs[0], later):
            np.testing.assert_array_equal(x, y)
    for got, ref in zip(runs[0], want):
        assert_close(got, ref, factor=2.0)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dq_dkv", [False, True])
def test_kept_keys_need_no_padded_copy(d, dq_dkv):
    """The keys the operator keeps under a window (a multiple of TILE) are a whole number
    of the backward's key tiles: its K and V operands are the slice itself, not a padded
    copy of it."""
    skv = 33 * am.TILE
    q, k = (jax.ShapeDtypeStruct((1, s, 8, d), jnp.bfloat16) for s in (16, skv))
    p = am._bwd_problem(q, k, False, 1.0, dq_dkv=dq_dkv)
    assert p.seq_kv_pad == skv


@pytest.mark.parametrize(
    "d, dq_dkv, features, slots",
    [
        (64, True, {}, (4, 4)),
        (128, True, {}, (4, 4)),  # (the ring fills what the tiles leave)
        (128, True, dict(has_segment_ids=True), (4, 3)),
        (128, False, {}, (2, 2)),
        (256, False, {}, (2, 1)),
    ],
)
def test_dq_kernel_ring_slots(d, dq_dkv, features, slots):
    """Decoding, the dQ kernel computing dK and dV takes up to ``DQ_DKV_STAGES`` K and V
    slots, as many as fit its shared memory; the dQ kernel of the two-kernel backward two."""
    q, k = (jax.ShapeDtypeStruct((1, s, 2, d), jnp.bfloat16) for s in (16, 4096))
    extra = am.SEGMENT_SMEM_BYTES if features else 0
    p = am._bwd_problem(q, k, False, 1.0, extra=extra, dq_dkv=dq_dkv)
    assert (p.stages, p.v_stages) == slots
    if dq_dkv:
        ring = (p.stages + p.v_stages) * p.block_kv * d * 2
        tiles = 2 * 2 * am.WG_ROWS * d * 2 + am.PDS_SLOTS * 2 * am.WG_ROWS * p.block_kv * 2
        assert ring + tiles + extra <= am.SMEM_BYTES


def _check_dkv_dq(dims, causal, lengths, *, interpret, repeat=1, window=None):
    """dQ from the dK/dV kernel (``flash_bwd(dkv_dq=True)``, head_dim 128) with key
    lengths, an lse cotangent and a ``window`` vs float64; ``repeat`` runs agree bit for
    bit. Compiled, dK and dV are bit for bit those of the two kernels too (the interpreter
    would take as long again for them)."""
    bwd, want = _bwd_with_lengths(dims, causal, lengths, interpret=interpret, window=window)
    runs = [[np.asarray(g) for g in bwd(dkv_dq=True)] for _ in range(repeat)]
    for later in runs[1:]:
        for x, y in zip(runs[0], later):
            np.testing.assert_array_equal(x, y)
    if not interpret:
        two = [np.asarray(g) for g in bwd(dkv_dq=False, dq_dkv=False)]
        for x, y in zip(runs[0][1:], two[1:]):
            np.testing.assert_array_equal(x, y)
    for got, ref in zip(runs[0], want):
        assert_close(got, ref, factor=2.0)


# (dims, causal, key lengths, window) of the dK/dV kernel computing dQ too: chains of key
# tiles per query block that start late (a window), end early (a length: the last tile
# sees no query) or hold one tile; causal; GQA.
DKV_DQ_CASES = [
    pytest.param((1, 70, 300, 2, 1, 128), False, [250], None, id="gqa-lengths"),
    pytest.param((1, 60, 260, 1, 1, 128), True, [140], None, id="causal-length"),
    pytest.param((1, 130, 260, 1, 1, 128), False, [260], (60, 10), id="window"),
]
# The GPU twins: longer chains of the same kinds.
DKV_DQ_GPU_CASES = [
    pytest.param((1, 200, 300, 2, 1, 128), False, [250], None, id="gqa-lengths"),
    pytest.param((2, 130, 400, 1, 1, 128), True, [400, 200], None, id="causal-lengths"),
    pytest.param((1, 330, 330, 1, 1, 128), False, [330], (100, 30), id="window"),
]


def _check_dkv_tiles(dims, causal, tiles, *, interpret, against=1):
    """The dK/dV kernel at ``tiles`` key tiles per CTA (the last CTA short, the second
    batch entry's length of 100 keys ending in a live CTA) against ``against`` tiles per
    CTA, bit for bit (None: not run again), and the gradients of ``(out, lse)``'s
    cotangents against float64."""
    b, sq, skv, hq, hkv, d = dims
    q, k = (jax.ShapeDtypeStruct((b, s, h, d), jnp.float16) for s, h in ((sq, hq), (skv, hkv)))
    kv_tiles = am._bwd_problem(q, k, causal, 1.0, dkv_tiles=tiles).kv_tiles
    assert kv_tiles % tiles != 0
    bwd, want = _bwd_with_lengths(dims, causal, [skv, 100], interpret=interpret)
    grads = [np.asarray(g) for g in bwd(dkv_tiles=tiles)]
    for got, other in zip(grads, () if against is None else bwd(dkv_tiles=against)):
        np.testing.assert_array_equal(got, np.asarray(other))
    for got, ref in zip(grads, want):
        assert_close(got, ref, factor=2.0)


def _check_folded_group(dims, opts, *, interpret):
    """Decoding with GQA (``opts``: key lengths or causal) folds the group into the rows:
    the forward has the bits of the unfolded kernels; forward and gradients through
    ``ts.flash_attention`` against float64 (:func:`_check_index_masks`)."""
    b, sq, skv, hq, hkv, d = dims
    causal, lengths = opts.get("causal", False), opts.get("key_value_seq_lengths")
    q = rand((b, sq, hq, d), jnp.bfloat16)
    k, v = rand((b, skv, hkv, d), jnp.bfloat16), rand((b, skv, hkv, d), jnp.bfloat16)
    spec = _spec(causal=causal, has_kv_lengths=lengths is not None)
    assert am._folded_group(spec, q, k) == hq // hkv
    extras = () if lengths is None else (jnp.array(lengths, jnp.int32),)
    folded = am.flash_fwd(spec, q, k, v, *extras, interpret=interpret)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(am, "_folded_group", lambda spec, q, k: 1)
        unfolded = am.flash_fwd(spec, q, k, v, *extras, interpret=interpret)
    for x, y in zip(folded, unfolded):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with without_kernel("triton_decode"):
        _check_index_masks(dims, opts, jnp.bfloat16)


# (batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, causal)
# Padded query and key tails, a GQA group of 2, seq_q < seq_kv (the bottom-right diagonal).
RAGGED_GQA = (1, 72, 100, 2, 1, 64, True)
# head_dim 256: the dK/dV kernel's warpgroups share key rows and split roles, the dQ
# kernel's V ring is shorter than its K ring.
RAGGED_D256 = (1, 72, 100, 1, 1, 256, True)


@pytest.fixture
def interpret_mode():
    with ts.kernel_mode("interpret"):
        yield


@pytest.fixture
def pallas_mode():
    with ts.kernel_mode("pallas"):
        yield


# Interpreted checks of one feature each, whose GPU twins run every case: 3 per run.
_feature_check = sampled_tests(
    [
        "test_padded_head_dim",
        "test_bias_in_input_dtype_is_exact",
        "test_index_masks_and_lse_cotangent",
        "test_query_lengths_skip_padded_blocks",
        "test_decode_splits_the_keys",
        "test_dq_kernel_computes_dk_dv_after_a_window_start",
        "test_decode_folds_the_gqa_group",
    ],
    3,
)


@pytest.mark.usefixtures("interpret_mode")
class TestAttentionKernelsInterpret:
    # The interpreter is slowest on these two: one of them per run (TESSERA_TEST_FULL=1: both).
    @pytest.mark.parametrize(
        "case",
        sample([pytest.param(RAGGED_GQA, id="gqa"), pytest.param(RAGGED_D256, id="d256")], 1),
    )
    def test_ragged_causal(self, case):
        _check(case, jnp.bfloat16)

    # head_dim 256: the dK/dV warpgroups hand Pᵀ over through shared memory. One per run.
    @pytest.mark.parametrize("head_dim", sample([64, 256], 1))
    def test_non_causal_no_races_bitwise_repeatable(self, head_dim):
        """Race detection on; two runs give the same bits (no atomics, a fixed order of
        accumulation)."""
        _fwd_bwd.clear_cache()  # trace under the race-detecting interpreter parameters
        with _compat.gpu_interpret_mode(detect_races=True):
            _check((1, 128, 128, 1, 1, head_dim, False), jnp.float16, repeat=2)
        assert _compat.races_detected() is False
        _fwd_bwd.clear_cache()  # later tests: not the race-detecting program

    def test_same_bits_with_x64(self):
        _check_x64((1, 100, 100, 2, 1, 64, True), backward=False, kernels=["mosaic_gpu"])

    # A head dim the kernels do not have runs zero-padded to the next one, with what the
    # kernels take there (here a key-padding mask and a bias per query).
    @_feature_check
    def test_padded_head_dim(self):
        dims = (1, 128, 128, 1, 1, 40)
        _check_mask_bias(dims, (1, 1, 1, 128), (1, 1, 128, 128), dict(causal=True), jnp.bfloat16)

    # A 16-bit bias reaches the scores unrounded: the kernels scale it to the exp2 domain
    # in f32, so lse matches float64 as closely as without a bias.
    @pytest.mark.parametrize(
        "bias_shape", [(1, 2, 128, 128), (1, 2, 1, 128)], ids=["tiles", "rows"]
    )
    @_feature_check
    def test_bias_in_input_dtype_is_exact(self, bias_shape):
        _check_exact_bias((1, 128, 2, 64), bias_shape, jnp.float16)

    # The bias in the inputs' dtype (tiles; padded here, read as given in the GPU twin's
    # whole tiles) or in the other 16-bit dtype (converted and clipped), against its f32
    # copy: one per run, the GPU twin runs both.
    @pytest.mark.parametrize(
        "dtype, bias_dtype",
        sample([(jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.bfloat16)], 1),
    )
    def test_16bit_bias_gives_the_bits_of_f32(self, dtype, bias_dtype):
        _check_bias_dtype_bits((1, 70, 100, 2, 1, 64), (1, 2, 70, 100), dtype, bias_dtype)

    # Lengths, a window, segment ids and an lse cotangent in the kernels. One case per run.
    @pytest.mark.parametrize("dims, opts", sample(INDEX_MASKS, 1))
    @_feature_check
    def test_index_masks_and_lse_cotangent(self, dims, opts):
        _check_index_masks(dims, opts, jnp.bfloat16)

    # Query lengths: the kernels skip blocks of padded queries only: here a warpgroup's
    # rows and a whole CTA of the forward (its pipelined loop) and of the dQ kernel, and
    # the dK/dV kernel's loop past the first query block.
    @_feature_check
    def test_query_lengths_skip_padded_blocks(self):
        opts = dict(query_seq_lengths=[10], key_value_seq_lengths=[100])
        _check_index_masks((1, 130, 100, 1, 1, 128), opts, jnp.bfloat16)

    # One case per run.
    @pytest.mark.parametrize("dims, opts", sample(DECODE_MASKS, 1))
    @_feature_check
    def test_decode_splits_the_keys(self, dims, opts, monkeypatch):
        monkeypatch.setattr(am, "default_split_keys", lambda seq_kv: 256)
        _check_decode(dims, opts, jnp.bfloat16)

    def test_decode_chunks_no_races(self):
        """Race detection on: each chunk writes its partial through tiles it reuses (the
        forward's output tile twice). Two chunks, the last one short."""
        q, do = rand((1, 3, 1, 64), jnp.float16), rand((1, 3, 1, 64), jnp.float16)
        k, v = rand((1, 264, 1, 64), jnp.float16), rand((1, 264, 1, 64), jnp.float16)
        spec = _spec(causal=True)
        with _compat.gpu_interpret_mode(detect_races=True):
            out, lse = am.flash_fwd(spec, q, k, v, interpret=True, split_keys=256)
            # (the two kernels: the dQ kernel computing dK and dV has a race test of its own)
            grads = am.flash_bwd(
                spec, q, k, v, out, lse, do, interpret=True, dq_split_keys=256, dq_dkv=False
            )
            grads = [np.asarray(g) for g in grads]
        assert _compat.races_detected() is False
        assert_close(out, np_attention(f64(q), f64(k), f64(v), True), factor=2.0)
        want = np_attention_grads(f64(q), f64(k), f64(v), f64(do), True)
        for got, ref in zip(grads, want):
            assert_close(got, ref, factor=2.0)

    # The dK/dV kernel running several key tiles per CTA, as at a long cache, against
    # float64 (the GPU twins compare its bits with a tile per CTA). The last CTA is short;
    # a batch entry's length ends inside a live CTA, whose tiles past it only skip. Race
    # detection on. One case per run.
    @pytest.mark.parametrize(
        "dims, causal, tiles",
        sample(
            [
                # (the diagonal in the second tile of the last CTA)
                pytest.param((2, 3, 600, 2, 1, 64), True, 3, id="gqa-causal"),
                pytest.param((2, 5, 300, 1, 1, 256), False, 4, id="d256-roles"),
            ],
            1,
        ),
    )
    def test_dkv_tiles_per_cta(self, dims, causal, tiles):
        with _compat.gpu_interpret_mode(detect_races=True):
            _check_dkv_tiles(dims, causal, tiles, interpret=True, against=None)
        assert _compat.races_detected() is False

    # The dQ kernel computing dK and dV too: warpgroup 0 hands each key block's P and dS
    # to warpgroup 1 through a ring, and writes dQ through tiles warpgroup 1 reads. Race
    # detection on; chunks of keys, a length ending in a chunk's second block. One per run.
    @pytest.mark.parametrize(
        "dims, causal, lengths, split_keys",
        sample(
            [
                pytest.param((2, 3, 600, 2, 2, 64), True, [600, 100], 256, id="chunks-causal"),
                pytest.param((1, 16, 300, 1, 1, 128), False, [300], None, id="d128"),
                # (the group folded into the rows: :func:`am._fold`)
                pytest.param((2, 4, 300, 8, 2, 64), False, [300, 70], 128, id="gqa"),
            ],
            1,
        ),
    )
    def test_dq_kernel_computes_dk_dv(self, dims, causal, lengths, split_keys):
        with _compat.gpu_interpret_mode(detect_races=True):
            _check_dq_dkv(dims, causal, lengths, interpret=True, split_keys=split_keys)
        assert _compat.races_detected() is False

    # The dK/dV kernel computing dQ too: interpreted, each key tile writes its partial
    # apart and the wrapper adds them in the GPU's order (am._dq_in_key_order; TMA's
    # reduce-add and the semaphores that order the adds on the GPU: test_dkv_dq_turns).
    # Race detection on. One case per run.
    @pytest.mark.parametrize("dims, causal, lengths, window", sample(DKV_DQ_CASES, 1))
    def test_dkv_kernel_computes_dq(self, dims, causal, lengths, window):
        with _compat.gpu_interpret_mode(detect_races=True):
            _check_dkv_dq(dims, causal, lengths, interpret=True, window=window)
        assert _compat.races_detected() is False

    @_feature_check
    def test_dq_kernel_computes_dk_dv_after_a_window_start(self):
        """Before the window's first key the kernel skips whole key blocks (3 of 4 here)
        and writes no dK/dV there: the wrapper zeroes them (the interpreter's unwritten
        outputs are NaN)."""
        _check_dq_dkv((1, 2, 256, 1, 1, 64), False, [256], interpret=True, window=(60, 0))

    # Decoding with GQA folds the group's queries into one tile's rows: the forward's bits
    # are those of the unfolded kernels; the gradients against float64. One batch entry
    # (the unfolded kernels run a program per query head, the interpreter's slowest part).
    # One case per run.
    @pytest.mark.parametrize(
        "dims, opts",
        sample(
            [
                pytest.param((1, 3, 130, 2, 1, 64), dict(key_value_seq_lengths=[90])),
                pytest.param((1, 1, 200, 8, 2, 64), dict(causal=True)),
            ],
            1,
        ),
    )
    @_feature_check
    def test_decode_folds_the_gqa_group(self, dims, opts):
        _check_folded_group(dims, opts, interpret=True)

    # The same with segment ids, a bias or a key-padding mask (which the P handed over
    # carries): against float64. One case per run.
    @pytest.mark.parametrize("feature", sample(["segments", "bias", "mask"], 1))
    def test_dq_kernel_computes_dk_dv_with_masks(self, feature):
        # Two chunks of keys, the last short; the bias broadcasts over a batch of one.
        b, sq, skv, h, d = 1 if feature == "bias" else 2, 5, 150, 1, 64
        q, do = rand((b, sq, h, d), jnp.float16), rand((b, sq, h, d), jnp.float16)
        k, v = rand((b, skv, h, d), jnp.float16), rand((b, skv, h, d), jnp.float16)
        if feature == "segments":
            q_seg = jnp.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], jnp.int32)
            kv_seg = np.searchsorted([0, 60, 100], np.arange(skv), side="right") - 1
            extras = (q_seg, jnp.asarray(np.stack([kv_seg] * b), jnp.int32))
            opts = dict(q_segment_ids=extras[0], kv_segment_ids=extras[1])
        elif feature == "bias":
            extras = (rand((1, h, sq, skv), jnp.float16),)
            opts = dict(causal=True, bias=extras[0])
        else:
            extras = (jax.random.bernoulli(jax.random.key(3), 0.8, (b, 1, 1, skv)),)
            opts = dict(mask=extras[0])
        spec = AttentionSpec(
            causal=feature == "bias",
            scale=d**-0.5,
            config=FlashAttentionConfig(),
            **{f"has_{'segment_ids' if feature == 'segments' else feature}": True},
        )
        out, lse = am.flash_fwd(spec, q, k, v, *extras, interpret=True)
        bwd = functools.partial(am.flash_bwd, spec, q, k, v, out, lse, do, *extras)
        with _compat.gpu_interpret_mode(detect_races=True):
            got = [np.asarray(g) for g in bwd(interpret=True, dq_dkv=True, dq_split_keys=128)]
        assert _compat.races_detected() is False
        _, want = np_dense(f64(q), f64(k), f64(v), opts, do=f64(do))
        for x, y in zip(got, want):
            assert_close(x, y, factor=2.0)

    # A mask and a bias in the kernels, broadcast in every supported way; one case per run:
    # or a race-detecting, bitwise-repeated one, or one differentiating the bias (the
    # forward kernel, then the reference's backward) (TESSERA_TEST_FULL=1: all).
    @pytest.mark.parametrize(
        "dims, mask_shape, bias_shape, opts, empty_rows, mode",
        sample(
            [pytest.param(*c.values, "", id=c.id) for c in MASK_BIAS]
            + [
                pytest.param(
                    (1, 128, 128, 1, 1, 64),
                    (1, 1, 128, 128),
                    (1, 1, 128, 128),
                    dict(causal=True),
                    (5,),
                    "races",
                    id="tiles-races-repeatable",
                ),
                pytest.param(
                    (1, 128, 256, 1, 1, 64),
                    (1, 1, 1, 256),
                    (1, 1, 1, 256),
                    {},
                    (),
                    "races",
                    id="rows-races-repeatable",
                ),
                pytest.param(
                    (1, 128, 128, 2, 1, 64),
                    (1, 1, 128, 128),
                    (1, 2, 1, 128),
                    dict(causal=True),
                    (),
                    "dbias",
                    id="rows-bias-gradient",
                ),
            ],
            1,
        ),
    )
    def test_mask_and_bias(self, dims, mask_shape, bias_shape, opts, empty_rows, mode):
        if mode != "races":
            _check_mask_bias(
                dims,
                mask_shape,
                bias_shape,
                opts,
                jnp.bfloat16,
                empty_rows=empty_rows,
                dbias=mode == "dbias",
            )
            return
        with _compat.gpu_interpret_mode(detect_races=True):
            _check_mask_bias(
                dims, mask_shape, bias_shape, opts, jnp.float16, repeat=2, empty_rows=empty_rows
            )
        assert _compat.races_detected() is False


# Packed sequences: per batch entry, segments of unequal lengths (one of them 1024 long).
SEGMENTS = [[0] * 300 + [1] * 200 + [2] * 524, [7] * 1024]


@pytest.mark.gpu
@pytest.mark.usefixtures("pallas_mode")
class TestAttentionKernelsGPU:
    @pytest.mark.parametrize("heads_kv", ["mha", "mqa"])
    @pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
    def test_a_mesh_of_the_gpus_keeps_one_gpus_bits(self, heads_kv, axis_type):
        """The kernels' output and gradients on a mesh of every local GPU, the batch or the
        heads sharded: one GPU's bits. (Δ as an XLA reduction broke this: XLA's autotuner
        emitted it differently in different programs.) The CPU tests check the reference
        on meshes (test_sharding_rules) and that no XLA reduction surrounds the kernels
        (test_sums_around_the_kernels_keep_a_fixed_order). Needs 2+ GPUs."""
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if len(gpus) < 2:
            pytest.skip(f"a mesh of GPUs needs 2+; this host has {len(gpus)}")
        n = len(gpus)
        b, s, hq, d = 2 * n, 512, 4 * n, 128
        hkv = hq if heads_kv == "mha" else 1
        q, do = rand((b, s, hq, d), jnp.bfloat16), rand((b, s, hq, d), jnp.bfloat16)
        k, v = rand((b, s, hkv, d), jnp.bfloat16), rand((b, s, hkv, d), jnp.bfloat16)
        f = functools.partial(ts.flash_attention, causal=True)

        def run(q, k, v, do):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(do)

        assert _chosen(run, q, k, v, do) == ["mosaic_gpu", "mosaic_gpu"]
        want = jax.jit(run)(q, k, v, do)
        types = (getattr(jax.sharding.AxisType, axis_type),)
        mesh = jax.make_mesh((n,), ("x",), axis_types=types, devices=gpus)
        kv_heads = "x" if hkv % n == 0 else None
        layouts = {
            "batch": (("x",), ("x",)),
            "heads": ((None, None, "x"), (None, None, kv_heads)),
        }
        for name, (q_spec, kv_spec) in layouts.items():
            with jax.set_mesh(mesh):
                put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
                args = [put(q, q_spec), put(k, kv_spec), put(v, kv_spec)]
                out_spec = jax.jit(f)(*args).sharding.spec
                got = jax.jit(run)(*args, put(do, out_spec))
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)

    @pytest.mark.parametrize(
        "case",
        [
            (2, 1024, 1024, 8, 2, 128, True),
            (2, 1024, 1024, 8, 8, 128, False),
            (1, 1000, 1000, 4, 1, 64, True),  # ragged, MQA
            (1, 333, 1100, 4, 2, 64, True),  # seq_q < seq_kv, both ragged
            (1, 700, 300, 2, 2, 128, True),  # seq_q > seq_kv: fully masked rows
            RAGGED_GQA,
            (2, 1024, 1024, 8, 2, 256, True),
            (1, 1000, 1000, 4, 4, 256, False),  # ragged
            (1, 333, 1100, 4, 1, 256, True),  # seq_q < seq_kv, both ragged, MQA
            (2, 1024, 1024, 8, 2, 96, True),  # head dims zero-padded to 128
            (1, 1000, 1000, 4, 4, 80, False),
        ],
    )
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    def test_forward_and_gradients(self, case, dtype):
        _check(case, dtype, repeat=3)

    @pytest.mark.parametrize(
        "dims, opts",
        [
            *INDEX_MASKS,
            ((2, 1024, 1024, 8, 2, 128), dict(local_window_size=(256, 256))),
            ((2, 1024, 1024, 8, 2, 128), dict(causal=True, local_window_size=(300, 0))),
            ((4, 1000, 1000, 4, 4, 128), dict(key_value_seq_lengths=[1000, 513, 64, 0])),
            (
                (3, 1024, 1024, 4, 2, 64),
                dict(
                    causal=True,
                    query_seq_lengths=[1024, 700, 5],
                    key_value_seq_lengths=[9, 1024, 1000],
                ),
            ),
            ((1, 1000, 1000, 2, 1, 256), dict(causal=True, local_window_size=(200, 0))),
            # (a batch entry of padded queries only: no block to run)
            (
                (3, 1000, 1000, 4, 2, 128),
                dict(query_seq_lengths=[1000, 300, 0], local_window_size=(200, 100)),
            ),
            (
                (1, 333, 1100, 4, 4, 256),
                dict(local_window_size=(100, 50), key_value_seq_lengths=[900]),
            ),
            ((2, 1024, 1024, 8, 2, 128), dict(q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS)),
            (
                (2, 1024, 1024, 4, 1, 64),
                dict(causal=True, q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS),
            ),
        ],
    )
    def test_index_masks(self, dims, opts):
        _check_index_masks(dims, opts, jnp.bfloat16, repeat=3)

    @pytest.mark.parametrize(
        "dims, causal, lengths, window",
        [
            ((4, 16, 4096, 8, 8, 128), False, [4096, 3000, 1, 2048], None),
            ((2, 1, 32768, 4, 4, 64), True, [32768, 100], None),
            ((2, 1, 8192, 32, 4, 128), True, [8192, 5000], None),
            # key blocks before the window are skipped: their gradients are zeroed
            ((2, 16, 8192, 8, 8, 128), False, [8192, 5000], (2048, 0)),
            ((2, 1, 32768, 4, 4, 64), True, [32768, 30000], (4096, 4096)),
        ],
    )
    def test_dq_kernel_computes_dk_dv(self, dims, causal, lengths, window):
        _check_dq_dkv(dims, causal, lengths, interpret=False, repeat=3, window=window)

    @pytest.mark.parametrize(
        "dims, causal, tiles",
        [
            ((2, 16, 4000, 8, 8, 128), False, 3),  # 32 tiles: CTAs of 3, the last of 2
            ((2, 3, 9000, 8, 2, 64), True, 16),
        ],
    )
    def test_dkv_tiles_per_cta(self, dims, causal, tiles):
        _check_dkv_tiles(dims, causal, tiles, interpret=False)

    @pytest.mark.parametrize("dims, causal, lengths, window", DKV_DQ_GPU_CASES)
    def test_dkv_kernel_computes_dq(self, dims, causal, lengths, window):
        _check_dkv_dq(dims, causal, lengths, interpret=False, repeat=3, window=window)

    @pytest.mark.parametrize(
        "dims, opts",
        [
            ((4, 16, 4096, 16, 4, 128), dict(key_value_seq_lengths=[4096, 3000, 1, 2048])),
            ((2, 1, 32768, 32, 4, 64), dict(causal=True)),
        ],
    )
    def test_decode_folds_the_gqa_group(self, dims, opts):
        _check_folded_group(dims, opts, interpret=False)

    # The forward and dQ kernels' key chunks at their tuned lengths, ragged caches.
    @pytest.mark.parametrize(
        "dims, opts",
        [
            ((4, 1, 8192, 16, 16, 128), {}),
            ((2, 16, 5000, 8, 2, 64), dict(causal=True)),
            (
                (2, 7, 6000, 4, 1, 256),  # the window leaves the last 4507 keys
                dict(causal=True, local_window_size=(4500, 0), key_value_seq_lengths=[6000, 2000]),
            ),
            (
                (2, 8, 6000, 4, 2, 128),
                dict(
                    q_segment_ids=[[0] * 4 + [1] * 4] * 2,
                    kv_segment_ids=[[0] * 2500 + [1] * 3500] * 2,
                ),
            ),
            ((2, 4, 5000, 4, 2, 64), dict(mask_shape=(2, 1, 1, 5000), bias_shape=(1, 4, 4, 5000))),
        ],
    )
    def test_decode_splits_the_keys(self, dims, opts):
        _check_decode(dims, opts, jnp.bfloat16, repeat=3, batch_alone=True)

    @pytest.mark.parametrize(
        "dims, mask_shape, bias_shape, opts, empty_rows",
        [
            *MASK_BIAS,
            pytest.param(
                (2, 1024, 1024, 8, 2, 128),
                (2, 1, 1, 1024),
                (1, 8, 1024, 1024),
                {},
                (),
                id="tiles-keypad-d128",
            ),
            pytest.param(
                (4, 1000, 1000, 8, 2, 128),
                (4, 1, 1, 1000),
                None,
                dict(causal=True),
                (),
                id="rows-keypad-causal-d128",
            ),
            pytest.param(
                (2, 1024, 1024, 4, 1, 64), (2, 1, 1, 1024), (1, 4, 1, 1024), {}, (), id="rows-d64"
            ),
            pytest.param(
                (2, 1000, 1000, 4, 4, 128),
                None,
                (2, 4, 1000, 1000),
                dict(causal=True),
                (),
                id="tiles-causal-ragged-d128",
            ),
            pytest.param(
                (1, 1024, 2048, 8, 1, 64),
                (1, 8, 1024, 2048),
                None,
                dict(causal=True),
                (3, 1000),
                id="tiles-empty-rows-kvcache-d64",
            ),
            pytest.param(
                (2, 1024, 1024, 4, 2, 128),
                (2, 1, 1024, 1024),
                (2, 4, 1024, 1024),
                dict(q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS),
                (),
                id="tiles-segments-d128",
            ),
        ],
    )
    def test_mask_and_bias(self, dims, mask_shape, bias_shape, opts, empty_rows):
        _check_mask_bias(
            dims, mask_shape, bias_shape, opts, jnp.bfloat16, repeat=3, empty_rows=empty_rows
        )

    @pytest.mark.parametrize(
        "case, kernels",
        [
            ((2, 1000, 1000, 4, 2, 128, True), ["mosaic_gpu", "mosaic_gpu"]),
            ((2, 8, 4096, 8, 2, 128, False), ["triton_decode", "triton_decode"]),
        ],
    )
    def test_same_bits_with_x64(self, case, kernels):
        _check_x64(case, backward=True, kernels=kernels)

    @pytest.mark.parametrize("bias_shape", [(1, 8, 1, 1024), (2, 8, 1024, 1024)])
    def test_bias_gradient(self, bias_shape):
        """The bias differentiated: the forward kernel, then the reference's backward."""
        _check_mask_bias((2, 1024, 1024, 8, 2, 128), None, bias_shape, {}, jnp.bfloat16, dbias=True)

    @pytest.mark.parametrize("bias_shape", [(2, 8, 1024, 1024), (1, 8, 1, 1024)])
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    def test_bias_in_input_dtype_is_exact(self, bias_shape, dtype):
        _check_exact_bias((2, 1024, 8, 128), bias_shape, dtype)

    @pytest.mark.parametrize("bias_shape", [(1, 8, 1024, 1024), (2, 8, 1, 1024)])
    @pytest.mark.parametrize(
        "dtype, bias_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.bfloat16)]
    )
    def test_16bit_bias_gives_the_bits_of_f32(self, bias_shape, dtype, bias_dtype):
        _check_bias_dtype_bits((2, 1024, 1024, 8, 2, 128), bias_shape, dtype, bias_dtype)

    @pytest.mark.parametrize("causal", [False, True])
    def test_forward_head_dim_256(self, causal):
        q, k, v = (rand((1, 512, 4, 256), jnp.bfloat16) for _ in range(3))
        f = functools.partial(ts.flash_attention, causal=causal)
        assert _chosen(f, q, k, v) == ["mosaic_gpu"]
        want = np_attention(f64(q), f64(k), f64(v), causal)
        assert_close(jax.jit(f)(q, k, v), want, factor=2)


# --- the pipelined forward (``Problem.fwd_pipelined``) -----------------------------------------
#
# Whichever schedule FWD_PIPELINED picks per head_dim, both are tested: these classes run
# the forward pipelined at every head_dim (the gradients take the usual backward kernels).


@pytest.fixture
def pipelined_forward(monkeypatch):
    monkeypatch.setattr(am, "_fwd_pipelined", lambda p: True)
    _fwd_bwd.clear_cache()  # traced with the other schedule otherwise
    yield
    _fwd_bwd.clear_cache()


def _pipelined(kind, *args, **kw):
    """A check of :func:`_check` (``"plain"``), :func:`_check_index_masks` (``"index"``)
    or :func:`_check_mask_bias` (``"mask_bias"``) with these leading arguments, to be
    called with the dtype and ``repeat``."""
    check = {"plain": _check, "index": _check_index_masks, "mask_bias": _check_mask_bias}[kind]
    return functools.partial(check, *args, **kw)


# A ragged causal GQA case at each head dim (the first block a warpgroup sees is masked and
# peeled, one P·V follows the last), a two-sided window with lengths (flushed blocks before
# and after the band), and a mask emptying rows beside a bias (warpgroups that see no block).
PIPELINED_INTERPRET = [
    pytest.param(_pipelined("plain", (1, 200, 330, 2, 1, 128, True)), id="ragged-gqa-d128"),
    pytest.param(_pipelined("plain", RAGGED_GQA), id="ragged-gqa-d64"),
    pytest.param(_pipelined("plain", RAGGED_D256), id="ragged-d256"),
    pytest.param(_pipelined("index", *INDEX_MASKS[0].values), id="window-lengths"),
    pytest.param(_pipelined("index", *INDEX_MASKS[2].values), id="causal-segments"),
    pytest.param(
        _pipelined("mask_bias", *MASK_BIAS[3].values[:4], empty_rows=MASK_BIAS[3].values[4]),
        id="tiles-empty-rows-window-lengths",
    ),
]


@pytest.mark.usefixtures("pipelined_forward", "interpret_mode")
class TestPipelinedForwardInterpret:
    @pytest.mark.parametrize("check", sample(PIPELINED_INTERPRET, 1))
    def test_pipelined_forward(self, check):
        check(jnp.bfloat16)

    @pytest.mark.parametrize("head_dim", sample([64, 128], 1))
    @pytest.mark.parametrize("pingpong", [True, False])
    def test_no_races_bitwise_repeatable(self, head_dim, pingpong):
        """The forward alone, race detection on, twice: the same bits; with the compute
        warpgroups taking turns on the tensor cores and without."""
        spec = AttentionSpec(causal=True, scale=head_dim**-0.5, config=FlashAttentionConfig())
        q, k, v = (rand((1, 128, 1, head_dim), jnp.float16) for _ in range(3))
        fwd = functools.partial(am.flash_fwd, spec, interpret=True, pingpong=pingpong)
        with _compat.gpu_interpret_mode(detect_races=True):
            runs = [fwd(q, k, v) for _ in range(2)]
        assert _compat.races_detected() is False
        for x, y in zip(*runs):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert_close(runs[0][0], np_attention(f64(q), f64(k), f64(v), True), factor=2)


@pytest.mark.gpu
@pytest.mark.usefixtures("pipelined_forward", "pallas_mode")
class TestPipelinedForwardGPU:
    @pytest.mark.parametrize(
        "check",
        [
            _pipelined("plain", (2, 1024, 1024, 8, 2, 128, False)),
            _pipelined("plain", (2, 1024, 1024, 8, 2, 128, True)),
            _pipelined("plain", (1, 1000, 1000, 4, 1, 64, True)),
            _pipelined("plain", (1, 333, 1100, 4, 1, 256, True)),
            _pipelined("plain", (1, 700, 300, 2, 2, 128, True)),  # fully masked rows
            _pipelined("index", (2, 1024, 1024, 8, 2, 128), dict(local_window_size=(256, 256))),
            _pipelined(
                "index", (4, 1000, 1000, 4, 4, 128), dict(key_value_seq_lengths=[1000, 513, 64, 0])
            ),
            _pipelined(
                "index",
                (2, 1024, 1024, 4, 1, 64),
                dict(causal=True, q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS),
            ),
            _pipelined(
                "mask_bias",
                (1, 1024, 2048, 8, 1, 64),
                (1, 8, 1024, 2048),
                None,
                dict(causal=True),
                empty_rows=(3, 1000),
            ),
            _pipelined(
                "mask_bias", (2, 1024, 1024, 8, 2, 128), (2, 1, 1, 1024), (1, 8, 1024, 1024), {}
            ),
        ],
        ids=[
            "d128",
            "d128-causal",
            "d64-causal-ragged-mqa",
            "d256-causal-ragged",
            "d128-empty-rows",
            "d128-window",
            "d128-kvlens",
            "d64-segments",
            "d64-mask-empty-rows",
            "d128-keypad-bias-tiles",
        ],
    )
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    def test_pipelined_forward(self, check, dtype):
        check(dtype, repeat=3)


# Compiles every attention kernel at each head_dim in a child process whose Mosaic GPU
# prints ptxas's report: one "Compiling entry function" line per kernel, then its warnings.
_PTXAS_CHILD = """
import functools, jax, jax.numpy as jnp
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am
for d in (64, 128, 256):
    for causal in (False, True):
        spec = AttentionSpec(causal=causal, scale=d**-0.5, config=FlashAttentionConfig())
        q = jnp.ones((1, 512, 2, d), jnp.bfloat16)
        lse = jnp.zeros((1, 2, 512), jnp.float32)
        for pipelined in (False, True):
            fwd = functools.partial(am.flash_fwd, spec, pipelined=pipelined)
            jax.jit(fwd).lower(q, q, q).compile()
        jax.jit(functools.partial(am.flash_bwd, spec)).lower(q, q, q, q, lse, q).compile()
    if d <= 128:  # decoding's one-kernel backward
        qd, ld = jnp.ones((1, 16, 2, d), jnp.bfloat16), jnp.zeros((1, 2, 16), jnp.float32)
        bwd = functools.partial(am.flash_bwd, spec, dq_dkv=True)
        jax.jit(bwd).lower(qd, q, q, qd, ld, qd).compile()
print("compiled")
"""


@pytest.mark.gpu
def test_no_kernel_serialises_its_wgmmas():
    """ptxas serialises a kernel's wgmma products when other instructions write registers
    that an in-flight product reads (warning C7513): the pipelined forward cast the next
    block's probabilities to 16 bits while the previous block's P·V was still reading the
    last ones, and ran at about half speed. No attention kernel may draw that warning."""
    # 3 head dims x 2 masks x (2 forwards + dQ + dK/dV), and 2 one-kernel decode backwards
    assert_no_serialised_wgmma(_PTXAS_CHILD, kernels=26)


@pytest.mark.parametrize("head_dim", sample([64, 128, 256], 1))
def test_index_masks_lower_for_cuda(head_dim):
    """The kernels with both lengths, a window, segment ids and an lse cotangent go through
    the real Mosaic GPU lowering (layouts, the lengths' scalar loads, shared memory) at each
    head_dim's tiles; the forward and dQ kernels split the keys into chunks."""
    spec = AttentionSpec(
        causal=True,
        scale=0.1,
        config=FlashAttentionConfig(),
        local_window_size=(300, 0),
        has_q_lengths=True,
        has_kv_lengths=True,
        has_segment_ids=head_dim != 256,  # (the kernels decline them at 256)
    )
    q, k = (jnp.zeros((2, s, h, head_dim), jnp.bfloat16) for s, h in ((300, 4), (700, 2)))
    lse, n = jnp.zeros((2, 4, 300), jnp.float32), jnp.array([5, 700], jnp.int32)
    extras = (n, n) + (jnp.zeros((2, 300), jnp.int32), jnp.zeros((2, 700), jnp.int32)) * (
        spec.has_segment_ids
    )
    fwd = cuda_lowering(functools.partial(am.flash_fwd, spec, split_keys=256), q, k, k, *extras)
    bwd = cuda_lowering_xla_row_dot(
        functools.partial(am.flash_bwd, spec.replace(has_dlse=True), dq_split_keys=256),
        *(q, k, k, q, lse, q, *extras, lse),
    )
    assert (len(mosaic_gpu_calls(fwd)), len(mosaic_gpu_calls(bwd))) == (1, 2)


def test_bias_in_the_kernel_dtype_is_not_copied():
    """A bias alone in the inputs' dtype whose tiles need no padding is every kernel's
    operand as the caller passed it (a (B, H, S, S) copy each call is a read and a write of
    the whole bias): the dK/dV kernel too, which reads its tiles transposed."""
    spec = AttentionSpec(causal=True, scale=0.1, config=FlashAttentionConfig(), has_bias=True)
    q, lse = jnp.zeros((2, 256, 4, 128), jnp.bfloat16), jnp.zeros((2, 4, 256), jnp.float32)
    bias = jnp.zeros((1, 4, 256, 256), jnp.bfloat16)
    fwd = cuda_lowering(functools.partial(am.flash_fwd, spec), q, q, q, bias)
    bwd = cuda_lowering_xla_row_dot(functools.partial(am.flash_bwd, spec), q, q, q, q, lse, q, bias)
    operands = lambda call: call.split("(", 1)[1].split(")")[0].split(", ")
    (call,) = mosaic_gpu_calls(fwd)
    assert operands(call)[-1] == "%arg3", call[:300]
    bwd_ops = [operands(call) for call in mosaic_gpu_calls(bwd)]
    assert len(bwd_ops) == 2 and all(ops[-1] == "%arg6" for ops in bwd_ops), bwd_ops


@pytest.mark.parametrize("head_dim", sample([64, 128, 256], 1))
def test_decode_chunks_lower_for_cuda(head_dim):
    """Decoding's key chunks write 8-row slices of their 64-row tiles (the partials keep
    the few queries only) through the real Mosaic GPU lowering: the tiled, swizzled
    shared-memory slices and the lse vector's; the dK/dV kernel runs 4 key tiles per CTA."""
    spec = AttentionSpec(causal=True, scale=0.1, config=FlashAttentionConfig())
    q, k = (jnp.zeros((2, s, h, head_dim), jnp.bfloat16) for s, h in ((3, 4), (700, 2)))
    lse = jnp.zeros((2, 4, 3), jnp.float32)
    fwd = cuda_lowering(functools.partial(am.flash_fwd, spec, split_keys=256), q, k, k)
    bwd_fn = functools.partial(am.flash_bwd, spec, dq_split_keys=256, dkv_tiles=4)
    bwd = cuda_lowering_xla_row_dot(bwd_fn, q, k, k, q, lse, q)
    assert (len(mosaic_gpu_calls(fwd)), len(mosaic_gpu_calls(bwd))) == (1, 2)


@pytest.mark.parametrize("seq_q", [3, 300])
def test_sums_around_the_kernels_keep_a_fixed_order(seq_q):
    """Around the kernels, the forward's key chunks, the backward's Δ = rowsum(dO ∘ O) and
    dQ's key chunks are summed elementwise in a fixed order: no XLA reduction, whose order
    XLA's GPU autotuner picks by timing (Δ through one made dQ and dK differ in the last
    bit between one GPU and a two-GPU mesh)."""
    spec = AttentionSpec(causal=True, scale=0.1, config=FlashAttentionConfig(), has_kv_lengths=True)
    q, k = (jnp.zeros((2, s, h, 64), jnp.bfloat16) for s, h in ((seq_q, 4), (700, 2)))
    lse, n = jnp.zeros((2, 4, seq_q), jnp.float32), jnp.array([5, 700], jnp.int32)
    fwd = functools.partial(am.flash_fwd, spec, interpret=True, split_keys=256)
    assert xla_ordered_sums(fwd, q, k, k, n) == []
    bwd = functools.partial(
        am.flash_bwd, spec.replace(has_dlse=True), interpret=True, dq_split_keys=256
    )
    assert xla_ordered_sums(bwd, q, k, k, q, lse, q, n, lse) == []


@pytest.mark.parametrize(
    "head_dim, bias_rows", sample([(64, 1), (64, 300), (128, 1), (128, 300)], 1)
)
def test_mask_and_bias_lower_for_cuda(head_dim, bias_rows):
    """The kernels with a key-padding mask, a bias (with one query row: vectors of keys; or
    a row per query: tiles, broadcast over the batch), key lengths, segment ids and an lse
    cotangent go through the real Mosaic GPU lowering: the bias's TMA loads, its register
    layout and the shared memory its ring takes beside the K/V rings."""
    spec = AttentionSpec(
        causal=True,
        scale=0.1,
        config=FlashAttentionConfig(),
        has_mask=True,
        has_bias=True,
        has_kv_lengths=True,
        has_segment_ids=True,
    )
    q, k = (jnp.zeros((2, s, h, head_dim), jnp.bfloat16) for s, h in ((300, 4), (700, 2)))
    lse, n = jnp.zeros((2, 4, 300), jnp.float32), jnp.array([5, 700], jnp.int32)
    mask = jnp.ones((2, 1, 1, 700), bool)
    bias = jnp.zeros((1, 4, bias_rows, 700), jnp.float32)
    extras = (mask, bias, n, jnp.zeros((2, 300), jnp.int32), jnp.zeros((2, 700), jnp.int32))
    fwd = cuda_lowering(functools.partial(am.flash_fwd, spec, split_keys=256), q, k, k, *extras)
    bwd = cuda_lowering_xla_row_dot(
        functools.partial(am.flash_bwd, spec.replace(has_dlse=True), dq_split_keys=256),
        *(q, k, k, q, lse, q, *extras, lse),
    )
    assert (len(mosaic_gpu_calls(fwd)), len(mosaic_gpu_calls(bwd))) == (1, 2)


@pytest.mark.parametrize(
    "head_dim, features, pipelined",
    [
        (256, {}, True),
        (256, dict(causal=True), True),
        (256, dict(local_window_size=(64, 64)), True),
        (256, dict(has_kv_lengths=True), True),
        (256, dict(has_segment_ids=True), False),
        (128, {}, True),
        (128, dict(causal=True), True),
        (128, dict(has_segment_ids=True), False),
        (64, {}, False),
        (64, dict(has_mask=True), False),
        (64, dict(causal=True), False),
        (64, dict(causal=True, fwd_ctas=2), True),  # 128 keys a step on the persistent grid
        (64, dict(causal=True, fwd_ctas=2, has_kv_lengths=True), True),
        (64, dict(causal=True, fwd_ctas=2, has_segment_ids=True), True),
        (64, dict(causal=True, fwd_ctas=2, has_mask=True), False),
        (64, dict(fwd_ctas=2), False),
    ],
)
def test_pipelined_forward_where_it_measured_faster(head_dim, features, pipelined):
    """The forward takes the pipelined loop only at FWD_PIPELINED's head dims with every
    block visible whole, and at 64 causal on the persistent grid without a bias."""
    q = jnp.zeros((1, 256, 1, head_dim), jnp.bfloat16)
    causal = features.pop("causal", False)
    ctas = features.pop("fwd_ctas", None)
    spec = _spec(causal=causal, **features)
    bias = jnp.zeros((1, 1, 256, 256)) if spec.has_mask else None
    p = am._with_features(am._fwd_problem(q, q, causal, 0.1), spec, bias)
    assert am._fwd_pipelined(dataclasses.replace(p, fwd_ctas=ctas)) is pipelined


@pytest.mark.parametrize(
    ("head_dim", "seq_kv", "causal", "bias_shape", "block_kv"),
    [
        (64, 1024, True, None, 128),  # short causal rows
        (64, 2048, True, (2, 1, 1, 2048), 128),  # a key-padding mask streamed beside
        (64, 4096, True, None, 256),
        (64, 1024, False, None, 256),
        (128, 1024, True, None, 128),
        (256, 1024, True, None, 64),
        (128, 1024, True, (1, 2, 256, 1024), 64),  # a bias tile per block: two slots fit
    ],
)
def test_forward_keys_per_step(head_dim, seq_kv, causal, bias_shape, block_kv):
    """FWD_BLOCK_KV per head_dim, FWD_SHORT_CAUSAL_BLOCK_KV on causal rows of up to
    FWD_PERSISTENT_MAX_KEYS keys, and with a bias the longest block leaving two slots."""
    q = jnp.zeros((2, 256, 2, head_dim), jnp.bfloat16)
    k = jnp.zeros((2, seq_kv, 2, head_dim), jnp.bfloat16)
    kind = None if bias_shape is None else ("rows" if bias_shape[2] == 1 else "tiles")
    assert am._fwd_problem(q, k, causal, 0.1, bias=kind).block_kv == block_kv


def test_pingpong_off_needs_the_pipelined_loop():
    """The serial loop's warpgroups always take turns: asking it not to is an error."""
    spec = _spec()
    q = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="pingpong=False needs the pipelined loop"):
        am.flash_fwd(spec, q, q, q, interpret=True, pipelined=False, pingpong=False)
    with pytest.raises(TypeError, match="pingpong=1 must be a bool"):
        am.flash_fwd(spec, q, q, q, interpret=True, pingpong=1)


# --- what the kernels decline (no kernel runs: fast) ----------------------------------------


def _spec(causal=False, config=None, **features):
    config = FlashAttentionConfig() if config is None else config
    return AttentionSpec(causal=causal, scale=0.125, config=config, **features)


def _aval(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _avals(b, sq, skv, hq, hkv, d, dtype, backward=False):
    q = jax.ShapeDtypeStruct((b, sq, hq, d), dtype)
    kv = jax.ShapeDtypeStruct((b, skv, hkv, d), dtype)
    if not backward:
        return (q, kv, kv)
    return (q, kv, kv, q, jax.ShapeDtypeStruct((b, hq, sq), jnp.float32), q)


@pytest.mark.parametrize(
    "avals, spec, reason",
    [
        (_avals(1, 128, 128, 2, 2, 64, jnp.float32), _spec(), "dtype float32"),
        (_avals(1, 128, 128, 2, 2, 320, jnp.bfloat16), _spec(), "head_dim 320"),
        (_avals(0, 128, 128, 2, 2, 64, jnp.bfloat16), _spec(), "an empty operand"),
        (_avals(1, 128, 128, 2, 2, 264, jnp.bfloat16, True), _spec(), "head_dim 264"),
        (
            _avals(1, 128, 128, 2, 2, 256, jnp.bfloat16, True),
            _spec(has_segment_ids=True),
            "segment_ids at head_dim 256",
        ),
        (
            _avals(1, 128, 128, 2, 2, 64, jnp.bfloat16),
            _spec(config=FlashAttentionConfig(64, 64)),
            "config=",
        ),
        (
            (*_avals(1, 128, 128, 2, 2, 256, jnp.bfloat16), _aval((1, 1, 128, 128), bool)),
            _spec(has_mask=True),
            "a mask or bias per query at head_dim 256 (the forward's ring",
        ),
        (
            (*_avals(1, 128, 128, 2, 2, 256, jnp.bfloat16), _aval((1, 2, 1, 128), jnp.float32)),
            _spec(has_bias=True),
            "a key-padding mask or bias at head_dim 256 (the dQ kernel's ring",
        ),
        (_avals(1, 128, 128, 2, 2, 64, jnp.bfloat16), _spec(has_bias=True), "1 extras"),
    ],
)
def test_supports_declines_with_a_reason(avals, spec, reason):
    why = am.supports(spec, avals)
    assert why is not None and reason in why
    assert (
        am.supports(_spec(config=FlashAttentionConfig()), _avals(1, 200, 72, 4, 2, 64, jnp.float16))
        is None
    )


def test_declined_case_runs_the_reference():
    """f32 in interpret mode: the kernel declines, the blocked reference runs."""
    q, k, v = (rand((1, 16, 2, 64)) for _ in range(3))
    with ts.kernel_mode("interpret"):
        assert _chosen(ts.flash_attention, q, k, v) == ["reference"]


def test_hardware_names_the_platform():
    assert "not cpu" in am.hardware("cpu")


@pytest.mark.parametrize(
    "features, name",
    [
        (dict(has_bias=True, bias_grad=True), "bias_grad"),
        (dict(has_mask=True, has_bias=True, bias_grad=True, has_kv_lengths=True), "bias_grad"),
    ],
)
def test_supports_declines_features_it_does_not_implement(features, name):
    """The bias's gradient runs the blocked reference's backward; the reason names it and
    not the features the kernels run."""
    why = am.supports(_spec(**features), _avals(1, 128, 128, 2, 2, 64, jnp.bfloat16))
    assert why is not None
    declined = why.split(" (")[0].split(", ")
    assert name in declined
    assert not set(declined) & set(am.FEATURES)


def test_supports_the_index_based_masks():
    spec = _spec(
        causal=True,
        local_window_size=(64, 0),
        has_q_lengths=True,
        has_kv_lengths=True,
        has_segment_ids=True,
        has_dlse=True,
    )
    assert am.supports(spec, _avals(2, 256, 256, 2, 1, 128, jnp.bfloat16, backward=True)) is None
    with_bias = spec.replace(has_mask=True, has_bias=True)
    lengths, ids = _aval((2,), jnp.int32), _aval((2, 256), jnp.int32)
    for d in (64, 128):
        for rows in (1, 256):
            mask, bias = _aval((2, 1, 1, 256), bool), _aval((1, 2, rows, 256), jnp.float32)
            extras = (mask, bias, lengths, lengths, ids, ids, _aval((2, 2, 256), jnp.float32))
            avals = (*_avals(2, 256, 256, 2, 1, d, jnp.float16, True), *extras)
            assert am.supports(with_bias, avals) is None


def test_prefer_from_the_measured_sequence_lengths():
    assert am.prefer(_spec(), _avals(2, 4096, 4096, 16, 16, 128, jnp.bfloat16))
    assert am.prefer(_spec(), _avals(1, 512, 2048, 8, 2, 64, jnp.bfloat16, backward=True))
    assert am.prefer(_spec(), _avals(4, 128, 128, 16, 16, 128, jnp.bfloat16))
    assert not am.prefer(_spec(), _avals(1, 127, 4096, 8, 8, 128, jnp.bfloat16))
    assert not am.prefer(_spec(), _avals(4, 256, 64, 16, 16, 128, jnp.bfloat16))


@pytest.mark.parametrize(
    "sq, skv, preferred", [(1, 32768, True), (16, 4096, True), (17, 4096, False), (16, 2048, False)]
)
def test_prefer_decoding_against_a_long_cache(sq, skv, preferred):
    """A few queries against a long kv cache run the kernels (their padded query tile costs
    little beside streaming the cache); the measured region only."""
    assert am.prefer(_spec(), _avals(4, sq, skv, 16, 16, 128, jnp.bfloat16)) is preferred


@pytest.mark.parametrize(
    "sq, skv, hq, hkv, preferred",
    [
        (1, 32768, 16, 16, True),
        (1, 4096, 16, 16, True),
        (16, 32768, 16, 16, True),
        (1, 32768, 32, 8, True),  # the group folded into the rows
        (1, 32768, 128, 1, True),  # a group of 128: too many rows to fold, one tile per head
        (17, 32768, 16, 16, False),
        (1, 2048, 16, 16, True),  # the backward decodes from fewer keys than the forward
        (16, 1024, 32, 8, True),
        (16, 256, 16, 16, True),
        (1, 255, 16, 16, False),
    ],
)
def test_prefer_decoding_backward(sq, skv, hq, hkv, preferred):
    """The backward (with or without an lse cotangent) decodes from DECODE_BWD_MIN_KV keys,
    whatever the GQA group."""
    avals = _avals(4, sq, skv, hq, hkv, 128, jnp.bfloat16, backward=True)
    assert am.prefer(_spec(), avals) is preferred
    assert am.prefer(_spec(has_dlse=True), (*avals, avals[4])) is preferred


@pytest.mark.parametrize(
    "rows, seq_kv, block",
    [
        (1, 32768, 32768),  # decode: one block of the whole cache
        (16, 32768, 32768),
        (512, 512, 512),  # short: one block
        (1024, 1024, 1024),
        (4096, 4096, 1024),  # long: O(Sq·block) memory, as the memory tests check
        (16384, 16384, 256),
        (1 << 20, 1 << 20, 128),
        (3, 100, 100),
        (1, 0, 1),  # no keys: a block of one, never run
    ],
)
def test_reference_block_per_shape(rows, seq_kv, block):
    """Where the kernels do not run, the reference's default block grows for few query
    rows (decode, short sequences), up to one block of all keys."""
    assert reference_block_kv(rows, seq_kv) == block


@pytest.mark.parametrize(
    "rows, seq_kv, block",
    [
        (1, 32768, 32768),  # decode: one block of the whole cache, as on other platforms
        (64, 32768, 32768),
        (128, 8192, 1024),  # beyond 64 rows, blocks of at most 2**17 scores
        (512, 512, 256),
        (4096, 4096, 128),
        (200, 100, 100),
    ],
)
def test_reference_block_per_shape_on_the_cpu(rows, seq_kv, block):
    assert reference_block_kv(rows, seq_kv, "cpu") == block


def test_each_platform_lowers_its_reference_block():
    """The CPU lowering runs the reference at the CPU's block (a loop of 8 steps of 256 keys
    for 512 query rows), the cuda lowering at the other platforms' one block."""
    q = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 2048, 2, 64), jnp.float32)
    f = jax.jit(functools.partial(ts.flash_attention, causal=True))
    with ts.kernel_mode("xla"):
        cpu = f.trace(q, k, k).lower(lowering_platforms=("cpu",)).as_text()
        cuda = f.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" in cpu and "x256xf32" in cpu
    assert "stablehlo.while" not in cuda and "x2048xf32" in cuda


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_key_chunks_combine_in_float32(dtype):
    """The forward's per-chunk outputs (as 16-bit pairs) and lse combine to the softmax over
    all keys, a chunk that saw no key (lse = -inf) adding nothing and a row no chunk saw
    coming out zeros with lse = -inf; the dQ partials sum to their f32 total."""
    chunks, b, sq, h, d = 3, 2, 4, 2, 8
    out = rand((chunks, b, sq, h, d), jnp.float32)
    lse = np.array(rand((chunks, b, h, sq), jnp.float32, scale=3.0))
    lse[1, 0, 0, 1] = -np.inf  # one chunk saw none of this row's keys
    lse[:, 1, 1, 2] = -np.inf  # no chunk saw any
    out = jnp.where(jnp.isneginf(jnp.swapaxes(lse, 2, 3))[..., None], 0.0, out)
    hi = out.astype(dtype)
    parts = jnp.stack([hi, (out - hi.astype(jnp.float32)).astype(dtype)])
    got_out, got_lse = am._combine_chunks(parts, jnp.asarray(lse))
    with np.errstate(divide="ignore", invalid="ignore"):
        want_lse = np.logaddexp.reduce(f64(lse), axis=0)
        w = np.exp(f64(lse) - want_lse)
    w = np.where(np.isneginf(want_lse), 0.0, w)
    want_out = np.einsum("cbhq,cbqhd->bqhd", w, f64(out))
    np.testing.assert_array_equal(np.isneginf(f64(got_lse)), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(f64(got_lse)[seen], want_lse[seen], rtol=0, atol=1e-5)
    assert got_out.dtype == dtype
    assert_close(got_out, want_out, dtype, factor=2.0)
    assert not np.any(f64(got_out)[1, 2, 1])
    total = am._sum_chunks(parts)
    assert_close(total, f64(out).sum(axis=0), dtype, factor=2.0)


def test_key_chunks_depend_on_the_lengths_only():
    """The forward's and dQ kernel's key chunks for decoding are the same whatever the batch
    and heads (a sharded batch or head axis keeps the bits); longer queries, or a cache
    that fits one chunk, are not split."""

    def chunks(b, sq, skv, hq, hkv, d):
        q = jax.ShapeDtypeStruct((b, sq, hq, d), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((b, skv, hkv, d), jnp.bfloat16)
        fwd, bwd = am._fwd_problem(q, k, False, 0.1), am._bwd_problem(q, k, False, 0.1)
        return (fwd.kv_split, fwd.kv_chunks), (bwd.kv_split, bwd.kv_chunks)

    for d in (64, 128, 256):
        want = chunks(1, 1, 32768, 1, 1, d)
        assert all(n > 1 for _, n in want)
        for b, hq, hkv in ((4, 16, 16), (2, 8, 2), (8, 32, 1)):
            assert chunks(b, 1, 32768, hq, hkv, d) == want
            assert chunks(b, 16, 32768, hq, hkv, d) == want
        assert chunks(1, 200, 32768, 1, 1, d) == ((None, 1), (None, 1))
        assert chunks(1, 1, am.SPLIT_KEYS_MIN, 1, 1, d) == ((None, 1), (None, 1))


def test_decode_chunk_lengths():
    """About SPLIT_CHUNKS chunks of a power of two keys, within the bounds, a whole number
    of every kernel's kv blocks."""
    lengths = [am.default_split_keys(n) for n in (1, 1000, 4096, 8192, 16384, 32768, 10**6)]
    assert lengths == [1024, 1024, 1024, 1024, 2048, 4096, 4096]
    blocks = {*am.FWD_BLOCK_KV_CHOICES, *am.DQ_BLOCK_KV_CHOICES}
    assert all(keys % bkv == 0 for keys in lengths for bkv in blocks)


def test_dkv_dq_lowers_for_cuda():
    """The dK/dV kernel computing dQ too goes through the real Mosaic GPU lowering: the
    global semaphores, TMA's reduce-add, dSᵀ read transposed and K by column halves."""
    spec = AttentionSpec(causal=True, scale=0.1, config=FlashAttentionConfig(), has_kv_lengths=True)
    q, k = (jnp.zeros((2, s, 2, 128), jnp.bfloat16) for s in (300, 700))
    lse, n = jnp.zeros((2, 2, 300), jnp.float32), jnp.array([5, 700], jnp.int32)
    bwd_fn = functools.partial(am.flash_bwd, spec.replace(local_window_size=(200, 0)), dkv_dq=True)
    assert len(mosaic_gpu_calls(cuda_lowering_xla_row_dot(bwd_fn, q, k, k, q, lse, q, n))) == 1


@pytest.mark.parametrize(
    "seq_q, seq_kv, causal, window, lengths",
    [
        (512, 512, False, None, None),
        (300, 1000, True, None, [1000, 517, 0]),
        (1000, 1000, False, (150, 40), [1000, 700, 129]),
        (1000, 300, True, (500, 0), None),
    ],
)
def test_dkv_dq_turns(seq_q, seq_kv, causal, window, lengths):
    """The semaphore protocol of :attr:`Problem.dkv_dq` (:func:`_dq_turn`,
    :func:`_dq_passes`), run by a scheduler that holds every key tile at once and steps a
    random one (a waiting tile spins): every tile finishes, each query block's partials are
    added in key-tile order by exactly the tiles that see it, and every count ends at 0."""
    aval = jax.ShapeDtypeStruct((1, seq_q, 1, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq_kv, 1, 128), jnp.bfloat16)
    p = am._bwd_problem(aval, kv, causal, 0.1, dkv_dq=True)
    p = dataclasses.replace(p, window=window, kv_lengths=lengths is not None)
    rng = np.random.default_rng(0)
    for kv_len in lengths or [None]:
        n_tiles = p.kv_tiles if kv_len is None else min(-(-kv_len // am.TILE), p.kv_tiles)
        count = collections.Counter()
        added = collections.defaultdict(list)

        def tile(t, kv_len=kv_len, n_tiles=n_tiles, count=count, added=added):
            start, stop = (int(x) for x in am._tile_q_span(p, t))
            if t >= n_tiles:
                stop = start  # (a tile past the length sees no query)
            for qi in range(*(int(x) for x in am._dq_passes(p, t, kv_len))):
                count[qi] += 1
            for qi in range(start, stop):
                follows, waits, clears, hands_on = (bool(x) for x in am._dq_turn(p, t, qi, kv_len))
                if waits:
                    while count[qi] < t:
                        yield
                    count[qi] -= t if clears else 0
                added[qi].append((t, follows))
                count[qi] += hands_on
                yield

        running = [tile(t) for t in range(p.kv_tiles)]
        while running:
            i = int(rng.integers(len(running)))
            try:
                next(running[i])
            except StopIteration:
                running.pop(i)
        nq = -(-seq_q // am.WG_ROWS)
        for qi in range(nq):
            chain = [t for t in range(n_tiles) if am._tile_q_span(p, t)[0] <= qi]
            chain = [t for t in chain if qi < am._tile_q_span(p, t)[1]]
            assert [t for t, _ in added[qi]] == chain, (kv_len, qi)
            assert [f for _, f in added[qi]] == [i > 0 for i in range(len(chain))]
        assert not any(count.values()), (kv_len, dict(count))


@pytest.mark.parametrize(
    "knobs, error",
    [
        (dict(dkv_dq=True, dq_block_kv=64), "dq_block_kv=64"),
        (dict(dkv_dq=True, dkv_tiles=2), "dkv_tiles=2"),
        (dict(dkv_dq=True, dq_dkv=True), "dq_dkv=True"),
        (dict(dkv_dq=1), "must be a bool"),
    ],
)
def test_dkv_dq_declines_the_dq_kernels_knobs(knobs, error):
    q, k = jnp.zeros((1, 200, 1, 128), jnp.bfloat16), jnp.zeros((1, 300, 1, 128), jnp.bfloat16)
    lse = jnp.zeros((1, 1, 200), jnp.float32)
    with pytest.raises((ValueError, TypeError), match=re.escape(error)):
        am.flash_bwd(_spec(), q, k, k, q, lse, q, **knobs)


def test_dkv_dq_declines_head_dim_64():
    q = jnp.zeros((1, 200, 1, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 1, 200), jnp.float32)
    with pytest.raises(ValueError, match="dkv_dq=True does not take the case: head_dim 64"):
        am.flash_bwd(_spec(), q, q, q, q, lse, q, dkv_dq=True)


@pytest.mark.parametrize("head_dim", sample([64, 128], 1))
def test_dq_dkv_lowers_for_cuda(head_dim):
    """The dQ kernel computing dK and dV too goes through the real Mosaic GPU lowering: the
    hand-over ring's 16-bit tiles, written from registers and read transposed by wgmma."""
    spec = AttentionSpec(causal=True, scale=0.1, config=FlashAttentionConfig(), has_kv_lengths=True)
    q, k = (jnp.zeros((2, s, 2, head_dim), jnp.bfloat16) for s in (3, 700))
    lse, n = jnp.zeros((2, 2, 3), jnp.float32), jnp.array([5, 700], jnp.int32)
    bwd_fn = functools.partial(am.flash_bwd, spec, dq_split_keys=256, dq_dkv=True)
    assert len(mosaic_gpu_calls(cuda_lowering_xla_row_dot(bwd_fn, q, k, k, q, lse, q, n))) == 1


@pytest.mark.parametrize(
    "q_shape, k_shape, window, reason",
    [
        ((1, 65, 2, 64), (1, 700, 2, 64), None, "seq_q 65 > 64"),
        # (a group too large to fold into one tile's rows)
        ((1, 40, 4, 64), (1, 700, 2, 64), None, "GQA (4 query heads, 2 key heads)"),
        ((1, 3, 2, 256), (1, 700, 2, 256), (100, 0), "head_dim 256"),
    ],
)
def test_dq_dkv_declines_with_a_reason(q_shape, k_shape, window, reason):
    spec = _spec(local_window_size=window)
    q, k = jnp.zeros(q_shape, jnp.bfloat16), jnp.zeros(k_shape, jnp.bfloat16)
    lse = jnp.zeros((1, q_shape[2], q_shape[1]), jnp.float32)
    with pytest.raises(ValueError, match=re.escape(f"does not take the case: {reason}")):
        am.flash_bwd(spec, q, k, k, q, lse, q, dq_dkv=True)
    with pytest.raises(TypeError, match="dq_dkv=1 must be a bool"):
        am.flash_bwd(spec, q, k, k, q, lse, q, dq_dkv=1)


@pytest.mark.parametrize(
    "knobs, reason",
    [
        (dict(dkv_tiles=2), "dkv_tiles=2 tune the two-kernel backward"),
        (dict(dkv_stages=2, dkv_paired=True), "dkv_stages=2, dkv_paired=True tune the two"),
        (dict(dq_block_kv=128), "dq_block_kv=128 (dq_dkv steps 64 keys) tune the two"),
    ],
)
def test_dq_dkv_declines_the_two_kernel_knobs(knobs, reason):
    """Knobs of the dK/dV kernel, which does not run when the dQ kernel computes dK and
    dV, are a ValueError beside ``dq_dkv=True``; by default they select the two kernels."""
    q, k = jnp.zeros((1, 3, 2, 64), jnp.bfloat16), jnp.zeros((1, 700, 2, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 3), jnp.float32)
    with pytest.raises(ValueError, match=re.escape(f"does not take the case: {reason}")):
        am.flash_bwd(_spec(), q, k, k, q, lse, q, dq_dkv=True, **knobs)
    lowered = cuda_lowering_xla_row_dot(
        functools.partial(am.flash_bwd, _spec(), **knobs), q, k, k, q, lse, q
    )
    assert len(mosaic_gpu_calls(lowered)) == 2


@pytest.mark.parametrize(
    "q_shape, k_shape, calls",
    [
        ((1, 16, 4, 128), (1, 4096, 4, 128), 1),  # decoding
        ((1, 4, 8, 64), (1, 700, 2, 64), 1),  # a GQA group folded into 16 rows
        ((1, 65, 2, 64), (1, 700, 2, 64), 2),  # more queries than one warpgroup's rows
        ((1, 3, 2, 256), (1, 700, 2, 256), 2),
    ],
)
def test_dq_dkv_by_default_where_it_fits(q_shape, k_shape, calls):
    """By default the dQ kernel computes dK and dV wherever it can (one Mosaic GPU call),
    else the dQ and dK/dV kernels run (two)."""
    q, k = jnp.zeros(q_shape, jnp.bfloat16), jnp.zeros(k_shape, jnp.bfloat16)
    lse = jnp.zeros((1, q_shape[2], q_shape[1]), jnp.float32)
    bwd = functools.partial(am.flash_bwd, _spec())
    lowered = cuda_lowering_xla_row_dot(bwd, q, k, k, q, lse, q)
    assert len(mosaic_gpu_calls(lowered)) == calls


@triton_lowers_here
@pytest.mark.parametrize("sq", [1, 300, 512])
def test_delta_reaches_the_kernels_without_a_transpose_or_pad(sq):
    """The row kernel writes Δ head-major and padded, as the backward kernels read it:
    no transpose or pad of it between the kernels (each a launch in a decoding step's
    chain of dependent ones). Of the f32 rows only lse is padded, where Sq needs it."""
    q, k = jnp.zeros((2, sq, 4, 128), jnp.bfloat16), jnp.zeros((2, 512, 4, 128), jnp.bfloat16)
    lse, do = jnp.zeros((2, 4, sq), jnp.float32), jnp.ones((2, sq, 4, 128), jnp.bfloat16)
    text = cuda_lowering(functools.partial(am.flash_bwd, _spec()), q, k, k, q, lse, do)
    assert "stablehlo.transpose" not in text
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1
    main = text[text.index("func.func public @main") :]
    main = main[: main.index("\n  }\n")]
    padded = f"-> tensor<2x4x{-(-sq // am.TILE) * am.TILE}xf32>"
    f32_pads = [ln for ln in main.splitlines() if "pad" in ln and padded in ln]
    assert len(f32_pads) == (0 if sq % am.TILE == 0 else 1)


def test_dq_dkv_fits_beside_every_feature():
    """At head_dim 128 the hand-over ring fits shared memory beside a key-padding mask,
    a bias tile ring, segment ids and key lengths: the one kernel lowers for cuda."""
    b, sq, skv, h, d = 2, 16, 1000, 2, 128
    q, k = jnp.zeros((b, sq, h, d), jnp.bfloat16), jnp.zeros((b, skv, h, d), jnp.bfloat16)
    lse = jnp.zeros((b, h, sq), jnp.float32)
    extras = (
        jnp.ones((b, 1, 1, skv), bool),
        jnp.zeros((1, h, sq, skv), jnp.bfloat16),
        jnp.array([skv, 10], jnp.int32),
        jnp.zeros((b, sq), jnp.int32),
        jnp.zeros((b, skv), jnp.int32),
    )
    spec = _spec(has_mask=True, has_bias=True, has_kv_lengths=True, has_segment_ids=True)
    bwd = functools.partial(am.flash_bwd, spec)
    lowered = cuda_lowering_xla_row_dot(bwd, q, k, k, q, lse, q, *extras)
    assert len(mosaic_gpu_calls(lowered)) == 1


@pytest.mark.parametrize(
    "b, sq, skv, h, d, tiles",
    [
        (1, 16, 4096, 8, 128, 2),  # 256 tiles of 128 keys: 128 CTAs of 2
        (1, 1, 32768, 8, 128, 16),  # at most DKV_TILES_MAX
        (4, 16, 4096, 16, 128, 16),
        (1, 16, 4096, 8, 256, 4),  # 64-key tiles
        (1, 16, 4096, 4, 128, 1),  # 128 CTAs of one tile
        (1, 128, 4096, 8, 128, 2),  # two query blocks per tile
        (1, 129, 32768, 8, 128, 1),  # three: the query loop is the CTA's work
    ],
)
def test_dkv_tiles_per_cta(b, sq, skv, h, d, tiles):
    q, k = jnp.zeros((b, sq, h, d), jnp.bfloat16), jnp.zeros((b, skv, h, d), jnp.bfloat16)
    assert am._bwd_problem(q, k, False, 1.0).dkv_tiles == tiles


def test_decode_reference_runs_one_block():
    """A decode shape compiles to no loop over kv blocks (one pair of matmuls)."""
    q = jax.ShapeDtypeStruct((2, 4, 4, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 4096, 2, 64), jnp.float32)
    hlo = jax.jit(ts.flash_attention).lower(q, kv, kv).compile().as_text()
    assert " while(" not in hlo  # a while instruction (op names in metadata may say while)
    one_by_one = functools.partial(ts.flash_attention, config=FlashAttentionConfig(block_kv=128))
    assert " while(" in jax.jit(one_by_one).lower(q, kv, kv).compile().as_text()


@pytest.mark.parametrize("block_kv", [32, 256])
def test_forward_block_kv_override_is_checked(block_kv):
    q = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"block_kv={block_kv} must be one of"):
        am.flash_fwd(_spec(config=FlashAttentionConfig()), q, q, q, block_kv=block_kv)


@pytest.mark.parametrize(
    "head_dim, override, match",
    [
        (256, dict(dq_block_kv=128), "dq_block_kv=128 must be one of"),
        (64, dict(dq_block_kv=32), "dq_block_kv=32 must be one of"),
        (256, dict(dkv_stages=3), "dkv_stages=3 must be one of"),
        (128, dict(dkv_stages=1), "dkv_stages=1 must be one of"),
        (128, dict(dkv_tiles=0), "dkv_tiles=0 must be an int >= 1"),
        (256, dict(dkv_paired=True), "dkv_paired=True applies to head_dim 64, 128, not 256"),
        (128, dict(dq_split_keys=192), "dq_split_keys=192 must be a positive multiple of .* 128"),
        (256, dict(dq_split_keys=0), "dq_split_keys=0 must be a positive multiple of .* 64"),
    ],
)
def test_backward_overrides_are_checked(head_dim, override, match):
    """A tuning override whose ring does not fit shared memory (or is not a choice, or a
    key chunk not a whole number of the dQ kernel's steps) is a ValueError before any
    kernel is built."""
    q = jnp.zeros((1, 128, 1, head_dim), jnp.bfloat16)
    lse = jnp.zeros((1, 1, 128), jnp.float32)
    with pytest.raises(ValueError, match=match):
        am.flash_bwd(_spec(), q, q, q, q, lse, q, **override)


def test_backward_schedule_override_must_be_a_bool():
    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 1, 128), jnp.float32)
    with pytest.raises(TypeError, match="dkv_paired=1 must be a bool"):
        am.flash_bwd(_spec(), q, q, q, q, lse, q, dkv_paired=1)


@pytest.mark.parametrize(
    "causal, features, bias_shape, regs",
    [
        (False, {}, None, 232),
        (False, dict(has_kv_lengths=True, has_q_lengths=True), None, 232),
        (True, {}, None, 240),
        (False, dict(local_window_size=(64, 64)), None, 240),
        (False, dict(has_segment_ids=True), None, 240),
        (False, dict(has_bias=True), (1, 2, 256, 256), 240),
        (False, dict(has_mask=True), (2, 1, 1, 256), 240),
    ],
)
def test_compute_regs_follow_the_masks(causal, features, bias_shape, regs):
    """Kernels with masked steps give their compute warpgroups 240 registers (the memory
    warpgroup 24), the others 232 (40): together the 504 the launch gives."""
    q = jnp.zeros((2, 256, 2, 128), jnp.bfloat16)
    bias = None if bias_shape is None else jnp.zeros(bias_shape, jnp.float32)
    p = am._with_features(am._bwd_problem(q, q, causal, 0.1), _spec(causal, **features), bias)
    assert p.wg_regs == (regs, 504 - 2 * regs)


@pytest.mark.parametrize("compute_regs", [236, 248, True, 240.0])
def test_compute_regs_override_is_checked(compute_regs):
    q = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
    lse = jnp.zeros((1, 1, 128), jnp.float32)
    match = re.escape(f"compute_regs={compute_regs!r} must be one of [232, 240]")
    with pytest.raises(ValueError, match="flash_fwd: " + match):
        am.flash_fwd(_spec(), q, q, q, compute_regs=compute_regs)
    with pytest.raises(ValueError, match="flash_bwd: " + match):
        am.flash_bwd(_spec(), q, q, q, q, lse, q, compute_regs=compute_regs)


def _check_compute_regs_keep_bits(shape, interpret: bool):
    """The forward and backward at each ``compute_regs``, causal with a bias: the same
    bits, and close to the float64 reference."""
    _, s, h, _ = shape
    spec = _spec(causal=True, has_bias=True)
    q, k, v, do = (rand(shape, jnp.bfloat16) for _ in range(4))
    bias = rand((1, h, s, s), jnp.bfloat16)
    runs = []
    for regs in (232, 240):
        fwd = functools.partial(am.flash_fwd, spec, interpret=interpret, compute_regs=regs)
        bwd = functools.partial(am.flash_bwd, spec, interpret=interpret, compute_regs=regs)
        out, lse = jax.jit(fwd)(q, k, v, bias)
        runs.append((out, lse, *jax.jit(bwd)(q, k, v, out, lse, do, bias)))
    for x, y in zip(*runs):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    opts = dict(causal=True, bias=bias, scale=spec.scale)
    (out, _), grads = np_dense(*(f64(x) for x in (q, k, v)), opts, do=f64(do))
    for got, want in zip(runs[0][:1] + runs[0][2:], (out, *grads[:3])):
        assert_close(got, want, factor=2)


def test_compute_regs_keep_bits_interpret():
    with _compat.gpu_interpret_mode():
        _check_compute_regs_keep_bits((1, 128, 1, 64), interpret=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("pallas_mode")
def test_compute_regs_keep_bits():
    _check_compute_regs_keep_bits((2, 1024, 4, 128), interpret=False)


# (batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, causal, key lengths), ctas: head_dim
# 128 loads the next tile's Q during a tile (two Q slots), 64 after the last one's stores.
PERSISTENT_CASES = [
    ((2, 200, 328, 2, 1, 128, True, None), 3),
    ((2, 300, 300, 2, 2, 64, True, None), 3),  # 128 keys a step, pipelined
    ((2, 384, 384, 1, 1, 64, False, None), 2),
    ((2, 200, 328, 2, 2, 64, False, (90, 328)), 3),
]


def _persistent_keeps_bits(fwd, ctas, *, interpret: bool):
    """``fwd(persistent=True, ctas=ctas)`` (``ctas`` None: the default count), checked to
    give the bits of ``fwd(persistent=False)``, one CTA per tile; in interpret mode without
    races."""
    grid = fwd(persistent=False)
    if interpret:
        with _compat.gpu_interpret_mode(detect_races=True):
            persistent = fwd(persistent=True, ctas=ctas)
        assert _compat.races_detected() is False
    else:
        persistent = fwd(persistent=True, ctas=ctas)
    for x, y in zip(grid, persistent):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    return persistent


def _check_persistent_forward(case, ctas, *, interpret: bool):
    """The forward on a persistent grid of ``ctas`` CTAs (several tiles each): the bits of
    one CTA per tile, and close to the float64 reference."""
    b, sq, skv, hq, hkv, d, causal, lengths = case
    q = rand((b, sq, hq, d), jnp.bfloat16)
    k, v = rand((b, skv, hkv, d), jnp.bfloat16), rand((b, skv, hkv, d), jnp.bfloat16)
    spec = _spec(causal=causal, has_kv_lengths=lengths is not None)
    extras = () if lengths is None else (jnp.array(lengths, jnp.int32),)
    fwd = functools.partial(am.flash_fwd, spec, q, k, v, *extras, interpret=interpret)
    persistent = _persistent_keeps_bits(fwd, ctas, interpret=interpret)
    opts = dict(causal=causal, scale=spec.scale, key_value_seq_lengths=lengths)
    out, _ = np_dense(*(f64(x) for x in (q, k, v)), opts)
    assert_close(persistent[0], out, factor=2)


@pytest.mark.usefixtures("interpret_mode")
@pytest.mark.parametrize(("case", "ctas"), PERSISTENT_CASES)
def test_persistent_forward_keeps_bits_interpret(case, ctas):
    _check_persistent_forward(case, ctas, interpret=True)


def _persistent_feature(name: str, b: int, s: int, h: int):
    """``(spec, extras, knobs)`` of one feature on the persistent grid."""
    if name == "window":
        return _spec(local_window_size=(50, 20)), (), {}
    if name == "bias":
        return _spec(causal=True, has_bias=True), (rand((1, h, s, s), jnp.bfloat16),), {}
    even = jnp.arange(b) % 2 == 0
    if name == "key_padding":
        keep = jnp.arange(s)[None, :] < jnp.where(even, s - 70, s)[:, None]
        return _spec(causal=True, has_mask=True), (keep[:, None, None, :],), {}
    if name in ("q_lengths", "causal_q_lengths"):
        spec = _spec(causal=name.startswith("causal"), has_q_lengths=True)
        return spec, (jnp.where(even, s - 50, 7).astype(jnp.int32),), {}
    if name == "segments":
        seg = jnp.broadcast_to((jnp.arange(s) >= s // 2).astype(jnp.int32), (b, s))
        return _spec(has_segment_ids=True), (seg, seg), {}
    return _spec(causal=True), (), dict(split_keys=256)  # key chunks


PERSISTENT_FEATURES = [
    "window",
    "bias",
    "key_padding",
    "q_lengths",
    "causal_q_lengths",
    "segments",
    "key_chunks",
]


def _check_persistent_feature(feature, b, s, h, d, *, interpret: bool):
    """On the persistent grid (forced where ``auto`` keeps the grid), ``feature`` gives
    the grid's bits (their results against float64: the grid's own tests); in interpret
    mode without races."""
    sq, skv = (5, 700) if feature == "key_chunks" else (s, s)
    q = rand((b, sq, h, d), jnp.bfloat16)
    k, v = rand((b, skv, h, d), jnp.bfloat16), rand((b, skv, h, d), jnp.bfloat16)
    spec, extras, knobs = _persistent_feature(feature, b, skv, h)
    fwd = functools.partial(am.flash_fwd, spec, q, k, v, *extras, interpret=interpret, **knobs)
    _persistent_keeps_bits(fwd, 3 if interpret else None, interpret=interpret)


@pytest.mark.usefixtures("interpret_mode")
@pytest.mark.parametrize("feature", sample(PERSISTENT_FEATURES, 2))
def test_persistent_forward_with_features_interpret(feature):
    _check_persistent_feature(feature, 2, 200, 2, 64, interpret=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("pallas_mode")
@pytest.mark.parametrize("feature", PERSISTENT_FEATURES)
def test_persistent_forward_with_features(feature):
    _check_persistent_feature(feature, 4, 1000, 8, 128, interpret=False)


def _check_four_tiles_d128_masked(window, b, s, h, *, interpret: bool):
    """Causal at head_dim 128 with segment ids (``window`` None) or a window, four tiles a
    CTA (the default grid on a GPU, forced in interpret mode): the bits of one CTA per
    tile (their results against float64: the grid's own tests, and here in interpret
    mode). With segment ids, jax 0.11's interpreter checks the producer's proxy fence
    before it refills a slot of key ids (``_fence_before_refill``)."""
    q, k, v = (rand((b, s, h, 128), jnp.bfloat16) for _ in range(3))
    if window is None:
        seg = jnp.broadcast_to((jnp.arange(s) >= 3 * s // 4).astype(jnp.int32), (b, s))
        spec, extras = _spec(causal=True, has_segment_ids=True), (seg, seg)
        opts = dict(causal=True, scale=spec.scale, q_segment_ids=seg, kv_segment_ids=seg)
    else:
        spec, extras = _spec(causal=True, local_window_size=window), ()
        opts = dict(causal=True, scale=spec.scale, local_window_size=window)
    p = am._with_features(am._fwd_problem(q, k, True, spec.scale), spec, None)
    ctas = p.fwd_work // 4
    if not interpret:
        assert am._fwd_ctas(p, device.sm_counts(interpret=False).grid, None, None) == ctas
    fwd = functools.partial(am.flash_fwd, spec, q, k, v, *extras, interpret=interpret)
    out = _persistent_keeps_bits(fwd, ctas if interpret else None, interpret=interpret)[0]
    if interpret:
        assert_close(out, np_dense(*(f64(x) for x in (q, k, v)), opts)[0], factor=2)


def test_generically_read_rings_are_refilled_after_a_proxy_fence():
    """The key ids' and the bias's rings (read by ``ld.shared``, not the tensor cores) are
    marked for the producer's proxy fence, and K's ring is not: jax 0.10's interpreter does
    not check the fence (0.11's does: test_persistent_forward_four_tiles_d128_masked_interpret)."""
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    spec = _spec(causal=True, has_segment_ids=True, has_bias=True)
    p = am._with_features(am._fwd_problem(q, q, True, 0.1), spec, jnp.zeros((1, 2, 256, 256)))
    ring = np.zeros((2, 128), np.int32)
    k_loads = [(lambda n: None, ring, ring)]
    ids = am._kv_segment_loads(p, None, ring, ring, 0, 0)
    bias = am._bias_loads(p, np.zeros((2, 2, 64, 128)), ring, lambda n, i: None)
    assert ids and bias
    assert not am._fence_before_refill(k_loads)
    assert am._fence_before_refill(ids) and am._fence_before_refill(bias)
    assert am._fence_before_refill(k_loads + ids)


@pytest.mark.usefixtures("interpret_mode")
@pytest.mark.parametrize("window", [None, (100, 0)])
def test_persistent_forward_four_tiles_d128_masked_interpret(window):
    _check_four_tiles_d128_masked(window, 1, 512, 2, interpret=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("pallas_mode")
@pytest.mark.parametrize("window", [None, (300, 0)])
def test_persistent_forward_four_tiles_d128_masked(window):
    _check_four_tiles_d128_masked(window, 8, 1024, 16, interpret=False)  # 2.0 waves


@pytest.mark.gpu
@pytest.mark.usefixtures("pallas_mode")
@pytest.mark.parametrize(
    ("case", "ctas"),
    [
        ((4, 1024, 1024, 8, 8, 128, False, None), None),
        ((4, 1000, 1000, 8, 8, 128, True, None), 100),
        ((4, 1024, 2048, 8, 2, 64, True, (700, 2048, 5, 1500)), None),
        ((8, 512, 512, 16, 16, 64, True, None), None),  # short causal rows: one wave
        ((8, 1024, 1024, 16, 16, 64, True, None), None),  # four tiles a CTA
    ],
)
def test_persistent_forward_keeps_bits(case, ctas):
    _check_persistent_forward(case, ctas, interpret=False)


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "features", "want"),
    [
        ((16, 1024, 16, 128), (16, 1024, 16, 128), {}, 132),  # one CTA per SM
        ((16, 1024, 16, 128), (16, 1024, 16, 128), dict(causal=True), 1024),  # 2 tiles each
        ((1, 1024, 4, 128), (1, 1024, 4, 128), dict(causal=True), 32),  # one wave: a tile each
        ((32, 512, 16, 64), (32, 512, 16, 64), dict(causal=True), 132),  # short causal rows
        ((32, 768, 16, 128), (32, 768, 16, 128), dict(causal=True), 132),
        ((32, 769, 16, 128), (32, 769, 16, 128), dict(causal=True), 1792),
        ((1, 512, 4, 64), (1, 512, 4, 64), dict(causal=True, has_kv_lengths=True), 16),
        ((16, 2048, 16, 64), (16, 2048, 16, 64), {}, 132),
        ((16, 1024, 16, 64), (16, 1024, 16, 64), dict(causal=True), 512),  # 4 tiles each
        ((8, 1024, 16, 64), (8, 1024, 16, 64), dict(causal=True), 256),  # 1.94 waves of 4
        ((7, 1024, 16, 64), (7, 1024, 16, 64), dict(causal=True), 448),  # 1.70 waves of 4: 2
        ((2, 2048, 16, 64), (2, 2048, 16, 64), dict(causal=True), 256),  # 4 each: < 1.9 waves
        ((8, 2048, 8, 64), (8, 2048, 8, 64), dict(causal=True, has_segment_ids=True), 256),
        ((4, 4096, 16, 128), (4, 4096, 16, 128), {}, None),  # long rows of keys
        ((16, 1024, 16, 256), (16, 1024, 16, 256), {}, None),
        ((16, 1024, 16, 128), (16, 1024, 16, 128), dict(has_kv_lengths=True), 132),
        ((16, 1024, 16, 128), (16, 1024, 16, 128), dict(local_window_size=(64, 0)), 132),
        ((8, 2048, 16, 128), (8, 2048, 16, 128), dict(causal=True, has_segment_ids=True), 512),
        ((8, 2048, 16, 128), (8, 2048, 16, 128), dict(causal=True, has_kv_lengths=True), 1024),
        (
            (32, 1024, 16, 128),
            (32, 1024, 16, 128),
            dict(causal=True, local_window_size=(256, 0)),
            1024,
        ),
        ((4, 1024, 16, 128), (4, 1024, 16, 128), dict(causal=True, has_segment_ids=True), 256),
        ((16, 1024, 16, 128), (16, 1024, 16, 128), dict(has_mask=True), 132),  # key padding
        ((16, 1024, 16, 128), (16, 1024, 16, 128), dict(has_bias=True), None),  # row per query
        ((16, 1024, 16, 128), (16, 1024, 16, 128), dict(has_q_lengths=True), None),
        ((16, 1024, 16, 128), (16, 1024, 16, 128), dict(causal=True, has_q_lengths=True), 1024),
        ((4, 1, 16, 128), (4, 2048, 16, 128), dict(causal=True), None),  # key chunks
    ],
)
def test_persistent_forward_where_it_measured_faster(q_shape, k_shape, features, want):
    q, k = jnp.zeros(q_shape, jnp.bfloat16), jnp.zeros(k_shape, jnp.bfloat16)
    spec = _spec(**features)
    causal = features.get("causal", False)
    b, sq, h, _ = q_shape
    rows = {"has_mask": (b, 1, 1, k_shape[1]), "has_bias": (1, h, sq, k_shape[1])}
    shape = next((rows[f] for f in rows if f in features), None)
    bias = None if shape is None else jnp.zeros(shape, jnp.float32)
    p = am._with_features(am._fwd_problem(q, k, causal, 0.1), spec, bias)
    assert am._fwd_ctas(p, 132, None, None) == want


@pytest.mark.parametrize(
    ("knobs", "error", "match"),
    [
        (dict(persistent=1), TypeError, "persistent=1 must be a bool or None"),
        (dict(ctas=0), ValueError, "ctas=0 must be a positive int or None"),
        (dict(ctas=True), ValueError, "ctas=True must be a positive int or None"),
        (dict(persistent=False, ctas=4), ValueError, "ctas=4 needs the persistent grid"),
    ],
)
def test_persistent_forward_knobs_are_checked(knobs, error, match):
    q = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
    with pytest.raises(error, match="flash_fwd: " + match):
        am.flash_fwd(_spec(), q, q, q, **knobs)
