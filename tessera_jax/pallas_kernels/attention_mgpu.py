"""Hopper (sm_90a) flash attention in Pallas Mosaic GPU: forward and a deterministic backward.

Three kernels, each a CTA of two *compute* warpgroups (64 rows each, ``wgmma`` into f32
accumulators in registers) and one *memory* warpgroup that streams the loop operand with
TMA into a ring of shared-memory slots, released by per-slot "consumed" barriers:

* forward: a CTA owns 128 query rows of one head; its loop streams K/V blocks and runs the
  FlashAttention online softmax in the exp2 domain, then writes ``out`` and the
  log-sum-exp (natural log, what the operator saves for the backward);
* dQ: a CTA owns 128 query rows of one head; its loop streams K/V blocks, recomputes
  ``P = exp2(S − lse)`` and accumulates ``dQ += dS·K``;
* dK/dV: a CTA owns 128 key rows of one kv head; its loop streams the query blocks of every
  query head of the GQA group, in a fixed order, and accumulates ``dV += Pᵀ·dO`` and
  ``dK += dSᵀ·Q`` — the sum over the group happens in the accumulator. At head_dim 256
  two (64, 256) f32 accumulators would not fit a thread's registers, so the CTA owns 64
  key rows and the warpgroups split roles: one computes ``Pᵀ`` and accumulates ``dV``,
  the other computes ``dPᵀ`` beside it, takes ``Pᵀ`` through shared memory and
  accumulates ``dK`` (no product is computed twice).

No atomics anywhere: every output element is written by exactly one warpgroup after a loop
of fixed order, so outputs and all three gradients are bitwise identical run to run. (The
dK/dV kernel can compute dQ too, :attr:`Problem.dkv_dq`, off by default: there each key
tile adds its dQ partial to an f32 accumulator with TMA's reduce-add, the tiles of a query
block taking turns in key order on a global semaphore, so the sum's order is fixed too.)
Decoding (a head's queries fit one tile) against a long cache, the forward and dQ kernels
split the keys into chunks (:func:`default_split_keys`), a CTA each,
that write partial results as pairs of 16-bit terms; XLA combines them in f32 in key order
(:func:`_combine_chunks`, :func:`_sum_chunks`). A warpgroup whose rows are all padding
computes nothing, and the dK/dV kernel streams no query block of padding only. Decoding
with GQA, the wrappers fold the group's queries into one tile's rows (:func:`_fold`).
Decoding (at most 64 query rows), the dQ kernel computes dK and dV too
(:attr:`Problem.dq_dkv`, on by default where :func:`_dq_dkv_reason` allows): its second
warpgroup, whose rows are padding, takes each key block's P and dS from the first through
shared memory; the dK/dV kernel does not run, and the cache is read once, not twice.
``Δ = rowsum(dO∘O)`` is precomputed by a row kernel (:func:`row_delta`), not XLA's
reduction, whose order XLA's GPU autotuner picks by timing; the forward's chunk
combination and dQ's chunk sums are elementwise, in key order.

Masking: the kernels' masks are computed from indices — causal (bottom-right aligned, as
the operator defines it), a local window ``(left, right)`` around the same diagonal, and
per-sequence key lengths read from an int32 ``(B,)`` operand — and from segment ids,
which stream beside the blocks they label (then every block is masked). Each
warpgroup's loop runs up to five ranges: blocks before its band that it skips, masked
blocks on the band's left edge, blocks that need no mask, masked blocks on the right edge
(the diagonal, the last key) and blocks past them that it skips (skipped blocks inside the
CTA's range still stream for the other warpgroup, so both keep the same barrier phases;
the CTA streams only its own range). Query lengths need no loop of their own: padded
queries are zeroed after the forward with ``lse = -inf``, which zeroes their gradients.
Sequences are zero-padded to whole tiles (128 rows, or the key block where it is longer);
the forward masks the padded keys of the last block, the backward gives padded and fully
masked query rows ``lse = +inf`` so their probabilities are exactly 0 (the dQ pass masks
padded keys too; they reach only padded dK/dV rows, which are cut off, as are the dK/dV
rows past a key length).

A ``mask`` and a ``bias`` are folded by XLA into one additive array, ``-inf`` where masked
(batch and heads stay 1 where both broadcast: the TMA loads index 0 there; a bias alone
in the inputs' dtype is passed as it is, not copied), streamed
into a ring beside the block it belongs to (the forward's beside V, the dQ kernel's beside
K, the dK/dV kernel's beside Q and dO); every block is then masked. A
row the mask empties is a fully masked row: zeros, ``lse = -inf``, zero gradients, as the
reference's. Two forms:

* one query row (jax.nn's key-padding mask ``(B, 1, 1, Skv)``, decoding): an f32 vector of
  the block's keys, broadcast over the queries in registers; a few hundred bytes, so the
  kernels keep their block sizes;
* a row per query: a 16-bit ``(64, block)`` tile per warpgroup, the bias rounded to the
  inputs' dtype (once: a bias in that dtype arrives exact; the kernels scale it to the exp2
  domain in f32); the dK/dV kernel, which works on Sᵀ, streams the same tiles of the
  caller's array and reads each transposed from shared memory (no transposed copy). The
  tiles take shared memory: the forward and dQ kernels take shorter kv blocks where their
  rings would otherwise lose slots.

At head_dim 256 the kernels decline both (the rings beside the 256-wide tiles do not fit).
The bias's gradient is not computed here (the reference's backward runs it).

In the Mosaic GPU interpreter (``interpret=True``) ``wgmma`` reads its A operand only from
shared memory, so the probabilities (and ``dS``) are staged through a shared-memory slot
there instead of being fed from registers; everything else is the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig, first_seen_key
from tessera_jax.pallas_kernels import device, norms_gpu
from tessera_jax.primitives.reductions import rounded

__all__ = ["Problem", "flash_bwd", "flash_fwd", "hardware", "prefer", "supports"]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
WG_ROWS = 64  # rows of one warpgroup's wgmma tile
NUM_COMPUTE_WGS = 2
TILE = NUM_COMPUTE_WGS * WG_ROWS  # rows a CTA owns; sequences are padded to multiples of it
# Registers per thread of a compute warpgroup (setmaxnreg, :attr:`Problem.wg_regs`).
# Three warpgroups launch with 168 each: 504 per 128 threads, of which the memory
# warpgroup keeps what the two compute warpgroups leave (24 at least). With masked steps
# (causal, a window, a bias, segment ids) the D=128 dK/dV kernel spills more at 232
# (ptxas) than at 240, and its causal backward with a bias runs faster at 240. Without
# masked steps 232 measured as fast or faster (``benchmarks/archive/compute-regs-h200.txt``).
REG_POOL = 504
COMPUTE_REGS = {False: 232, True: 240}  # by whether the kernel has masked steps
DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
HEAD_DIMS = (64, 128, 256)
# From this head_dim on the dK/dV kernel's warpgroups split roles: two f32 (64, D)
# accumulators cost D registers per thread, and at D=256 that is more than a thread's 255.
# There the CTA owns 64 key rows; warpgroup 0 computes Pᵀ and accumulates dV, warpgroup 1
# computes dPᵀ, takes Pᵀ through shared memory and accumulates dK, so that no product is
# computed twice.
DKV_ROLES_HEAD_DIM = 256
# The dK/dV kernel's Q/dO ring slots, by head_dim: a slot holds 64 query rows of Q and dO
# (64 KiB at D=256, where only two fit beside K and V). ``benchmarks/attention.py
# --sweep-bwd`` measures the other choices against these defaults.
DKV_STAGES = {64: 3, 128: 3, 256: 2}
DKV_STAGES_CHOICES = (2, 3, 4)
# The dK/dV kernel's step schedule, by head_dim: *paired* issues Sᵀ with dPᵀ and dV with dK
# (two waits for the tensor cores per step instead of four). It needs a third ring slot to
# pay: with two, the paired schedule measured slower than the serial one on causal loops
# (whose warpgroups run a step apart and hold their slots through longer bursts); with
# three, as fast or faster. (The role-split kernel of D=256 has a schedule of its own.)
DKV_PAIRED = {64: True, 128: True}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call as the kernels see it (sequences padded to whole tiles).

    Attributes:
      batch, heads_q, heads_kv, head_dim: the operand sizes.
      seq_q, seq_kv: the true sequence lengths (masks use them).
      dtype: the 16-bit input dtype.
      causal: bottom-right aligned causal mask.
      scale: the score scale.
      block_kv: keys per loop step of the forward and dQ kernels.
      stages: shared-memory ring slots of the streamed operand (K in the dQ kernel).
      dkv_stages: the dK/dV kernel's Q/dO ring slots (backward only).
      fwd_pipelined: the forward's steps overlap within a warpgroup (:func:`_fwd_pipelined`):
        step j issues ``S_j = Q·K_jᵀ`` and ``O += P_{j−1}·V_{j−1}`` together and runs the
        softmax of ``S_j`` while the second product is on the tensor cores.
      fwd_pingpong: the forward's two compute warpgroups take turns on the tensor cores
        (FA3's ping-pong: one's softmax runs while the other's products do). Always so
        with the serial loop; the pipelined loop may instead run both freely
        (:data:`FWD_PINGPONG`).
      fwd_ctas: the forward's persistent grid (:func:`_fwd_ctas`): this many CTAs,
        each running the query tiles (:attr:`fwd_work` items) of the grid it replaces one
        after the other, so that its memory warpgroup streams the next tile's first K/V
        blocks while the compute warpgroups finish the last; None: one CTA per tile.
      dkv_paired: the dK/dV kernel's paired schedule (:data:`DKV_PAIRED`; False where the
        warpgroups split roles).
      dq_v_stages: the dQ kernel's V ring slots where fewer than its K slots fit (V is
        released early in a step, K only at its end); None: as many as K.
      kv_split: kv blocks per CTA of the forward or dQ kernel: the keys are split into
        chunks of this many blocks, one CTA per query tile and chunk, each writing its
        partial result (:func:`flash_fwd` and :func:`flash_bwd` combine them in a fixed
        order); None: one CTA per query tile loops over all keys.
      window: ``(left, right)``: query ``i`` sees keys ``i + offset − left`` to
        ``i + offset + right`` (the operator's ``local_window_size``); None: no window.
      kv_lengths: the forward and dQ kernels read each batch entry's key count from an
        int32 ``(2, B)`` operand's first row (keys from it on are masked, their blocks
        skipped); False: all ``seq_kv`` keys (the row is then not read).
      q_lengths: every kernel reads each batch entry's query count from that operand's
        second row and skips the blocks of queries from it on (the rows of a block that
        reaches the count still run, with zero probabilities: the wrappers zero padded
        queries' outputs and gradients); False: not read.
      segments: queries see only keys of their segment id: every kernel streams the ids
        of the keys (or queries) it loops over beside them, and masks every block.
      bias: a ``mask`` and/or ``bias`` folded into one additive array (``-inf`` where
        masked, :func:`_bias_operand`): every kernel streams the
        part of it for the block it works on beside the block, and masks every block.
        ``"tiles"``: a 16-bit tile per block; ``"rows"``: the array has one query row (a
        key-padding mask), an f32 vector of the block's keys is streamed and broadcast
        over the queries. None: no mask or bias.
      bias_batch, bias_heads: the bias operand has a batch (a head) dimension of its own;
        False: of size 1, read at index 0 for every batch entry (head).
      dkv_tiles: key tiles (of :attr:`dkv_rows` keys) a dK/dV CTA runs one after the other
        (:func:`_dkv_tiles`); each tile's gradients are summed over the same queries in the
        same order whatever the count, so it changes no bit.
      dq_dkv: the dQ kernel computes dK and dV too, and the dK/dV kernel does not run
        (:func:`_dq_dkv_reason`: decoding, one query head per kv head or the group folded
        into the rows; its second warpgroup, whose query rows are padding, turns each key
        block's P and dS into the block's dV and dK). ``flash_bwd``'s default wherever it
        fits.
      dkv_dq: the dK/dV kernel computes dQ too, and the dQ kernel does not run
        (:data:`DKV_DQ`): each key tile adds its dQ partials to an f32 accumulator in
        global memory in key-tile order, tile ``t`` after tile ``t − 1`` (a semaphore per
        query block hands the turn on; :func:`_dq_turns`), so the sum has a fixed order.
      compute_regs: registers per thread of each compute warpgroup, a tuning override;
        None: :data:`COMPUTE_REGS` by :attr:`has_masked_steps` (:attr:`wg_regs`). It
        changes no bit.
    """

    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seq_q: int
    seq_kv: int
    dtype: np.dtype
    causal: bool
    scale: float
    block_kv: int
    stages: int
    dkv_stages: int = 2
    dq_v_stages: int | None = None
    kv_split: int | None = None
    dkv_paired: bool = False
    fwd_pipelined: bool = False
    fwd_pingpong: bool = True
    fwd_ctas: int | None = None
    window: tuple[int, int] | None = None
    kv_lengths: bool = False
    q_lengths: bool = False
    segments: bool = False
    bias: str | None = None
    bias_batch: bool = False
    bias_heads: bool = False
    dkv_tiles: int = 1
    dq_dkv: bool = False
    dkv_dq: bool = False
    compute_regs: int | None = None

    @property
    def wg_regs(self) -> tuple[int, int]:
        """Registers per thread of a compute warpgroup (:attr:`compute_regs`) and of the
        memory warpgroup (what the compute warpgroups leave)."""
        regs = self.compute_regs
        regs = COMPUTE_REGS[self.has_masked_steps] if regs is None else regs
        return regs, REG_POOL - NUM_COMPUTE_WGS * regs

    @property
    def has_masked_steps(self) -> bool:
        """Whether some loop steps mask scores by position or value (not only the last
        block's padded keys): causal, a window, segment ids or a bias."""
        return self.right is not None or self.left is not None or self.every_block_masked

    @property
    def every_block_masked(self) -> bool:
        """Whether values per key (segment ids, a bias) may hide any score of any block:
        no block is visible whole."""
        return self.segments or self.bias is not None

    @property
    def left(self) -> int | None:
        """How far before its diagonal a query sees keys; None: from the first key."""
        return None if self.window is None else self.window[0]

    @property
    def right(self) -> int | None:
        """How far after its diagonal a query sees keys (0 when causal); None: to the last."""
        bounds = ([0] if self.causal else []) + ([] if self.window is None else [self.window[1]])
        return min(bounds) if bounds else None

    @property
    def v_stages(self) -> int:
        return self.stages if self.dq_v_stages is None else self.dq_v_stages

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def kv_chunks(self) -> int:
        """Key chunks (:attr:`kv_split`); 1: none."""
        if self.kv_split is None:
            return 1
        return -(-self.seq_kv_pad // (self.block_kv * self.kv_split))

    @property
    def q_items(self) -> int:
        """The forward's work items per head and batch entry: query tiles times key
        chunks (its grid's ``q_seq`` axis, :func:`_tile_and_chunk`)."""
        return self.seq_q_pad // TILE * self.kv_chunks

    @property
    def fwd_work(self) -> int:
        """The forward's CTAs without :attr:`fwd_ctas`: (head, query tile, key chunk, batch
        entry) items."""
        return self.heads_q * self.q_items * self.batch

    @property
    def fwd_q_slots(self) -> int:
        """Pairs of Q tiles the forward holds: with :attr:`fwd_ctas`, 2 where a second
        pair fits shared memory beside the K/V ring (the next item's Q loads while one
        runs, :func:`_fwd_q_slots`); else 1."""
        if self.fwd_ctas is None:
            return 1
        return _fwd_q_slots(self.head_dim, self.block_kv, self.stages, self.bias)

    @property
    def part_rows(self) -> int:
        """Query rows of a warpgroup that a key chunk's partial result keeps: decoding's
        few queries (at most one warpgroup's) rounded up to a tile of 8 rows, else all 64.
        (Every chunk writes its partials and XLA reads them back: a 64-row tile of one
        query would move 8 times the bytes.)"""
        return -(-self.seq_q // 8) * 8 if self.seq_q <= WG_ROWS else WG_ROWS

    @property
    def part_seq(self) -> int:
        """Query rows of the chunks' partial outputs (:attr:`part_rows`)."""
        return self.part_rows if self.seq_q <= WG_ROWS else self.seq_q_pad

    @property
    def seq_q_pad(self) -> int:
        return -(-self.seq_q // TILE) * TILE

    @property
    def seq_kv_pad(self) -> int:
        unit = math.lcm(TILE, self.block_kv)  # whole CTA tiles (dK/dV) and kv blocks
        return -(-self.seq_kv // unit) * unit

    @property
    def offset(self) -> int:
        """Causal alignment: query ``i`` sees keys ``j <= i + offset``."""
        return self.seq_kv - self.seq_q

    @property
    def dkv_roles(self) -> bool:
        """Whether the dK/dV kernel's warpgroups split roles (:data:`DKV_ROLES_HEAD_DIM`)."""
        return _dkv_roles(self.head_dim)

    @property
    def dkv_rows(self) -> int:
        """Key rows of a dK/dV CTA: 64 per warpgroup, or 64 shared when roles split."""
        return _dkv_rows(self.head_dim)

    @property
    def kv_tiles(self) -> int:
        """Key tiles of the dK/dV kernel (:attr:`dkv_rows` keys each)."""
        return self.seq_kv_pad // self.dkv_rows

    @property
    def c(self) -> float:
        """Scores to the exp2 domain: ``s · scale · log2(e)``."""
        return self.scale * LOG2E


# Decoding (a head's queries fit one tile), the forward and dQ kernels would run one CTA
# per (batch, head) through every key: one CTA streams keys at a small fraction of the
# memory bandwidth, so at a small batch times heads the GPU idles. There the keys are split
# into about SPLIT_CHUNKS chunks of SPLIT_KEYS_MIN to SPLIT_KEYS_MAX keys (a power of two),
# a CTA per chunk, and the chunks' partial results are combined in a fixed order. Each
# chunk adds a partial's write and read and the combination, which a large batch times
# heads (enough CTAs without chunks) pays for nothing: the bounds trade the two
# (``benchmarks/attention.py --sweep-decode``, the ``sweep-decode-…`` records). The
# chunks depend on the sequence lengths only, not on batch or heads, so that a sharded
# batch or head axis gets the same bits.
SPLIT_CHUNKS = 8
SPLIT_KEYS_MIN = 1024
SPLIT_KEYS_MAX = 4096


def default_split_keys(seq_kv: int) -> int:
    """Keys per chunk of a decode shape with ``seq_kv`` keys (:data:`SPLIT_CHUNKS`)."""
    keys = 1 << max(0, math.ceil(math.log2(max(seq_kv, 1) / SPLIT_CHUNKS)))
    return min(max(keys, SPLIT_KEYS_MIN), SPLIT_KEYS_MAX)


def _kv_split(seq_q: int, seq_kv: int, block_kv: int, keys: int | None) -> int | None:
    """:attr:`Problem.kv_split`: ``keys`` per chunk (or :func:`default_split_keys` where the
    queries fit one tile) in kv blocks; None where one chunk would hold every key."""
    if keys is None:
        if seq_q > TILE:
            return None
        keys = default_split_keys(seq_kv)
    return keys // block_kv if keys < seq_kv else None


def _check_compute_regs(kernel: str, compute_regs) -> None:
    """A ValueError unless ``compute_regs`` (a tuning override) is None or one of
    :data:`COMPUTE_REGS`' counts."""
    if compute_regs is None:
        return
    choices = sorted(set(COMPUTE_REGS.values()))
    if (
        not isinstance(compute_regs, int)
        or isinstance(compute_regs, bool)
        or (compute_regs not in choices)
    ):
        raise ValueError(f"attention_mgpu.{kernel}: {compute_regs=} must be one of {choices}")


def _check_split_keys(kernel: str, arg: str, split_keys, block_kv: int) -> None:
    """A ValueError unless ``split_keys`` (the tuning override ``arg``) is None or a
    positive multiple of the kernel's ``block_kv``."""
    if split_keys is None:
        return
    number = isinstance(split_keys, int) and not isinstance(split_keys, bool)
    if not (number and split_keys > 0 and split_keys % block_kv == 0):
        raise ValueError(
            f"attention_mgpu.{kernel}: {arg}={split_keys!r} must be a positive multiple of "
            f"the kernel's {block_kv} keys per step"
        )


# The forward's keys per loop step, by head_dim: a (64, 256) f32 accumulator leaves room in
# the registers for a (64, 64) score tile only; a smaller head_dim takes longer blocks.
# (benchmarks/results/attention-h100-sweep.json: 256 keys at D=64 measured 0.97x cuDNN, 128
# keys 0.84x).
FWD_BLOCK_KV = {64: 256, 128: 128, 256: 64}
FWD_BLOCK_KV_CHOICES = (64, 128, 256)
# Causal attention up to FWD_PERSISTENT_MAX_KEYS keys at head_dim 64 steps 128 keys, on
# the pipelined loop where it runs the persistent grid (:func:`_fwd_pipelined`); probably
# because the diagonal block's masked half is a large share of a short row. 256 keys
# measured 0.69-0.89x cuDNN at 512-2048 keys, 128 keys pipelined 0.84-0.94x; at 4096 keys
# 256 stays level with cuDNN and 128 is not faster
# (benchmarks/archive/d64-short-causal-h200.txt).
FWD_SHORT_CAUSAL_BLOCK_KV = {64: 128}


def _fwd_stages(d: int, block_kv: int, bias: str | None = None) -> int:
    """K/V ring slots that fit 227 KiB of shared memory beside the Q tiles (at most 3); with
    a ``bias`` (:attr:`Problem.bias`), each slot also holds the CTA's part of it."""
    return min(3, (227 * 1024 - _fwd_fixed_bytes(d, bias)) // _fwd_slot_bytes(d, block_kv, bias))


def _fwd_slot_bytes(d: int, block_kv: int, bias: str | None) -> int:
    """One slot of the forward's K/V ring, with its part of a bias."""
    return 2 * block_kv * d * 2 + _bias_slot_bytes(bias, TILE, block_kv)


def _fwd_fixed_bytes(d: int, bias: str | None, q_slots: int = 1) -> int:
    """The forward's shared memory beside its K/V ring: ``q_slots`` pairs of Q tiles, the
    bias ring's barriers, and 4 KiB for the other scratch and the allocator's alignment."""
    return q_slots * NUM_COMPUTE_WGS * WG_ROWS * d * 2 + _bias_ring_bytes(bias) + 4096


def _fwd_q_slots(d: int, block_kv: int, stages: int, bias: str | None = None) -> int:
    """Q tile pairs of a persistent forward (:attr:`Problem.fwd_q_slots`): 2 where they fit
    beside ``stages`` K/V ring slots, as :func:`_fwd_stages` counts them."""
    used = _fwd_fixed_bytes(d, bias, 2) + stages * _fwd_slot_bytes(d, block_kv, bias)
    return 2 if used <= 227 * 1024 else 1


def _bias_slot_bytes(bias: str | None, queries: int, keys: int) -> int:
    """Shared memory of one ring slot of a bias (:attr:`Problem.bias`) for ``queries`` by
    ``keys``: a 16-bit tile, or an f32 vector of the keys."""
    return {None: 0, "tiles": queries * keys * 2, "rows": keys * 4}[bias]


def _bias_ring_bytes(bias: str | None) -> int:
    """Shared memory a bias ring takes beside its slots: its barriers and the allocator's
    alignment."""
    return 0 if bias is None else 1024


def _fwd_block_kv(d: int, bias: str | None, short_causal: bool = False) -> int | None:
    """The forward's keys per loop step: :data:`FWD_BLOCK_KV` (``short_causal``:
    :data:`FWD_SHORT_CAUSAL_BLOCK_KV` where it has ``d``), or with a bias the longest choice
    up to it that leaves two ring slots (a bias tile grows with the block); None: none
    does."""
    most = FWD_BLOCK_KV[d]
    if short_causal:
        most = FWD_SHORT_CAUSAL_BLOCK_KV.get(d, most)
    if bias is None:
        return most
    fits = [bkv for bkv in FWD_BLOCK_KV_CHOICES if bkv <= most and _fwd_stages(d, bkv, bias) >= 2]
    return max(fits, default=None)


# The head dims where the forward overlaps its steps within a warpgroup
# (``Problem.fwd_pipelined``; :func:`_fwd_pipelined`). Measured faster at 256, whether its
# loop bounds are fixed at compile time or read at run time (causal masks, key lengths; a
# window's bounds are read the same way, not timed); slower at 64 at every block length
# (benchmarks/archive/fwd-pipelined-bounds-h200.txt, results/attention-h200-sweep.json),
# except causal at 128 keys on the persistent grid (:data:`FWD_SHORT_CAUSAL_BLOCK_KV`).
# At 128 it is faster than the serial loop without the ping-pong (:data:`FWD_PINGPONG`),
# level with it; timed there at B4 S4096 H16, non-causal against both and causal against
# cuDNN only; not with a window or key lengths, nor at decode shapes or short sequences.
FWD_PIPELINED = {64: False, 128: True, 256: True}

# Whether the pipelined loop keeps the ping-pong between the compute warpgroups, by
# head_dim (``Problem.fwd_pingpong``). With it the two softmaxes take turns, and at 128 a
# block's softmax (benchmarks/archive/fwd-profile-h200.txt) outlasts what the other
# warpgroup's two products take at the tensor cores' peak rate (an estimate), so the tensor
# cores wait; without it both softmaxes run while both warpgroups' products do (the
# ``no-pingpong`` rows of results/attention-h200-sweep.json, at B4 S4096 H16: faster at 128
# and 256, causal and not; at 64 the serial loop, which keeps it, is faster than either).
FWD_PINGPONG = {64: True, 128: False, 256: False}

# Where the forward runs a persistent grid (``Problem.fwd_ctas``, :func:`_fwd_ctas`): its
# CTAs step through query tiles, so one tile's epilogue and the next one's first loads
# overlap instead of each tile paying a CTA's start and end. That fixed cost weighs most
# against short rows of keys; against long ones the grid's own order measured faster
# (probably because its running CTAs stay on neighbouring tiles, which share K/V in L2),
# and at head_dim 256 too. A causal grid's tiles differ in length, so there each CTA takes
# a few tiles (FWD_CAUSAL_TILES_PER_CTA) and the hardware's scheduler still balances them
# (benchmarks/archive/fwd-persistent-h200.txt; with the features:
# fwd-persistent-features-h200.txt, fwd-qlengths-d64-loop-h200.txt). Causal rows of up to
# FWD_CAUSAL_ONE_WAVE_MAX_KEYS keys run one wave, a CTA per SM, like non-causal ones: their
# tiles are a few blocks long, so a CTA's fixed cost weighs most, and along a CTA's stride
# of items their lengths mix (benchmarks/archive/fwd-causal-ctas-h200.txt: 1.05-1.24x at
# 256 to 768 keys, level at B8 S512, 0.80-0.88x at 1024). Longer causal rows at head_dim 64
# take four tiles a CTA where that still leaves FWD_CAUSAL_MIN_WAVES waves of CTAs
# (benchmarks/archive/fwd-causal-ctas4-h200.txt and its -confirm and -waves logs: 1.02-1.07x
# over two at 1024 to 4096 items, 0.82-0.97x at 512 to 896, 1.0-1.7 waves). At 128 four
# ran 0.96-1.00x plain, so it keeps two, except with a window or segment ids
# (FWD_CAUSAL_MASKED_TILES_PER_CTA): 1.01-1.05x over two at 2048 and 4096 items, two rounds
# each (benchmarks/archive/fwd-causal-ctas4-d128-features-h200.txt), where key lengths ran
# 0.96-0.97x at B8 S2048 and keep two.
FWD_PERSISTENT_HEAD_DIMS = (64, 128)
FWD_PERSISTENT_MAX_KEYS = 2048
FWD_CAUSAL_TILES_PER_CTA = {64: 4, 128: 2}
FWD_CAUSAL_MASKED_TILES_PER_CTA = {**FWD_CAUSAL_TILES_PER_CTA, 128: 4}
FWD_CAUSAL_MIN_WAVES = 1.9
FWD_CAUSAL_ONE_WAVE_MAX_KEYS = 768


def _fwd_ctas(p: Problem, sms: int, persistent: bool | None, ctas: int | None) -> int | None:
    """The forward's persistent grid (:attr:`Problem.fwd_ctas`), or None for one CTA per
    tile. ``persistent`` None: where :data:`FWD_PERSISTENT_MAX_KEYS` and
    :data:`FWD_PERSISTENT_HEAD_DIMS` say, with or without a causal mask, key lengths, a
    window, segment ids or a key-padding mask, and query lengths if causal; non-causal
    query lengths and a mask or bias of a row per query keep the grid (they measured level
    or slower on it), and so do key chunks; True: wherever the kernel runs. ``ctas``
    (which implies ``persistent``) replaces the CTA count: otherwise one CTA per SM, or
    causal beyond :data:`FWD_CAUSAL_ONE_WAVE_MAX_KEYS` keys one per
    :data:`FWD_CAUSAL_TILES_PER_CTA` tiles by head_dim (with a window or segment ids
    :data:`FWD_CAUSAL_MASKED_TILES_PER_CTA`), or per two where that many would not fill
    :data:`FWD_CAUSAL_MIN_WAVES` waves (at least one CTA per SM)."""
    if persistent is None and ctas is not None:
        persistent = True
    if persistent is None:
        persistent = (
            (p.causal or not p.q_lengths)
            and p.bias in (None, "rows")
            and p.kv_chunks == 1
            and p.head_dim in FWD_PERSISTENT_HEAD_DIMS
            and p.seq_kv <= FWD_PERSISTENT_MAX_KEYS
        )
    if not persistent:
        if ctas is not None:
            raise ValueError(f"attention_mgpu.flash_fwd: {ctas=} needs the persistent grid")
        return None
    if ctas is not None:
        if not isinstance(ctas, int) or isinstance(ctas, bool) or ctas <= 0:
            raise ValueError(f"attention_mgpu.flash_fwd: {ctas=} must be a positive int or None")
        return min(ctas, max(p.fwd_work, 1))
    one_wave = max(1, min(sms, p.fwd_work))
    if not p.causal or p.seq_kv <= FWD_CAUSAL_ONE_WAVE_MAX_KEYS:
        return one_wave
    masked = p.window is not None or p.segments
    table = FWD_CAUSAL_MASKED_TILES_PER_CTA if masked else FWD_CAUSAL_TILES_PER_CTA
    per_cta = table.get(p.head_dim, 2)
    if -(-p.fwd_work // per_cta) < FWD_CAUSAL_MIN_WAVES * sms:
        per_cta = 2
    return max(one_wave, -(-p.fwd_work // per_cta))


def _fwd_problem(
    q,
    k,
    causal: bool,
    scale: float,
    block_kv: int | None = None,
    bias: str | None = None,
    split_keys: int | None = None,
) -> Problem:
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    if block_kv is None:
        block_kv = _fwd_block_kv(d, bias, short_causal=causal and skv <= FWD_PERSISTENT_MAX_KEYS)
    stages = _fwd_stages(d, block_kv, bias)
    _check_split_keys("flash_fwd", "split_keys", split_keys, block_kv)
    split = _kv_split(sq, skv, block_kv, split_keys)
    dtype = np.dtype(q.dtype)
    return Problem(b, hq, hkv, d, sq, skv, dtype, causal, scale, block_kv, stages, kv_split=split)


def _fwd_pipelined(p: Problem) -> bool:
    """Whether the forward of ``p`` takes the pipelined loop where it measured faster:
    :data:`FWD_PIPELINED`'s head dims with blocks visible whole (no segment ids or bias:
    the pipelined step runs a masked block's products one after the other), and causal on
    the persistent grid at :data:`FWD_SHORT_CAUSAL_BLOCK_KV`'s block, segment ids included
    (a bias, a mask or a key-padding mask streamed beside: not faster)."""
    short_causal = (
        p.causal
        and p.fwd_ctas is not None
        and p.block_kv == FWD_SHORT_CAUSAL_BLOCK_KV.get(p.head_dim)
    )
    return (FWD_PIPELINED[p.head_dim] and not p.every_block_masked) or (
        short_causal and p.bias is None
    )


# The dQ kernel's keys per loop step, by head_dim (the dK/dV kernel's tiles are 64 x 64);
# 128 measured 1-3% faster than 64 (benchmarks/results/attention-h100-sweep.json). At
# D=256 the (64, 256) Q and dO tiles of both warpgroups take 128 KiB of shared memory:
# beside them fit two 64-key K slots and one V slot (wgmma wants 64 keys or more).
DQ_BLOCK_KV = {64: 128, 128: 128, 256: 64}
DQ_BLOCK_KV_CHOICES = (64, 128)
SMEM_BYTES = 227 * 1024  # a Hopper CTA's shared memory


# Shared memory the segment ids take beside a kernel's tiles: the query tiles' ids, a ring
# of key blocks' ids, their barriers, and the allocator's alignment of each.
SEGMENT_SMEM_BYTES = 3072


def _dq_stages(
    d: int, block_kv: int, extra: int = 0, bias: str | None = None, most: int = 2
) -> tuple[int, int]:
    """``(K slots, V slots)`` of the dQ kernel's rings that fit beside its Q and dO tiles
    (and ``extra`` bytes), at most ``most`` each; K gets a slot before V does (it is held
    to the end of a step). With a ``bias``, each K slot also holds the CTA's part of it."""
    fixed = 2 * NUM_COMPUTE_WGS * WG_ROWS * d * 2 + 2 * NUM_COMPUTE_WGS * WG_ROWS * 4 + 1024
    room = SMEM_BYTES - fixed - extra - _bias_ring_bytes(bias)
    kv = block_kv * d * 2
    k_slot = kv + _bias_slot_bytes(bias, TILE, block_kv)
    for k_slots in range(most, 0, -1):
        for v_slots in (k_slots, k_slots - 1):
            if v_slots > 0 and k_slots * k_slot + v_slots * kv <= room:
                return k_slots, v_slots
    return 0, 0


def _dq_block_kv(d: int, extra: int, bias: str | None) -> int | None:
    """The dQ kernel's keys per loop step: :data:`DQ_BLOCK_KV`, or with a bias the longest
    choice up to it whose rings keep the slots they have without one (None: none does)."""
    if bias is None:
        return DQ_BLOCK_KV[d]
    plain = _dq_stages(d, DQ_BLOCK_KV[d], extra)
    fits = [
        bkv
        for bkv in DQ_BLOCK_KV_CHOICES
        if bkv <= DQ_BLOCK_KV[d] and _dq_stages(d, bkv, extra, bias) == plain
    ]
    return max(fits, default=None)


# Decoding (a key tile sees one or two query blocks), a dK/dV CTA is short, and CTAs run
# one per SM (the compute warpgroups' registers fill an SM's register file), in many waves
# at a long cache. There a CTA runs consecutive key tiles, as many as leave at least
# DKV_MIN_CTAS CTAs (a power of two, at most DKV_TILES_MAX): it starts once, and its Q/dO
# ring streams the next tile's queries during the current tile. A tile's K/V load, products
# and write stay in series, so this gains a few percent, at a large batch times heads; more
# tiles than the bound leave SMs idle (``--sweep-decode``, the ``dkv_tiles`` rows).
DKV_TILES_MAX = 16
DKV_MIN_CTAS = 128
DKV_TILES_MAX_STEPS = 2  # query steps (heads of the group × query blocks) per key tile


def _dkv_tiles(p: Problem) -> int:
    """Key tiles per dK/dV CTA (:attr:`Problem.dkv_tiles`)."""
    if p.group * -(-p.seq_q // WG_ROWS) > DKV_TILES_MAX_STEPS:
        return 1
    tiles = 1
    while (
        tiles < DKV_TILES_MAX
        and p.batch * p.heads_kv * -(-p.kv_tiles // (2 * tiles)) >= DKV_MIN_CTAS
    ):
        tiles *= 2
    return tiles


# Where the dK/dV kernel computes dQ too (:attr:`Problem.dkv_dq`), by head_dim: five
# products per key block and query block instead of the two kernels' seven (the dQ kernel
# recomputes S and dP), for a dQ partial per key tile that goes through shared memory to an
# f32 accumulator (a TMA reduce-add) once the tile before it has added its own. Each compute
# warpgroup forms 64 of the partial's columns from both warpgroups' dS, so head_dim 64
# (32-column halves, narrower than the 128-byte swizzle) keeps the two kernels, as does
# the role-split kernel of 256. Off: correct and bitwise repeatable on the GPU, but slower
# than the two kernels (``--sweep-bwd``'s ``dkv_dq`` rows): staging the partial, the
# reduce-add and the turns each cost more than the saved products gain
# (benchmarks/archive/dkv-dq-variants-h200.txt).
DKV_DQ = {128: False}


def _dkv_dq_smem(d: int) -> int:
    """Shared memory :attr:`Problem.dkv_dq` adds: both warpgroups' dSᵀ (16-bit, 64 keys by
    64 queries each) and each one's f32 half of the dQ partial."""
    return NUM_COMPUTE_WGS * WG_ROWS * WG_ROWS * 2 + NUM_COMPUTE_WGS * WG_ROWS * (d // 2) * 4


def _dkv_roles(d: int) -> bool:
    return d >= DKV_ROLES_HEAD_DIM


def _dkv_rows(d: int) -> int:
    return WG_ROWS if _dkv_roles(d) else TILE


def _dkv_smem(d: int, stages: int, bias: str | None = None, dq: bool = False) -> int:
    """Shared-memory bytes of the dK/dV kernel: K and V of its key rows, the Q/dO ring (with
    a ``bias``, each slot also holds the key rows' part of it), where the warpgroups
    split roles, the f32 Pᵀ tile they hand over, and with ``dq`` :func:`_dkv_dq_smem`."""
    hand_over = WG_ROWS * WG_ROWS * 4 if _dkv_roles(d) else 0
    slot = 2 * WG_ROWS * d * 2 + 2 * WG_ROWS * 4
    slot += _bias_slot_bytes(bias, WG_ROWS, _dkv_rows(d))
    fixed = 2 * _dkv_rows(d) * d * 2 + hand_over + _bias_ring_bytes(bias) + 4096
    return fixed + stages * slot + (_dkv_dq_smem(d) if dq else 0)


def _bwd_problem(
    q,
    k,
    causal: bool,
    scale: float,
    dq_block_kv: int | None = None,
    dkv_stages: int | None = None,
    dkv_paired: bool | None = None,
    extra: int = 0,
    bias: str | None = None,
    dq_split_keys: int | None = None,
    dkv_tiles: int | None = None,
    dq_dkv: bool = False,
    dkv_dq: bool = False,
) -> Problem:
    """The backward's problem; ``extra``: shared memory the dQ kernel gives segment ids."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    if dq_dkv:  # 64 keys a step (warpgroup 1's dK and dV fit its registers), P and dS
        dq_block_kv = WG_ROWS if dq_block_kv is None else dq_block_kv
        extra += PDS_SLOTS * 2 * WG_ROWS * dq_block_kv * 2
    bkv = _dq_block_kv(d, extra, bias) if dq_block_kv is None else dq_block_kv
    stages, v_stages = _dq_stages(d, bkv, extra, bias, DQ_DKV_STAGES if dq_dkv else 2)
    dkv_stages = DKV_STAGES[d] if dkv_stages is None else dkv_stages
    paired = DKV_PAIRED.get(d, False) if dkv_paired is None else dkv_paired
    _check_split_keys("flash_bwd", "dq_split_keys", dq_split_keys, bkv)
    p = Problem(
        b,
        hq,
        hkv,
        d,
        sq,
        skv,
        np.dtype(q.dtype),
        causal,
        scale,
        bkv,
        stages,
        dkv_stages,
        v_stages,
        _kv_split(sq, skv, bkv, dq_split_keys),
        paired,
    )
    tiles = 1 if dkv_dq else _dkv_tiles(p) if dkv_tiles is None else dkv_tiles
    return dataclasses.replace(p, dkv_tiles=tiles, dq_dkv=dq_dkv, dkv_dq=dkv_dq)


def _dkv_dq_reason(d: int, stages: int, extra: int, bias: str | None) -> str | None:
    """Why the dK/dV kernel cannot compute dQ too (:attr:`Problem.dkv_dq`) at head_dim
    ``d`` with ``stages`` Q/dO ring slots, ``extra`` bytes of segment ids and a ``bias``
    kind, or None."""
    if d not in DKV_DQ:
        return f"head_dim {d} (it takes {', '.join(map(str, DKV_DQ))})"
    need = _dkv_smem(d, stages, bias, dq=True) + extra
    if need > SMEM_BYTES:
        return f"shared memory: {need} bytes > {SMEM_BYTES}"
    return None


# Decoding with GQA, each query head of a group would stream its kv head's keys in CTAs of
# its own. Where no mask depends on the query's position or head, the wrappers fold the
# group's queries into the rows of one query tile per kv head (head-major: row
# ``i·seq_q + s`` is query ``s`` of the group's head ``i``): the keys are streamed once per
# kv head, by as many CTAs per chunk as without GQA. Each row's forward is computed as
# before (a row's products and softmax do not depend on the other rows: the same bits),
# and the backward sums a key block's gradients over the group inside one product.


def _folded_group(spec, q, k) -> int:
    """The GQA group folded into the query rows (:func:`_fold`), or 1: at most 64 rows,
    non-causal or one query (whose causal mask hides no key), and no window, query
    lengths, segment ids, mask or bias."""
    sq, g = q.shape[1], q.shape[2] // k.shape[2]
    per_query = (
        spec.local_window_size is not None
        or spec.has_q_lengths
        or spec.has_segment_ids
        or spec.has_mask
        or spec.has_bias
    )
    if g == 1 or g * sq > WG_ROWS or (spec.causal and sq > 1) or per_query:
        return 1
    return g


def _unfolded_spec(spec):
    """The spec of the folded call: one query sees every key, causal or not."""
    return spec.replace(causal=False)


def _fold(x: jax.Array, g: int) -> jax.Array:
    """``(B, Sq, Hkv·g, D)`` → ``(B, g·Sq, Hkv, D)``, a group's queries head-major."""
    b, sq, hq, d = x.shape
    return x.reshape(b, sq, hq // g, g, d).transpose(0, 3, 1, 2, 4).reshape(b, g * sq, -1, d)


def _unfold(x: jax.Array, g: int) -> jax.Array:
    """:func:`_fold`'s inverse."""
    b, rows, hkv, d = x.shape
    return x.reshape(b, g, rows // g, hkv, d).transpose(0, 2, 3, 1, 4).reshape(b, -1, hkv * g, d)


def _fold_rows(x: jax.Array, g: int) -> jax.Array:
    """``(B, Hkv·g, Sq)`` (lse and its cotangent) → ``(B, Hkv, g·Sq)``, as :func:`_fold`."""
    b, hq, sq = x.shape
    return x.reshape(b, hq // g, g * sq)


def _unfold_rows(x: jax.Array, g: int) -> jax.Array:
    """:func:`_fold_rows`' inverse."""
    b, hkv, rows = x.shape
    return x.reshape(b, hkv * g, rows // g)


# The dQ kernel's hand-over ring of P and dS when it computes dK and dV too: warpgroup 0
# runs this many key blocks ahead of warpgroup 1.
PDS_SLOTS = 2
# Its K and V ring slots, where they fit (at most this many each). Decoding, a CTA walks
# its keys in short steps, and with two slots a step still waited on V's load; its time
# is mostly its 64-row products (benchmarks/archive/dq-dkv-profile-h200.txt, and
# dq-dkv-stages-h200.txt for 2 against 4 slots).
DQ_DKV_STAGES = 4


def _dq_dkv_reason(spec, q, k) -> str | None:
    """Why the dQ kernel cannot compute dK and dV too (:attr:`Problem.dq_dkv`), or None:
    it needs one query tile of which the second warpgroup's rows are padding (at most 64
    queries), one query head per key head (no GQA, whose key blocks' gradients would sum
    over several CTAs, unless :func:`_fold` folded the group into the rows) and head_dim up
    to 128. The key blocks the kernel skips, past the lengths or before a window, get no
    gradient written: :func:`flash_bwd` zeroes those keys."""
    sq, hq, d = q.shape[1], q.shape[2], q.shape[3]
    if sq > WG_ROWS:
        return f"seq_q {sq} > {WG_ROWS}"
    if hq != k.shape[2]:
        return f"GQA ({hq} query heads, {k.shape[2]} key heads)"
    if kernel_head_dim(d) not in (64, 128):
        return f"head_dim {d}"
    return None


def _smem(shape, dtype) -> Any:
    """A shared-memory block of 16-bit rows, tiled and swizzled as TMA and wgmma want them
    (every row here is a multiple of 64 elements: the 128-byte swizzle)."""
    return plgpu.SMEM(
        shape,
        dtype,
        transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)),
    )


# --- shared pieces of the kernel bodies -----------------------------------------------------


def _cdiv(x, d: int):
    """``ceil(x / d)`` of a non-negative int32 scalar, 0 for negative ``x``."""
    return lax.max(lax.div(x + (d - 1), jnp.int32(d)), jnp.int32(0))


def _fdiv(x, d: int):
    """``floor(x / d)`` of an int32 scalar, clipped at 0."""
    return lax.max(lax.div(x, jnp.int32(d)), jnp.int32(0))


def _clip(x, hi):
    return lax.min(x, _i32(hi))


def _i32(x):
    """An int32 scalar of a Python int or a traced scalar."""
    return jnp.asarray(x, jnp.int32)


def _slot(step, stages: int):
    return lax.rem(step, jnp.int32(stages))


def _advance(base, steps):
    """Ring steps after ``steps`` that followed ``base`` earlier ones (None: none)."""
    return steps if base is None else base + steps


def _dot(shape, a, b) -> jax.Array:
    """``a @ b`` of two shared-memory refs into a fresh f32 accumulator; ``a`` and ``b`` may
    be equally long lists of refs whose products are summed (a contraction in chunks)."""
    return _dots(shape, (a, b))[0]


def _dots(shape, *products) -> tuple[jax.Array, ...]:
    """``a @ b`` for each ``(a, b)`` of ``products`` (shared-memory refs, or equally long
    lists of them whose products are summed), each into a fresh f32 accumulator. All of them
    are issued before the first result is read: one wait for the tensor cores, not one per
    product."""

    def pairs(a, b):
        return list(zip(a, b)) if isinstance(a, list) else [(a, b)]

    def body(*acc_refs):
        for acc_ref, (a, b) in zip(acc_refs, products):
            for x, y in pairs(a, b):
                plgpu.wgmma(acc_ref, x, y)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    return pl.run_scoped(body, *(plgpu.ACC(shape, jnp.float32) for _ in products))


def _dot_acc(acc, a, b_ref, stage_ref, *, interpret: bool, overlap=None) -> jax.Array:
    """``acc + a @ b_ref`` with ``a`` in registers: fed to wgmma from registers when
    compiled, staged through ``stage_ref`` in the interpreter (which reads A from shared
    memory only). ``overlap()`` runs between issuing the product and waiting for it: a
    barrier wait for the next step's operands there hides behind the tensor cores."""
    return _dots_acc([(acc, a, b_ref)], stage_ref, interpret=interpret, overlap=overlap)[0]


def _dots_acc(terms, stage_ref, *, interpret: bool, overlap=None) -> tuple[jax.Array, ...]:
    """``acc + a @ b_ref`` for each ``(acc, a, b_ref)`` of ``terms`` (``a`` in registers), all
    issued before one wait; ``overlap`` as in :func:`_dot_acc`. The interpreter stages each
    ``a`` through ``stage_ref`` in turn."""
    if not interpret:

        def body(acc_refs):
            for acc_ref, (_, a, b_ref) in zip(acc_refs, terms):
                plgpu.wgmma(acc_ref, a, b_ref)
            if overlap is not None:
                overlap()

        return tuple(pl.run_state(body)(tuple(plgpu.ACC.init(t[0]) for t in terms)))
    out = []
    for acc, a, b_ref in terms:
        stage_ref[...] = a
        plgpu.commit_smem()
        out.append(acc + _dot(acc.shape, stage_ref, b_ref))
    if overlap is not None:
        overlap()
    return tuple(out)


def _wait_if(cond, barriers):
    """A function that waits on each of ``barriers`` if ``cond``. The condition and the
    barrier indices are computed here, outside the function: run inside a wgmma's
    ``run_state`` body, it must close over traced values only (a captured constant becomes
    an output of the ``run_state`` that the Mosaic GPU lowering cannot represent)."""

    def wait():
        @pl.when(cond)
        def _():
            for bar in barriers:
                plgpu.barrier_wait(bar)

    return wait


def _producer(p: Problem, n_steps, stages: int | Sequence[int], groups) -> None:
    """The memory warpgroup: for each of ``n_steps`` (an int32 scalar) steps, into ring slot
    ``step % stages``, once the slot's previous contents were consumed, every load of every
    group.

    ``groups``: ``[(consumed_barriers, [(src(step) -> gmem ref, ring, barriers), ...])]``;
    a ring (and its barriers) is a shared-memory ref indexed by the slot, or a function of
    the slot. A load may carry a fourth element, True where the compute warpgroups read its
    ring with generic loads (:func:`_generic_reads`).
    ``stages``: the ring slots, one count for all groups or one per group.
    """
    plgpu.set_max_registers(p.wg_regs[1], action="decrease")
    _produce(None, n_steps, stages, groups)
    _drain(n_steps, stages, groups)


def _per_group(stages: int | Sequence[int], groups) -> list[int]:
    return [stages] * len(groups) if isinstance(stages, int) else list(stages)


def _produce(base, n_steps, stages: int | Sequence[int], groups) -> None:
    """:func:`_producer`'s loads of ``n_steps`` steps that follow ``base`` earlier ones on
    the same rings (a persistent kernel's next work item; None: none): step ``n`` fills
    ring slot ``(base + n) % stages``; ``src`` still takes ``n``."""
    per_group = _per_group(stages, groups)

    @pl.loop(0, n_steps)
    def _step(step):
        for (consumed, loads), n in zip(groups, per_group):
            ring_step = _advance(base, step)
            slot = _slot(ring_step, n)

            @pl.when(ring_step >= n)
            def _wait(consumed=consumed, slot=slot, loads=loads):
                plgpu.barrier_wait(consumed.at[slot])
                if _fence_before_refill(loads):
                    plgpu.commit_smem()

            for src, ring, bars, *_ in loads:
                dst = ring(slot) if callable(ring) else ring.at[slot]
                bar = bars(slot) if callable(bars) else bars.at[slot]
                plgpu.copy_gmem_to_smem(src(step), dst, bar)


# Whether the producer fences the proxies before it refills a slot that was read with generic
# loads (see _fence_before_refill); False only to time the fence.
FENCE_GENERIC_REFILLS = True


def _generic_reads(loads: list) -> list:
    """``loads`` (of :func:`_producer`'s groups) marked as read by the compute warpgroups'
    generic loads (``ld.shared``, not the tensor cores)."""
    return [(*load[:3], True) for load in loads]


def _fence_before_refill(loads) -> bool:
    """Whether a slot of ``loads`` is refilled after a proxy fence. The consumed barrier
    orders the compute warpgroups' generic reads of a slot before the producer's wait, but
    TMA writes through the async proxy: ``commit_smem`` (``fence.proxy.async``) after the
    wait orders those reads before the refill's writes (the wgmma's operand reads are in the
    async proxy already). jax 0.11's Mosaic GPU interpreter checks it."""
    return FENCE_GENERIC_REFILLS and any(len(load) > 3 and load[3] for load in loads)


def _drain(n_steps, stages: int | Sequence[int], groups) -> None:
    """After ``n_steps`` steps in all, wait for the last steps' releases too, so that every
    phase of the consumed barriers is observed before the CTA ends (the interpreter checks
    it; free on the GPU, where the compute warpgroups finish after their last release
    anyway)."""
    for (consumed, _), n in zip(groups, _per_group(stages, groups)):

        @pl.loop(lax.max(n_steps - n, jnp.int32(0)), n_steps)
        def _drain(step, consumed=consumed, n=n):
            plgpu.barrier_wait(consumed.at[_slot(step, n)])


def _mask(shape, row0, col0, *, rows_are_q: bool, p: Problem, kv_len=None, segs=None):
    """Which scores of a tile are visible: rows from ``row0``, columns from ``col0``;
    queries along rows (forward, dQ) or columns (dK/dV); keys from ``kv_len`` on (an int32
    scalar, or None: no key limit) are hidden, those outside the band of
    ``p.left``/``p.right`` around the diagonal, and where ``segs`` (the rows' and the
    columns' segment ids) is given, those of another segment."""
    rows = lax.broadcasted_iota(jnp.int32, shape, 0) + row0
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) + col0
    q_pos, kv_pos = (rows, cols) if rows_are_q else (cols, rows)
    conds = [] if kv_len is None else [kv_pos < kv_len]
    if segs is not None:
        row_ids, col_ids = segs
        conds.append(
            lax.broadcast_in_dim(row_ids, shape, [0]) == lax.broadcast_in_dim(col_ids, shape, [1])
        )
    if p.right is not None:
        conds.append(kv_pos <= q_pos + (p.offset + p.right))
    if p.left is not None:
        conds.append(kv_pos >= q_pos + (p.offset - p.left))
    return functools.reduce(lambda a, b: a & b, conds) if conds else None


def _clamped(lengths, seq: int):
    """int32 ``lengths`` clipped to ``[0, seq]``, as the reference's masks clip them."""
    return lax.clamp(jnp.int32(0), lengths.astype(jnp.int32), jnp.int32(seq))


def _kv_len(p: Problem, lengths_ref, b):
    """Batch entry ``b``'s key count: read from the lengths operand (:func:`_lengths_operand`;
    :func:`_clamped`) or ``seq_kv``."""
    if not p.kv_lengths:
        return jnp.int32(p.seq_kv)
    return _clamped(lengths_ref[0, b], p.seq_kv)


def _q_len(p: Problem, lengths_ref, b):
    """Batch entry ``b``'s query count (:func:`_clamped`), or None without query lengths:
    the kernels skip the blocks of padded queries only (their rows are zeroed)."""
    if not p.q_lengths:
        return None
    return _clamped(lengths_ref[1, b], p.seq_q)


def _kv_ranges(p: Problem, q_base, kv_len):
    """Loop steps over kv blocks for the query rows ``[q_base, q_base + 64)`` and ``kv_len``
    keys: ``(first, lo, hi, steps)``: blocks before ``first`` and from ``steps`` on hold no
    visible key (skipped); ``[first, lo)`` and ``[hi, steps)`` are masked, ``[lo, hi)`` are
    visible whole (none with segment ids or a bias). ``first`` and ``lo`` are 0 without a
    window."""
    bkv = p.block_kv
    steps, hi = _cdiv(kv_len, bkv), _fdiv(kv_len, bkv)  # blocks with a key / only keys
    first = lo = 0
    if p.right is not None:
        steps = lax.min(steps, _cdiv(q_base + (WG_ROWS + p.offset + p.right), bkv))
        hi = lax.min(hi, _fdiv(q_base + (p.offset + p.right + 1), bkv))
    if p.left is not None:
        first = lax.min(_fdiv(q_base + (p.offset - p.left), bkv), steps)
        lo = lax.min(lax.max(_cdiv(q_base + (WG_ROWS - 1 + p.offset - p.left), bkv), first), steps)
    return first, lo, lo if p.every_block_masked else lax.min(lax.max(hi, lo), steps), steps


def _kv_loop(p: Problem, ranges, cta_first, cta_steps, step, flush, carry):
    """One warpgroup's loop over the CTA's kv blocks ``[cta_first, cta_steps)``:
    ``step(j, carry, masked)`` on the blocks its ``ranges`` (:func:`_kv_ranges`) see,
    ``flush(j, None)`` on the others (they stream for the other warpgroup; both keep the
    same barrier phases)."""
    first, lo, hi, steps = ranges
    masked = functools.partial(step, masked=True)
    if p.left is not None:
        lax.fori_loop(cta_first, first, flush, None)
    if p.every_block_masked:  # lo == hi: one loop, one copy of the masked step
        carry = lax.fori_loop(first, steps, masked, carry)
    else:
        if p.left is not None:
            carry = lax.fori_loop(first, lo, masked, carry)
        carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(hi, steps, masked, carry)
    lax.fori_loop(steps, cta_steps, flush, None)
    return carry


def _segment_scratch(p: Problem, q_tiles: int, stages: int, kv_rows: int) -> list:
    """Shared memory and barriers for segment ids (None each without them): the query
    tiles' ids (loaded once) and a ring of the streamed key blocks' ids."""
    if not p.segments:
        return [None] * 4
    return [
        plgpu.SMEM((q_tiles, WG_ROWS), jnp.int32),
        plgpu.SMEM((stages, kv_rows), jnp.int32),
        plgpu.Barrier(num_barriers=q_tiles),
        plgpu.Barrier(num_barriers=stages),
    ]


def _load_q_segments(p: Problem, q_seg_ref, qseg_smem, qseg_bar, b, q_base, i):
    """The segment ids of the query rows ``[q_base, q_base + 64)`` (None without them)."""
    if not p.segments:
        return None
    plgpu.copy_gmem_to_smem(
        q_seg_ref.at[b, pl.ds(q_base, WG_ROWS)], qseg_smem.at[i], qseg_bar.at[i]
    )
    plgpu.barrier_wait(qseg_bar.at[i])
    return qseg_smem[i]


def _kv_segments(p: Problem, q_seg, kseg_smem, kseg_bar, slot):
    """``(query ids, key ids)`` of a streamed kv block in ring ``slot`` (None without
    segment ids). Its barrier is awaited even where the ids go unused (a skipped block):
    every phase is observed."""
    if not p.segments:
        return None
    plgpu.barrier_wait(kseg_bar.at[slot])
    return q_seg, kseg_smem[slot]


def _kv_segment_loads(p: Problem, kv_seg_ref, kseg_smem, kseg_bar, b, first) -> list:
    """The producer's load of step ``n``'s key ids (block ``first + n``), beside K."""
    if not p.segments:
        return []
    rows = kseg_smem.shape[-1]
    load = (lambda n: kv_seg_ref.at[b, pl.ds((first + n) * rows, rows)], kseg_smem, kseg_bar)
    return _generic_reads([load])


def _bias_scratch(p: Problem, stages: int, groups: int, n: int) -> list:
    """Shared memory and barriers for the bias (None each without one): a ring of ``groups``
    parts per slot, each 64 rows by ``n`` 16-bit columns (tiles, as TMA and the register
    loads want them) or an f32 vector of ``n`` keys (rows), and a barrier per part and slot
    (a warpgroup waits for its own part only)."""
    if p.bias is None:
        return [None, None]
    if p.bias == "tiles":
        ring = _smem((stages, groups, WG_ROWS, n), p.dtype)
    else:
        ring = plgpu.SMEM((stages, groups, n), jnp.float32)
    return [ring, plgpu.Barrier(num_barriers=stages * groups)]


def _bias_bar(bias_smem, bias_bar, slot, group):
    return bias_bar.at[slot * bias_smem.shape[1] + group]


def _bias_tile(p: Problem, bias_smem, bias_bar, slot, group, shape):
    """The f32 bias of a (queries, keys) score tile of ``shape`` (the forward's and the dQ
    kernel's), in the exp2 domain (times ``log2(e)``), from part ``group`` of ring ``slot``
    (None without a bias): :func:`_bias_load`, then :func:`_bias_exp2`."""
    raw = _bias_load(p, bias_smem, bias_bar, slot, group, keys_dim=1, interpret=False)
    return _bias_exp2(p, raw, shape, keys_dim=1)


def _bias_load(p: Problem, bias_smem, bias_bar, slot, group, keys_dim: int, interpret: bool):
    """Part ``group`` of ring ``slot`` of the bias in registers, as stored (None without
    one): a 16-bit (queries, keys) tile as it is, or transposed for Sᵀ (``keys_dim`` 0), or
    an f32 vector of keys. Its barrier is awaited here; :func:`_bias_flush` observes it for
    a skipped block."""
    if p.bias is None:
        return None
    plgpu.barrier_wait(_bias_bar(bias_smem, bias_bar, slot, group))
    if p.bias == "rows":
        return bias_smem[slot, group]
    tile = bias_smem.at[slot, group]
    if keys_dim == 1:
        return tile[...]
    if interpret:  # (the interpreter holds values, not layouts)
        return tile[...].T
    # Sᵀ's tile of the caller's (queries, keys) bias: read transposed from the swizzled
    # tile into wgmma's transposed layout, then one shuffle between lane pairs into the
    # accumulator's (no transposed copy of the bias in global memory).
    tile = plgpu.layout_cast(tile.transpose((1, 0))[...], plgpu.Layout.WGMMA_TRANSPOSED)
    return plgpu.layout_cast(tile, plgpu.Layout.WGMMA)


def _bias_exp2(p: Problem, raw, shape, keys_dim: int):
    """:func:`_bias_load`'s ``raw`` bias in f32 and the exp2 domain, as a tile of ``shape``."""
    if raw is None:
        return None
    # To the exp2 domain here, in f32: a 16-bit tile scaled before its rounding would
    # round a 16-bit user bias a second time.
    if p.bias == "rows":
        return lax.broadcast_in_dim(raw * LOG2E, shape, [keys_dim])
    return raw.astype(jnp.float32) * LOG2E


def _bias_flush(p: Problem, bias_smem, bias_bar, slot, group) -> None:
    """A skipped block's bias barrier, awaited so that every phase is observed."""
    if p.bias is not None:
        plgpu.barrier_wait(_bias_bar(bias_smem, bias_bar, slot, group))


def _bias_loads(p: Problem, bias_smem, bias_bar, src) -> list:
    """The producer's loads of step ``n``'s bias, one per part ``i`` of a ring slot:
    ``src(n, i)`` is its source in global memory."""
    if p.bias is None:
        return []
    return _generic_reads(
        [
            (
                functools.partial(src, i=i),
                lambda slot, i=i: bias_smem.at[slot, i],
                lambda slot, i=i: _bias_bar(bias_smem, bias_bar, slot, i),
            )
            for i in range(bias_smem.shape[1])
        ]
    )


def _bias_parts(p: Problem) -> int:
    """Parts of a forward or dQ bias slot: a 64-row tile per warpgroup, or one vector of
    keys that both read."""
    return NUM_COMPUTE_WGS if p.bias == "tiles" else 1


def _bias_src(p: Problem, bias_ref, b, h, row0, col0, cols: int):
    """``src(n, i)`` of :func:`_bias_loads` for the forward and dQ kernels: tiles of 64
    query rows from ``row0`` (part ``i`` from ``row0 + 64·i``), or the vector of keys, for
    the ``cols`` keys from ``(col0 + n)·cols``."""
    bb, bh = (b if p.bias_batch else 0), (h if p.bias_heads else 0)

    def src(n, i):
        keys = pl.ds((col0 + n) * cols, cols)
        if p.bias == "rows":
            return bias_ref.at[bb, bh, keys]
        return bias_ref.at[bb, bh, pl.ds(row0 + i * WG_ROWS, WG_ROWS), keys]

    return src


def _tile_and_chunk(p: Problem, i=None, *, reverse: bool = False):
    """The CTA's 128-row query tile and key chunk (None without :attr:`Problem.kv_split`):
    the grid's ``q_seq`` axis (or ``i``, a persistent CTA's work item's index along it)
    runs the chunks of a tile side by side. ``reverse``: the
    tiles last to first (the forward's causal grid: its loops grow with the tile index,
    so the longest CTAs start first and the shortest fill the last wave, FA3's order. The
    dQ kernel keeps the launch order: at head_dim 256 with seq_q != seq_kv its gradients
    came out wrong on the H100 in the reversed order, while the interpreter's were right;
    not yet understood.)"""
    i = lax.axis_index("q_seq") if i is None else i
    chunk = None
    if p.kv_chunks > 1:
        n = jnp.int32(p.kv_chunks)
        i, chunk = lax.div(i, n), lax.rem(i, n)
    return (p.seq_q_pad // TILE - 1 - i if reverse else i), chunk


def _in_chunk(p: Problem, chunk, bounds):
    """Block bounds (:func:`_kv_ranges`) clipped to key chunk ``chunk``'s blocks (as they
    are where ``chunk`` is None)."""
    if chunk is None:
        return tuple(_i32(x) for x in bounds)
    c0 = chunk * p.kv_split
    return tuple(lax.clamp(c0, _i32(x), c0 + p.kv_split) for x in bounds)


def _cta_kv_ranges(p: Problem, tile0, chunk, kv_len, q_len=None):
    """``(cta_first, cta_steps, ranges(q_base))``: the CTA's loop over kv blocks, from its
    first warpgroup's first block to the last block of its last warpgroup with a query
    row (below ``q_len``, :func:`_q_len`, where given), and a warpgroup's
    :func:`_kv_ranges` in the chunk (empty for a warpgroup of padded rows only, which
    computes nothing: its rows' results are zeros)."""
    n_q = p.seq_q if q_len is None else q_len
    first0, *_, steps0 = _in_chunk(p, chunk, _kv_ranges(p, tile0, kv_len))
    steps1 = _in_chunk(p, chunk, _kv_ranges(p, tile0 + WG_ROWS, kv_len))[3]
    cta_steps = lax.select(tile0 + WG_ROWS < n_q, steps1, steps0)
    if q_len is not None:  # (a CTA of padded queries only streams nothing)
        cta_steps = lax.select(tile0 < n_q, cta_steps, first0)

    def ranges(q_base):
        own = _in_chunk(p, chunk, _kv_ranges(p, q_base, kv_len))
        return tuple(lax.select(q_base < n_q, x, first0) for x in own)

    return first0, cta_steps, ranges


# --- forward --------------------------------------------------------------------------------


def _fwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    lengths_ref,
    q_seg_ref,
    kv_seg_ref,
    bias_ref,
    out_ref,
    lse_ref,
    *scratch,
    p: Problem,
    interpret: bool,
):
    qo_smem, k_smem, v_smem, lse_smem, stage = scratch[:5]
    k_bar, v_bar, q_bar, k_done, v_done, sched = scratch[5:11]
    qseg_smem, kseg_smem, qseg_bar, kseg_bar = scratch[11:15]
    bias_smem, bias_bar = scratch[15:]  # a ring of bias tiles, released with V
    wg = lax.axis_index("wg")
    n_items, item_at = _fwd_items(p)
    persistent = p.fwd_ctas is not None
    q_slots = qo_smem.shape[0]
    bq, bkv, d = WG_ROWS, p.block_kv, p.head_dim

    def item(k):
        """Work item ``k``'s ``(b, h, tile0, chunk, kv_len, cta_first, cta_steps,
        wg_ranges)``: see :func:`_cta_kv_ranges`."""
        b, h, tile, chunk = item_at(k)
        tile0 = tile * TILE
        kv_len = _kv_len(p, lengths_ref, b)
        q_len = _q_len(p, lengths_ref, b)
        return b, h, tile0, chunk, kv_len, *_cta_kv_ranges(p, tile0, chunk, kv_len, q_len)

    def q_tile(k):
        """Item ``k``'s Q tile of this warpgroup and its barrier: slot ``k % q_slots``."""
        slot = 0 if q_slots == 1 else _slot(k, q_slots)
        return qo_smem.at[slot, wg], q_bar.at[slot * NUM_COMPUTE_WGS + wg]

    def load_q(b, h, q_base, tile):
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, bq), h], *tile)

    def prefetch_q(k):  # (with two Q slots: item k's while item k - 1 runs)
        b, h, tile0, *_ = item(k)
        tile = q_tile(k)
        load_q(b, h, tile0 + wg * bq, tile)

    def schedule():
        # Ping-pong between the two compute warpgroups: one's softmax overlaps the other's
        # wgmma (the FA3 schedule). Without it (the pipelined loop only) no rendezvous.
        if p.fwd_pingpong:
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

    @pl.when(wg < NUM_COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(p.wg_regs[0], action="increase")
        if q_slots > 1:
            pl.when(n_items > 0)(lambda: prefetch_q(0))

        def run(k, base):
            """Item ``k``, whose K/V ring steps follow ``base`` earlier ones (None: the
            kernel's only item); returns the steps after it."""
            b, h, tile0, chunk, kv_len, cta_first, cta_steps, wg_ranges = item(k)
            stg = None if stage is None else stage.at[wg]  # the interpreter's A-operand slot
            q_base = tile0 + wg * bq
            ranges = wg_ranges(q_base)
            qs, q_ready = q_tile(k)
            if persistent:  # the last item's stores must have read Q's tile and the lse row
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if q_slots == 1:
                load_q(b, h, q_base, (qs, q_ready))
            plgpu.barrier_wait(q_ready)
            if q_slots > 1:  # the next item's Q streams in while this one runs
                pl.when(k + 1 < n_items)(lambda: prefetch_q(k + 1))
            q_seg = _load_q_segments(p, q_seg_ref, qseg_smem, qseg_bar, b, q_base, wg)
            m = jnp.full((bq,), -jnp.inf, jnp.float32)
            l_ = jnp.zeros((bq,), jnp.float32)
            acc = jnp.zeros((bq, d), jnp.float32)
            pl.when(wg == 1)(schedule)

            def slot_of(j):
                return _slot(_advance(base, j - cta_first), p.stages)

            def wait_next_k(j):
                # Each step waits for the next step's K block while its P·V product runs (the
                # first block before the loop), so the barrier wait hides behind the tensor cores.
                return _wait_if(j + 1 < cta_steps, [k_bar.at[slot_of(j + 1)]])

            def scores(slot):
                """``S = Q·Kᵀ`` for the K block in ring ``slot``."""

                def qk(s_ref):
                    plgpu.wgmma(s_ref, qs, k_smem.at[slot].transpose((1, 0)))
                    schedule()
                    return s_ref[...]

                return pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))

            def probs(j, s, m, masked: bool):
                """The online softmax of block ``j``'s scores ``s`` (K released once read):
                ``(m_new, pr, alpha)``, the running max and the probabilities in the exp2
                domain and the factor that rescales what came before."""
                slot = slot_of(j)
                segs = _kv_segments(p, q_seg, kseg_smem, kseg_bar, slot)  # before K's release
                plgpu.barrier_arrive(k_done.at[slot])
                part = 0 if p.bias == "rows" else wg
                bias = _bias_tile(p, bias_smem, bias_bar, slot, part, (bq, bkv))

                # ``scaled(x)``: scores to the exp2 domain. The bias tile is in it already, so
                # with one the scores are scaled once, here.
                def scaled(x):
                    return x if bias is not None else x * p.c

                if bias is not None:
                    s = s * p.c + bias
                if masked:
                    vis = _mask(
                        (bq, bkv), q_base, j * bkv, rows_are_q=True, p=p, kv_len=kv_len, segs=segs
                    )
                    s = jnp.where(vis, s, -jnp.inf)
                # The running max lives in the scaled exp2 domain, so that ``s·c − m`` below is
                # one fused multiply-add per score.
                m_new = jnp.maximum(m, scaled(s.max(axis=1)))
                m_use = m_new
                if masked:  # a row with nothing visible yet: subtract 0, not -inf (NaN)
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m - m_use)
                pr = jnp.exp2(scaled(s) - lax.broadcast_in_dim(m_use, s.shape, [0]))
                return m_new, pr, alpha

            def rows(x):
                return lax.broadcast_in_dim(x, (bq, d), [0])

            def step(j, carry, masked: bool):
                acc, m, l_ = carry
                slot = slot_of(j)
                s = scores(slot)
                m_new, pr, alpha = probs(j, s, m, masked)
                acc = acc * rows(alpha)
                l_ = l_ * alpha + pr.sum(axis=1)
                if d <= 128:
                    # Finish the softmax, the cast included, before handing the tensor cores
                    # over: measured faster up to head_dim 128 (as in jax's FA3 kernel), slower
                    # at 256, where the registers are short and the cast waits for the V tile.
                    pr = pr.astype(p.dtype)
                    acc, l_, m_new, pr = lax.optimization_barrier((acc, l_, m_new, pr))
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_wait(sched)
                acc = _dot_acc(
                    acc,
                    pr.astype(p.dtype),
                    v_smem.at[slot],
                    stg,
                    interpret=interpret,
                    overlap=wait_next_k(j),
                )
                plgpu.barrier_arrive(v_done.at[slot])
                return acc, m_new, l_

            def flush(j, _):
                # Blocks this warpgroup does not see: keep the barrier phases and the schedule.
                slot = slot_of(j)
                if p.fwd_pipelined:  # (a pipelined step awaits its own K block)
                    plgpu.barrier_wait(k_bar.at[slot])
                _kv_segments(p, q_seg, kseg_smem, kseg_bar, slot)
                plgpu.barrier_arrive(k_done.at[slot])
                _bias_flush(p, bias_smem, bias_bar, slot, 0 if p.bias == "rows" else wg)
                schedule()
                plgpu.barrier_wait(v_bar.at[slot])
                schedule()
                if not p.fwd_pipelined:
                    wait_next_k(j)()
                plgpu.barrier_arrive(v_done.at[slot])

            # The pipelined loop (``p.fwd_pipelined``, FA3's intra-warpgroup overlap): step j
            # issues S_j = Q·K_jᵀ and O += P_{j−1}·V_{j−1} back to back, reads S_j as soon as
            # it is done and runs its softmax while the P·V product is still on the tensor
            # cores; O is rescaled by step j's factor once that product has landed. The first
            # block a warpgroup sees only computes its scores, one P·V product follows the
            # last, and masked blocks run their two products one after the other. With the
            # ping-pong (``p.fwd_pingpong``) a step's two schedule rendezvous stay where the
            # serial loop has them, after the products are issued and after the softmax;
            # without it the warpgroups meet only at the K/V ring's barriers.

            def row_sums(l_, m_new, pr, alpha):  # the carried softmax state after a block
                return m_new, l_ * alpha + pr.sum(axis=1), pr.astype(p.dtype)

            def first_step(j, carry):
                m, l_, _ = carry
                plgpu.barrier_wait(k_bar.at[slot_of(j)])
                # Masked whatever its range: it may be any of them, and the mask is exact.
                m_new, pr, alpha = probs(j, scores(slot_of(j)), m, masked=True)
                schedule()
                return row_sums(l_, m_new, pr, alpha)

            def pipelined_step(j, carry, masked: bool):
                (m, l_, pr_prev), acc = carry
                slot, prev = slot_of(j), slot_of(j - 1)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[prev])
                if interpret or masked:
                    # One product after the other: the interpreter has no register operands,
                    # and a masked block's softmax needs the registers that P_{j-1} and the
                    # in-flight product would hold.
                    o = _dot_acc(acc, pr_prev, v_smem.at[prev], stg, interpret=interpret)
                    m_new, pr, alpha = probs(j, scores(slot), m, masked)
                    state = row_sums(l_, m_new, pr, alpha)
                else:

                    def both(s_ref, o_ref):
                        o_ref[...] = acc
                        plgpu.wgmma(s_ref, qs, k_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma(o_ref, pr_prev, v_smem.at[prev])
                        schedule()
                        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # P·V still running
                        m_new, pr, alpha = probs(j, s, m, masked)
                        l_new = l_ * alpha + pr.sum(axis=1)
                        o = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
                        # The 16-bit P is written once P·V has landed: written while the
                        # product still reads the last one, it makes ptxas serialise every
                        # product of the kernel (its warning C7513).
                        o, pr = lax.optimization_barrier((o, pr))
                        return (m_new, l_new, pr.astype(p.dtype)), alpha, o

                    state, alpha, o = pl.run_scoped(
                        both, plgpu.ACC((bq, bkv), jnp.float32), plgpu.ACC((bq, d), jnp.float32)
                    )
                plgpu.barrier_arrive(v_done.at[prev])
                schedule()
                return state, o * rows(alpha)

            def pipelined_loop(acc, m, l_):
                first, lo, hi, steps = ranges
                if p.left is not None:
                    lax.fori_loop(cta_first, first, flush, None)
                pr = jnp.zeros((bq, bkv), p.dtype)
                state = lax.fori_loop(first, lax.min(first + 1, steps), first_step, (m, l_, pr))
                after_first = first + 1

                def span(start, stop, masked, carry):
                    return lax.fori_loop(
                        start, stop, functools.partial(pipelined_step, masked=masked), carry
                    )

                carry = (state, acc)
                if p.left is not None:
                    carry = span(after_first, lo, True, carry)
                carry = span(lax.max(lo, after_first), hi, False, carry)
                (m, l_, pr), acc = span(lax.max(hi, after_first), steps, True, carry)

                def last(j, acc):  # the last seen block's P·V (none if no block is seen)
                    plgpu.barrier_wait(v_bar.at[slot_of(j)])
                    acc = _dot_acc(acc, pr, v_smem.at[slot_of(j)], stg, interpret=interpret)
                    plgpu.barrier_arrive(v_done.at[slot_of(j)])
                    return acc

                acc = lax.fori_loop(lax.max(steps - 1, first), steps, last, acc)
                lax.fori_loop(steps, cta_steps, flush, None)
                return acc, m, l_

            if p.fwd_pipelined:
                acc, m, l_ = pipelined_loop(acc, m, l_)
            else:
                wait_next_k(cta_first - 1)()
                acc, m, l_ = _kv_loop(p, ranges, cta_first, cta_steps, step, flush, (acc, m, l_))
            pl.when(wg == 0)(schedule)
            empty = l_ == 0.0  # rows that see no key: zeros and lse = -inf
            l_safe = jnp.where(empty, 1.0, l_)
            acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            q_rows = pl.ds(q_base, bq)

            @pl.when(q_base < p.seq_q)  # (padded rows are cut off)
            def _write():
                hi = acc.astype(p.dtype)
                qs[...] = hi
                lse_smem[wg] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
                plgpu.commit_smem()
                lse_wg = lse_smem.at[wg]
                if chunk is None:
                    plgpu.copy_smem_to_gmem(qs, out_ref.at[b, q_rows, h])
                    plgpu.copy_smem_to_gmem(lse_wg, lse_ref.at[b, h, q_rows])
                    if not persistent:  # (else awaited where the tiles are reused)
                        plgpu.wait_smem_to_gmem(0)
                    return
                # A chunk's output as a pair of 16-bit terms (as the dQ kernel's partials),
                # the second through the same tile once the first has left it; rows past
                # the partials' (:attr:`Problem.part_rows`) stay behind.
                n = p.part_rows
                rows, tile_rows = pl.ds(q_base, n), pl.ds(0, n)
                plgpu.copy_smem_to_gmem(qs.at[tile_rows], out_ref.at[0, chunk, b, rows, h])
                plgpu.copy_smem_to_gmem(lse_wg.at[tile_rows], lse_ref.at[chunk, b, h, rows])
                plgpu.wait_smem_to_gmem(0)
                qs[...] = (acc - hi.astype(jnp.float32)).astype(p.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qs.at[tile_rows], out_ref.at[1, chunk, b, rows, h])
                plgpu.wait_smem_to_gmem(0)

            return _advance(base, cta_steps - cta_first)

        if persistent:
            lax.fori_loop(0, n_items, run, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)
        else:
            run(0, None)

    @pl.when(wg == NUM_COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(p.wg_regs[1], action="decrease")

        def feed(k, base):
            b, h, tile0, _, _, cta_first, cta_steps, _ = item(k)
            kv_head = lax.div(h, jnp.int32(p.group))

            def kv(ref):
                return lambda n: ref.at[b, pl.ds((cta_first + n) * bkv, bkv), kv_head]

            k_loads = [(kv(k_ref), k_smem, k_bar)]
            k_loads += _kv_segment_loads(p, kv_seg_ref, kseg_smem, kseg_bar, b, cta_first)
            v_loads = [(kv(v_ref), v_smem, v_bar)]
            bias_src = _bias_src(p, bias_ref, b, h, tile0, cta_first, bkv)
            v_loads += _bias_loads(p, bias_smem, bias_bar, bias_src)
            groups = [(k_done, k_loads), (v_done, v_loads)]
            _produce(base, cta_steps - cta_first, p.stages, groups)
            return _advance(base, cta_steps - cta_first)

        if persistent:
            steps = lax.fori_loop(0, n_items, feed, jnp.int32(0))
        else:
            steps = feed(0, None)
        _drain(steps, p.stages, [(k_done, None), (v_done, None)])


def _fwd_items(p: Problem):
    """The forward CTA's work items: ``(count, at(k) -> (b, h, tile, chunk))``. One, the
    grid's, without :attr:`Problem.fwd_ctas`; else items ``cta, cta + ctas, ...`` of the
    grid the kernel would launch without it, in its launch order (heads fastest), while
    below :attr:`Problem.fwd_work`."""
    if p.fwd_ctas is None:
        b, h = lax.axis_index("batch"), lax.axis_index("heads")
        tile, chunk = _tile_and_chunk(p, reverse=p.causal)
        return 1, lambda k: (b, h, tile, chunk)
    cta, ctas = lax.axis_index("cta"), p.fwd_ctas

    def at(k):
        w = k * jnp.int32(ctas) + cta
        h, r = lax.rem(w, jnp.int32(p.heads_q)), lax.div(w, jnp.int32(p.heads_q))
        b, i = lax.div(r, jnp.int32(p.q_items)), lax.rem(r, jnp.int32(p.q_items))
        return (b, h, *_tile_and_chunk(p, i, reverse=p.causal))

    return _cdiv(jnp.int32(p.fwd_work) - cta, ctas), at


def _fwd_grid(p: Problem) -> dict:
    if p.fwd_ctas is not None:
        return dict(grid=(p.fwd_ctas,), grid_names=("cta",))
    grid = (p.heads_q, p.q_items, p.batch)
    return dict(grid=grid, grid_names=("heads", "q_seq", "batch"))


def _build_fwd(p: Problem, interpret: bool) -> Any:
    d, bkv = p.head_dim, p.block_kv
    stage = _smem((NUM_COMPUTE_WGS, WG_ROWS, bkv), p.dtype) if interpret else None
    scratch = [
        _smem((p.fwd_q_slots, NUM_COMPUTE_WGS, WG_ROWS, d), p.dtype),
        _smem((p.stages, bkv, d), p.dtype),
        _smem((p.stages, bkv, d), p.dtype),
        plgpu.SMEM((NUM_COMPUTE_WGS, WG_ROWS), jnp.float32),
        stage,
        plgpu.Barrier(num_barriers=p.stages),
        plgpu.Barrier(num_barriers=p.stages),
        plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS * p.fwd_q_slots),
        plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=p.stages),
        plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=p.stages),
        plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS),
        *_segment_scratch(p, NUM_COMPUTE_WGS, p.stages, bkv),
        *_bias_scratch(p, p.stages, _bias_parts(p), bkv),
    ]
    out = (p.batch, p.seq_q_pad, p.heads_q, d)
    lse = (p.batch, p.heads_q, p.seq_q_pad)
    if p.kv_chunks > 1:  # per chunk: (hi, lo) and its lse
        out = (2, p.kv_chunks, p.batch, p.part_seq, p.heads_q, d)
        lse = (p.kv_chunks, p.batch, p.heads_q, p.part_seq)
    return plgpu.kernel(
        functools.partial(_fwd_kernel, p=p, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct(out, p.dtype), jax.ShapeDtypeStruct(lse, jnp.float32)),
        scratch_types=scratch,
        **_fwd_grid(p),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
    )


# --- backward: dQ ---------------------------------------------------------------------------


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    lengths_ref,
    q_seg_ref,
    kv_seg_ref,
    bias_ref,
    dq_ref,
    *refs,
    p,
    interpret,
):
    dk_ref, dv_ref, *scratch = refs if p.dq_dkv else (None, None, *refs)
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, stage = scratch[:7]
    q_bar, k_bar, v_bar, k_done, v_done = scratch[7:12]
    qseg_smem, kseg_smem, qseg_bar, kseg_bar = scratch[12:16]
    bias_smem, bias_bar = scratch[16:18]  # a ring of bias tiles, released with K
    # dq_dkv: a ring of PDS_SLOTS key blocks' P and dS (queries × keys, 16-bit), handed
    # from warpgroup 0 to warpgroup 1, and the hand-over's barriers.
    pds_smem, pds_ready, pds_free = scratch[18:] if p.dq_dkv else (None, None, None)
    b, h = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    kv_head = lax.div(h, jnp.int32(p.group))
    tile, chunk = _tile_and_chunk(p)
    tile0 = tile * TILE
    kv_len = _kv_len(p, lengths_ref, b)
    # (computing dK and dV, warpgroup 1 streams the keys for rows that are all padding)
    q_len = None if p.dq_dkv else _q_len(p, lengths_ref, b)
    cta_first, cta_steps, wg_ranges = _cta_kv_ranges(p, tile0, chunk, kv_len, q_len)
    bq, bkv, d = WG_ROWS, p.block_kv, p.head_dim

    @pl.when(wg < NUM_COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(p.wg_regs[0], action="increase")
        stg = None if stage is None else stage.at[wg]  # the interpreter's A-operand slot
        q_base = tile0 + wg * bq
        live = q_base < p.seq_q
        ranges = wg_ranges(q_base)
        rows = pl.ds(q_base, bq)
        qs, dos = q_smem.at[wg], do_smem.at[wg]
        bars = [q_bar.at[wg * 4 + i] for i in range(4)]
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], qs, bars[0])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], dos, bars[1])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[wg], bars[2])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[wg], bars[3])
        for bar in bars:
            plgpu.barrier_wait(bar)
        lse = lse_smem[wg]
        delta = delta_smem[wg]
        q_seg = _load_q_segments(p, q_seg_ref, qseg_smem, qseg_bar, b, q_base, wg)
        dq = jnp.zeros((bq, d), jnp.float32)

        def step(j, dq, masked: bool):
            slot, vslot = _slot(j - cta_first, p.stages), _slot(j - cta_first, p.v_stages)
            plgpu.barrier_wait(k_bar.at[slot])
            s = _dot((bq, bkv), qs, k_smem.at[slot].transpose((1, 0)))
            plgpu.barrier_wait(v_bar.at[vslot])
            dp = _dot((bq, bkv), dos, v_smem.at[vslot].transpose((1, 0)))
            plgpu.barrier_arrive(v_done.at[vslot])
            s = s * p.c
            part = 0 if p.bias == "rows" else wg
            bias = _bias_tile(p, bias_smem, bias_bar, slot, part, (bq, bkv))
            if bias is not None:
                s = s + bias
            pr = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            if masked:
                segs = _kv_segments(p, q_seg, kseg_smem, kseg_bar, slot)
                vis = _mask(
                    (bq, bkv), q_base, j * bkv, rows_are_q=True, p=p, kv_len=kv_len, segs=segs
                )
                pr = jnp.where(vis, pr, 0.0)
            ds = pr * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
            if p.dq_dkv:  # once warpgroup 1 has read the slot's last block
                n = j - cta_first
                hand = _slot(n, PDS_SLOTS)
                _wait_if(n >= PDS_SLOTS, [pds_free.at[hand]])()
                pds_smem.at[hand, 0][...] = pr.astype(p.dtype)
                pds_smem.at[hand, 1][...] = ds.astype(p.dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(pds_ready.at[hand])
            dq = _dot_acc(dq, ds.astype(p.dtype), k_smem.at[slot], stg, interpret=interpret)
            plgpu.barrier_arrive(k_done.at[slot])
            return dq

        def flush(j, _):
            slot, vslot = _slot(j - cta_first, p.stages), _slot(j - cta_first, p.v_stages)
            plgpu.barrier_wait(k_bar.at[slot])
            _kv_segments(p, q_seg, kseg_smem, kseg_bar, slot)
            _bias_flush(p, bias_smem, bias_bar, slot, 0 if p.bias == "rows" else wg)
            plgpu.barrier_wait(v_bar.at[vslot])
            plgpu.barrier_arrive(v_done.at[vslot])
            plgpu.barrier_arrive(k_done.at[slot])

        def write(dq):
            @pl.when(live)  # (padded rows are cut off)
            def _write():
                hi = dq.astype(p.dtype)
                qs[...] = hi
                if chunk is None:
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(qs, dq_ref.at[b, rows, h])
                else:
                    # A chunk's partial dQ as a pair of 16-bit terms, through the Q and dO
                    # tiles: ``hi + lo`` is the f32 partial to about 16 bits of mantissa.
                    dos[...] = (dq - hi.astype(jnp.float32)).astype(p.dtype)
                    plgpu.commit_smem()
                    n = p.part_rows
                    parts, tile_rows = pl.ds(q_base, n), pl.ds(0, n)
                    plgpu.copy_smem_to_gmem(qs.at[tile_rows], dq_ref.at[0, chunk, b, parts, h])
                    plgpu.copy_smem_to_gmem(dos.at[tile_rows], dq_ref.at[1, chunk, b, parts, h])
                plgpu.wait_smem_to_gmem(0)

        if not p.dq_dkv:
            write(_kv_loop(p, ranges, cta_first, cta_steps, step, flush, dq) * p.scale)
            return

        @pl.when(wg == 0)
        def _dq():
            dq_out = _kv_loop(p, ranges, cta_first, cta_steps, step, flush, dq) * p.scale

            # dQ goes out through the Q and dO tiles: once warpgroup 1 has read them for
            # the last blocks (this observes every release's phase, too).
            @pl.loop(lax.max(cta_steps - PDS_SLOTS, cta_first), cta_steps)
            def _drain(j):
                plgpu.barrier_wait(pds_free.at[_slot(j - cta_first, PDS_SLOTS)])

            write(dq_out)

        @pl.when(wg == 1)
        def _dkv():
            # Warpgroup 1's query rows are padding: it streams the blocks as a flush does,
            # and turns each block's P and dS into the block's dV = Pᵀ·dO and dK = dSᵀ·Q,
            # written through its own Q and dO tiles.
            def block(j, _):
                flush(j, None)
                hand = _slot(j - cta_first, PDS_SLOTS)
                plgpu.barrier_wait(pds_ready.at[hand])
                pt, dst = (pds_smem.at[hand, i].transpose((1, 0)) for i in (0, 1))
                dv, dk = _dots((bkv, d), (pt, do_smem.at[0]), (dst, q_smem.at[0]))
                plgpu.barrier_arrive(pds_free.at[hand])
                plgpu.wait_smem_to_gmem(0)  # the last block's writes have left the tiles
                qs[...] = (dk * p.scale).astype(p.dtype)
                dos[...] = dv.astype(p.dtype)
                plgpu.commit_smem()
                keys = pl.ds(j * bkv, bkv)
                plgpu.copy_smem_to_gmem(qs, dk_ref.at[b, keys, h])
                plgpu.copy_smem_to_gmem(dos, dv_ref.at[b, keys, h])

            lax.fori_loop(cta_first, cta_steps, block, None)
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_COMPUTE_WGS)
    def _memory():
        def kv(ref):
            return lambda n: ref.at[b, pl.ds((cta_first + n) * bkv, bkv), kv_head]

        k_loads = [(kv(k_ref), k_smem, k_bar)]
        k_loads += _kv_segment_loads(p, kv_seg_ref, kseg_smem, kseg_bar, b, cta_first)
        bias_src = _bias_src(p, bias_ref, b, h, tile0, cta_first, bkv)
        k_loads += _bias_loads(p, bias_smem, bias_bar, bias_src)
        _producer(
            p,
            cta_steps - cta_first,
            (p.stages, p.v_stages),
            [(k_done, k_loads), (v_done, [(kv(v_ref), v_smem, v_bar)])],
        )


