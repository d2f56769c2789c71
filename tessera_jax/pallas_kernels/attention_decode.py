"""The attention forward for decoding (a few queries against a long K/V cache) in Pallas'
Triton backend.

Why a second forward beside ``attention_mgpu``'s: a Hopper warpgroup's product tile is 64
query rows however few the queries, so at 1 to 16 queries the Mosaic GPU forward spends its
time on padded rows (``benchmarks/archive/decode-kernel-probe-h100.txt``). Triton's
products take 16 rows. A program owns one kv head of one batch entry and one chunk of its
keys: the group's ``g`` query heads times ``Sq`` queries are its rows (head-major, as
``attention_mgpu._fold``), gathered straight from ``q`` (no transposed copy), and it walks
the chunk's key blocks with the online softmax in f32. The chunks' partial outputs (16-bit
pairs) and lse are combined by ``attention_mgpu._combine_chunks`` in key order, the same
fixed order as the Mosaic GPU forward's; one chunk is written as the output itself.

Output and lse follow ``attention_mgpu.flash_fwd``'s contract (so its backward kernels take
them): ``lse`` in the natural log, ``-inf`` and zeros for a row that sees no key.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tessera_jax.pallas_kernels import attention_mgpu as _mgpu

__all__ = ["decode_fwd", "decode_reason"]

MIN_ROWS = 16  # a Triton product's narrowest side
MAX_ROWS = 64
BLOCK_KV = 64
NUM_WARPS = 4


def decode_reason(spec, q, k) -> str | None:
    """Why :func:`decode_fwd` cannot run the case, or None: at most 64 rows (query heads
    of a group × queries), head_dim 64 or 128, 16-bit inputs, and no mask, bias, window,
    query lengths or segment ids (key lengths and a causal mask are supported)."""
    sq, hq, d = q.shape[1:]
    hkv = k.shape[2]
    if hq % hkv:
        return f"{hq=} is not a multiple of {hkv=}"
    if (hq // hkv) * sq > MAX_ROWS:
        return f"group {hq // hkv} × seq_q {sq} > {MAX_ROWS} rows"
    if d not in (64, 128):
        return f"head_dim {d} not in (64, 128)"
    if np.dtype(q.dtype) not in _mgpu.DTYPES:
        return f"dtype {q.dtype} not 16-bit"
    extras = (
        spec.local_window_size is not None,
        spec.has_q_lengths,
        spec.has_segment_ids,
        spec.has_mask,
        spec.has_bias,
    )
    if any(extras):
        return "a window, query lengths, segment ids, a mask or a bias"
    return None


def _kernel(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *, dims, chunk_keys, causal, c):
    b_, sq, hq, hkv, skv, d, rows_pad, chunks = dims
    g = hq // hkv
    b, h, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # Row r is query r % sq of head h·g + r // sq; the padding rows repeat the real ones
    # (the same values to the same addresses: every load and store is unmasked, and no
    # padding row lands on another row's output).
    r = jnp.arange(rows_pad) % (g * sq)
    s_of = r % sq
    q_rows = (b * sq + s_of) * hq + h * g + r // sq
    cols = jnp.arange(d)
    q = plgpu.load(q_ref.at[q_rows[:, None], cols[None, :]])
    kv_len = jnp.minimum(len_ref[b], skv)
    start = chunk * chunk_keys
    # The keys a query sees: below kv_len and, causal, up to its position (bottom-right
    # aligned, as jax.nn's causal mask for seq_q != seq_kv).
    limit = jnp.minimum(kv_len, start + chunk_keys)
    steps = jnp.maximum(0, (limit - start + BLOCK_KV - 1) // BLOCK_KV)

    def body(j, carry):
        acc, m, l_ = carry
        key = start + j * BLOCK_KV + jnp.arange(BLOCK_KV)
        kmask = key < limit
        kv_rows = (b * skv + key) * hkv + h
        k = plgpu.load(k_ref.at[kv_rows[:, None], cols[None, :]], mask=kmask[:, None], other=0.0)
        s = plgpu.dot(q, k, trans_b=True) * c  # the exp2 domain
        vis = kmask[None, :]
        if causal:
            vis = vis & (key[None, :] <= (s_of + (skv - sq))[:, None])
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l_ = l_ * alpha + p.sum(axis=1)
        v = plgpu.load(v_ref.at[kv_rows[:, None], cols[None, :]], mask=kmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, l_

    init = (
        jnp.zeros((rows_pad, d), jnp.float32),
        jnp.full((rows_pad,), -jnp.inf, jnp.float32),
        jnp.zeros((rows_pad,), jnp.float32),
    )
    acc, m, l_ = jax.lax.fori_loop(0, steps, body, init)
    empty = l_ == 0.0
    acc = acc / jnp.where(empty, 1.0, l_)[:, None]
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l_))) * _mgpu.LN2)
    hi = acc.astype(out_ref.dtype)
    part = chunk * (b_ * sq * hq) + q_rows  # row of (chunks, B, Sq, Hq) flattened
    plgpu.store(out_ref.at[part[:, None], cols[None, :]], hi)
    if chunks > 1:
        lo = (acc - hi.astype(jnp.float32)).astype(out_ref.dtype)
        lo_rows = (chunks + chunk) * (b_ * sq * hq) + q_rows
        plgpu.store(out_ref.at[lo_rows[:, None], cols[None, :]], lo)
    lse_at = ((chunk * b_ + b) * hq + h * g + r // sq) * sq + s_of  # (chunks, B, Hq, Sq)
    plgpu.store(lse_ref.at[lse_at], lse)


def decode_fwd(spec, q, k, v, kv_lengths=None, *, split_keys=None, interpret=False):
    """``(out, lse)`` of attention at a decode shape (:func:`decode_reason`), ``out`` like
    ``q`` and ``lse`` ``(B, H, Sq)`` in f32, as ``attention_mgpu.flash_fwd``. ``kv_lengths``:
    each batch entry's key count (clipped to ``[0, seq_kv]``). ``split_keys``: keys per chunk
    (a multiple of :data:`BLOCK_KV`; default ``attention_mgpu.default_split_keys``, no split
    where one chunk holds every key)."""
    reason = decode_reason(spec, q, k)
    if reason is not None:
        raise ValueError(f"attention_decode.decode_fwd: this kernel cannot run the case: {reason}")
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"attention_decode.decode_fwd: q {q.shape}, k {k.shape} and v {v.shape} must "
            "share batch and head_dim, k and v one shape"
        )
    keys = _mgpu.default_split_keys(skv) if split_keys is None else split_keys
    if keys <= 0 or keys % BLOCK_KV:
        raise ValueError(
            f"attention_decode.decode_fwd: {split_keys=} must be a positive multiple of {BLOCK_KV}"
        )
    chunks = max(1, math.ceil(skv / keys)) if keys < skv else 1
    keys = keys if chunks > 1 else max(skv, 1)
    rows_pad = max(MIN_ROWS, 1 << max(0, math.ceil(math.log2(max(hq // hkv * sq, 1)))))
    causal, scale = _mgpu._decode(spec)
    lengths = (
        jnp.full((b,), skv, jnp.int32)
        if kv_lengths is None
        else jnp.clip(kv_lengths.astype(jnp.int32), 0, skv)
    )
    dims = (b, sq, hq, hkv, skv, d, rows_pad, chunks)
    pairs = 2 if chunks > 1 else 1
    out_rows = pairs * chunks * b * sq * hq
    out, lse = pl.pallas_call(
        lambda *refs: _kernel(
            *refs, dims=dims, chunk_keys=keys, causal=causal, c=scale * _mgpu.LOG2E
        ),
        grid=(b, hkv, chunks),
        out_shape=(
            jax.ShapeDtypeStruct((out_rows, d), q.dtype),
            jax.ShapeDtypeStruct((chunks * b * hq * sq,), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        interpret=interpret,
        name="ts_attention_decode_fwd",
    )(lengths, q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d))
    lse = lse.reshape(chunks, b, hq, sq)
    if chunks == 1:
        return out.reshape(b, sq, hq, d), lse[0]
    return _mgpu._combine_chunks(out.reshape(2, chunks, b, sq, hq, d), lse)
