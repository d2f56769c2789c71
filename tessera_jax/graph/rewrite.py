"""Rewrite passes over a graph's jaxpr: the pass API and the built-in passes.

A pass looks at the equations of a (flat) ``ClosedJaxpr`` through a :class:`GraphView`
and proposes :class:`Replacement` s: a set of equations to drop and a Python function,
written with ts operators, that computes the values of their outputs from other values
of the graph. :func:`apply_passes` runs the passes in order; each one that matched
re-traces the graph (an interpreter that binds every kept equation and calls the
replacement functions in their place, under ``jax.make_jaxpr``), then drops equations
whose results nothing uses. Every pass reports what it changed (:class:`PassReport`); a
pass that matches nothing leaves the jaxpr object itself unchanged.

Built-in passes (:data:`DEFAULT_PASSES`, in this order):

* :class:`AttentionFusion`: ``ts_matmul → [scale] → [mask] → ts_softmax → ts_matmul``
  (seed 004's attention) ⇒ one ``ts_flash_attention_fwd``;
* :class:`MatmulEpilogueFusion`: ``ts_matmul → add bias → relu/gelu → add residual``
  (each step optional, at least one) ⇒ one fused-epilogue ``ts_matmul``;
* :class:`RMSNormMatmulFusion`: ``ts_rmsnorm → [reshape] → ts_matmul`` (a plain product of
  the normalised activation by a 2-D weight) ⇒ one ``ts_rmsnorm_matmul`` (the fused prologue:
  no normalised activation in memory); it runs after the epilogue fusion, which it leaves be;
* :class:`TransposeFolding`: ``transpose ∘ transpose`` ⇒ one transpose, or none (what
  the attention fusion leaves where the graph moved heads in and out of its layout).

User passes: :class:`PatternPass` matches a chain of ts operators and calls a function
that returns the replacement (docs/GRAPHS.md shows one).

"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var

from tessera_jax import _compat
from tessera_jax.contracts.matmul import MatmulSpec
from tessera_jax.primitives._core import OPERATORS, compute_dtype, explicit_sharding
from tessera_jax.primitives.attention import flash_attention
from tessera_jax.primitives.matmul import matmul_op
from tessera_jax.primitives.rmsnorm_matmul import RMSNormMatmulSpec, rmsnorm_matmul_op

# Constants larger than this (elements) are not folded at rewrite time: a mask is
# checked on its un-broadcast source, which is at most (Sq, Skv).
_FOLD_LIMIT = 1 << 26
# A masked score filled with a finite value at or below this acts as -inf: exp(fill - max)
# underflows to 0 whenever a visible score of the row is above fill + 745 (exp's underflow
# in float64; 104 in float32, where 8- and 16-bit softmaxes compute), which holds for any
# score of a real model.
_MASK_FILL_MAX = -1e9


# --- reports ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Change:
    """One rewrite: the operators it replaced, what replaced them, and what matched."""

    removed: tuple[str, ...]
    added: tuple[str, ...]
    note: str = ""

    def __str__(self) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{', '.join(self.removed)} -> {', '.join(self.added) or '(nothing)'}{note}"


@dataclasses.dataclass(frozen=True)
class PassReport:
    """What one pass did to a graph: its changes, none if it did not apply."""

    name: str
    changes: tuple[Change, ...] = ()
    ops_before: int = 0
    ops_after: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def __str__(self) -> str:
        if not self.changes:
            return f"{self.name}: no match (graph unchanged)"
        n = len(self.changes)
        # The counts include what became unused (a mask's iota, a transpose) and was dropped.
        ops = f"{self.ops_before} ops -> {self.ops_after}"
        lines = [f"{self.name}: {n} rewrite{'s' * (n > 1)}, {ops}"]
        lines += [f"  {c}" for c in self.changes]
        return "\n".join(lines)


# --- looking at a jaxpr -------------------------------------------------------------------


class GraphView:
    """Producers, uses and constant values of a flat ``ClosedJaxpr``'s variables."""

    def __init__(self, closed: ClosedJaxpr):
        self.closed = closed
        self.jaxpr = closed.jaxpr
        self.eqns = list(self.jaxpr.eqns)
        self._producer: dict[Var, int] = {}
        self._uses: dict[Var, list[int]] = {}
        for i, eqn in enumerate(self.eqns):
            for v in eqn.outvars:
                self._producer[v] = i
            for v in eqn.invars:
                if isinstance(v, Var):
                    self._uses.setdefault(v, []).append(i)
        self._outputs = {v for v in self.jaxpr.outvars if isinstance(v, Var)}
        self._consts = dict(zip(self.jaxpr.constvars, closed.consts))
        self._folded: dict[Var, Any] = {}

    def producer(self, v: Any) -> int | None:
        """The index of the equation defining ``v`` (None for inputs, consts, literals)."""
        return self._producer.get(v) if isinstance(v, Var) else None

    def producer_eqn(self, v: Any, name: str | None = None) -> Any:
        """The equation defining ``v`` if there is one (named ``name``, when given)."""
        i = self.producer(v)
        if i is None:
            return None
        eqn = self.eqns[i]
        return eqn if name is None or eqn.primitive.name == name else None

    def uses(self, v: Any) -> list[int]:
        return list(self._uses.get(v, ())) if isinstance(v, Var) else []

    def only_use(self, v: Any) -> int | None:
        """The one equation reading ``v`` if it has no other use (nor is an output)."""
        uses = self.uses(v)
        if len(uses) != 1 or v in self._outputs:
            return None
        return uses[0]

    def const_value(self, v: Any) -> np.ndarray | None:
        """``v``'s value if it depends on no input of the graph (a literal, a closed-over
        constant, or computed from those: an iota mask), else None. Folding runs at
        rewrite time, eagerly even inside a jit trace."""
        if isinstance(v, Literal):
            return np.asarray(v.val)
        if v in self._consts:
            c = self._consts[v]
            return None if isinstance(c, jax.core.Tracer) else np.asarray(c)
        if v in self._folded:
            return self._folded[v]
        i = self.producer(v)
        out = None
        if i is not None and _size(v.aval) <= _FOLD_LIMIT:
            eqn = self.eqns[i]
            vals = [self.const_value(x) for x in eqn.invars]
            if not eqn.effects and all(x is not None for x in vals):
                with jax.ensure_compile_time_eval():
                    outs = _compat.bind_eqn(eqn, [jnp.asarray(x) for x in vals])
                for o, val in zip(eqn.outvars, outs):
                    self._folded[o] = np.asarray(val)
                out = self._folded.get(v)
        self._folded[v] = out
        return out

    def unbroadcast(self, v: Any) -> tuple[Any, tuple[int, ...]]:
        """``(source, view)``: ``v`` is ``broadcast_in_dim`` of ``source`` (repeatedly), and
        ``source.reshape(view)`` broadcasts to ``v``'s shape; ``(v, v.shape)`` otherwise."""
        rank = v.aval.ndim
        axes = tuple(range(rank))  # where each axis of v lies in the final shape
        while (eqn := self.producer_eqn(v, "broadcast_in_dim")) is not None:
            # broadcast_dimensions increase strictly, so the composition does too.
            axes = tuple(axes[d] for d in eqn.params["broadcast_dimensions"])
            v = eqn.invars[0]
        view = [1] * rank
        for size, a in zip(v.aval.shape, axes):
            view[a] = size
        return v, tuple(view)

    def op_names(self, indices: Sequence[int]) -> tuple[str, ...]:
        return tuple(self.eqns[i].primitive.name for i in indices)


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


