"""The ``ts_flash_attention_*`` contract: the static parameters every implementation reads.

Three primitives share one frozen spec, :class:`AttentionSpec`, bound as their only
parameter (``spec=``)::

    ts_flash_attention_fwd(q, k, v, *extras)                          -> (out, lse)
    ts_flash_attention_bwd(q, k, v, out, lse, dout, *extras, [dlse])  -> (dq, dk, dv, [dbias])
    ts_flash_attention_jvp(q, k, v, out, lse, *extras, *tangents)     -> (t_out, t_lse)

``extras`` are, in this order and each only where the spec's flag says so: ``mask``
(bool, rank 4, broadcastable to ``(B, Hq, Sq, Skv)``), ``bias`` (float, likewise),
``q_lengths`` (int32 ``(B,)``), ``kv_lengths`` (int32 ``(B,)``) and the pair
``q_segment_ids`` (int32 ``(B, Sq)``), ``kv_segment_ids`` (int32 ``(B, Skv)``). The
tangents of the JVP primitive are those named by ``spec.tangents``, in the order
``q, k, v, bias``.

A kernel reads :attr:`AttentionSpec.features` to decline what it cannot run (``"mask"``,
``"window"``, ``"dlse"``, …): the operator then lowers its blocked reference, which runs
every case. This module imports nothing from ``primitives/`` or ``pallas_kernels/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

TANGENT_NAMES = ("q", "k", "v", "bias")


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Block sizes of flash attention (a static, hashable primitive parameter).

    Attributes:
      block_q: query rows per tile. Kernels tile queries by it; the reference
        processes all queries of a kv block at once and ignores it.
      block_kv: keys per block of the online softmax (forward) and of the
        recompute (backward) in the reference. Clipped to ``Skv`` for short sequences; a
        sequence that is not a multiple of it has a padded, masked last block. None (the
        default): chosen per shape, so that one block's scores stay within a fixed
        budget per kv head, smaller on the CPU (``primitives/attention.py``: one block
        for short sequences and decoding, O(S) memory for long ones).
    """

    block_q: int = 128
    block_kv: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if val is None and f.name == "block_kv":
                continue
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool):
                raise TypeError(f"FlashAttentionConfig: {f.name}={val!r} must be an int")
            if val < 1:
                raise ValueError(f"FlashAttentionConfig: {f.name}={val} must be ≥ 1")
            object.__setattr__(self, f.name, int(val))

    @classmethod
    def get_default(cls) -> FlashAttentionConfig:
        return cls()


