"""Flash attention: ``softmax(Q·Kᵀ·scale + bias, masked)·V``, blocked, never materialising S×S.

Layout and semantics
--------------------
``q: (B, Sq, Hq, D)``, ``k, v: (B, Skv, Hkv, D)``, output ``(B, Sq, Hq, D)``.
``Hkv`` divides ``Hq`` (GQA; ``Hkv == 1`` is MQA): query head ``h`` reads kv head
``h // (Hq // Hkv)``. ``scale`` defaults to ``1/sqrt(D)``.

The optional arguments are ``jax.nn.dot_product_attention``'s, under its names:

* ``mask`` (bool, True = attend) and ``bias`` (additive, added after ``scale``):
  broadcastable to ``(B, Hq, Sq, Skv)`` — jax.nn's ``(B, N, T, S)``: heads before
  sequence, unlike ``q``'s layout. A rank below 4 gets leading 1s, as in jax.nn.
* ``query_seq_lengths`` / ``key_value_seq_lengths`` (int ``(B,)``): query ``i`` and key
  ``j`` of sequence ``b`` exist only for ``i < query_seq_lengths[b]``,
  ``j < key_value_seq_lengths[b]``.
* ``local_window_size``: ``(left, right)`` (an int ``w`` means ``(w, w)``): query ``i``
  sees keys ``j`` with ``p − left ≤ j ≤ p + right``, ``p = i + Skv − Sq``.
* ``q_segment_ids`` / ``kv_segment_ids`` (int ``(B, Sq)`` / ``(B, Skv)``, both or
  neither): packed sequences, a query sees only keys of its own segment id.

``causal=True`` aligns the mask to the **bottom-right** corner: query ``i`` sees
keys ``j ≤ i + (Skv − Sq)``, the window is centred on the same position. For
``Sq == Skv`` both are jax.nn's (top-left) masks; for ``Sq < Skv`` (decoding with a kv
cache, Sq from 1 to a few) the queries are the last ``Sq`` positions of the sequence;
for ``Sq > Skv`` the first ``Sq − Skv`` queries see no key. The diagonal follows the
array shapes, not the lengths: for a ragged batch of multi-token decodes pass the
per-sequence causal structure as a ``mask``.

A query that sees no key (a fully masked row, a padded query) outputs zeros, its
log-sum-exp is ``-inf`` and its gradients are zero — never NaN. (jax.nn's XLA path
gives padded queries zeros too, but a row emptied by ``mask`` or the window the mean of
``v``: it masks with a large finite negative number.)

Algorithm (the reference lowering)
----------------------------------
The FlashAttention online softmax: ``lax.scan`` over blocks of ``block_kv`` keys,
carrying per query row the running maximum ``m``, normaliser ``l`` and output
accumulator; memory is ``O(Sq·block_kv)`` per (batch, head), never ``Sq×Skv``.
With a window, the keys before the first query's window (decoding against a cache longer
than ``Sq + left``) are sliced off before the primitive binds, all but those that keep
the rest a multiple of 128 keys: no implementation reads them, and their gradients are
zeros.
``mask`` and ``bias`` are read one kv block at a time from the arrays the user passed
(a gather of the block's columns: no padded or broadcast copy of our own); the other
masks are computed per block from positions, lengths and segment ids.
The GQA group of ``Hq/Hkv`` query heads is folded into the query rows of its kv
head, so K/V are read once per kv head. Both matmuls take their operands in the
input dtype (the probabilities are rounded to it before ``P·V``, as FlashAttention
kernels do) and accumulate in f32 for 8-/16-bit inputs; f32 products follow
``jax_default_matmul_precision`` as ``jnp.dot`` does (TF32 on GPUs by default;
``"highest"`` for full f32). The softmax statistics and the accumulator are f32 (f64
for f64 inputs). A last, partial kv block is zero-padded and masked. Each block's
normaliser ``Σ_j p_j`` (``p = exp(s − m) ≤ 1``) is summed in fixed point
(:func:`~tessera_jax.primitives.reductions.fixed_point_sum`: exact integer sums, the same
bits in any order, one fused reduction on a GPU), and ``rowsum(dO ∘ O)`` and the JVP's
``rowsum(P∘tS)`` on the canonical tree, so the rows' bits do not depend on how XLA orders
a reduction in a given program.

The backward (FlashAttention-2) recomputes each block's probabilities from the
saved log-sum-exp, ``P = exp(S − lse)``, with ``Δ = rowsum(dO ∘ O) − dlse``::

    dV_j = P_jᵀ·dO      dP = dO·V_jᵀ      dS = P∘(dP − Δ)      dBias_j = dS
    dK_j = scale·dSᵀ·Q  dQ += scale·dS·K_j

in one scan over kv blocks (``dQ`` carried, ``dK_j``/``dV_j`` stacked), again
``O(Sq·block_kv)`` memory. Folding the GQA group into the rows sums ``dK``/``dV``
over the query heads that share a kv head; ``dBias`` is summed over the dimensions
the bias broadcasts along, so it has the bias's shape.

Adjoints
--------
Three primitives, one frozen :class:`~tessera_jax.contracts.attention.AttentionSpec`
parameter each (``contracts/attention.py`` defines the operands):

* ``ts_flash_attention_fwd`` ``(q, k, v, *extras) → (out, lse)``, with a JVP rule:
* ``ts_flash_attention_jvp`` ``(q, k, v, out, lse, *extras, *tangents) → (t_out,
  t_lse)``, linear in the tangents of ``q, k, v, bias``, computed blocked like the
  forward from the saved ``lse`` (``P = exp(S − lse)``, ``tS = scale·(tQ·Kᵀ + Q·tKᵀ) +
  tBias``)::

      t_lse = rowsum(P∘tS)      t_out = Σ_j P_j·(tS_j·V_j + tV_j) − t_lse·out

* its transpose is ``ts_flash_attention_bwd`` ``(q, k, v, out, lse, dout, *extras,
  [dlse]) → (dq, dk, dv, [dbias])``.

So ``jax.jvp``/``jax.jacfwd`` run the blocked JVP (``O(S)`` memory), and ``jax.grad``
(linearize, then transpose) runs the backward primitive and its kernels. The bias is
differentiable, as in jax.nn (``dbias`` is computed only when the bias has a tangent).
Second derivatives are not supported (a NotImplementedError names the operator).
Every primitive has a batching rule (``jax.vmap`` over any dimension of any operand).

Determinism: the reference and the Pallas kernels registered on these primitives add in
a fixed order (no atomics), so outputs and gradients are bitwise identical run to run.
On a mesh the three primitives keep batch and heads sharded and run on local shards;
sharded sequences and head_dim are gathered first (``sharding/rules.py``; under Explicit
axes the public function gathers them, and a GQA group's queries, and their heads where
the kv heads are split otherwise, then gives the output the queries' sharding back, as
jax.nn types it), so the bits are one device's.

Kernels
-------
``flash_attention_fwd_op.add_kernel(Kernel(...))`` with ``fn(spec, q, k, v, *extras,
interpret) -> (out, lse)`` and ``flash_attention_bwd_op`` with ``fn(spec, q, k, v, out,
lse, dout, *extras, interpret) -> (dq, dk, dv)``; ``lse`` is ``(B, Hq, Sq)`` in the
statistics dtype (f32; f64 for f64 inputs). A kernel's ``supports(spec, avals)`` declines
what it cannot run (by ``spec.features``, dtype, head_dim); the reference then runs the
case. Registered today: ``pallas_kernels/attention_decode.py`` (Hopper; the forward and
the backward at decode shapes, 1 to 16 queries, with every option; first, so it takes the
cases it supports) and ``pallas_kernels/attention_mgpu.py`` (Hopper; causal or not, with
query/key lengths, a local window, an ``lse`` cotangent and, at head dims up to 128,
segment ids, a ``mask`` and a ``bias``; bf16 and f16, head_dim 64, 128 and 256 — other
head dims up to 256 zero-padded to the next — forward and backward; in ``auto`` mode from
128 queries and keys, and for decoding against a long cache). The bias's gradient
(``dbias``) runs the reference's backward, from the kernels' saved ``lse``. Other dtypes,
head dims over 256, an explicit ``config``, and shorter sequences run the reference, whose
block size is chosen per shape (:func:`reference_block_kv`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax import _compat
from tessera_jax.contracts.attention import (
    AttentionExtras,
    AttentionSpec,
    FlashAttentionConfig,
    dropped_keys,
)
from tessera_jax.pallas_kernels import attention_decode as _decode
from tessera_jax.pallas_kernels import attention_mgpu as _mgpu
from tessera_jax.primitives._core import (
    Kernel,
    Operator,
    ad,
    as_array,
    batching,
    check_dtype,
    compute_dtype,
    explicit_sharding,
    explicit_spec,
    move_bdim_to_front,
    not_mapped,
    reshard_spec,
    unshard_axes,
    zero_tangent,
)
from tessera_jax.primitives.reductions import fixed_point_sum, pairwise_tree_sum

_NAME = "flash_attention"


# --- the blocked reference ----------------------------------------------------------------


# The reference's keys per block where the config leaves it to the shape: one block's
# scores for one kv head (its G·Sq query rows) hold at most REFERENCE_BLOCK_ELEMENTS (16 MiB
# of f32), in a power-of-two block of at least REFERENCE_MIN_BLOCK keys. Short sequences
# and decoding (a few queries against a long cache) then run as one block — one pair of
# large matmuls instead of a loop of small ones — and long sequences keep O(Sq·block)
# memory. Every step re-reads and re-writes the f32 output accumulator (Sq·D per head), so
# on a GPU wider blocks ran faster, up to about 2048 keys at 4096 rows
# (benchmarks/archive/reference-probe-h200.txt). The block depends on one head's problem
# only, never on the batch or head count, which a mesh divides: the same bits on any mesh.
REFERENCE_BLOCK_ELEMENTS = 1 << 22
REFERENCE_MIN_BLOCK = 128
# On the CPU a kv head of more than REFERENCE_CPU_FEW_ROWS query rows takes blocks of at
# most REFERENCE_BLOCK_ELEMENTS_CPU scores: blocks of 128 to 512 keys ran the forward and
# the gradients faster there than the other platforms' larger blocks, while decoding's few
# rows ran fastest in one large block (benchmarks/archive/reference-cpu-blocks.txt).
REFERENCE_BLOCK_ELEMENTS_CPU = 1 << 17
REFERENCE_CPU_FEW_ROWS = 64


def reference_block_kv(rows: int, seq_kv: int, platform: str | None = None) -> int:
    """Keys per block of the reference for ``rows`` query rows per kv head and ``seq_kv``
    keys (:data:`REFERENCE_BLOCK_ELEMENTS`; on ``platform="cpu"``,
    :data:`REFERENCE_BLOCK_ELEMENTS_CPU` beyond :data:`REFERENCE_CPU_FEW_ROWS` rows)."""
    budget = REFERENCE_BLOCK_ELEMENTS
    if platform == "cpu" and rows > REFERENCE_CPU_FEW_ROWS:
        budget = REFERENCE_BLOCK_ELEMENTS_CPU
    return _block_within(budget, rows, seq_kv)


def _block_within(budget: int, rows: int, seq_kv: int) -> int:
    """The largest power-of-two block (at least :data:`REFERENCE_MIN_BLOCK` keys) whose
    scores for ``rows`` query rows hold at most ``budget`` elements, clipped to ``seq_kv``."""
    block = max(REFERENCE_MIN_BLOCK, budget // max(rows, 1))
    return max(1, min(1 << (block.bit_length() - 1), seq_kv))


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static sizes of one attention call and its kv blocking."""

    batch: int
    seq_q: int
    seq_kv: int
    heads_q: int
    heads_kv: int
    head_dim: int
    block: int

    @classmethod
    def of(cls, q, k, config: FlashAttentionConfig, platform: str | None = None) -> _Geometry:
        b, sq, hq, d = q.shape
        skv, hkv = k.shape[1], k.shape[2]
        if config.block_kv is None:
            block = reference_block_kv(sq * (hq // hkv), skv, platform)
        else:
            block = max(1, min(config.block_kv, skv))
        return cls(b, sq, skv, hq, hkv, d, block)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def rows(self) -> int:
        """Query rows per kv head: the GQA group folded over the sequence."""
        return self.group * self.seq_q

    @property
    def num_blocks(self) -> int:
        return -(-self.seq_kv // self.block)


def _q_rows(g: _Geometry, x: jax.Array) -> jax.Array:
    """``(B, Sq, Hq, D)`` → ``(B, Hkv, G·Sq, D)``.

    Row ``g·Sq + i`` of kv head ``hkv`` is query ``i`` of query head ``hkv·G + g``.
    """
    x = x.reshape(g.batch, g.seq_q, g.heads_kv, g.group, x.shape[-1])
    return x.transpose(0, 2, 3, 1, 4).reshape(g.batch, g.heads_kv, g.rows, x.shape[-1])


def _from_rows(g: _Geometry, x: jax.Array) -> jax.Array:
    """Inverse of :func:`_q_rows`."""
    x = x.reshape(g.batch, g.heads_kv, g.group, g.seq_q, x.shape[-1])
    return x.transpose(0, 3, 1, 2, 4).reshape(g.batch, g.seq_q, g.heads_q, x.shape[-1])


def _stat_rows(g: _Geometry, x: jax.Array) -> jax.Array:
    """A per-query statistic ``(B, Hq, Sq)`` → ``(B, Hkv, G·Sq, 1)`` (the rows' order)."""
    x = x.reshape(g.batch, g.heads_kv, g.group, g.seq_q)
    return x.reshape(g.batch, g.heads_kv, g.rows)[..., None]


def _stat_from_rows(g: _Geometry, x: jax.Array) -> jax.Array:
    """Inverse of :func:`_stat_rows`. (Each reshape splits or merges adjacent dims only:
    on a mesh with Explicit axes jax types no other.)"""
    x = x[..., 0].reshape(g.batch, g.heads_kv, g.group, g.seq_q)
    return x.reshape(g.batch, g.heads_q, g.seq_q)


def _kv_blocks(g: _Geometry, x: jax.Array) -> jax.Array:
    """``(B, Skv, Hkv, D)`` → ``(nb, B, Hkv, block, D)``, zero-padding the last block."""
    pad = g.num_blocks * g.block - g.seq_kv
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    x = x.reshape(g.batch, g.num_blocks, g.block, g.heads_kv, g.head_dim)
    return x.transpose(1, 0, 3, 2, 4)


def _from_blocks(g: _Geometry, x: jax.Array) -> jax.Array:
    """Inverse of :func:`_kv_blocks` (dropping the padding)."""
    x = x.transpose(1, 0, 3, 2, 4)
    x = x.reshape(g.batch, g.num_blocks * g.block, g.heads_kv, g.head_dim)
    return x[:, : g.seq_kv]


def _kv_columns(g: _Geometry, x: jax.Array, j: jax.Array, axis: int) -> jax.Array:
    """Block ``j``'s columns of ``x`` along its kv ``axis`` (unchanged if that dim is 1).

    A gather from the caller's array: keys past ``Skv`` read a filler that the
    padding mask hides.
    """
    if x.shape[axis] == 1:
        return x
    if x.shape[axis] == 0:  # no keys: the scan never runs, but is traced (jnp.take refuses)
        return jnp.zeros((*x.shape[:axis], g.block, *x.shape[axis + 1 :]), x.dtype)
    cols = j * g.block + jnp.arange(g.block, dtype=jnp.int32)
    return jnp.take(x, cols, axis=axis, mode="fill", fill_value=0)


def _fold_rows(g: _Geometry, x: jax.Array) -> jax.Array:
    """A mask/bias block ``(b, h, sq, t)`` (``h`` in {1, Hq}, ``sq`` in {1, Sq}) in the
    reference's row layout: ``(b, Hkv or 1, G·Sq or 1, t)``."""
    b, h, sq, t = x.shape
    if h == 1 and sq == 1:
        return x
    hk, grp = (1, 1) if h == 1 else (g.heads_kv, g.group)
    x = jnp.broadcast_to(x.reshape(b, hk, grp, sq, t), (b, hk, g.group, g.seq_q, t))
    return x.reshape(b, hk, g.rows, t)


def _bias_cotangent(g: _Geometry, ds: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``dS`` of one block ``(B, Hkv, G·Sq, block)`` summed to a bias block of ``shape``
    (``shape[3]`` the block's columns, or 1)."""
    ds = ds.reshape(g.batch, g.heads_kv, g.group, g.seq_q, ds.shape[-1])
    ds = ds.reshape(g.batch, g.heads_q, g.seq_q, ds.shape[-1])
    axes = tuple(a for a in range(4) if shape[a] == 1 and ds.shape[a] != 1)
    return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds


class _Blocks:
    """What one kv block's scores need: the problem's sizes, spec and extra operands."""

    def __init__(self, g: _Geometry, spec: AttentionSpec, extras: AttentionExtras, acc):
        self.g, self.spec, self.ex, self.acc = g, spec, extras, acc
        self.q_pos = (jnp.arange(g.rows, dtype=jnp.int32) % max(g.seq_q, 1)).reshape(
            1, 1, g.rows, 1
        )
        self.q_seg = None
        if extras.q_segment_ids is not None:
            seg = extras.q_segment_ids.reshape(g.batch, 1, 1, g.seq_q)
            seg = jnp.broadcast_to(seg, (g.batch, 1, g.group, g.seq_q))
            self.q_seg = seg.reshape(g.batch, 1, g.rows)[..., None]

    def visible(self, j: jax.Array) -> jax.Array | None:
        """``(b, h, rows, block)``-broadcastable bool: which scores of block ``j`` count
        (None: all)."""
        g, spec, ex = self.g, self.spec, self.ex
        kv_pos = (j * g.block + jnp.arange(g.block, dtype=jnp.int32)).reshape(1, 1, 1, g.block)
        diag = self.q_pos + (g.seq_kv - g.seq_q)  # the query's position among the keys
        conds = []
        if g.num_blocks * g.block != g.seq_kv:
            conds.append(kv_pos < g.seq_kv)
        if spec.causal:
            conds.append(kv_pos <= diag)
        if spec.local_window_size is not None:
            left, right = spec.local_window_size
            conds += [kv_pos >= diag - left, kv_pos <= diag + right]
        if ex.kv_lengths is not None:
            conds.append(kv_pos < ex.kv_lengths.reshape(g.batch, 1, 1, 1))
        if ex.q_lengths is not None:
            conds.append(self.q_pos < ex.q_lengths.reshape(g.batch, 1, 1, 1))
        if self.q_seg is not None:
            kv_seg = _kv_columns(g, ex.kv_segment_ids, j, axis=1)
            conds.append(self.q_seg == kv_seg.reshape(g.batch, 1, 1, g.block))
        if ex.mask is not None:
            conds.append(_fold_rows(g, _kv_columns(g, ex.mask, j, axis=3)))
        if not conds:
            return None
        out = conds[0]
        for c in conds[1:]:
            out = out & c
        return out

    def bias(self, bias: jax.Array, j: jax.Array) -> jax.Array:
        """Block ``j`` of a bias (or of its tangent) in the row layout, in ``acc``."""
        return _fold_rows(self.g, _kv_columns(self.g, bias, j, axis=3)).astype(self.acc)

    def scores(self, q_rows: jax.Array, k_blk: jax.Array, j: jax.Array):
        """Scaled, biased scores of block ``j``, ``(B, Hkv, G·Sq, block)``, and which of them
        count (:meth:`visible`)."""
        s = _dot(q_rows, k_blk, 3, self.acc) * self.spec.scale
        if self.ex.bias is not None:
            s = s + self.bias(self.ex.bias, j)
        return s, self.visible(j)


# The masks select before a maximum and after an exponential (on the CPU before it, after
# the subtraction: :func:`_exp_visible`), never between the scale's multiply and the
# subtraction that follows it: LLVM contracts a multiply into the add it feeds when nothing
# stands between them, and a select whose condition is a compile-time constant in one
# program (a loop of one trip, inlined) folds away in that program only. So every program
# contracts alike, with no rounding pass of its own over the scores.


def _hidden(s: jax.Array, vis: jax.Array | None) -> jax.Array:
    """``s`` with the scores that do not count at ``-inf`` (for a maximum)."""
    return s if vis is None else jnp.where(vis, s, -jnp.inf)


def _exp_then_mask(x: jax.Array, vis: jax.Array) -> jax.Array:
    e = jnp.exp(x)
    return jnp.where(vis, e, jnp.zeros_like(e))


def _mask_then_exp(x: jax.Array, vis: jax.Array) -> jax.Array:
    return jnp.exp(_hidden(x, vis))


def _exp_visible(x: jax.Array, vis: jax.Array | None) -> jax.Array:
    """``exp(x)`` where the scores count, 0 elsewhere. On the CPU the exponential of
    ``-inf`` where they do not (the same values, a hidden NaN or ``inf`` included): XLA's
    CPU backend fuses that into one pass, where it wrote the exponentials out before
    masking them (benchmarks/archive/reference-cpu-probe.txt). Elsewhere the mask follows
    the exponential: the form the GPU records were measured with."""
    if vis is None:
        return jnp.exp(x)
    return jax.lax.platform_dependent(x, vis, cpu=_mask_then_exp, default=_exp_then_mask)


def _dot(a: jax.Array, b: jax.Array, contract: int, acc) -> jax.Array:
    """``a``'s last dim contracted with ``b``'s dim ``contract``, batched over (B, Hkv)."""
    dims = (((3,), (contract,)), ((0, 1), (0, 1)))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=acc)


def _row_sum(x: jax.Array) -> jax.Array:
    """``x`` summed over its last axis (kept) on the canonical tree: XLA's own reduction
    leaves the order to LLVM's vectoriser, which picks it from the whole fused loop, so
    the same rows could round differently in different programs."""
    return pairwise_tree_sum(x, axis=-1)[..., None]


def _safe_lse_rows(g: _Geometry, lse: jax.Array) -> jax.Array:
    """``lse`` in rows; fully masked rows (``-inf``) as 0, so that ``exp(S − lse) = 0``."""
    rows = _stat_rows(g, lse)
    return jnp.where(rows == -jnp.inf, jnp.zeros_like(rows), rows)


def _scan_blocks(step, init, xs):
    """``lax.scan(step, init, xs)`` over the kv blocks; one block is one call of ``step``:
    no loop of one trip for XLA to inline (jaxlib 0.10's inliner, carrying a deep caller's
    stack-frame metadata into such a loop's body, was seen not to finish)."""
    if jax.tree.leaves(xs)[0].shape[0] != 1:
        return jax.lax.scan(step, init, xs)
    carry, ys = step(init, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], ys)


def _blocked_per_platform(reference):
    """``reference(q, k, …, spec, platform)`` as a reference of ``(q, k, …, spec)`` whose
    default kv block is the one of the platform it is lowered for
    (:func:`reference_block_kv`)."""

    @functools.wraps(reference)
    def run(q, k, *rest, spec: AttentionSpec):
        cpu = functools.partial(reference, spec=spec, platform="cpu")
        default = functools.partial(reference, spec=spec)
        if _Geometry.of(q, k, spec.config, "cpu") == _Geometry.of(q, k, spec.config):
            return default(q, k, *rest)
        return jax.lax.platform_dependent(q, k, *rest, cpu=cpu, default=default)

    return run


@_blocked_per_platform
def _flash_fwd_reference(q, k, v, *extras, spec: AttentionSpec, platform: str | None = None):
    """Blocked online-softmax forward: ``(out, lse)``, ``lse`` of shape ``(B, Hq, Sq)``."""
    g = _Geometry.of(q, k, spec.config, platform)
    acc = compute_dtype(q.dtype)
    blocks = _Blocks(g, spec, spec.split(extras), acc)
    q_rows = _q_rows(g, q)

    def step(carry, xs):
        m, l, o = carry
        j, k_blk, v_blk = xs
        s, vis = blocks.scores(q_rows, k_blk, j)
        m_new = jnp.maximum(m, jnp.max(_hidden(s, vis), axis=-1, keepdims=True))
        # A row with nothing visible yet keeps m = -inf; subtract 0 there so that
        # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
        m_safe = jnp.where(m_new == -jnp.inf, jnp.zeros_like(m_new), m_new)
        p = _exp_visible(s - m_safe, vis)  # at most 1 (a rounding above it where contracted)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + fixed_point_sum(p)
        o = alpha * o + _dot(p.astype(v.dtype), v_blk, 2, acc)
        return (m_new, l, o), None

    # *_like the query rows: on a mesh with Explicit axes the carry then has their sharding.
    stat = jnp.zeros_like(q_rows[..., :1], dtype=acc)
    init = (stat - jnp.inf, stat, jnp.zeros_like(q_rows, dtype=acc))
    xs = (jnp.arange(g.num_blocks, dtype=jnp.int32), _kv_blocks(g, k), _kv_blocks(g, v))
    (m, l, o), _ = _scan_blocks(step, init, xs)
    empty = l == 0  # fully masked rows
    out = o / jnp.where(empty, jnp.ones_like(l), l)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, jnp.ones_like(l), l)))
    lse = _stat_from_rows(g, lse)
    return _from_rows(g, out).astype(q.dtype), lse


