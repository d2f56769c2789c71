"""How a kernel body becomes one ``pl.pallas_call``.

The target is Pallas' Triton backend, whose lane-vector model (masked per-lane loads and
stores, ``tl.dot`` on the tensor cores, ``num_warps``/``num_stages``, a software pipeliner
for ``scf.for``) is the tile language's own; Mosaic GPU is warpgroup/TMA-level and is what
the operators' kernels (``pallas_kernels/*_mgpu.py``) use. On the CPU the same call runs
in Pallas' interpreter (``interpret=True``).

**Source transform.** As Triton does, the kernel function's AST is rewritten before it is
traced: ``for k in ts.tile.range(...)`` becomes one ``lax.fori_loop`` (an ``scf.for``,
which Triton's software pipeliner needs; a Python loop would be unrolled and never
pipelined). Its loop-carried variables are the names assigned in the body that were bound
before the loop, and the shared tiles whose values must cross iterations (``_plan``: a
prefetched copy is recomputed from the loop index instead). ``if``/``while``/conditional
expressions and Python ``for ... in range(...)`` are checked: a traced condition or bound
raises an error naming the kernel, the line and what to write instead. Line numbers are
kept, so tracebacks point at the kernel's own source.

**Launch.** Every array argument is passed whole (no BlockSpecs): a body addresses arrays
with windows (``pl.ds``) and masks, as the Triton backend's pointer model does. ``mut``
arguments are outputs aliased to their inputs (``input_output_aliases``), so elements a
kernel does not store keep their values. A first, abstract trace records the windows each
array is read through, which arrays are stored and the deepest ``prefetch``; the second
trace is the real one. Pallas' interpreter clamps a window that runs off an array's end,
where the GPU masks lane by lane, so in interpret mode every array is padded by its
largest window on both sides and the results sliced back: ragged edges give the same
values on the CPU as on the GPU.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from tessera_jax import _compat
from tessera_jax._compat import pallas_triton as plgpu
from tessera_jax.tile import ops

RUNTIME = "__tessera_tile__"


# --- the source transform -----------------------------------------------------------------


def _is_tile_range(node: ast.expr) -> bool:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    f = node.func
    return f.attr == "range" and (
        (isinstance(f.value, ast.Attribute) and f.value.attr == "tile")
        or (isinstance(f.value, ast.Name) and f.value.id == "tile")
    )


def _stored_names(nodes: Sequence[ast.AST]) -> set[str]:
    out: set[str] = set()
    for n in nodes:
        for sub in ast.walk(n):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                out.add(sub.id)
    return out


def _rt(attr: str) -> ast.expr:
    return ast.Attribute(ast.Name(RUNTIME, ast.Load()), attr, ast.Load())


class _Transform:
    def __init__(self, filename: str, name: str):
        self.filename, self.name, self.count = filename, name, 0

    def fail(self, node: ast.AST, msg: str) -> Exception:
        return SyntaxError(f"kernel {self.name!r} at {self.filename}:{node.lineno}: {msg}")

    def block(self, stmts: list[ast.stmt], defined: set[str]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for s in stmts:
            out.extend(self.stmt(s, defined))
            defined |= _stored_names([s])
        return out

    def expr(self, node: ast.expr) -> ast.expr:
        """Wraps the tests of conditional expressions in a static-truth check."""

        outer = self

        class Conds(ast.NodeTransformer):
            def visit_IfExp(self, n):
                self.generic_visit(n)
                n.test = outer.cond(n.test)
                return n

            def visit_Lambda(self, n):
                return n

        return Conds().visit(node)

    def cond(self, test: ast.expr) -> ast.expr:
        return ast.Call(_rt("cond"), [test, ast.Constant(test.lineno)], [])

    def stmt(self, s: ast.stmt, defined: set[str]) -> list[ast.stmt]:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [s]
        if isinstance(s, ast.For) and _is_tile_range(s.iter):
            return self.tile_loop(s, defined)
        for field in ("test", "iter", "value", "targets", "target"):
            v = getattr(s, field, None)
            if isinstance(v, ast.expr):
                setattr(s, field, self.expr(v))
        if isinstance(s, (ast.If, ast.While)):
            s.test = self.cond(s.test)
        if isinstance(s, ast.For):
            it = s.iter
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
                it.func = _rt("static_range")
                it.args.insert(0, ast.Constant(it.lineno))
        for field in ("body", "orelse", "finalbody"):
            body = getattr(s, field, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                setattr(s, field, self.block(body, set(defined)))
        if isinstance(s, ast.Try):
            for h in s.handlers:
                h.body = self.block(h.body, set(defined))
        return [s]

    def tile_loop(self, s: ast.For, defined: set[str]) -> list[ast.stmt]:
        if not isinstance(s.target, ast.Name):
            raise self.fail(s, "the target of a ts.tile.range loop must be one name")
        if s.orelse:
            raise self.fail(s, "a ts.tile.range loop cannot have an else: block")
        for sub in ast.walk(ast.Module(s.body, [])):
            if isinstance(sub, (ast.Break, ast.Continue, ast.Return)):
                kind = type(sub).__name__.lower()
                raise self.fail(
                    sub,
                    f"`{kind}` inside a ts.tile.range loop: the loop is compiled as a whole; "
                    "mask the remaining iterations' loads and stores instead",
                )
        carried = sorted((_stored_names(s.body) - {s.target.id}) & defined)
        self.count += 1
        body_name = f"__tile_body_{self.count}"
        inner = self.block(list(s.body), set(defined) | {s.target.id})
        tup = lambda ctx: ast.Tuple([ast.Name(n, ctx) for n in carried], ctx)
        inner.append(ast.Return(tup(ast.Load())))
        args = ast.arguments(
            posonlyargs=[],
            args=[ast.arg(s.target.id)] + [ast.arg(n) for n in carried],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        )
        fdef = ast.FunctionDef(body_name, args, inner, [], None, type_params=[])
        call = ast.Call(
            _rt("loop"),
            [
                self.expr(s.iter),
                ast.Name(body_name, ast.Load()),
                tup(ast.Load()),
                ast.Tuple([ast.Constant(n) for n in carried], ast.Load()),
                ast.Constant(s.lineno),
            ],
            [],
        )
        assign = ast.Assign([tup(ast.Store())], call) if carried else ast.Expr(call)
        out = [fdef, assign]
        for node in out:
            ast.copy_location(node, s)
        return out


def transform(fn: Callable[..., Any], name: str) -> tuple[Callable[..., Any], str, tuple[int, int]]:
    """``fn`` recompiled from its rewritten source; its file name and line range."""
    try:
        lines, first = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    except (OSError, TypeError):
        raise TypeError(
            f"kernel {name!r}: its source is not available, and a kernel body is compiled from "
            "its source; define it in a file (not in an interactive prompt or with exec)"
        ) from None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise TypeError(f"kernel {name!r}: @ts.kernel takes a function defined with def")
    fdef.decorator_list = []
    ast.increment_lineno(tree, first - 1)
    t = _Transform(filename, name)
    params = {a.arg for a in (*fdef.args.posonlyargs, *fdef.args.args, *fdef.args.kwonlyargs)}
    fdef.body = t.block(fdef.body, set(params))
    last = max(getattr(n, "end_lineno", 0) or 0 for n in ast.walk(fdef))
    # Free variables of the original become parameters of a factory, so closures keep working.
    free = fn.__code__.co_freevars
    factory = ast.FunctionDef(
        "__tile_factory",
        ast.arguments(
            posonlyargs=[],
            args=[ast.arg(v) for v in free],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        [fdef, ast.Return(ast.Name(fdef.name, ast.Load()))],
        [],
        None,
        type_params=[],
    )
    ast.copy_location(factory, fdef)
    module = ast.fix_missing_locations(ast.Module([factory], []))
    code = compile(module, filename, "exec")
    glb = dict(fn.__globals__)
    glb[RUNTIME] = Runtime
    ns: dict[str, Any] = {}
    exec(code, glb, ns)
    cells = [c.cell_contents for c in (fn.__closure__ or ())]
    return ns["__tile_factory"](*cells), filename, (first, last)


# --- what the rewritten source calls ------------------------------------------------------


def _traced(x: Any) -> bool:
    if isinstance(x, (ops.Idx,)):
        return not x.static
    return isinstance(x, (jax.Array, ops.Lanes, ops.RefView, ops.SharedTile)) or isinstance(
        x, jax.core.Tracer
    )


class Runtime:
    @staticmethod
    def cond(test: Any, line: int) -> bool:
        if isinstance(test, (ops.Lanes,)) or (_traced(test) and not isinstance(test, ops.Idx)):
            if (
                hasattr(test, "shape")
                and tuple(test.shape) == ()
                and not isinstance(test, jax.core.Tracer)
            ):
                return bool(test)
            raise _line_error(
                line,
                "an `if` (or while / conditional expression) on a tile value cannot be traced",
                "compute a mask and pass mask= to ts.tile.load/store, or select with "
                "ts.tile.where(cond, x, y)",
            )
        return bool(test)

    @staticmethod
    def static_range(line: int, *args: Any):
        for a in args:
            if _traced(a):
                raise _line_error(
                    line,
                    f"a Python `for ... in range(...)` over a traced bound ({a!r})",
                    "loop with `for i in ts.tile.range(start, stop, step)`, which compiles to "
                    "one loop",
                )
        return range(*(int(a) if isinstance(a, ops.Idx) else a for a in args))

    @staticmethod
    def loop(rng: Any, body: Callable, init: tuple, names: tuple[str, ...], line: int) -> tuple:
        if not isinstance(rng, ops.TileRange):
            raise _line_error(
                line, f"the loop iterates over {rng!r}", "use ts.tile.range", TypeError
            )
        return _run_loop(rng, body, init, names, line)


def _line_error(line: int, msg: str, hint: str, exc: type[Exception] = TypeError) -> Exception:
    ctx = ops.current()
    return exc(f"kernel {ctx.name!r} at {ctx.filename}:{line}: {msg}; {hint}")


def _carry_value(name: str, v: Any, line: int) -> jax.Array:
    if isinstance(v, ops.Idx):
        return jnp.asarray(v.value(), jnp.int32)
    if isinstance(v, (bool, int, float, np.number, np.ndarray, jax.Array)) or isinstance(
        v, jax.core.Tracer
    ):
        return jnp.asarray(v)
    raise _line_error(
        line,
        f"the loop-carried variable {name!r} holds a {type(v).__name__}",
        "only arrays and numbers can change inside a ts.tile.range loop; keep tiles and "
        "arrays in names the loop does not assign",
    )


def _run_loop(rng: ops.TileRange, body: Callable, init: tuple, names, line: int) -> tuple:
    ctx = ops.current()
    start, stop, step = rng.start, rng.stop, rng.step
    if start.static and stop.static:
        n: Any = max(0, -(-(stop.off - start.off) // step))
    else:
        span = jnp.asarray(stop.value(), jnp.int32) - jnp.asarray(start.value(), jnp.int32)
        n = jnp.maximum(0, (span + (step - 1)) // step)
    hi = None  # the largest value the loop variable takes
    if isinstance(n, int) and start.hi is not None:
        hi = start.hi + max(n - 1, 0) * step
    elif start.hi is not None and stop.hi is not None:
        hi = max(start.hi, stop.hi - 1)
    shared = list(ctx.shared)
    entry = [t.state for t in shared]
    carry = [_carry_value(nm, v, line) for nm, v in zip(names, init)]
    weak = [not isinstance(v, (jax.Array, jax.core.Tracer)) or _weak(v) for v in init]
    traces: list[tuple] = []

    def step_fn(i, state, plan):
        """One iteration. ``plan`` says how each shared tile enters it: ``"carry"`` (its
        value is loop state), ``"fixed"`` (its state before the loop) or a
        :class:`_CarriedCopy` (the copy the previous iteration left in it)."""
        vals, tiles = state
        saved = [t.state for t in shared]
        carried = iter(tiles)
        for t, how, s0 in zip(shared, plan, entry):
            if how == "carry":
                t.state = next(carried)
            else:
                t.state = how.previous(i) if isinstance(how, _CarriedCopy) else s0
        tracks = [{"read_first": False, "written": False} for _ in shared]
        for t, tr in zip(shared, tracks):
            t.tracks.append(tr)
        ctx.scopes.append(object())
        depth = len(ctx.shared)
        k = ops.Idx(((i, step),), 0, None, None) + start
        k = ops.Idx(k.terms, k.off, start.lo, hi)
        try:
            try:
                out = body(k, *vals)
            finally:
                for t in shared:
                    t.tracks.pop()
            traces.append((i, tracks, [t.state for t in shared]))
            new_tiles = tuple(t.peek() for t, how in zip(shared, plan) if how == "carry")
        finally:
            ctx.scopes.pop()
            del ctx.shared[depth:]
            for t, v in zip(shared, saved):
                t.state = v
        return tuple(_carry_value(nm, v, line) for nm, v in zip(names, out)), new_tiles

    # A first, abstract trace of the body says what each shared tile needs (see _plan).
    plan = ["fixed" if isinstance(s0, ops.Copy) else "carry" for s0 in entry]
    tiles0 = tuple(s0 for s0 in entry if not isinstance(s0, ops.Copy))
    outs = jax.eval_shape(lambda i, st: step_fn(i, st, plan), jnp.int32(0), (tuple(carry), tiles0))
    fixed = []
    for nm, c, o, w in zip(names, carry, outs[0], weak):
        if c.shape != o.shape or c.dtype != o.dtype:
            if w and np.broadcast_shapes(c.shape, o.shape) == o.shape:
                c = jnp.broadcast_to(c, o.shape).astype(o.dtype)
            else:
                raise _line_error(
                    line,
                    f"the loop-carried variable {nm!r} is {c.dtype}{list(c.shape)} before the "
                    f"loop and {o.dtype}{list(o.shape)} after one iteration",
                    f"initialise it with its final shape and dtype, e.g. "
                    f"ts.tile.zeros({tuple(o.shape)}, jnp.{o.dtype})",
                )
        fixed.append(c)

    plan, after = _plan(entry, *traces[-1], n)
    tiles0 = tuple(
        s0.load() if isinstance(s0, ops.Copy) else s0
        for s0, how in zip(entry, plan)
        if how == "carry"
    )
    carried = sum(c.size * c.dtype.itemsize for c in fixed) + sum(
        t.size * t.dtype.itemsize for t in tiles0
    )
    ctx.carried_bytes = max(ctx.carried_bytes, carried)
    dtypes = [t.dtype for t, how in zip(shared, plan) if how == "carry"]

    def typed(i, state):
        vals, tiles = step_fn(i, state, plan)
        vals = tuple(v.astype(c.dtype) for v, c in zip(vals, fixed))
        return vals, tuple(v.astype(d) for v, d in zip(tiles, dtypes))

    vals, tiles = jax.lax.fori_loop(0, n, typed, (tuple(fixed), tiles0))
    tiles = iter(tiles)
    for t, how, a in zip(shared, plan, after):
        t.state = next(tiles) if how == "carry" else a
    return tuple(vals)


def _plan(entry: list, i: Any, tracks: list[dict], exits: list, n: Any) -> tuple[list, list]:
    """How each shared tile enters the loop's iterations, and its state after the loop.

    A tile the body does not write keeps its state (``"fixed"``). A tile whose body leaves
    a copy affine in the loop index needs no loop state: when the body writes it before
    reading it, the iterations see it as the body left it (``"fixed"``); when the body
    reads it first, the copy before the loop must be the one the body's copy gives for the
    iteration before the first, and each iteration sees the previous iteration's copy (a
    :class:`_CarriedCopy`), which is the prefetch of a double buffer. Any other tile is
    loop state: its value, in registers (``"carry"``).
    """
    plan, after = [], []
    for s0, tr, ex in zip(entry, tracks, exits):
        tmpl = _CarriedCopy.of(ex, i) if tr["written"] and isinstance(ex, ops.Copy) else None
        if not tr["written"]:
            if tr["read_first"] and isinstance(s0, ops.Copy):
                s0.load()  # once, before the loop, rather than in every iteration
            plan.append("fixed")
            after.append(s0)
        elif tmpl is not None and tr["read_first"] and tmpl.follows(s0):
            plan.append(tmpl)
            after.append(tmpl.last(n))
        elif tmpl is not None and not tr["read_first"] and isinstance(n, int):
            plan.append("fixed")
            after.append(tmpl.last(n) if n else s0)
        elif tmpl is not None and not tr["read_first"] and tmpl.follows(s0):
            plan.append("fixed")
            after.append(tmpl.last(n))
        else:
            plan.append("carry")
            after.append(None)
    return plan, after


class _CarriedCopy:
    """The copy a loop body leaves in a shared tile, as a function of the iteration ``j``:
    per dimension the start ``rest + coef·j`` (``rest``: terms from outside the loop and a
    constant) with its bounds over the iterations, and the window's size."""

    def __init__(self, copy: ops.Copy, dims: list[tuple]):
        self.copy, self.dims = copy, dims

    @staticmethod
    def of(copy: ops.Copy, i: Any) -> _CarriedCopy | None:
        """``copy`` (made in the body whose loop index is ``i``) as a function of the
        iteration, or None when it depends on other values of the body."""
        dims = []
        for a, size, window in copy.dims:
            coef = sum(c for t, c in a.terms if t is i)
            rest = tuple((t, c) for t, c in a.terms if t is not i)
            if any(_compat.same_trace(t, i) for t, _ in rest):
                return None
            dims.append((rest, coef, a.off, a.lo, a.hi, size, window))
        return _CarriedCopy(copy, dims)

    def _at(self, j: Any, j_const: int, shifts: tuple[int, ...]) -> ops.Copy:
        """The copy at iteration ``j + j_const`` (``j`` a traced index or None), whose value
        lies within the iterations' bounds shifted back by ``shifts`` iterations."""
        dims = []
        for rest, coef, off, lo, hi, size, window in self.dims:
            terms = rest + (((j, coef),) if j is not None else ())
            if lo is not None:
                lo, hi = min(lo - s * coef for s in shifts), max(hi - s * coef for s in shifts)
            dims.append((ops.Idx(terms, off + j_const * coef, lo, hi), size, window))
        return ops.Copy(self.copy.src, tuple(dims), self.copy.dtype)

    def previous(self, i: Any) -> ops.Copy:
        """What the iteration before ``i`` left (the copy before the loop when ``i`` is 0)."""
        return self._at(i, -1, (1,))

    def last(self, n: Any) -> ops.Copy:
        """What the last of ``n`` iterations left (the copy before the loop when none ran,
        which ``follows`` checked where ``n`` is traced)."""
        if isinstance(n, int):
            return self._at(None, n - 1, (0,) if n else (1,))
        return self._at(jnp.asarray(n, jnp.int32), -1, (0, 1))

    def follows(self, before: Any) -> bool:
        """Whether ``before`` (the tile's state before the loop) is this copy at iteration
        -1, so that the first iteration's ``previous`` is exact."""
        if not isinstance(before, ops.Copy) or before.src is not self.copy.src:
            return False
        if before.dtype != self.copy.dtype or len(before.dims) != len(self.dims):
            return False
        for (a, size, window), (rest, coef, off, *_, size2, window2) in zip(before.dims, self.dims):
            if (size, window) != (size2, window2) or a.off != off - coef:
                return False
            if {id(t): c for t, c in a.terms} != {id(t): c for t, c in rest if c}:
                return False
        return True