class AttentionExtras(NamedTuple):
    """The optional operands of one bind, None where absent."""

    mask: Any = None
    bias: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static parameters of one flash-attention bind (hashable: it is the bind's param).

    Attributes:
      causal: keys after the query are masked, aligned bottom-right (query ``i`` sees
        keys ``j ≤ i + Skv − Sq``).
      scale: the positive factor multiplying ``q·kᵀ``.
      config: block sizes (:class:`FlashAttentionConfig`).
      local_window_size: ``(left, right)``: query ``i`` sees keys ``j`` with
        ``i + Skv − Sq − left ≤ j ≤ i + Skv − Sq + right``; None: no window.
      has_mask / has_bias / has_q_lengths / has_kv_lengths / has_segment_ids: which
        extra operands follow the fixed ones (segment ids come as a q/kv pair).
      bias_grad: backward only: the bias is differentiated, so ``dbias`` (the bias's
        shape and dtype) follows ``(dq, dk, dv)``.
      has_dlse: backward only: a cotangent of the log-sum-exp follows the extras.
      tangents: JVP only: which of ``q, k, v, bias`` have a tangent operand.
    """

    causal: bool
    scale: float
    config: FlashAttentionConfig
    local_window_size: tuple[int, int] | None = None
    has_mask: bool = False
    has_bias: bool = False
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    has_segment_ids: bool = False
    bias_grad: bool = False
    has_dlse: bool = False
    tangents: tuple[str, ...] = ()

    def __post_init__(self):
        # Normalised so that equal specs compare (and hash, and cache) equal.
        for name in (
            "causal",
            "has_mask",
            "has_bias",
            "has_q_lengths",
            "has_kv_lengths",
            "has_segment_ids",
            "bias_grad",
            "has_dlse",
        ):
            object.__setattr__(self, name, bool(getattr(self, name)))
        object.__setattr__(self, "scale", float(self.scale))
        if self.local_window_size is not None:
            object.__setattr__(self, "local_window_size", tuple(map(int, self.local_window_size)))
        tangents = tuple(self.tangents)
        if any(t not in TANGENT_NAMES for t in tangents):
            raise ValueError(f"AttentionSpec: tangents={tangents} must be among {TANGENT_NAMES}")
        object.__setattr__(self, "tangents", tuple(t for t in TANGENT_NAMES if t in tangents))
        if self.bias_grad and not self.has_bias:
            raise ValueError("AttentionSpec: bias_grad=True needs has_bias=True")

    def replace(self, **changes: Any) -> AttentionSpec:
        return dataclasses.replace(self, **changes)

    @property
    def num_extras(self) -> int:
        """How many extra operands follow the fixed ones (not counting ``dlse``)."""
        return (
            int(self.has_mask)
            + int(self.has_bias)
            + int(self.has_q_lengths)
            + int(self.has_kv_lengths)
            + 2 * int(self.has_segment_ids)
        )

    @property
    def features(self) -> tuple[str, ...]:
        """What this bind asks beyond plain (causal or not) attention, by name: a kernel
        that runs only plain attention declines a spec whose ``features`` is not empty."""
        named = (
            ("mask", self.has_mask),
            ("bias", self.has_bias),
            ("query_seq_lengths", self.has_q_lengths),
            ("key_value_seq_lengths", self.has_kv_lengths),
            ("segment_ids", self.has_segment_ids),
            ("local_window_size", self.local_window_size is not None),
            ("bias_grad", self.bias_grad),
            ("dlse", self.has_dlse),
        )
        return tuple(n for n, on in named if on)

    def split(self, extras: Sequence[Any]) -> AttentionExtras:
        """The extra operands by name; a missing one is None."""
        if len(extras) != self.num_extras:
            raise ValueError(
                f"flash_attention: {len(extras)} extra operands, but the spec has {self.num_extras}"
            )
        it = iter(extras)
        mask = next(it) if self.has_mask else None
        bias = next(it) if self.has_bias else None
        q_lengths = next(it) if self.has_q_lengths else None
        kv_lengths = next(it) if self.has_kv_lengths else None
        q_seg = next(it) if self.has_segment_ids else None
        kv_seg = next(it) if self.has_segment_ids else None
        return AttentionExtras(mask, bias, q_lengths, kv_lengths, q_seg, kv_seg)

    @staticmethod
    def operands(extras: AttentionExtras) -> list[Any]:
        """The present extras as the operand list :meth:`split` reads."""
        return [x for x in extras if x is not None]

    def with_extras(self, extras: AttentionExtras) -> AttentionSpec:
        """This spec with its ``has_*`` flags set from which extras are present."""
        return self.replace(
            has_mask=extras.mask is not None,
            has_bias=extras.bias is not None,
            has_q_lengths=extras.q_lengths is not None,
            has_kv_lengths=extras.kv_lengths is not None,
            has_segment_ids=extras.q_segment_ids is not None,
        )


def first_seen_key(window: tuple[int, int] | None, seq_q: int, seq_kv: int) -> int:
    """The first key any query sees under a ``(left, right)`` window (0 without one):
    query ``i`` sees none before ``i + seq_kv − seq_q − left``. The operator slices off
    the keys before it (:func:`dropped_keys`); a kernel skipping their blocks writes
    their zero gradients."""
    return 0 if window is None else max(0, seq_kv - seq_q - window[0])


def dropped_keys(window: tuple[int, int] | None, seq_q: int, seq_kv: int, multiple: int) -> int:
    """How many leading keys the operator slices off before it binds: those before
    :func:`first_seen_key`, fewer by what keeps the rest a multiple of ``multiple`` (the
    keys between stay, hidden by the window). Static shapes and the window only: the
    same on any mesh."""
    seen = seq_kv - first_seen_key(window, seq_q, seq_kv)
    kept = -(-seen // multiple) * multiple
    return max(0, seq_kv - kept)