def _build_dq(p: Problem, interpret: bool) -> Any:
    d, bkv, w = p.head_dim, p.block_kv, NUM_COMPUTE_WGS
    stage = _smem((w, WG_ROWS, bkv), p.dtype) if interpret else None
    scratch = [
        _smem((w, WG_ROWS, d), p.dtype),
        _smem((w, WG_ROWS, d), p.dtype),
        plgpu.SMEM((w, WG_ROWS), jnp.float32),
        plgpu.SMEM((w, WG_ROWS), jnp.float32),
        _smem((p.stages, bkv, d), p.dtype),
        _smem((p.v_stages, bkv, d), p.dtype),
        stage,
        plgpu.Barrier(num_barriers=4 * w),  # per warpgroup: Q, dO, lse, delta
        plgpu.Barrier(num_barriers=p.stages),
        plgpu.Barrier(num_barriers=p.v_stages),
        plgpu.Barrier(num_arrivals=w, num_barriers=p.stages),
        plgpu.Barrier(num_arrivals=w, num_barriers=p.v_stages),
        *_segment_scratch(p, w, p.stages, bkv),
        *_bias_scratch(p, p.stages, _bias_parts(p), bkv),
    ]
    out = (p.batch, p.seq_q_pad, p.heads_q, d)
    if p.kv_chunks > 1:  # (hi, lo) per chunk
        out = (2, p.kv_chunks, p.batch, p.part_seq, p.heads_q, d)
    out_type = jax.ShapeDtypeStruct(out, p.dtype)
    if p.dq_dkv:
        scratch += [
            _smem((PDS_SLOTS, 2, WG_ROWS, bkv), p.dtype),
            plgpu.Barrier(num_barriers=PDS_SLOTS),
            plgpu.Barrier(num_barriers=PDS_SLOTS),
        ]
        kv = jax.ShapeDtypeStruct((p.batch, p.seq_kv_pad, p.heads_kv, d), p.dtype)
        out_type = (out_type, kv, kv)
    return plgpu.kernel(
        functools.partial(_dq_kernel, p=p, interpret=interpret),
        out_type=out_type,
        scratch_types=scratch,
        grid=(p.heads_q, p.seq_q_pad // TILE * p.kv_chunks, p.batch),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=w + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
    )


# --- backward: dK/dV ------------------------------------------------------------------------


def _q_ranges(p: Problem, kv_base, q_blocks=None):
    """Query blocks for the keys ``[kv_base, kv_base + 64)``: ``(start, lo, hi, stop)``:
    blocks before ``start`` and from ``stop`` on see none of the keys (skipped), those in
    ``[start, lo)`` and ``[hi, stop)`` are masked, those in ``[lo, hi)`` see all of them
    (none with segment ids or a bias). ``q_blocks``: the blocks with a query below the
    batch entry's query length (None: all)."""
    nq = -(-p.seq_q // WG_ROWS)  # (blocks of padded rows only contribute nothing)
    if q_blocks is not None:
        nq = lax.min(_i32(q_blocks), _i32(nq))
    start, lo, hi, stop = 0, 0, nq, nq
    if p.left is not None:  # query i sees key j only if i <= j - offset + left: stop, hi
        stop = _clip(_cdiv(kv_base + (WG_ROWS - p.offset + p.left), WG_ROWS), nq)
        hi = _fdiv(kv_base + (1 - p.offset + p.left), WG_ROWS)
    if p.right is not None:  # ... and if i >= j - offset - right: start, lo
        start = lax.min(_clip(_fdiv(kv_base - (p.offset + p.right), WG_ROWS), nq), stop)
        lo = _clip(_cdiv(kv_base + (WG_ROWS - 1 - p.offset - p.right), WG_ROWS), nq)
        lo = lax.min(lax.max(lo, start), stop)
    if p.left is not None:
        hi = lax.min(lax.max(hi, lo), stop)
    return start, lo, lo if p.every_block_masked else hi, stop


def _tile_q_span(p: Problem, t):
    """``(start, stop)``: the query blocks that key tile ``t`` (of two 64-key groups) sees."""
    return _q_ranges(p, t * TILE)[0], _q_ranges(p, t * TILE + WG_ROWS)[3]


def _live_tiles(p: Problem, kv_len=None):
    """Key tiles that see any query: those before ``kv_len`` (all without lengths)."""
    return p.kv_tiles if kv_len is None else lax.min(_cdiv(kv_len, TILE), _i32(p.kv_tiles))


def _dq_turns(p: Problem, t, qi, kv_len=None):
    """``(follows, followed)`` of key tile ``t``'s dQ partial for query block ``qi``
    (:attr:`Problem.dkv_dq`): whether tile ``t − 1`` adds one before it, and tile ``t + 1``
    one after it. The tiles that see a query block are consecutive (a tile's query span
    moves forward with its keys), so the partials go in key order, each tile taking its
    turn from the one before. Tiles past ``kv_len`` see no query.

    The turns are counted on a semaphore per block (and head and column half) that every
    tile from the first on raises by one once it is done with the block: tile ``t``
    waits for ``t``, and the last of the chain takes the count back to 0. A tile before
    the chain that will not see the block (a window's) raises it as it starts
    (:func:`_dq_passes`)."""
    live = _live_tiles(p, kv_len)
    return (
        (t >= 1) & (t - 1 < live) & (qi < _tile_q_span(p, t - 1)[1]),
        (t + 1 < live) & (qi >= _tile_q_span(p, t + 1)[0]),
    )


def _dq_turn(p: Problem, t, qi, kv_len=None):
    """What key tile ``t`` does on block ``qi``'s semaphore (:func:`_dq_turns`):
    ``(follows, waits, clears, hands_on)``: it adds onto earlier tiles' partials; it waits
    for the count ``t`` before adding (for the turn, or, first of a chain that a window
    starts late, to clear the passes); it takes the count back to 0 as it does (the last
    of the chain); it raises the count by one once its partial has landed."""
    follows, followed = _dq_turns(p, t, qi, kv_len)
    last = jnp.logical_not(followed)  # (not ``~``: the turns may be Python bools)
    return follows, (follows & followed) | ((t > 0) & last), last, followed


def _dq_in_key_order(p: Problem, parts: jax.Array, kv_lengths) -> jax.Array:
    """dQ's f32 accumulator from the key tiles' ``(kv_tiles, B, Sq_pad, Hq, D)`` partials
    of the interpreted dkv_dq kernel, summed as the GPU's reduce-adds sum them: block by
    block, the first tile's stored, each later one that sees it added, in key order.

    The interpreter runs the CTAs one after the other but models them as concurrent: a
    read-add-write of one accumulator (it has neither TMA's reduce-add nor semaphores) is
    a race there, as it would be on the GPU."""
    qi = jnp.arange(p.seq_q_pad // WG_ROWS)[None]  # (1, query blocks of 64 rows)
    kv_len = None if kv_lengths is None else _clamped(kv_lengths, p.seq_kv)[:, None]
    live = _live_tiles(p, kv_len)
    acc = jnp.zeros(parts.shape[1:], jnp.float32)
    for t in range(p.kv_tiles):
        start, stop = _tile_q_span(p, t)
        seen = (t < live) & (qi >= start) & (qi < stop)  # (B or 1, query blocks)
        follows = _dq_turns(p, t, qi, kv_len)[0]
        seen, follows = (jnp.repeat(x, WG_ROWS, axis=-1)[..., None, None] for x in (seen, follows))
        acc = jnp.where(seen, jnp.where(follows, acc + parts[t], parts[t]), acc)
    return acc


def _dq_passes(p: Problem, t, kv_len=None):
    """``[first, stop)``: the query blocks past key tile ``t``'s span that a later tile sees
    (the window's): the tile passes their turns on at its start (:func:`_dq_turns`)."""
    last = _live_tiles(p, kv_len) - 1
    return _tile_q_span(p, t)[1], _tile_q_span(p, last)[1]


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    lengths_ref,
    q_seg_ref,
    kv_seg_ref,
    bias_ref,
    dk_ref,
    dv_ref,
    *refs,
    p,
    interpret,
):
    dq_ref, *scratch = refs if p.dkv_dq else (None, *refs)
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, stage = scratch[:7]
    kv_bar, q_bar, do_bar, lse_bar, delta_bar, done, p_smem, p_ready, p_free = scratch[7:16]
    # Segment ids: the key rows' (per key-row group), a ring of the streamed query blocks'.
    kseg_smem, qseg_smem, kseg_bar, qseg_bar = scratch[16:20]
    # The bias: a ring of (64 queries, key rows) tiles, read transposed, or of the vectors
    # of the key rows, per key-row group, beside Q and dO.
    bias_smem, bias_bar = scratch[20:22]
    # dkv_dq: both warpgroups' dSᵀ, each one's f32 half of the dQ partial and the
    # hand-over's barriers.
    ds_smem, dq_stage, ds_ready, ds_free = scratch[22:] if p.dkv_dq else [None] * 4
    roles = p.dkv_roles
    b, hk = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    # The CTA's key tiles, one after the other: ``tiles`` from ``first`` on.
    first = lax.axis_index("kv_seq") * p.dkv_tiles
    tiles = p.dkv_tiles
    if p.kv_tiles % p.dkv_tiles:  # the last CTA has fewer
        tiles = lax.min(_i32(p.dkv_tiles), p.kv_tiles - first)

    def tile_rows(t):
        return (first + t) * p.dkv_rows

    # The CTA's query blocks: from its first key rows' first to its last key rows' last,
    # and (query lengths) before the batch entry's padded queries. (dkv_dq's turns count
    # on every tile seeing its whole span: it streams the padded blocks.)
    q_len = None if p.dkv_dq else _q_len(p, lengths_ref, b)
    q_blocks = None if q_len is None else _cdiv(q_len, WG_ROWS)
    cta_start = _q_ranges(p, tile_rows(0), q_blocks)[0]
    cta_stop = _q_ranges(p, tile_rows(tiles) - WG_ROWS, q_blocks)[3]
    # Key rows past the batch entry's length (whole tiles of them) see no query: their
    # loops only skip, or a CTA of them has none (the wrapper zeroes such rows' gradients).
    kv_len = _kv_len(p, lengths_ref, b) if p.kv_lengths else None
    if kv_len is not None:
        cta_stop = lax.select(tile_rows(0) < kv_len, _i32(cta_stop), _i32(cta_start))
    per_head = cta_stop - cta_start
    per_tile = p.group * per_head  # query steps per key tile
    bq, bkv, s = WG_ROWS, WG_ROWS, p.dkv_stages

    def qh(step):
        """``(query head, first query row)`` of the CTA's query step ``step``: every key
        tile streams the same query steps, heads of the group, then blocks."""
        local = lax.rem(step, per_tile)
        return hk * p.group + lax.div(local, per_head), (cta_start + lax.rem(local, per_head)) * bq

    @pl.when(wg < NUM_COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(p.wg_regs[0], action="increase")
        stg = None if stage is None else stage.at[wg]  # the interpreter's A-operand slot
        # Each warpgroup owns 64 key rows of a tile, or (roles) both share the tile's 64.
        r = 0 if roles else wg
        ks, vs = k_smem.at[r], v_smem.at[r]
        zeros = jnp.zeros((bkv, p.head_dim), jnp.float32)

        def wait(slot):
            for bars in (q_bar, do_bar, lse_bar, delta_bar) + ((qseg_bar,) if p.segments else ()):
                plgpu.barrier_wait(bars.at[slot])

        def bias_regs(slot):
            return _bias_load(p, bias_smem, bias_bar, slot, r, 0, interpret)

        def probs(st, slot, qi, kv_base, masked: bool, raw_bias=None):
            lse = lse_smem[slot]
            st = st * p.c
            if raw_bias is None:
                raw_bias = bias_regs(slot)
            bias = _bias_exp2(p, raw_bias, (bkv, bq), 0)
            if bias is not None:
                st = st + bias
            pt = jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))
            if masked:
                segs = (kseg_smem[r], qseg_smem[slot]) if p.segments else None
                vis = _mask((bkv, bq), kv_base, qi * bq, rows_are_q=False, p=p, segs=segs)
                if vis is not None:  # (a bias alone masks no index)
                    pt = jnp.where(vis, pt, 0.0)
            if p.dkv_dq and kv_len is not None:
                # Keys past the length would reach dQ (their dK and dV are zeroed later).
                keys = kv_base + lax.broadcasted_iota(jnp.int32, pt.shape, 0)
                pt = jnp.where(keys < kv_len, pt, 0.0)
            return pt

        def dscores(pt, dpt, slot):
            delta = delta_smem[slot]
            return pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))

        def step(qi, carry, t, g, masked: bool):
            dk, dv = carry
            n = t * per_tile + g * per_head + qi - cta_start
            slot = _slot(n, s)
            wait(slot)
            qt, dot = q_smem.at[slot].transpose((1, 0)), do_smem.at[slot].transpose((1, 0))
            qs, dos = q_smem.at[slot], do_smem.at[slot]
            kv_base = tile_rows(t) + r * bkv
            if p.dkv_paired:
                # Two waits for the tensor cores per step: Sᵀ and dPᵀ (which need only
                # shared memory) together, then dV and dK together.
                # The bias's shared-memory reads beside the tensor cores' products.
                raw_bias = bias_regs(slot)
                st, dpt = _dots((bkv, bq), (ks, qt), (vs, dot))
                pt = probs(st, slot, qi, kv_base, masked, raw_bias)
                dst = dscores(pt, dpt, slot).astype(p.dtype)
                dv, dk = _dots_acc(
                    [(dv, pt.astype(p.dtype), dos), (dk, dst, qs)],
                    stg,
                    interpret=interpret,
                )
            else:
                # One product at a time: fewer registers live, four waits per step.
                pt = probs(_dot((bkv, bq), ks, qt), slot, qi, kv_base, masked)
                dpt = _dot((bkv, bq), vs, dot)
                dv = _dot_acc(dv, pt.astype(p.dtype), dos, stg, interpret=interpret)
                dst = dscores(pt, dpt, slot).astype(p.dtype)
                dk = _dot_acc(dk, dst, qs, stg, interpret=interpret)
            plgpu.barrier_arrive(done.at[slot])
            if p.dkv_dq:
                dq_part(n, qi, g, dst)
            return dk, dv

        # dkv_dq (one key tile per CTA): the tile's dQ partial of each step, over both
        # warpgroups' keys, goes to the f32 accumulator ``dq_ref`` in key-tile order. A
        # semaphore per query block, head and column half counts the tiles that have added
        # theirs (:func:`_dq_turns`): tile ``t`` waits for the count ``t`` (tiles that a
        # window puts before a block's chain raise it as they start; the chain's last tile
        # takes it back to 0).
        nqb = p.seq_q_pad // bq
        sems = None
        if p.dkv_dq and not interpret:
            n_sems = p.batch * p.heads_q * nqb * NUM_COMPUTE_WGS
            sems = pl.get_global(plgpu.SemaphoreType.REGULAR((n_sems,)))
        t_cta = lax.axis_index("kv_seq")

        def sem_of(qi, h, half):
            return sems.at[((b * p.heads_q + h) * nqb + qi) * NUM_COMPUTE_WGS + half]

        def hand_on(n, half):
            """Step ``n``'s partial has reached the accumulator: the next tile's turn."""
            if sems is None:
                return
            h, q0 = qh(n)
            qi = lax.div(q0, bq)

            @pl.when(_dq_turn(p, t_cta, qi, kv_len)[3])
            def _():
                plgpu.semaphore_signal(sem_of(qi, h, half), 1, memory_scope="gpu")

        def take_turn(qi, h, half):
            """Waits for the tiles before this one to be done with block ``qi`` of head
            ``h``; returns whether any of them added a partial."""
            follows, waits, clears, _ = _dq_turn(p, t_cta, qi, kv_len)
            if sems is not None:
                sem = sem_of(qi, h, half)
                for clear in (False, True):

                    @pl.when(waits & (clears == clear))
                    def _(clear=clear):
                        plgpu.semaphore_wait(sem, t_cta, decrement=clear, memory_scope="gpu")

            return follows

        if sems is not None and p.left is not None:

            @pl.loop(*_dq_passes(p, t_cta, kv_len))
            def _(qi):
                for g in range(p.group):
                    plgpu.semaphore_signal(sem_of(qi, hk * p.group + g, wg), 1, memory_scope="gpu")

        def dq_half(n, qi, g, half):
            """Columns ``half`` of the tile's dQ partial, from both warpgroups' dSᵀ, added
            to the accumulator in turn."""
            cols = pl.ds(half * (p.head_dim // 2), p.head_dim // 2)
            dst = [ds_smem.at[i].transpose((1, 0)) for i in range(NUM_COMPUTE_WGS)]
            keys = [k_smem.at[i, :, cols] for i in range(NUM_COMPUTE_WGS)]
            dq = _dot((bq, p.head_dim // 2), dst, keys)
            plgpu.barrier_arrive(ds_free)
            # The last step's partial has left the stage and reached the accumulator.
            plgpu.wait_smem_to_gmem(0)
            pl.when(n > 0)(lambda: hand_on(n - 1, half))
            stage = dq_stage.at[half]
            h = hk * p.group + g
            stage[...] = dq
            if interpret:  # each tile's partial apart (:func:`_dq_in_key_order`)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(stage, dq_ref.at[t_cta, b, pl.ds(qi * bq, bq), h, cols])
                return
            out = dq_ref.at[b, pl.ds(qi * bq, bq), h, cols]
            follows = take_turn(qi, h, half)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage, out, predicate=follows, reduction_op="add")
            plgpu.copy_smem_to_gmem(stage, out, predicate=~follows)

        def dq_part(n, qi, g, dst):
            """Hands this warpgroup's dSᵀ (16-bit) of step ``n`` over, then adds its half
            of the dQ partial."""
            _wait_if(n > 0, [ds_free])()  # both have read the last step's
            ds_smem.at[r][...] = dst
            plgpu.commit_smem()
            plgpu.barrier_arrive(ds_ready)
            plgpu.barrier_wait(ds_ready)
            for half in range(NUM_COMPUTE_WGS):
                pl.when(wg == half)(functools.partial(dq_half, n, qi, g, half))

        def dq_drain():
            """After the last step: its turn handed on, and the other warpgroup done with
            this one's K (the write of dK goes through it)."""
            n_steps = tiles * per_tile
            plgpu.wait_smem_to_gmem(0)
            pl.when(n_steps > 0)(lambda: hand_on(n_steps - 1, wg))
            _wait_if(n_steps > 0, [ds_free])()

        def step_dv(qi, dv, t, g, masked: bool):
            # Roles, warpgroup 0: Pᵀ from Sᵀ = K·Qᵀ, handed to warpgroup 1 through shared
            # memory (in f32: the dK warpgroup forms dSᵀ from it), then dV += Pᵀ·dO.
            n = t * per_tile + g * per_head + qi - cta_start
            slot = _slot(n, s)
            wait(slot)
            st = _dot((bkv, bq), ks, q_smem.at[slot].transpose((1, 0)))
            pt = probs(st, slot, qi, tile_rows(t), masked)
            _wait_if(n > 0, [p_free])()  # the dK warpgroup has read the previous Pᵀ
            p_smem[...] = pt
            plgpu.barrier_arrive(p_ready)
            dv = _dot_acc(dv, pt.astype(p.dtype), do_smem.at[slot], stg, interpret=interpret)
            plgpu.barrier_arrive(done.at[slot])
            return dv

        def step_dk(qi, dk, t, g, masked: bool):
            # Roles, warpgroup 1: dPᵀ = V·dOᵀ (beside warpgroup 0's Sᵀ on the tensor cores),
            # then dSᵀ with warpgroup 0's Pᵀ, and dK += dSᵀ·Q.
            del masked  # Pᵀ arrives masked (and biased)
            n = t * per_tile + g * per_head + qi - cta_start
            slot = _slot(n, s)
            wait(slot)
            dpt = _dot((bkv, bq), vs, do_smem.at[slot].transpose((1, 0)))
            plgpu.barrier_wait(p_ready)
            pt = p_smem[...]
            plgpu.barrier_arrive(p_free)
            dst = dscores(pt, dpt, slot)
            dk = _dot_acc(dk, dst.astype(p.dtype), q_smem.at[slot], stg, interpret=interpret)
            plgpu.barrier_arrive(done.at[slot])
            return dk

        def skip(qi, _, t, g):
            n = t * per_tile + g * per_head + qi - cta_start
            slot = _slot(n, s)
            wait(slot)
            # The bias is read by the warpgroup(s) computing Pᵀ: with roles, warpgroup 0.
            flush = functools.partial(_bias_flush, p, bias_smem, bias_bar, slot, r)
            pl.when(wg == 0)(flush) if roles else flush()
            plgpu.barrier_arrive(done.at[slot])
            if p.dkv_dq:  # the other warpgroup's keys see the block: its dQ partial
                dq_part(n, qi, g, jnp.zeros((bkv, bq), p.dtype))

        def tile(t, body, carry, write):
            """Key tile ``t``: load its K/V (and ids), run ``body`` over its query steps
            from ``carry``, and ``write`` the result."""
            kv_base = tile_rows(t) + r * bkv
            rows = pl.ds(kv_base, bkv)
            for i, (ref, buf) in enumerate(((k_ref, ks), (v_ref, vs))):

                def load(ref=ref, buf=buf, i=i):
                    plgpu.copy_gmem_to_smem(ref.at[b, rows, hk], buf, kv_bar.at[2 * r + i])
                    plgpu.barrier_wait(kv_bar.at[2 * r + i])

                # With roles, the dV warpgroup (0) reads only K, the dK warpgroup (1) only V.
                pl.when(wg == i)(load) if roles else load()
            if p.dkv_dq:  # the dQ partial reads the other warpgroup's K too
                plgpu.barrier_wait(kv_bar.at[2 * (1 - r)])

            if p.segments:  # the key rows' ids, read by the warpgroup(s) computing Pᵀ

                def load_ids():
                    plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, rows], kseg_smem.at[r], kseg_bar.at[r])
                    plgpu.barrier_wait(kseg_bar.at[r])

                pl.when(wg == 0)(load_ids) if roles else load_ids()

            start, lo, hi, stop = _q_ranges(p, kv_base, q_blocks)
            # A tile past the length skips its CTA's steps (a CTA of such tiles has none).
            dead_tiles = kv_len is not None and p.dkv_tiles > 1
            if kv_len is not None:
                start, lo, hi, stop = (
                    lax.select(tile_rows(t) < kv_len, _i32(x), _i32(cta_stop))
                    for x in (start, lo, hi, stop)
                )

            def head(g, carry):
                # The group's query heads in a fixed order: their dK/dV sum in the
                # accumulator.
                masked = functools.partial(body, t=t, g=g, masked=True)
                skips = functools.partial(skip, t=t, g=g)
                if p.right is not None or dead_tiles:
                    lax.fori_loop(cta_start, start, skips, None)
                if p.every_block_masked:  # lo == hi: one loop, one copy of the masked body
                    carry = lax.fori_loop(start, stop, masked, carry)
                else:
                    if p.right is not None:
                        carry = lax.fori_loop(start, lo, masked, carry)
                    unmasked = functools.partial(body, t=t, g=g, masked=False)
                    carry = lax.fori_loop(lo, hi, unmasked, carry)
                    if p.left is not None:
                        carry = lax.fori_loop(hi, stop, masked, carry)
                if p.left is not None:
                    lax.fori_loop(stop, cta_stop, skips, None)
                return carry

            write(rows, lax.fori_loop(0, p.group, head, carry))

        def write(rows, *results):
            # Each result goes out through a K or V tile that only this warpgroup reads; the
            # next tile's loads wait for the copies.
            if p.dkv_dq:
                dq_drain()
            for buf, value, _ in results:
                buf[...] = value.astype(p.dtype)
            plgpu.commit_smem()
            for buf, _, out_ref in results:
                plgpu.copy_smem_to_gmem(buf, out_ref.at[b, rows, hk])
            plgpu.wait_smem_to_gmem(0)

        def tiles_loop(body, carry, out):
            def one(t, _):
                tile(t, body, carry, lambda rows, acc: write(rows, *out(acc)))

            lax.fori_loop(0, tiles, one, None)

        if not roles:
            tiles_loop(
                step,
                (zeros, zeros),
                lambda acc: [(ks, acc[0] * p.scale, dk_ref), (vs, acc[1], dv_ref)],
            )
            return

        @pl.when(wg == 0)
        def _dv():
            tiles_loop(step_dv, zeros, lambda dv: [(ks, dv, dv_ref)])
            # Observe the last hand-over's release too (every barrier phase is awaited).
            _wait_if(tiles * per_tile > 0, [p_free])()

        @pl.when(wg == 1)
        def _dk():
            tiles_loop(step_dk, zeros, lambda dk: [(vs, dk * p.scale, dk_ref)])

    @pl.when(wg == NUM_COMPUTE_WGS)
    def _memory():
        def rows_of(ref):
            def src(step):
                h, q0 = qh(step)
                return ref.at[b, pl.ds(q0, bq), h]

            return src

        def vec_of(ref):
            def src(step):
                h, q0 = qh(step)
                return ref.at[b, h, pl.ds(q0, bq)]

            return src

        def ids_of(step):
            return q_seg_ref.at[b, pl.ds(qh(step)[1], bq)]

        def bias_of(step, i):
            h, q0 = qh(step)
            bb, bh = (b if p.bias_batch else 0), (h if p.bias_heads else 0)
            keys = pl.ds(tile_rows(lax.div(step, per_tile)) + i * WG_ROWS, WG_ROWS)
            if p.bias == "rows":
                return bias_ref.at[bb, bh, keys]
            return bias_ref.at[bb, bh, pl.ds(q0, bq), keys]

        loads = [(rows_of(q_ref), q_smem, q_bar), (rows_of(do_ref), do_smem, do_bar)]
        vectors = [(vec_of(lse_ref), lse_smem, lse_bar), (vec_of(delta_ref), delta_smem, delta_bar)]
        if p.segments:
            vectors.append((ids_of, qseg_smem, qseg_bar))
        loads += _generic_reads(vectors)
        loads += _bias_loads(p, bias_smem, bias_bar, bias_of)
        _producer(p, tiles * per_tile, s, [(done, loads)])


def _build_dkv(p: Problem, interpret: bool) -> Any:
    d, s, w = p.head_dim, p.dkv_stages, NUM_COMPUTE_WGS
    groups = p.dkv_rows // WG_ROWS
    stage = _smem((w, WG_ROWS, WG_ROWS), p.dtype) if interpret else None
    roles = p.dkv_roles
    scratch = [
        _smem((groups, WG_ROWS, d), p.dtype),  # K, per key-row group
        _smem((groups, WG_ROWS, d), p.dtype),  # V
        _smem((s, WG_ROWS, d), p.dtype),  # Q ring
        _smem((s, WG_ROWS, d), p.dtype),  # dO ring
        plgpu.SMEM((s, WG_ROWS), jnp.float32),
        plgpu.SMEM((s, WG_ROWS), jnp.float32),
        stage,
        plgpu.Barrier(num_barriers=2 * groups),  # per key-row group: K, V
        plgpu.Barrier(num_barriers=s),
        plgpu.Barrier(num_barriers=s),
        plgpu.Barrier(num_barriers=s),
        plgpu.Barrier(num_barriers=s),
        plgpu.Barrier(num_arrivals=w, num_barriers=s),
        # Roles: Pᵀ handed from the dV warpgroup to the dK warpgroup, and its release.
        plgpu.SMEM((WG_ROWS, WG_ROWS), jnp.float32) if roles else None,
        plgpu.Barrier() if roles else None,
        plgpu.Barrier() if roles else None,
        *_segment_scratch(p, groups, s, WG_ROWS),
        *_bias_scratch(p, s, groups, WG_ROWS),  # (a vector of 64 keys, or 64 queries)
    ]
    kv = jax.ShapeDtypeStruct((p.batch, p.seq_kv_pad, p.heads_kv, d), p.dtype)
    out_type = (kv, kv)
    if p.dkv_dq:
        scratch += [
            _smem((w, WG_ROWS, WG_ROWS), p.dtype),  # dSᵀ, per warpgroup
            plgpu.SMEM(  # the dQ partial's halves, f32, as TMA stores them
                (w, WG_ROWS, d // 2),
                jnp.float32,
                transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)),
            ),
            plgpu.Barrier(num_arrivals=w),
            plgpu.Barrier(num_arrivals=w),
        ]
        # (the interpreter: each key tile's partial apart, :func:`_dq_in_key_order`)
        tiles = (p.kv_tiles,) if interpret else ()
        dq = jax.ShapeDtypeStruct((*tiles, p.batch, p.seq_q_pad, p.heads_q, d), jnp.float32)
        out_type += (dq,)
    return plgpu.kernel(
        functools.partial(_dkv_kernel, p=p, interpret=interpret),
        out_type=out_type,
        scratch_types=scratch,
        grid=(p.heads_kv, -(-p.kv_tiles // p.dkv_tiles), p.batch),
        grid_names=("heads", "kv_seq", "batch"),
        num_threads=w + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
    )


# --- the wrappers (Kernel calling convention of primitives/_core.py) ------------------------


def _pad_seq(x: jax.Array, n: int, value: float = 0.0) -> jax.Array:
    """``x`` zero-padded (or ``value``-padded) along its sequence axis 1 to ``n``."""
    if x.shape[1] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def _pad_last(x: jax.Array, n: int, value: float) -> jax.Array:
    if x.shape[-1] == n:
        return x
    pad = [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])]
    return jnp.pad(x, pad, constant_values=value)


