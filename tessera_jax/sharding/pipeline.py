"""Pipeline parallelism over a mesh axis: ``ts.dist.pipeline``.

``pipe = ts.dist.pipeline(layer, microbatches=4, schedule="gpipe", mesh=mesh, axis="pp")``
places consecutive layers on the devices of ``axis`` (stage s on the s-th
device) and streams microbatches through them; activations move between stages
with ``ppermute``.

Stages
------
* one callable ``layer(params, x) -> y`` with ``params`` stacked along a leading
  dim of L layers (L a multiple of the stage count S): stage s applies layers
  ``s·L/S … (s+1)·L/S - 1`` in order; the stacked params are partitioned over
  ``axis``, so each device holds only its layers;
* a list of L callables ``[f0, f1, …]`` with a list of L param pytrees: stage s
  applies its L/S functions; these params are replicated on every stage.

Every stage maps activations of one shape to the same shape (the buffer that
``ppermute`` passes along). Microbatch m is rows ``m·B/M … (m+1)·B/M - 1`` of x.

Schedules
---------
``"gpipe"``: ``M + S - 1`` ticks; at tick t stage s runs the forward of
microbatch ``t - s``. Without ``loss``, ``pipe(params, x)`` returns the outputs
(differentiable: JAX's reverse of the tick loop is GPipe's backward, all
microbatches' backwards after the forwards). With ``loss`` it returns the loss.

``"1f1b"`` (needs ``loss``): ``pipe(params, x, targets)`` returns the loss; under
``jax.grad`` its forward pass runs the interleaved schedule: ``M + 2S - 2``
ticks, at tick t stage s runs the forward of microbatch ``t - s`` and the
backward of microbatch ``t - 2S + 2 + s`` (the last stage's backward starts the
tick its forward ends), gradients flowing back by ``ppermute``. A stage keeps at
most ``2(S - s) - 1`` microbatch inputs (ring buffer of ``2S - 1``; the
backward recomputes the stage forward from its saved input), instead of all M
as GPipe does: memory bounded by the stage count, not the microbatch count.

``loss(y_m, targets_m) -> scalar`` is applied per microbatch; the pipeline loss
is their mean (the full-batch mean when ``loss`` is a mean over rows). The
gradients equal those of the unpipelined model (``pipe.sequential``) up to the
order in which per-microbatch gradients are added (microbatch order).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tessera_jax import _compat
from tessera_jax.sharding.mesh import (
    Mesh,
    as_mesh,
    constrain,
    positive_int,
    resolve_mesh,
)

SCHEDULES = ("gpipe", "1f1b")


def _neg_zero_like(x: jax.Array) -> jax.Array:
    # -0.0 is the identity of float addition for every value (+0.0 + -0.0 == +0.0), so a
    # psum in which one stage holds the value and the others -0.0 is exact in any order.
    return jnp.full_like(x, -0.0) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros_like(x)


def _from_stage(x: jax.Array, stage: jax.Array, s: int, axis: str) -> jax.Array:
    """The value of ``x`` on stage ``s``, on every stage (exact)."""
    return lax.psum(jnp.where(stage == s, x, _neg_zero_like(x)), axis)


class Pipeline:
    """A pipelined model (module docstring). Call it, or use ``.sequential`` as the
    unpipelined reference."""

    def __init__(
        self,
        stages: Callable[..., Any] | Sequence[Callable[..., Any]],
        microbatches: int,
        schedule: str = "gpipe",
        *,
        mesh: Mesh | None = None,
        axis: str = "pp",
        loss: Callable[[Any, Any], Any] | None = None,
    ):
        if not isinstance(schedule, str) or schedule not in SCHEDULES:
            raise ValueError(f"pipeline: schedule={schedule!r} must be one of {SCHEDULES}")
        microbatches = positive_int("pipeline", "microbatches", microbatches)
        if loss is not None and not callable(loss):
            raise TypeError(f"pipeline: loss={loss!r} must be a callable loss(y, targets) or None")
        if schedule == "1f1b" and loss is None:
            raise ValueError("pipeline: schedule='1f1b' interleaves backward passes; pass loss=")
        if not isinstance(axis, str) or not axis:
            raise TypeError(f"pipeline: axis={axis!r} must be a mesh-axis name")
        self.stacked = callable(stages)
        if not self.stacked:
            if not isinstance(stages, (list, tuple)):
                raise TypeError(
                    f"pipeline: stages={stages!r} must be a callable layer(params, x) or a "
                    "list of them"
                )
            stages = list(stages)
            if not stages or not all(callable(f) for f in stages):
                raise TypeError(
                    f"pipeline: stages={stages!r} must be a non-empty list of callables"
                )
        self.stages = stages
        self.microbatches = microbatches
        self.schedule = schedule
        self.mesh = None if mesh is None else as_mesh(mesh, "pipeline")
        self.axis = axis
        self.loss = loss

    # --- the unpipelined model --------------------------------------------------------------

    def sequential(self, params: Any, x: jax.Array) -> jax.Array:
        """Every layer in order on the whole batch: the model without the pipeline."""
        if self.stacked:
            return lax.scan(lambda h, p: (self.stages(p, h), None), x, params)[0]
        for f, p in zip(self.stages, params):
            x = f(p, x)
        return x

    def sequential_loss(self, params: Any, x: jax.Array, targets: Any) -> jax.Array:
        """The loss of the unpipelined model, averaged over the same microbatches."""
        ys = _split(self.sequential(params, x), self.microbatches)
        ts = jax.tree.map(lambda t: _split(t, self.microbatches), targets)
        losses = jax.vmap(self.loss)(ys, ts)
        return jnp.mean(losses)

    # --- the pipeline ----------------------------------------------------------------------

    def _setup(self, params: Any, x: jax.Array, targets: Any = None):
        m = resolve_mesh("pipeline", self.mesh)
        m.check_axes("pipeline", f"axis={self.axis!r}", (self.axis,))
        n = m.axis_size(self.axis)
        if x.ndim < 1:
            raise ValueError(
                f"pipeline: x of shape {x.shape} must have a batch dim to split into microbatches"
            )
        if self.stacked:
            leaves = jax.tree.leaves(params)
            leading = {getattr(a, "shape", ())[:1] for a in leaves}
            if not leaves or len(leading) != 1 or () in leading:
                raise ValueError(
                    "pipeline: params must be arrays stacked along a leading dim of layers (the "
                    f"same size in every leaf); got leaf shapes "
                    f"{[getattr(a, 'shape', type(a).__name__) for a in leaves]}"
                )
            n_layers = leaves[0].shape[0]
        else:
            n_layers = len(self.stages)
            if not isinstance(params, (list, tuple)):
                raise TypeError(
                    f"pipeline: {n_layers} stage functions take a list of {n_layers} params; "
                    f"got a {type(params).__name__}"
                )
            if len(params) != n_layers:
                raise ValueError(
                    f"pipeline: {n_layers} stage functions but {len(params)} params; pass one "
                    "param pytree per stage function"
                )
        if n_layers % n:
            raise ValueError(
                f"pipeline: {n_layers} layers cannot be split evenly over the {n} devices "
                f"of axis {self.axis!r}"
            )
        if x.shape[0] % self.microbatches:
            raise ValueError(
                f"pipeline: batch size {x.shape[0]} is not a multiple of "
                f"microbatches={self.microbatches}"
            )
        mb = jax.ShapeDtypeStruct((x.shape[0] // self.microbatches, *x.shape[1:]), x.dtype)
        if self.stacked:
            one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
            layers = [(self.stages, one)]
        else:
            layers = list(zip(self.stages, params))
        for i, (f, p) in enumerate(layers):
            out = jax.eval_shape(f, p, mb)
            if (getattr(out, "shape", None), getattr(out, "dtype", None)) != (mb.shape, mb.dtype):
                raise ValueError(
                    f"pipeline: layer {i} maps {mb.shape} {mb.dtype} to "
                    f"{getattr(out, 'shape', out)} {getattr(out, 'dtype', '')}; every stage must "
                    "keep the activation shape and dtype"
                )
        if targets is not None:
            self._check_targets(mb, targets, x.shape[0])
        return m, n, n_layers // n

    def _check_targets(self, mb: jax.ShapeDtypeStruct, targets: Any, batch: int) -> None:
        """Targets split into the same microbatches as x; the loss of one is a scalar."""
        for t in jax.tree.leaves(targets):
            if jnp.ndim(t) < 1 or jnp.shape(t)[0] != batch:
                raise ValueError(
                    f"pipeline: targets of shape {jnp.shape(t)} must have x's batch size "
                    f"{batch} as their leading dim"
                )
        t_mb = jax.tree.map(
            lambda t: jax.ShapeDtypeStruct((mb.shape[0], *jnp.shape(t)[1:]), jnp.result_type(t)),
            targets,
        )
        out = jax.eval_shape(self.loss, mb, t_mb)
        if getattr(out, "shape", None) != ():
            raise ValueError(
                f"pipeline: loss(y, targets) must return a scalar per microbatch; it returned "
                f"shape {getattr(out, 'shape', type(out).__name__)}"
            )

    def _stage_fn(self, per: int) -> Callable[..., Any]:
        """``apply(local_params, h, stage)``: this stage's ``per`` layers in order."""
        if self.stacked:
            return lambda p, h, stage: lax.scan(lambda c, q: (self.stages(q, c), None), h, p)[0]
        fns = self.stages

        def branch(s):
            def run(p, h):
                for i in range(s * per, (s + 1) * per):
                    h = fns[i](p[i], h)
                return h

            return run

        n_stages = len(fns) // per
        branches = [branch(s) for s in range(n_stages)]
        axis = self.axis

        def apply(p, h, stage):
            # Operands are marked varying first: with invariant operands and a varying
            # index, jax 0.10's transpose of lax.switch inside shard_map sends every
            # branch's parameter cotangent to branch 0.
            p, h = jax.tree.map(lambda a: _compat.pvary(a, (axis,)), (p, h))
            return lax.switch(stage, branches, p, h)

        return apply

    def _param_spec(self):
        return P(self.axis) if self.stacked else P()

    def _place(self, m: Mesh, params: Any, xs: Any, ts: Any) -> tuple[Any, Any, Any]:
        """On a mesh with Explicit axes, ``shard_map`` takes its inputs only laid out as its
        in_specs say: params partitioned over the pipeline axis (stacked) or replicated,
        the microbatches replicated."""
        if not m.explicit:
            return params, xs, ts
        place = lambda t, spec: jax.tree.map(
            lambda a: constrain(a, NamedSharding(m.jax_mesh, spec)), t
        )
        return place(params, self._param_spec()), place(xs, P()), place(ts, P())

    def __call__(self, params: Any, x: jax.Array, targets: Any = None) -> Any:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")) and not isinstance(x, (list, tuple)):
            raise TypeError(f"pipeline: x={x!r:.60} must be an array of shape (batch, ...)")
        x = jnp.asarray(x)
        if self.loss is None:
            if targets is not None:
                raise ValueError("pipeline: targets given but no loss=")
            return self._forward(params, x, None)
        if targets is None:
            raise ValueError(
                "pipeline: this pipeline has a loss: call it as pipe(params, x, targets)"
            )
        if self.schedule == "gpipe":
            return self._forward(params, x, targets)
        return _one_f_one_b(self, params, x, targets)

    def _forward(self, params: Any, x: jax.Array, targets: Any) -> Any:
        """GPipe: the forward tick loop (its reverse under jax.grad is GPipe's backward)."""
        m, n, per = self._setup(params, x, targets)
        M, axis, apply = self.microbatches, self.axis, self._stage_fn(per)
        loss_fn = self.loss

        def body(p, xs, ts):
            stage = lax.axis_index(axis)
            state = _compat.pvary(jnp.zeros_like(xs[0]), (axis,))
            outs = _compat.pvary(jnp.zeros_like(xs), (axis,))

            def tick(carry, t):
                state, outs = carry
                inp = jnp.where(stage == 0, xs[jnp.minimum(t, M - 1)], state)
                y = apply(p, inp, stage)
                done = t - (n - 1)
                write = (stage == n - 1) & (done >= 0)
                outs = jnp.where(write, outs.at[jnp.maximum(done, 0)].set(y), outs)
                state = lax.ppermute(y, axis, [(i, i + 1) for i in range(n - 1)])
                return (state, outs), None

            (_, outs), _ = lax.scan(tick, (state, outs), jnp.arange(M + n - 1))
            outs = _from_stage(outs, stage, n - 1, axis)
            if ts is None:
                return outs
            return jnp.mean(jax.vmap(loss_fn)(outs, ts))

        xs = _split(x, M)
        ts = None if targets is None else jax.tree.map(lambda t: _split(t, M), targets)
        fn = _compat.shard_map(
            body,
            mesh=m.jax_mesh,
            in_specs=(self._param_spec(), P(), P()),
            out_specs=P(),
            check_vma=True,
        )
        out = fn(*self._place(m, params, xs, ts))
        return out if targets is not None else out.reshape(x.shape[0], *out.shape[2:])

    def _one_f_one_b(self, params: Any, x: jax.Array, targets: Any):
        """The interleaved schedule: (loss, d loss / d params, d loss / d x)."""
        m, n, per = self._setup(params, x, targets)
        M, axis, apply, loss_fn = self.microbatches, self.axis, self._stage_fn(per), self.loss
        K = min(M, 2 * n - 1)  # stash slots (module docstring)
        stacked = self.stacked
        inv_m = 1.0 / M

        def body(p, xs, ts):
            stage = lax.axis_index(axis)
            zero_act = _compat.pvary(jnp.zeros_like(xs[0]), (axis,))
            carry0 = dict(
                act=zero_act,
                grad=zero_act,
                stash=_compat.pvary(jnp.zeros((K, *xs.shape[1:]), xs.dtype), (axis,)),
                gp=jax.tree.map(lambda a: _compat.pvary(jnp.zeros_like(a), (axis,)), p),
                dx=_compat.pvary(jnp.zeros_like(xs), (axis,)),
                loss=_compat.pvary(jnp.zeros((), jnp.float32), (axis,)),
            )

            def tick(c, t):
                f = t - stage  # forward microbatch
                b = t - (2 * n - 2) + stage  # backward microbatch
                f_ok = (f >= 0) & (f < M)
                b_ok = (b >= 0) & (b < M)
                fi, bi = jnp.clip(f, 0, M - 1), jnp.clip(b, 0, M - 1)
                # forward
                inp = jnp.where(stage == 0, xs[fi], c["act"])
                y = apply(p, inp, stage)
                stash = jnp.where(f_ok, c["stash"].at[fi % K].set(inp), c["stash"])
                # the last stage: loss and its gradient for microbatch f (== b there)
                t_f = jax.tree.map(lambda a: a[fi], ts)
                lval, dy = jax.value_and_grad(lambda yy: loss_fn(yy, t_f))(y)
                last = stage == n - 1
                loss = c["loss"] + jnp.where(last & f_ok, lval.astype(jnp.float32), 0.0)
                g_in = jnp.where(last, dy * jnp.asarray(inv_m, dy.dtype), c["grad"])
                # backward of microbatch b from its saved input (the forward recomputed)
                saved = stash[bi % K]
                _, vjp = jax.vjp(lambda q, h: apply(q, h, stage), p, saved)
                dp, dh = vjp(g_in)
                gp = jax.tree.map(
                    lambda a, d: a + jnp.where(b_ok, d, jnp.zeros_like(d)), c["gp"], dp
                )
                dx = jnp.where(b_ok & (stage == 0), c["dx"].at[bi].set(dh), c["dx"])
                act = lax.ppermute(y, axis, [(i, i + 1) for i in range(n - 1)])
                grad = lax.ppermute(dh, axis, [(i + 1, i) for i in range(n - 1)])
                return dict(act=act, grad=grad, stash=stash, gp=gp, dx=dx, loss=loss), None

            c, _ = lax.scan(tick, carry0, jnp.arange(M + 2 * n - 2))
            loss = _from_stage(c["loss"], stage, n - 1, axis) * inv_m
            dx = _from_stage(c["dx"], stage, 0, axis)
            gp = c["gp"]
            if not stacked:  # replicated params: layer i's gradient lives on stage i // per
                gp = [
                    jax.tree.map(lambda g, s=i // per: _from_stage(g, stage, s, axis), g)
                    for i, g in enumerate(gp)
                ]
            return loss, gp, dx

        xs = _split(x, M)
        ts = jax.tree.map(lambda t: _split(t, M), targets)
        spec = self._param_spec()
        fn = _compat.shard_map(
            body,
            mesh=m.jax_mesh,
            in_specs=(spec, P(), P()),
            out_specs=(P(), spec, P()),
            check_vma=True,
        )
        loss, gp, dx = fn(*self._place(m, params, xs, ts))
        gp, dx = (gp if stacked else type(params)(gp)), dx.reshape(x.shape)
        if m.explicit:
            # On Explicit axes a sharding is part of the type, and a custom_vjp cotangent
            # must have its primal's type: the gradients go back to the inputs' layouts.
            gp, dx = jax.tree.map(functools.partial(_like, m), gp, params), _like(m, dx, x)
        return loss, gp, dx


def _like(m: Mesh, g: jax.Array, primal: Any) -> jax.Array:
    """``g`` resharded to ``primal``'s type: its layout, or replicated on ``m`` when the
    primal carries no mesh (a single-device input)."""
    s = jax.typeof(primal).sharding
    if not getattr(s.mesh, "axis_names", ()):
        s = NamedSharding(m.jax_mesh, P())
    return jax.sharding.reshard(g, s)


def _split(x: jax.Array, m: int) -> jax.Array:
    return x.reshape(m, x.shape[0] // m, *x.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _one_f_one_b(pipe: Pipeline, params, x, targets):
    return pipe._forward(params, x, targets)


def _ofob_fwd(pipe, params, x, targets):
    loss, gp, dx = pipe._one_f_one_b(params, x, targets)
    return loss, (gp, dx)


def _ofob_bwd(pipe, res, ct):
    gp, dx = res
    scale = lambda g: (g * ct.astype(g.dtype)).astype(g.dtype)
    return jax.tree.map(scale, gp), scale(dx), None


_one_f_one_b.defvjp(_ofob_fwd, _ofob_bwd)


def pipeline(
    stages: Callable[..., Any] | Sequence[Callable[..., Any]],
    microbatches: int,
    schedule: str = "gpipe",
    *,
    mesh: Mesh | None = None,
    axis: str = "pp",
    loss: Callable[[Any, Any], Any] | None = None,
) -> Pipeline:
    """``ts.dist.pipeline(stages, microbatches=M, schedule="gpipe"|"1f1b", ...)``
    (module docstring)."""
    return Pipeline(stages, microbatches, schedule, mesh=mesh, axis=axis, loss=loss)
