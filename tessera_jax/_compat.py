"""Every jax-version difference and every private-API import lives here.

The project supports jax 0.10.x (the CPU machines) through 0.12.x (the GPU
machines run 0.11.2). Anything reached through ``jax._src`` or through a name
that moved between releases is imported once, in this module, so a jax upgrade
touches one file.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
from typing import Any

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = [
    "INTERPRETER_BODIES",
    "JAX_VERSION",
    "MGPU_INTERPRET_TMA_OOB",
    "MGPU_MIXED_FP8",
    "MGPU_PEER_KERNELS",
    "TRITON_LOWERS_WITHOUT_GPU",
    "TRITON_MISSING",
    "Primitive",
    "ad",
    "apply_primitive",
    "batching",
    "custom_partitioning",
    "enum_config_state",
    "gpu_interpret_forced",
    "gpu_interpret_mode",
    "gpu_interpret_params",
    "mgpu_load",
    "mlir",
    "not_mapped",
    "pallas_triton",
    "shard_map",
]

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# Mosaic GPU kernels that write to peer GPUs (``plgpu.remote_ref``, remote semaphores)
# through XLA's collective metadata in one process: lowered on 0.10 and 0.11, run and
# measured on the GPU machines only with 0.11 (the NVLink all-reduce kernel).
MGPU_PEER_KERNELS = JAX_VERSION >= (0, 11)

# ``plgpu.wgmma`` with one e4m3 and one e5m2 operand (PTX wgmma takes separate
# ``.atype``/``.btype`` for fp8): accepted from jax 0.11; 0.10 requires one dtype.
MGPU_MIXED_FP8 = JAX_VERSION >= (0, 11)
# From jax 0.11 Pallas' Triton lowering asks the local GPU for its properties, so a
# pallas_call for cuda no longer lowers on a machine without one (Mosaic GPU's still does).
TRITON_LOWERS_WITHOUT_GPU = JAX_VERSION < (0, 11)

# The Mosaic GPU interpreter emulates TMA's out-of-bounds behaviour (loads fill zeros,
# stores skip) from jax 0.11; 0.10's raises on an out-of-bounds copy. The GPU does it on both.
MGPU_INTERPRET_TMA_OOB = JAX_VERSION >= (0, 11)

# Eager application of a primitive: jit-compile the single primitive (the same
# path jax.lax ops take), so the per-platform lowering (kernel or reference) is
# used outside jit too.
from jax._src.dispatch import apply_primitive  # noqa: E402
from jax.experimental.custom_partitioning import custom_partitioning  # noqa: E402

shard_map = jax.shard_map


def mgpu_load(ref: Any, *, layout: Any) -> Any:
    """``plgpu.load`` of a whole reference (index it first, ``ref.at[idx]``) into ``layout``:
    jax 0.10 requires the separate index argument that 0.11 deprecates."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if JAX_VERSION >= (0, 11):
        return plgpu.load(ref, layout=layout)
    return plgpu.load(ref, (), layout=layout)


# The batch-dimension marker of an unbatched operand in a batching rule
# (``batching.not_mapped`` was removed from the public module; it is None).
not_mapped = None


def enum_config_state(name: str, values: list[str], default: str | None, help: str) -> Any:
    """A jax config option that is part of the jit cache key.

    Read from the environment variable ``name.upper()`` at import. Part of the
    jit key and of the trace context (the lowering cache's key), so changing it
    (``with state(value):``, thread-local) retraces and relowers instead of reusing a
    function compiled under the other setting. ``default=None``: unset until given.
    """
    from jax._src import config as _config

    make = _config.enum_state if default is not None else _config.optional_enum_state
    return make(
        name=name,
        enum_values=values,
        default=default,
        help=help,
        include_in_jit_key=True,
        include_in_trace_context=True,
    )