def _decode(spec: AttentionSpec) -> tuple[bool, float]:
    return bool(spec.causal), float(spec.scale)


def _with_features(p: Problem, spec: AttentionSpec, bias=None) -> Problem:
    """``p`` with the spec's masks: its window, whether lengths and segment ids are read, and
    the folded ``bias`` (:func:`_bias_operand`; None: no mask or bias)."""
    return dataclasses.replace(
        p,
        window=spec.local_window_size,
        kv_lengths=spec.has_kv_lengths,
        q_lengths=spec.has_q_lengths,
        segments=spec.has_segment_ids,
        bias=None if bias is None else _bias_kind(bias.shape),
        bias_batch=bias is not None and bias.shape[0] > 1,
        bias_heads=bias is not None and bias.shape[1] > 1,
    )


def _bias_kind(shape) -> str:
    """:attr:`Problem.bias` of a folded bias of ``shape``: ``"rows"`` for one query row."""
    return "rows" if shape[2] == 1 else "tiles"


def _extras_bias_kind(spec: AttentionSpec, extras) -> str | None:
    """:attr:`Problem.bias` of the user's ``mask`` and ``bias`` (arrays or avals, rank 4):
    rows where neither has more than one query row."""
    ex = spec.split(extras)
    given = [x for x in (ex.mask, ex.bias) if x is not None]
    if not given:
        return None
    return _bias_kind((1, 1, max(x.shape[2] for x in given)))