def _weak(v: Any) -> bool:
    return bool(getattr(getattr(v, "aval", None), "weak_type", False)) or bool(
        getattr(v, "weak_type", False)
    )


# --- the pallas_call ----------------------------------------------------------------------


class Param:
    """How one kernel parameter is passed: ``kind`` is array, scalar (traced) or static.

    ``fresh``: a mut array given as a ``jax.ShapeDtypeStruct`` (``value``): an output with
    no input to alias, whose unstored elements are undefined.
    """

    __slots__ = ("fresh", "kind", "mut", "name", "value")

    def __init__(self, name: str, kind: str, mut: bool, value: Any = None, fresh: bool = False):
        self.name, self.kind, self.mut, self.value, self.fresh = name, kind, mut, value, fresh

    @property
    def dynamic(self) -> bool:
        """Whether the launch passes this argument as an array."""
        return self.kind != "static" and not self.fresh

    def key(self) -> tuple:
        v = self.value
        v = v if self.kind == "static" else ((v.shape, str(v.dtype)) if self.fresh else None)
        return (self.name, self.kind, self.mut, v)


def call(
    body: Callable,
    name: str,
    filename: str,
    lines: tuple[int, int],
    params: Sequence[Param],
    kwargs: dict[str, Any],
    grid: tuple[int, ...],
    threads: tuple[int, ...],
    interpret: bool,
    num_warps: int | None,
    num_stages: int | None,
    dyn: Sequence[jax.Array],
) -> tuple[list[jax.Array], ops.Context]:
    """Runs the kernel over ``grid``; returns the new values of the mut arguments."""
    probe = trace(body, name, filename, lines, params, kwargs, grid, threads, dyn)
    arrays = [i for i, p in enumerate(params) if p.kind == "array"]
    for i in arrays:
        p = params[i]
        if p.mut and i not in probe.stored:
            raise ValueError(
                f"kernel {name!r} at {filename}:{lines[0]}: the ts.mut parameter {p.name!r} is "
                f"never stored; store to it with ts.tile.store({p.name}, idx, value), or drop "
                "its ts.mut annotation"
            )
    pads: dict[int, tuple[int, ...]] = {}
    if interpret:
        for i in arrays:
            nd = len(params_shape(dyn, params, i))
            pads[i] = tuple(probe.windows.get((i, d), 0) for d in range(nd))
    stages = num_stages
    if stages is None and probe.prefetch:
        stages = probe.prefetch + 1
    ctx = ops.Context(name, filename, lines, grid, threads, interpret, pads)

    def run(*d):
        return _pallas(body, ctx, params, kwargs, d, pads, interpret, num_warps, stages)

    if not _compat.vma_checking():
        return run(*dyn), probe
    # Inside shard_map (ts.index_launch): one primitive whose lowering traces the kernel
    # vma-free, as the ts operators' lowerings do; pallas_call and its interpreter would
    # otherwise need every intermediate typed by the mesh axes it varies over.
    vma = frozenset().union(*(_compat.varying_axes(x) for x in dyn))
    like = jax.typeof(dyn[0]) if dyn else None
    out_avals = tuple(
        _compat.with_varying(
            jax.core.ShapedArray(params_shape(dyn, params, i), _dtype(dyn, params, i)), vma, like
        )
        for i, p in enumerate(params)
        if p.mut
    )
    dyn = _compat.match_vma(dyn)
    fn = _Opaque(run, math.prod(grid))
    return list(_launch_p.bind(*dyn, fn=fn, out_avals=out_avals)), probe


