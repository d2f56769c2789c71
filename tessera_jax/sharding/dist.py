"""``ts.dist``: meshes, distributed tensors, distributions and pipelines."""

from tessera_jax.sharding.domain import Block as Block
from tessera_jax.sharding.mesh import Mesh as Mesh
from tessera_jax.sharding.mesh import current_mesh as current_mesh
from tessera_jax.sharding.mesh import mesh as mesh
from tessera_jax.sharding.pipeline import Pipeline as Pipeline
from tessera_jax.sharding.pipeline import pipeline as pipeline
from tessera_jax.sharding.runtime import initialize as initialize
from tessera_jax.sharding.spec import ShardSpec as ShardSpec
from tessera_jax.sharding.tensor import DistTensor as DistTensor
from tessera_jax.sharding.tensor import Parts as Parts
from tessera_jax.sharding.tensor import tensor as tensor