def _bias_operand(spec: AttentionSpec, ex, q, k) -> jax.Array | None:
    """The user's ``mask`` and ``bias`` as one additive ``(Bb, Hb, Sq or 1, Skv)`` array
    (``Bb``, ``Hb`` and the query dim are 1 where both broadcast along them; None without
    either): f32, or a 16-bit ``bias`` without a mask as it is (f32 holds it exactly; the
    kernels convert it), so that a kernel of its dtype reads the user's array, not a copy.

    It is ``-inf`` where the mask hides a key (a row it empties gets no probability, as
    the reference's); the kernels take it to the exp2 domain (:func:`_bias_tile`).
    """
    if ex.mask is None and ex.bias is None:
        return None
    if ex.mask is None and np.dtype(ex.bias.dtype) in DTYPES:
        x = ex.bias
    else:
        x = jnp.zeros((1, 1, 1, 1), jnp.float32)
        if ex.bias is not None:
            x = ex.bias.astype(jnp.float32)
        if ex.mask is not None:
            x = jnp.where(ex.mask, x, -jnp.inf)
    return jnp.broadcast_to(x, (*x.shape[:3], k.shape[1]))


def _bias_for_kernel(p: Problem, bias) -> jax.Array:
    """The kernels' bias operand (one for the three: the dK/dV kernel reads its tiles
    transposed): tiles: ``bias`` in the 16-bit dtype, its query rows materialised,
    zero-padded to whole tiles; rows: the f32 ``(Bb, Hb, Skv)`` vectors, zero-padded.
    Padded rows and columns are masked by position. Finite values beyond the 16-bit range
    are clipped to it: a large finite bias stays finite (the reference's softmax of such
    values is not that of ``-inf``). A bias in the kernel's dtype whose tiles need no padding
    is the operand itself: XLA passes the user's buffer (a copy of a (B, H, S, S) bias is a
    read and a write of it, each call). Without a bias, a placeholder that is not read."""
    if bias is None:
        return jnp.zeros((1, 1, 1, 1), p.dtype)
    if p.bias == "rows":
        return _pad_last(bias[:, :, 0].astype(jnp.float32), p.seq_kv_pad, 0.0)
    if bias.dtype != p.dtype:
        big = float(jnp.finfo(p.dtype).max)
        bias = bias.astype(jnp.float32)
        bias = jnp.where(jnp.isinf(bias), bias, jnp.clip(bias, -big, big)).astype(p.dtype)
    bias = jnp.broadcast_to(bias, (*bias.shape[:2], p.seq_q, p.seq_kv))
    rows, cols = p.seq_q_pad, p.seq_kv_pad
    if (rows, cols) == bias.shape[2:]:
        return bias
    return jnp.pad(bias, [(0, 0), (0, 0), (0, rows - bias.shape[2]), (0, cols - bias.shape[3])])


