"""What every benchmark shares: timing, random inputs, device names and JSON records.

Timing: each function is warmed up for a fixed time (compilation, autotuning and clock
ramp-up land there), then the functions are timed in turn in every repeat and the
median of the repeats is reported; interleaving puts clock and temperature drift on all
of them alike, so ratios between them stay meaningful when absolute times move.

Records are lists of flat dicts written as JSON (``indent=1``) to
``benchmarks/results/`` or, when ``$OUT`` is set (the GPU machines), to ``$OUT``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

_FAMILIES = ("h100", "h200", "b200", "a100")


def device_name(*, family: bool = False, count: bool = False) -> str:
    """The local device kind, lower case and dashed (``"nvidia-h200"``; ``"cpu"`` on
    CPUs). ``family``: the GPU family alone where it is known (``"h100"``); ``count``:
    with ``-x<number of local devices>`` appended (``"nvidia-h200-x4"``)."""
    dev = jax.devices()[0]
    kind = "cpu" if dev.platform == "cpu" else dev.device_kind.lower().replace(" ", "-")
    if family:
        kind = next((f for f in _FAMILIES if f in kind), kind)
    return f"{kind}-x{jax.device_count()}" if count else kind


def normal(
    seed: int,
    shape: Sequence[int],
    dtype: Any = jnp.float32,
    *,
    scale: float = 1.0,
    sharding: jax.sharding.Sharding | None = None,
) -> jax.Array:
    """Standard-normal values times ``scale``, drawn in f32 and rounded to ``dtype``;
    made directly in ``sharding``'s layout when given (each device computes its block)."""
    make = lambda k: (jax.random.normal(k, tuple(shape), jnp.float32) * scale).astype(dtype)
    return jax.jit(make, out_shardings=sharding)(jax.random.key(seed))


