"""The attention forward, and its backward, for decoding (a few queries against a long K/V
cache) in Pallas' Triton backend.

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

Every option of the operator runs here: key lengths, a causal mask and a local window from
positions (a window's first visible key is where a program starts its loop: the blocks
before it are not read), query lengths and segment ids from their int32 operands, and a
``mask`` and ``bias`` folded by XLA into one additive array (``-inf`` where masked:
``attention_mgpu._bias_operand``), read in f32 beside each key block with 1-sized dims
broadcast: the bias is not rounded to 16 bits here. (Read as given instead, a bool mask or
a bf16 bias, the kernel's narrower loads cost more per key than the fold's launch:
``benchmarks/archive/decode-unfolded-mask-h200.txt``.)

Output and lse follow ``attention_mgpu.flash_fwd``'s contract (so its backward kernels take
them): ``lse`` in the natural log, ``-inf`` and zeros for a row that sees no key.

Registered on ``flash_attention_fwd`` and ``flash_attention_bwd`` ahead of the Mosaic GPU
kernels, for decode shapes only (:func:`supports`). The chunks depend on the key count
only (:func:`default_split_keys`), never on batch or heads, so a sharded batch or head axis
computes the same sums.

:func:`decode_bwd` is the backward in the same form: a program owns one chunk of one kv
head's keys for the whole group, so it writes those keys' complete dK and dV (no sum
across programs), computes Δ = rowsum(dO∘O) from O itself (no row kernel before it), and
adds its f32 part of each row's dQ, which XLA sums chunk by chunk. Its products take 16
rows where the Mosaic GPU backward's take 64 (``attention_mgpu``'s dQ kernel computing dK
and dV, whose time at B1 follows its padded products: five of 64×64×128 a 64-key step,
``benchmarks/archive/dq-dkv-profile-h200.txt``); ``benchmarks/attention.py --sweep-dq-dkv``
times the two.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from tessera_jax import _compat
from tessera_jax._compat import pallas_triton as plgpu
from tessera_jax.pallas_kernels import attention_mgpu as _mgpu
from tessera_jax.pallas_kernels import device

__all__ = [
    "BWD_CONFIG",
    "BWD_MIN_KV",
    "MIN_KV",
    "DecodeConfig",
    "decode_bwd",
    "decode_fwd",
    "decode_reason",
    "default_split_keys",
    "flash_bwd",
    "flash_fwd",
    "padded_rows",
    "prefer",
    "smem_bytes",
    "supports",
]

# Why the kernels cannot be built in this process (a jax without Pallas' Triton
# backend), or None.
MISSING = _compat.TRITON_MISSING
MIN_ROWS = 16  # a Triton product's narrowest side
MAX_ROWS = 64
# Chunks per row: about SPLIT_CHUNKS of at least SPLIT_KEYS_MIN keys. Profiled on the H100
# at B1 and B4, 1 to 16 queries, GQA or not, against 4096 and 32768 keys (kernel time per
# call, ``benchmarks/archive/decode-triton-tuning-h100.txt``): 8 chunks ran fastest at B1
# and against 32768 keys; at B4 against 4096 keys 4 chunks ran 5-10% faster, which a rule
# reading the key count only (the same bits on any mesh) cannot choose.
SPLIT_CHUNKS = 8
SPLIT_KEYS_MIN = 512
# The backward's chunks: about SPLIT_CHUNKS_BWD. Against 32768 keys at B1 (one query, GQA
# or not) 16 chunks of 2048 keys ran 0.075 ms where 8 of 4096 ran 0.112 and 32 of 1024 ran
# 0.081; at B4 the three were level; against 4096 keys the SPLIT_KEYS_MIN bound keeps 8
# chunks, which beat 4 there (kernel time, ``benchmarks/archive/decode-bwd-tuning-h200.txt``).
SPLIT_CHUNKS_BWD = 16
# Columns of the output per program of the forward's combination of its chunks. With one
# program per kv head (8 at B1 H8) the combination ran as long as half the split kernel at
# B1; 16 columns a program ran it fastest there and level at B4, with the same bits
# (kernel time, ``benchmarks/archive/decode-combine-probe-h200.txt``).
COMBINE_COLS = 16
# ``auto`` mode runs this forward from MIN_KV keys, below ``attention_mgpu.DECODE_MIN_KV``
# (where the Mosaic GPU forward starts). Against 1024 and 2048 keys (B1 and B4, 1 and 16
# queries, GQA or not; the ``fwd-noncausal-decode-…-skv1024/2048`` rows of
# benchmarks/results/attention-h100.json, in-graph) it beat the blocked reference that auto
# ran there in every case; in two runs it ran 0.72-1.89x XLA, below 1.0 in one and in two of
# the 12 cases, where the reference ran 0.63-1.10x. Against 257 and 272 keys (the
# ``fwd-noncausal-decode-window-…-skv2048`` rows, whose window left those keys then; the
# operator keeps 384 now, contracts.attention.dropped_keys: the ``ts_pallas`` and
# ``ts_reference`` rows) it beat the reference too, at B1 and B4.
MIN_KV = 256
# ``auto`` mode runs this backward from BWD_MIN_KV keys (where ``attention_mgpu``'s backward
# kernels start decoding), ahead of them. With its defaults it ran faster than they did at
# every measured decode shape, kernel calls chained in one program on an H200
# (``benchmarks/archive/decode-bwd-tuning-h200.txt``): against 256 to 2048 keys (B1 H8 and
# B4 H16, 1 and 16 queries) 1.28-1.60x faster, and against 4096 and 32768 keys (B1
# and B4, GQA or not) 1.04-1.05x at B4 and 1.34-1.73x at B1. At head dim 64, forward and
# backward through ``auto`` ran ahead of XLA in every case measured (the
# ``fwdbwd-noncausal-decode-…-d64-…`` rows of benchmarks/results/attention-h200.json).
BWD_MIN_KV = 256


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tuning of :func:`decode_fwd` (its defaults) and :func:`decode_bwd`
    (:data:`BWD_CONFIG`).

    Attributes:
      block_kv: keys per step of a program's loop (a power of two, at least 16).
      num_warps: warps per program (a power of two).
      num_stages: Triton's software-pipelining depth of the loop's loads.
      split_keys: keys per chunk, a multiple of ``block_kv``; None:
        :func:`default_split_keys`.
    """

    block_kv: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_keys: int | None = None

    def __post_init__(self):
        for name in ("block_kv", "num_warps", "num_stages"):
            x = getattr(self, name)
            if not isinstance(x, int) or isinstance(x, bool) or x <= 0:
                raise ValueError(f"DecodeConfig: {name}={x!r} must be a positive int")
        if self.block_kv < 16 or self.block_kv & (self.block_kv - 1):
            raise ValueError(f"DecodeConfig: {self.block_kv=} must be a power of two >= 16")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"DecodeConfig: {self.num_warps=} must be a power of two")
        keys = self.split_keys
        if keys is not None and (
            not isinstance(keys, int) or isinstance(keys, bool) or keys <= 0 or keys % self.block_kv
        ):
            raise ValueError(
                f"DecodeConfig: split_keys={keys!r} must be a positive multiple of {self.block_kv=}"
            )


