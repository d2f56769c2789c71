"""The data path of the deterministic collectives: the canonical tree over ranks and the
algorithms that move the data to it. Everything here runs where mesh axes are bound
(inside ``shard_map``'s lowering).

Determinism
-----------
``all_reduce(..., op="sum", deterministic=True)`` returns, on every part, the canonical
pairwise tree of ``primitives/reductions.py`` over the parts in rank order,
``((x0+x1)+(x2+x3))+…`` (an odd last node passes up unchanged), accumulating 8-/16-bit
floats in f32 and rounding once: bitwise the same as ``ts.op.sum`` of the stacked parts
on one device, run after run, whatever NCCL would have chosen. ``mean`` is that sum
divided by the part count; ``max`` and ``min`` are exact in any order. The algorithm
chooses how the data moves, never the bits.

Algorithms
----------
These are every name :func:`choose_algo` can return (``api.ALGOS`` are the ones a
caller may ask for; ``"auto"`` picks among them):

* ``"binary_tree"``: all_to_all (rank j receives every rank's j-th 1/n chunk), the tree
  over the n received chunks locally, all_gather. Each rank sends and receives
  ``2(n-1)/n`` of the message, as NCCL's ring all-reduce does.
* ``"ring"``: the same, with the all_to_all done as ``n-1`` ``ppermute`` rounds (rank r
  sends to r+s in round s): for fabrics where all-to-all is slow.
* ``"gather"``: all_gather of the whole message, then the tree locally: one collective
  of ``n`` times the bytes, for latency-bound messages.
* ``"nvlink"``: the Mosaic GPU kernel (``pallas_kernels/allreduce_mgpu.py``): each rank
  pushes chunk j of its ``x`` straight into rank j's memory over NVLink, rank j adds the
  n contributions on the tree and pushes the result to every rank; the same bytes as
  ``"binary_tree"`` in one launch. Where the kernel does not run (``dispatch``: another
  platform or GPU, an unsupported case, ``TESSERA_KERNELS=xla|interpret``) it is
  ``"binary_tree"``, which gives the same bits.
* ``"psum"``: NCCL's own all-reduce (``lax.psum``/``pmax``/``pmin``), only where every
  order gives the canonical bits (:func:`order_free`).

``"auto"`` takes ``"nvlink"`` where ``dispatch`` selects the kernel (in ``auto`` mode:
messages of more than ``SMALL_MESSAGE_BYTES`` per rank, at least
``allreduce_mgpu.MIN_BYTES_VS_NCCL`` where the order is free); else ``"psum"`` where the
order is free; else ``"gather"`` for messages up to ``SMALL_MESSAGE_BYTES`` per rank; else
``"binary_tree"``. The timings behind the thresholds are in
``benchmarks/results/allreduce-*.json``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tessera_jax import _compat
from tessera_jax.primitives._core import compute_dtype
from tessera_jax.primitives.collectives.dispatch import AllReduceSpec, select_kernel
from tessera_jax.primitives.reductions import pairwise_tree_sum

# Every algorithm choose_algo can return (module docstring).
ALGORITHMS = ("binary_tree", "ring", "gather", "nvlink", "psum")
# "auto": per-rank messages up to this size take "gather" (one latency-bound collective);
# larger ones the NVLink kernel where it runs (allreduce_mgpu.prefer), else "binary_tree".
SMALL_MESSAGE_BYTES = 1 << 20


def axis_size(axes: tuple[str, ...]) -> int:
    """The number of parts along the bound mesh ``axes``."""
    return math.prod(lax.axis_size(a) for a in axes)


def tree_over_ranks(stacked: jax.Array) -> jax.Array:
    """``(n, ...) -> (...)``: the canonical pairwise tree over the leading (rank) axis,
    accumulating 8-/16-bit floats in f32 and rounding once."""
    acc = compute_dtype(stacked.dtype)
    return pairwise_tree_sum(stacked.astype(acc), axis=0).astype(stacked.dtype)


def combine_ranks(stacked: jax.Array, op: str) -> jax.Array:
    """``(n, ...) -> (...)``: ``op`` over the leading (rank) axis; sums on the tree."""
    if op == "max":
        return jnp.max(stacked, axis=0)
    if op == "min":
        return jnp.min(stacked, axis=0)
    return tree_over_ranks(stacked)


def exchange(chunks: jax.Array, axes: tuple[str, ...], algo: str) -> jax.Array:
    """``chunks[j]`` is this rank's contribution for rank j; returns ``recv`` with
    ``recv[j]`` = rank j's contribution for this rank (an all_to_all, as ``n-1``
    ppermute rounds for ``algo="ring"``)."""
    n = chunks.shape[0]
    if algo != "ring" or n == 1:
        return lax.all_to_all(chunks, axes, 0, 0, tiled=True)
    rank = lax.axis_index(axes)
    mine = lax.dynamic_index_in_dim(chunks, rank, 0, keepdims=False)
    recv = lax.dynamic_update_index_in_dim(jnp.zeros_like(chunks), mine, rank, 0)
    for s in range(1, n):
        send = lax.dynamic_index_in_dim(chunks, (rank + s) % n, 0, keepdims=False)
        got = lax.ppermute(send, axes, perm=[(r, (r + s) % n) for r in range(n)])
        recv = lax.dynamic_update_index_in_dim(recv, got, (rank - s) % n, 0)
    return recv


def order_free(dtype: Any, n: int, op: str) -> bool:
    """Whether every reduction order gives the canonical tree's bits, so NCCL's own
    all-reduce can run it: integer sums, maxima and minima (exact and associative, with
    wrap-around), and a sum over 2 parts in the accumulation dtype (one addition, and IEEE
    addition commutes; NaN payloads aside)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return True
    return op == "sum" and n == 2 and compute_dtype(dtype) == dtype


