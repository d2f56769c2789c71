"""Distribution: meshes, ShardSpecs, DistTensors, index launches, domains, region
privileges, pipelines and the sharding rules of the kernel path.

Public names are re-exported by ``tessera_jax`` (``ts.dist``, ``ts.ShardSpec``,
``ts.index_launch``, ``ts.domain``, ``ts.array``, ``ts.Region``…).
"""

from tessera_jax.sharding import rules as _rules

_rules.install()