# The backward's tuning: 64 keys a step with three stages ran fastest at B1 and within 3%
# of the fastest (two stages) at B4, at every measured decode shape (1 and 16 queries, GQA
# or not, 4096 and 32768 keys; ``benchmarks/archive/decode-bwd-tuning-h200.txt``), where
# two stages ran up to 1.5x slower at B1; at 64 rows, 128 keys a step with three stages
# does not fit shared memory (:func:`smem_bytes`).
BWD_CONFIG = DecodeConfig(block_kv=64)


def padded_rows(rows: int) -> int:
    """A program's rows for ``rows`` real ones (a GQA group's query heads × queries): the
    next power of two, at least :data:`MIN_ROWS`."""
    return max(MIN_ROWS, pl.next_power_of_2(rows))


def smem_bytes(config: DecodeConfig, rows: int, head_dim: int, backward: bool) -> int:
    """Shared memory a program takes, as modelled: Triton's ring of ``num_stages`` K and V
    blocks, the rows' Q tile (and the backward's dO tile), and one rows × keys tile of the
    probabilities (16-bit elements throughout). It gives the 245760 bytes the compiled
    backward requested at 64 rows, 128 keys a step, three stages and head_dim 128, and no
    more than :data:`attention_mgpu.SMEM_BYTES` for every configuration that compiled
    (``benchmarks/archive/decode-bwd-tuning-h200.txt``)."""
    kv_ring = config.num_stages * 2 * config.block_kv * head_dim * 2
    return kv_ring + (2 if backward else 1) * rows * head_dim * 2 + rows * config.block_kv * 2


