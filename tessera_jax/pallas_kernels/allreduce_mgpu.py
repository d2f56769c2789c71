"""The deterministic all-reduce as one Mosaic GPU kernel over NVLink (Hopper, one process).

``all_reduce(x, axis)`` inside ``shard_map`` returns, on every part, the canonical
pairwise tree over the parts in rank order (``primitives/collectives/algorithms.py``),
bit for bit what the XLA data path (all_to_all + local tree + all_gather) returns. The kernel moves
the same bytes as that path (and NCCL's ring), ``2(n-1)/n`` of the message out of each
GPU, but in one launch and with every NVLink transfer a posted write:

1. **scatter**: each rank pushes chunk ``p`` of its ``x`` into rank ``p``'s receive
   buffer, slot ``rank`` (TMA: HBM -> shared memory -> the peer's HBM), then raises a
   semaphore on ``p``;
2. **reduce + gather**: once its ``n-1`` peers have pushed, rank ``d`` loads the ``n``
   contributions to its chunk (its own from ``x``, the others from the receive buffer),
   adds them on the canonical tree in f32 registers, rounds once, and pushes the result
   into its own output and every peer's output at chunk ``d``; a second semaphore round
   says the output is complete.

The message is viewed as ``(rows, LANES)``; chunk ``p`` is rows ``[p*C, (p+1)*C)``, split
into ``tile_rows``-row tiles; CTA ``b`` of every rank handles tiles ``b, b+B, ...`` of every
chunk, so the semaphores are per CTA (CTA ``b`` waits for CTA ``b`` of each peer) and
the two phases overlap across CTAs. All CTAs must be resident at once (they wait on one
another across GPUs): ``B`` is at most the number of SMs, one CTA per SM.

Needs jax >= 0.11 (remote references with XLA's collective metadata in a single
process), sm_90, and every device of the mesh in this process (``hardware``); the
operator takes its XLA path elsewhere. The Mosaic GPU interpreter (jax 0.10.2) has no
peer references and cannot allocate the kernel's cross-device semaphores, so the kernel
is not interpretable (``INTERPRETABLE``): the CPU tests check the plan, the in-register
tree and the lowering; the GPU benchmark (``benchmarks/allreduce.py``) checks the bits
against the canonical tree.

Dispatch vocabulary (the same as every kernel's): ``supports(spec, avals)``,
``prefer(spec, avals)``, ``hardware(platform)`` and ``fn(spec, x, interpret=...)``.
``spec`` is the operator's frozen all-reduce description; the kernel reads its
``axes``, ``op``, ``deterministic`` and ``n`` (the number of parts) and nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tessera_jax import _compat
from tessera_jax.pallas_kernels import device

LANES = 256
_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# Shared memory a CTA may use for its staging buffers (of 227 KiB on sm_90).
SMEM_BUDGET = 200 * 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one all-reduce of ``size`` elements over ``n`` ranks is tiled."""

    n: int
    rows: int  # of the padded (rows, LANES) message
    tile_rows: int
    blocks: int
    stages: int  # scatter-phase pipeline depth (tiles of every peer in flight)

    @property
    def chunk_rows(self) -> int:
        return self.rows // self.n

    @property
    def tiles_per_block(self) -> int:
        return self.chunk_rows // self.tile_rows // self.blocks

    def __post_init__(self):
        if self.n < 2:
            raise ValueError(f"all_reduce kernel: {self.n=} must be at least 2")
        if self.rows % (self.n * self.tile_rows):
            raise ValueError(f"all_reduce kernel: {self.rows=} is not a multiple of n * tile_rows")
        if (self.chunk_rows // self.tile_rows) % self.blocks:
            raise ValueError("all_reduce kernel: the tiles of a chunk must split evenly over CTAs")


def plan(size: int, n: int, dtype: Any, num_sms: int, max_tile_rows: int | None = None) -> Plan:
    """The tiling for ``size`` elements: tiles of up to ``max_tile_rows`` rows (the
    largest whose staging fits the shared-memory budget, smaller while a chunk has
    fewer tiles than SMs), and up to ``num_sms`` CTAs with the same number of tiles."""
    itemsize = np.dtype(dtype).itemsize
    row_bytes = LANES * itemsize
    # Phase 2 stages 2 x n input tiles and 2 output tiles; phase 1 reuses the space.
    fit = SMEM_BUDGET // ((2 * n + 2) * row_bytes)
    tile_rows = 1 << max(0, min(fit, max_tile_rows or 64).bit_length() - 1)
    chunk_rows = -(-size // (n * LANES))
    # Keep at least ~num_sms tiles per chunk where the message allows it.
    while tile_rows > 1 and chunk_rows // tile_rows < num_sms:
        tile_rows //= 2
    tiles = -(-chunk_rows // tile_rows)
    # CTAs: between half and all of the SMs, the count that pads the tiles least (a
    # ragged message is padded to whole tiles on every CTA; ties go to more CTAs).
    most = min(num_sms, tiles)
    blocks = min(range(max(1, most // 2), most + 1), key=lambda b: (-(-tiles // b) * b, -b))
    chunk_rows = -(-tiles // blocks) * blocks * tile_rows
    # Phase 1 keeps up to 4 tiles of every peer in flight.
    stages = max(1, min(4, SMEM_BUDGET // ((n - 1) * tile_rows * row_bytes)))
    return Plan(n=n, rows=chunk_rows * n, tile_rows=tile_rows, blocks=blocks, stages=stages)


def canonical_tree(vals: list) -> Any:
    """The canonical pairwise tree over ``vals`` in order (an odd last node passes up),
    as ``primitives.reductions.pairwise_tree_sum``."""
    while len(vals) > 1:
        pairs = [vals[i] + vals[i + 1] for i in range(0, len(vals) - 1, 2)]
        vals = pairs + ([vals[-1]] if len(vals) % 2 else [])
    return vals[0]


def supports(spec: Any, avals: Sequence[Any]) -> str | None:
    """Why the kernel cannot run this all-reduce (None when it can): it computes the
    canonical-tree sum (and mean) of an f32/bf16/f16 message over one mesh axis."""
    (x,) = avals
    if not spec.deterministic:
        return "deterministic=False (the kernel is the canonical tree)"
    if spec.op not in ("sum", "mean"):
        return f"op={spec.op!r} (the kernel sums)"
    if len(spec.axes) != 1:
        return f"axes={spec.axes} (the kernel reduces over one mesh axis)"
    if np.dtype(x.dtype) not in _DTYPES:
        return f"dtype {np.dtype(x.dtype)} (the kernel takes f32, bf16, f16)"
    if spec.n < 2:
        return "fewer than 2 parts"
    return None


def hardware(platform: str) -> str | None:
    """Why this machine cannot run the kernel compiled (None when it can)."""
    if platform != "cuda":
        return f"platform {platform!r} is not cuda"
    if not _compat.MGPU_PEER_KERNELS:
        return "this jax cannot run peer kernels in one process (needs jax >= 0.11)"
    if jax.process_count() != 1:
        return "the devices span several processes (the kernel needs them all in one)"
    if not device.is_sm90():
        return "not a Hopper (sm_90) GPU"
    return None


# No interpreter runs peer references (module docstring).
INTERPRETABLE = False

# Where ``auto`` takes the kernel, by per-rank message size. Against the XLA algorithms:
# above ``algorithms.SMALL_MESSAGE_BYTES`` (1 MiB), where ``auto``'s all_gather path
# stops. Up to it that path's smaller fixed cost wins per call and in a straight-line
# program, where a kernel whose only cross-GPU work is one semaphore round with its peers
# takes longer than the gather path's whole all-reduce. Where NCCL's own all-reduce may
# run instead (the order cannot change the bits: ``collectives.order_free``), the kernel
# wins from 32 MiB. The measurements: benchmarks/results/allreduce-nvidia-h200-x4.json
# (per call and ``in_program_*``), benchmarks/archive/allreduce-latency-h200-x4.txt
# (device time in straight-line programs and loops) and allreduce-nvidia-h200-x2.json
# (the kernel against psum from 32 MiB).
MIN_BYTES_VS_NCCL = 32 << 20


def prefer(spec: Any, avals: Sequence[Any]) -> bool:
    """Whether the kernel is expected to beat the other paths ``auto`` could take."""
    # Imported here: the collectives package imports this module.
    from tessera_jax.primitives.collectives.algorithms import SMALL_MESSAGE_BYTES, order_free

    (x,) = avals
    nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
    if order_free(x.dtype, spec.n, spec.op):
        return nbytes >= MIN_BYTES_VS_NCCL
    return nbytes > SMALL_MESSAGE_BYTES


def fn(spec: Any, x: jax.Array, *, interpret: bool) -> jax.Array:
    """The all-reduce ``spec`` of ``x`` by the kernel: the canonical-tree sum, divided
    by the part count for a mean (in ``x``'s dtype, as the reference rounds)."""
    if interpret:
        raise ValueError("all_reduce kernel: no interpreter runs peer references")
    if (why := supports(spec, (x,))) is not None:
        raise ValueError(f"all_reduce kernel: unsupported {why}")
    y = all_reduce(x, spec.axes[0], spec.n)
    return y / jnp.asarray(spec.n, y.dtype) if spec.op == "mean" else y


def all_reduce(x: jax.Array, axis_name: Any, n: int, num_sms: int | None = None) -> jax.Array:
    """The canonical-tree sum of ``x`` over ``axis_name`` (bound, of size ``n``), by the
    kernel. Called inside ``shard_map``; every rank must call it with the same shape."""
    if np.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"all_reduce kernel: unsupported dtype {np.dtype(x.dtype)}")
    size = x.size
    p = plan(size, n, x.dtype, num_sms or device.num_sms())
    flat = x.reshape(-1)
    if p.rows * LANES != size:
        flat = jnp.pad(flat, (0, p.rows * LANES - size))
    x2 = flat.reshape(p.rows, LANES)
    dtype = x.dtype
    acc = jnp.float32
    tr, crows, nb, per, stages = p.tile_rows, p.chunk_rows, p.blocks, p.tiles_per_block, p.stages
    npeers = n - 1

    def body(x_ref, out_ref, recv_ref, sems):
        d = lax.axis_index(axis_name)
        blk = lax.axis_index("blocks")
        # Static offsets: the TMA descriptors of remote refs are built on the host, which
        # recomputes the peer id from the device id and constants.
        peers = [{axis_name: lax.rem(d + k, n)} for k in range(1, n)]

        def tile_row(i):  # first row, within a chunk, of this CTA's tile i
            return (blk + i * nb) * tr

        def scatter(bufs, bars):
            def load(i, slot):
                for k in range(npeers):
                    src = x_ref.at[pl.ds(lax.rem(d + k + 1, n) * crows + tile_row(i), tr)]
                    plgpu.copy_gmem_to_smem(src, bufs.at[slot, k], bars.at[slot * npeers + k])

            for i in range(min(stages - 1, per)):
                load(i, i)

            @pl.loop(0, per)
            def _(i):
                slot = lax.rem(i, stages)
                for k in range(npeers):
                    plgpu.barrier_wait(bars.at[slot * npeers + k])
                    dst = plgpu.remote_ref(recv_ref, peers[k]).at[d, pl.ds(tile_row(i), tr)]
                    plgpu.copy_smem_to_gmem(bufs.at[slot, k], dst, commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                # The stores of tile i-1 have left shared memory: its slot takes tile i+S-1.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)

                @pl.when(i + stages - 1 < per)
                def _():
                    load(i + stages - 1, lax.rem(i + stages - 1, stages))

        def reduce_gather(bufs, outs, bars):
            def load_rank(r, row, dst, bar):  # rank r's contribution: ours is in x
                @pl.when(d == r)
                def _():
                    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(d * crows + row, tr)], dst, bar)

                @pl.when(d != r)
                def _():
                    plgpu.copy_gmem_to_smem(recv_ref.at[r, pl.ds(row, tr)], dst, bar)

            def load(i, slot):
                for r in range(n):
                    load_rank(r, tile_row(i), bufs.at[slot, r], bars.at[slot * n + r])

            load(0, 0)

            @pl.loop(0, per)
            def _(i):
                slot = lax.rem(i, 2)

                @pl.when(i + 1 < per)
                def _():
                    load(i + 1, 1 - slot)

                vals = []
                for r in range(n):
                    plgpu.barrier_wait(bars.at[slot * n + r])
                    vals.append(bufs.at[slot, r][...].astype(acc))
                # outs[slot] was last stored from at tile i-2: at most one group in flight.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                outs.at[slot][...] = canonical_tree(vals).astype(dtype)
                plgpu.commit_smem()
                rows = pl.ds(d * crows + tile_row(i), tr)
                plgpu.copy_smem_to_gmem(outs.at[slot], out_ref.at[rows], commit_group=False)
                for k in range(npeers):
                    dst = plgpu.remote_ref(out_ref, peers[k]).at[rows]
                    plgpu.copy_smem_to_gmem(outs.at[slot], dst, commit_group=False)
                plgpu.commit_smem_to_gmem_group()

        def handshake(sem):
            # Our writes to the peers have landed; tell them, then wait for theirs.
            plgpu.wait_smem_to_gmem(0)
            for k in range(npeers):
                pl.semaphore_signal(sem, device_id=peers[k])
            pl.semaphore_wait(sem, npeers)

        pl.run_scoped(
            scatter,
            plgpu.SMEM((stages, npeers, tr, LANES), dtype),
            plgpu.Barrier(num_barriers=stages * npeers),
        )
        handshake(sems.at[0])
        pl.run_scoped(
            reduce_gather,
            plgpu.SMEM((2, n, tr, LANES), dtype),
            plgpu.SMEM((2, tr, LANES), dtype),
            plgpu.Barrier(num_barriers=2 * n),
        )
        handshake(sems.at[1])

    with device.int32_tracing():
        out, _ = plgpu.kernel(
            body,
            out_type=(
                jax.ShapeDtypeStruct((p.rows, LANES), dtype),
                jax.ShapeDtypeStruct((n, crows, LANES), dtype),  # the receive buffer
            ),
            scratch_types=[plgpu.SemaphoreType.REGULAR((2,))],
            grid=(nb,),
            grid_names=("blocks",),
            compiler_params=plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Warpgroup
            ),
        )(x2)
    return out.reshape(-1)[:size].reshape(x.shape)
