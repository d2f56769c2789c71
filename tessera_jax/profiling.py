"""``ts.profile``: per-operator device time from the JAX profiler's trace, and a roofline.

How a row comes about:

1. ``fn`` is jit-compiled and warmed up; the compiled HLO says, for every instruction, the
   ts operator it was lowered from: each operator's lowering pushes its primitive name
   (``ts_matmul``) on jax's name stack, which XLA keeps as ``metadata.op_name``.
2. ``fn`` runs ``steps`` times under ``jax.profiler.trace``. The trace's device events
   (``args.hlo_op``: the instruction a kernel or CPU thunk executes) are summed per
   instruction, as exclusive time (a ``while`` loop's own time excludes its body's
   kernels), and per step (each step's events fall inside a host annotation).
3. A kernel's time goes to the ts operator its HLO ops come from. Where XLA fused ops of
   several operators into one kernel (an activation into the product before it), the
   kernel goes to the operator of its product (or library call), else of its root, and
   the row lists the others (``Row.fused``); an operator none of whose ops kept a kernel
   has no row (``Profile.unattributed``). A kernel whose root is no ts op is an ``(xla)``
   row named after its jax primitive (``(xla) add``), and the device's idle time inside
   a step is the ``(idle)`` row. The rows therefore add up to the measured device time of
   a step (less the time kernels overlapped, which the summary reports).
4. Below the rows, ``Profile.kernels`` keeps each instruction's own time
   (:meth:`Profile.kernel_table`): an operator lowered to several kernels (a backward's
   passes, the glue between them) shows each of them.

FLOPs and bytes of a ts row come from its operators' shapes (the formulas in
:func:`operator_cost`, summed over every bind of the operators in the traced program):
bytes are each operator's operands and results, read or written once (the traffic of the
unfused operator). ``(xla)`` rows have none; the program's totals come from XLA's cost
analysis. Achieved rates are shown against the device's peaks (:data:`PEAKS`, or measured
on the CPU, which has no published peak).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gzip
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.primitives._core import OPERATORS
from tessera_jax.primitives.collectives import primitives as _collectives

__all__ = ["PEAKS", "Kernel", "Peaks", "Profile", "Row", "operator_cost", "profile"]


# --- device peaks -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Peaks:
    """What a device can do at most: dense FLOP/s by operand dtype and memory bytes/s.

    Attributes:
      name: the device, as shown in the table.
      flops_per_s: peak FLOP/s by dtype name (``"bfloat16"``, ``"float32"``, …); a row
        whose dtype is missing shows no FLOP/s fraction.
      bytes_per_s: peak memory bandwidth.
      source: where the numbers come from (a datasheet, or how they were measured).
    """

    name: str
    flops_per_s: dict[str, float]
    bytes_per_s: float
    source: str

    def flops_for(self, dtype: str | None) -> float | None:
        return self.flops_per_s.get(dtype) if dtype is not None else None


def _hopper(name: str, tensor_16: float, fp32: float, hbm: float, source: str) -> Peaks:
    """Hopper peaks: bf16/f16 tensor-core dense, fp8 twice that, f32 on the CUDA cores
    (an f32 product at ``highest`` precision does not use TF32)."""
    return Peaks(
        name,
        {
            "bfloat16": tensor_16,
            "float16": tensor_16,
            "float8_e4m3fn": 2 * tensor_16,
            "float8_e5m2": 2 * tensor_16,
            "float32": fp32,
        },
        hbm,
        source,
    )


_DATASHEET = "NVIDIA {} datasheet (dense, no sparsity)"

# Peaks by device kind: the first key contained in ``jax.Device.device_kind`` wins.
PEAKS: dict[str, Peaks] = {
    "H200": _hopper("H200 SXM", 989.4e12, 66.9e12, 4.8e12, _DATASHEET.format("H200")),
    "H100 PCIe": _hopper("H100 PCIe", 756.0e12, 51.2e12, 2.0e12, _DATASHEET.format("H100")),
    "H100": _hopper("H100 SXM", 989.4e12, 66.9e12, 3.35e12, _DATASHEET.format("H100")),
}


def device_peaks(device: jax.Device) -> Peaks:
    """The peaks of ``device``: from :data:`PEAKS` by device kind; on a CPU (no published
    peak for an unknown CPU) the rates this process measures (:func:`measured_cpu_peaks`).
    A ValueError for a GPU kind not in the table (pass ``peaks=`` to ``profile``)."""
    for key, peaks in PEAKS.items():
        if key in device.device_kind:
            return peaks
    if device.platform == "cpu":
        return measured_cpu_peaks()
    raise ValueError(
        f"profile: no peaks known for device_kind={device.device_kind!r} (known: "
        f"{sorted(PEAKS)}); pass peaks=ts.profiling.Peaks(...)"
    )


@functools.cache
def measured_cpu_peaks() -> Peaks:
    """This CPU's attainable f32 FLOP/s and bandwidth, measured once per process: the best
    of ten runs of a 512³ f32 product and of ``x + 1`` over 32 MiB (read and written).
    Attainable rates through XLA, not the hardware's nominal peaks."""
    cpu = jax.devices("cpu")[0]
    n = 512
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    big = jax.device_put(jnp.ones((8 << 20,), jnp.float32), cpu)
    dot = jax.jit(lambda x: jnp.dot(x, x, precision="highest")).lower(a).compile()
    inc = jax.jit(lambda x: x + 1.0).lower(big).compile()
    t_dot = _best_time(lambda: dot(a), 10)
    t_inc = _best_time(lambda: inc(big), 10)
    return Peaks(
        "CPU",
        {"float32": 2 * n**3 / t_dot},
        2 * big.nbytes / t_inc,
        "measured: f32 512³ jnp.dot and x+1 over 32 MiB (attainable, not nominal)",
    )


