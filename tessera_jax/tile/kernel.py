"""``@ts.kernel``, ``ts.mut`` and the launches ``ts.launch.grid(...)(k)(...)``, ``k[g, b](...)``.

A kernel is a Python function written against ``ts.tile``; parameters annotated
``ts.mut`` are its outputs. A launch returns their new values (one array, or a tuple in
parameter order): JAX arrays are immutable, so the caller's arrays are never changed, and
elements the kernel does not store keep the values they had. A ``mut`` argument may also
be a ``jax.ShapeDtypeStruct``: an output with no initial values (its unstored elements are
undefined), for kernels that store every element, which saves writing the initial array.
Array arguments are passed
whole; 0-d arrays are traced scalars; Python numbers (and keyword-only arguments) are
compile-time constants, each distinct value compiling its own kernel.

Every launch goes through :func:`_launch`, which validates it, picks the backend (Pallas'
Triton backend on GPUs, Pallas' interpreter elsewhere or under ``TESSERA_KERNELS=
interpret``) and runs a ``jax.jit`` compiled once per launch shape, so launches compose
with ``jax.jit``, ``jax.vmap`` (a batched launch adds a grid axis) and ``ts.index_launch``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax import autotune
from tessera_jax._config import get_kernel_mode
from tessera_jax.graph.capture import record_call
from tessera_jax.tile import lowering

__all__ = ["AutotunedKernel", "Grid", "Kernel", "Launch", "ceil_div", "grid", "kernel", "mut"]

# Triton's largest tile (TRITON_MAX_TENSOR_NUMEL).
MAX_LANES = 1 << 20
_MAX_AXES = 3


class _Mut:
    """The ``ts.mut`` annotation: the parameter is an output (``Out: ts.mut`` or
    ``ts.mut[ts.f32]``)."""

    def __getitem__(self, item: Any) -> _Mut:
        return self

    def __repr__(self) -> str:
        return "ts.mut"


mut = _Mut()
_MUT_TEXT = re.compile(r"(?:\w+\.)*mut(?:\[.*\])?")


def _is_mut(annotation: Any, globals_: dict[str, Any]) -> bool:
    if isinstance(annotation, _Mut):
        return True
    if isinstance(annotation, str):
        try:
            return isinstance(eval(annotation, dict(globals_)), _Mut)
        except Exception:
            return bool(_MUT_TEXT.fullmatch(annotation.strip()))
    return False


def ceil_div(a: Any, b: Any) -> Any:
    """``⌈a / b⌉`` for positive ``b`` (Python ints stay Python ints, for grids)."""
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        if b <= 0:
            raise ValueError(f"ceil_div: {b=} must be positive")
        return -(-int(a) // int(b))
    return (a + b - 1) // b


class Kernel:
    """A ``@ts.kernel`` function; launched by ``ts.launch.grid(...)(k)`` or ``k[grid, block]``."""

    def __init__(self, fn: Callable[..., Any]):
        if not inspect.isfunction(fn):
            raise TypeError(f"ts.kernel: expected a function, got {type(fn).__name__}")
        self.fn, self.name = fn, fn.__name__
        sig = inspect.signature(fn)
        self.params: list[tuple[str, bool]] = []
        self.kwonly: dict[str, Any] = {}
        for p in sig.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.params.append((p.name, _is_mut(p.annotation, fn.__globals__)))
            elif p.kind == p.KEYWORD_ONLY:
                self.kwonly[p.name] = p.default
            else:
                raise TypeError(
                    f"kernel {self.name!r}: *args and **kwargs are not kernel parameters"
                )
        self._compiled: tuple | None = None
        self._jitted: dict[tuple, Callable[..., Any]] = {}
        functools_wraps(self, fn)

    @property
    def mut_params(self) -> list[str]:
        return [n for n, m in self.params if m]

    def body(self) -> tuple[Callable[..., Any], str, tuple[int, int]]:
        if self._compiled is None:
            self._compiled = lowering.transform(self.fn, self.name)
        return self._compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"kernel {self.name!r} is launched over a grid: ts.launch.grid(blocks=(…), "
            f"threads=(…))({self.name})(…) or {self.name}[grid, block](…)"
        )

    def __tessera_tunable__(self) -> Any:
        raise TypeError(
            f"kernel {self.name!r} is tuned through a launch, which fixes its grid: "
            f"ts.autotune.search(kernel=ts.launch.grid(blocks=…, threads=…)({self.name}), "
            "args=(…), params={…}) (grid sizes may be functions of the tuned parameters)"
        )

    def __getitem__(self, key: Any) -> Callable[..., Any]:
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError(f"kernel {self.name!r}: launch as {self.name}[grid, block](…)")
        return grid(blocks=key[0], threads=key[1])(self)

    def __repr__(self) -> str:
        return f"<ts.kernel {self.name}>"


def functools_wraps(obj: Any, fn: Callable[..., Any]) -> None:
    obj.__doc__, obj.__module__, obj.__qualname__ = fn.__doc__, fn.__module__, fn.__qualname__


def kernel(fn: Callable[..., Any]) -> Kernel:
    """Makes ``fn`` a tile kernel (module docstring; the body's operations are ``ts.tile``)."""
    return Kernel(fn)


def _dims(what: str, v: Any, *, pow2: bool) -> tuple[int, ...]:
    t = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    ok = 1 <= len(t) <= _MAX_AXES and all(
        isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in t
    )
    if not ok:
        raise ValueError(
            f"ts.launch.grid: {what}={v!r} must be 1 to {_MAX_AXES} positive Python ints "
            "(compute sizes with ts.ceil_div on Python ints)"
        )
    t = tuple(int(n) for n in t)
    if pow2 and any(n & (n - 1) for n in t):
        raise ValueError(
            f"ts.launch.grid: {what}={t} must be powers of two: the Triton backend holds a "
            "group's lanes as one tile with power-of-two extents (launch more lanes and mask)"
        )
    return t


@dataclasses.dataclass(frozen=True)
class Grid:
    """A launch configuration: ``blocks`` groups of ``threads`` lanes.

    ``num_warps`` (a power of two ≤ 32) and ``num_stages`` (≥ 1, the software-pipeline
    depth of ``ts.tile.range`` loops) go to the Triton compiler; by default 4 warps and
    ``prefetch + 1`` stages (3 without a prefetch). They tune the GPU code only: the
    interpreter has no warps or pipeline, and computes the same values with any.

    Any of the four may instead be a function of the kernel's keyword-only arguments (a
    dict), e.g. ``threads=lambda c: (c["BM"],)``, so that an autotuned tile size sets the
    launch; it is evaluated at each launch.
    """

    blocks: Any
    threads: Any
    num_warps: Any = None
    num_stages: Any = None

    def __post_init__(self):
        if self.dynamic:
            return
        if math.prod(self.threads) > MAX_LANES:
            raise ValueError(
                f"ts.launch.grid: threads={self.threads} holds {math.prod(self.threads)} lanes; "
                f"the Triton backend's largest tile has {MAX_LANES}"
            )
        w = self.num_warps
        if w is not None and (not isinstance(w, int) or w < 1 or w > 32 or w & (w - 1)):
            raise ValueError(f"ts.launch.grid: num_warps={w!r} must be a power of two in [1, 32]")
        s = self.num_stages
        if s is not None and (not isinstance(s, int) or s < 1):
            raise ValueError(f"ts.launch.grid: num_stages={s!r} must be an int >= 1")

    @property
    def dynamic(self) -> bool:
        return any(callable(v) for v in dataclasses.astuple(self))

    def resolve(self, kw: dict[str, Any]) -> Grid:
        """This grid with its functions of the keyword-only arguments evaluated."""
        if not self.dynamic:
            return self
        v = [f(dict(kw)) if callable(f) else f for f in dataclasses.astuple(self)]
        return grid(v[0], v[1], num_warps=v[2], num_stages=v[3])

    def __call__(self, k: Kernel) -> Launch:
        if not isinstance(k, Kernel):
            raise TypeError(f"ts.launch.grid(...): expected a @ts.kernel, got {k!r}")
        return Launch(k, self)


def grid(blocks: Any, threads: Any, *, num_warps: Any = None, num_stages: Any = None) -> Grid:
    """``ts.launch.grid(blocks=(ts.ceil_div(N, 256),), threads=(256,))(kernel)(*args)``."""
    b = blocks if callable(blocks) else _dims("blocks", blocks, pow2=False)
    t = threads if callable(threads) else _dims("threads", threads, pow2=True)
    return Grid(b, t, num_warps, num_stages)


class Launch:
    """A kernel bound to a grid: call it with the kernel's arguments.

    It is also an autotuning target: ``ts.autotune.search(kernel=launch, args=(…),
    params={…})`` times it over keyword-only arguments (and grid functions of them),
    pruning configs whose tiles cannot fit the GPU (``check``).
    """

    def __init__(self, k: Kernel, g: Grid):
        self.kernel, self.grid = k, g
        self.__name__ = k.name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _launch(self.kernel, self.grid, args, kwargs)

    def __repr__(self) -> str:
        return f"<launch of {self.kernel!r} over {self.grid}>"

    def __tessera_tunable__(self) -> Any:
        return autotune.Tunable(
            name=f"ts.kernel:{self.kernel.fn.__module__}.{self.kernel.fn.__qualname__}",
            key=functools.partial(_tuning_key, self),
            check=functools.partial(_fits, self),
            run=lambda args, config: self(*args, **config),
        )


def _leaf(x: Any) -> Any:
    if _is_array(x):
        return ["array", list(x.shape), str(np.dtype(x.dtype))]
    return x if isinstance(x, (bool, int, float, str, type(None))) else repr(x)


def _tuning_key(launch: Launch, args: Sequence[Any]) -> tuple:
    g = launch.grid
    geometry = None if g.dynamic else [list(g.blocks), list(g.threads), g.num_warps, g.num_stages]
    return (tuple(_leaf(a) for a in args), geometry, jax.default_backend())


# Shared memory per group and registers per thread of the GPUs Triton targets (by compute
# capability major version); Hopper's limits where no GPU is present.
_SMEM_BYTES = {9: 227 * 1024, 8: 163 * 1024}
_MAX_REGS = 255


def _smem_limit() -> int:
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or not cc:
        return _SMEM_BYTES[9]
    return _SMEM_BYTES.get(int(str(cc).split(".")[0]), 99 * 1024)


def _fits(launch: Launch, args: Sequence[Any], config: dict[str, Any]) -> str | None:
    """Why ``config`` cannot run (its tiles overflow shared memory or registers), or None.

    Shared memory: the shared tiles plus the dot operand tiles once per pipeline stage
    (Triton's pipeliner stages them there). Registers: the loop-carried tiles spread over
    the group's threads (32 bits a register).
    """
    k = launch.kernel
    try:
        params, kw = _bind(k, args, dict(config))
        g = launch.grid.resolve(kw)
        body, filename, lines = k.body()
        dyn = [jnp.asarray(x) if not _is_array(x) else x for p, x in zip(params, args) if p.dynamic]
        ctx = lowering.trace(body, k.name, filename, lines, params, kw, g.blocks, g.threads, dyn)
    except (TypeError, ValueError) as e:
        return str(e)
    stages = g.num_stages or (ctx.prefetch + 1 if ctx.prefetch else 3)
    smem = ctx.shared_bytes + stages * ctx.dot_bytes
    if smem > _smem_limit():
        return f"needs about {smem} bytes of shared memory per group; the GPU has {_smem_limit()}"
    threads = 32 * (g.num_warps or 4)
    regs = ctx.carried_bytes // (4 * threads)
    if regs > _MAX_REGS:
        return (
            f"its loop-carried tiles need about {regs} registers per thread over {threads} "
            f"threads; a thread has {_MAX_REGS}"
        )
    return None


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def _classify(k: Kernel, name: str, is_mut: bool, x: Any) -> lowering.Param:
    if isinstance(x, jax.ShapeDtypeStruct):
        if not is_mut or len(x.shape) == 0:
            raise TypeError(
                f"kernel {k.name!r}: argument {name!r} is a ShapeDtypeStruct; only a ts.mut "
                "output of rank >= 1 may be given by shape and dtype alone"
            )
        return lowering.Param(name, "array", True, x, fresh=True)
    if _is_array(x):
        if is_mut and len(x.shape) == 0:
            raise TypeError(
                f"kernel {k.name!r}: the ts.mut parameter {name!r} got a 0-d array; an output "
                "is an array of rank >= 1"
            )
        return lowering.Param(name, "array" if len(x.shape) else "scalar", is_mut)
    if is_mut:
        raise TypeError(
            f"kernel {k.name!r}: the ts.mut parameter {name!r} got {type(x).__name__} {x!r}; "
            "pass the array whose new value the launch returns"
        )
    if isinstance(x, (bool, int, float, complex, np.number)):
        return lowering.Param(name, "static", False, x)
    raise TypeError(
        f"kernel {k.name!r}: argument {name!r} is a {type(x).__name__}; kernel arguments are "
        "arrays, 0-d arrays (traced scalars) or Python numbers (compile-time constants)"
    )


def _bind(k: Kernel, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list, dict]:
    names = [n for n, _ in k.params]
    sig = ", ".join(f"{n}: ts.mut" if m else n for n, m in k.params)
    if len(args) != len(names):
        raise TypeError(f"kernel {k.name!r} takes {len(names)} arguments ({sig}), got {len(args)}")
    unknown = sorted(set(kwargs) - set(k.kwonly))
    if unknown:
        raise TypeError(
            f"kernel {k.name!r}: unexpected keyword arguments {unknown}; its keyword-only "
            f"parameters are {sorted(k.kwonly)}"
        )
    kw = {}
    for n, default in k.kwonly.items():
        v = kwargs.get(n, default)
        if v is inspect.Parameter.empty:
            raise TypeError(f"kernel {k.name!r}: missing the keyword-only argument {n!r}")
        try:
            hash(v)
        except TypeError:
            raise TypeError(
                f"kernel {k.name!r}: keyword-only argument {n}={v!r} must be a hashable "
                "compile-time constant"
            ) from None
        kw[n] = v
    params = [_classify(k, n, m, x) for (n, m), x in zip(k.params, args)]
    if not any(p.mut for p in params):
        raise TypeError(
            f"kernel {k.name!r} has no ts.mut parameter, so a launch has nothing to return; "
            "annotate its outputs, e.g. `def {k.name}(X, Out: ts.mut)`"
        )
    return params, kw


def interpreting() -> bool:
    """Whether kernels run in Pallas' interpreter (off the GPU, or TESSERA_KERNELS=interpret)."""
    return get_kernel_mode() == "interpret" or jax.default_backend() != "gpu"


def _launch(k: Kernel, g: Grid, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The one way a kernel runs: validate, then call the launch compiled for this shape."""
    if isinstance(k, AutotunedKernel):
        kwargs = {**k.choose(g, args, kwargs), **kwargs}
    params, kw = _bind(k, args, kwargs)
    g = g.resolve(kw)
    interpret = interpreting()
    key = (g, tuple(p.key() for p in params), tuple(sorted(kw.items())), interpret)
    fn = k._jitted.get(key)
    if fn is None:
        body, filename, lines = k.body()

        def run(*dyn):
            outs, _ = lowering.call(
                body,
                k.name,
                filename,
                lines,
                params,
                kw,
                g.blocks,
                g.threads,
                interpret,
                g.num_warps,
                g.num_stages,
                dyn,
            )
            return tuple(outs)

        fn = k._jitted[key] = jax.jit(run)
    dyn = [jnp.asarray(x) for p, x in zip(params, args) if p.dynamic]
    # Inside ts.graph.capture the launch is one step of the captured graph.
    outs = record_call(f"ts.launch:{k.name}", fn, *dyn)
    return outs[0] if len(outs) == 1 else outs


class AutotunedKernel(Kernel):
    """``@ts.kernel.autotune(space={name: [values]})``: a kernel whose keyword-only
    arguments named in ``space`` are chosen by timing (``ts.autotune.search``) on its first
    launch for each new key (argument shapes, dtypes and constants, and the grid); the
    winner is kept in memory and in the autotune cache. Arguments given at a launch are
    not tuned."""

    def __init__(self, fn: Callable[..., Any], space: dict[str, Sequence[Any]]):
        super().__init__(fn)
        if not isinstance(space, dict) or not space:
            raise ValueError(f"ts.kernel.autotune: space={space!r} must be a non-empty dict")
        missing = sorted(set(space) - set(self.kwonly))
        if missing:
            raise ValueError(
                f"ts.kernel.autotune: kernel {self.name!r} has no keyword-only parameters "
                f"{missing}; tuning parameters are keyword-only (def {self.name}(..., *, "
                f"{', '.join(space)}))"
            )
        self.space = {n: list(v) for n, v in space.items()}
        self.tuned: dict[str, dict[str, Any]] = {}

    def choose(self, g: Grid, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The tuned values of the parameters ``kwargs`` leaves open (searching if new)."""
        open_ = {n: v for n, v in self.space.items() if n not in kwargs}
        if not open_:
            return {}
        fixed = {n: v for n, v in kwargs.items()}
        launch = _FixedLaunch(self, g, fixed)
        concrete = [_concrete(x) for x in args]
        key = repr((_tuning_key(launch, concrete), tuple(sorted(fixed.items()))))
        if key not in self.tuned:
            self.tuned[key] = dict(
                autotune.search(kernel=launch, args=tuple(concrete), params=open_)
            )
        return self.tuned[key]


class _FixedLaunch(Launch):
    """A launch with some keyword-only arguments fixed (the ones a caller gave)."""

    def __init__(self, k: Kernel, g: Grid, fixed: dict[str, Any]):
        super().__init__(k, g)
        self.fixed = fixed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _launch(self.kernel, self.grid, args, {**self.fixed, **kwargs})

    def __tessera_tunable__(self) -> Any:
        t = super().__tessera_tunable__()
        key = lambda args: (t.key(args), tuple(sorted(self.fixed.items())))
        check = lambda args, config: t.check(args, {**self.fixed, **config})
        return autotune.Tunable(name=t.name, key=key, check=check, run=t.run)


def _concrete(x: Any) -> Any:
    """``x``, or random values of its shape and dtype when it is traced (a launch inside
    ``jit`` tunes on stand-ins: the timing depends on shapes, not values)."""
    if not isinstance(x, jax.core.Tracer):
        return x
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.random.normal(jax.random.key(0), x.shape, jnp.float32).astype(x.dtype)
    return jnp.zeros(x.shape, x.dtype)


def _autotune(
    *, space: dict[str, Sequence[Any]]
) -> Callable[[Callable[..., Any]], AutotunedKernel]:
    """``@ts.kernel.autotune(space=dict(BM=[128, 256], stages=[2, 3]))`` (see AutotunedKernel)."""

    def wrap(fn: Callable[..., Any]) -> AutotunedKernel:
        return AutotunedKernel(fn, space)

    return wrap


kernel.autotune = _autotune