def _loop(fn: Callable[..., Any], args: Sequence[Any], k: int) -> float:
    """Milliseconds per call over ``k`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(k):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / k * 1e3


def time_interleaved(
    fns: dict[str, Callable[..., Any]],
    args: Sequence[Any],
    *,
    repeats: int = 5,
    target_ms: float = 40.0,
    min_iters: int = 10,
    max_iters: int = 2000,
    warmup_ms: float = 200.0,
) -> dict[str, float]:
    """Median milliseconds per call of each ``fn(*args)`` in ``fns``.

    Each function is first called for ``warmup_ms`` (loops of doubling length, which
    also estimate its time); every repeat then calls each function in turn, enough
    times for ~``target_ms`` (between ``min_iters`` and ``max_iters`` calls). On CPU
    devices there is no timed warm-up and every repeat is ``min_iters`` calls: many
    calls in flight starve the threads of the CPU collectives.
    """
    cpu = jax.default_backend() == "cpu"
    iters = {}
    for name, f in fns.items():
        jax.block_until_ready(f(*args))  # compile
        if cpu:
            iters[name] = min_iters
            continue
        t, k, spent = _loop(f, args, 1), 1, 0.0
        while spent < warmup_ms:
            t = _loop(f, args, k)
            spent += t * k
            k *= 2
        iters[name] = max(min_iters, min(max_iters, int(target_ms / max(t, 1e-6)) + 1))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            times[name].append(_loop(f, args, iters[name]))
    return {name: statistics.median(t) for name, t in times.items()}


L2_ROTATE_BYTES = 256 << 20  # several times a Hopper's 50 MiB L2 cache
IN_GRAPH_MIN_CALLS = 8


def rotation(set_bytes: int) -> int:
    """How many input sets :func:`time_in_graph` rotates through so that they hold at least
    :data:`L2_ROTATE_BYTES` together (at most 16)."""
    return max(1, min(16, -(-L2_ROTATE_BYTES // max(set_bytes, 1))))


def chained(
    fn: Callable[..., Any], calls: int, chain: Callable[[Sequence[Any], Any], Sequence[Any]]
) -> Callable[[Sequence[Sequence[Any]]], list[Any]]:
    """The program :func:`time_in_graph` times: ``run(sets)`` makes ``calls`` calls of
    ``fn``, call ``i`` on ``sets[i % len(sets)]`` passed through ``chain(args, previous
    result)``, and returns every result."""

    def run(sets):
        results, prev = [], None
        for i in range(calls):
            args = sets[i % len(sets)]
            prev = fn(*(args if prev is None else chain(args, prev)))
            results.append(prev)
        return results  # every result is an output: no call's work is dead code

    return run


def time_in_graph(
    fns: dict[str, Callable[..., Any]],
    arg_sets: Sequence[Sequence[Any]],
    chain: Callable[[Sequence[Any], Any], Sequence[Any]],
    *,
    jit: Callable[[str, Callable[..., Any]], Callable[..., Any]] = lambda name, f: jax.jit(f),
    **timing: Any,
) -> dict[str, float]:
    """Median milliseconds per call of each ``fn`` run back to back inside one jitted
    program, as a model's layers run: call ``i`` takes ``arg_sets[i % n]`` (sets whose
    buffers together exceed the L2 cache: :func:`rotation`), passed through
    ``chain(args, previous result)`` so that every call depends on the one before and
    none can be skipped or reordered. A call of a few tens of microseconds is shorter
    than the host's dispatch of a jitted call; timed alone (:func:`time_interleaved`) it
    measures the host, here the device. ``jit(name, program)`` compiles ``fns[name]``'s
    program (default :func:`jax.jit`); ``timing`` goes to :func:`time_interleaved`.
    """
    calls = max(len(arg_sets), IN_GRAPH_MIN_CALLS)
    programs = {name: jit(name, chained(fn, calls, chain)) for name, fn in fns.items()}
    ms = time_interleaved(programs, (tuple(tuple(s) for s in arg_sets),), **timing)
    return {name: t / calls for name, t in ms.items()}


def power_draw(fn: Callable[..., Any], args: Sequence[Any], seconds: float = 4.0) -> dict:
    """``fn(*args)`` called back to back for about ``seconds`` while ``nvidia-smi`` samples
    the GPU every 100 ms: milliseconds per call and the median board power (W) and SM clock
    (MHz) over the samples, the first and last few (ramps) left out, with the throttle
    reasons seen (``0x4``: the software power cap). A GPU's speed at its power cap is work
    over energy per unit of work: two kernels at the cap differ in energy, not in clocks."""
    jax.block_until_ready(fn(*args))
    per_call = _loop(fn, args, 10)
    calls = max(10, int(seconds * 1e3 / per_call))
    query = "power.draw,clocks.sm,clocks_throttle_reasons.active"
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ms = _loop(fn, args, calls)
    finally:
        smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].strip().splitlines()[3:-2]]
    if not rows:
        raise RuntimeError(f"nvidia-smi gave no samples over {calls} calls of {per_call:.3f} ms")
    return dict(
        ms=ms,
        watts=statistics.median(float(r[0]) for r in rows),
        sm_mhz=statistics.median(float(r[1]) for r in rows),
        throttle_reasons=sorted({r[2] for r in rows}),
    )


def results_path(filename: str) -> Path:
    """Where a record file goes: ``$OUT/filename`` if ``$OUT`` is set, else
    ``benchmarks/results/filename``."""
    out = os.environ.get("OUT")
    return (Path(out) if out else RESULTS) / filename


def record(
    suite: str,
    case: str,
    impl: str,
    baseline: str,
    ms: float,
    baseline_ms: float | None,
    **fields: Any,
) -> dict[str, Any]:
    """One record of the benchmarks' common schema: the device family, the jax version, both
    times and ``ratio = baseline_ms / ms`` (above 1: ``impl`` is faster; None where the
    baseline did not run), then ``fields``."""
    return dict(
        suite=suite,
        case=case,
        device=device_name(family=True),
        jax=jax.__version__,
        impl=impl,
        baseline=baseline,
        ms=ms,
        baseline_ms=baseline_ms,
        ratio=None if baseline_ms is None else baseline_ms / ms,
        **fields,
    )


def write_records(path: str | os.PathLike, records: list[dict[str, Any]]) -> Path:
    """Writes ``records`` as a JSON list (one key per line) and returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def module_from_file(path: str | os.PathLike, name: str):
    """The module in ``path`` (another tree's copy of a kernel module, for an A/B in one
    process), imported as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod
