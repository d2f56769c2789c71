"""``ts.launch``: kernel launches (``grid``, ``thread_id``).

``ts.launch.grid(blocks=(…), threads=(…))(kernel)(*args)`` runs a ``@ts.kernel`` over a
grid of groups (``tessera_jax/tile/``). The process launcher ``tessera-launch`` (``python
-m tessera_jax.launch``) lives in ``process.py``.
"""

from tessera_jax.tile.kernel import Grid as Grid
from tessera_jax.tile.kernel import grid as grid
from tessera_jax.tile.ops import thread_id as thread_id
