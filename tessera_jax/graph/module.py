"""Graph modules: a function of ts operators captured as a jaxpr, rewritten, then run.

``@ts.graph.module("attention")`` wraps a function into a :class:`GraphModule`. For
each set of input types (shapes, dtypes, the pytree structure) the module traces the
function once to a jaxpr, inlines nested ``jax.jit`` calls (so passes see every
operator), runs its rewrite passes (:mod:`tessera_jax.graph.rewrite`) and caches the
result, a :class:`Graph`. Calling the module evaluates the rewritten jaxpr with
``jax.core.eval_jaxpr`` inside a cached ``jax.jit``, so the module composes with
``jax.jit``, ``jax.grad`` / ``ts.grad`` and ``jax.vmap`` like any function of jax
primitives: every ts operator brings its own JVP, transpose and batching rules, the fused
ones included.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var

from tessera_jax.graph.rewrite import DEFAULT_PASSES, Pass, PassReport, apply_passes, rebuild
from tessera_jax.primitives._core import explicit_sharding


@dataclasses.dataclass(frozen=True)
class Graph:
    """A graph module lowered for one set of input types.

    Attributes:
      name: the module's name.
      jaxpr: the rewritten ``ClosedJaxpr`` (what the module runs).
      original: the ``ClosedJaxpr`` before the passes (nested jit calls inlined).
      report: one :class:`~tessera_jax.graph.rewrite.PassReport` per pass, in order.
      input_names: each flat input's name (``q``, ``params['w']``).
      input_shardings: each input's sharding as text, where the argument had one to show
        (a committed or multi-device array), else None.
    """

    name: str
    jaxpr: ClosedJaxpr
    original: ClosedJaxpr
    report: tuple[PassReport, ...]
    input_names: tuple[str, ...]
    input_shardings: tuple[str | None, ...]
    in_tree: Any
    out_tree: Any

    @property
    def ops(self) -> tuple[str, ...]:
        """The operators in execution order: ts operators by their primitive names
        (``ts_matmul``), other jax operations by theirs (``transpose``, ``mul``,
        ``select_n``; a nested call such as ``custom_jvp_call`` by the call's name)."""
        return tuple(e.primitive.name for e in self.jaxpr.jaxpr.eqns)

    @property
    def ts_ops(self) -> tuple[str, ...]:
        """:attr:`ops` restricted to the ts operators."""
        return tuple(o for o in self.ops if o.startswith("ts_"))

    def __str__(self) -> str:
        return _format(self)


class GraphModule:
    """A function captured and rewritten as an operator graph (see :func:`module`).

    Calling it runs the rewritten graph; :meth:`lower` returns the :class:`Graph` for
    given arguments; :meth:`with_passes` gives the same function under other passes
    (``with_passes(())``: the graph as written).
    """

    def __init__(self, fn: Callable[..., Any], name: str, passes: tuple[Pass, ...]):
        self.fn = fn
        self.name = name
        self.passes = passes
        self._signature = _signature(fn)
        self._cache: dict[Any, tuple[Graph, Callable[..., Any] | None]] = {}
        # Name, docstring and __wrapped__ (signature) of fn; not its __dict__, which for a
        # wrapped GraphModule would replace this module's own state.
        functools.update_wrapper(self, fn, updated=())

    def __repr__(self) -> str:
        return f"GraphModule({self.name!r}, passes={[p.name for p in self.passes]})"

    def with_passes(self, passes: Sequence[Pass]) -> GraphModule:
        return GraphModule(self.fn, self.name, _check_passes(self.name, passes))

    def lower(self, *args: Any, **kwargs: Any) -> Graph:
        """The :class:`Graph` the module runs for these arguments (arrays or their types:
        ``jax.ShapeDtypeStruct`` leaves are accepted)."""
        return self._lowered(args, kwargs)[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graph, run = self._lowered(args, kwargs)
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        for name, x in zip(graph.input_names, leaves):
            if isinstance(x, jax.ShapeDtypeStruct):
                raise TypeError(
                    f"graph module {self.name!r}: argument {name} is a ShapeDtypeStruct; "
                    "call the module with arrays (.lower accepts types)"
                )
        if run is None:  # constants captured from an enclosing trace: evaluated in it
            outs = jax.core.eval_jaxpr(graph.jaxpr.jaxpr, graph.jaxpr.consts, *leaves)
        else:
            outs = run(*leaves)
        return jax.tree_util.tree_unflatten(graph.out_tree, outs)

    def _lowered(self, args, kwargs) -> tuple[Graph, Callable[..., Any] | None]:
        names = self._input_names(args, kwargs)
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        types = tuple(_input_type(self.name, n, x) for n, x in zip(names, leaves))
        key = (in_tree, types)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._trace(in_tree, types, names)
        graph, run = hit
        shardings = tuple(_sharding_text(x) for x in leaves)
        if shardings != graph.input_shardings:
            graph = dataclasses.replace(graph, input_shardings=shardings)
        return graph, run

    def _trace(self, in_tree, types, names):
        out_tree = []

        def flat_fn(*leaves):
            a, kw = jax.tree_util.tree_unflatten(in_tree, leaves)
            out = self.fn(*a, **kw)
            flat, tree = jax.tree_util.tree_flatten(out)
            out_tree.append(tree)
            return flat

        sds = [jax.ShapeDtypeStruct(s, d, weak_type=w, sharding=sh) for s, d, w, sh in types]
        original = rebuild(jax.make_jaxpr(flat_fn)(*sds))
        rewritten, report = apply_passes(original, self.passes)
        graph = Graph(
            name=self.name,
            jaxpr=rewritten,
            original=original,
            report=report,
            input_names=names,
            input_shardings=(None,) * len(names),
            in_tree=in_tree,
            out_tree=out_tree[0],
        )
        if any(isinstance(c, jax.core.Tracer) for c in rewritten.consts):
            return graph, None  # not cached: the constants belong to one trace
        run = jax.jit(functools.partial(jax.core.eval_jaxpr, rewritten.jaxpr, rewritten.consts))
        self._cache[(in_tree, types)] = (graph, run)
        return graph, run

    def _input_names(self, args, kwargs) -> tuple[str, ...]:
        if self._signature is not None:
            try:
                self._signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"graph module {self.name!r}: {e}") from None
        params = list(self._signature.parameters) if self._signature is not None else []
        names = []
        for path, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
            head, rest = path[0], path[1:]
            if head.idx == 0:  # positional
                i = rest[0].idx
                base = params[i] if i < len(params) else f"arg{i}"
                rest = rest[1:]
            else:
                base, rest = rest[0].key, rest[1:]
            names.append(base + jax.tree_util.keystr(rest))
        return tuple(names)


def module(name: str, *, passes: Sequence[Pass] | None = None) -> Callable[..., GraphModule]:
    """Decorator: the function as a :class:`GraphModule` named ``name``.

    Arguments:
      name: the graph's name (shown in its text and reports).
      passes: the rewrite passes, run in order; default
        :data:`~tessera_jax.graph.rewrite.DEFAULT_PASSES` (attention fusion, matmul
        epilogue fusion, transpose folding). ``()`` runs the graph as written.
    Returns:
      A decorator taking a function of arrays (pytrees of arrays) to arrays.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"graph.module: name={name!r} must be a non-empty str")
    chosen = DEFAULT_PASSES if passes is None else _check_passes(name, passes)

    def wrap(fn: Callable[..., Any]) -> GraphModule:
        if not callable(fn):
            raise TypeError(f"graph.module({name!r}): {fn!r} is not a function")
        return GraphModule(fn, name, chosen)

    return wrap


def _check_passes(name: str, passes: Any) -> tuple[Pass, ...]:
    if isinstance(passes, Pass) or not isinstance(passes, (tuple, list)):
        raise TypeError(
            f"graph.module({name!r}): passes={passes!r} must be a tuple or list of graph passes"
        )
    for p in passes:
        if not isinstance(p, Pass):
            raise TypeError(
                f"graph.module({name!r}): passes entry {p!r} is not a graph pass "
                "(ts.graph.Pass, e.g. a ts.graph.PatternPass)"
            )
    return tuple(passes)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _input_type(module_name: str, arg: str, x: Any) -> tuple[Any, ...]:
    """``(shape, dtype, weak_type, sharding)`` of one input leaf (the sharding where it is
    part of the type: a mesh with Explicit axes), or a TypeError naming it."""
    if isinstance(x, jax.ShapeDtypeStruct):
        aval = jax.core.ShapedArray(x.shape, x.dtype, weak_type=bool(x.weak_type))
        sharding = x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else None
        return (*_type_key(aval), sharding if _explicit(sharding) else None)
    ok = isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
    if not ok:
        raise TypeError(
            f"graph module {module_name!r}: argument {arg}={x!r} of type {type(x).__name__} "
            "is not an array; a graph module takes arrays (or pytrees of arrays)"
        )
    aval = jax.typeof(x)
    return (*_type_key(aval), explicit_sharding(aval))


def _type_key(aval: Any) -> tuple[tuple[int, ...], np.dtype, bool]:
    return tuple(aval.shape), np.dtype(aval.dtype), bool(aval.weak_type)


def _explicit(sharding: Any) -> bool:
    mesh = getattr(sharding, "mesh", None)
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _sharding_text(x: Any) -> str | None:
    """An input's sharding where it says something: several devices, or named axes."""
    s = getattr(x, "sharding", None)
    if s is None or isinstance(x, jax.core.Tracer):
        return None
    if isinstance(s, jax.sharding.NamedSharding):
        return f"{dict(s.mesh.shape)} spec={tuple(s.spec)}"
    if len(s.device_set) > 1:
        return str(s)
    return None


# --- text ---------------------------------------------------------------------------------


def _format(g: Graph) -> str:
    jaxpr = g.jaxpr.jaxpr
    names: dict[Var, str] = {}
    for v, n in zip(jaxpr.invars, g.input_names):
        names[v] = n
    for i, v in enumerate(jaxpr.constvars):
        names[v] = f"const{i}"

    def ref(x):
        if isinstance(x, Literal):
            return repr(np.asarray(x.val).item()) if np.size(x.val) == 1 else "<literal>"
        if x not in names:
            names[x] = f"%{len(names) - len(jaxpr.invars) - len(jaxpr.constvars)}"
        return names[x]

    lines = [f"graph {g.name}: {len(jaxpr.invars)} inputs, {len(g.ops)} ops"]
    lines.append("  inputs")
    for v, n, s in zip(jaxpr.invars, g.input_names, g.input_shardings):
        lines.append(f"    {n}: {_type(v.aval)}" + (f"  sharding {s}" if s else ""))
    for v in jaxpr.constvars:
        lines.append(f"    {ref(v)}: {_type(v.aval)}  (constant)")
    lines.append("  ops")
    for eqn in jaxpr.eqns:
        args = ", ".join(ref(x) for x in eqn.invars)
        params = _params(eqn.params)
        outs = ", ".join(f"{ref(v)}: {_type(v.aval)}" for v in eqn.outvars)
        lines.append(f"    {outs} = {eqn.primitive.name}({args}){params}")
    lines.append("  outputs: " + ", ".join(ref(v) for v in jaxpr.outvars))
    lines.append("  passes")
    for r in g.report:
        lines += ["    " + line for line in str(r).splitlines()]
    return "\n".join(lines)


def _type(aval: Any) -> str:
    """``bf16[4,16]`` (with the mesh axes of a dimension where sharding is in the type)."""
    return aval.str_short(short_dtypes=True)


def _params(params: dict[str, Any]) -> str:
    if not params:
        return ""
    return "  " + " ".join(f"{k}={_param(v)}" for k, v in params.items())


def _param(v: Any) -> str:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = []
        for f in dataclasses.fields(v):
            val = getattr(v, f.name)
            if f.default is not dataclasses.MISSING and _same(val, f.default):
                continue
            fields.append(f"{f.name}={_param(val)}")
        return f"{type(v).__name__}({', '.join(fields)})"
    if isinstance(v, np.dtype):
        return v.name
    if isinstance(v, (ClosedJaxpr, jax.extend.core.Jaxpr)):
        return "{jaxpr}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays and other values without a truth value
        return False