def _segment_operands(p: Problem, ex) -> tuple[jax.Array, jax.Array]:
    """The kernels' int32 segment ids of queries and keys, padded to whole tiles (padded
    rows are masked by position); without segment ids, placeholders that are not read."""
    if ex.q_segment_ids is None:
        unread = jnp.zeros((1, 1), jnp.int32)
        return unread, unread
    return _pad_seq(ex.q_segment_ids, p.seq_q_pad), _pad_seq(ex.kv_segment_ids, p.seq_kv_pad)


def _lengths_operand(p: Problem, kv_lengths, q_lengths) -> jax.Array:
    """The kernels' int32 ``(2, B)`` key and query counts: the user's, or ``seq_kv`` and
    ``seq_q`` (then not read)."""

    def row(lengths, seq):
        full = jnp.full((p.batch,), seq, jnp.int32)
        return full if lengths is None else lengths.astype(jnp.int32)

    return jnp.stack([row(kv_lengths, p.seq_kv), row(q_lengths, p.seq_q)])


def _positions_below(lengths, seq: int) -> jax.Array:
    """``(B, seq)`` bool: position ``i`` of batch entry ``b`` is below ``lengths[b]``."""
    return jnp.arange(seq, dtype=jnp.int32)[None, :] < lengths[:, None]


