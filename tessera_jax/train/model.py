"""The demo's model: a decoder-only transformer built from ts operators, written so
that its bits do not depend on how many devices run it.

Why the model is written in chunks and groups
---------------------------------------------
A matmul's bits depend on its shapes: XLA's and cuBLAS's GEMMs block the contraction
differently for different M or N, so a row computed in a 64-row matmul can differ in
the last bit from the same row computed in a 512-row one. Splitting a batch over more
devices, or a layer's columns over more devices, therefore changes the bits — unless
every per-device matmul keeps one shape whatever the mesh. So:

* The global batch is cut into a fixed number of groups of sequences (8 by default). A
  device runs its groups one after another (``lax.map``, or straight-line code on GPUs:
  ``step.make_train_step``'s ``unroll``), each group's forward and
  backward with the same shapes on any mesh. The per-group gradients are added on the
  canonical pairwise tree: locally over the device's groups, then across the ``dp`` axis with
  ``ts.all_reduce(..., deterministic=True)`` — together the tree over all groups in
  order, because group counts are powers of two and each device holds a contiguous run.
* Tensor parallelism splits the heads and the MLP's hidden units into ``chunks`` fixed
  chunks; the ``tp`` axis holds ``chunks / tp`` of them per device. Each chunk is one
  batch entry of a batched matmul (same shapes on any mesh). Where the math sums over
  chunks — the attention output and MLP down projections, and the gradient of the
  activations that fan out to every chunk — the partial results are added on the same
  canonical tree: locally, then across ``tp``. Nothing goes through ``lax.psum``.

Same shapes are not quite enough: XLA compiles each fused loop as a whole, and two
of its choices there depend on what else the loop holds. LLVM contracts a multiply
into an add when nothing stands between them, and a select on a condition that is a
constant in one program (a loop of one trip, inlined) folds away there only; and XLA's
CPU reductions leave their order to LLVM's vectoriser, which picks it from the whole
loop. The number of local chunks (a loop of one trip or several) and the cross-device
sum (local adds, a collective) are what differ between meshes, so: attention rounds its
scores and sums rows on the canonical tree (``ts.flash_attention``'s reference), the
tree sums no single leaf, and every cross-chunk sum ends in a collective on every mesh
(``all_sum``), so that no mesh-dependent code fuses into the norms that consume it.
XLA's CPU pipeline drops ``lax.optimization_barrier`` before fusing, so a barrier
would not separate them.

The result: the same loss, gradients and parameters, bit for bit, on any ``dp × tp``
mesh with ``dp`` dividing the group count and ``tp | chunks``, in one process or several.

Layout
------
Parameters are f32; activations use ``compute_dtype``. The chunked weights are stacked
``(layers, chunks, …)`` and sharded over ``tp`` on the chunk axis; everything else is
replicated. The embedding is a one-hot matmul (its gradient is then a matmul too, not
a scatter-add, which GPUs run with atomics) and positions are sinusoidal.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax.primitives.collectives.algorithms import SMALL_MESSAGE_BYTES
from tessera_jax.primitives.reductions import pairwise_tree_sum

DP, TP = "dp", "tp"

# The chunked weights: sharded over tp on their chunk axis (axis 1 after the layer axis).
CHUNKED = ("wqkv", "wo", "w1", "w2")


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo transformer.

    Attributes:
      vocab: the tokenizer's vocabulary (256 bytes).
      d_model: the residual width.
      n_layers: transformer blocks.
      n_heads: attention heads; ``d_model / n_heads`` is the head dim.
      d_ff: the MLP's hidden width.
      seq_len: tokens per sequence.
      chunks: the fixed tensor-parallel split of heads and MLP hidden units (a power
        of two dividing both); a mesh's ``tp`` must divide it.
      compute_dtype: the activations' dtype (``"float32"`` or ``"bfloat16"``).
    """

    vocab: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 8
    d_ff: int = 512
    seq_len: int = 64
    chunks: int = 4
    compute_dtype: str = "float32"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.type == "str":
                continue
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
                raise ValueError(f"ModelConfig: {f.name}={val!r} must be a positive int")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig: d_model={self.d_model} must be a multiple of n_heads={self.n_heads}"
            )
        if not is_power_of_two(self.chunks):
            raise ValueError(f"ModelConfig: chunks={self.chunks} must be a power of two")
        for name in ("n_heads", "d_ff"):
            if getattr(self, name) % self.chunks:
                raise ValueError(
                    f"ModelConfig: {name}={getattr(self, name)} must be a multiple of "
                    f"chunks={self.chunks}"
                )
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"ModelConfig: compute_dtype={self.compute_dtype!r} must be 'float32' or 'bfloat16'"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def heads_per_chunk(self) -> int:
        return self.n_heads // self.chunks

    @property
    def n_params(self) -> int:
        d, f, layer = self.d_model, self.d_ff, 4 * self.d_model**2 + 2 * self.d_model
        return self.n_layers * (layer + 2 * d * f) + 2 * self.vocab * d + d