# --- passes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Replacement:
    """A proposed rewrite.

    Attributes:
      eqns: indices of the equations it removes; the replacement runs where the last of
        them ran, so every input must be defined before that.
      inputs: the graph values (variables or literals) passed to ``fn``.
      outputs: the variables whose values ``fn`` returns (a tuple, in this order); every
        later use of them reads the replacement's values.
      fn: ``fn(*inputs) -> tuple`` written with ts operators (traced, never run eagerly).
      note: what matched, for the report.
    """

    eqns: tuple[int, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    fn: Callable[..., tuple[Any, ...]]
    note: str = ""


class Pass:
    """A rewrite pass: :meth:`find` proposes replacements for one graph.

    Subclasses set ``name`` and implement :meth:`find`; replacements that overlap an
    earlier one of the same pass are skipped (the next :func:`apply_passes` run can take
    them).
    """

    name: str = "pass"

    def find(self, view: GraphView) -> Sequence[Replacement]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@dataclasses.dataclass(frozen=True)
class Match:
    """A chain of ts operators found by a :class:`PatternPass`.

    Attributes:
      ops: the primitive names, in order (``("ts_relu", "ts_relu")``).
      params: each equation's parameters (``{"axis": 1}``, ``{"spec": MatmulSpec(…)}``).
      inputs: avals (shape, dtype) of the chain's operands from outside the chain: every
        equation's operands in order, except the previous equation's result.
      outputs: avals of the last equation's results.
    """

    ops: tuple[str, ...]
    params: tuple[dict[str, Any], ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]


class PatternPass(Pass):
    """A user pass: a chain of ts operators, replaced by what ``replace`` returns.

    The chain is a sequence of equations whose names are ``ts_<pattern[i]>``, each reading
    the previous one's (single) result, which nothing else reads. For each such chain
    ``replace(match)`` returns None (leave it) or a function ``f(*inputs)`` computing the
    last operator's result(s) from :attr:`Match.inputs` (an array, or a tuple of arrays
    for an operator with several results) with ts operators.

    Arguments:
      name: shown in the graph's report.
      pattern: ts operator names (``"relu"`` or ``"ts_relu"``), at least one.
      replace: ``replace(match: Match) -> Callable | None``.
    """

    def __init__(
        self,
        name: str,
        pattern: Sequence[str],
        replace: Callable[[Match], Callable[..., Any] | None],
    ):
        if not isinstance(name, str) or not name:
            raise TypeError(f"PatternPass: name={name!r} must be a non-empty str")
        if isinstance(pattern, str) or not isinstance(pattern, Sequence) or not pattern:
            raise TypeError(
                f"PatternPass: pattern={pattern!r} must be a non-empty sequence of ts "
                "operator names"
            )
        prims = []
        for p in pattern:
            op = p[3:] if isinstance(p, str) and p.startswith("ts_") else p
            if op not in OPERATORS:
                raise ValueError(
                    f"PatternPass: pattern entry {p!r} is not a ts operator; known: "
                    f"{', '.join(sorted(OPERATORS))}"
                )
            prims.append(f"ts_{op}")
        if not callable(replace):
            raise TypeError(f"PatternPass: replace={replace!r} must be callable")
        self.name = name
        self.pattern = tuple(prims)
        self.replace = replace

    def find(self, view: GraphView) -> list[Replacement]:
        out = []
        for i, eqn in enumerate(view.eqns):
            if eqn.primitive.name != self.pattern[0]:
                continue
            chain = [i]
            for want in self.pattern[1:]:
                prev = view.eqns[chain[-1]]
                if len(prev.outvars) != 1:
                    break
                j = view.only_use(prev.outvars[0])
                if j is None or view.eqns[j].primitive.name != want:
                    break
                if sum(x is prev.outvars[0] for x in view.eqns[j].invars) != 1:
                    break
                chain.append(j)
            if len(chain) != len(self.pattern):
                continue
            eqns = [view.eqns[j] for j in chain]
            inputs = list(eqns[0].invars)
            for prev, e in itertools.pairwise(eqns):
                inputs += [x for x in e.invars if x is not prev.outvars[0]]
            match = Match(
                ops=self.pattern,
                params=tuple(dict(e.params) for e in eqns),
                inputs=tuple(x.aval for x in inputs),
                outputs=tuple(v.aval for v in eqns[-1].outvars),
            )
            fn = self.replace(match)
            if fn is None:
                continue
            single = len(eqns[-1].outvars) == 1
            out.append(
                Replacement(
                    eqns=tuple(chain),
                    inputs=tuple(inputs),
                    outputs=tuple(eqns[-1].outvars),
                    fn=_as_tuple_fn(fn, single),
                )
            )
        return out


def _as_tuple_fn(fn: Callable[..., Any], single: bool) -> Callable[..., tuple[Any, ...]]:
    def call(*args):
        out = fn(*args)
        return (out,) if single else tuple(out)

    return call


# --- applying passes ----------------------------------------------------------------------


def apply_passes(
    closed: ClosedJaxpr, passes: Sequence[Pass]
) -> tuple[ClosedJaxpr, tuple[PassReport, ...]]:
    """``closed`` rewritten by each pass in turn, and each pass's report."""
    reports = []
    for p in passes:
        view = GraphView(closed)
        taken: set[int] = set()
        chosen = []
        for r in p.find(view):
            if taken.isdisjoint(r.eqns):
                taken.update(r.eqns)
                chosen.append(r)
        changes = tuple(_check(p, view, r) for r in chosen)
        before = len(closed.jaxpr.eqns)
        if chosen:
            closed = rebuild(closed, chosen)
        reports.append(PassReport(p.name, changes, before, len(closed.jaxpr.eqns)))
    return closed, tuple(reports)


def _check(p: Pass, view: GraphView, r: Replacement) -> Change:
    """The change ``r`` makes; a TypeError naming the pass if its results do not have the
    types of the values they replace."""
    traced = jax.make_jaxpr(r.fn)(*[_sds(x.aval) for x in r.inputs])
    got = [(tuple(a.shape), np.dtype(a.dtype)) for a in traced.out_avals]
    want = [(tuple(v.aval.shape), np.dtype(v.aval.dtype)) for v in r.outputs]
    if got != want:
        raise TypeError(
            f"graph pass {p.name!r}: the replacement of {', '.join(view.op_names(r.eqns))} "
            f"returns {_types(got)}, but the values it replaces are {_types(want)}"
        )
    added = tuple(e.primitive.name for e in _flat_eqns(traced.jaxpr))
    return Change(view.op_names(sorted(r.eqns)), added, r.note)


def _sds(aval: Any, weak_type: bool = False) -> jax.ShapeDtypeStruct:
    """A value of ``aval``'s type to trace with (its sharding where the type has one)."""
    sharding = explicit_sharding(aval)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak_type, sharding=sharding)