def gpu_interpret_params(detect_races: bool = False) -> Any:
    """Parameters that run a Mosaic GPU kernel in the CPU interpreter."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(detect_races=detect_races)


@contextlib.contextmanager
def gpu_interpret_mode(detect_races: bool = False):
    """Runs every Mosaic GPU kernel traced inside in the CPU interpreter."""
    from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

    _patch_gpu_interpreter()
    with force_gpu_interpret_mode(gpu_interpret_params(detect_races)):
        yield


def _patch_gpu_interpreter() -> bool:
    """Applies this module's patches to the Mosaic GPU interpreter; whether the one that
    compiles each kernel body once is in force."""
    _patch_gpu_interpreter_wgmma()
    _patch_gpu_interpreter_callback_args()
    return _patch_gpu_interpreter_thread_compiles()


_INTERPRETER_CALLBACKS = "jax._src.pallas.mosaic_gpu.interpret."


def _patch_gpu_interpreter_callback_args() -> None:
    """Hands the Mosaic GPU interpreter's host callbacks the NumPy arrays XLA passes.

    The interpreter calls back into Python for every shared-memory access, barrier and
    wgmma of every thread, and ``io_callback`` first copies each call's arguments onto a
    CPU device (a ``device_put`` per call, a large share of an interpreted kernel's time);
    the interpreter's callbacks read them with ``int()`` and NumPy indexing, so the copies
    buy nothing. Every other callback keeps jax's behaviour. Patched on jax 0.10
    only: 0.11's interpreter builds its thread locations from jax Arrays and refuses NumPy
    arrays. Idempotent."""
    if JAX_VERSION >= (0, 11):
        return
    from jax._src import callback as _callback
    from jax._src import config as _config
    from jax._src import xla_bridge

    orig = _callback.io_callback_impl
    if getattr(orig, "_tessera_patched", False):
        return

    def interpreter_function(callback) -> bool:
        f = getattr(callback, "callback_func", None)
        while isinstance(f, functools.partial):
            f = f.func
        return getattr(f, "_tessera_interpreter_callback", False) or getattr(
            f, "__module__", ""
        ).startswith(_INTERPRETER_CALLBACKS)

    def io_callback_impl(*args, callback, **params):
        if not interpreter_function(callback):
            return orig(*args, callback=callback, **params)
        cpu_device, *_ = xla_bridge.local_devices(backend="cpu")
        with _config.default_device(cpu_device):
            return jax.tree.map(np.asarray, callback(*args))

    io_callback_impl._tessera_patched = True
    _callback.io_callback_impl = io_callback_impl


@dataclasses.dataclass
class InterpretedBody:
    """A kernel body the Mosaic GPU interpreter compiled, and how many threads ran it."""

    exe: Any
    runs: int = 0


# The Mosaic GPU interpreter's compiled kernel bodies, most recently used last
# (_patch_gpu_interpreter_thread_compiles).
INTERPRETER_BODIES: collections.OrderedDict[Any, InterpretedBody] = collections.OrderedDict()
_INTERPRETER_BODIES_KEPT = 64


def _patch_gpu_interpreter_thread_compiles() -> bool:
    """Compiles each interpreted kernel body once, not once per thread and grid point.

    jax 0.10's Mosaic GPU interpreter runs a kernel's warpgroups as host threads, each
    evaluating the kernel's jaxpr in a computation it traces, lowers and compiles on every
    call (``thread_map._run_jaxpr`` jits a closure it defines there, so jax's caches never
    hit): a kernel of 4 CTAs of 3 warpgroups compiles the same body 12 times, and compiling
    is most of the interpreter's time. (jax 0.11 jits a module-level function, which its
    caches compile once.) This keeps each compiled body, keyed by the jaxpr (the one
    object every thread and grid point of a traced kernel shares) and the argument types,
    in a bounded cache. The compile runs under a lock and the call outside it: the threads
    of one CTA wait on each other's barriers, so none may hold a lock another needs while
    it runs (a plain ``jax.jit`` dispatch, which serialises a cache miss's first call,
    deadlocks here). Patched only where the runner is 0.10's; whether it was is returned.
    """
    import inspect
    import threading

    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover - interpreter layout changed
        return False
    orig = thread_map._run_jaxpr
    if getattr(orig, "_tessera_patched", False):
        return True
    try:
        source = inspect.getsource(orig)
    except (OSError, TypeError):  # pragma: no cover
        return False
    closure = "def _run(jaxpr, consts, *args):", "jax_core.eval_jaxpr(jaxpr, consts, *args)"
    if not all(line in source for line in (*closure, ".compile()(consts, *args)")):
        return False
    eval_jaxpr = thread_map.jax_core.eval_jaxpr

    def run(jaxpr, consts, *args):
        eval_jaxpr(jaxpr, consts, *args)

    compiled = INTERPRETER_BODIES
    lock = threading.Lock()

    def run_jaxpr(jaxpr, consts, *args):
        key = (jaxpr, *(jax.typeof(x) for x in jax.tree.leaves((consts, args))))
        key += (jax.tree.structure((consts, args)),)
        with lock:
            body = compiled.get(key)
            if body is None:
                exe = jax.jit(run, static_argnums=0).trace(jaxpr, consts, *args).lower().compile()
                body = compiled[key] = InterpretedBody(exe)
                if len(compiled) > _INTERPRETER_BODIES_KEPT:
                    compiled.popitem(last=False)
            else:
                compiled.move_to_end(key)
            body.runs += 1
        body.exe(consts, *args)

    run_jaxpr._tessera_patched = True
    thread_map._run_jaxpr = run_jaxpr
    return True


def _patch_gpu_interpreter_wgmma() -> None:
    """Teaches the Mosaic GPU interpreter's ``wgmma`` transposed shared-memory operands.

    jax 0.10's interpreter reads wgmma operands through indexing transforms only, so
    ``wgmma(acc, a, plgpu.transpose_ref(b, (1, 0)))`` (the compiled kernel's copy-free
    transposed operand: the instruction's transpose bit) fails there. This wraps the
    interpreter callback: operands with a trailing ``TransposeTransform`` are read
    through their indexers and transposed in numpy; everything else goes to jax's
    own callback unchanged. Idempotent; a no-op where the interpreter handles them.
    """
    try:
        from jax._src.pallas.mosaic.interpret import utils as interpret_utils
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        from jax._src.state.types import TransposeTransform
    except ImportError:  # pragma: no cover - interpreter layout changed
        return
    orig = gc.wgmma
    if getattr(orig, "_tessera_patched", False):
        return
    import inspect

    try:  # jax 0.11 reads every operand through transposes itself (and changed this API)
        if "TransposeTransform" in inspect.getsource(gc) or "mesh_location" in inspect.getsource(
            orig
        ):
            return
    except (OSError, TypeError):  # pragma: no cover
        return

    def split(transforms):
        idx, perm = [], None
        for t in gc._remove_noop_transforms(tuple(transforms)):
            if isinstance(t, TransposeTransform):
                p = tuple(t.permutation)
                perm = p if perm is None else tuple(perm[i] for i in p)
            elif perm is not None:
                raise NotImplementedError("indexing after a transpose in an interpreted wgmma")
            else:
                idx.append(t)
        return tuple(idx), perm

    def wgmma(**kw):
        a_idx, a_perm = split(kw["a_transforms"])
        b_idx, b_perm = split(kw["b_transforms"])
        if a_perm is None and b_perm is None:
            return orig(**kw)
        device_id, thread_id = int(kw["device_id"]), int(kw["thread_id"])
        coords = tuple(int(x) for x in kw["grid_point_coords"])
        shared_memory = gc._get_shared_memory()
        gtid = shared_memory.get_global_thread_id(device_id, thread_id)
        info = interpret_utils.GPULoggingInfo(
            device_id=device_id,
            grid_point_coords=coords,
            thread_id=thread_id,
            source_info=kw.get("source_info"),
        )

        def read(key, transforms, perm):
            rng = interpret_utils.to_range(jax.tree.map(int, transforms))
            key = gc.HostAllocationKey.from_array(key)
            x, _, _ = shared_memory.get_buffer_content(key, rng, gtid, logging_info=info)
            return x if perm is None else x.transpose(perm)

        a = read(kw["a_allocation_key_as_array"], a_idx, a_perm)
        b = read(kw["b_allocation_key_as_array"], b_idx, b_perm)
        acc_key = gc.HostAllocationKey.from_array(kw["acc_allocation_key_as_array"])
        acc_range = interpret_utils.to_range(
            jax.tree.map(int, gc._remove_noop_transforms(tuple(kw["acc_transforms"])))
        )
        acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, gtid, logging_info=info)
        res = acc + np.matmul(a, b, dtype=kw["acc_dtype"])
        shared_memory.store_buffer_content(acc_key, acc_range, res, gtid, logging_info=info)
        return kw["token"]

    wgmma._tessera_patched = True
    wgmma._tessera_interpreter_callback = True
    gc.wgmma = wgmma


def gpu_interpret_current_params() -> Any:
    """The interpreter parameters a ``gpu_interpret_mode`` context has in force, else defaults."""
    from jax._src import config as _config

    state = getattr(_config, "pallas_tpu_interpret_mode_context_manager", None)
    value = None if state is None else state.value
    return value if value is not None else gpu_interpret_params()


@contextlib.contextmanager
def gpu_interpret_mode_with(params: Any):
    """``gpu_interpret_mode`` with given ``InterpretGPUParams`` (see gpu_interpret_params)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

    _patch_gpu_interpreter()
    with force_gpu_interpret_mode(params):
        yield


def gpu_interpret_forced() -> bool:
    """Whether a ``gpu_interpret_mode`` context (or global setting) is already in force."""
    from jax._src import config as _config

    state = getattr(_config, "pallas_tpu_interpret_mode_context_manager", None)
    return state is not None and state.value is not None


@contextlib.contextmanager
def without_gpu_interpret_mode():
    """Lifts a ``gpu_interpret_mode`` context for the calls traced inside: a kernel in
    Pallas' Triton backend (``interpret=True``: Pallas' own interpreter) that runs between
    Mosaic GPU kernels, which the forced mode would hand to the Mosaic GPU interpreter."""
    from jax._src import config as _config

    state = getattr(_config, "pallas_tpu_interpret_mode_context_manager", None)
    if state is None or state.value is None:
        yield
        return
    prev = state.swap_local(None)
    try:
        yield
    finally:
        state.set_local(prev)


def races_detected() -> bool | None:
    """Whether the last Mosaic GPU interpret run saw a data race (None if unknown)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    except ImportError:  # pragma: no cover - layout moved
        return None
    fn = getattr(ipc, "get_races", None)
    if fn is None:
        return None
    return bool(fn().races_found)


def cpu_device_count_flag(n: int) -> None:
    """Asks XLA for ``n`` virtual CPU devices (must run before the backend starts)."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # pragma: no cover - older jax
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"


# XLA's CPU option that keeps the older fusion emitters; jaxlib 0.11 has only the fusion
# emitters and refuses the option.
_OLD_CPU_EMITTERS = "xla_cpu_use_fusion_emitters"


def compile_unoptimized_cpu_programs_quickly() -> bool:
    """Compiles every program built under ``jax_disable_most_optimizations`` with XLA's
    older CPU fusion emitters, which compile a small program much faster (the CPU
    test-suite's setting: tests/conftest.py); whether this jaxlib has them. jax's switch
    is global and the emitters' option per compile, so it joins the options jax builds
    for each program."""
    from jax._src import compiler

    try:
        jax.jit(lambda x: x + 1, compiler_options={_OLD_CPU_EMITTERS: False}).lower(1.0).compile()
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" in str(e):
            return False
        raise
    get = compiler.get_compile_options
    if getattr(get, "_tessera_patched", False):
        return True

    def get_compile_options(*args, **kwargs):
        options = get(*args, **kwargs)
        if compiler._DISABLE_MOST_OPTIMIZATIONS.value:
            overrides = dict(options.env_option_overrides)
            overrides.setdefault(_OLD_CPU_EMITTERS, False)
            options.env_option_overrides = list(overrides.items())
        return options

    get_compile_options._tessera_patched = True
    compiler.get_compile_options = get_compile_options
    return True


def enable_x64(enabled: bool = True):
    """Context manager turning 64-bit types on (``jax.enable_x64`` in jax >= 0.9)."""
    fn = getattr(jax, "enable_x64", None)
    if fn is None:  # pragma: no cover - older jax
        from jax.experimental import enable_x64 as fn
    return fn(enabled)


def zero_tangent(primal: Any) -> Any:
    """A symbolic-zero tangent for ``primal`` (``ad.Zero.from_primal_value`` in newer jax)."""
    return ad.Zero(jax.typeof(primal).to_tangent_aval())


# --- distribution (tessera_jax.sharding, primitives/collectives/) ----------------------


def make_mesh(devices: Any, axis_names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A ``jax.sharding.Mesh`` with Auto axes over an ndarray of devices.

    ``jax.make_mesh`` defaults to Explicit axes from jax 0.10 on (sharding in types),
    under which ``shard_map`` wants inputs already placed as ``in_specs`` say; Tessera
    meshes use Auto axes everywhere.
    """
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None:  # pragma: no cover - older jax
        return jax.sharding.Mesh(devices, axis_names)
    return jax.sharding.Mesh(devices, axis_names, axis_types=(axis_type.Auto,) * len(axis_names))


def axis_is_bound(name: Any) -> bool:
    """Whether mesh axis ``name`` is bound here (inside ``shard_map`` over it)."""
    try:
        jax.lax.axis_size(name)
    except (NameError, KeyError, ValueError):
        return False
    return True


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes a traced value varies over inside ``shard_map`` (its vma)."""
    return varying_axes_of_aval(jax.typeof(x))


def varying_axes_of_aval(aval: Any) -> frozenset:
    mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))  # older / newer spelling