def init(cfg: ModelConfig, key: jax.Array) -> dict[str, Any]:
    """Parameters with their global shapes (scaled normal weights, unit norm gains)."""
    c, L, d = cfg.chunks, cfg.n_layers, cfg.d_model
    hd = cfg.heads_per_chunk * cfg.head_dim
    ks = jax.random.split(key, 6)

    def normal(k, shape, fan_in):
        return jax.random.normal(k, shape, jnp.float32) / np.float32(math.sqrt(fan_in))

    return {
        "embed": normal(ks[0], (cfg.vocab, d), 1.0) * np.float32(0.02 * math.sqrt(d)),
        "layers": {
            "ln1": jnp.ones((L, d), jnp.float32),
            "wqkv": normal(ks[1], (L, c, d, 3 * hd), d),
            "wo": normal(ks[2], (L, c, hd, d), d) / np.float32(math.sqrt(2 * L)),
            "ln2": jnp.ones((L, d), jnp.float32),
            "w1": normal(ks[3], (L, c, d, cfg.d_ff // c), d),
            "w2": normal(ks[4], (L, c, cfg.d_ff // c, d), cfg.d_ff) / np.float32(math.sqrt(2 * L)),
        },
        "ln_f": jnp.ones((d,), jnp.float32),
        "head": normal(ks[5], (d, cfg.vocab), d),
    }


def param_specs(params: dict[str, Any]) -> dict[str, Any]:
    """The PartitionSpec of every parameter: chunked weights over ``tp``, the rest replicated."""
    return {
        k: ({n: P(None, TP) if n in CHUNKED else P() for n in v} if k == "layers" else P())
        for k, v in params.items()
    }


def all_sum(x: jax.Array, axis_name: str | None, algo: str | None = None) -> jax.Array:
    """``x`` summed across ``axis_name`` on the canonical tree (None: ``x`` itself), by
    ``ts.all_reduce``'s ``algo`` (None: the rule below).

    The sum must end in a collective on every mesh: XLA fuses whatever computes it into
    the consumer (the norm after a residual add, its backward), and on the CPU the
    consumer's own row sums then vectorise, and round, differently. ``"auto"`` ends in a
    collective (or the NVLink kernel) except for small messages over more than two
    parts, where it gathers and adds locally; ``"binary_tree"`` ends in an all-gather.
    So the rule takes ``"binary_tree"`` there and ``"auto"`` elsewhere. A sum whose
    result only leaves the program (the step's gradients) may name any algorithm.
    """
    if axis_name is None:
        return x
    if algo is None:
        small = x.size * x.dtype.itemsize <= SMALL_MESSAGE_BYTES
        algo = "binary_tree" if jax.lax.axis_size(axis_name) > 2 and small else "auto"
    return ts.all_reduce(x, "sum", axis=axis_name, algo=algo)


def tree_sum(x: jax.Array, axis_name: str | None, algo: str | None = None) -> jax.Array:
    """``(n, …) → (…)``: the canonical tree over the local leading axis, then across
    ``axis_name`` (None: this device holds every part), by ``algo`` (:func:`all_sum`)."""
    return all_sum(pairwise_tree_sum(x, axis=0), axis_name, algo)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fan_out(x: jax.Array, n: int, axis_name: str | None) -> jax.Array:
    """``x`` copied to the ``n`` local chunks; the gradient adds the chunks' cotangents
    on the canonical tree (locally, then across ``axis_name``)."""
    return jnp.broadcast_to(x, (n, *x.shape))


def _fan_out_fwd(x, n, axis_name):
    return fan_out(x, n, axis_name), None


def _fan_out_bwd(n, axis_name, _, ct):
    return (tree_sum(ct.astype(jnp.float32), axis_name).astype(ct.dtype),)


fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fan_in(parts: jax.Array, axis_name: str | None) -> jax.Array:
    """``(n, …) → (…)``: the chunks' partial results added on the canonical tree; the
    gradient copies the cotangent back to every chunk."""
    return tree_sum(parts.astype(jnp.float32), axis_name).astype(parts.dtype)


def _fan_in_fwd(parts, axis_name):
    return fan_in(parts, axis_name), parts.shape[0]


def _fan_in_bwd(axis_name, n, ct):
    return (jnp.broadcast_to(ct, (n, *ct.shape)),)


fan_in.defvjp(_fan_in_fwd, _fan_in_bwd)


def _positions(seq_len: int, d: int) -> np.ndarray:
    """Sinusoidal position embeddings ``(seq_len, d)`` (no parameters, no gradient)."""
    pos = np.arange(seq_len, dtype=np.float64)[:, None]
    freq = np.exp(-np.log(10000.0) * np.arange(0, d, 2, dtype=np.float64) / d)
    out = np.zeros((seq_len, d), np.float64)
    out[:, 0::2] = np.sin(pos * freq)
    out[:, 1::2] = np.cos(pos * freq)
    return out.astype(np.float32)


def _block(cfg: ModelConfig, tp_axis: str | None, x: jax.Array, lp: dict[str, jax.Array]):
    """One pre-norm transformer block on ``x: (B, S, d)``; ``lp`` holds this device's
    chunks of the layer's weights. The chunks run one after another (``lax.map``), not
    as one batched op: XLA's reductions round differently for different batch sizes,
    and the number of local chunks changes with ``tp``."""
    b, s, d = x.shape
    n = lp["wqkv"].shape[0]  # local chunks
    hc, dh = cfg.heads_per_chunk, cfg.head_dim
    cdt = x.dtype

    def attention(args):
        h, wqkv, wo = args
        q, k, v = jnp.split(ts.matmul(h, wqkv).reshape(b, s, 3 * hc, dh), 3, axis=2)
        att = ts.flash_attention(q, k, v, causal=True).reshape(b * s, hc * dh)
        return ts.matmul(att, wo)  # this chunk's share of the output projection

    def mlp(args):
        h, w1, w2 = args
        return ts.op.fused_mlp(h, w1, None, w2, None, activation="gelu")

    for norm, f, w_in, w_out in (("ln1", attention, "wqkv", "wo"), ("ln2", mlp, "w1", "w2")):
        h = ts.rmsnorm(x, lp[norm].astype(cdt)).reshape(b * s, d)
        if cfg.chunks == 1:
            # One chunk on every mesh: no sum, so no f32 round trip or one-trip loop.
            out = f((h, lp[w_in][0].astype(cdt), lp[w_out][0].astype(cdt)))
        else:
            parts = jax.lax.map(
                f, (fan_out(h, n, tp_axis), lp[w_in].astype(cdt), lp[w_out].astype(cdt))
            )
            out = fan_in(parts, tp_axis)
        x = x + out.reshape(b, s, d)
    return x


def compute_params(cfg: ModelConfig, params, unstack: bool = False):
    """``params`` as the forward reads them: cast to the compute dtype, and with
    ``unstack`` the stacked layers as a list of per-layer trees.

    A training step calls this once and differentiates each group with respect to the
    result, so the casts run once per step rather than once per group, and the group
    gradients stay in the compute dtype until they are added. Unstacked layers run as
    straight-line code whose gradients are per-layer arrays: they are stacked once,
    after the groups are added (``stack_layers``), instead of once per group. Bits do not
    change: a cast's gradient is the cotangent converted back, exactly, wherever it runs.
    """
    cdt = jnp.dtype(cfg.compute_dtype)
    out = jax.tree.map(lambda p: p.astype(cdt), params)
    if unstack:
        out["layers"] = [
            jax.tree.map(lambda p, i=i: p[i], out["layers"]) for i in range(cfg.n_layers)
        ]
    return out


def stack_layers(tree):
    """The inverse of ``compute_params``' unstacking (a stacked tree is returned as is)."""
    layers = tree["layers"]
    if isinstance(layers, (list, tuple)):
        tree = {**tree, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
    return tree


def logits(cfg: ModelConfig, params, tokens: jax.Array, tp_axis: str | None = None):
    """``tokens: (B, S) int → (B, S, vocab)`` f32 logits. ``tp_axis``: the bound mesh
    axis holding the other chunks (None: ``params`` holds every chunk). ``params``' layers
    are stacked (run in a ``lax.scan``) or a list of per-layer trees (``compute_params``;
    run as straight-line code, as the GPU step does: there a loop iteration costs a host
    round trip and the stacked residuals' copies)."""
    cdt = jnp.dtype(cfg.compute_dtype)
    b, s = tokens.shape
    onehot = jax.nn.one_hot(tokens.reshape(b * s), cfg.vocab, dtype=cdt)
    x = ts.matmul(onehot, params["embed"].astype(cdt)).reshape(b, s, cfg.d_model)
    x = x + jnp.asarray(_positions(cfg.seq_len, cfg.d_model)[None, :s], cdt)

    if isinstance(params["layers"], (list, tuple)):
        for lp in params["layers"]:
            x = _block(cfg, tp_axis, x, lp)
    else:
        body = lambda x, lp: (_block(cfg, tp_axis, x, lp), None)
        x, _ = jax.lax.scan(body, x, params["layers"])
    x = ts.rmsnorm(x, params["ln_f"].astype(cdt)).reshape(b * s, cfg.d_model)
    out = ts.matmul(x, params["head"].astype(cdt), out_dtype=jnp.float32)
    return out.reshape(b, s, cfg.vocab)


def loss(cfg: ModelConfig, params, window: jax.Array, tp_axis: str | None = None):
    """Mean next-token cross-entropy of ``window: (B, S + 1)`` (inputs ``[:, :-1]``,
    targets ``[:, 1:]``), summed on the canonical tree."""
    inputs, targets = window[:, :-1], window[:, 1:]
    logp = ts.log_softmax(logits(cfg, params, inputs, tp_axis))
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)
    return ts.sum(nll) / np.float32(nll.size)