def _types(pairs) -> str:
    return "(" + ", ".join(f"{d.name}{list(s)}" for s, d in pairs) + ")"


def _flat_eqns(jaxpr: Any) -> list[Any]:
    """The equations of ``jaxpr`` with nested jit calls inlined (their names only)."""
    out = []
    for eqn in jaxpr.eqns:
        call = _compat.inlinable_call(eqn)
        out += _flat_eqns(call[0]) if call is not None else [eqn]
    return out


def rebuild(closed: ClosedJaxpr, replacements: Sequence[Replacement] = ()) -> ClosedJaxpr:
    """``closed`` re-traced with ``replacements`` applied, nested jit calls inlined and
    equations whose results nothing uses (and that have no effects) dropped."""
    jaxpr = closed.jaxpr
    at = {max(r.eqns): r for r in replacements}
    removed = {i for r in replacements for i in r.eqns}
    # Liveness, backwards from the outputs.
    live = {v for v in jaxpr.outvars if isinstance(v, Var)}
    keep = [False] * len(jaxpr.eqns)
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if i in at:
            r = at[i]
            if any(v in live for v in r.outputs):
                keep[i] = True
                live.update(x for x in r.inputs if isinstance(x, Var))
        elif i not in removed and (eqn.effects or any(v in live for v in eqn.outvars)):
            keep[i] = True
            live.update(x for x in eqn.invars if isinstance(x, Var))

    # Each replacement traced on its own first, so that the graph receives its equations
    # with nested jit calls (jnp helpers) inlined, like the rest of the graph.
    traced = {
        i: jax.make_jaxpr(r.fn)(*[_sds(x.aval) for x in r.inputs]) for i, r in at.items() if keep[i]
    }

    def run(*args):
        env: dict[Var, Any] = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))

        def read(x):
            return x.val if isinstance(x, Literal) else env[x]

        for i, eqn in enumerate(jaxpr.eqns):
            if not keep[i]:
                continue
            if i in at:
                t = traced[i]
                outs = _eval(t.jaxpr, t.consts, list(map(read, at[i].inputs)))
                env.update(zip(at[i].outputs, outs))
            else:
                env.update(zip(eqn.outvars, eval_eqn(eqn, list(map(read, eqn.invars)))))
        return [read(v) for v in jaxpr.outvars]

    sds = [_sds(v.aval, weak_type=v.aval.weak_type) for v in jaxpr.invars]
    return jax.make_jaxpr(run)(*sds)