def pvary(x: Any, axes: tuple[str, ...]) -> Any:
    """Marks an invariant value as varying over ``axes`` (a no-op on the data)."""
    axes = tuple(a for a in axes if a not in varying_axes(x))
    if not axes or not vma_checking():  # no vma typing here: nothing to mark
        return x
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # pragma: no cover - jax without pcast


def all_gather_invariant(x: Any, axes: tuple[str, ...], *, axis: int, tiled: bool = True) -> Any:
    """``all_gather`` whose result is typed invariant over ``axes`` (its transpose slices).

    Outside vma typing (``check_vma=False``, custom_partitioning bodies) the plain
    ``all_gather``: there is no type to state.
    """
    if not vma_checking():
        return jax.lax.all_gather(x, axes, axis=axis, tiled=tiled)
    fn = getattr(jax.lax, "all_gather_invariant", None)
    if fn is None:
        from jax._src.lax.parallel import all_gather_invariant as fn
    return fn(x, axes, axis=axis, tiled=tiled)


def _strip_vma(aval: Any) -> Any:
    mat = getattr(aval, "mat", None)
    if mat is not None and getattr(mat, "varying", None):
        return aval.update(manual_axis_type=mat.update(varying=frozenset()))
    if getattr(aval, "vma", None):  # pragma: no cover - other spelling
        return aval.update(vma=frozenset())
    return aval