def _dtype(dyn, params, i) -> Any:
    p = params[i]
    return p.value.dtype if p.fresh else dyn[_dyn_index(params, i)].dtype


class _Opaque:
    """A primitive parameter holding a function, hashed by identity; ``programs``: how many
    programs (groups) one call of it launches."""

    def __init__(self, fn: Callable[..., Any], programs: int):
        self.fn, self.programs = fn, programs


_launch_p = _compat.Primitive("ts_tile_launch")
_launch_p.multiple_results = True
_launch_p.def_impl(lambda *args, fn, out_avals: fn.fn(*args))
_launch_p.def_abstract_eval(lambda *avals, fn, out_avals: list(out_avals))


def _launch_lowering(ctx, *args, fn, out_avals):
    with _compat.lowering_without_vma(ctx) as ctx:
        return _compat.mlir.lower_fun(fn.fn, multiple_results=True)(ctx, *args)


_compat.mlir.register_lowering(_launch_p, _launch_lowering)

# The most programs one launch may have: CUDA's grid limit along x, into which Pallas'
# Triton backend folds every grid axis that does not fit y and z.
MAX_PROGRAMS = 2**31 - 1


def _launch_batching(args, dims, *, fn, out_avals):
    """``vmap`` of a launch: the batch becomes a grid axis of the one ``pallas_call`` (Pallas'
    own batching rule, which gives each program its batch element). A batch that would take
    the launch past ``MAX_PROGRAMS``, or an empty one (no grid has an axis of size 0), runs
    as a loop of launches instead."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _compat.not_mapped)
    in_axes = tuple(None if d is _compat.not_mapped else d for d in dims)
    programs = size * fn.programs
    if 0 < programs <= MAX_PROGRAMS:
        batched = jax.vmap(fn.fn, in_axes=in_axes)
    else:
        programs = fn.programs

        def batched(*xs):
            mapped = [jnp.moveaxis(x, a, 0) for x, a in zip(xs, in_axes) if a is not None]

            def one(slices):
                it = iter(slices)
                return fn.fn(*(x if a is None else next(it) for x, a in zip(xs, in_axes)))

            return jax.lax.map(one, mapped)

    avals = tuple(a.update(shape=(size, *a.shape)) for a in out_avals)
    outs = _launch_p.bind(*args, fn=_Opaque(batched, programs), out_avals=avals)
    return outs, [0] * len(outs)


_compat.batching.primitive_batchers[_launch_p] = _launch_batching


def trace(body, name, filename, lines, params, kwargs, grid, threads, dyn) -> ops.Context:
    """An abstract trace of the body: what it reads, stores, allocates and carries."""
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in dyn]
    probe = ops.Context(name, filename, lines, grid, threads, True, {})
    with _compat.vma_checks_off():
        jax.eval_shape(
            lambda *d: _pallas(body, probe, params, kwargs, d, {}, True, None, None), *shapes
        )
    return probe


def params_shape(dyn, params, i) -> tuple[int, ...]:
    if params[i].fresh:
        return tuple(params[i].value.shape)
    return tuple(dyn[_dyn_index(params, i)].shape)


def _dyn_index(params, i) -> int:
    return sum(1 for p in params[:i] if p.dynamic)


def _pallas(body, ctx, params, kwargs, dyn, pads, interpret, num_warps, num_stages):
    if _compat.TRITON_MISSING is not None:
        raise NotImplementedError(
            f"tile kernel {ctx.name!r}: tile kernels lower through Pallas' Triton backend "
            f"(interpreted too), and {_compat.TRITON_MISSING}"
        )
    operands, out_shapes, aliases, slots, out_of = [], [], {}, [], {}
    for i, p in enumerate(params):
        if p.kind == "static":
            slots.append(None)
            continue
        if p.fresh:
            shape = tuple(n + 2 * q for n, q in zip(p.value.shape, pads.get(i, ())))
            shape += tuple(p.value.shape[len(shape) :])
            slots.append(None)
            out_of[i] = len(out_shapes)
            out_shapes.append(jax.ShapeDtypeStruct(shape, p.value.dtype))
            continue
        x = dyn[_dyn_index(params, i)]
        if p.kind == "scalar":
            x = jnp.reshape(x, (1,))
        elif pads.get(i) and any(pads[i]):
            x = jnp.pad(x, [(n, n) for n in pads[i]])
        slots.append(len(operands))
        if p.mut:
            aliases[len(operands)] = out_of[i] = len(out_shapes)
            out_shapes.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
        operands.append(x)
    n_in = len(operands)

    def kernel(*refs):
        ins, outs = refs[:n_in], refs[n_in:]
        args = []
        for i, p in enumerate(params):
            if p.kind == "static":
                args.append(p.value)
            elif p.kind == "scalar":
                args.append(ins[slots[i]][0])
            else:
                ref = outs[out_of[i]] if p.mut else ins[slots[i]]
                shape = params_shape(dyn, params, i)
                args.append(ops.TileRef(ref, p.name, i, shape, ref.dtype, p.mut))
        with ops.enter(ctx):
            body(*args, **kwargs)

    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(
            num_warps=num_warps or 4, num_stages=num_stages or 3
        )
    res = pl.pallas_call(
        kernel,
        grid=ctx.grid,
        out_shape=out_shapes,
        input_output_aliases=aliases,
        interpret=interpret,
        name=ctx.name,
        **extra,
    )(*operands)
    outs = []
    for i, r in zip(sorted(out_of, key=out_of.get), res):
        if pads.get(i) and any(pads[i]):
            r = r[tuple(slice(n, n + s) for n, s in zip(pads[i], params_shape(dyn, params, i)))]
        outs.append(r)
    return outs
