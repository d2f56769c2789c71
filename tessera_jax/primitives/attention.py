"""Flash attention: ``softmax(Q·Kᵀ·scale + mask)·V``, blocked, never materialising S×S.

Layout and semantics
--------------------
``q: (B, Sq, Hq, D)``, ``k, v: (B, Skv, Hkv, D)``, output ``(B, Sq, Hq, D)``.
``Hkv`` divides ``Hq`` (GQA; ``Hkv == 1`` is MQA): query head ``h`` reads kv head
``h // (Hq // Hkv)``. ``scale`` defaults to ``1/sqrt(D)``.

``causal=True`` aligns the mask to the **bottom-right** corner: query ``i`` sees
keys ``j ≤ i + (Skv − Sq)``. For ``Sq == Skv`` this is the plain lower triangle;
for ``Sq < Skv`` (decoding with a kv cache) the queries are the last ``Sq``
positions of the sequence; for ``Sq > Skv`` the first ``Sq − Skv`` queries see no
key. A query that sees no key (a fully masked row) outputs zeros, its
log-sum-exp is ``-inf`` and its gradients are zero — never NaN.

Algorithm (the reference lowering)
----------------------------------
The FlashAttention online softmax: ``lax.scan`` over blocks of ``block_kv`` keys,
carrying per query row the running maximum ``m``, normaliser ``l`` and output
accumulator; memory is ``O(Sq·block_kv)`` per (batch, head), never ``Sq×Skv``.
The GQA group of ``Hq/Hkv`` query heads is folded into the query rows of its kv
head, so K/V are read once per kv head. Both matmuls take their operands in the
input dtype (the probabilities are rounded to it before ``P·V``, as FlashAttention
kernels do) and accumulate in f32 for 8-/16-bit inputs; f32 products follow
``jax_default_matmul_precision`` as ``jnp.dot`` does (TF32 on GPUs by default;
``"highest"`` for full f32). The softmax
statistics and the accumulator are f32 (f64 for f64 inputs). A last, partial kv block is
zero-padded and masked.

The backward (FlashAttention-2) recomputes each block's probabilities from the
saved log-sum-exp, ``P = exp(S − lse)``, with ``Δ = rowsum(dO ∘ O)``::

    dV_j = P_jᵀ·dO      dP = dO·V_jᵀ      dS = P∘(dP − Δ)
    dK_j = scale·dSᵀ·Q  dQ += scale·dS·K_j

in one scan over kv blocks (``dQ`` carried, ``dK_j``/``dV_j`` stacked), again
``O(Sq·block_kv)`` memory. Folding the GQA group into the rows sums ``dK``/``dV``
over the query heads that share a kv head.

Adjoints: VJP-only
------------------
Attention is differentiable in reverse mode only: the public function is a
``jax.custom_vjp`` over two primitives, ``ts_flash_attention_fwd`` ``(q, k, v) →
(out, lse)`` and ``ts_flash_attention_bwd`` ``(q, k, v, out, lse, dout) →
(dq, dk, dv)``. ``jax.jvp``/``jax.jacfwd`` raise jax's "can't apply forward-mode
autodiff (jvp) to a custom_vjp function" TypeError; second derivatives are not
supported. Both primitives have batching rules (``jax.vmap`` over any dimension
of any operand).

Kernels
-------
``flash_attention_fwd_op.add_kernel(Kernel(...))`` with
``fn(q, k, v, *, interpret, causal, scale, config) -> (out, lse)`` and
``flash_attention_bwd_op`` with ``fn(q, k, v, out, lse, dout, *, interpret,
causal, scale, config) -> (dq, dk, dv)``; ``lse`` is ``(B, Hq, Sq)`` in the
statistics dtype (f32; f64 for f64 inputs).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.pallas_kernels import attention_mgpu as _mgpu
from tessera_jax.primitives._core import (
    Kernel,
    Operator,
    as_array,
    batching,
    check_dtype,
    compute_dtype,
    move_bdim_to_front,
    not_mapped,
)

_NAME = "flash_attention"


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Block sizes of flash attention (a static, hashable primitive parameter).

    Attributes:
      block_q: query rows per tile. Kernels tile queries by it; the reference
        processes all queries of a kv block at once and ignores it.
      block_kv: keys per block of the online softmax (forward) and of the
        recompute (backward). Clipped to ``Skv`` for short sequences; a
        sequence that is not a multiple of it has a padded, masked last block.
    """

    block_q: int = 128
    block_kv: int = 128

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool):
                raise TypeError(f"FlashAttentionConfig: {f.name}={val!r} must be an int")
            if val < 1:
                raise ValueError(f"FlashAttentionConfig: {f.name}={val} must be ≥ 1")
            object.__setattr__(self, f.name, int(val))

    @classmethod
    def get_default(cls) -> FlashAttentionConfig:
        return cls()