def eval_eqn(eqn: Any, invals: list[Any]) -> list[Any]:
    """One equation on ``invals``; a nested jit call is evaluated equation by equation, so
    that the graph being traced sees (and passes can match) the operators inside it."""
    call = _compat.inlinable_call(eqn)
    if call is None:
        return _compat.bind_eqn(eqn, invals)
    return _eval(*call, invals)


def _eval(jaxpr: Any, consts: Sequence[Any], invals: Sequence[Any]) -> list[Any]:
    """``jaxpr`` evaluated equation by equation (:func:`eval_eqn`) on ``invals``."""
    env: dict[Var, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, invals))

    def read(x):
        return x.val if isinstance(x, Literal) else env[x]

    for e in jaxpr.eqns:
        env.update(zip(e.outvars, eval_eqn(e, list(map(read, e.invars)))))
    return [read(v) for v in jaxpr.outvars]


# --- attention fusion ---------------------------------------------------------------------


def _plain_product(spec: MatmulSpec, dtype: Any) -> bool:
    """A ts_matmul with no epilogue, writing its operands' float dtype with the default
    accumulator (so that flash attention computes the same product)."""
    dtype = np.dtype(dtype)
    return (
        not spec.has_epilogue
        and jnp.issubdtype(dtype, jnp.floating)
        and spec.out_dtype == dtype
        and spec.accumulate_dtype == compute_dtype(dtype)
    )