@_blocked_per_platform
def _flash_bwd_reference(
    q, k, v, out, lse, dout, *rest, spec: AttentionSpec, platform: str | None = None
):
    """FlashAttention-2 backward by blocked recompute from ``lse``: ``(dq, dk, dv[, dbias])``."""
    g = _Geometry.of(q, k, spec.config, platform)
    acc = compute_dtype(q.dtype)
    extras = spec.split(rest[: spec.num_extras])
    blocks = _Blocks(g, spec, extras, acc)
    q_rows, do_rows = _q_rows(g, q), _q_rows(g, dout)
    delta = _row_sum(_q_rows(g, out).astype(acc) * do_rows.astype(acc))  # (B, Hkv, G·Sq, 1)
    if spec.has_dlse:  # d lse / dS = P: the lse cotangent enters as −Δ does
        delta = delta - _stat_rows(g, rest[spec.num_extras]).astype(acc)
    lse_rows = _safe_lse_rows(g, lse)
    bias = extras.bias
    bias_sum = spec.bias_grad and bias.shape[3] == 1  # dbias summed over blocks, or stacked

    def step(carry, xs):
        dq, dbias = carry
        j, k_blk, v_blk = xs
        s, vis = blocks.scores(q_rows, k_blk, j)
        p = _exp_visible(s - lse_rows, vis)
        dv_blk = _dot(jnp.swapaxes(p.astype(dout.dtype), 2, 3), do_rows, 2, acc)
        dp = _dot(do_rows, v_blk, 3, acc)
        ds_acc = p * (dp - delta)
        ds = ds_acc.astype(q.dtype)
        dk_blk = _dot(jnp.swapaxes(ds, 2, 3), q_rows, 2, acc) * spec.scale
        dq = dq + _dot(ds, k_blk, 2, acc) * spec.scale
        ys = (dk_blk.astype(k.dtype), dv_blk.astype(v.dtype))
        if spec.bias_grad:
            db = _bias_cotangent(g, ds_acc, bias.shape)
            if bias_sum:
                dbias = dbias + db
            else:
                ys = (*ys, db)
        return (dq, dbias), ys

    xs = (jnp.arange(g.num_blocks, dtype=jnp.int32), _kv_blocks(g, k), _kv_blocks(g, v))
    dq0 = jnp.zeros_like(q_rows, dtype=acc)
    dbias0 = jnp.zeros(bias.shape, acc) if bias_sum else None
    (dq, dbias), ys = _scan_blocks(step, (dq0, dbias0), xs)
    grads = (_from_rows(g, dq).astype(q.dtype), _from_blocks(g, ys[0]), _from_blocks(g, ys[1]))
    if not spec.bias_grad:
        return grads
    if not bias_sum:  # (nb, b, h, sq, block) → (b, h, sq, Skv)
        db = jnp.moveaxis(ys[2], 0, 3)
        dbias = db.reshape(*db.shape[:3], g.num_blocks * g.block)[..., : g.seq_kv]
    return (*grads, dbias.astype(bias.dtype))


@_blocked_per_platform
def _flash_jvp_reference(
    q, k, v, out, lse, *rest, spec: AttentionSpec, platform: str | None = None
):
    """Blocked forward-mode derivative from the saved ``lse``: ``(t_out, t_lse)``."""
    g = _Geometry.of(q, k, spec.config, platform)
    acc = compute_dtype(q.dtype)
    extras = spec.split(rest[: spec.num_extras])
    tan = dict(zip(spec.tangents, rest[spec.num_extras :]))
    blocks = _Blocks(g, spec, extras, acc)
    q_rows = _q_rows(g, q)
    tq_rows = _q_rows(g, tan["q"]) if "q" in tan else None
    lse_rows = _safe_lse_rows(g, lse)
    zero_kv = jnp.zeros((g.num_blocks,), jnp.int32)  # a placeholder for an absent tangent
    tk_blocks = _kv_blocks(g, tan["k"]) if "k" in tan else zero_kv
    tv_blocks = _kv_blocks(g, tan["v"]) if "v" in tan else zero_kv

    def step(carry, xs):
        a, tl = carry
        j, k_blk, v_blk, tk_blk, tv_blk = xs
        s, vis = blocks.scores(q_rows, k_blk, j)
        p = _exp_visible(s - lse_rows, vis)
        ts = None  # tS = scale·(tQ·Kᵀ + Q·tKᵀ) + tBias
        if tq_rows is not None:
            ts = _dot(tq_rows, k_blk, 3, acc)
        if "k" in tan:
            t = _dot(q_rows, tk_blk, 3, acc)
            ts = t if ts is None else ts + t
        if ts is not None:
            ts = ts * spec.scale
        if "bias" in tan:
            tb = blocks.bias(tan["bias"], j)
            ts = tb if ts is None else ts + tb
        if ts is not None:
            pts = p * ts
            tl = tl + _row_sum(pts)
            a = a + _dot(pts.astype(v.dtype), v_blk, 2, acc)
        if "v" in tan:
            a = a + _dot(p.astype(v.dtype), tv_blk, 2, acc)
        return (a, tl), None

    xs = (
        jnp.arange(g.num_blocks, dtype=jnp.int32),
        _kv_blocks(g, k),
        _kv_blocks(g, v),
        tk_blocks,
        tv_blocks,
    )
    init = (jnp.zeros_like(q_rows, dtype=acc), jnp.zeros_like(q_rows[..., :1], dtype=acc))
    (a, tl), _ = _scan_blocks(step, init, xs)
    t_out = a - tl * _q_rows(g, out).astype(acc)
    t_lse = _stat_from_rows(g, tl).astype(lse.dtype)
    return _from_rows(g, t_out).astype(q.dtype), t_lse


# --- the primitives -----------------------------------------------------------------------


def _fwd_abstract_eval(q, k, v, *extras, spec):
    b, sq, hq, _ = q.shape
    lse = q.update(shape=(b, hq, sq), dtype=compute_dtype(q.dtype), weak_type=False)
    return q.update(weak_type=False), lse


def _bwd_abstract_eval(q, k, v, out, lse, dout, *rest, spec):
    grads = (q.update(weak_type=False), k.update(weak_type=False), v.update(weak_type=False))
    if spec.bias_grad:
        return (*grads, spec.split(rest[: spec.num_extras]).bias.update(weak_type=False))
    return grads


flash_attention_fwd_op = Operator(
    "flash_attention_fwd",
    reference=_flash_fwd_reference,
    abstract_eval=_fwd_abstract_eval,
    multiple_results=True,
    spec=lambda params: params["spec"],
)
flash_attention_bwd_op = Operator(
    "flash_attention_bwd",
    reference=_flash_bwd_reference,
    abstract_eval=_bwd_abstract_eval,
    multiple_results=True,
    spec=lambda params: params["spec"],
)
flash_attention_jvp_op = Operator(
    "flash_attention_jvp",
    reference=_flash_jvp_reference,
    abstract_eval=lambda q, k, v, out, lse, *rest, spec: (out.update(weak_type=False), lse),
    multiple_results=True,
    spec=lambda params: params["spec"],
)


# --- batching -----------------------------------------------------------------------------

# How an operand's leading dim relates to the batch: "b" is the batch (B); "m" is a
# mask-like dim of size B or 1 (mask, bias and the bias tangent).


def _operand_kinds(spec: AttentionSpec, fixed: int) -> list[str]:
    """The kinds of ``fixed`` batch-led operands followed by the spec's extras."""
    kinds = ["b"] * fixed
    kinds += ["m"] * (spec.has_mask + spec.has_bias)
    kinds += ["b"] * (spec.has_q_lengths + spec.has_kv_lengths + 2 * spec.has_segment_ids)
    return kinds


def _unmapped_shape(x: jax.Array, d: int | None) -> tuple[int, ...]:
    """``x``'s shape without its vmapped dimension."""
    return tuple(s for i, s in enumerate(x.shape) if i != d)


def _fold_batch(args, dims, kinds, materialise=()):
    """vmap: every operand's mapped dim (size N) merged into its batch dim: ``N·B``.

    A mask-like operand of batch 1 that is not mapped stays as it is (it broadcasts);
    otherwise its batch is broadcast to B first. ``materialise`` lists operand indices
    that are broadcast to ``N·B`` whatever they are (a bias whose cotangent is wanted
    per example).
    """
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
    batch = _unmapped_shape(args[0], dims[0])[0]
    out = []
    for i, (a, d, kind) in enumerate(zip(args, dims, kinds)):
        if kind == "m" and d is not_mapped and a.shape[0] == 1 and i not in materialise:
            out.append(a)
            continue
        a = move_bdim_to_front(a, d, size)
        if kind == "m":
            a = jnp.broadcast_to(a, (size, batch, *a.shape[2:]))
        out.append(a.reshape(size * a.shape[1], *a.shape[2:]))
    return size, batch, out


def _unfold(size: int, batch: int, x: jax.Array) -> jax.Array:
    """``(N·B, …)`` → ``(N, B, …)``."""
    return x.reshape(size, batch, *x.shape[1:])


def _fwd_batcher(args, dims, *, spec):
    size, batch, folded = _fold_batch(args, dims, _operand_kinds(spec, 3))
    out, lse = flash_attention_fwd_op.bind(*folded, spec=spec)
    return (_unfold(size, batch, out), _unfold(size, batch, lse)), (0, 0)


def _bwd_batcher(args, dims, *, spec):
    kinds = _operand_kinds(spec, 6) + ["b"] * spec.has_dlse
    bias_at = 6 + spec.has_mask
    materialise = (bias_at,) if spec.bias_grad else ()
    size, batch, folded = _fold_batch(args, dims, kinds, materialise)
    grads = [_unfold(size, batch, t) for t in flash_attention_bwd_op.bind(*folded, spec=spec)]
    if spec.bias_grad and _unmapped_shape(args[bias_at], dims[bias_at])[0] == 1:
        # The bias broadcast over the batch: its cotangent sums over the batch.
        grads[3] = jnp.sum(grads[3], axis=1, keepdims=True)
    return tuple(grads), (0,) * len(grads)


