"""Collectives as operators: all_reduce, all_gather, reduce_scatter, scatter, all_to_all.

*Inside an SPMD region* (``ts.index_launch``, ``jax.shard_map``), where ``axis`` is a
bound mesh axis, a collective combines the per-part values ``x`` of the parts along
``axis``, as in MPI/NCCL:

=================================  =================================================
``all_reduce(x, op, axis)``        every part gets ``op`` over the parts' ``x``
``all_gather(x, axis, dim)``       every part gets the parts' ``x`` concatenated on ``dim``
``reduce_scatter(x, axis, dim)``   the sum over parts; part r keeps slice r of ``dim``
``scatter(x, axis, dim)``          part r keeps slice r of ``dim`` of its ``x``
``all_to_all(x, axis, s, c)``      slice j of dim ``s`` goes to part j; received slices
                                   are concatenated on dim ``c`` in part order
=================================  =================================================

*Outside* (a global array or DistTensor, eager or under ``jax.jit``), a collective is the
same operation applied to the parts of ``x`` over ``axis`` of a mesh (``mesh=``, the mesh
of a DistTensor argument, or ``with mesh:``): ``all_reduce`` and ``reduce_scatter``
combine the parts (a DistTensor's blocks as its layout lays them out, a plain array's
slices of dim 0); ``all_gather``, ``scatter`` and ``all_to_all`` move data without
changing the global values: they reshard ``x`` (replicated / partitioned on ``dim`` /
partitioned on ``s`` instead of ``c``).

One file per job:

* :mod:`.algorithms`: the data path: the canonical tree over ranks, the algorithms that
  move data to it, and which one runs (determinism, algorithm names);
* :mod:`.dispatch`: the kernel record, the all-reduce's spec and kernel selection
  under ``TESSERA_KERNELS``;
* :mod:`.primitives`: the six primitives ``ts_<name>`` (abstract eval, lowering,
  JVP/transpose, batching) and ``replicate``;
* :mod:`.api`: the public functions, their argument checks and the global view.
"""

from tessera_jax.primitives.collectives.algorithms import ALGORITHMS as ALGORITHMS
from tessera_jax.primitives.collectives.algorithms import axis_size as axis_size
from tessera_jax.primitives.collectives.algorithms import choose_algo as choose_algo
from tessera_jax.primitives.collectives.algorithms import exchange as exchange
from tessera_jax.primitives.collectives.algorithms import order_free as order_free
from tessera_jax.primitives.collectives.algorithms import tree_all_reduce as tree_all_reduce
from tessera_jax.primitives.collectives.algorithms import tree_over_ranks as tree_over_ranks
from tessera_jax.primitives.collectives.algorithms import (
    tree_reduce_scatter as tree_reduce_scatter,
)
from tessera_jax.primitives.collectives.api import ALGOS as ALGOS
from tessera_jax.primitives.collectives.api import OPS as OPS
from tessera_jax.primitives.collectives.api import SCATTER_ALGOS as SCATTER_ALGOS
from tessera_jax.primitives.collectives.api import all_gather as all_gather
from tessera_jax.primitives.collectives.api import all_reduce as all_reduce
from tessera_jax.primitives.collectives.api import all_to_all as all_to_all
from tessera_jax.primitives.collectives.api import partition_entry as partition_entry
from tessera_jax.primitives.collectives.api import reduce_scatter as reduce_scatter
from tessera_jax.primitives.collectives.api import scatter as scatter
from tessera_jax.primitives.collectives.dispatch import AllReduceSpec as AllReduceSpec
from tessera_jax.primitives.collectives.dispatch import select_kernel as select_kernel
from tessera_jax.primitives.collectives.primitives import all_gather_p as all_gather_p
from tessera_jax.primitives.collectives.primitives import all_reduce_p as all_reduce_p
from tessera_jax.primitives.collectives.primitives import all_to_all_p as all_to_all_p
from tessera_jax.primitives.collectives.primitives import reduce_scatter_p as reduce_scatter_p
from tessera_jax.primitives.collectives.primitives import replicate as replicate
from tessera_jax.primitives.collectives.primitives import replicate_p as replicate_p
from tessera_jax.primitives.collectives.primitives import scatter_p as scatter_p