def _logical(
    view: GraphView, v: Any, perm: tuple[int, ...], *, scaled: bool = False
) -> tuple[Any, tuple[int, ...], float]:
    """``(x, axes, c)`` with ``transpose(v, perm) == c · transpose(x, axes)``, looking
    through the transposes that produced ``v`` and, if ``scaled``, multiplications by
    positive scalar constants (a query scaled before its product) that keep its dtype."""
    factor = 1.0
    while (eqn := view.producer(v)) is not None:
        eqn = view.eqns[eqn]
        if eqn.primitive.name == "transpose":
            p = eqn.params["permutation"]
            perm = tuple(p[a] for a in perm)
            v = eqn.invars[0]
            continue
        if not scaled or eqn.primitive.name != "mul":
            break
        a, b = eqn.invars
        if _scalar(view, a) is not None:
            a, b = b, a
        c = _scalar(view, b)
        if c is None or not (math.isfinite(c) and c > 0) or a.aval.dtype != v.aval.dtype:
            break
        if a.aval.shape != v.aval.shape:
            break
        factor *= c
        v = a
    return v, perm, factor


def _swap_last(n: int) -> tuple[int, ...]:
    return (*range(n - 2), n - 1, n - 2)


@dataclasses.dataclass(frozen=True)
class _Mask:
    pred: Any  # the select_n predicate's un-broadcast source (a variable)
    view: tuple[int, ...]  # its shape with unit dims, broadcasting to the scores
    scores_case: int  # which select_n case holds the scores (1: where(pred, s, fill))
    fill: float


