"""Sharding rules: how each ts operator runs on sharded operands under ``jax.jit``.

A Pallas kernel (``pallas_call``) is opaque to XLA's SPMD partitioner, which by
default replicates it: every device all-gathers the operands and computes the
whole result. Each rule here describes an operator's dims as factors, in the
einsum-like notation of Shardy (``"b s d -> b s d"``), and the operator's
lowering wraps its implementation in ``jax.experimental.custom_partitioning``
with that ``sharding_rule`` and a ``partition`` callback that runs the
implementation on local shards:

* pass-through factors (batch, heads, rows, matmul's M and N) keep the operands'
  sharding, so a batch-sharded op computes its shard without communication;
* ``replicated`` factors (the softmax/normalised axis, attention's sequence and
  head_dim) are gathered first if sharded (only that dim is gathered);
* ``reduction`` factors (matmul's K) that are sharded run as local partial
  results combined by the deterministic all-reduce (``primitives/collectives.py``),
  with the matmul epilogue applied after the combination.

Operators whose lowering is the XLA reference are partitioned by XLA itself
(the reference is plain jax.numpy) and get no wrapper, with these exceptions:
``sum(deterministic=True)`` and ``mse`` of floats always take their rule, which
makes a sum over a sharded axis mesh-size invariant by construction (below); flash
attention, softmax, log_softmax, rmsnorm, layernorm (and their adjoints) and
rmsnorm_matmul always take theirs too, which gather sharded sequences, head_dim or
normalised axes (XLA would split the reference's products and sums over them: other
bits). The weight gradients of the norms, sums over the rows, are the exception: their
local sums and the deterministic all-reduce are not the one-device order.

The rules are registered by operator name in ``primitives._core.SHARDING_RULES``;
``Operator._lower`` consults them only when lowering under the partitioner (jit
over several devices), not inside ``shard_map`` or on one device.

Mesh-size invariance of ``sum``
-------------------------------
``ts.op.sum`` adds on the canonical tree over the flattened reduced index space
``0 … N-1`` (``primitives/reductions.py``): level ``l`` node ``i`` is the sum of
leaves ``[i·2^l, (i+1)·2^l)`` (the last one partial), computed as the tree of that
block. Let the reduced dims be sharded so that each device holds, for every
prefix of the unsharded leading reduced dims, a contiguous run of ``R`` leaves
starting at a multiple of ``R`` (``R`` = the local block of the last sharded
reduced dim times the sizes of the reduced dims after it). With ``L = v2(R)``
(the largest power of two dividing ``R``), each device's run is ``R/2^L`` whole,
aligned level-``L`` subtrees. The rule:

1. locally, the first ``L`` levels: ``R/2^L`` subtree sums per run (explicit
   pairwise adds, f32 for 8-/16-bit inputs);
2. across devices, the level-``L`` nodes of all devices, in global order, summed
   on the same canonical tree (levels ``L+1 …``): when one mesh-axis group
   shards the reduced dims and the output has at least ``n`` elements, by
   ``all_to_all`` (each device receives all nodes of ``1/n`` of the outputs),
   the local tree, and ``all_gather``; otherwise by ``all_gather`` of the nodes
   and the tree on every device.

Every add has the same operands in the same order as on one device, so the bits
equal the unsharded ``ts.op.sum`` for any mesh size. (The tree's leaves pass a
select that keeps XLA from contracting a producing multiply into the first-level
adds: such FMAs would depend on fusion decisions, which differ between meshes;
see ``reductions._leaves``.) Cost: the local levels read
the input once; the cross-device step moves ``c = R/2^L`` values per output
element and device: ``c = 1`` when the local block is a power of two (the
bandwidth of an all-reduce of the output, ``2(n-1)/n`` of it), up to the whole
local block when ``R`` is odd (then the rule all-gathers the block's leaves: an
odd local block cannot be reduced locally without changing the bits).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tessera_jax import _compat
from tessera_jax._config import get_kernel_mode, kernel_mode
from tessera_jax.contracts.matmul import MatmulSpec, epilogue, epilogue_with_derivative
from tessera_jax.primitives import _core
from tessera_jax.primitives import collectives as _coll
from tessera_jax.primitives.collectives import partition_entry
from tessera_jax.primitives.reductions import canonical_sum, pairwise_tree_sum
from tessera_jax.sharding.spec import entry_axes

Dim = str | tuple[str, ...]  # a factor, or a compound (major, …, minor) of factors


@dataclasses.dataclass(frozen=True)
class Factors:
    """An operator's dims as Shardy factors.

    Attributes:
      operands: per operand, per dim: a factor name or a compound (major…minor).
      results: likewise per result.
      sizes: every factor's size.
      replicated: factors that must not be sharded (gathered first if they are).
      reduction: factors absent from the results whose sharding leaves partial
        results to combine (see ``Rule.combine``).
    """

    operands: tuple[tuple[Dim, ...], ...]
    results: tuple[tuple[Dim, ...], ...]
    sizes: dict[str, int]
    replicated: tuple[str, ...] = ()
    reduction: tuple[str, ...] = ()

    def sdy_rule(self) -> SdyShardingRule:
        def mapping(dims):
            return ArrayMapping(*(CompoundFactor(*d) if isinstance(d, tuple) else d for d in dims))

        whole = {d for m in self.operands + self.results for d in m if isinstance(d, str)}
        compound_only = {
            f: self.sizes[f]
            for m in self.operands + self.results
            for d in m
            if isinstance(d, tuple)
            for f in d
            if f not in whole
        }
        order = {}  # Shardy wants special factors in the order factors first appear
        for m in self.operands + self.results:
            for d in m:
                for f in d if isinstance(d, tuple) else (d,):
                    order.setdefault(f, len(order))
        return SdyShardingRule(
            tuple(map(mapping, self.operands)),
            tuple(map(mapping, self.results)),
            reduction_factors=tuple(sorted(set(self.reduction), key=order.__getitem__)),
            need_replication_factors=tuple(sorted(set(self.replicated), key=order.__getitem__)),
            **compound_only,
        )


def _major(d: Dim) -> str:
    return d[0] if isinstance(d, tuple) else d


def _mesh_size(mesh: Any, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _spec_of(sharding: Any, ndim: int) -> tuple[Any, ...]:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


def assign_factors(mesh: Any, factors: Factors, shardings: Sequence[Any]) -> dict[str, tuple]:
    """Mesh axes per factor, taken from the operands' shardings in operand order.

    A factor keeps the first sharding seen for it, unless it must be replicated,
    its size is not divisible, or an axis is already taken by another factor.
    """
    assign: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    for mapping, sharding in zip(factors.operands, shardings):
        for d, entry in zip(mapping, _spec_of(sharding, len(mapping))):
            f, axes = _major(d), entry_axes(entry)
            if not axes or f in assign or f in factors.replicated or used & set(axes):
                continue
            if factors.sizes[f] % _mesh_size(mesh, axes):
                continue
            assign[f] = axes
            used.update(axes)
    return assign


def _sharding(mesh: Any, mapping: tuple[Dim, ...], assign: dict[str, tuple]) -> NamedSharding:
    return NamedSharding(mesh, P(*(partition_entry(assign.get(_major(d), ())) for d in mapping)))


@dataclasses.dataclass(frozen=True)
class Rule:
    """A sharding rule: ``factors(avals_in, params) -> Factors | None`` (None: no rule
    for this case), ``combine(outs, axes, local_avals, params) -> outs`` for sharded
    reduction factors (default: not allowed — they are gathered), and whether it
    applies to the XLA reference lowering too (``always``) or only to kernels."""

    factors: Callable[[Sequence[Any], dict[str, Any]], Factors | None]
    combine: Callable[..., Any] | None = None
    always: bool = False
    local: Callable[..., Any] | None = None  # replaces "impl then combine" when given
    # ``always`` rules: how the factors change where the reference runs (None: they don't)
    for_reference: Callable[[Factors], Factors] | None = None


def _local_impl(op: Any, platform: str | None, mode: str, params: dict[str, Any]):
    """The implementation to run on local shards: selected again for the local shapes
    (with ``op=``, another operator's, for a product a rule computes on the way)."""

    def run(*xs, op=op, **override):
        p = {**params, **override}
        with kernel_mode(mode):  # (an implementation may pick nested operators' too)
            return op.apply(platform, *xs, **p)

    return run


def _wrap(rule: Rule, op: Any, impl: str, fn: Any, platform: str | None, avals_in, params):
    if not rule.always and impl == "reference":
        return None
    factors = rule.factors(avals_in, params)
    if factors is None:
        return None
    if impl == "reference" and rule.for_reference is not None:
        factors = rule.for_reference(factors)
    mode = get_kernel_mode()
    multiple = op.prim.multiple_results
    local_impl = _local_impl(op, platform, mode, params)

    def shardings(mesh, arg_shapes):
        if rule.combine is None and rule.local is None:
            # Unsharded reduction factors only: treat them as replicated.
            f = dataclasses.replace(factors, replicated=(*factors.replicated, *factors.reduction))
        else:
            f = factors
        assign = assign_factors(mesh, f, [a.sharding for a in arg_shapes])
        args = tuple(_sharding(mesh, m, assign) for m in factors.operands)
        outs = tuple(_sharding(mesh, m, assign) for m in factors.results)
        red = tuple(a for r in factors.reduction for a in assign.get(r, ()))
        return assign, args, outs, red

    def partition(mesh, arg_shapes, result_shape):
        assign, args, outs, red = shardings(mesh, arg_shapes)

        def lower_fn(*xs):
            with _compat.outside_mesh_context():
                if rule.local is not None:
                    return rule.local(local_impl, xs, assign, factors, params)
                out = local_impl(*xs)
                if red:
                    out = rule.combine(out, red, [jax.typeof(x) for x in xs], params)
                return out

        return mesh, lower_fn, _like(result_shape, outs), args

    def infer(mesh, arg_shapes, result_shape):  # the GSPMD (non-Shardy) partitioner
        _, _, outs, _ = shardings(mesh, arg_shapes)
        return _like(result_shape, outs)

    def _like(result_shape, outs):
        """The results' shardings in the container the implementation returns (a tuple or
        a list: custom_partitioning matches the pytree)."""
        if not multiple:
            return outs[0]
        return list(outs) if isinstance(result_shape, list) else outs

    wrapped = _compat.custom_partitioning(lambda *xs: fn(*xs, **params))
    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=factors.sdy_rule(),
    )
    return lambda *xs, **_: wrapped(*xs)


