"""The attention forward for decoding (a few queries against a long K/V cache) in Pallas'
Triton backend.

Why a second forward beside ``attention_mgpu``'s: a Hopper warpgroup's product tile is 64
query rows however few the queries, so at 1 to 16 queries the Mosaic GPU forward spends its
time on padded rows (``benchmarks/archive/decode-kernel-probe-h100.txt``). Triton's
products take 16 rows. A program owns one kv head of one batch entry and one chunk of its
keys: the group's ``g`` query heads times ``Sq`` queries are its rows (head-major, as
``attention_mgpu._fold``), gathered straight from ``q`` (no transposed copy), and it walks
the chunk's key blocks with the online softmax in f32. Split into chunks, the programs
write f32 partials and their lse, and a second kernel combines each row's chunks in key
order (one launch, where XLA's fusions of the same sums take three or more); one chunk is
written as the output itself.

Output and lse follow ``attention_mgpu.flash_fwd``'s contract (so its backward kernels take
them): ``lse`` in the natural log, ``-inf`` and zeros for a row that sees no key.
"""

from __future__ import annotations

import functools
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
    if k.shape[0] * k.shape[1] * hkv * d >= 2**31:
        return f"K/V of {k.shape} hold 2**31 elements or more (the kernel's offsets are int32)"
    return None


def _rows(b, h, sq: int, hq: int, g: int, rows_pad: int):
    """The program's rows: ``(s, rows)``, each row's query position and its row of the
    flattened ``(B, Sq, Hq)`` queries. Row r is query ``r % sq`` of head ``h·g + r // sq``;
    the padding rows repeat the real ones (the same values to the same addresses: every
    load and store is unmasked, and no padding row lands on another row's output)."""
    r = jnp.arange(rows_pad) % (g * sq)
    s = r % sq
    return s, (b * sq + s) * hq + h * g + r // sq


def _lse_rows(b, rows, sq: int, hq: int, batch: int, chunk):
    """Chunk ``chunk``'s lse positions of ``rows`` in the flattened ``(chunks, B, Hq, Sq)``."""
    head, s = rows % hq, (rows // hq) % sq
    return ((chunk * batch + b) * hq + head) * sq + s


def _kernel(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *, dims, chunk_keys, causal, c):
    batch, sq, hq, hkv, skv, d, rows_pad, _ = dims
    g = hq // hkv
    b, h, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s_of, q_rows = _rows(b, h, sq, hq, g, rows_pad)
    cols = jnp.arange(d)
    q = plgpu.load(q_ref.at[q_rows[:, None], cols[None, :]])
    kv_len = jnp.minimum(len_ref[b], skv)
    start = chunk * chunk_keys
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
        if causal:  # bottom-right aligned, as the operator's mask
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
    part = chunk * (batch * sq * hq) + q_rows  # (a chunk's partial: f32; one chunk: out)
    plgpu.store(out_ref.at[part[:, None], cols[None, :]], acc.astype(out_ref.dtype))
    plgpu.store(lse_ref.at[_lse_rows(b, q_rows, sq, hq, batch, chunk)], lse)


def _combine_kernel(part_ref, lse_ref, out_ref, lse_out_ref, *, dims):
    """The chunks' partials of the program's rows: ``lse = m + log Σ_c e_c`` with
    ``e_c = exp(lse_c − m)`` (``m`` their max) and ``out = Σ_c (e_c / Σ e)·part_c``, every
    sum over the chunks in key order; a row no chunk saw gets zeros and ``lse = -inf``."""
    batch, sq, hq, hkv, _, d, rows_pad, chunks = dims
    b, h = pl.program_id(0), pl.program_id(1)
    _, rows = _rows(b, h, sq, hq, hq // hkv, rows_pad)
    cols = jnp.arange(d)
    lses = [plgpu.load(lse_ref.at[_lse_rows(b, rows, sq, hq, batch, c)]) for c in range(chunks)]
    m = functools.reduce(jnp.maximum, lses)
    e = [jnp.exp(x - jnp.where(m == -jnp.inf, 0.0, m)) for x in lses]
    total = functools.reduce(jnp.add, e)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    acc = jnp.zeros((rows_pad, d), jnp.float32)
    for c in range(chunks):
        part = plgpu.load(part_ref.at[(c * batch * sq * hq + rows)[:, None], cols[None, :]])
        acc = acc + (e[c] / safe)[:, None] * part
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype))
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
    plgpu.store(lse_out_ref.at[_lse_rows(b, rows, sq, hq, batch, 0)], lse)


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
    params = plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2)
    n_rows = b * sq * hq
    out, lse = pl.pallas_call(
        functools.partial(
            _kernel, dims=dims, chunk_keys=keys, causal=causal, c=scale * _mgpu.LOG2E
        ),
        grid=(b, hkv, chunks),
        out_shape=(
            jax.ShapeDtypeStruct((chunks * n_rows, d), q.dtype if chunks == 1 else jnp.float32),
            jax.ShapeDtypeStruct((chunks * n_rows,), jnp.float32),
        ),
        compiler_params=params,
        interpret=interpret,
        name="ts_attention_decode_fwd",
    )(lengths, q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d))
    if chunks > 1:
        out, lse = pl.pallas_call(
            functools.partial(_combine_kernel, dims=dims),
            grid=(b, hkv),
            out_shape=(
                jax.ShapeDtypeStruct((n_rows, d), q.dtype),
                jax.ShapeDtypeStruct((n_rows,), jnp.float32),
            ),
            compiler_params=params,
            interpret=interpret,
            name="ts_attention_decode_combine",
        )(out, lse)
    return out.reshape(b, sq, hq, d), lse.reshape(b, hq, sq)