class AttentionFusion(Pass):
    """``ts_matmul → [× or ÷ scale] → [masked] → ts_softmax(last axis) → ts_matmul`` ⇒
    ``ts.flash_attention``.

    Matched exactly:

    * the first product ``q·kᵀ`` and the second ``p·v`` are plain ts_matmul products (no
      epilogue, default accumulator, writing the operands' float dtype); their operands
      have identical leading (batch) dimensions, the same sequence length for ``k`` and
      ``v``, and ``v``'s feature size equals ``q``'s (flash attention's ``k.shape ==
      v.shape``); which axes each product contracts follows from its transpose flags and
      the transposes that produced its operands;
    * between them only: multiplications or divisions by scalar constants (the scale, in
      the scores' dtype), at most one ``jnp.where(mask, s, fill)`` whose fill is ``-inf``
      (or a finite value ≤ -1e9 with a constant mask that leaves every row a visible key),
      and ``ts.softmax`` over the last (key) axis; the scale may instead (or also) multiply
      the query or key before the first product (there it rounds them to their dtype,
      which the fused form, scaling the f32 scores, does not: bf16 results then differ by
      that rounding);
    * every intermediate (scores, scaled and masked scores, probabilities) has exactly one
      use and is not a graph output.

    A constant mask equal to the causal lower triangle becomes ``causal=True`` (the fused
    kernels' case); another mask is passed as flash attention's ``mask``. Heads laid out
    as ``(batch, seq, heads, dim)`` and transposed to ``(batch, heads, seq, dim)`` for the
    products are read in place; any other batch layout is flattened into flash
    attention's batch (a free reshape).
    """

    name = "attention_fusion"

    def find(self, view: GraphView) -> list[Replacement]:
        out = []
        for i, eqn in enumerate(view.eqns):
            if eqn.primitive.name == "ts_softmax":
                r = self._match(view, i)
                if r is not None:
                    out.append(r)
        return out

    def _match(self, view: GraphView, i_sm: int) -> Replacement | None:
        sm = view.eqns[i_sm]
        p = sm.outvars[0]
        n = p.aval.ndim
        if n < 2 or sm.params["axis"] != n - 1:
            return None
        i_pv = view.only_use(p)
        if i_pv is None:
            return None
        pv = view.eqns[i_pv]
        if pv.primitive.name != "ts_matmul" or pv.invars[0] is not p or pv.invars[1] is p:
            return None
        spec_pv = pv.params["spec"]
        if spec_pv.transpose_a or not _plain_product(spec_pv, p.aval.dtype):
            return None
        # Walk back from the softmax input to the first product.
        eqns = [i_sm, i_pv]
        scale, mask = 1.0, None
        x = sm.invars[0]
        dtype, shape = p.aval.dtype, p.aval.shape
        while True:
            j = view.producer(x)
            if j is None or view.only_use(x) is None:
                return None
            e = view.eqns[j]
            if e.outvars[0].aval.dtype != dtype or e.outvars[0].aval.shape != shape:
                return None
            eqns.append(j)
            name = e.primitive.name
            if name == "ts_matmul":
                qk = e
                break
            if name in ("mul", "div"):
                a, b = e.invars
                if name == "mul" and _scalar(view, a) is not None and _scalar(view, b) is None:
                    a, b = b, a
                c = _scalar(view, b)
                if c is None or not (math.isfinite(c) and c > 0):
                    return None
                scale = scale * c if name == "mul" else scale / c
                x = a
            elif name == "select_n" and len(e.invars) == 3 and mask is None:
                pred, c0, c1 = e.invars
                if pred.aval.dtype != np.bool_:
                    return None
                f0, f1 = _scalar(view, c0), _scalar(view, c1)
                if (f0 is None) == (f1 is None):
                    return None
                scores_case = 1 if f0 is not None else 0
                fill = f0 if f0 is not None else f1
                if not (fill == -math.inf or fill <= _MASK_FILL_MAX):
                    return None
                src, mview = view.unbroadcast(pred)
                mask = _Mask(src, mview, scores_case, float(fill))
                x = c1 if scores_case else c0
            else:
                return None
        spec_qk = qk.params["spec"]
        if not _plain_product(spec_qk, dtype):
            return None
        a, b = qk.invars
        v = pv.invars[1]
        if not (a.aval.dtype == b.aval.dtype == v.aval.dtype == dtype):
            return None
        if not (a.aval.ndim == b.aval.ndim == v.aval.ndim == n):
            return None
        # Logical views: q (*lead, Sq, D), k (*lead, Skv, D), v (*lead, Skv, Dv).
        ident = tuple(range(n))
        qx, qa, cq = _logical(view, a, _swap_last(n) if spec_qk.transpose_a else ident, scaled=True)
        kx, ka, ck = _logical(view, b, ident if spec_qk.transpose_b else _swap_last(n), scaled=True)
        vx, va, _ = _logical(view, v, _swap_last(n) if spec_pv.transpose_b else ident)
        scale *= cq * ck
        qs = tuple(qx.aval.shape[d] for d in qa)
        ks = tuple(kx.aval.shape[d] for d in ka)
        vs = tuple(vx.aval.shape[d] for d in va)
        if not (qs[:-2] == ks[:-2] == vs[:-2] and ks == vs and qs[-1] == ks[-1]):
            return None
        if 0 in qs or 0 in ks:
            return None
        sq, skv = qs[-2], ks[-2]
        causal, const_mask, runtime_mask = False, None, False
        if mask is not None:
            value = view.const_value(mask.pred)
            if value is not None:
                # Checked on the un-broadcast mask: the scores' shape can be gigabytes.
                visible = value.reshape(mask.view)
                visible = visible if mask.scores_case else ~visible
                tril = np.tril(np.ones((sq, skv), bool), k=skv - sq)
                if visible.all():
                    pass  # hides nothing
                elif visible.shape[-2:] == (sq, skv) and (visible == tril).all():
                    causal = True
                else:
                    const_mask = visible
                if mask.fill != -math.inf and not visible.any(axis=-1).all():
                    return None  # a finite fill averages v over an empty row; flash gives 0
            elif mask.fill == -math.inf:
                runtime_mask = True
            else:
                return None
        bshd = n == 4 and qa == (0, 2, 1, 3)
        lead = qs[:-2]
        inputs = [qx, kx, vx] + ([mask.pred] if runtime_mask else [])
        mview = mask.view if mask is not None else None
        mcase = mask.scores_case if mask is not None else 1

        def fused(q_in, k_in, v_in, *pred):
            q, k, vv = (
                _to_flash(z, axes, bshd, lead) for z, axes in ((q_in, qa), (k_in, ka), (v_in, va))
            )
            m = None
            if pred:
                m = pred[0].reshape(mview)
                m = m if mcase else jnp.logical_not(m)
            elif const_mask is not None:
                m = jnp.asarray(const_mask)
            if m is not None:
                m = _mask_to_flash(m, bshd, lead)
            o = flash_attention(q, k, vv, mask=m, causal=causal, scale=scale)
            if bshd:
                return (jnp.transpose(o, (0, 2, 1, 3)),)
            return (o.reshape(*lead, sq, o.shape[-1]),)

        kind = "causal" if causal else ("mask" if runtime_mask or const_mask is not None else "")
        note = ", ".join(
            s
            for s in (
                f"{jnp.dtype(dtype).name}{list(lead)}",
                f"Sq={sq} Skv={skv} D={qs[-1]}",
                kind,
                f"scale={scale:.6g}",
                "heads in place" if bshd else "batch flattened",
            )
            if s
        )
        return Replacement(tuple(eqns), tuple(inputs), (pv.outvars[0],), fused, note)


def _scalar(view: GraphView, v: Any) -> float | None:
    """The value of ``v`` if it is a constant holding one number (possibly broadcast)."""
    src, _ = view.unbroadcast(v) if isinstance(v, Var) else (v, ())
    val = view.const_value(src)
    if val is None or val.size != 1 or not jnp.issubdtype(val.dtype, jnp.floating):
        return None
    return float(val.reshape(()))