def _best_time(run: Callable[[], jax.Array], repeats: int) -> float:
    run().block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        run().block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


# --- operator FLOPs and bytes ---------------------------------------------------------------

# Nominal FLOPs per element of the operators that are not products (a transcendental
# counts as one): a convention, shown so that the FLOP/s of such rows can be compared.
_PER_ELEMENT = {
    "ts_sum": 1,
    "ts_max": 1,
    "ts_mse": 3,  # difference, square, sum
    "ts_softmax": 5,  # max, subtract, exp, sum, divide
    "ts_log_softmax": 5,
    "ts_softmax_bwd": 4,
    "ts_log_softmax_tangent": 4,
    "ts_log_softmax_bwd": 4,
    "ts_rmsnorm": 4,  # square, sum, scale by rsqrt, gain
    "ts_layernorm": 7,  # mean, subtract, square, sum, scale, gain, bias
    "ts_rmsnorm_tangent": 8,
    "ts_layernorm_tangent": 14,
    "ts_rmsnorm_bwd": 8,
    "ts_layernorm_bwd": 14,
}
_ELEMENTWISE = {"relu", "tanh", "exp", "sqrt", "abs", "round", "gelu", "cast", "stochastic_cast"}
_COLLECTIVES = {
    p.name
    for p in (
        _collectives.all_reduce_p,
        _collectives.reduce_scatter_p,
        _collectives.all_gather_p,
        _collectives.scatter_p,
        _collectives.all_to_all_p,
        _collectives.replicate_p,
    )
}