@contextlib.contextmanager
def lowering_without_vma(ctx: Any):
    """``ctx`` with vma-free avals, and vma checks off, to trace an implementation
    inside a lowering rule.

    Inside ``shard_map`` the avals of a lowering carry the axes they vary over; an
    implementation traced from them (a ``pallas_call``'s ``out_shape``, a loop
    carry) would then have to state vma itself. The lowered MLIR types are the same
    either way, so implementations are traced vma-free.
    """
    ctx = ctx.replace(
        avals_in=[_strip_vma(a) for a in ctx.avals_in],
        avals_out=[_strip_vma(a) for a in ctx.avals_out],
    )
    state = _check_vma_state()
    with state(False) if state is not None else contextlib.nullcontext():
        yield ctx


def lowering_is_partitioned(ctx: Any) -> bool:
    """Whether a lowering runs under XLA's SPMD partitioner over several devices
    (jit with shardings), as opposed to one device or a fully manual ``shard_map``."""
    from jax._src import sharding_impls

    ac = ctx.module_context.axis_context
    if isinstance(ac, sharding_impls.ShardingContext):
        return ac.num_devices > 1
    return False


def require_devices_during_lowering(prim: Any) -> None:
    """Lowering ``prim`` needs the device assignment (it may emit custom_partitioning)."""
    from jax._src import dispatch

    dispatch.prim_requires_devices_during_lowering.add(prim)