# --- the blocked reference ----------------------------------------------------------------


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
    def of(cls, q, k, config: FlashAttentionConfig) -> _Geometry:
        b, sq, hq, d = q.shape
        skv, hkv = k.shape[1], k.shape[2]
        return cls(b, sq, skv, hq, hkv, d, max(1, min(config.block_kv, skv)))

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


def _block_mask(g: _Geometry, j: jax.Array, causal: bool) -> jax.Array | None:
    """``(1, 1, G·Sq, block)`` bool: which scores of kv block ``j`` are visible (None: all)."""
    kv_pos = j * g.block + jnp.arange(g.block, dtype=jnp.int32)[None, :]
    mask = None
    if g.num_blocks * g.block != g.seq_kv:
        mask = kv_pos < g.seq_kv
    if causal:
        q_pos = jnp.arange(g.rows, dtype=jnp.int32)[:, None] % g.seq_q + (g.seq_kv - g.seq_q)
        visible = kv_pos <= q_pos
        mask = visible if mask is None else mask & visible
    return None if mask is None else jnp.broadcast_to(mask, (g.rows, g.block))[None, None]


def _dot(a: jax.Array, b: jax.Array, contract: int, acc) -> jax.Array:
    """``a``'s last dim contracted with ``b``'s dim ``contract``, batched over (B, Hkv)."""
    dims = (((3,), (contract,)), ((0, 1), (0, 1)))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=acc)


def _scores(g, q_rows, k_blk, j, causal, scale, acc):
    """Scaled scores of one kv block, ``(B, Hkv, G·Sq, block)``, masked entries ``-inf``."""
    s = _dot(q_rows, k_blk, 3, acc) * scale
    mask = _block_mask(g, j, causal)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _flash_fwd_reference(q, k, v, *, causal, scale, config):
    """Blocked online-softmax forward: ``(out, lse)``, ``lse`` of shape ``(B, Hq, Sq)``."""
    g = _Geometry.of(q, k, config)
    acc = compute_dtype(q.dtype)
    q_rows = _q_rows(g, q)

    def step(carry, xs):
        m, l, o = carry
        j, k_blk, v_blk = xs
        s = _scores(g, q_rows, k_blk, j, causal, scale, acc)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        # A row with nothing visible yet keeps m = -inf; subtract 0 there so that
        # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
        m_safe = jnp.where(m_new == -jnp.inf, jnp.zeros_like(m_new), m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
        o = alpha * o + _dot(p.astype(v.dtype), v_blk, 2, acc)
        return (m_new, l, o), None

    # *_like the query rows: on a mesh with Explicit axes the carry then has their sharding.
    stat = jnp.zeros_like(q_rows[..., :1], dtype=acc)
    init = (stat - jnp.inf, stat, jnp.zeros_like(q_rows, dtype=acc))
    xs = (jnp.arange(g.num_blocks, dtype=jnp.int32), _kv_blocks(g, k), _kv_blocks(g, v))
    (m, l, o), _ = jax.lax.scan(step, init, xs)
    empty = l == 0  # fully masked rows
    out = o / jnp.where(empty, jnp.ones_like(l), l)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, jnp.ones_like(l), l)))
    lse = lse.reshape(g.batch, g.heads_kv, g.group, g.seq_q).reshape(g.batch, g.heads_q, g.seq_q)
    return _from_rows(g, out).astype(q.dtype), lse


