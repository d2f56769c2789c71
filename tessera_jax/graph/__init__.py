"""``ts.graph``: operator graphs (capture and replay; graph modules and rewrites)."""

# Capture and replay (tessera_jax/graph/capture.py).
from tessera_jax._config import command_buffer_options as command_buffer_options
from tessera_jax.graph.capture import Graph as Graph
from tessera_jax.graph.capture import capture as capture
from tessera_jax.graph.capture import launch as launch
from tessera_jax.graph.capture import record_call as record_call
