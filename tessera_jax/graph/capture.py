"""Graph capture and replay: ``ts.graph.capture``, ``ts.graph.launch``, ``record_call``.

Seed 000 records a sequence of kernel launches once and replays it "without CPU
overhead". In JAX the overhead of a sequence of eager operators is one dispatch each
(Python, argument checks, an executable launch); the replay removes it by compiling the
whole recorded sequence into ONE XLA program, compiled at the first launch and called
directly afterwards. On GPUs XLA can further record that program's kernels into command
buffers (CUDA graphs) and launch them as one graph: :func:`command_buffer_options` is the
per-compile option that asks for it (``xla_gpu_enable_command_buffer``).

How a capture works:

* ``with ts.graph.capture() as g:`` installs a recorder that every eager
  ``Operator.bind`` goes through (tessera_jax/primitives/_core.py): the operator, its
  parameters and its operands are recorded, and the operator still runs, so the block
  computes real results as it would without the capture.
* Kernel launches that are not operators are recorded through :func:`record_call`.
* An operand is either a graph input (an array that was alive when the block began) or
  the result of an earlier recorded step. Anything else was computed inside the block by
  an operation the capture cannot see (``jax.numpy``, a jitted function, a conversion
  from NumPy): replaying it would bake its captured value in as a constant, so it is an
  error, raised before the step runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tessera_jax import _compat
from tessera_jax._config import command_buffer_options, get_kernel_mode
from tessera_jax.primitives import _core

_STATE = threading.local()  # the capture running on this thread (one at a time)


@dataclasses.dataclass(frozen=True)
class _Step:
    """One recorded call: ``fn(*operands)`` returns a pytree of arrays.

    ``sources[i]`` says where operand ``i`` comes from at replay: ``("input", k)`` (the
    graph's k-th input) or ``("step", s, j)`` (leaf j of step s's result).
    """

    name: str
    fn: Callable[..., Any]
    sources: tuple[tuple[Any, ...], ...]
    avals: tuple[jax.ShapeDtypeStruct, ...]  # of the results' leaves, for printing


class CapturedGraph:
    """A captured sequence of ts operators and kernel launches, replayed by :func:`launch`.

    Attributes:
      inputs: ``{name: array}``, the arrays the recorded steps read that were alive when
        the capture began, in order of first use. An array named in
        ``ts.graph.capture(name=array)`` has that name; the others are ``in0``, ``in1``, …
        (the number is the input's position). :func:`launch` replaces them by name.
      ops: the recorded steps' names in capture order (``ts_matmul`` for an operator,
        the name given to :func:`record_call` for a kernel launch).
      trace_count: how many times the replay program has been traced: once per kernel
        mode (and again after :meth:`set_outputs`); later launches reuse the compiled
        program.
      compiler_options: the XLA options the replay is compiled with (the command-buffer
        option on GPUs; empty elsewhere, where XLA has no command buffers).
    """

    def __init__(self, named: Mapping[str, jax.Array], command_buffer: bool):
        self._named = {id(a): n for n, a in named.items()}
        self._named_arrays = dict(named)  # keeps the named arrays' ids valid until the end
        self._command_buffer = command_buffer
        self._steps: list[_Step] = []
        self._inputs: dict[str, jax.Array] = {}
        self._input_index: dict[int, int] = {}  # id(array) -> input position
        self._produced: dict[int, tuple[weakref.ref, int, int]] = {}  # id -> (ref, step, leaf)
        self._outputs: tuple[tuple[int, int], ...] | None = None  # None: every step's result
        self._live: dict[int, weakref.ref] | None = None
        self._capturing = False
        self._compiled: dict[str, Any] = {}  # kernel mode -> executable
        self.trace_count = 0
        self.compiler_options: dict[str, str] = {}

    # --- what the capture block sees ------------------------------------------------------

    @property
    def inputs(self) -> dict[str, jax.Array]:
        return dict(self._inputs)

    @property
    def ops(self) -> list[str]:
        return [s.name for s in self._steps]

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        names = list(self._inputs)
        lines = [f"CapturedGraph({len(self._steps)} steps, inputs: {', '.join(names) or 'none'})"]
        for k, step in enumerate(self._steps):
            args = ", ".join(self._operand_text(src, names) for src in step.sources)
            types = ", ".join(f"{a.dtype}{list(a.shape)}" for a in step.avals)
            lines.append(f"  %{k} = {step.name}({args}) -> {types}")
        return "\n".join(lines)

    def _operand_text(self, src: tuple[Any, ...], names: list[str]) -> str:
        if src[0] == "input":
            return names[src[1]]
        multiple = len(self._steps[src[1]].avals) > 1
        return f"%{src[1]}.{src[2]}" if multiple else f"%{src[1]}"

    # --- recording ------------------------------------------------------------------------

    def _begin(self) -> None:
        self._live = {id(a): weakref.ref(a) for a in _live_arrays()}
        self._capturing = True

    def _end(self, *, check_names: bool) -> None:
        self._capturing = False
        self._live = None
        unused = [n for n in self._named_arrays if n not in self._inputs]
        self._named, self._named_arrays = {}, {}
        if check_names and unused:
            raise ValueError(
                f"ts.graph.capture: the input(s) {', '.join(map(repr, unused))} were named "
                "but no recorded ts operator read them (check that the block uses those "
                "arrays, not copies of them)"
            )

    def _source(self, name: str, pos: int, x: Any) -> tuple[Any, ...]:
        """Where operand ``pos`` of step ``name`` comes from, or a ValueError."""
        if not isinstance(x, jax.Array):
            raise TypeError(
                f"ts.graph.capture: operand {pos} of {name} is a {type(x).__name__}, not a jax "
                "array: a capture records eager calls on device arrays (put host values on "
                "the device with jax.device_put before the `with ts.graph.capture()` block)"
            )
        key = id(x)
        made = self._produced.get(key)
        if made is not None and made[0]() is x:
            return ("step", made[1], made[2])
        if key in self._input_index:
            return ("input", self._input_index[key])
        live = self._live.get(key) if self._live is not None else None
        if (live is not None and live() is x) or key in self._named:
            return ("new input", x)  # becomes an input once every operand is checked
        raise ValueError(
            f"ts.graph.capture: operand {pos} of {name} (a {x.dtype}{list(x.shape)} array) was "
            "computed inside the capture block by an operation that is not a ts operator (a "
            "jax.numpy or lax call, a jitted function, a conversion from NumPy), so a replay "
            "could only bake its captured value in as a constant. Compute it with ts "
            "operators, or compute it before the `with ts.graph.capture()` block so that it "
            "becomes a graph input"
        )

    def _add_input(self, _: str, x: jax.Array) -> tuple[str, int]:
        key = id(x)
        if key not in self._input_index:  # (an array passed twice to one step is one input)
            k = len(self._inputs)
            self._inputs[self._named.get(key) or self._auto_name(k)] = x
            self._input_index[key] = k
        return ("input", self._input_index[key])

    def _auto_name(self, k: int) -> str:
        taken = set(self._inputs) | set(self._named_arrays)
        name = f"in{k}"
        while name in taken:
            name += "_"
        return name

    def _record(self, name: str, fn: Callable[..., Any], operands: Sequence[Any]) -> Any:
        """Records ``fn(*operands)`` as the next step and returns its (eager) result."""
        sources = tuple(
            self._add_input(*src) if src[0] == "new input" else src
            for src in [self._source(name, i, x) for i, x in enumerate(operands)]
        )
        with _suspended():  # whatever ``fn`` binds eagerly belongs to this one step
            out = fn(*operands)
        leaves = jax.tree.leaves(out)
        k = len(self._steps)
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, jax.Array):
                self._produced[id(leaf)] = (weakref.ref(leaf), k, j)
        avals = tuple(jax.ShapeDtypeStruct(np.shape(v), _dtype(v)) for v in leaves)
        self._steps.append(_Step(name, fn, sources, avals))
        return out

    def _record_operator(self, op: Any, args: Sequence[Any], params: dict[str, Any]) -> Any:
        def fn(*operands: Any) -> Any:
            if _compat.is_eager():
                return op.bind_eager(operands, params)
            return op.prim.bind(*operands, **params)

        return self._record(op.prim.name, fn, args)

    # --- replay ---------------------------------------------------------------------------

    def set_outputs(self, *results: jax.Array) -> None:
        """Makes :func:`launch` return only these results of the capture, in this order.

        ``results`` are arrays the capture block computed with recorded steps (``y`` after
        ``y = ts.relu(x)`` in the block). By default a launch returns every step's result:
        the program writes each to a buffer of its own and the launch wraps each in an
        array; returning only the ones used saves both, and lets XLA fuse the others away.
        With no arguments, every step's result is returned again.
        """
        if self._capturing:
            raise RuntimeError("CapturedGraph.set_outputs: call it after the capture block")
        where = []
        for i, r in enumerate(results):
            made = self._produced.get(id(r))
            if made is None or made[0]() is not r:
                raise ValueError(
                    f"CapturedGraph.set_outputs: result {i} (a {type(r).__name__}) is not an array "
                    "that a recorded step of this graph computed"
                )
            where.append((made[1], made[2]))
        self._outputs = tuple(where) if results else None
        self._compiled = {}  # the program returns other values: compile it again

    def _program(self, *inputs: jax.Array) -> tuple[Any, ...]:
        """Every recorded step in order, on ``inputs``: the results in capture order (or
        the ones chosen by :meth:`set_outputs`)."""
        self.trace_count += 1
        results: list[Any] = []
        leaves: list[list[Any]] = []
        for step in self._steps:
            operands = [
                inputs[src[1]] if src[0] == "input" else leaves[src[1]][src[2]]
                for src in step.sources
            ]
            out = step.fn(*operands)
            results.append(out)
            leaves.append(jax.tree.leaves(out))
        if self._outputs is not None:
            return tuple(leaves[k][j] for k, j in self._outputs)
        return tuple(results)

    def compile(self) -> Any:
        """The replay program compiled for the kernel mode in force (a ``jax.stages.Compiled``:
        ``.as_text()`` shows the optimized HLO). Compiled at the first call per kernel mode
        and kept; :func:`launch` calls it."""
        if self._capturing:
            raise RuntimeError(
                "ts.graph: the graph is still being captured; compile or launch it after its "
                "`with ts.graph.capture()` block"
            )
        mode = get_kernel_mode()
        exe = self._compiled.get(mode)
        if exe is None:
            specs = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                for a in self._inputs.values()
            ]
            devices = {d for a in self._inputs.values() for d in a.sharding.device_set}
            platforms = {d.platform for d in devices} or {jax.default_backend()}
            self.compiler_options = (
                command_buffer_options(self._command_buffer) if platforms == {"gpu"} else {}
            )
            lowered = jax.jit(self._program).lower(*specs)
            exe = lowered.compile(compiler_options=self.compiler_options or None)
            self._compiled[mode] = exe
        return exe


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    recorder = _core.CAPTURE.recorder
    _core.CAPTURE.recorder = None
    try:
        yield
    finally:
        _core.CAPTURE.recorder = recorder


def _live_arrays() -> list[jax.Array]:
    """Every live array of the backends in use (the candidate graph inputs)."""
    platforms = {d.platform for d in jax.devices()} | {"cpu"}
    out: list[jax.Array] = []
    for p in sorted(platforms):
        out.extend(jax.live_arrays(p))
    return out


@contextlib.contextmanager
def capture(*, command_buffer: bool = True, **inputs: jax.Array) -> Iterator[CapturedGraph]:
    """Records the ts operators and kernel launches executed eagerly in the block.

    ``with ts.graph.capture() as g:`` runs the block as usual (every operator computes its
    real result) and records each eager ts operator call (and each :func:`record_call`)
    into ``g``; ``ts.graph.launch(g, **new_inputs)`` replays the sequence as one compiled
    program.

    **Arguments:**

    - ``command_buffer``: on GPUs, compile the replay with XLA's command buffers on
      (``True``: its kernels are launched as CUDA graphs) or off (``False``). See
      :func:`command_buffer_options`.
    - ``**inputs``: names for arrays the block reads (``capture(x=x, w=w)``), to replace
      them by those names at launch. Unnamed inputs are called ``in0``, ``in1``, …

    Every operand of a recorded step must be an array alive when the block began (a graph
    input) or the result of an earlier recorded step; an array computed in the block by
    anything else (``jax.numpy``, a jitted function) raises a ValueError naming the
    operator it fed. Calls under a trace (inside ``jax.jit``, ``grad``, ``vmap``) run but
    are not recorded; a capture cannot begin under a trace.
    """
    if not isinstance(command_buffer, (bool, np.bool_)):
        raise TypeError(f"ts.graph.capture: {command_buffer=!r} must be a bool")
    for name, a in inputs.items():
        if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer):
            raise TypeError(
                f"ts.graph.capture: input {name}={type(a).__name__} must be a jax array "
                "(a named graph input is an array the block reads)"
            )
    if not _compat.is_eager():
        raise RuntimeError(
            "ts.graph.capture: cannot capture under a trace (inside jax.jit, grad or vmap): "
            "operators there are already part of one compiled program; capture eagerly, "
            "outside any transformation"
        )
    if getattr(_STATE, "graph", None) is not None:
        raise RuntimeError(
            "ts.graph.capture: a capture is already running on this thread (captures do not nest)"
        )
    g = CapturedGraph(inputs, bool(command_buffer))
    g._begin()
    _STATE.graph = g
    _core.CAPTURE.recorder = g._record_operator
    ok = False
    try:
        yield g
        ok = True
    finally:
        _core.CAPTURE.recorder = None
        _STATE.graph = None
        g._end(check_names=ok)


def record_call(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn(*args, **kwargs)``; inside a capture block, also records it as one step.

    The hook through which a kernel launch that is not a ts operator (the tile language's
    ``ts.launch.grid(...)``, a hand-written ``pallas_call``) becomes part of a captured
    graph: the launcher calls ``record_call(kernel_name, run, *operands)`` instead of
    ``run(*operands)``. Outside a capture, or under a trace, it is exactly that call.

    The jax arrays among ``args``/``kwargs`` (pytree leaves) are the step's operands and
    follow the capture's rules (graph inputs or earlier results); other leaves (ints,
    configs) are fixed at capture. ``fn`` must compute its result from those arguments
    only and be traceable by ``jax.jit``: the replay traces it. Operators ``fn`` binds are
    part of this step, not steps of their own.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"ts.graph.record_call: {name=!r} must be a non-empty string")
    if not callable(fn):
        raise TypeError(f"ts.graph.record_call: fn={fn!r} must be callable")
    g = getattr(_STATE, "graph", None)
    if g is None or _core.CAPTURE.recorder is None or not _compat.is_eager():
        return fn(*args, **kwargs)
    leaves, tree = jax.tree.flatten((args, kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, (jax.Array, np.ndarray))]

    def step(*operands: Any) -> Any:
        full = list(leaves)
        for i, v in zip(where, operands):
            full[i] = v
        a, k = jax.tree.unflatten(tree, full)
        return fn(*a, **k)

    return g._record(name, step, [leaves[i] for i in where])


def launch(graph: CapturedGraph, /, **new_inputs: Any) -> tuple[Any, ...]:
    """Replays a captured graph as one compiled program; returns every step's result.

    The program is compiled at the first launch (per kernel mode) and called directly by
    every later one: no retrace, no recompile (``graph.trace_count`` stays 1).

    **Arguments:**

    - ``graph``: from ``with ts.graph.capture() as graph:``.
    - ``**new_inputs``: replacements for inputs, by their names in ``graph.inputs``, each
      with the captured array's shape and dtype (a NumPy array or a jax array; placed
      like the captured one). Inputs not given keep their captured values.

    **Returns:** a tuple with one entry per recorded step, in capture order: the result
    of that operator (a list for operators with several results) or kernel launch; or
    the results chosen by ``graph.set_outputs(...)``.
    """
    if not isinstance(graph, CapturedGraph):
        raise TypeError(
            f"ts.graph.launch: graph={type(graph).__name__} must be a CapturedGraph from "
            "`with ts.graph.capture() as graph:`"
        )
    if not _compat.is_eager():
        raise RuntimeError(
            "ts.graph.launch: cannot launch a graph under a trace (inside jax.jit, grad or "
            "vmap), where its captured inputs would become constants; call the operators "
            "themselves there, or launch the graph eagerly"
        )
    if graph._capturing:
        raise RuntimeError(
            "ts.graph.launch: the graph is still being captured; launch it after its "
            "`with ts.graph.capture()` block"
        )
    if not graph._steps:
        raise ValueError(
            "ts.graph.launch: the graph is empty (its capture block ran no ts operator "
            "eagerly), so there is nothing to replay"
        )
    names = list(graph._inputs)
    unknown = [n for n in new_inputs if n not in graph._inputs]
    if unknown:
        raise ValueError(
            f"ts.graph.launch: unknown input name(s) {', '.join(map(repr, unknown))}; the "
            f"graph's inputs are {', '.join(names) or 'none'}"
        )
    args = []
    for name, captured in graph._inputs.items():
        if name in new_inputs:
            args.append(_replacement(name, captured, new_inputs[name]))
        elif captured.is_deleted():
            raise ValueError(
                f"ts.graph.launch: input {name!r} was deleted (or donated) after the capture, "
                f"so the graph has no value for it: pass {name}=<a {captured.dtype}"
                f"{list(captured.shape)} array>"
            )
        else:
            args.append(captured)
    return graph.compile()(*args)


def _replacement(name: str, captured: jax.Array, value: Any) -> jax.Array:
    """``value`` for input ``name``, checked against the captured array and placed like it."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"ts.graph.launch: input {name!r} is a tracer: launch a graph eagerly (inside a "
            "jitted function, call the operators themselves)"
        )
    if not isinstance(value, (jax.Array, np.ndarray, np.generic, int, float, complex)):
        raise TypeError(
            f"ts.graph.launch: input {name!r} is a {type(value).__name__}; expected an array"
        )
    shape, dtype = np.shape(value), _dtype(value)
    if isinstance(value, (int, float, complex)):
        dtype = captured.dtype  # a Python scalar takes the input's dtype, as in jax
    if shape != captured.shape or dtype != captured.dtype:
        raise ValueError(
            f"ts.graph.launch: input {name!r} must be {captured.dtype}{list(captured.shape)} "
            f"as captured, got {dtype}{list(shape)}"
        )
    if not isinstance(value, jax.Array):
        value = np.asarray(value, dtype)
    elif value.sharding == captured.sharding:
        return value
    return jax.device_put(value, captured.sharding)


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)