def kernel_head_dim(d: int) -> int | None:
    """The head dim the kernels run ``d`` at: the smallest of :data:`HEAD_DIMS` at least
    ``d`` (None: none is). Q, K and V are zero-padded to it: the padded columns add
    nothing to the scores, and the output's and gradients' padded columns are cut off."""
    return next((h for h in HEAD_DIMS if h >= d), None)


def _pad_head_dim(x: jax.Array, d: int) -> jax.Array:
    return x if x.shape[-1] == d else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - x.shape[-1])])


def flash_fwd(
    spec,
    q,
    k,
    v,
    *extras,
    interpret: bool = False,
    block_kv: int | None = None,
    pipelined: bool | None = None,
    split_keys: int | None = None,
    pingpong: bool | None = None,
    compute_regs: int | None = None,
    persistent: bool | None = None,
    ctas: int | None = None,
):
    """``(out, lse)`` of ``ts_flash_attention_fwd`` (``lse`` natural log, ``(B, Hq, Sq)``).

    ``extras``: the spec's mask, bias, query/key lengths and segment ids
    (:data:`FEATURES`). Padded queries (from ``query_seq_lengths`` on) are zeroed after the
    kernel, with ``lse = -inf`` (which zeroes their gradients in :func:`flash_bwd`); the
    kernels skip the blocks holding only such queries. Where the kernel splits the keys
    (:func:`default_split_keys`), the chunks' outputs and lse are combined in f32 in a fixed
    order (:func:`_combine_chunks`).

    ``block_kv``, ``pipelined``, ``pingpong`` and ``split_keys`` (benchmarks, tests)
    replace the tuned keys per loop step (:data:`FWD_BLOCK_KV`, :func:`_fwd_block_kv` with a
    bias), loop schedule (:func:`_fwd_pipelined`), whether the pipelined loop's warpgroups
    take turns (:data:`FWD_PINGPONG`; the serial loop always does) and keys per chunk (a
    multiple of the keys per step; at least ``seq_kv``: no split); a ``block_kv`` whose K/V
    (and bias) ring does not fit shared memory is a ValueError, and so is
    ``pingpong=False`` with the serial loop. ``compute_regs`` replaces the compute
    warpgroups' registers (:data:`COMPUTE_REGS`; no bit depends on it), and
    ``persistent`` whether the grid is persistent and ``ctas`` its CTA count
    (:func:`_fwd_ctas`; no bit depends on either).
    """
    knobs = (("pipelined", pipelined), ("pingpong", pingpong), ("persistent", persistent))
    for name, knob in knobs:
        if knob is not None and not isinstance(knob, bool):
            raise TypeError(f"attention_mgpu.flash_fwd: {name}={knob!r} must be a bool or None")
    reason = supports(spec, (q, k, v, *extras))
    if reason is not None:
        raise ValueError(f"attention_mgpu.flash_fwd: this kernel cannot run the case: {reason}")
    # (for the calls on padded head dims or a folded group)
    _check_compute_regs("flash_fwd", compute_regs)
    knobs = dict(
        block_kv=block_kv,
        pipelined=pipelined,
        split_keys=split_keys,
        pingpong=pingpong,
        compute_regs=compute_regs,
        persistent=persistent,
        ctas=ctas,
    )
    d = q.shape[-1]
    if kernel_head_dim(d) != d:
        q, k, v = (_pad_head_dim(x, kernel_head_dim(d)) for x in (q, k, v))
        out, lse = flash_fwd(spec, q, k, v, *extras, interpret=interpret, **knobs)
        return out[..., :d], lse
    if (g := _folded_group(spec, q, k)) > 1:
        out, lse = flash_fwd(
            _unfolded_spec(spec), _fold(q, g), k, v, *extras, interpret=interpret, **knobs
        )
        return _unfold(out, g), _unfold_rows(lse, g)
    kind = _extras_bias_kind(spec, extras)
    if block_kv is not None and (
        block_kv not in FWD_BLOCK_KV_CHOICES or _fwd_stages(q.shape[-1], block_kv, kind) < 2
    ):
        raise ValueError(
            f"attention_mgpu.flash_fwd: {block_kv=} must be one of {FWD_BLOCK_KV_CHOICES} with "
            f"two K/V slots fitting shared memory at head_dim {q.shape[-1]}"
        )
    causal, scale = _decode(spec)
    ex = spec.split(extras)
    bias = _bias_operand(spec, ex, q, k)
    p = _with_features(_fwd_problem(q, k, causal, scale, block_kv, kind, split_keys), spec, bias)
    sms = device.sm_counts(interpret=interpret).grid
    p = dataclasses.replace(p, fwd_ctas=_fwd_ctas(p, sms, persistent, ctas))
    pipelined = _fwd_pipelined(p) if pipelined is None else pipelined
    if pingpong is None:
        pingpong = FWD_PINGPONG[p.head_dim] or not pipelined
    elif not (pingpong or pipelined):
        raise ValueError("attention_mgpu.flash_fwd: pingpong=False needs the pipelined loop")
    p = dataclasses.replace(
        p, fwd_pipelined=pipelined, fwd_pingpong=pingpong, compute_regs=compute_regs
    )
    qp = _pad_seq(q, p.seq_q_pad)
    kp, vp = _pad_seq(k, p.seq_kv_pad), _pad_seq(v, p.seq_kv_pad)
    lengths = _lengths_operand(p, ex.kv_lengths, ex.q_lengths)
    operands = (qp, kp, vp, lengths, *_segment_operands(p, ex), _bias_for_kernel(p, bias))
    out, lse = device.run_mosaic(_build_fwd(p, interpret), operands, interpret=interpret)
    if p.kv_chunks > 1:
        out, lse = _combine_chunks(out[..., : p.seq_q, :, :], lse[..., : p.seq_q])
    else:
        out, lse = out[:, : p.seq_q], lse[:, :, : p.seq_q]
    if ex.q_lengths is not None:
        real = _positions_below(ex.q_lengths, p.seq_q)
        out = jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
        lse = jnp.where(real[:, None, :], lse, -jnp.inf)
    return out, lse