def _jvp_batcher(args, dims, *, spec):
    kinds = _operand_kinds(spec, 5) + ["m" if t == "bias" else "b" for t in spec.tangents]
    size, batch, folded = _fold_batch(args, dims, kinds)
    t_out, t_lse = flash_attention_jvp_op.bind(*folded, spec=spec)
    return (_unfold(size, batch, t_out), _unfold(size, batch, t_lse)), (0, 0)


batching.primitive_batchers[flash_attention_fwd_op.prim] = _fwd_batcher
batching.primitive_batchers[flash_attention_bwd_op.prim] = _bwd_batcher
batching.primitive_batchers[flash_attention_jvp_op.prim] = _jvp_batcher


# --- adjoints: JVP of the forward, transpose of the JVP -----------------------------------


def _is_zero(t: Any) -> bool:
    return type(t) is ad.Zero


def _fwd_jvp(primals, tangents, *, spec: AttentionSpec):
    q, k, v, *extras = primals
    out, lse = flash_attention_fwd_op.bind(*primals, spec=spec)
    named = {"q": tangents[0], "k": tangents[1], "v": tangents[2]}
    if spec.has_bias:
        named["bias"] = tangents[3 + spec.has_mask]
    present = {n: t for n, t in named.items() if not _is_zero(t)}
    if not present:
        return (out, lse), (zero_tangent(out), zero_tangent(lse))
    jspec = spec.replace(tangents=tuple(present))
    ordered = [present[n] for n in jspec.tangents]
    t_out, t_lse = flash_attention_jvp_op.bind(q, k, v, out, lse, *extras, *ordered, spec=jspec)
    return (out, lse), (t_out, t_lse)


def _jvp_transpose(cts, q, k, v, out, lse, *rest, spec: AttentionSpec):
    if any(ad.is_undefined_primal(x) for x in (q, k, v, out, lse, *rest[: spec.num_extras])):
        raise NotImplementedError(_SECOND_ORDER)
    ct_out, ct_lse = cts
    nonlinear = [None] * (5 + spec.num_extras)
    tangent_avals = [t.aval for t in rest[spec.num_extras :]]
    if _is_zero(ct_out) and _is_zero(ct_lse):
        return [*nonlinear, *(ad.Zero(a) for a in tangent_avals)]
    dout = jnp.zeros(out.shape, out.dtype) if _is_zero(ct_out) else ct_out
    dlse = [] if _is_zero(ct_lse) else [ct_lse]
    bspec = spec.replace(tangents=(), bias_grad="bias" in spec.tangents, has_dlse=bool(dlse))
    extras = rest[: spec.num_extras]
    # dK and dV contract the queries: on a mesh with Explicit axes they are gathered first
    # (the forward gathered the keys, _prepare), and dQ gets the queries' sharding back.
    rows = [unshard_axes(x, (1,)) for x in (q, out, dout)]
    stats = [unshard_axes(x, (2,)) for x in (lse, *dlse)]
    grads = flash_attention_bwd_op.bind(
        rows[0], k, v, rows[1], stats[0], rows[2], *extras, *stats[1:], spec=bspec
    )
    q_sharding = explicit_sharding(jax.typeof(q))
    if q_sharding is not None:
        grads = (jax.sharding.reshard(grads[0], q_sharding), *grads[1:])
    by_name = dict(zip(("q", "k", "v", "bias"), grads))
    return [*nonlinear, *(by_name[n] for n in spec.tangents)]


_SECOND_ORDER = (
    f"{_NAME}: second derivatives (jax.hessian, grad of grad, jvp of grad) are not "
    "supported: ts_flash_attention_bwd and ts_flash_attention_jvp have no derivative rules"
)


def _no_second_order(primals, tangents, **params):
    raise NotImplementedError(_SECOND_ORDER)


ad.primitive_jvps[flash_attention_fwd_op.prim] = _fwd_jvp
ad.primitive_transposes[flash_attention_jvp_op.prim] = _jvp_transpose
ad.primitive_jvps[flash_attention_jvp_op.prim] = _no_second_order
ad.primitive_jvps[flash_attention_bwd_op.prim] = _no_second_order


# --- the public function ------------------------------------------------------------------


def _validate_core(q, k, v, causal, scale, config) -> tuple[float, FlashAttentionConfig]:
    for arg, x in (("q", q), ("k", k), ("v", v)):
        check_dtype(_NAME, arg, x, (jnp.floating,))
        if x.ndim != 4:
            raise ValueError(
                f"{_NAME}: {arg}.shape={x.shape} must have rank 4 (batch, seq, heads, head_dim)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{_NAME}: q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype} must be equal"
        )
    if k.shape != v.shape:
        raise ValueError(f"{_NAME}: k.shape={k.shape} must equal v.shape={v.shape}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(
            f"{_NAME}: k.shape[0]={k.shape[0]} (batch) must equal q.shape[0]={q.shape[0]}"
        )
    if k.shape[3] != q.shape[3]:
        raise ValueError(
            f"{_NAME}: k.shape[3]={k.shape[3]} (head_dim) must equal q.shape[3]={q.shape[3]}"
        )
    if q.shape[3] == 0:
        raise ValueError(f"{_NAME}: q.shape={q.shape} has head_dim 0")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"{_NAME}: the query heads q.shape[2]={hq} must be a multiple of the kv heads "
            f"k.shape[2]={hkv}"
        )
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{_NAME}: causal={causal!r} must be a bool")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{_NAME}: scale={scale!r} must be a Python float (a static value, not an array)"
        )
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{_NAME}: scale={scale} must be a positive finite float")
    if config is None:
        config = FlashAttentionConfig.get_default()
    elif not isinstance(config, FlashAttentionConfig):
        raise TypeError(f"{_NAME}: config={config!r} must be a FlashAttentionConfig or None")
    return scale, config


def _scores_shape(q, k) -> tuple[int, int, int, int]:
    return (q.shape[0], q.shape[2], q.shape[1], k.shape[1])


def _validate_logits_operand(arg: str, x: Any, q, k, kinds) -> jax.Array | None:
    """``mask``/``bias`` as a rank-4 array broadcastable to ``(B, Hq, Sq, Skv)``."""
    if x is None:
        return None
    x = as_array(_NAME, arg, x)
    check_dtype(_NAME, arg, x, kinds)
    full = _scores_shape(q, k)
    if x.ndim > 4:
        raise ValueError(
            f"{_NAME}: {arg}.shape={x.shape} must have rank ≤ 4 and broadcast to "
            f"(batch, heads_q, seq_q, seq_kv)={full}"
        )
    shape = (1,) * (4 - x.ndim) + tuple(x.shape)
    if any(s not in (1, f) for s, f in zip(shape, full)):
        raise ValueError(
            f"{_NAME}: {arg}.shape={tuple(x.shape)} does not broadcast to "
            f"(batch, heads_q, seq_q, seq_kv)={full} (jax.nn.dot_product_attention's "
            "(B, N, T, S) layout: heads before sequence)"
        )
    return x.reshape(shape)


