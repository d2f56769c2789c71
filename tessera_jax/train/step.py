"""The demo's training step on a ``dp × tp`` mesh: per-group gradients added on the
canonical tree (``model.py`` says why), then AdamW.

The loss and gradients are computed under ``jax.shard_map`` — each device runs its
groups in turn (``lax.map``, or unrolled on GPUs) and the tensor-parallel chunks it
holds, and every sum across devices is ``ts.all_reduce(..., deterministic=True)``. The
optimizer update is elementwise, so it runs in the global view on the sharded parameters.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tessera_jax import _compat, _config
from tessera_jax.primitives.collectives.api import ALGOS
from tessera_jax.train import model
from tessera_jax.train.model import DP, TP, ModelConfig

# The global batch is cut into this many gradient groups by default: the data-parallel
# invariance holds for every dp dividing it. Fewer groups mean fewer, larger per-group
# launches (faster on few GPUs), more mean more meshes with the same bits.
GROUPS = 8


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with a warmup then inverse-square-root schedule.

    The learning rate at step ``i`` depends on ``i`` only (never on the run's length),
    so a run resumed at step ``k`` continues exactly as an uninterrupted one would.
    """

    peak_lr: float = 3e-3
    warmup: int = 20
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.01

    def schedule(self, step):
        step = jnp.asarray(step, jnp.float32) + 1.0
        warm = np.float32(self.warmup)
        return np.float32(self.peak_lr) * jnp.minimum(step / warm, jnp.sqrt(warm / step))

    def optimizer(self) -> optax.GradientTransformation:
        # Norm gains are not decayed.
        decay = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
        return optax.adamw(
            self.schedule, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay, mask=decay
        )


def make_mesh(devices, dp: int, tp: int) -> jax.sharding.Mesh:
    """A ``dp × tp`` mesh (Auto axes) over ``devices`` in order."""
    return _compat.make_mesh(np.asarray(devices, dtype=object).reshape(dp, tp), (DP, TP))


def check_layout(
    cfg: ModelConfig, mesh: jax.sharding.Mesh, batch: int, groups: int = GROUPS
) -> None:
    """Raises ValueError unless the mesh and batch keep the run mesh-invariant."""
    dp, tp = mesh.shape[DP], mesh.shape[TP]
    if not model.is_power_of_two(groups):
        raise ValueError(f"--groups={groups} must be a power of two")
    if batch % groups:
        raise ValueError(f"--batch={batch} must be a multiple of the {groups} gradient groups")
    if groups % dp:
        raise ValueError(f"the mesh's dp={dp} must divide the {groups} gradient groups")
    if cfg.chunks % tp:
        raise ValueError(
            f"the mesh's tp={tp} must divide the model's {cfg.chunks} tensor-parallel chunks"
        )


def shardings(mesh, tree_of_specs):
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), tree_of_specs, is_leaf=lambda s: isinstance(s, P)
    )


def _init_tree(cfg: ModelConfig, opt: optax.GradientTransformation, key) -> dict[str, Any]:
    params = model.init(cfg, key)
    return {"params": params, "opt_state": opt.init(params)}


def init_state(cfg: ModelConfig, optim: OptimConfig, mesh, seed: int) -> dict[str, Any]:
    """``{"params", "opt_state"}`` laid out on ``mesh``; the values do not depend on it."""
    return _initializer(cfg, optim, mesh)(jax.random.key(seed))


# Compiled programs are cached per (config, mesh): a resumed or repeated run in the same
# process (a notebook, the tests) does not compile them again.
@functools.lru_cache(maxsize=16)
def _initializer(cfg: ModelConfig, optim: OptimConfig, mesh):
    opt = optim.optimizer()
    init = functools.partial(_init_tree, cfg, opt)
    specs = state_specs(opt, jax.eval_shape(init, jax.random.key(0)))
    return jax.jit(init, out_shardings=shardings(mesh, specs))