def _check_vma_state() -> Any:
    from jax._src import config as _config

    return getattr(_config, "_check_vma", None)


_CHECK_VMA = _check_vma_state()


def vma_checking() -> bool:
    """Whether values are being typed by the mesh axes they vary over (inside a
    ``shard_map`` with ``check_vma=True``)."""
    return bool(_CHECK_VMA is not None and _CHECK_VMA.value)


def match_vma(args: Any) -> list[Any]:
    """Operands marked varying over the union of their varying axes, as jax does for
    its own primitives, so that a primitive's operands agree inside ``shard_map``."""
    vmas = [varying_axes(a) for a in args]
    union = frozenset().union(*vmas)
    if not union:
        return list(args)
    return [pvary(a, tuple(union - v)) if union - v else a for a, v in zip(args, vmas)]


def named_axis_effects(axes: tuple[str, ...]) -> set:
    """The effects of a collective over mesh ``axes`` (as jax's own collectives state
    them: one ``NamedAxisEffect`` per axis, which ``shard_map`` discharges)."""
    from jax._src.core import NamedAxisEffect

    return {NamedAxisEffect(a) for a in axes}


def with_varying(aval: Any, vma: frozenset, like: Any) -> Any:
    """``aval`` typed as varying over ``vma`` (the output type of a primitive whose
    operands vary over ``vma``); ``like`` is an operand aval carrying the mesh."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        if mat.varying == vma:
            return aval
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        if mesh is None or mesh.empty:  # a fresh ShapedArray: take the operands' mesh
            spec = jax.sharding.PartitionSpec()
            aval = aval.update(sharding=jax.sharding.NamedSharding(like.sharding.mesh, spec))
        return aval.update(manual_axis_type=aval.mat.update(varying=vma))
    if hasattr(aval, "vma"):  # pragma: no cover - other spelling
        return aval.update(vma=vma)
    return aval


from jax._src import core as _core  # noqa: E402


def is_eager() -> bool:
    """Whether a primitive bound now is evaluated at once (no jit, grad or vmap trace)."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def outside_mesh_context():
    """A context with no abstract mesh in force (as outside ``jax.set_mesh``).

    What a custom_partitioning rule traces runs on local shards after the partitioner:
    under a mesh with Explicit axes jax would type (and constrain) its values by that mesh,
    and the constraints would reach the per-device program, which cannot run them.
    """
    from jax._src import mesh as mesh_lib

    return jax.sharding.use_abstract_mesh(mesh_lib.empty_abstract_mesh)