def _flash_bwd_reference(q, k, v, out, lse, dout, *, causal, scale, config):
    """FlashAttention-2 backward by blocked recompute from ``lse``: ``(dq, dk, dv)``."""
    g = _Geometry.of(q, k, config)
    acc = compute_dtype(q.dtype)
    q_rows, do_rows = _q_rows(g, q), _q_rows(g, dout)
    delta = jnp.sum(
        _q_rows(g, out).astype(acc) * do_rows.astype(acc), axis=-1, keepdims=True
    )  # (B, Hkv, G·Sq, 1)
    lse_rows = lse.reshape(g.batch, g.heads_kv, g.rows, 1)
    # Fully masked rows (lse = -inf) have P = 0: subtract 0 instead of -inf.
    lse_rows = jnp.where(lse_rows == -jnp.inf, jnp.zeros_like(lse_rows), lse_rows)

    def step(dq, xs):
        j, k_blk, v_blk = xs
        s = _scores(g, q_rows, k_blk, j, causal, scale, acc)
        p = jnp.exp(s - lse_rows)  # masked entries: exp(-inf) = 0
        dv_blk = _dot(jnp.swapaxes(p.astype(dout.dtype), 2, 3), do_rows, 2, acc)
        dp = _dot(do_rows, v_blk, 3, acc)
        ds = (p * (dp - delta)).astype(q.dtype)
        dk_blk = _dot(jnp.swapaxes(ds, 2, 3), q_rows, 2, acc) * scale
        dq = dq + _dot(ds, k_blk, 2, acc) * scale
        return dq, (dk_blk.astype(k.dtype), dv_blk.astype(v.dtype))

    xs = (jnp.arange(g.num_blocks, dtype=jnp.int32), _kv_blocks(g, k), _kv_blocks(g, v))
    dq0 = jnp.zeros_like(q_rows, dtype=acc)
    dq, (dk, dv) = jax.lax.scan(step, dq0, xs)
    return _from_rows(g, dq).astype(q.dtype), _from_blocks(g, dk), _from_blocks(g, dv)


# --- the primitives -----------------------------------------------------------------------


def _fwd_abstract_eval(q, k, v, *, causal, scale, config):
    b, sq, hq, _ = q.shape
    lse = q.update(shape=(b, hq, sq), dtype=compute_dtype(q.dtype), weak_type=False)
    return q.update(weak_type=False), lse


flash_attention_fwd_op = Operator(
    "flash_attention_fwd",
    reference=_flash_fwd_reference,
    abstract_eval=_fwd_abstract_eval,
    multiple_results=True,
)
flash_attention_bwd_op = Operator(
    "flash_attention_bwd",
    reference=_flash_bwd_reference,
    abstract_eval=lambda q, k, v, out, lse, dout, **_: (q, k, v),
    multiple_results=True,
)