def register(name: str, rule: Rule) -> None:
    """Installs ``rule`` for the operator ``name`` (it may be defined later)."""
    _core.SHARDING_RULES[name] = functools.partial(_apply, rule)
    op = _core.OPERATORS.get(name)
    if op is not None:
        _compat.require_devices_during_lowering(op.prim)


def _apply(rule: Rule, op, impl, fn, platform, avals_in, params):
    return _wrap(rule, op, impl, fn, platform, avals_in, params)


def install() -> None:
    """(Re)registers every rule; call after new operators are defined."""
    for name, rule in RULES.items():
        register(name, rule)


# --- factor helpers ----------------------------------------------------------------------


def _names(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(n))


def _sizes(names: Sequence[Dim], shape: Sequence[int]) -> dict[str, int]:
    return {d: s for d, s in zip(names, shape) if isinstance(d, str)}


def elementwise_factors(avals_in, params) -> Factors:
    """Every dim passes through (elementwise ops, casts; operands of one shape)."""
    x = avals_in[0]
    dims = _names("d", x.ndim)
    return Factors((dims,) * len(avals_in), (dims,), _sizes(dims, x.shape))


def _last_axis_factors(axis_of: Callable[[dict[str, Any], int], int]):
    """x (and weight/bias over the normalised axis); that axis replicated."""

    def factors(avals_in, params):
        x = avals_in[0]
        ax = axis_of(params, x.ndim)
        dims = _names("d", x.ndim)
        extra = tuple((dims[ax],) for _ in avals_in[1:])
        return Factors((dims, *extra), (dims,), _sizes(dims, x.shape), replicated=(dims[ax],))

    return factors