def default_split_keys(seq_kv: int, block_kv: int, chunks: int = SPLIT_CHUNKS) -> int:
    """Keys per chunk for ``seq_kv`` keys: about ``chunks`` chunks (:data:`SPLIT_CHUNKS`
    for the forward, :data:`SPLIT_CHUNKS_BWD` for the backward) of at least
    :data:`SPLIT_KEYS_MIN` keys, a multiple of ``block_kv``."""
    keys = max(SPLIT_KEYS_MIN, -(-seq_kv // chunks))
    return -(-keys // block_kv) * block_kv


def decode_reason(spec, q, k) -> str | None:
    """Why :func:`decode_fwd` cannot run the case, or None: at most 64 rows (query heads
    of a group × queries), head_dim 64 or 128 and 16-bit inputs (every option of the
    operator is supported)."""
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
    if 0 in q.shape or 0 in k.shape:
        return f"an empty operand (q {tuple(q.shape)}, k {tuple(k.shape)})"
    return None


def _rows(h, sq: int, g: int, rows_pad: int):
    """The program's rows: ``(s, head)``, each row's query position and query head. Row r
    is query ``r % sq`` of head ``h·g + r // sq``; the padding rows repeat the real ones
    (the same values to the same addresses: every load and store is unmasked, and no
    padding row lands on another row's output)."""
    r = jnp.arange(rows_pad) % (g * sq)
    return r % sq, h * g + r // sq


# Every operand is indexed per dimension, never by a flattened offset computed here: Pallas
# widens the offsets to 64 bits for an array of 2**32 bytes or more, so the kernel takes
# any cache size, and which kernel runs does not depend on the batch or head count.


def _operands(refs, operands):
    """``({name: refs}, rest)``: the optional operands' refs, named, and the refs after."""
    opt = {}
    for name in operands:
        n = 2 if name == "segment_ids" else 1
        opt[name], refs = refs[:n], refs[n:]
    return opt, refs


def _chunk_keys(len_ref, b, chunk, *, dims, chunk_keys, block_kv, window):
    """The keys of chunk ``chunk`` of batch entry ``b``: ``(start, end, limit, first,
    steps)``: the chunk is keys ``[start, end)``, its keys below ``limit`` are below the
    entry's length, and its blocks ``[first, steps)`` hold every key a row can see (a
    window's rows see no key of the blocks before ``first``)."""
    sq, skv = dims[0], dims[3]
    kv_len = jnp.minimum(len_ref[b], skv)
    start = chunk * chunk_keys
    end = jnp.minimum(start + chunk_keys, skv)
    limit = jnp.minimum(kv_len, end)
    steps = jnp.maximum(0, (limit - start + block_kv - 1) // block_kv)
    first = 0
    if window is not None:  # no row sees a key before the first row's window
        first = jnp.clip((skv - sq - window[0] - start) // block_kv, 0, steps)
    return start, end, limit, first, steps


def _scores_fn(opt, b, s_of, head, *, dims, causal, window, bias_dims):
    """``scores(s, key, kmask)``: a key block's scores ``s`` (rows × keys, the exp2
    domain) with the bias added, ``-inf`` where a row does not see a key (``kmask``: the
    keys below the length)."""
    sq, skv = dims[0], dims[3]
    diag = s_of + (skv - sq)  # each row's position among the keys (bottom-right aligned)
    row_vis = None  # (rows,) bool: rows that see keys at all
    if "q_lengths" in opt:
        row_vis = s_of < opt["q_lengths"][0][b]
    if "bias" in opt:
        bb, bh, bq = bias_dims
        bias_at = (
            b if bb > 1 else 0,
            (head if bh > 1 else jnp.zeros_like(head))[:, None],
            (s_of if bq > 1 else jnp.zeros_like(s_of))[:, None],
        )
    if "segment_ids" in opt:
        q_seg_ref, kv_seg_ref = opt["segment_ids"]
        q_seg = plgpu.load(q_seg_ref.at[b, s_of])

    def scores(s, key, kmask):
        if "bias" in opt:
            bias = plgpu.load(
                opt["bias"][0].at[(*bias_at, key[None, :])], mask=kmask[None, :], other=0.0
            )
            s = s + bias * _mgpu.LOG2E
        vis = kmask[None, :]
        if causal:
            vis = vis & (key[None, :] <= diag[:, None])
        if window is not None:
            left, right = window
            vis = vis & (key[None, :] >= (diag - left)[:, None])
            vis = vis & (key[None, :] <= (diag + right)[:, None])
        if row_vis is not None:
            vis = vis & row_vis[:, None]
        if "segment_ids" in opt:
            kv_seg = plgpu.load(kv_seg_ref.at[b, key], mask=kmask, other=0)
            vis = vis & (q_seg[:, None] == kv_seg[None, :])
        return jnp.where(vis, s, -jnp.inf)

    return scores


def _kernel(*refs, dims, chunk_keys, block_kv, causal, window, operands, bias_dims, c):
    """One chunk of one kv head's keys for one batch entry: the rows' output (divided by
    their sum, in ``out_ref``'s dtype) and lse, at ``out_ref[chunk, b]``/``lse_ref[chunk,
    b]``. ``refs``: the key lengths, then the optional ``operands`` in their order
    (``"q_lengths"``, ``"bias"``: the folded mask and bias, whose batch, head and query dims
    ``bias_dims`` are each 1 or full, ``"segment_ids"``: two refs), then q, k, v and the
    two outputs."""
    sq, hq, hkv, _, d, rows_pad, _ = dims
    len_ref, *refs = refs
    opt, (q_ref, k_ref, v_ref, out_ref, lse_ref) = _operands(refs, operands)
    b, h, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s_of, head = _rows(h, sq, hq // hkv, rows_pad)
    cols = jnp.arange(d)
    q = plgpu.load(q_ref.at[b, s_of[:, None], head[:, None], cols[None, :]])
    start, _, limit, first, steps = _chunk_keys(
        len_ref, b, chunk, dims=dims, chunk_keys=chunk_keys, block_kv=block_kv, window=window
    )
    scores = _scores_fn(
        opt, b, s_of, head, dims=dims, causal=causal, window=window, bias_dims=bias_dims
    )

    def body(j, carry):
        acc, m, l_ = carry
        key = start + j * block_kv + jnp.arange(block_kv)
        kmask = key < limit
        at = (b, key[:, None], h, cols[None, :])
        k = plgpu.load(k_ref.at[at], mask=kmask[:, None], other=0.0)
        s = scores(plgpu.dot(q, k, trans_b=True) * c, key, kmask)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l_ = l_ * alpha + p.sum(axis=1)
        v = plgpu.load(v_ref.at[at], mask=kmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, l_

    init = (
        jnp.zeros((rows_pad, d), jnp.float32),
        jnp.full((rows_pad,), -jnp.inf, jnp.float32),
        jnp.zeros((rows_pad,), jnp.float32),
    )
    acc, m, l_ = jax.lax.fori_loop(first, steps, body, init)
    empty = l_ == 0.0
    acc = acc / jnp.where(empty, 1.0, l_)[:, None]
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l_))) * _mgpu.LN2)
    out_at = (chunk, b, s_of[:, None], head[:, None], cols[None, :])
    plgpu.store(out_ref.at[out_at], acc.astype(out_ref.dtype))
    plgpu.store(lse_ref.at[chunk, b, head, s_of], lse)


def _combine_kernel(part_ref, lse_ref, out_ref, lse_out_ref, *, dims, cols_per_program):
    """The chunks' partials of the program's rows, ``cols_per_program`` columns of them:
    ``lse = m + log Σ_c e_c`` with ``e_c = exp(lse_c − m)`` (``m`` their max) and
    ``out = Σ_c (e_c / Σ e)·part_c``, every sum over the chunks in key order; a row no chunk
    saw gets zeros and ``lse = -inf``. Every program of a head computes its rows' weights
    alike; the first writes the lse."""
    sq, hq, hkv, _, _, rows_pad, chunks = dims
    b, h, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s_of, head = _rows(h, sq, hq // hkv, rows_pad)
    cols = col_block * cols_per_program + jnp.arange(cols_per_program)
    lses = [plgpu.load(lse_ref.at[c, b, head, s_of]) for c in range(chunks)]
    m = functools.reduce(jnp.maximum, lses)
    e = [jnp.exp(x - jnp.where(m == -jnp.inf, 0.0, m)) for x in lses]
    total = functools.reduce(jnp.add, e)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    acc = jnp.zeros((rows_pad, cols_per_program), jnp.float32)
    for c in range(chunks):
        part = plgpu.load(part_ref.at[c, b, s_of[:, None], head[:, None], cols[None, :]])
        acc = acc + (e[c] / safe)[:, None] * part
    plgpu.store(
        out_ref.at[b, s_of[:, None], head[:, None], cols[None, :]], acc.astype(out_ref.dtype)
    )
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)

    @pl.when(col_block == 0)
    def _():
        plgpu.store(lse_out_ref.at[b, head, s_of], lse)


def _call(spec, q, k, v, kv_lengths, q_lengths, bias, segment_ids, config, dlse=None, *, backward):
    """What the forward's and the backward's calls share: ``(kernel keyword arguments,
    dims, optional operands in their order, key lengths, compiler params)``."""
    fn = "decode_bwd" if backward else "decode_fwd"
    cfg = (BWD_CONFIG if backward else DecodeConfig()) if config is None else config
    if not isinstance(cfg, DecodeConfig):
        raise TypeError(f"attention_decode.{fn}: config={cfg!r} must be a DecodeConfig")
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"attention_decode.{fn}: q {q.shape}, k {k.shape} and v {v.shape} must "
            "share batch and head_dim, k and v one shape"
        )
    given = {
        "q_lengths": (q_lengths, spec.has_q_lengths),
        "bias": (bias, spec.has_mask or spec.has_bias),
        "segment_ids": (segment_ids, spec.has_segment_ids),
        "dlse": (dlse, spec.has_dlse),
    }
    for name, (x, wanted) in given.items():
        if (x is not None) != wanted:
            raise ValueError(
                f"attention_decode.{fn}: {name} is {'missing' if wanted else 'given'}, "
                f"but the spec says {wanted=}"
            )
    bias_dims = (1, 1, 1)
    if bias is not None:
        bias_dims = tuple(bias.shape[:3])
        full = (b, hq, sq, skv)
        if (
            bias.ndim != 4
            or any(n not in (1, f) for n, f in zip(bias_dims, full))
            or (bias.shape[3] != skv)
        ):
            raise ValueError(
                f"attention_decode.{fn}: bias.shape={bias.shape} must be (1 or {b}, "
                f"1 or {hq}, 1 or {sq}, {skv})"
            )
    keys = cfg.split_keys
    if keys is None:
        keys = default_split_keys(skv, cfg.block_kv, SPLIT_CHUNKS_BWD if backward else SPLIT_CHUNKS)
    chunks = math.ceil(skv / keys) if keys < skv else 1
    keys = keys if chunks > 1 else skv
    rows_pad = padded_rows(hq // hkv * sq)
    need = smem_bytes(cfg, rows_pad, d, backward)
    if need > _mgpu.SMEM_BYTES:
        raise ValueError(
            f"attention_decode.{fn}: config={cfg} takes about {need} bytes of shared memory "
            f"at {rows_pad} rows and head_dim {d}, over {_mgpu.SMEM_BYTES}: take a smaller "
            "block_kv or fewer num_stages"
        )
    causal, scale = _mgpu._decode(spec)
    lengths = (
        jnp.full((b,), skv, jnp.int32) if kv_lengths is None else _mgpu._clamped(kv_lengths, skv)
    )
    operands = []
    if q_lengths is not None:
        operands.append(("q_lengths", [q_lengths.astype(jnp.int32)]))
    if bias is not None:
        operands.append(("bias", [bias.astype(jnp.float32)]))
    if segment_ids is not None:
        operands.append(("segment_ids", [x.astype(jnp.int32) for x in segment_ids]))
    if dlse is not None:
        operands.append(("dlse", [dlse.astype(jnp.float32)]))
    dims = (sq, hq, hkv, skv, d, rows_pad, chunks)
    kernel = dict(
        dims=dims,
        chunk_keys=keys,
        block_kv=cfg.block_kv,
        causal=causal,
        window=spec.local_window_size,
        operands=tuple(name for name, _ in operands),
        bias_dims=bias_dims,
        c=scale * _mgpu.LOG2E,
    )
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return kernel, dims, [x for _, xs in operands for x in xs], lengths, params


def decode_fwd(
    spec,
    q,
    k,
    v,
    kv_lengths=None,
    *,
    q_lengths=None,
    bias=None,
    segment_ids=None,
    config=None,
    interpret=False,
):
    """``(out, lse)`` of attention at a decode shape (:func:`decode_reason`), ``out`` like
    ``q`` and ``lse`` ``(B, H, Sq)`` in f32, as ``attention_mgpu.flash_fwd``.

    ``kv_lengths`` / ``q_lengths``: int ``(B,)``, each batch entry's key / query count
    (clipped to ``[0, seq]``); ``bias``: the folded mask and bias ``(Bb, Hb, Sq or 1,
    Skv)``, read in f32, with ``Bb`` in ``{1, B}`` and ``Hb`` in ``{1, Hq}`` (``-inf``
    where masked: ``attention_mgpu._bias_operand``); ``segment_ids``: the pair of int
    ``(B, Sq)`` and ``(B, Skv)``. Each is given exactly where ``spec`` says so; causal and
    the window come from ``spec``. ``config``: a :class:`DecodeConfig` (None: its
    defaults)."""
    reason = decode_reason(spec, q, k)
    if reason is not None:
        raise ValueError(f"attention_decode.decode_fwd: this kernel cannot run the case: {reason}")
    call = _call(spec, q, k, v, kv_lengths, q_lengths, bias, segment_ids, config, backward=False)
    kernel, dims, operands, lengths, params = call
    (b, sq, hq), hkv, chunks = q.shape[:3], k.shape[2], dims[-1]
    kernel = functools.partial(_kernel, **kernel)
    # One chunk writes the output itself; several write f32 partials for the combination.
    with device.int32_tracing():
        out, lse = pl.pallas_call(
            kernel,
            grid=(b, hkv, chunks),
            out_shape=(
                jax.ShapeDtypeStruct((chunks, *q.shape), q.dtype if chunks == 1 else jnp.float32),
                jax.ShapeDtypeStruct((chunks, b, hq, sq), jnp.float32),
            ),
            compiler_params=params,
            interpret=interpret,
            name="ts_attention_decode_fwd",
        )(lengths, *operands, q, k, v)
        if chunks == 1:
            return out[0], lse[0]
        cols = min(COMBINE_COLS, q.shape[-1])
        return pl.pallas_call(
            functools.partial(_combine_kernel, dims=dims, cols_per_program=cols),
            grid=(b, hkv, q.shape[-1] // cols),
            out_shape=(
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
            ),
            compiler_params=params,
            interpret=interpret,
            name="ts_attention_decode_combine",
        )(out, lse)


# --- backward --------------------------------------------------------------------------------


def _bwd_kernel(*refs, dims, chunk_keys, block_kv, causal, window, operands, bias_dims, c, scale):
    """One chunk of one kv head's keys for one batch entry, every row of the group: the
    chunk's dK and dV (complete: no other program sees these keys; zeros where no row sees
    a key) and the rows' dQ over the chunk (f32, unscaled, at ``dq_ref[chunk, b]``; the
    wrapper sums the chunks). Δ = rowsum(dO∘O) is computed here from O. ``refs``: as
    :func:`_kernel`'s, with ``"dlse"`` among the optional operands (the lse cotangent,
    which enters as −Δ does), then q, k, v, out, lse, dout and the three outputs."""
    sq, hq, hkv, _, d, rows_pad, _ = dims
    g = hq // hkv
    len_ref, *refs = refs
    opt, refs = _operands(refs, operands)
    q_ref, k_ref, v_ref, o_ref, lse_ref, do_ref, dq_ref, dk_ref, dv_ref = refs
    b, h, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s_of, head = _rows(h, sq, g, rows_pad)
    # The padding rows repeat real ones: their dQ is the real row's (stored to the same
    # address with the same value, as the forward's rows), and they add nothing to dK, dV.
    real = (jnp.arange(rows_pad) < g * sq)[:, None]
    cols = jnp.arange(d)
    rows_at = (b, s_of[:, None], head[:, None], cols[None, :])
    q, do = plgpu.load(q_ref.at[rows_at]), plgpu.load(do_ref.at[rows_at])
    o = plgpu.load(o_ref.at[rows_at]).astype(jnp.float32)
    delta = jnp.sum(o * do.astype(jnp.float32), axis=1)
    if "dlse" in opt:
        delta = delta - plgpu.load(opt["dlse"][0].at[b, head, s_of])
    lse = plgpu.load(lse_ref.at[b, head, s_of])
    # exp2(s − lse2) is exactly 0 where lse2 = +inf: rows that saw no key.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * _mgpu.LOG2E)
    start, end, limit, first, steps = _chunk_keys(
        len_ref, b, chunk, dims=dims, chunk_keys=chunk_keys, block_kv=block_kv, window=window
    )
    scores = _scores_fn(
        opt, b, s_of, head, dims=dims, causal=causal, window=window, bias_dims=bias_dims
    )

    def keys(j):
        key = start + j * block_kv + jnp.arange(block_kv)
        inside = jnp.broadcast_to((key < end)[:, None], (block_kv, d))
        return key, (b, key[:, None], h, cols[None, :]), inside

    def body(j, dq):
        key, at, inside = keys(j)
        kmask = key < limit
        k = plgpu.load(k_ref.at[at], mask=kmask[:, None], other=0.0)
        v = plgpu.load(v_ref.at[at], mask=kmask[:, None], other=0.0)
        s = scores(plgpu.dot(q, k, trans_b=True) * c, key, kmask)
        p = jnp.exp2(s - lse2[:, None])
        dp = plgpu.dot(do, v, trans_b=True)
        ds = (p * (dp - delta[:, None])).astype(q.dtype)
        p = jnp.where(real, p, 0.0).astype(q.dtype)
        dv = plgpu.dot(p, do, trans_a=True)
        plgpu.store(dv_ref.at[at], dv.astype(dv_ref.dtype), mask=inside)
        dk = plgpu.dot(jnp.where(real, ds, jnp.zeros((), ds.dtype)), q, trans_a=True) * scale
        plgpu.store(dk_ref.at[at], dk.astype(dk_ref.dtype), mask=inside)
        return dq + plgpu.dot(ds, k)

    def zeros(j, carry):  # blocks no row sees: a window's before ``first``, past the length
        _, at, inside = keys(j)
        for ref in (dk_ref, dv_ref):
            plgpu.store(ref.at[at], jnp.zeros((block_kv, d), ref.dtype), mask=inside)
        return carry

    dq = jax.lax.fori_loop(first, steps, body, jnp.zeros((rows_pad, d), jnp.float32))
    jax.lax.fori_loop(0, first, zeros, 0)
    jax.lax.fori_loop(steps, (end - start + block_kv - 1) // block_kv, zeros, 0)
    plgpu.store(dq_ref.at[(chunk, *rows_at)], dq)


def decode_bwd(
    spec,
    q,
    k,
    v,
    out,
    lse,
    dout,
    kv_lengths=None,
    *,
    q_lengths=None,
    bias=None,
    segment_ids=None,
    dlse=None,
    config=None,
    interpret=False,
):
    """``(dq, dk, dv)`` of :func:`decode_fwd`'s attention (``out`` and ``lse`` its outputs,
    ``dout`` the output's cotangent), bitwise reproducible: a program owns one kv head's
    keys of one chunk for every query of the group, so each key's dK and dV are one
    program's sums, and dQ is the sum of the chunks' f32 partials, chunk by chunk from the
    first key on, times the scale, rounded once. The chunks are :data:`SPLIT_CHUNKS_BWD`
    (key count only). Keys no query sees get zero dK and dV. The operands are
    :func:`decode_fwd`'s, plus ``dlse``: f32 ``(B, H, Sq)``, the lse's cotangent, or None;
    ``config``: a :class:`DecodeConfig` (None: :data:`BWD_CONFIG`). The bias is not
    differentiated."""
    reason = decode_reason(spec, q, k)
    if reason is not None:
        raise ValueError(f"attention_decode.decode_bwd: this kernel cannot run the case: {reason}")
    b, sq, hq = q.shape[:3]
    for name, x, want in (
        ("out", out, q.shape),
        ("dout", dout, q.shape),
        ("lse", lse, (b, hq, sq)),
        ("dlse", dlse, (b, hq, sq)),
    ):
        if x is not None and tuple(x.shape) != want:
            raise ValueError(f"attention_decode.decode_bwd: {name}.shape={x.shape} must be {want}")
    call = _call(
        spec, q, k, v, kv_lengths, q_lengths, bias, segment_ids, config, dlse, backward=True
    )
    kernel, dims, operands, lengths, params = call
    chunks = dims[-1]
    scale = _mgpu._decode(spec)[1]
    with device.int32_tracing():
        dq, dk, dv = pl.pallas_call(
            functools.partial(_bwd_kernel, **kernel, scale=scale),
            grid=(b, k.shape[2], chunks),
            out_shape=(
                jax.ShapeDtypeStruct((chunks, *q.shape), jnp.float32),
                jax.ShapeDtypeStruct(k.shape, k.dtype),
                jax.ShapeDtypeStruct(k.shape, k.dtype),
            ),
            compiler_params=params,
            interpret=interpret,
            name="ts_attention_decode_bwd",
        )(lengths, *operands, q, k, v, out, lse, dout)
    dq = _mgpu._in_key_order(chunks, lambda i: dq[i])
    return (dq * scale).astype(q.dtype), dk, dv


# --- the kernel vocabulary (primitives/_core.Kernel) ----------------------------------------


def supports(spec, avals: Sequence[Any]) -> str | None:
    """None for a forward or a backward at a decode shape (at most
    ``attention_mgpu.DECODE_MAX_Q`` queries) that :func:`decode_reason` accepts, with the
    default ``FlashAttentionConfig``; else why not (never raises). ``avals``: as
    ``attention_mgpu.supports`` takes them. Longer query blocks are the Mosaic GPU
    kernels'."""
    q, k = avals[0], avals[1]
    if _mgpu._fixed_operands(spec, avals) not in (3, 6):
        return f"{len(avals)} operands for a spec with {spec.num_extras} extras"
    declined = [f for f in spec.features if f not in _mgpu.FEATURES]
    if declined:  # the bias's gradient: the reference's backward computes it
        return f"{', '.join(declined)} (the kernels take {', '.join(_mgpu.FEATURES)})"
    if q.shape[1] > _mgpu.DECODE_MAX_Q:
        return f"seq_q {q.shape[1]} > {_mgpu.DECODE_MAX_Q} (a decode kernel)"
    if not _mgpu._default_config(spec):
        return f"config={spec.config}: an explicit FlashAttentionConfig runs the reference"
    return decode_reason(spec, q, k)


def prefer(spec, avals: Sequence[Any]) -> bool:
    """``auto`` mode runs the forward from :data:`MIN_KV` keys and the backward from
    :data:`BWD_MIN_KV`; it reads the key count only, as the chunks do."""
    backward = _mgpu._fixed_operands(spec, avals) == 6
    return avals[1].shape[1] >= (BWD_MIN_KV if backward else MIN_KV)


def hardware(platform: str) -> str | None:
    """None on a Hopper GPU (where the kernel is tuned and measured), else why not."""
    return device.hopper_only(platform, "a Triton kernel tuned on Hopper")


def flash_fwd(spec, q, k, v, *extras, interpret: bool = False, config=None):
    """``ts_flash_attention_fwd``'s kernel: ``(out, lse)`` with the spec's options, the
    extras as the primitive binds them (``config``: :func:`decode_fwd`'s)."""
    ex = spec.split(extras)
    segments = None if ex.q_segment_ids is None else (ex.q_segment_ids, ex.kv_segment_ids)
    return decode_fwd(
        spec,
        q,
        k,
        v,
        ex.kv_lengths,
        q_lengths=ex.q_lengths,
        bias=_mgpu._bias_operand(spec, ex, q, k),
        segment_ids=segments,
        config=config,
        interpret=interpret,
    )


def flash_bwd(spec, q, k, v, out, lse, dout, *extras, interpret: bool = False, config=None):
    """``ts_flash_attention_bwd``'s kernel at decode shapes: ``(dq, dk, dv)`` with the spec's
    options, the extras as the primitive binds them (the lse cotangent last where the spec
    has one; ``config``: :func:`decode_bwd`'s)."""
    ex = spec.split(extras[: spec.num_extras])
    segments = None if ex.q_segment_ids is None else (ex.q_segment_ids, ex.kv_segment_ids)
    return decode_bwd(
        spec,
        q,
        k,
        v,
        out,
        lse,
        dout,
        ex.kv_lengths,
        q_lengths=ex.q_lengths,
        bias=_mgpu._bias_operand(spec, ex, q, k),
        segment_ids=segments,
        dlse=extras[spec.num_extras] if spec.has_dlse else None,
        config=config,
        interpret=interpret,
    )