def flash_bwd(
    spec,
    q,
    k,
    v,
    out,
    lse,
    dout,
    *extras,
    interpret: bool = False,
    dq_block_kv: int | None = None,
    dkv_stages: int | None = None,
    dkv_paired: bool | None = None,
    dq_split_keys: int | None = None,
    dkv_tiles: int | None = None,
    dq_dkv: bool | None = None,
    dkv_dq: bool | None = None,
    compute_regs: int | None = None,
):
    """``(dq, dk, dv)`` of ``ts_flash_attention_bwd``, bitwise reproducible.

    ``extras``: the spec's mask, bias, query/key lengths and segment ids, then the ``lse``
    cotangent if it has one (:data:`FEATURES`; the bias is not differentiated here). Keys
    past ``key_value_seq_lengths`` get zero ``dk``/``dv``.

    Where the dQ kernel splits the keys (:func:`default_split_keys`), dQ is the sum of the
    chunks' partials in f32, chunk by chunk from the first key on, each chunk's two
    16-bit terms added first; then rounded once to the inputs' dtype.

    ``dq_block_kv``, ``dkv_stages``, ``dkv_paired``, ``dq_split_keys`` and ``dkv_tiles``
    (benchmarks, tests) replace the dQ kernel's tuned keys per loop step
    (:data:`DQ_BLOCK_KV`), the dK/dV kernel's ring slots (:data:`DKV_STAGES`) and its
    schedule (:data:`DKV_PAIRED`), the dQ kernel's keys per chunk (a multiple of its keys
    per step; at least ``seq_kv``: no split) and the dK/dV kernel's key tiles per CTA
    (:func:`_dkv_tiles`; the bits do not depend on it); a choice that does not fit shared
    memory is a ValueError. ``dq_dkv``: whether the dQ kernel computes dK and dV too
    (:attr:`Problem.dq_dkv`: one kernel streams the keys once instead of two kernels
    streaming them); None: wherever :func:`_dq_dkv_reason` gives no reason (it depends
    on the query rows, the GQA group, the window and head_dim, never on batch or heads, so
    a data- or head-sharded run takes the same path on every device count) and no knob of
    the two-kernel backward is given (the dK/dV kernel's, or ``dq_block_kv`` other than
    64). True where either holds is a ValueError. The two paths sum a key's gradients
    over the same queries in a different order: for more than one query row their bits
    differ. ``dkv_dq``: whether the dK/dV kernel computes dQ too (:attr:`Problem.dkv_dq`:
    dQ sums f32 partials of 128 keys each, in key order, where the dQ kernel sums its
    products in one accumulator: other bits); None: :data:`DKV_DQ` where
    :func:`_dkv_dq_reason` gives no reason, ``dq_dkv`` is off and no knob of the dQ kernel
    (``dq_block_kv``, ``dq_split_keys``) or ``dkv_tiles`` other than 1 is given. True
    where any of these holds is a ValueError. ``compute_regs`` replaces both kernels'
    compute warpgroups' registers (:data:`COMPUTE_REGS`; no bit depends on it).
    """
    reason = supports(spec, (q, k, v, out, lse, dout, *extras))
    if reason is not None:
        raise ValueError(f"attention_mgpu.flash_bwd: this kernel cannot run the case: {reason}")
    # (for the calls on padded head dims or a folded group)
    knobs = dict(
        dq_block_kv=dq_block_kv,
        dkv_stages=dkv_stages,
        dkv_paired=dkv_paired,
        dq_split_keys=dq_split_keys,
        dkv_tiles=dkv_tiles,
        dq_dkv=dq_dkv,
        dkv_dq=dkv_dq,
        compute_regs=compute_regs,
    )
    _check_compute_regs("flash_bwd", compute_regs)
    d = q.shape[-1]
    if kernel_head_dim(d) != d:
        q, k, v, out, dout = (_pad_head_dim(x, kernel_head_dim(d)) for x in (q, k, v, out, dout))
        grads = flash_bwd(spec, q, k, v, out, lse, dout, *extras, interpret=interpret, **knobs)
        return tuple(g[..., :d] for g in grads)
    if (g := _folded_group(spec, q, k)) > 1:
        if spec.has_dlse:  # the lse cotangent comes last, rows like lse's
            extras = (*extras[:-1], _fold_rows(extras[-1], g))
        q, out, dout = (_fold(x, g) for x in (q, out, dout))
        dq, dk, dv = flash_bwd(
            _unfolded_spec(spec),
            *(q, k, v, out, _fold_rows(lse, g), dout, *extras),
            interpret=interpret,
            **knobs,
        )
        return _unfold(dq, g), dk, dv
    extra = SEGMENT_SMEM_BYTES if spec.has_segment_ids else 0
    kind = _extras_bias_kind(spec, extras[: spec.num_extras])
    if dq_block_kv is not None and (
        dq_block_kv not in DQ_BLOCK_KV_CHOICES
        or min(_dq_stages(q.shape[-1], dq_block_kv, extra, kind)) < 1
    ):
        raise ValueError(
            f"attention_mgpu.flash_bwd: {dq_block_kv=} must be one of {DQ_BLOCK_KV_CHOICES} "
            f"with one K/V slot fitting shared memory at head_dim {q.shape[-1]}"
        )
    if dkv_stages is not None and (
        dkv_stages not in DKV_STAGES_CHOICES
        or _dkv_smem(q.shape[-1], dkv_stages, kind) > SMEM_BYTES
    ):
        raise ValueError(
            f"attention_mgpu.flash_bwd: {dkv_stages=} must be one of {DKV_STAGES_CHOICES} "
            f"with the ring fitting shared memory at head_dim {q.shape[-1]}"
        )
    if dkv_tiles is not None and (
        not isinstance(dkv_tiles, int) or isinstance(dkv_tiles, bool) or dkv_tiles < 1
    ):
        raise ValueError(f"attention_mgpu.flash_bwd: {dkv_tiles=} must be an int >= 1 or None")
    if dq_dkv is not None and not isinstance(dq_dkv, bool):
        raise TypeError(f"attention_mgpu.flash_bwd: {dq_dkv=} must be a bool or None")
    # Knobs of the dK/dV kernel, or of a dQ step other than 64 keys (warpgroup 1's dK and
    # dV accumulators fill its registers at 64), ask for the two kernels.
    dkv_knobs = {"dkv_stages": dkv_stages, "dkv_paired": dkv_paired, "dkv_tiles": dkv_tiles}
    two_kernels = [f"{n}={x}" for n, x in dkv_knobs.items() if x is not None]
    if dq_block_kv not in (None, WG_ROWS):
        two_kernels.append(f"{dq_block_kv=} (dq_dkv steps {WG_ROWS} keys)")
    why = _dq_dkv_reason(spec, q, k)
    if dq_dkv and (why is not None or two_kernels):
        why = why or f"{', '.join(two_kernels)} tune the two-kernel backward"
        raise ValueError(f"attention_mgpu.flash_bwd: dq_dkv=True does not take the case: {why}")
    if dkv_dq is not None and not isinstance(dkv_dq, bool):
        raise TypeError(f"attention_mgpu.flash_bwd: {dkv_dq=} must be a bool or None")
    dq_dkv = why is None and not two_kernels and not dkv_dq if dq_dkv is None else dq_dkv
    stages = DKV_STAGES[d] if dkv_stages is None else dkv_stages
    fused_why = _dkv_dq_reason(d, stages, extra, kind)
    dq_knobs = {"dq_block_kv": dq_block_kv, "dq_split_keys": dq_split_keys}
    two_passes = [f"{n}={x}" for n, x in dq_knobs.items() if x is not None]
    two_passes += ["dq_dkv=True"] * bool(dq_dkv)
    two_passes += [f"{dkv_tiles=}"] * (dkv_tiles not in (None, 1))
    if dkv_dq and (fused_why is not None or two_passes):
        why = fused_why or f"{', '.join(two_passes)} (the dQ kernel's, or key tiles per CTA)"
        raise ValueError(f"attention_mgpu.flash_bwd: dkv_dq=True does not take the case: {why}")
    if dkv_dq is None:
        dkv_dq = DKV_DQ.get(d, False) and fused_why is None and not two_passes
    if dkv_paired is not None and not isinstance(dkv_paired, bool):
        raise TypeError(f"attention_mgpu.flash_bwd: {dkv_paired=} must be a bool or None")
    if dkv_paired is not None and q.shape[-1] not in DKV_PAIRED:
        raise ValueError(
            f"attention_mgpu.flash_bwd: {dkv_paired=} applies to head_dim "
            f"{', '.join(map(str, DKV_PAIRED))}, not {q.shape[-1]} (whose dK/dV warpgroups "
            "split roles, with a schedule of their own)"
        )
    causal, scale = _decode(spec)
    ex = spec.split(extras[: spec.num_extras])
    bias = _bias_operand(spec, ex, q, k)
    # Segment ids take shared memory too (``extra``; checked by the cuda lowering test).
    p = _bwd_problem(
        q,
        k,
        causal,
        scale,
        dq_block_kv,
        dkv_stages,
        dkv_paired,
        extra,
        kind,
        dq_split_keys,
        dkv_tiles,
        dq_dkv,
        dkv_dq,
    )
    p = dataclasses.replace(_with_features(p, spec, bias), compute_regs=compute_regs)
    delta = row_delta(out, dout, interpret, p.seq_q_pad)
    if spec.has_dlse:  # d lse / dS = P: the lse cotangent enters as −Δ does
        delta = delta - _pad_last(extras[spec.num_extras].astype(jnp.float32), p.seq_q_pad, 0.0)
    # The kernels work in the exp2 domain. Rows that saw no key (lse = -inf) and padded rows
    # get +inf, so their probabilities exp2(s - inf) are exactly 0: zero gradients.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
    lse2 = _pad_last(lse2, p.seq_q_pad, jnp.inf)
    qp, dop = _pad_seq(q, p.seq_q_pad), _pad_seq(dout, p.seq_q_pad)
    kp, vp = _pad_seq(k, p.seq_kv_pad), _pad_seq(v, p.seq_kv_pad)
    lengths = _lengths_operand(p, ex.kv_lengths, ex.q_lengths)
    operands = (qp, kp, vp, dop, lse2, delta, lengths, *_segment_operands(p, ex))
    operands += (_bias_for_kernel(p, bias),)
    if p.dkv_dq:
        dk, dv, dq = device.run_mosaic(_build_dkv(p, interpret), operands, interpret=interpret)
        if interpret:
            dq = _dq_in_key_order(p, dq, ex.kv_lengths)
        # Query blocks that no key tile sees are never written: their rows saw no key.
        seen = jnp.swapaxes(lse != -jnp.inf, 1, 2)[..., None]
        dq = jnp.where(seen, dq[:, : p.seq_q] * p.scale, 0.0).astype(p.dtype)
    else:
        if p.dq_dkv:
            dq, dk, dv = device.run_mosaic(_build_dq(p, interpret), operands, interpret=interpret)
        else:
            dq = device.run_mosaic(_build_dq(p, interpret), operands, interpret=interpret)
            dk, dv = device.run_mosaic(_build_dkv(p, interpret), operands, interpret=interpret)
        dq = _sum_chunks(dq[..., : p.seq_q, :, :]) if p.kv_chunks > 1 else dq[:, : p.seq_q]
    dk, dv = dk[:, : p.seq_kv], dv[:, : p.seq_kv]
    # Keys no query sees get zero gradients: past the lengths (the dK/dV kernel ran past
    # them in its last CTA; the dQ kernel skips their blocks) and, where the dQ kernel
    # computes dK and dV, before the window of the first query (it skips their blocks).
    real = None
    if ex.kv_lengths is not None:
        real = _positions_below(ex.kv_lengths, p.seq_kv)[:, :, None, None]
    first = first_seen_key(spec.local_window_size, p.seq_q, p.seq_kv)
    # (The operator slices off all but fewer than TILE such keys before it binds.)
    if p.dq_dkv and first > 0:
        seen = (jnp.arange(p.seq_kv) >= first)[None, :, None, None]
        real = seen if real is None else real & seen
    if real is not None:
        dk = jnp.where(real, dk, jnp.zeros((), dk.dtype))
        dv = jnp.where(real, dv, jnp.zeros((), dv.dtype))
    return dq, dk, dv