def _validate_lengths(arg: str, x: Any, batch: int, seq: int, seq_arg: str) -> jax.Array | None:
    if x is None:
        return None
    x = as_array(_NAME, arg, x)
    check_dtype(_NAME, arg, x, (jnp.integer,))
    if x.shape != (batch,):
        raise ValueError(f"{_NAME}: {arg}.shape={x.shape} must be (batch,)=({batch},)")
    values = _compat.concrete_value(x)
    if values is not None and values.size and (values.min() < 0 or values.max() > seq):
        raise ValueError(
            f"{_NAME}: {arg} has values in [{values.min()}, {values.max()}], outside "
            f"[0, {seq_arg}={seq}]"
        )
    return x.astype(jnp.int32)


def _validate_window(w: Any, seq_q: int, seq_kv: int) -> tuple[int, int] | None:
    """``(left, right)``, each side clipped to where it stops hiding keys (``seq_kv`` on the
    left, ``seq_q`` on the right: a wider side sees every key, and the clipped sizes stay
    in int32 whatever the caller passed); None where neither side hides a key."""
    if w is None:
        return None
    pair = (w, w) if isinstance(w, (int, np.integer)) and not isinstance(w, bool) else w
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or any(not isinstance(s, (int, np.integer)) or isinstance(s, bool) for s in pair)
    ):
        raise TypeError(
            f"{_NAME}: local_window_size={w!r} must be None, an int or a (left, right) "
            "tuple of ints"
        )
    if pair[0] < 0 or pair[1] < 0:
        raise ValueError(f"{_NAME}: local_window_size={w!r} must not be negative")
    left, right = min(int(pair[0]), seq_kv), min(int(pair[1]), seq_q)
    return None if (left, right) == (seq_kv, seq_q) else (left, right)


def _validate_segments(q_seg, kv_seg, q, k) -> tuple[jax.Array | None, jax.Array | None]:
    if (q_seg is None) != (kv_seg is None):
        given = "q_segment_ids" if kv_seg is None else "kv_segment_ids"
        raise ValueError(f"{_NAME}: {given} was given without the other: pass both or neither")
    if q_seg is None:
        return None, None
    out = []
    for arg, x, seq, name in (
        ("q_segment_ids", q_seg, q.shape[1], "seq_q"),
        ("kv_segment_ids", kv_seg, k.shape[1], "seq_kv"),
    ):
        x = as_array(_NAME, arg, x)
        check_dtype(_NAME, arg, x, (jnp.integer,))
        if x.shape != (q.shape[0], seq):
            raise ValueError(
                f"{_NAME}: {arg}.shape={x.shape} must be (batch, {name})=({q.shape[0]}, {seq})"
            )
        out.append(x.astype(jnp.int32))
    return out[0], out[1]