axis_factors = _last_axis_factors(lambda p, nd: p["axis"] % nd)  # softmax, fft
norm_factors = _last_axis_factors(lambda p, nd: nd - 1)


def reduction_factors(avals_in, params) -> Factors:
    """``sum``/``max`` over ``axes``: kept dims pass through, reduced dims are reductions."""
    x = avals_in[0]
    axes, keepdims = params["axes"], params["keepdims"]
    dims = _names("d", x.ndim)
    out = tuple(
        (f"k{a}" if a in axes else d) for a, d in enumerate(dims) if keepdims or a not in axes
    )
    return Factors((dims,), (out,), _sizes(dims, x.shape), reduction=tuple(dims[a] for a in axes))


# The factors of attention's integer operands (lengths, segment ids).
_ATTENTION_INDEX_DIMS = {
    "q_lengths": ("b",),
    "kv_lengths": ("b",),
    "q_segment_ids": ("b", "s"),
    "kv_segment_ids": ("b", "t"),
}


def attention_fwd_factors(avals_in, params) -> Factors:
    """q (b s h d), k/v (b t hk d), extras -> out (b s h d), lse (b h s): batch and heads
    pass; the sequences and head_dim are replicated (a contraction split over devices would
    add its partial sums in another order). The extras (``contracts/attention.py``) name
    the same factors, a dim they broadcast along (size 1) a factor of its own; a bias
    whose gradient is wanted and that broadcasts over the batch or heads sums its
    gradient over them, so those factors are replicated too."""
    spec = params["spec"]
    q, k = avals_in[0], avals_in[1]
    b, s, hq, d = q.shape
    t, hk = k.shape[1], k.shape[2]
    # Query heads: the kv heads' factor, or (kv head, group) compound; MQA's one kv head
    # is a factor of size 1, which Shardy allows only alone: the group then stands alone.
    qh = "h" if hq == hk else ("g" if hk == 1 else ("h", "g"))
    sizes = {"b": b, "s": s, "h": hk, "d": d, "t": t}
    if hq != hk:
        sizes["g"] = hq // hk
    q_m, kv_m = ("b", "s", qh, "d"), ("b", "t", "h", "d")
    extras = spec.split(avals_in[3 : 3 + spec.num_extras])
    replicated = ["s", "t", "d"]
    maps = []
    for name, x in zip(extras._fields, extras):
        if x is None:
            continue
        if name in ("mask", "bias"):
            m = []
            for i, (size, f) in enumerate(zip(x.shape, ("b", qh, "s", "t"))):
                if size == 1 and (b, hq, s, t)[i] != 1:
                    f = f"{name}{i}"  # broadcast: its own factor, of size 1
                    sizes[f] = 1
                m.append(f)
            if name == "bias" and spec.bias_grad:
                replicated += [_major(f) for f, size in zip(("b", qh), x.shape[:2]) if size == 1]
            maps.append(tuple(m))
        else:
            maps.append(_ATTENTION_INDEX_DIMS[name])
    return Factors(
        (q_m, kv_m, kv_m, *maps), (q_m, ("b", qh, "s")), sizes, replicated=tuple(replicated)
    )