def row_delta(
    out: jax.Array, dout: jax.Array, interpret: bool = False, seq_pad: int | None = None
) -> jax.Array:
    """Δ = rowsum(dO ∘ O), ``(B, H, seq_pad)`` in f32 (zeros past Sq; ``seq_pad`` defaults
    to Sq), by a row kernel whose order of summation depends on head_dim only
    (:func:`norms_gpu.row_dot`): XLA's GPU autotuner picks the emitter of its own
    reduction, and with it the order, by timing, so two programs (one GPU and a mesh, two
    processes) rounded Δ, and then dQ and dK, differently. The kernel writes Δ in the
    layout the backward kernels read: a decoding step's backward is a chain of dependent
    launches, each adding its latency."""
    seq_pad = out.shape[1] if seq_pad is None else seq_pad
    return norms_gpu.row_dot(out, dout, interpret=interpret, seq_pad=seq_pad)


def _in_key_order(chunks: int, term) -> jax.Array:
    """``Σ_c term(c)`` over the key chunks, added one after the other from the first: the
    fixed order every combination of the kernels' partials uses."""
    return functools.reduce(lambda total, c: total + term(c), range(1, chunks), term(0))


def _chunk(parts: jax.Array, c: int) -> jax.Array:
    """Chunk ``c``'s f32 partial from a kernel's ``(2, chunks, ...)`` 16-bit pairs."""
    return parts[0, c].astype(jnp.float32) + parts[1, c].astype(jnp.float32)


def _combine_chunks(parts: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` from the forward kernel's ``(2, chunks, B, Sq, H, D)`` outputs and
    ``(chunks, B, H, Sq)`` lse, in f32: ``lse = m + log Σ_c exp(lse_c − m)`` (``m`` their
    max) and ``out = Σ_c exp(lse_c − lse)·(hi_c + lo_c)``, both sums in key order
    (:func:`_in_key_order`); a row no chunk saw keeps zeros and ``lse = -inf``."""
    # (A chain of maxima rather than a reduction over the chunk axis: elementwise, like
    # the rest of the combination. XLA fuses it into three or four kernels on the GPU; one
    # exponential over all the chunks instead of one per chunk fused into more kernels (20
    # at 16 chunks): benchmarks/archive/decode-kernel-probe-h100.txt.)
    m = functools.reduce(jnp.maximum, list(lse))
    m = jnp.where(m == -jnp.inf, 0.0, m)
    total = _in_key_order(len(lse), lambda c: jnp.exp(lse[c] - m))
    seen = total > 0
    lse_all = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)

    def term(c):
        w = jnp.where(seen, jnp.exp(lse[c] - lse_all), 0.0)  # (B, H, Sq)
        # (rounded: a product contracted into the add (an FMA) in one program and not in
        # another would round differently.)
        return rounded(jnp.swapaxes(w, 1, 2)[..., None] * _chunk(parts, c))

    return _in_key_order(len(lse), term).astype(parts.dtype), lse_all


def _sum_chunks(parts: jax.Array) -> jax.Array:
    """dQ from the dQ kernel's ``(2, chunks, ...)`` partials (:func:`flash_bwd`): their f32
    sum in key order (:func:`_in_key_order`), rounded once."""
    return _in_key_order(parts.shape[1], functools.partial(_chunk, parts)).astype(parts.dtype)


# --- dispatch -------------------------------------------------------------------------------


def hardware(platform: str) -> str | None:
    """None if this machine's ``platform`` devices can run the compiled kernels, else why not."""
    return device.hopper_only(platform, "a Mosaic GPU kernel")


def _default_config(spec: AttentionSpec) -> bool:
    return spec.config is None or spec.config == FlashAttentionConfig()


# The spec features the kernels run: the index-based masks (an iota compare per tile, and
# whole kv blocks skipped outside the lengths and the window), segment ids (streamed beside
# the blocks they label, every block masked), a mask and a bias (folded into one additive
# tile per block, streamed beside it, every block masked) and the lse cotangent (it only
# shifts Δ). The bias's gradient (``bias_grad``) runs the reference's backward, which
# reads the same saved ``lse``.
FEATURES = (
    "mask",
    "bias",
    "query_seq_lengths",
    "key_value_seq_lengths",
    "local_window_size",
    "segment_ids",
    "dlse",
)


def _bias_reason(d: int, segments: bool, bias: str) -> str | None:
    """Which kernel's ring cannot hold a ``bias`` (:attr:`Problem.bias`) per block at
    head_dim ``d`` beside K/V (None: every kernel's can): the forward keeps two slots, the
    dQ kernel the slots it has without a bias, the dK/dV kernel its default ones."""
    extra = SEGMENT_SMEM_BYTES if segments else 0
    if _fwd_block_kv(d, bias) is None:
        return "the forward's"
    if _dq_block_kv(d, extra, bias) is None:
        return "the dQ kernel's"
    if _dkv_smem(d, DKV_STAGES[d], bias) > SMEM_BYTES:
        return "the dK/dV kernel's"
    return None


def _fixed_operands(spec, avals: Sequence[Any]) -> int:
    """How many of ``avals`` come before the spec's extras: 3 for the forward's
    ``(q, k, v)``, 6 for the backward's ``(q, k, v, out, lse, dout)``."""
    return len(avals) - spec.num_extras - int(spec.has_dlse)


def supports(spec, avals: Sequence[Any]) -> str | None:
    """None if the kernels can run the case, else why not (never raises).

    ``avals``: ``(q, k, v)`` (forward) or ``(q, k, v, out, lse, dout)`` (backward), then
    the spec's extra operands (and the backward's ``lse`` cotangent), as the operator binds
    them: a mask's and a bias's shapes choose how they stream.
    """
    declined = [f for f in spec.features if f not in FEATURES]
    if declined:
        return (
            f"{', '.join(declined)} (the kernels run causal or not attention with "
            f"{', '.join(FEATURES)}; the blocked reference runs the rest)"
        )
    q, k = avals[0], avals[1]
    dt = np.dtype(q.dtype)
    if dt not in DTYPES:
        return f"dtype {dt} (the kernels take bfloat16 and float16)"
    d = kernel_head_dim(q.shape[-1])
    if d is None:
        return f"head_dim {q.shape[-1]} (the kernels take up to {HEAD_DIMS[-1]})"
    if spec.has_segment_ids and _dkv_roles(d):
        # The role-split dK/dV kernel with a ring of query ids deadlocks in the Mosaic GPU
        # interpreter on causal cases; until that is understood it does not run them.
        return (
            f"segment_ids at head_dim {q.shape[-1]} (the kernels take them up to "
            f"{DKV_ROLES_HEAD_DIM // 2})"
        )
    if spec.has_mask or spec.has_bias:
        fixed = _fixed_operands(spec, avals)
        if fixed not in (3, 6):
            return (
                f"{len(avals)} operands for a spec with {spec.num_extras} extras (the mask's "
                "and bias's shapes are needed)"
            )
        bias = _extras_bias_kind(spec, avals[fixed : fixed + spec.num_extras])
        kernel = _bias_reason(d, spec.has_segment_ids, bias)
        if kernel is not None:
            fit = [h for h in HEAD_DIMS if _bias_reason(h, spec.has_segment_ids, bias) is None]
            what = "a mask or bias per query" if bias == "tiles" else "a key-padding mask or bias"
            return (
                f"{what} at head_dim {q.shape[-1]} ({kernel} ring of it does not fit shared memory "
                f"beside K/V; the kernels take it at head_dim {', '.join(map(str, fit))})"
            )
    if 0 in q.shape or 0 in k.shape:
        return f"an empty operand (q {tuple(q.shape)}, k {tuple(k.shape)})"
    if not _default_config(spec):
        return (
            f"config={spec.config}: the kernels use their own tiles; an explicit "
            "FlashAttentionConfig runs the blocked reference, which honours it"
        )
    return None


# Dispatch rule. Where the kernels decline or are not preferred, ``auto`` mode lowers the
# operator's blocked XLA reference, which the kernels beat at every measured shape: 128 to
# 4096 keys, head_dim 64-256 and 96 zero-padded, B*H 16-256 against the reference before
# its fixed-point normaliser (benchmarks/archive/attention-h100-old-reference.json), 4096
# keys against today's (the ts_reference rows of benchmarks/results/attention-h100.json;
# 128-256 keys are not re-measured). Below PREFER_MIN_SEQ queries or keys the 128-row tile
# padding is unmeasured. Decoding (at most DECODE_MAX_Q queries) against DECODE_MIN_KV keys
# or more runs the kernels too: the padded tile costs little beside streaming the cache (the
# ``…-decode-…`` cases, timed inside one program), one query's backward against 32768 keys
# included: with the dQ kernel computing dK and dV, the kernels ran as fast as the one-block
# reference there, in the same process and in less memory (the ``fwdbwd-…-sq1-skv32768-…``
# rows without GQA: ``mosaic_gpu`` is the kernels, ``ts_auto`` the reference that ``auto``
# took there when they were measured). The rule reads one head's sizes only, never batch
# or heads, which a mesh divides, so that a sharded run takes the same path and gets the
# same bits on any device count.
# At decode shapes the forward these kernels would run is mostly taken first by
# ``attention_decode`` (Pallas' Triton backend), registered ahead of them, from fewer keys
# (its ``MIN_KV``), and so is the backward (its ``BWD_MIN_KV``); these kernels decode the
# cases it declines (a GQA group of more than 64 rows, other head dims). The backward
# decodes from DECODE_BWD_MIN_KV keys, that forward's threshold. When that was chosen,
# before the Triton backward took the cases it now does: against 1024 and 2048 keys (the
# ``fwdbwd-noncausal-decode-…-skv1024/2048`` rows of benchmarks/results/attention-h100.json,
# in-graph, B1 and B4, 1 and 16 queries, GQA or not) the Triton forward with these
# backward kernels ran 0.93-2.03x XLA at B4, where the reference's backward beside it ran
# 0.95-1.08x, and beat that pairing in 6 of the 8 B1 cases; four B1 cases trail XLA on
# either path (0.84-0.92x with the kernels).
# Against 256 and 512 keys (B1 H8 and B4 H16, 1 and 16 queries; both backwards compiled
# in one process on an H200, benchmarks/archive/decode-bwd-threshold-probe-h200.txt) the
# kernels led at B4 with 16 queries and were level within a few microseconds elsewhere,
# behind in one B1 case; against the keys a window of 2048 leaves they led too on an
# H100 (the ``…-decode-window-b1-…-skv2048`` rows of attention-h100.json, 272 keys then),
# and on an H200, where both trail XLA there, the reference further
# (benchmarks/archive/decode-window-probe-h200.txt). A decode forward that
# the Triton kernel declines (a mask or bias) keeps the reference below DECODE_MIN_KV,
# unmeasured.
PREFER_MIN_SEQ = 128
DECODE_MAX_Q = 16
DECODE_MIN_KV = 4096
DECODE_BWD_MIN_KV = 256


def prefer(spec, avals: Sequence[Any]) -> bool:
    """Whether the kernels are expected to beat the blocked XLA reference (``auto`` mode):
    from :data:`PREFER_MIN_SEQ` queries and keys, or decoding (:data:`DECODE_MAX_Q`
    queries against :data:`DECODE_MIN_KV` keys, :data:`DECODE_BWD_MIN_KV` for the
    backward). Asked only of cases :func:`supports` accepts."""
    q, k = avals[0], avals[1]
    sq, skv = q.shape[1], k.shape[1]
    min_kv = DECODE_MIN_KV if _fixed_operands(spec, avals) == 3 else DECODE_BWD_MIN_KV
    return min(sq, skv) >= PREFER_MIN_SEQ or (sq <= DECODE_MAX_Q and skv >= min_kv)