def _fold_batch(args, dims):
    """vmap: ``(N, B, folded)``, every operand's mapped dim (size N) merged into its batch dim."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
    moved = [move_bdim_to_front(a, d, size) for a, d in zip(args, dims)]
    return size, moved[0].shape[1], [a.reshape(size * a.shape[1], *a.shape[2:]) for a in moved]


def _unfold(size: int, batch: int, x: jax.Array) -> jax.Array:
    """``(N·B, …)`` → ``(N, B, …)``."""
    return x.reshape(size, batch, *x.shape[1:])


def _fwd_batcher(args, dims, **params):
    size, batch, folded = _fold_batch(args, dims)
    out, lse = flash_attention_fwd_op.bind(*folded, **params)
    return (_unfold(size, batch, out), _unfold(size, batch, lse)), (0, 0)


def _bwd_batcher(args, dims, **params):
    size, batch, folded = _fold_batch(args, dims)
    grads = flash_attention_bwd_op.bind(*folded, **params)
    return tuple(_unfold(size, batch, t) for t in grads), (0, 0, 0)


batching.primitive_batchers[flash_attention_fwd_op.prim] = _fwd_batcher
batching.primitive_batchers[flash_attention_bwd_op.prim] = _bwd_batcher


# --- the custom VJP -----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _flash_attention(q, k, v, causal, scale, config):
    out, _ = flash_attention_fwd_op.bind(q, k, v, causal=causal, scale=scale, config=config)
    return out


def _flash_attention_fwd(q, k, v, causal, scale, config):
    out, lse = flash_attention_fwd_op.bind(q, k, v, causal=causal, scale=scale, config=config)
    return out, (q, k, v, out, lse)


def _flash_attention_bwd(causal, scale, config, residuals, dout):
    return tuple(
        flash_attention_bwd_op.bind(*residuals, dout, causal=causal, scale=scale, config=config)
    )


_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)


# --- the public function ------------------------------------------------------------------


def _validate(q, k, v, causal, scale, config) -> tuple[float, FlashAttentionConfig]:
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


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    config: FlashAttentionConfig | None = None,
) -> jax.Array:
    """Multi-head attention ``softmax(q·kᵀ·scale)·v`` without materialising the score matrix.

    Arguments:
      q: ``(batch, seq_q, heads_q, head_dim)``, a floating dtype.
      k: ``(batch, seq_kv, heads_kv, head_dim)``, ``q``'s dtype; ``heads_kv`` divides
        ``heads_q`` (GQA/MQA: query head ``h`` uses kv head ``h // (heads_q // heads_kv)``).
      v: ``k``'s shape and dtype.
      causal: mask keys after the query, aligned bottom-right (query ``i`` sees keys
        ``j ≤ i + seq_kv − seq_q``; the lower triangle when ``seq_q == seq_kv``).
      scale: a positive finite float multiplying the scores; default ``1/sqrt(head_dim)``.
      config: block sizes (:class:`FlashAttentionConfig`); default ``block_kv=128``.
    Returns:
      ``(batch, seq_q, heads_q, head_dim)`` in ``q``'s dtype. A query that sees no key
      gives zeros. Differentiable in reverse mode only (``jax.grad``/``jax.vjp``); see
      the module docstring.
    """
    q, k, v = (as_array(_NAME, n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    scale, config = _validate(q, k, v, causal, scale, config)
    try:
        return _flash_attention(q, k, v, bool(causal), scale, config)
    except TypeError as e:
        # jax.jvp / jacfwd reached the custom_vjp: say which operator and why.
        if "forward-mode" not in str(e):
            raise
        raise TypeError(
            f"{_NAME} is differentiable in reverse mode only (jax.grad, jax.vjp, jax.jacrev): "
            "it is a custom_vjp over ts_flash_attention_fwd/ts_flash_attention_bwd and has "
            "no JVP rule, so jax.jvp, jax.jacfwd and jax.hessian are not supported"
        ) from e


def flash_attention_fwd(q, k, v, *, causal=False, scale=None, config=None):
    """The forward primitive itself: ``(out, lse)`` with ``lse`` of shape ``(B, Hq, Sq)``."""
    q, k, v = (as_array(_NAME, n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    scale, config = _validate(q, k, v, causal, scale, config)
    out, lse = flash_attention_fwd_op.bind(q, k, v, causal=bool(causal), scale=scale, config=config)
    return out, lse


# --- kernels ------------------------------------------------------------------------------

# Hopper (Mosaic GPU) forward and deterministic backward; the kernels decode the operator's
# parameters (causal, scale, config) from ``spec`` themselves.
flash_attention_fwd_op.add_kernel(Kernel.from_module("mosaic_gpu", _mgpu, _mgpu.flash_fwd))
flash_attention_bwd_op.add_kernel(Kernel.from_module("mosaic_gpu", _mgpu, _mgpu.flash_bwd))
