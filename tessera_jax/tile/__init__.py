"""``ts.tile``: the operations of a tile kernel body (see ``ops.py``) and the kernel language.

A kernel (``@ts.kernel``, ``kernel.py``) is a tile-first SPMD program: each of its groups
(a CUDA block, a Pallas program) runs the body once on whole tiles of lanes. It lowers to
one ``pl.pallas_call`` (``lowering.py``): on GPUs through Pallas' Triton backend, whose
lane-vector model (masked per-lane loads and stores, ``tl.dot`` on the tensor cores,
``num_warps``/``num_stages``, a software pipeliner for ``scf.for`` loops) is this
language's model; on the CPU through Pallas' interpreter (``interpret=True``), with the
same results. Mosaic GPU, Pallas' other GPU backend, programs at the warpgroup/TMA level
(explicit shared-memory pipelines, ``wgmma``); the operators' own kernels
(``pallas_kernels/*_mgpu.py``) use it, and they are what ``ts.op`` runs.
"""

from tessera_jax.tile.ops import CooperativeGroup as CooperativeGroup
from tessera_jax.tile.ops import Idx as Idx
from tessera_jax.tile.ops import Lanes as Lanes
from tessera_jax.tile.ops import SharedTile as SharedTile
from tessera_jax.tile.ops import TileRef as TileRef
from tessera_jax.tile.ops import alloc_register as alloc_register
from tessera_jax.tile.ops import alloc_shared as alloc_shared
from tessera_jax.tile.ops import barrier as barrier
from tessera_jax.tile.ops import cooperative_group as cooperative_group
from tessera_jax.tile.ops import cp_async as cp_async
from tessera_jax.tile.ops import cp_commit_group as cp_commit_group
from tessera_jax.tile.ops import cp_wait_group as cp_wait_group
from tessera_jax.tile.ops import dot as dot
from tessera_jax.tile.ops import exp as exp
from tessera_jax.tile.ops import full as full
from tessera_jax.tile.ops import group_id as group_id
from tessera_jax.tile.ops import group_size as group_size
from tessera_jax.tile.ops import lane_id as lane_id
from tessera_jax.tile.ops import lanes as lanes
from tessera_jax.tile.ops import linear_id as linear_id
from tessera_jax.tile.ops import load as load
from tessera_jax.tile.ops import load_vector as load_vector
from tessera_jax.tile.ops import local_id as local_id
from tessera_jax.tile.ops import max as max
from tessera_jax.tile.ops import maximum as maximum
from tessera_jax.tile.ops import mma as mma
from tessera_jax.tile.ops import num_groups as num_groups
from tessera_jax.tile.ops import range as range
from tessera_jax.tile.ops import reduce_sum as reduce_sum
from tessera_jax.tile.ops import relu as relu
from tessera_jax.tile.ops import softmax as softmax
from tessera_jax.tile.ops import store as store
from tessera_jax.tile.ops import store_vector as store_vector
from tessera_jax.tile.ops import thread_id as thread_id
from tessera_jax.tile.ops import warp_id as warp_id
from tessera_jax.tile.ops import warp_lane as warp_lane
from tessera_jax.tile.ops import warp_shuffle_down as warp_shuffle_down
from tessera_jax.tile.ops import where as where
from tessera_jax.tile.ops import zeros as zeros