def choose_algo(spec: AllReduceSpec, x: Any, platform: str | None) -> str:
    """The algorithm (one of ``ALGORITHMS``) that runs the all-reduce ``spec`` of ``x``
    (an array or aval) when lowered for ``platform`` (module docstring)."""
    if select_kernel(spec, (x,), platform) is not None:
        return "nvlink"
    if spec.algo == "nvlink":
        return "binary_tree"
    if spec.algo != "auto":
        return spec.algo
    if order_free(x.dtype, spec.n, spec.op):
        return "psum"
    size = math.prod(x.shape)
    small = size * jnp.dtype(x.dtype).itemsize <= SMALL_MESSAGE_BYTES
    return "gather" if small or size < spec.n else "binary_tree"


def tree_all_reduce(
    x: jax.Array,
    axes: tuple[str, ...],
    op: str = "sum",
    algo: str = "auto",
    platform: str | None = None,
) -> jax.Array:
    """The deterministic all-reduce of ``x`` over the bound ``axes`` (module docstring):
    ``op`` is sum, mean, max or min; ``algo`` a requested algorithm or ``"auto"``;
    ``platform`` the one being lowered for, where known (the NVLink kernel needs cuda)."""
    spec = AllReduceSpec(axes=axes, op=op, algo=algo, deterministic=True, n=axis_size(axes))
    picked = select_kernel(spec, (x,), platform)
    if picked is not None:
        kernel, interpret = picked
        return kernel.fn(spec, x, interpret=interpret)
    if op == "mean":  # the tree sum, rounded, then divided (as the kernel does)
        y = _xla_all_reduce(x, dataclasses.replace(spec, op="sum"), platform)
        return y / jnp.asarray(spec.n, y.dtype)
    return _xla_all_reduce(x, spec, platform)


def _xla_all_reduce(x: jax.Array, spec: AllReduceSpec, platform: str | None) -> jax.Array:
    """The all-reduce ``spec`` (sum, max or min) by the XLA algorithm choose_algo picks."""
    axes, n, op = spec.axes, spec.n, spec.op
    algo = choose_algo(spec, x, platform)
    if algo == "psum" or x.size == 0:  # (no elements: no order to fix, no chunks to send)
        return {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op](x, axes)
    if algo == "gather":
        stacked = _compat.all_gather_invariant(x[None], axes, axis=0, tiled=True)
        return combine_ranks(stacked, op)
    flat = x.reshape(-1)
    size = flat.shape[0]
    m = -(-size // n)
    if m * n != size:
        flat = jnp.pad(flat, (0, m * n - size))
    recv = exchange(flat.reshape(n, m), axes, algo)
    mine = combine_ranks(recv, op)
    full = _compat.all_gather_invariant(mine, axes, axis=0, tiled=True)
    return full[:size].reshape(x.shape)


def tree_reduce_scatter(
    x: jax.Array, axes: tuple[str, ...], dim: int, algo: str = "auto"
) -> jax.Array:
    """Sum over the bound ``axes`` on the canonical tree; rank r keeps slice r of
    ``dim``. ``algo``: ``"ring"`` exchanges by ppermute rounds, else by all_to_all."""
    n = axis_size(axes)
    xm = jnp.moveaxis(x, dim, 0)
    chunks = xm.reshape(n, -1)
    recv = exchange(chunks, axes, "ring" if algo == "ring" else "binary_tree")
    out = tree_over_ranks(recv).reshape(xm.shape[0] // n, *xm.shape[1:])
    return jnp.moveaxis(out, 0, dim)