def _prepare(
    q, k, v, causal, scale, config, mask, bias, q_lengths, kv_lengths, window, q_seg, kv_seg
):
    """Validated operands and the spec of one call (errors name the argument and shapes)."""
    q, k, v = (as_array(_NAME, n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    scale, config = _validate_core(q, k, v, causal, scale, config)
    # The products contract the keys and head_dim: on a mesh with Explicit axes they are
    # gathered first, as the sharding rule gathers them (sharding/rules.py); so are the
    # queries of a GQA group, which the reference folds into one axis of rows, and their
    # heads where the kv heads are not split alike (a group's dK and dV sum over them).
    rows = () if q.shape[2] == k.shape[2] else (1,)
    if rows and _head_spec(q) != _head_spec(k):
        rows = (1, 2)
    q = unshard_axes(q, (*rows, 3))
    k, v = unshard_axes(k, (1, 3)), unshard_axes(v, (1, 3))
    b = q.shape[0]
    q_seg, kv_seg = _validate_segments(q_seg, kv_seg, q, k)
    extras = AttentionExtras(
        mask=_validate_logits_operand("mask", mask, q, k, (jnp.bool_,)),
        bias=_validate_logits_operand("bias", bias, q, k, (jnp.floating,)),
        q_lengths=_validate_lengths("query_seq_lengths", q_lengths, b, q.shape[1], "seq_q"),
        kv_lengths=_validate_lengths("key_value_seq_lengths", kv_lengths, b, k.shape[1], "seq_kv"),
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
    )
    gathered = lambda x, axes: None if x is None else _batch_like(unshard_axes(x, axes), q)
    # The masks' (B, H, Sq, Skv) axes gathered as q's heads (2) and queries (1) are.
    logits_axes = (*((1,) if 2 in rows else ()), *((2,) if 1 in rows else ()), 3)
    extras = extras._replace(
        mask=gathered(extras.mask, logits_axes),
        bias=gathered(extras.bias, logits_axes),
        q_lengths=gathered(extras.q_lengths, ()),
        kv_lengths=gathered(extras.kv_lengths, ()),
        q_segment_ids=gathered(extras.q_segment_ids, (1,) if rows else ()),
        kv_segment_ids=gathered(extras.kv_segment_ids, (1,)),
    )
    window = _validate_window(window, q.shape[1], k.shape[1])
    k, v, extras = _drop_unseen_keys(q, k, v, extras, window)
    spec = AttentionSpec(
        causal=bool(causal),
        scale=scale,
        config=config,
        local_window_size=window,
    ).with_extras(extras)
    return q, k, v, AttentionSpec.operands(extras), spec


def _batch_like(x: jax.Array, q: jax.Array) -> jax.Array:
    """``x`` (a batch-led extra operand) with ``q``'s batch sharding on a mesh with Explicit
    axes, where its batch is ``q``'s: the masks built from it then meet the scores with the
    sharding they have (jax types a select of two shardings as an error)."""
    target = explicit_spec(q)
    if target is None or x.shape[0] != q.shape[0]:
        return x
    own = explicit_spec(x) or (None,) * x.ndim
    return reshard_spec(x, (target[0], *own[1:]), like=q)


def _head_spec(x: jax.Array) -> Any:
    """The mesh axes that split ``x``'s heads (dim 2) on a mesh with Explicit axes."""
    spec = explicit_spec(x)
    return None if spec is None else spec[2]


def _drop_unseen_keys(q, k, v, extras: AttentionExtras, window):
    """``k``, ``v`` and the extras without the keys before the first query's window.

    Query ``i`` sees no key before ``i + Skv − Sq − left``, so with a window and a cache
    longer than ``Sq + left`` (decoding) a prefix of the keys is hidden from every query.
    Dropping it before the primitive spares every implementation the keys' reads and
    their share of the key chunks, and the dispatch sees the keys that count; the slice's
    transpose gives them zero gradients. The prefix is rounded down so that the kept keys
    are a whole number of the backward kernels' key tiles (``attention_mgpu.TILE``, to
    which they pad the keys): the slice, a copy since a kernel reads a buffer of its own,
    is then the only copy of K and V their operands need. The masks are relative to the
    shapes (the window and the causal diagonal follow ``Skv − Sq``, which drops with the
    keys) or to the key lengths, shifted here. It depends on the static shapes and window
    only: the same on any mesh.
    """
    dropped = dropped_keys(window, q.shape[1], k.shape[1], _mgpu.TILE)
    if dropped == 0 or q.shape[1] == 0:
        return k, v, extras
    # (_prepare gathered the keys of every operand on a mesh with Explicit axes.)
    k, v = k[:, dropped:], v[:, dropped:]

    def keys_of(x, axis):
        if x is None or x.shape[axis] == 1:
            return x
        return jax.lax.slice_in_dim(x, dropped, None, axis=axis)

    kv_lengths = extras.kv_lengths
    if kv_lengths is not None:
        kv_lengths = jnp.maximum(kv_lengths - dropped, 0)
    extras = extras._replace(
        mask=keys_of(extras.mask, 3),
        bias=keys_of(extras.bias, 3),
        kv_lengths=kv_lengths,
        kv_segment_ids=keys_of(extras.kv_segment_ids, 1),
    )
    return k, v, extras


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    config: FlashAttentionConfig | None = None,
) -> jax.Array:
    """Multi-head attention ``softmax(q·kᵀ·scale + bias)·v`` without materialising the scores.

    The arguments after ``v`` are ``jax.nn.dot_product_attention``'s, under its names
    (``causal`` is its ``is_causal``); see the module docstring for the exact masks.

    Arguments:
      q: ``(batch, seq_q, heads_q, head_dim)``, a floating dtype.
      k: ``(batch, seq_kv, heads_kv, head_dim)``, ``q``'s dtype; ``heads_kv`` divides
        ``heads_q`` (GQA/MQA: query head ``h`` uses kv head ``h // (heads_q // heads_kv)``).
      v: ``k``'s shape and dtype.
      bias: additive, a floating dtype, broadcastable to ``(batch, heads_q, seq_q,
        seq_kv)`` (heads before sequence, as jax.nn); differentiable. On Hopper the
        forward and backward kernels read a bias in ``q``'s dtype as given (without a
        ``mask``, sequences filling whole tiles); otherwise one pass over it folds,
        converts and pads it first.
      mask: bool, True where a query attends to a key; broadcastable like ``bias``.
      causal: mask keys after the query, aligned bottom-right (query ``i`` sees keys
        ``j ≤ i + seq_kv − seq_q``; the lower triangle when ``seq_q == seq_kv``).
      scale: a positive finite float multiplying the scores; default ``1/sqrt(head_dim)``.
      query_seq_lengths: int ``(batch,)`` in ``[0, seq_q]``: later queries are padding
        (their output is zeros).
      key_value_seq_lengths: int ``(batch,)`` in ``[0, seq_kv]``: later keys are padding.
        (Values are checked where they are known at trace time; under ``jit`` a value
        outside the range acts as if clipped to it.)
      local_window_size: ``(left, right)`` non-negative ints, or an int for both: query
        ``i`` sees keys within ``left`` before and ``right`` after its position
        ``i + seq_kv − seq_q`` (a side of any size: past the sequence it hides nothing).
      q_segment_ids, kv_segment_ids: int ``(batch, seq_q)`` and ``(batch, seq_kv)``, both
        or neither: a query sees only keys with its segment id (packed sequences).
      config: block sizes (:class:`FlashAttentionConfig`); default: chosen per shape (an
        explicit config runs the blocked reference, which honours it).
    Returns:
      ``(batch, seq_q, heads_q, head_dim)`` in ``q``'s dtype. A query that sees no key
      gives zeros.

    Differentiable in forward and reverse mode, first order (``jax.grad``, ``jax.vjp``,
    ``jax.jvp``, ``jax.jacfwd``), with respect to ``q``, ``k``, ``v`` and ``bias``.

    Where it runs (``auto`` mode): on a Hopper GPU, bf16/f16 with head_dim up to 256 (64,
    128 and 256 natively, others zero-padded to the next) and at least 128 queries and keys
    (or decoding, at most 16 queries: the forward against 4096 keys or more, the backward
    against 1024 or more), the Mosaic GPU kernels run the forward and backward, causal or
    not, with ``query_seq_lengths``, ``key_value_seq_lengths``, ``local_window_size`` and,
    at head dims up to 128, segment ids, ``mask`` and ``bias`` (a bias with a row per query
    is rounded to the inputs' 16-bit dtype there, one broadcast over the queries is not).
    Everything else — the gradient of ``bias`` (its backward), other dtypes, head dims over
    256, shorter sequences, an explicit ``config`` — runs the blocked XLA reference.
    Decoding's forward, at head_dim 64 or 128 with at most 64 query rows per kv head (GQA
    group × queries), runs a Triton decode kernel instead of the Mosaic GPU forward,
    against 256 keys or more, with any of the options (its bias stays f32). Every path
    is deterministic: bitwise identical outputs and gradients run to run (no atomics); which
    path runs, and how it blocks the keys, depends on one head's sizes only, never on the
    batch or head count a mesh divides. The kernels' paths hold no XLA reduction, so they
    keep their bits from one compilation to the next (another process, a mesh); the XLA
    reference's GEMMs and fusions do where XLA's autotuning is off
    (``ts.jit(deterministic=True)``). There is no cuDNN path.
    """
    out, _ = flash_attention_fwd(
        q,
        k,
        v,
        bias,
        mask,
        causal=causal,
        scale=scale,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        config=config,
    )
    return out


def flash_attention_fwd(
    q,
    k,
    v,
    bias=None,
    mask=None,
    *,
    causal=False,
    scale=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    config=None,
):
    """The forward primitive itself: ``(out, lse)`` with ``lse`` of shape ``(B, Hq, Sq)``
    (``-inf`` for a query that sees no key); arguments as :func:`flash_attention`."""
    q = as_array(_NAME, "q", q)
    q_spec = explicit_spec(q)
    q, k, v, extras, spec = _prepare(
        q,
        k,
        v,
        causal,
        scale,
        config,
        mask,
        bias,
        query_seq_lengths,
        key_value_seq_lengths,
        local_window_size,
        q_segment_ids,
        kv_segment_ids,
    )
    out, lse = flash_attention_fwd_op.bind(q, k, v, *extras, spec=spec)
    return _sharded_like_queries(out, lse, q_spec)


def _sharded_like_queries(out, lse, q_spec):
    """``out`` and ``lse`` with the queries' batch, sequence and head sharding on a mesh with
    Explicit axes, as jax.nn types its output: ``_prepare`` gathered a GQA group's queries
    (and heads) for the products, and giving them back is a local slice."""
    if q_spec is None:
        return out, lse
    b, s, h = q_spec[:3]
    return reshard_spec(out, (b, s, h, explicit_spec(out)[3])), reshard_spec(lse, (b, h, s))


# --- kernels ------------------------------------------------------------------------------

# Decoding's forward and backward (1 to 16 queries, every option) in Pallas' Triton backend,
# whose products waste fewer padded rows; first, so that they take the shapes they support.
flash_attention_fwd_op.add_kernel(Kernel.from_module("triton_decode", _decode, _decode.flash_fwd))
flash_attention_bwd_op.add_kernel(Kernel.from_module("triton_decode", _decode, _decode.flash_bwd))
# Hopper (Mosaic GPU) forward and deterministic backward, causal or not, with lengths, a
# window, segment ids, a mask and a bias; the bias's gradient runs the reference backward.
flash_attention_fwd_op.add_kernel(Kernel.from_module("mosaic_gpu", _mgpu, _mgpu.flash_fwd))
flash_attention_bwd_op.add_kernel(Kernel.from_module("mosaic_gpu", _mgpu, _mgpu.flash_bwd))
