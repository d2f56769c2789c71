"""``ts.graph``: operator graphs. Graph modules and their rewrite passes (module.py,
rewrite.py; docs/GRAPHS.md), capture and replay of eager operators (capture.py)."""

from tessera_jax._config import command_buffer_options as command_buffer_options
from tessera_jax.graph.capture import CapturedGraph as CapturedGraph
from tessera_jax.graph.capture import capture as capture
from tessera_jax.graph.capture import launch as launch
from tessera_jax.graph.capture import record_call as record_call
from tessera_jax.graph.module import Graph as Graph
from tessera_jax.graph.module import GraphModule as GraphModule
from tessera_jax.graph.module import module as module
from tessera_jax.graph.rewrite import DEFAULT_PASSES as DEFAULT_PASSES
from tessera_jax.graph.rewrite import AttentionFusion as AttentionFusion
from tessera_jax.graph.rewrite import Change as Change
from tessera_jax.graph.rewrite import GraphView as GraphView
from tessera_jax.graph.rewrite import Match as Match
from tessera_jax.graph.rewrite import MatmulEpilogueFusion as MatmulEpilogueFusion
from tessera_jax.graph.rewrite import Pass as Pass
from tessera_jax.graph.rewrite import PassReport as PassReport
from tessera_jax.graph.rewrite import PatternPass as PatternPass
from tessera_jax.graph.rewrite import Replacement as Replacement
from tessera_jax.graph.rewrite import TransposeFolding as TransposeFolding