def _whole_groups(f: Factors) -> Factors:
    """The reference's attention factors: GQA/MQA heads are not split. The query heads
    become a factor of their own (``q``), unlinked from the kv heads' (``h``), and both
    are replicated. (Linked as a (kv head, group) compound, Shardy splits a mesh axis
    over the compound with sub-axes where the kv heads are fewer than the axis, and
    custom_partitioning cannot express the operands it then gets; a kernel's rule keeps
    the compound, and the heads split, for its speed.)"""
    if "g" not in f.sizes:
        return f
    heads = lambda d: "q" if d in (("h", "g"), "g") else d
    remap = lambda maps: tuple(tuple(map(heads, m)) for m in maps)
    sizes = {n: x for n, x in f.sizes.items() if n != "g"}
    sizes["q"] = f.sizes["g"] * f.sizes["h"]
    replicated = (*(r for r in f.replicated if r != "g"), "h", "q")
    return dataclasses.replace(
        f, operands=remap(f.operands), results=remap(f.results), sizes=sizes, replicated=replicated
    )


def attention_bwd_factors(avals_in, params) -> Factors:
    """(q, k, v, out, lse, dout, *extras[, dlse]) -> (dq, dk, dv[, dbias]), batch and heads
    pass (:func:`attention_fwd_factors`)."""
    spec = params["spec"]
    f = attention_fwd_factors((*avals_in[:3], *avals_in[6 : 6 + spec.num_extras]), params)
    q_m, kv_m, _, *maps = f.operands
    lse_m = f.results[1]
    dlse = (lse_m,) if spec.has_dlse else ()
    dbias = ()
    if spec.bias_grad:
        dbias = (maps[spec.has_mask],)
    # dK and dV sum over a kv head's group of query heads: the group is not split (MQA's
    # group is a factor of its own, which the query heads' sharding would split).
    replicated = (*f.replicated, "g") if "g" in f.sizes else f.replicated
    return dataclasses.replace(
        f,
        operands=(q_m, kv_m, kv_m, q_m, lse_m, q_m, *maps, *dlse),
        results=(q_m, kv_m, kv_m, *dbias),
        replicated=replicated,
    )