def state_specs(opt: optax.GradientTransformation, state) -> dict[str, Any]:
    """The PartitionSpecs of ``{"params", "opt_state"}``: optimizer moments as their
    parameters, scalars (the step count) replicated."""
    specs = model.param_specs(state["params"])
    opt_specs = optax.tree_map_params(
        opt,
        lambda _, s: s,
        state["opt_state"],
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    return {"params": specs, "opt_state": opt_specs}


def _group_sums(vg, params, windows):
    """Each local group's loss and gradients (``vg(params, window)``), one group after
    another, converted to f32 and added on the canonical tree as they come: a
    binary counter keeps at most log2(groups) + 1 partial sums, and for a power-of-two
    count its adds are exactly ``pairwise_tree_sum``'s."""
    stack = []
    for i in range(windows.shape[0]):
        item = vg(params, windows[i])
        # The barrier asks XLA to finish one group before the next starts (one group's
        # activations live at a time). It is not what keeps the bits mesh-invariant: XLA's
        # CPU compiler removes barriers before it fuses (docs/DISTRIBUTION.md, Determinism).
        item, params = jax.lax.optimization_barrier((item, params))
        item = jax.tree.map(lambda x: x.astype(jnp.float32), item)
        level = 0
        while stack and stack[-1][0] == level:
            item = jax.tree.map(jnp.add, stack.pop()[1], item)
            level += 1
        stack.append((level, item))
    ((_, sums),) = stack
    return sums


@functools.lru_cache(maxsize=16)
def make_train_step(
    cfg: ModelConfig,
    optim: OptimConfig,
    mesh,
    groups: int = GROUPS,
    unroll: bool | None = None,
    deterministic: bool = True,
    grad_algo: str | None = None,
):
    """``step(state, windows) -> (state, loss)``, jitted; ``windows: (groups, B/groups,
    S + 1)`` int32 laid out over ``dp``.

    ``unroll``: run the layers and the local groups as straight-line code instead of
    loops (default: on GPUs, where each loop iteration costs a host round trip and the
    loops' stacked buffers cost copies; on the CPU the loops compile faster). Each gives
    the same bits on any mesh; the two are different programs, and in f32 XLA may contract
    their multiply-adds differently.

    ``deterministic``: compile the step's programs with
    ``_config.deterministic_compile_options`` (the same bits in every process). ``False``
    is for tools that jit the step again, such as ``ts.profile``: jax takes compile
    options on the outermost jit only.

    ``grad_algo``: the all-reduce algorithm (``ts.all_reduce``'s ``algo``) that sums the
    loss and gradients over ``dp`` (None: ``model.all_sum``'s rule). Every algorithm
    gives the canonical tree's bits, so the choice changes the time, not the result.
    """
    if grad_algo is not None and grad_algo not in ALGOS:
        raise ValueError(f"make_train_step: {grad_algo=} must be None or one of {ALGOS}")
    opt = optim.optimizer()
    abstract = jax.eval_shape(lambda key: _init_tree(cfg, opt, key), jax.random.key(0))
    specs = state_specs(opt, abstract)
    if unroll is None:
        unroll = mesh.devices.flat[0].platform == "gpu"
    vg = jax.value_and_grad(functools.partial(model.loss, cfg, tp_axis=TP))
    scale = np.float32(1.0 / groups)  # a power of two: exact

    def local(params, windows):
        cparams = model.compute_params(cfg, params, unstack=unroll)
        if unroll:
            loss, grads = _group_sums(vg, cparams, windows)
            grads = model.stack_layers(grads)
            reduce = functools.partial(model.all_sum, axis_name=DP, algo=grad_algo)
        else:
            loss, grads = jax.lax.map(lambda w: vg(cparams, w), windows)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            reduce = functools.partial(model.tree_sum, axis_name=DP, algo=grad_algo)
        return reduce(loss) * scale, jax.tree.map(lambda g: reduce(g) * scale, grads)

    # XLA's GPU autotuning would pick kernels, and so bits, per process.
    options = _config.deterministic_compile_options() if deterministic else None
    loss_and_grads = jax.jit(
        _compat.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs["params"], P(DP)),
            out_specs=(P(), specs["params"]),
            check_vma=False,
        ),
        compiler_options=options,
    )

    # The update is its own program: XLA contracts a*b + c*d into an FMA on one product
    # or the other depending on the program around it, so fused with the mesh-dependent
    # collectives above its rounding would depend on the mesh.
    @functools.partial(jax.jit, donate_argnums=0, compiler_options=options)
    def update(state, grads):
        # optax mixes int and float scalars (its step count), which strict promotion refuses.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    def step(state, windows):
        loss, grads = loss_and_grads(state["params"], windows)
        return update(state, grads), loss

    return step


def place_windows(mesh, windows: np.ndarray, groups: int = GROUPS) -> jax.Array:
    """The host batch ``(B, S + 1)`` as a global ``(groups, B/groups, S + 1)`` array laid
    out over ``dp`` (each process supplies its own devices' groups)."""
    grouped = windows.reshape(groups, windows.shape[0] // groups, windows.shape[1])
    sharding = NamedSharding(mesh, P(DP))
    return jax.make_array_from_callback(grouped.shape, sharding, lambda idx: grouped[idx])