def _ts_names() -> frozenset[str]:
    """Every ts primitive name (the labels the lowerings push on the name stack)."""
    return frozenset({op.prim.name for op in OPERATORS.values()} | _COLLECTIVES)


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _size(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def operator_cost(name: str, avals_in: Sequence[Any], avals_out: Sequence[Any], params: dict):
    """``(flops, bytes)`` of one bind of the ts primitive ``name``; ``flops`` is None for
    an operator with no formula here.

    * ``ts_matmul`` and its two-output form ``ts_matmul_with_derivative``: ``2·M·N·K`` per
      batch element (the epilogue is not counted).
    * flash attention forward: ``2·B·H·Sq·Skv·(D + Dv)`` (``q·kᵀ`` and ``p·v``), backward
      ``2·B·H·Sq·Skv·(3·D + 2·Dv)`` (``q·kᵀ`` recomputed, ``dv``, ``dp``, ``dq``, ``dk``);
      halved when causal (a local window or masks are not accounted for).
    * ``ts_fft``: ``5·n·log2(n)`` per transform of length ``n``.
    * elementwise operators: one per element; reductions, norms, softmax: the nominal
      per-element counts of ``_PER_ELEMENT``.

    Bytes: every operand and result, read or written once; for a collective, its payload
    (the operand: bytes over bytes per second is the algorithm bandwidth), and no FLOPs.
    """
    nbytes = sum(map(_nbytes, avals_in)) + sum(map(_nbytes, avals_out))
    spec = params.get("spec")
    if name in ("ts_matmul", "ts_matmul_with_derivative"):
        a = avals_in[0]
        k = a.shape[-2] if spec.transpose_a else a.shape[-1]
        return 2 * _size(avals_out[0]) * k, nbytes
    if name in ("ts_flash_attention_fwd", "ts_flash_attention_bwd"):
        q, k, v = avals_in[:3]
        b, sq, h, d = q.shape
        skv, dv = k.shape[1], v.shape[-1]
        per = (d + dv) if name.endswith("fwd") else (3 * d + 2 * dv)
        flops = 2 * b * h * sq * skv * per
        return (flops // 2 if spec.causal else flops), nbytes
    if name == "ts_fft":
        n = avals_in[0].shape[params["axis"]]
        return int(5 * _size(avals_in[0]) * math.log2(max(n, 2))), nbytes
    if name[len("ts_") :] in _ELEMENTWISE:
        return _size(avals_out[0]), nbytes
    if name in _PER_ELEMENT:
        return _PER_ELEMENT[name] * _size(avals_in[0]), nbytes
    if name in _COLLECTIVES:
        return None, sum(map(_nbytes, avals_in))
    return None, nbytes


@dataclasses.dataclass
class _OpCost:
    """What the traced program asks of one ts primitive, over all its binds."""

    binds: int = 0
    flops: float | None = 0.0
    bytes: float | None = 0.0
    dtypes: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _subjaxprs(params: dict) -> Iterable[tuple[str, Any]]:
    for key, value in params.items():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                yield key, v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield key, v.jaxpr


def _program_costs(jaxpr: Any, ts_names: frozenset[str], num_devices: int) -> dict:
    """``{primitive name: _OpCost}`` of the ts binds in ``jaxpr`` and the jaxprs under it.

    A scan body counts ``length`` times; a bind under a ``while_loop`` (unknown trip count)
    or a ``cond`` (one branch of several runs) makes its operator's FLOPs and bytes
    unknown. Binds outside ``shard_map`` see global
    shapes, which the devices share: counted per device as ``1/num_devices`` of the work
    (an even split); inside ``shard_map`` the shapes are already per device.
    """
    costs: dict[str, _OpCost] = collections.defaultdict(_OpCost)

    def visit(jx: Any, times: float, local: bool, known: bool) -> None:
        for eqn in jx.eqns:
            name = eqn.primitive.name
            if name in ts_names:
                cost = costs[name]
                cost.binds += 1
                avals_in = [v.aval for v in eqn.invars]
                avals_out = [v.aval for v in eqn.outvars]
                flops, nbytes = operator_cost(name, avals_in, avals_out, eqn.params)
                share = times / (1 if local else num_devices)
                if cost.flops is not None:
                    cost.flops = None if flops is None or not known else cost.flops + flops * share
                if cost.bytes is not None:
                    cost.bytes = None if not known else cost.bytes + nbytes * share
                if avals_in:
                    cost.dtypes[str(np.dtype(avals_in[0].dtype))] += 1
                continue
            for key, sub in _subjaxprs(eqn.params):
                t = times * eqn.params["length"] if name == "scan" and key == "jaxpr" else times
                visit(sub, t, local or name == "shard_map", known and name not in ("while", "cond"))

    visit(jaxpr, 1, False, True)
    return dict(costs)


# --- the compiled HLO: which instruction belongs to which operator -----------------------

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^(\([^=]*\)|[\w\[\]{},:.\- ]*?)\s+([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FUSED_CALLS = re.compile(r"\b(?:calls|to_apply|called_computations)=\{?([%\w.\-, ]+)\}?")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:_[a-z0-9]+)*)\[([0-9,]*)\]")
_COLLECTIVE_OPCODES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)
_HLO_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2}
_HLO_DTYPE_BYTES.update({"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8})
_HLO_DTYPE_BYTES.update({"c64": 8, "c128": 16})


# Instructions whose owner a kernel is attributed to before any other's: the products and
# library calls that dominate a kernel they share with an operator's elementwise ops.
_HEAVY_OPCODES = ("dot", "convolution", "custom-call", "fft", "sort", "scatter")


@dataclasses.dataclass(frozen=True)
class _Instruction:
    owner: str | None  # the ts primitive the kernel is attributed to (None: no ts op)
    others: frozenset[str]  # the other ts primitives whose ops the kernel also runs
    label: str  # the jax primitive (from op_name) or the HLO name: for (xla) rows
    opcode: str
    result_bytes: int


@dataclasses.dataclass
class _Computation:
    ops: list[tuple[str | None, str]] = dataclasses.field(default_factory=list)  # owner, opcode
    root: tuple[str | None, str] | None = None


def _outermost_ts(op_name: str, ts_names: frozenset[str]) -> str | None:
    """The first ts primitive on an op_name's name stack (a ts operator's reference may
    bind other ts operators: the user called the outer one)."""
    for part in op_name.split("/"):
        if part in ts_names:
            return part
    return None


def _result_bytes(rhs: str, opcode: str) -> int:
    shape = rhs.split(f" {opcode}(", 1)[0]
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
        total += n * _HLO_DTYPE_BYTES.get(dtype, 0)
    return total


def _attribute(
    own: tuple[str | None] | None, called: list[_Computation]
) -> tuple[str | None, frozenset]:
    """The ts primitive a kernel is attributed to (None: XLA's own), and the other ts
    primitives whose ops it runs.

    XLA fuses ops of several operators into one kernel (an activation into the product
    before it; a softmax recomputing the elementwise op feeding it; a reshape into the
    user's slice). The kernel goes to the owner of its first product or library call,
    else to the op its own metadata names (XLA gives a fusion its root's), else to its
    fused root's owner. ``own`` is ``(owner,)`` where the instruction has metadata.
    """
    ops = [op for c in called for op in c.ops]
    owners = {o for o, _ in ops if o is not None} | ({own[0]} if own and own[0] else set())
    heavy = [o for o, code in ops if o is not None and code in _HEAVY_OPCODES]
    roots = [c.root for c in called if c.root is not None]
    if heavy:
        first = heavy[0]
    elif own is not None:
        first = own[0]
    elif roots:
        first = roots[0][0]
    else:
        first = None
    return first, frozenset(owners - {first})


def _hlo_instructions(hlo_text: str, ts_names: frozenset[str]) -> dict[str, _Instruction]:
    """Every instruction of an HLO module's text, by name.

    HLO text lists a computation after the computations it calls, so a fusion's fused
    ops are known when the fusion is read. Control flow (``while`` bodies, conditional
    branches) is not looked into: the profiler sees their kernels by their own names.
    """
    instructions: dict[str, _Instruction] = {}
    computations: dict[str, _Computation] = {}
    current: _Computation | None = None
    current_name = ""
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("(", 1)[0]:
                current, current_name = _Computation(), m.group(2)
            continue
        if line.strip() == "}":
            computations[current_name] = current
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, rhs = m.groups()
        op = _OPCODE.match(rhs)
        opcode = op.group(2) if op else ""
        op_name = _OP_NAME.search(rhs)
        own = None
        if op_name and opcode not in ("parameter", "constant"):
            own = (_outermost_ts(op_name.group(1), ts_names),)
        called = [
            computations[c.strip().lstrip("%")]
            for group in _FUSED_CALLS.findall(rhs)
            for c in group.split(",")
            if c.strip().lstrip("%") in computations
        ]
        owner, others = _attribute(own, called)
        if opcode not in ("parameter", "constant"):
            current.ops.append((owner, opcode))
            if line.lstrip().startswith("ROOT"):
                current.root = (owner, opcode)
        label = op_name.group(1).rsplit("/", 1)[-1] if op_name else re.sub(r"\.\d+$", "", name)
        instructions[name] = instructions[_normalized(name)] = _Instruction(
            owner=owner,
            others=others,
            label=label,
            opcode=opcode,
            result_bytes=_result_bytes(rhs, opcode)
            if opcode.startswith(_COLLECTIVE_OPCODES)
            else 0,
        )
    return instructions


# --- the trace ------------------------------------------------------------------------------


def _load_trace(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _find_trace(run_dir: str) -> tuple[str, str | None]:
    """The TensorBoard trace (``*.trace.json.gz``) of the newest profile under ``run_dir``,
    and the Perfetto one (``perfetto_trace.json.gz``) if written."""
    root = os.path.join(run_dir, "plugins", "profile")
    runs = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for run in reversed(runs):
        files = sorted(os.listdir(os.path.join(root, run)))
        tb = [f for f in files if f.endswith(".trace.json.gz")]
        pf = [f for f in files if f == "perfetto_trace.json.gz"]
        if tb or pf:
            tb_path = os.path.join(root, run, (tb or pf)[0])
            return tb_path, os.path.join(root, run, pf[0]) if pf else None
    raise RuntimeError(f"profile: the JAX profiler wrote no trace under {root!r}")


def _device_events(events: list[dict], module: str) -> list[dict]:
    """The complete events of ``module``'s instructions on one device: the first device
    process (``/device:…``) that has any, else (the CPU, whose thunks run on host threads)
    the host's events of the lowest device ordinal."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    ops = [
        e
        for e in events
        if e.get("ph") == "X"
        and isinstance(e.get("args"), dict)
        and "hlo_op" in e["args"]
        and e["args"].get("hlo_module") == module
    ]
    on_device = [e for e in ops if procs.get(e["pid"], "").startswith("/device:")]
    if on_device:
        first = min({e["pid"] for e in on_device}, key=lambda p: procs[p])
        return [e for e in on_device if e["pid"] == first]
    ordinals = {e["args"].get("device_ordinal", "0") for e in ops}
    first_ordinal = min(ordinals, key=int) if ordinals else "0"
    return [e for e in ops if e["args"].get("device_ordinal", "0") == first_ordinal]


def _exclusive(events: list[dict]) -> list[tuple[dict, float]]:
    """``(event, exclusive µs)``: an event's duration less that of the events nested in it
    on the same thread (a while loop's thunk contains its body's)."""
    out = []
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, exclusive]
        for e in evs:
            end = e["ts"] + e["dur"]
            # Nested only if it ends inside: consecutive GPU kernels may overlap by a few
            # hundred nanoseconds, which is not nesting.
            while stack and (stack[-1][1] <= e["ts"] or end > stack[-1][1]):
                out.append(tuple(stack.pop()[::2]))
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e, end, e["dur"]])
        out.extend(tuple(s[::2]) for s in stack)
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


# --- the result ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the table: per step, averaged over the profiled steps.

    Attributes:
      name: ``ts_matmul``; ``ts_matmul+ts_gelu`` for operators XLA fused into common
        kernels; ``(xla) add`` for kernels of no ts operator; ``(idle)``.
      kind: ``"operator"``, ``"collective"``, ``"xla"`` or ``"idle"``.
      time_s: device time per step.
      kernels: kernel (or CPU thunk) executions per step.
      flops, bytes: per step and device (None where unknown: see the module docstring).
      dtype: the dtype of the operators' first operands (which peak FLOP/s applies).
      peak_flops_per_s: that peak (None where the table has none for the dtype).
      peak_bytes_per_s: the device's memory bandwidth (None for a collective, whose link
        has a bandwidth of its own).
      fused: other ts operators whose ops XLA fused into this row's kernels (their time
        is this row's; their FLOPs and bytes are not).
    """

    name: str
    kind: str
    time_s: float
    kernels: float
    flops: float | None = None
    bytes: float | None = None
    dtype: str | None = None
    peak_flops_per_s: float | None = None
    peak_bytes_per_s: float | None = None
    fused: tuple[str, ...] = ()

    @property
    def flops_per_s(self) -> float | None:
        return self.flops / self.time_s if self.flops is not None and self.time_s > 0 else None

    @property
    def bytes_per_s(self) -> float | None:
        return self.bytes / self.time_s if self.bytes is not None and self.time_s > 0 else None

    @property
    def intensity(self) -> float | None:
        """FLOPs per byte (the roofline's x axis)."""
        return self.flops / self.bytes if self.flops and self.bytes else None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One instruction of the profiled program: its kernel's (or CPU thunk's) executions,
    per step, averaged over the profiled steps.

    Attributes:
      name: the HLO instruction (``fusion.3``; a Pallas kernel's custom call).
      launched: what the trace names the executed kernel (``anonymous_mosaic_gpu_kernel``,
        a fusion's kernel, a CPU thunk).
      row: the :class:`Row` its time is counted in (a ts operator, an ``(xla)`` row).
      time_s: device time per step (exclusive of events nested in it).
      calls: executions per step.
    """

    name: str
    launched: str
    row: str
    time_s: float
    calls: float


@dataclasses.dataclass(frozen=True)
class Profile:
    """What :func:`profile` measured; ``str()`` is the table.

    Attributes:
      rows: the operators, the ``(xla)`` kernels and ``(idle)``, largest time first (idle
        last). ``sum(r.time_s) - overlap_s == device_s``.
      device_s: device time per step: first kernel start to last kernel end.
      overlap_s: time per step during which kernels ran concurrently (counted in two rows).
      host_s: wall-clock time per step seen by the host (dispatch, wait included).
      steps: profiled steps (after the warm-up).
      collective_s, collective_bytes: per step, over the collective rows; their ratio is
        the algorithm bandwidth (payload bytes per second).
      xla_flops, xla_bytes: per step, from XLA's cost analysis of the whole program.
      peaks: the device's peaks the fractions refer to.
      device: the device profiled (its kind).
      trace_path: the TensorBoard/Perfetto trace (``*.trace.json.gz``).
      perfetto_path: the Perfetto trace (``perfetto_trace.json.gz``), if written.
      plot_path: the roofline PNG, if ``plot=`` was given.
      unattributed: ts operators of the program with no kernel of their own: XLA fused
        all their ops into other operators' kernels (see ``Row.fused``) or removed them.
      kernels: the rows' kernels, one per instruction, largest time first
        (:meth:`kernel_table`); a row's time is the sum of its kernels'.
    """

    rows: tuple[Row, ...]
    device_s: float
    overlap_s: float
    host_s: float
    steps: int
    collective_s: float
    collective_bytes: float | None
    xla_flops: float | None
    xla_bytes: float | None
    peaks: Peaks
    device: str
    trace_path: str
    perfetto_path: str | None
    plot_path: str | None = None
    unattributed: tuple[str, ...] = ()
    kernels: tuple[Kernel, ...] = ()

    def row(self, name: str) -> Row:
        """The row named ``name`` (a KeyError listing the names if none is)."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"Profile.row: no row {name!r}; rows: {[r.name for r in self.rows]}")

    def kernel_table(self, top: int | None = None) -> str:
        """The kernels (:attr:`kernels`), ``top`` largest (all if None): per step, the
        time, its share of the device time, the executions, the row and the kernel."""
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
            raise ValueError(f"Profile.kernel_table: top={top!r} must be an int >= 1 or None")
        head = f"{'time µs':>10} {'%':>5} {'calls':>5}  {'row':<28} {'instruction':<28} kernel"
        lines = [head, "-" * len(head)]
        for k in self.kernels[:top]:
            share = 100 * k.time_s / self.device_s if self.device_s else 0.0
            lines.append(
                f"{k.time_s * 1e6:>10.2f} {share:>5.1f} {k.calls:>5.0f}  {k.row[:28]:<28} "
                f"{k.name[:28]:<28} {k.launched}"
            )
        left = len(self.kernels) - len(self.kernels[:top])
        if left:
            rest = sum(k.time_s for k in self.kernels[top:])
            lines.append(f"{rest * 1e6:>10.2f}  and {left} more kernels")
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (
            f"{'operator':<28} {'kernels':>7} {'time µs':>10} {'%':>5} {'GFLOP':>9} "
            f"{'MB':>9} {'TFLOP/s':>8} {'%peak':>6} {'GB/s':>8} {'%peak':>6}"
        )
        lines = [
            f"ts.profile on {self.device} ({self.steps} steps; per step and device)",
            head,
            "-" * len(head),
        ]
        for r in self.rows:
            name = f"{r.name}*" if r.fused else r.name
            lines.append(
                f"{name[:28]:<28} {r.kernels:>7.0f} {r.time_s * 1e6:>10.1f} "
                f"{100 * r.time_s / self.device_s if self.device_s else 0:>5.1f} "
                f"{_fmt(r.flops, 1e-9, 9, 3)} {_fmt(r.bytes, 1e-6, 9, 3)} "
                f"{_fmt(r.flops_per_s, 1e-12, 8, 3)} "
                f"{_fmt(_frac(r.flops_per_s, r.peak_flops_per_s), 100, 6, 1)} "
                f"{_fmt(r.bytes_per_s, 1e-9, 8, 1)} "
                f"{_fmt(_frac(r.bytes_per_s, r.peak_bytes_per_s), 100, 6, 1)}"
            )
        lines.append("-" * len(head))
        lines.append(
            f"{'device time':<28} {'':>7} {self.device_s * 1e6:>10.1f}  (host step "
            f"{self.host_s * 1e6:.1f} µs; kernels overlapped {self.overlap_s * 1e6:.1f} µs)"
        )
        for r in self.rows:
            if r.fused:
                lines.append(f"* {r.name}'s kernels also run ops of {', '.join(r.fused)}")
        if self.unattributed:
            lines.append(
                f"no kernel of their own (fused or removed): {', '.join(self.unattributed)}"
            )
        ts_flops = [r.flops for r in self.rows if r.kind == "operator" and r.flops is not None]
        if ts_flops and self.device_s:
            lines.append(
                f"ts operators (formulas): {sum(ts_flops) / 1e9:.4g} GFLOP, "
                f"{sum(ts_flops) / self.device_s / 1e12:.4g} TFLOP/s over the device time"
            )
        if self.xla_flops is not None:
            rate = self.xla_flops / self.device_s if self.device_s else 0.0
            lines.append(
                f"program (XLA cost analysis; custom calls such as cuBLAS or Pallas kernels "
                f"count 0): {self.xla_flops / 1e9:.4g} GFLOP, "
                f"{(self.xla_bytes or 0) / 1e6:.4g} MB accessed, {rate / 1e12:.4g} TFLOP/s"
            )
        if self.collective_s > 0:
            bw = (
                f", {self.collective_bytes / self.collective_s / 1e9:.2f} GB/s algorithm bandwidth"
                if self.collective_bytes
                else ""
            )
            lines.append(f"collectives: {self.collective_s * 1e6:.1f} µs{bw}")
        peak = ", ".join(f"{k} {v / 1e12:.1f}" for k, v in self.peaks.flops_per_s.items())
        lines.append(
            f"peaks ({self.peaks.name}; {self.peaks.source}): TFLOP/s {peak}; "
            f"{self.peaks.bytes_per_s / 1e9:.0f} GB/s"
        )
        lines.append(
            "FLOPs/bytes of ts rows: operator formulas (tessera_jax.profiling.operator_cost)"
        )
        lines.append(f"trace: {self.trace_path}")
        if self.plot_path:
            lines.append(f"roofline: {self.plot_path}")
        return "\n".join(lines)


def _frac(value: float | None, peak: float | None) -> float | None:
    return value / peak if value is not None and peak else None


def _fmt(value: float | None, scale: float, width: int, digits: int) -> str:
    """``value · scale`` in ``width`` columns: ``digits`` decimals, or significant digits
    where fixed decimals would show a small value as zero."""
    if value is None:
        return f"{'–':>{width}}"
    v = value * scale
    if v != 0 and abs(v) < 10 ** (1 - digits):
        return f"{v:>{width}.{digits}g}"
    return f"{v:>{width}.{digits}f}"


# --- the profiler ----------------------------------------------------------------------------


def profile(
    fn: Callable[..., Any],
    *args: Any,
    steps: int = 5,
    warmup: int = 1,
    plot: str | os.PathLike | None = None,
    trace_dir: str | os.PathLike | None = None,
    peaks: Peaks | None = None,
) -> Profile:
    """Runs ``fn(*args)`` under the JAX profiler and reports device time per ts operator.

    Arguments:
      fn: the function (jit-compiled here if it is not already a ``jax.jit`` function).
        Keyword arguments of ``fn``: bind them with ``functools.partial``.
      args: its arguments (arrays, pytrees).
      steps: profiled runs; the table is their per-step average.
      warmup: runs before profiling (the first run compiles nothing: ``fn`` is compiled
        before, but caches and allocators warm up).
      plot: where to save the roofline (PNG, needs matplotlib: ``pip install
        tessera_jax[profile]``); its directory must exist.
      trace_dir: where the profiler writes its trace (a new temporary directory if None);
        the trace is kept, its path is ``Profile.trace_path``.
      peaks: the device's peaks, overriding :data:`PEAKS` (and the CPU measurement).

    Returns:
      A :class:`Profile`; ``print(ts.profile(fn, x))`` prints the table.
    """
    if not callable(fn):
        raise TypeError(f"profile: fn={fn!r} must be callable (got {type(fn).__name__})")
    for arg, value, low in (("steps", steps, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"profile: {arg}={value!r} must be an int >= {low}")
    if plot is not None:
        plot = os.fspath(plot)
        folder = os.path.dirname(os.path.abspath(plot))
        if not os.path.isdir(folder):
            raise ValueError(f"profile: plot={plot!r}: the directory {folder!r} does not exist")
        _pyplot()  # a missing matplotlib fails before anything runs
    if peaks is not None and not isinstance(peaks, Peaks):
        raise TypeError(f"profile: peaks={peaks!r} must be a ts.profiling.Peaks or None")
    trace_dir = (
        tempfile.mkdtemp(prefix="ts_profile_") if trace_dir is None else os.fspath(trace_dir)
    )

    jitted = fn if hasattr(fn, "trace") and hasattr(fn, "lower") else jax.jit(fn)
    traced = jitted.trace(*args)
    # On GPUs XLA records a step's kernels as CUDA graphs (command buffers), whose trace
    # events all name the graph, not the instruction: profiled without them, as jax's
    # own profile-guided compilation does (each kernel then pays its own launch).
    platform = _platform_of(args)
    options = {"xla_gpu_enable_command_buffer": ""} if platform == "gpu" else None
    compiled = traced.lower().compile(options)
    hlo_text = compiled.as_text()
    module = re.search(r"HloModule\s+([\w.\-]+)", hlo_text).group(1)
    devices = _executable_devices(compiled)
    device = devices[0]
    peaks = peaks if peaks is not None else device_peaks(device)
    ts_names = _ts_names()
    costs = _program_costs(traced.jaxpr.jaxpr, ts_names, len(devices))
    instructions = _hlo_instructions(hlo_text, ts_names)
    xla_flops, xla_bytes = _xla_cost(compiled)

    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    host = []
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i in range(steps):
            t0 = time.perf_counter()
            with jax.profiler.TraceAnnotation(f"ts.profile step {i}"):
                jax.block_until_ready(compiled(*args))
            host.append(time.perf_counter() - t0)
    trace_path, perfetto_path = _find_trace(trace_dir)
    events = _load_trace(trace_path)

    result = _tabulate(
        events, module, instructions, costs, peaks, steps, _step_windows(events, steps)
    )
    result = dataclasses.replace(
        result,
        host_s=sum(host) / steps,
        xla_flops=xla_flops,
        xla_bytes=xla_bytes,
        device=device.device_kind,
        trace_path=trace_path,
        perfetto_path=perfetto_path,
    )
    if plot is not None:
        _plot_roofline(result, plot)
        result = dataclasses.replace(result, plot_path=plot)
    return result


def _platform_of(args: Sequence[Any]) -> str:
    """The platform of the first array argument (where the program runs)."""
    for leaf in jax.tree.leaves(args):
        devices = getattr(leaf, "devices", None)
        if callable(devices):
            return next(iter(devices())).platform
    return jax.devices()[0].platform


def _executable_devices(compiled: Any) -> list[jax.Device]:
    """The devices the compiled program runs on, the first being the one reported."""
    shardings = jax.tree.leaves(compiled.input_shardings) + jax.tree.leaves(
        compiled.output_shardings
    )
    for s in shardings:
        devs = sorted(s.device_set, key=lambda d: d.id)
        if devs:
            return devs
    return [jax.devices()[0]]


def _xla_cost(compiled: Any) -> tuple[float | None, float | None]:
    """The program's FLOPs and bytes accessed from XLA's cost analysis (of one device's
    program, after partitioning), or None where the backend gives none."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends implement no cost analysis
        return None, None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost:
        return None, None
    flops = cost.get("flops")
    nbytes = cost.get("bytes accessed")
    return (float(flops) if flops is not None and flops >= 0 else None), (
        float(nbytes) if nbytes is not None and nbytes >= 0 else None
    )


def _step_windows(events: list[dict], steps: int) -> list[tuple[float, float]]:
    windows = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and name.startswith("ts.profile step "):
            windows[int(name.rsplit(" ", 1)[1])] = (e["ts"], e["ts"] + e["dur"])
    if len(windows) != steps:
        raise RuntimeError(
            f"profile: the trace has {len(windows)} of the {steps} step annotations; another "
            "profiler session may be running"
        )
    return [windows[i] for i in range(steps)]


def _tabulate(
    events: list[dict],
    module: str,
    instructions: dict[str, _Instruction],
    costs: dict[str, _OpCost],
    peaks: Peaks,
    steps: int,
    windows: list[tuple[float, float]],
) -> Profile:
    ops = _device_events(events, module)
    if not ops:
        raise RuntimeError(
            f"profile: the trace has no device events of the program {module!r}; this "
            "backend's profiler may not record per-kernel events"
        )
    time_us: dict[str, float] = collections.defaultdict(float)
    kernels: dict[str, int] = collections.defaultdict(int)
    kind: dict[str, str] = {}
    fused: dict[str, set[str]] = collections.defaultdict(set)
    coll_bytes: dict[str, int] = collections.defaultdict(int)
    # instruction -> [row, launched kernel, exclusive µs, executions]
    per_kernel: dict[str, list] = {}
    device_us, overlap_us = 0.0, 0.0
    in_steps = []
    for lo, hi in windows:
        step = [e for e in ops if lo <= e["ts"] <= hi]
        in_steps.extend(step)
        if step:
            span = max(e["ts"] + e["dur"] for e in step) - min(e["ts"] for e in step)
            busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in step])
            device_us += span
            time_us["(idle)"] += span - busy
            overlap_us += max(0.0, sum(x for _, x in _exclusive(step)) - busy)
    for e, exclusive in _exclusive(in_steps):
        inst = _lookup(instructions, e["args"]["hlo_op"])
        if inst.owner is not None:
            key = inst.owner
            kind[key] = "collective" if key in _COLLECTIVES else "operator"
            fused[key] |= inst.others
        else:
            is_coll = inst.opcode.startswith(_COLLECTIVE_OPCODES)
            key = f"(xla) {inst.opcode if is_coll else inst.label}"
            kind[key] = "collective" if is_coll else "xla"
            fused[key] |= inst.others
            if is_coll and not inst.opcode.endswith("-done"):
                coll_bytes[key] += inst.result_bytes
        time_us[key] += exclusive
        kernels[key] += 1
        entry = per_kernel.setdefault(e["args"]["hlo_op"], [key, e.get("name", ""), 0.0, 0])
        entry[2] += exclusive
        entry[3] += 1

    rows = []
    for key, t in time_us.items():
        if key == "(idle)":
            continue
        cost = costs.get(key)
        if cost is not None:
            flops, nbytes = cost.flops, cost.bytes
            dtype = cost.dtypes.most_common(1)[0][0] if cost.dtypes else None
        else:
            flops, dtype = None, None
            nbytes = coll_bytes[key] / steps if key in coll_bytes else None
        rows.append(
            Row(
                name=key,
                kind=kind[key],
                time_s=t / steps * 1e-6,
                kernels=kernels[key] / steps,
                flops=flops,
                bytes=nbytes,
                dtype=dtype,
                peak_flops_per_s=peaks.flops_for(dtype),
                # The table's bandwidth is memory's; a collective's link has its own.
                peak_bytes_per_s=None if kind[key] == "collective" else peaks.bytes_per_s,
                fused=tuple(sorted(fused.get(key, ()))),
            )
        )
    rows.sort(key=lambda r: -r.time_s)
    rows.append(Row("(idle)", "idle", time_us["(idle)"] / steps * 1e-6, 0))
    collective = [r for r in rows if r.kind == "collective"]
    coll_b = [r.bytes for r in collective]
    return Profile(
        rows=tuple(rows),
        device_s=device_us / steps * 1e-6,
        overlap_s=overlap_us / steps * 1e-6,
        host_s=0.0,
        steps=steps,
        collective_s=sum(r.time_s for r in collective),
        collective_bytes=None if None in coll_b else float(sum(coll_b)),
        xla_flops=None,
        xla_bytes=None,
        peaks=peaks,
        device="",
        trace_path="",
        perfetto_path=None,
        unattributed=tuple(sorted(set(costs) - {r.name for r in rows})),
        kernels=tuple(
            sorted(
                (
                    Kernel(name, launched, row, t / steps * 1e-6, n / steps)
                    for name, (row, launched, t, n) in per_kernel.items()
                ),
                key=lambda k: (-k.time_s, k.name),
            )
        ),
    )


def _lookup(instructions: dict[str, _Instruction], hlo_op: str) -> _Instruction:
    """The instruction an event names; one the HLO text does not have (a runtime construct)
    becomes an ``(xla)`` row of its own name."""
    inst = instructions.get(hlo_op)
    if inst is None:
        inst = instructions.get(_normalized(hlo_op))
    return inst or _Instruction(None, frozenset(), hlo_op, "", 0)


def _normalized(name: str) -> str:
    """Instruction names as some runtimes spell them in trace events (``fusion_1`` for
    ``fusion.1``)."""
    return name.replace(".", "_")


def _sum_known(values: Iterable[float | None]) -> float | None:
    total = 0.0
    for v in values:
        if v is None:
            return None
        total += v
    return total


# --- the roofline -----------------------------------------------------------------------------


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only).

    Imported here, not at the top of the module: matplotlib is an optional dependency
    (the ``profile`` extra), needed only for ``plot=``, and importing it costs a second.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "profile: plot= needs matplotlib (pip install 'tessera_jax[profile]')"
        ) from e
    return plt


def _plot_roofline(result: Profile, path: str) -> None:
    """Saves the roofline: achieved FLOP/s against FLOPs per byte for every row with both,
    under each peak's ceiling ``min(peak FLOP/s, intensity · peak bytes/s)``."""
    plt = _pyplot()
    points = [r for r in result.rows if r.flops_per_s and r.intensity]
    fig, ax = plt.subplots(figsize=(7, 5), dpi=100)
    peaks = result.peaks
    xs = [r.intensity for r in points] or [1.0]
    lo = min(min(xs) / 10, 0.01)
    hi = max(max(xs) * 10, max(peaks.flops_per_s.values()) / peaks.bytes_per_s * 10)
    grid = np.logspace(math.log10(lo), math.log10(hi), 200)
    used = {r.dtype for r in points} & set(peaks.flops_per_s) or set(peaks.flops_per_s)
    for dtype in sorted(used):
        ceiling = np.minimum(peaks.flops_per_s[dtype], grid * peaks.bytes_per_s)
        ax.plot(grid, ceiling, "--", label=f"{peaks.name} {dtype} ceiling")
    for r in points:
        ax.scatter([r.intensity], [r.flops_per_s], zorder=3)
        ax.annotate(r.name, (r.intensity, r.flops_per_s), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"ts.profile roofline on {result.device}")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