def backends_started() -> bool:
    """Whether a JAX backend has started (after which ``jax.distributed.initialize`` fails)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def concrete_value(x: Any) -> Any:
    """``x``'s value as a numpy array when known at trace time, else None (a tracer)."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return jax.device_get(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None  # a value known only when the traced function runs


def lowering_named(ctx: Any, name: str) -> Any:
    """``ctx`` with ``name`` pushed on its name stack: the HLO ops the lowering emits then
    carry ``…/name/…`` in their ``metadata.op_name``, which the profiler's trace events
    point back to (jax names ops after the primitives of their jaxpr only, so an
    operator lowered through ``mlir.lower_fun`` would otherwise not appear)."""
    return ctx.replace(name_stack=ctx.name_stack.extend(name))


# --- graph modules (tessera_jax/graph): evaluating and inlining jaxpr equations ----------


def bind_eqn(eqn: Any, invals: list[Any]) -> list[Any]:
    """Evaluates one jaxpr equation on ``invals`` under the current trace, as
    ``jax.core.eval_jaxpr`` does for each of its equations; returns its outputs as a list.

    ``get_bind_params`` turns the parameters a jaxpr stores (the sub-jaxprs of
    ``custom_jvp_call`` …) into the ones ``bind`` takes.
    """
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def inlinable_call(eqn: Any) -> tuple[Any, list[Any]] | None:
    """``(jaxpr, consts)`` of a nested ``jax.jit`` equation (which a graph inlines), else
    None. jax 0.10 stores a ClosedJaxpr under ``params["jaxpr"]``, jax 0.11 an open Jaxpr."""
    if eqn.primitive.name not in ("jit", "pjit"):
        return None
    inner = eqn.params.get("jaxpr")
    if isinstance(inner, jax.extend.core.ClosedJaxpr):
        return inner.jaxpr, list(inner.consts)
    if isinstance(inner, jax.extend.core.Jaxpr) and not inner.constvars:
        return inner, []
    return None


