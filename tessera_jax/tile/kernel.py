"""``@ts.kernel``, ``ts.mut`` and the launches ``ts.launch.grid(...)(k)(...)``, ``k[g, b](...)``.

A kernel is a Python function written against ``ts.tile``; parameters annotated
``ts.mut`` are its outputs. A launch returns their new values (one array, or a tuple in
parameter order): JAX arrays are immutable, so the caller's arrays are never changed, and
elements the kernel does not store keep the values they had. Array arguments are passed
whole; 0-d arrays are traced scalars; Python numbers (and keyword-only arguments) are
compile-time constants, each distinct value compiling its own kernel.

Every launch goes through :func:`_launch`, which validates it, picks the backend (Pallas'
Triton backend on GPUs, Pallas' interpreter elsewhere or under ``TESSERA_KERNELS=
interpret``) and runs a ``jax.jit`` compiled once per launch shape, so launches compose
with ``jax.jit``, ``jax.vmap`` (a batched launch adds a grid axis) and ``ts.index_launch``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax._config import get_kernel_mode
from tessera_jax.tile import lowering

__all__ = ["Grid", "Kernel", "ceil_div", "grid", "kernel", "mut"]

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
    """

    blocks: tuple[int, ...]
    threads: tuple[int, ...]
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
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

    def __call__(self, k: Kernel) -> Callable[..., Any]:
        if not isinstance(k, Kernel):
            raise TypeError(f"ts.launch.grid(...): expected a @ts.kernel, got {k!r}")

        def launch(*args: Any, **kwargs: Any) -> Any:
            return _launch(k, self, args, kwargs)

        launch.__name__ = k.name
        return launch


def grid(
    blocks: Any, threads: Any, *, num_warps: int | None = None, num_stages: int | None = None
) -> Grid:
    """``ts.launch.grid(blocks=(ts.ceil_div(N, 256),), threads=(256,))(kernel)(*args)``."""
    return Grid(
        _dims("blocks", blocks, pow2=False),
        _dims("threads", threads, pow2=True),
        num_warps,
        num_stages,
    )


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def _classify(k: Kernel, name: str, is_mut: bool, x: Any) -> lowering.Param:
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
    params, kw = _bind(k, args, kwargs)
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
    dyn = [jnp.asarray(x) for p, x in zip(params, args) if p.kind != "static"]
    outs = fn(*dyn)
    return outs[0] if len(outs) == 1 else outs