def attention_jvp_factors(avals_in, params) -> Factors:
    """(q, k, v, out, lse, *extras, *tangents) -> (t_out, t_lse), batch and heads pass
    (:func:`attention_fwd_factors`); a tangent is typed like its primal."""
    spec = params["spec"]
    n = spec.num_extras
    f = attention_fwd_factors((*avals_in[:3], *avals_in[5 : 5 + n]), params)
    q_m, kv_m, _, *maps = f.operands
    lse_m = f.results[1]
    like = {"q": q_m, "k": kv_m, "v": kv_m}
    if spec.has_bias:
        like["bias"] = maps[spec.has_mask]
    tangents = tuple(like[t] for t in spec.tangents)
    return dataclasses.replace(f, operands=(q_m, kv_m, kv_m, q_m, lse_m, *maps, *tangents))


# --- sum: the mesh-size-invariant tree (module docstring) -------------------------------


def _v2(n: int) -> int:
    """The largest power of two dividing n (n > 0)."""
    return n & -n


def _sum_local(local_impl, xs, assign, factors, params):
    """``sum`` on local shards: local levels, then the top of the canonical tree."""
    (x,) = xs
    axes, keepdims = params["axes"], params["keepdims"]
    red_dims = factors.operands[0]
    sharded = [a for a in axes if assign.get(red_dims[a])]
    if not sharded:
        return local_impl(x)
    kept = [a for a in range(x.ndim) if a not in axes]
    acc = _core.compute_dtype(x.dtype)
    xt = jnp.transpose(x, kept + list(axes)).astype(acc)  # (*kept, *reduced) local
    kshape = xt.shape[: len(kept)]
    rshape = xt.shape[len(kept) :]
    last = max(axes.index(a) for a in sharded)  # position of the last sharded reduced dim
    run = math.prod(rshape[last:])
    block = _v2(run)
    c = run // block
    # (*kept, *rshape[:last], c, block) -> level-L nodes (*kept, *rshape[:last], c)
    nodes = pairwise_tree_sum(xt.reshape(*kshape, *rshape[:last], c, block))
    group = tuple(a for r in axes for a in assign.get(red_dims[r], ()))
    nk = math.prod(kshape)
    if len(sharded) == 1 and nk >= _coll.axis_size(group):
        # One sharded reduced dim (the last one, so nodes of a device are contiguous per
        # output): all_to_all over the outputs, the top of the tree locally, all_gather.
        n = _coll.axis_size(group)
        flat = nodes.reshape(nk, -1)  # (outputs, prefix * c) ; global order = prefix, rank, c
        pre = math.prod(rshape[:last])
        m = -(-nk // n)
        if m * n != nk:
            flat = jnp.pad(flat, ((0, m * n - nk), (0, 0)))
        recv = _coll.exchange(flat.reshape(n, m, pre, c), group, "binary_tree")  # [rank, m, pre, c]
        ordered = jnp.transpose(recv, (1, 2, 0, 3)).reshape(m, pre * n * c)
        mine = pairwise_tree_sum(ordered)
        full = jax.lax.all_gather(mine, group, axis=0, tiled=True)[:nk]
        out = full.reshape(kshape)
    else:
        # General case: gather every device's nodes in global order, the tree everywhere.
        g = nodes
        for i, a in enumerate(axes):
            if assign.get(red_dims[a]) and i <= last:
                # nodes dims: (*kept, *reduced[:last], c): reduced dim i sits at len(kept) + i
                g = jax.lax.all_gather(g, assign[red_dims[a]], axis=len(kshape) + i, tiled=True)
        out = pairwise_tree_sum(g.reshape(*kshape, -1))
    out = out.astype(x.dtype)
    if keepdims:
        out = out.reshape([1 if a in axes else x.shape[a] for a in range(x.ndim)])
    return out


def _mse_factors(avals_in, params):
    if not _core.is_float(avals_in[0].dtype):
        return None
    dims = _names("d", avals_in[0].ndim)
    return Factors((dims, dims), ((),), _sizes(dims, avals_in[0].shape), reduction=dims)


def _mse_local(local_impl, xs, assign, factors, params):
    """``mse`` on local shards: the squared differences summed like ``sum`` (above)."""
    pred, target = xs
    acc = _core.compute_dtype(pred.dtype)
    d = pred.astype(acc) - target.astype(acc)
    every = tuple(range(d.ndim))
    total = _sum_local(
        lambda v: canonical_sum(v, every, False),
        (d * d,),
        assign,
        dataclasses.replace(factors, operands=factors.operands[:1]),
        {"axes": every, "keepdims": False},
    )
    size = math.prod(factors.sizes[f] for f in factors.operands[0])
    return (total / np.asarray(size, acc)).astype(pred.dtype)


def _sum_factors(avals_in, params):
    if not (params.get("deterministic") and _core.is_float(avals_in[0].dtype)):
        return None
    return reduction_factors(avals_in, params)


def _reduce_combine(kind: str):
    def combine(out, axes, local_avals, params):
        return (jax.lax.psum if kind == "sum" else jax.lax.pmax)(out, axes)

    return combine


# --- matmul: batch / row / column parallel ---------------------------------------------


def matmul_factors(avals_in, params) -> Factors:
    """``ts_matmul`` (``contracts/matmul.py``): a (…, m, k), b (…, k, n), bias (n),
    residual (…, m, n), scale (); K is a reduction factor."""
    spec: MatmulSpec = params["spec"]
    a, b = avals_in[0], avals_in[1]
    nb = max(a.ndim, b.ndim) - 2
    batch = _names("b", nb)
    a_m = (*(batch if a.ndim > 2 else ()), *(("k", "m") if spec.transpose_a else ("m", "k")))
    b_m = (*(batch if b.ndim > 2 else ()), *(("n", "k") if spec.transpose_b else ("k", "n")))
    out = (*batch, "m", "n")
    extras = []
    if spec.has_bias:
        extras.append(("n",))
    if spec.has_residual:
        extras.append(out)
    if spec.has_scale:
        extras.append(())
    sizes = {**_sizes(a_m, a.shape), **_sizes(b_m, b.shape)}
    return Factors((a_m, b_m, *extras), (out,), sizes, reduction=("k",))


def matmul_with_derivative_factors(avals_in, params) -> Factors:
    """``ts_matmul_with_derivative``: ``ts_matmul``'s factors, and two results of the
    output's shape (y and the activation's derivative)."""
    f = matmul_factors(avals_in, params)
    return dataclasses.replace(f, results=f.results * 2)


def _matmul_local(local_impl, xs, assign, factors, params, finish=epilogue):
    """Local shards; a sharded K: partial products in the accumulate dtype, the
    deterministic all-reduce, then the contract's epilogue (scale, bias, activation,
    residual, cast; ``finish``: the two-output form's)."""
    if not assign.get("k"):
        return local_impl(*xs)
    spec: MatmulSpec = params["spec"]
    a, b, *extras = xs
    bias, residual, scale = spec.split(extras)
    product = spec.replace(
        out_dtype=spec.accumulate_dtype,
        activation=None,
        has_bias=False,
        has_residual=False,
        has_scale=False,
    )
    # The partial products are plain ts_matmul products: the local implementation of the
    # plain operator computes them.
    matmul_impl = functools.partial(local_impl, op=_core.OPERATORS["matmul"])
    acc = _coll.tree_all_reduce(matmul_impl(a, b, spec=product), assign["k"])
    return finish(acc, bias, residual, scale, activation=spec.activation, out_dtype=spec.out_dtype)


RULES: dict[str, Rule] = {
    "matmul": Rule(matmul_factors, local=_matmul_local),
    "matmul_with_derivative": Rule(
        matmul_with_derivative_factors,
        local=functools.partial(_matmul_local, finish=epilogue_with_derivative),
    ),
    "sum": Rule(_sum_factors, local=_sum_local, always=True),
    "mse": Rule(_mse_factors, local=_mse_local, always=True),
    "max": Rule(reduction_factors, combine=_reduce_combine("max")),
    # Always, the reference too: XLA would split a normalised axis that is sharded over
    # devices into partial sums (other bits than on one device).
    "softmax": Rule(axis_factors, always=True),
    "fft": Rule(axis_factors),
    "log_softmax": Rule(axis_factors, always=True),
    "rmsnorm": Rule(norm_factors, always=True),
    "layernorm": Rule(norm_factors, always=True),
    # Always, the reference too: a sequence sharded over devices would have XLA split the
    # reference's contractions and sums (other bits than on one device).
    "flash_attention_fwd": Rule(attention_fwd_factors, always=True, for_reference=_whole_groups),
    "flash_attention_bwd": Rule(attention_bwd_factors, always=True, for_reference=_whole_groups),
    "flash_attention_jvp": Rule(attention_jvp_factors, always=True, for_reference=_whole_groups),
    **{
        name: Rule(elementwise_factors)
        for name in (
            "relu",
            "gelu",
            "tanh",
            "exp",
            "sqrt",
            "abs",
            "round",
            "cast",
            "stochastic_cast",
        )
    },
}


# --- the adjoints of softmax, log_softmax, rmsnorm and layernorm ------------------------------


def adjoint_axis_factors(avals_in, params) -> Factors:
    """``ts_softmax_bwd`` / ``ts_log_softmax_bwd``: ``(y, g) -> dx`` of one shape, ``axis``
    replicated, every other dim passing through."""
    x = avals_in[0]
    dims = _names("d", x.ndim)
    sizes = _sizes(dims, x.shape)
    return Factors((dims, dims), (dims,), sizes, replicated=(dims[params["axis"]],))


def norm_bwd_factors(avals_in, params) -> Factors | None:
    """``ts_<norm>_bwd(x, [w], ct) -> (dx, [dw], [db])`` with ``(D,)`` parameters: rows pass
    through to dx; dw/db, sums over the rows, are combined by :func:`_norm_bwd_local`.
    (A vmapped weight of another shape runs the XLA reference, which XLA partitions.)"""
    x = avals_in[0]
    d = x.shape[-1]
    if any(a.shape not in (x.shape, (d,)) for a in avals_in[1:]):
        return None
    dims = _names("d", x.ndim)
    last = (dims[-1],)
    operands = (dims, *([last] if params["has_weight"] else []), dims)
    grads = [s for s in (params["weight_grad_shape"], params.get("bias_grad_shape")) if s]
    results = (dims, *(last for _ in grads))
    return Factors(operands, results, _sizes(dims, x.shape), replicated=last)


def _norm_bwd_local(local_impl, xs, assign, factors, params):
    """Local rows: dx, and the column sums of this device's rows, added over the mesh axes
    that shard the rows by the deterministic all-reduce."""
    dx, *grads = local_impl(*xs)
    axes = tuple(a for dim in factors.operands[0][:-1] for a in assign.get(dim, ()))
    if axes:
        grads = [_coll.tree_all_reduce(g, axes) for g in grads]
    return [dx, *grads]


RULES.update(
    {
        "softmax_bwd": Rule(adjoint_axis_factors, always=True),
        "log_softmax_bwd": Rule(adjoint_axis_factors, always=True),
        "rmsnorm_bwd": Rule(norm_bwd_factors, local=_norm_bwd_local, always=True),
        "layernorm_bwd": Rule(norm_bwd_factors, local=_norm_bwd_local, always=True),
    }
)


# --- rmsnorm fused into the following matmul ---------------------------------------------


def rmsnorm_matmul_factors(avals_in, params) -> Factors:
    """``ts_rmsnorm_matmul``: x (…, k), weight (k), b (k, n) -> (…, n). Rows and N pass
    through; K, normalised and contracted, is replicated (gathered if sharded), as the
    rmsnorm that the fused operator replaces gathers it."""
    x, _, b = avals_in
    rows = _names("d", x.ndim - 1)
    dims = (*rows, "k")
    sizes = {**_sizes(dims, x.shape), "n": b.shape[-1]}
    return Factors((dims, ("k",), ("k", "n")), ((*rows, "n"),), sizes, replicated=("k",))


RULES["rmsnorm_matmul"] = Rule(rmsnorm_matmul_factors, always=True)