@contextlib.contextmanager
def vma_checks_off():
    """Traces inside without typing values by the mesh axes they vary over (an abstract
    trace of a kernel body, whose avals carry no mesh axes)."""
    state = _check_vma_state()
    with state(False) if state is not None else contextlib.nullcontext():
        yield


def same_trace(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are tracers of one trace (values made inside the same traced
    function, e.g. a loop body, rather than captured from an enclosing one)."""
    ta = getattr(a, "_trace", None)
    return ta is not None and ta is getattr(b, "_trace", None)


def scan_carry_count(eqn: Any) -> int:
    """How many values a ``scan`` equation carries from one iteration to the next (jax 0.10:
    its ``num_carry`` parameter; 0.11: the middle group of its ``ft_in`` flat tree, which
    unpacks into constants, carries and scanned inputs)."""
    if "num_carry" in eqn.params:
        return int(eqn.params["num_carry"])
    return len(list(eqn.params["ft_in"].unpack()[1]))


from jax._src.lib.mlir import ir as _ir  # noqa: E402

# Pallas' Triton backend (the norm, decode-attention and tile kernels) is deprecated from
# jax 0.11. Where a jax no longer has it, ``pallas_triton`` is None and TRITON_MISSING says
# why: those kernels step aside (their modules' ``MISSING``), ``norms_gpu.row_dot`` sums
# on the canonical tree in XLA, and the tile language raises at a launch.
try:
    from jax._src.lib.triton import dialect as _tt
    from jax._src.pallas.triton import lowering as _pallas_triton
    from jax.experimental.pallas import triton as pallas_triton
except ImportError as e:
    _tt = _pallas_triton = pallas_triton = None
    TRITON_MISSING: str | None = f"this jax has no Pallas Triton backend ({e})"
else:
    TRITON_MISSING = None


def register_triton_gather_lowering(prim: Any) -> None:
    """Lowers ``prim(x, idx, axis=)`` (``take_along_axis``) in Pallas' Triton backend to
    Triton's ``tt.gather``, which moves values between the lanes of a warp with shuffles
    when the gathered axis lies within one warp (else through shared memory). Pallas has
    no public hook for a primitive's Triton lowering, nor a gather of its own. Without the
    backend (TRITON_MISSING) there is nothing to register."""
    if _pallas_triton is None:
        return

    def rule(ctx: Any, x: Any, idx: Any, *, axis: int) -> Any:
        out = _ir.RankedTensorType.get(
            list(ctx.avals_out[0].shape), _ir.RankedTensorType(x.type).element_type
        )
        return _tt.gather(x, idx, axis, results=[out])

    _pallas_triton.register_lowering(prim)(rule)