def _to_flash(x: jax.Array, axes: tuple[int, ...], bshd: bool, lead: tuple[int, ...]):
    """A logical ``(*lead, S, D)`` operand (``transpose(x, axes)``) in flash attention's
    ``(B, S, H, D)`` layout: in place for heads stored ``(b, s, h, d)``, else with the
    leading dimensions flattened into the batch and one head."""
    if bshd:
        perm = (axes[0], axes[2], axes[1], axes[3])
        return x if perm == (0, 1, 2, 3) else jnp.transpose(x, perm)
    if axes != tuple(range(x.ndim)):
        x = jnp.transpose(x, axes)
    return x.reshape(math.prod(lead), x.shape[-2], 1, x.shape[-1])


def _mask_to_flash(m: jax.Array, bshd: bool, lead: tuple[int, ...]) -> jax.Array:
    """A mask broadcasting to the scores ``(*lead, Sq, Skv)`` in flash attention's
    ``(B, H, Sq, Skv)`` broadcastable form."""
    if bshd:
        return m
    if math.prod(m.shape[:-2]) not in (1, math.prod(lead)):
        m = jnp.broadcast_to(m, (*lead, *m.shape[-2:]))
    return m.reshape(math.prod(m.shape[:-2]), 1, *m.shape[-2:])


# --- matmul epilogue fusion ---------------------------------------------------------------

_ACTIVATIONS = {
    "ts_relu": lambda params: "relu",
    "ts_gelu": lambda params: "gelu_tanh" if params.get("approximate") else "gelu",
}


class MatmulEpilogueFusion(Pass):
    """``ts_matmul → [+ bias] → [relu | gelu] → [+ residual]`` ⇒ one ``ts_matmul`` with that
    epilogue (``ts.linear``'s contract: ``act(a @ b + bias) + residual``).

    Matched exactly: a float ts_matmul without an epilogue; ``+ bias`` adds a vector of the
    output's last dimension (broadcast over the rows by ``broadcast_in_dim``) of the
    output's dtype; the activation is ``ts.relu`` or ``ts.gelu``; ``+ residual`` adds an
    array of the output's shape and dtype. At least one step; each intermediate has one
    use and is not a graph output. The fused form rounds once (the epilogue runs in the
    accumulator's precision), where the unfused graph rounds after every step.
    """

    name = "matmul_epilogue"

    def find(self, view: GraphView) -> list[Replacement]:
        out = []
        for i, eqn in enumerate(view.eqns):
            if eqn.primitive.name == "ts_matmul":
                r = self._match(view, i)
                if r is not None:
                    out.append(r)
        return out

    def _match(self, view: GraphView, i_mm: int) -> Replacement | None:
        mm = view.eqns[i_mm]
        spec: MatmulSpec = mm.params["spec"]
        y = mm.outvars[0]
        if spec.has_bias or spec.has_residual or spec.activation is not None:
            return None
        if not jnp.issubdtype(spec.out_dtype, jnp.floating):
            return None
        eqns, bias, act, residual = [i_mm], None, None, None
        n = y.aval.shape[-1]
        while True:
            j = view.only_use(y)
            if j is None:
                break
            e = view.eqns[j]
            name = e.primitive.name
            if e.outvars[0].aval.shape != y.aval.shape or e.outvars[0].aval.dtype != y.aval.dtype:
                break
            if name == "add" and residual is None:
                other = e.invars[1] if e.invars[0] is y else e.invars[0]
                if other is y or isinstance(other, Literal) or other.aval.dtype != y.aval.dtype:
                    break
                if bias is None and act is None and (src := _bias_source(view, other, n)):
                    bias = src
                elif other.aval.shape == y.aval.shape:
                    residual = other
                else:
                    break
            elif name in _ACTIVATIONS and act is None and residual is None:
                act = _ACTIVATIONS[name](e.params)
            else:
                break
            eqns.append(j)
            y = e.outvars[0]
        if len(eqns) == 1:
            return None
        a, b, *extras = mm.invars
        scale = extras[0] if spec.has_scale else None
        fused = spec.replace(
            activation=act, has_bias=bias is not None, has_residual=residual is not None
        )
        inputs = [a, b] + [x for x in (bias, residual, scale) if x is not None]

        def fn(*args):
            return (matmul_op.bind(*args, spec=fused),)

        steps = ["bias" if bias is not None else "", act or "", "residual" if residual else ""]
        note = " + ".join(s for s in steps if s)
        return Replacement(tuple(eqns), tuple(inputs), (y,), fn, note)


def _bias_source(view: GraphView, v: Any, n: int) -> Any:
    """The ``(n,)`` vector that ``v`` broadcasts along its last axis, else None."""
    src, shape = view.unbroadcast(v)
    if tuple(src.aval.shape) == (n,) and all(s == 1 for s in shape[:-1]) and shape[-1] == n:
        return src
    return None


# --- rmsnorm fused into the following matmul ---------------------------------------------

_WIDE_FLOATS = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


class RMSNormMatmulFusion(Pass):
    """``ts_rmsnorm → [reshape] → ts_matmul`` ⇒ one ``ts_rmsnorm_matmul`` (``ts.rmsnorm_matmul``).

    Matched exactly: an rmsnorm with a ``(K,)`` weight and ``eps > 0`` of a wide float x;
    its result read only by the matmul (or by a reshape that keeps the last dimension,
    ``ts.linear``'s row flattening, read only by the matmul) as its untransposed left
    operand; a matmul without epilogue, transposes or requested tile against a 2-D ``b`` of
    x's dtype. A matmul whose epilogue :class:`MatmulEpilogueFusion` fused is left alone.
    The fused kernel rounds ``weight·b`` where the unfused graph rounds x̂ (see
    ``primitives/rmsnorm_matmul.py``).
    """

    name = "rmsnorm_matmul"

    def find(self, view: GraphView) -> list[Replacement]:
        out = []
        for i, eqn in enumerate(view.eqns):
            if eqn.primitive.name == "ts_rmsnorm":
                r = self._match(view, i)
                if r is not None:
                    out.append(r)
        return out

    def _match(self, view: GraphView, i_norm: int) -> Replacement | None:
        norm = view.eqns[i_norm]
        if not norm.params["has_weight"] or not norm.params["eps"] > 0:
            return None
        x, w = norm.invars
        k = x.aval.shape[-1]
        if np.dtype(x.aval.dtype) not in _WIDE_FLOATS or tuple(w.aval.shape) != (k,):
            return None
        eqns, y = [i_norm], norm.outvars[0]
        j = view.only_use(y)
        if j is not None and view.eqns[j].primitive.name == "reshape":
            e = view.eqns[j]
            shape = tuple(e.outvars[0].aval.shape)
            if e.params.get("dimensions") is not None or e.params.get("sharding") is not None:
                return None
            if len(shape) < 1 or shape[-1] != k:
                return None
            eqns.append(j)
            y = e.outvars[0]
            j = view.only_use(y)
        if j is None or view.eqns[j].primitive.name != "ts_matmul":
            return None
        mm = view.eqns[j]
        spec: MatmulSpec = mm.params["spec"]
        a, b = mm.invars[0], mm.invars[1]
        if a is not y or b is y or spec.has_epilogue or spec.transpose_a or spec.transpose_b:
            return None
        if spec.tile_shape is not None or spec.out_sharding is not None:
            return None
        if b.aval.ndim != 2 or np.dtype(b.aval.dtype) != np.dtype(x.aval.dtype):
            return None
        if not jnp.issubdtype(spec.out_dtype, jnp.floating):
            return None
        eqns.append(j)
        fused = RMSNormMatmulSpec(
            eps=norm.params["eps"],
            out_dtype=spec.out_dtype,
            accumulate_dtype=spec.accumulate_dtype,
        )
        out_shape = tuple(mm.outvars[0].aval.shape)

        def fn(x, w, b):
            out = rmsnorm_matmul_op.bind(x, w, b, spec=fused)
            return (out.reshape(out_shape) if out.shape != out_shape else out,)

        note = f"{np.dtype(x.aval.dtype).name} x{list(x.aval.shape)} @ b{list(b.aval.shape)}"
        return Replacement(tuple(eqns), (x, w, b), (mm.outvars[0],), fn, note)


# --- transpose folding --------------------------------------------------------------------


class TransposeFolding(Pass):
    """``transpose(transpose(x, p1), p2)`` ⇒ ``transpose(x, p1∘p2)``, or ``x`` itself when
    that is the identity (the inner transpose having no other use)."""

    name = "transpose_folding"

    def find(self, view: GraphView) -> list[Replacement]:
        out = []
        for i, eqn in enumerate(view.eqns):
            if eqn.primitive.name != "transpose":
                continue
            inner = view.producer_eqn(eqn.invars[0], "transpose")
            if inner is None or view.only_use(eqn.invars[0]) is None:
                continue
            p1, p2 = inner.params["permutation"], eqn.params["permutation"]
            perm = tuple(p1[a] for a in p2)
            if perm == tuple(range(len(perm))):

                def fn(x):
                    return (x,)
            else:

                def fn(x, perm=perm):
                    return (jnp.transpose(x, perm),)

            j = view.producer(eqn.invars[0])
            note = "identity" if perm == tuple(range(len(perm))) else f"permutation={perm}"
            out.append(Replacement((j, i), (inner.invars[0],), (eqn.outvars[0],), fn, note))
        return out


DEFAULT_PASSES: tuple[Pass, ...] = (
    AttentionFusion(),
    MatmulEpilogueFusion(),
    RMSNormMatmulFusion(),
    TransposeFolding(),
)
