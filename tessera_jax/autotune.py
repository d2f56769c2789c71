"""Autotuning: time a kernel over a space of tuning parameters, keep the fastest, cache it.

``ts.autotune.search(kernel=…, args=(…), params={name: [values]})`` returns the winning
config as a dict. What it does, in order:

1. Looks up the JSON cache under :func:`cache_dir` for the key (kernel name, the key of
   ``args`` — shapes and dtypes —, device kind, jax version). A valid entry tuned over
   the same space is returned without timing anything.
2. Otherwise enumerates the product of ``params`` and asks the kernel's ``check`` of each
   config first: a config that cannot fit (shared memory, registers) is pruned before
   anything is compiled.
3. Runs each remaining config once (compilation: a config whose ``run`` raises is skipped
   with a warning and listed in the report), warms it up, and times repeats of it on the
   device, each ended by ``jax.block_until_ready``; the objective is the median.
4. Writes the winner atomically (a temporary file renamed over the entry) and returns it.

A kernel is either a plain callable, tuned as ``kernel(*args, **config)`` without pruning,
or an object with a ``__tessera_tunable__()`` method returning a :class:`Tunable` (its
name, its cache key, its fit check and how to run a config); ``ts.op.matmul`` is one, with
params ``BM``, ``BN``, ``BK`` (its ``tile_shape``) and optionally ``stages``.

The ts operators read the same cache when they choose a kernel config
(:func:`lookup`): the call is cheap enough for trace time, since each entry file is parsed
once and then kept in memory for as long as its modification time is unchanged. A config
is chosen when a function is lowered; functions already compiled keep theirs.

The cache is one small JSON file per entry, never pickle. Every entry is validated when
read (schema, version, the key it claims, the types of the config); a corrupt or foreign
entry is ignored with a :class:`CacheWarning` and re-tuned.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

try:  # a declared dependency, but `import tessera_jax` must not fail where it is missing
    import tqdm
except ImportError:  # pragma: no cover - environments without tqdm
    tqdm = None

__all__ = [
    "CacheWarning",
    "SearchReport",
    "Tunable",
    "TunedConfig",
    "cache_dir",
    "lookup",
    "search",
    "trial",
]

OBJECTIVES = ("runtime",)
SCHEMA = "tessera_jax.autotune"
VERSION = 1
_SCALARS = (bool, int, float, str, type(None))


class CacheWarning(UserWarning):
    """A cache entry was unreadable, foreign or not writable; the search re-tunes."""


@dataclasses.dataclass(frozen=True)
class Tunable:
    """How :func:`search` tunes one kernel (what ``kernel.__tessera_tunable__()`` returns).

    Any object with these four attributes will do; this dataclass is the ready-made one.

    Attributes:
      name: the kernel's name in the cache (stable across processes: ``"ts.matmul"``).
      key: ``key(args) -> tuple`` of what makes two problems different for tuning (shapes,
        dtypes, flags): ints, floats, strings, bools, None, dtypes and nested tuples/lists.
      check: ``check(args, config) -> str | None``: why ``config`` cannot run on ``args``
        (shared memory, registers, instruction shapes), or None. Called before compiling.
      run: ``run(args, config) -> outputs``: compiles (on the first call) and runs the
        kernel with ``config``; an exception means the config fails to compile or run.
    """

    name: str
    key: Callable[[tuple], tuple]
    check: Callable[[tuple, dict], str | None]
    run: Callable[[tuple, dict], Any]


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """What one :func:`search` did.

    Attributes:
      kernel: the tunable's name.
      key: the cache key of the arguments (JSON form), device kind and jax version aside.
      path: the cache entry's file.
      cached: the config came from the cache (nothing was timed).
      timings: ``(config, median seconds)`` of every config that ran, in search order.
      pruned: ``(config, reason)`` of the configs ``check`` rejected before compiling.
      failed: ``(config, error)`` of the configs whose ``run`` raised.
    """

    kernel: str
    key: Any
    path: Path
    cached: bool
    timings: tuple[tuple[dict, float], ...] = ()
    pruned: tuple[tuple[dict, str], ...] = ()
    failed: tuple[tuple[dict, str], ...] = ()


class TunedConfig(dict):
    """The winning config (a plain ``dict`` of parameter values) with its :attr:`report`."""

    def __init__(self, config: Mapping[str, Any], report: SearchReport):
        super().__init__(config)
        self.report = report


# --- the cache ----------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where tuned configs live: ``$TESSERA_CACHE_DIR``, else ``$XDG_CACHE_HOME/tessera_jax``,
    else ``~/.cache/tessera_jax`` (read on every call, so the variable can change)."""
    env = os.environ.get("TESSERA_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tessera_jax"


def _jsonable(x: Any, what: str) -> Any:
    """``x`` in its JSON form (tuples as lists, dtypes as names), or a TypeError."""
    if isinstance(x, (bool, str, type(None))):
        return x
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x)
    if isinstance(x, (tuple, list)):
        return [_jsonable(v, what) for v in x]
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return np.dtype(x).name
    raise TypeError(
        f"autotune: {what} holds {x!r} of type {type(x).__name__}; a key is built of ints, "
        "floats, strings, bools, None, dtypes and tuples of those"
    )


def device_kind() -> str:
    """The kind of this process's first device (``"NVIDIA H100 80GB HBM3"``, ``"cpu"``)."""
    return str(jax.devices()[0].device_kind)


def _identity(name: str, key: Any) -> dict[str, Any]:
    """The fields an entry must carry to belong to ``(name, key)`` here."""
    return {
        "kernel": name,
        "key": _jsonable(key, f"the key of {name}"),
        "device_kind": device_kind(),
        "jax_version": jax.__version__,
    }


def entry_path(name: str, key: Any) -> Path:
    """The cache file of ``(name, key)`` on this device and jax version."""
    ident = _identity(name, key)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return cache_dir() / "autotune" / f"{stem}-{digest}.json"


def _invalid(entry: Any, ident: dict[str, Any]) -> str | None:
    """Why ``entry`` is not a well-formed entry of ``ident`` (None if it is)."""
    if not isinstance(entry, dict):
        return f"not a JSON object but {type(entry).__name__}"
    if entry.get("schema") != SCHEMA or entry.get("version") != VERSION:
        return (
            f"schema {entry.get('schema')!r} version {entry.get('version')!r}, not "
            f"{SCHEMA!r} version {VERSION}"
        )
    for field, want in ident.items():
        if entry.get(field) != want:
            return f"it is an entry of {field}={entry.get(field)!r}, not {want!r}"
    space, config = entry.get("space"), entry.get("config")
    if not isinstance(space, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(x, _SCALARS) for x in v)
        for k, v in space.items()
    ):
        return "its space is not a mapping of names to lists of scalars"
    if not isinstance(config, dict) or set(config) != set(space):
        return "its config does not name the parameters of its space"
    for k, v in config.items():
        # JSON has no tuples or ints-as-floats: a value must be one of its space, type included.
        if not any(type(v) is type(x) and v == x for x in space[k]):
            return f"its config {k}={v!r} is not one of its space's values {space[k]}"
    runtime = entry.get("runtime_s")
    if not isinstance(runtime, (int, float)) or isinstance(runtime, bool) or not runtime >= 0:
        return f"its runtime_s={runtime!r} is not a non-negative number"
    return None


# Parsed entries by path: (mtime_ns, size, config or None). Trace-time lookups stat the file
# and parse it only when it changed; an invalid file is remembered too, so it warns once.
_MEMO: dict[Path, tuple[int, int, dict | None]] = {}
_MEMO_LOCK = threading.Lock()


def _read(path: Path, ident: dict[str, Any]) -> dict | None:
    """The valid entry at ``path`` for ``ident``, or None (missing; or invalid, with a
    :class:`CacheWarning` the first time this version of the file is seen)."""
    try:
        st = path.stat()
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    with _MEMO_LOCK:
        memo = _MEMO.get(path)
    if memo is not None and memo[:2] == stamp:
        return memo[2]
    try:
        entry = json.loads(path.read_text())
        why = _invalid(entry, ident)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        entry, why = None, f"unreadable JSON ({type(e).__name__}: {e})"
    if why is not None:
        warnings.warn(
            f"autotune: ignoring the cache entry {path} of {ident['kernel']}: {why}; it is "
            "tuned again",
            CacheWarning,
            stacklevel=3,
        )
        entry = None
    with _MEMO_LOCK:
        _MEMO[path] = (*stamp, entry)
    return entry


def _write(path: Path, entry: dict) -> None:
    """Writes ``entry`` atomically: a temporary file in the same folder, renamed over
    ``path``, so readers see the old entry or the new one, never half of one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
            st = path.stat()
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        warnings.warn(
            f"autotune: could not write the cache entry {path} ({e}); the winner is returned "
            "but not remembered",
            CacheWarning,
            stacklevel=3,
        )
        return
    with _MEMO_LOCK:  # what was just written is what this process reads next
        _MEMO[path] = (st.st_mtime_ns, st.st_size, entry)


# The config a Tunable's ``run`` is trying, as (name, JSON key, config): inside
# :func:`trial`, :func:`lookup` answers it for that problem, so an operator is timed through
# the very path by which it later reads the cached winner.
_TRIAL: contextvars.ContextVar[tuple[str, Any, dict] | None] = contextvars.ContextVar(
    "tessera_autotune_trial", default=None
)


@contextlib.contextmanager
def trial(name: str, key: Any, config: Mapping[str, Any]):
    """Within this context, :func:`lookup` of ``(name, key)`` returns ``config`` instead of
    the cache. A Tunable's ``run`` uses it to trace an operator with a candidate config;
    the operator must be traced afresh inside it (a new ``jax.jit``), since jax's
    compilation caches do not see the context."""
    token = _TRIAL.set((name, _jsonable(key, f"the key of {name}"), dict(config)))
    try:
        yield
    finally:
        _TRIAL.reset(token)


def lookup(name: str, key: Any) -> dict | None:
    """The cached config of kernel ``name`` for problem ``key`` on this device and jax
    version (or the one under :func:`trial`), or None. Cheap (one ``stat`` when the file
    is unchanged): operators call it at trace time to pick their config."""
    tried = _TRIAL.get()
    if tried is not None and tried[0] == name and tried[1] == _jsonable(key, "key"):
        return dict(tried[2])
    ident = _identity(name, key)
    entry = _read(entry_path(name, key), ident)
    return None if entry is None else dict(entry["config"])


# --- kernels ------------------------------------------------------------------------------


def _leaf_key(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return [list(map(int, x.shape)), np.dtype(x.dtype).name]
    return type(x).__name__


def _callable_tunable(fn: Callable[..., Any]) -> Tunable:
    """A plain callable as a Tunable: ``fn(*args, **config)``, keyed by the shapes and
    dtypes of the array leaves of ``args`` (the types of other leaves), no pruning."""
    name = f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', repr(fn))}"
    return Tunable(
        name=name,
        key=lambda args: tuple(_leaf_key(x) for x in jax.tree.leaves(args)),
        check=lambda args, config: None,
        run=lambda args, config: fn(*args, **config),
    )


def as_tunable(kernel: Any) -> Tunable:
    """``kernel``'s Tunable: ``kernel.__tessera_tunable__()`` where it has one, else the
    plain-callable one. TypeError for anything else."""
    make = getattr(kernel, "__tessera_tunable__", None)
    if make is not None:
        t = make()
        missing = [a for a in ("key", "check", "run") if not callable(getattr(t, a, None))]
        if not isinstance(getattr(t, "name", None), str) or missing:
            raise TypeError(
                f"autotune.search: kernel.__tessera_tunable__() returned {t!r}, which is not a "
                "Tunable (a str name and callables key, check and run)"
            )
        return t
    if callable(kernel):
        return _callable_tunable(kernel)
    raise TypeError(
        f"autotune.search: kernel={kernel!r} must be a callable or have __tessera_tunable__"
    )


# --- search -------------------------------------------------------------------------------


def _check_params(params: Any) -> dict[str, list]:
    if not isinstance(params, Mapping) or not params:
        raise ValueError(
            f"autotune.search: params={params!r} must be a non-empty dict of parameter names "
            "to lists of values"
        )
    out = {}
    for name, values in params.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"autotune.search: parameter name {name!r} must be an identifier")
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(
                f"autotune.search: params[{name!r}]={values!r} must be a non-empty list of values"
            )
        vals = []
        for v in values:
            if isinstance(v, np.generic):
                v = v.item()
            if not isinstance(v, _SCALARS):
                raise TypeError(
                    f"autotune.search: params[{name!r}] holds {v!r} of type "
                    f"{type(v).__name__}; values are ints, floats, strings, bools or None "
                    "(they are stored as JSON)"
                )
            vals.append(v)
        if len({(type(v), v) for v in vals}) != len(vals):
            raise ValueError(f"autotune.search: params[{name!r}]={values!r} repeats a value")
        out[name] = vals
    return out


def _positive_int(fn: str, name: str, v: Any) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{fn}: {name}={v!r} must be a positive int")
    return int(v)


def _configs(space: dict[str, list]) -> Iterator[dict]:
    names = list(space)
    for values in itertools.product(*space.values()):
        yield dict(zip(names, values))


def _in_space(config: dict, space: dict[str, list]) -> bool:
    return set(config) == set(space) and all(
        any(type(v) is type(x) and v == x for x in space[k]) for k, v in config.items()
    )


def _time(
    run: Callable[[], Any], *, warmup: int, repeats: int, min_time: float, timer: Callable
) -> float:
    """Median seconds of one ``run()`` (already compiled): ``warmup`` calls, then
    ``repeats`` measurements of enough back-to-back calls to last ``min_time`` seconds
    (launch overhead amortised over short kernels), each ended by block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(run())
    t0 = timer()
    jax.block_until_ready(run())
    once = max(timer() - t0, 1e-9)
    number = max(1, min(1000, math.ceil(min_time / once)))
    samples = []
    for _ in range(repeats):
        t0 = timer()
        for _ in range(number):
            out = run()
        jax.block_until_ready(out)
        samples.append((timer() - t0) / number)
    return statistics.median(samples)


class _Progress:
    """A progress bar over the configs: tqdm's, or plain lines on stderr without tqdm."""

    def __init__(self, total: int, desc: str, *, enabled: bool):
        self.total, self.desc, self.enabled, self.done = total, desc, enabled, 0
        self.bar = None
        if enabled and tqdm is not None:
            self.bar = tqdm.tqdm(total=total, desc=desc, unit="config")

    def step(self, what: str) -> None:
        """Marks the previous config done and names the one starting."""
        if self.bar is not None:
            self.bar.update(int(self.done > 0))
            self.bar.set_postfix_str(what)
        elif self.enabled:
            print(f"{self.desc}: {self.done + 1}/{self.total} {what}", file=sys.stderr)
        self.done += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(int(self.done > 0))
            self.bar.close()


def _error_text(e: BaseException) -> str:
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}"


def search(
    *,
    kernel: Any,
    args: Sequence[Any],
    params: Mapping[str, Sequence[Any]],
    objective: str = "runtime",
    warmup: int = 2,
    repeats: int = 7,
    min_time: float = 1e-3,
    cache: bool = True,
    progress: bool = True,
    timer: Callable[[], float] = time.perf_counter,
) -> TunedConfig:
    """The fastest config of ``kernel`` on ``args`` over the product of ``params``.

    Arguments:
      kernel: a plain callable, run as ``kernel(*args, **config)``, or an object with
        ``__tessera_tunable__()`` returning a :class:`Tunable` (``ts.op.matmul``: params
        ``BM``, ``BN``, ``BK``, optionally ``stages``).
      args: the arguments to tune on (a tuple); their shapes and dtypes key the cache.
      params: ``{name: [values]}``; every combination is a config. Values are JSON
        scalars (ints, floats, strings, bools, None).
      objective: what to minimise; only ``"runtime"`` (median seconds per call).
      warmup, repeats: calls before timing, and timed measurements (the median is kept).
      min_time: seconds each measurement lasts at least (several calls for short kernels).
      cache: read and write the cache (False: always time, remember nothing).
      progress: show a progress bar over the configs (tqdm, on stderr; without tqdm
        installed, one line per config).
      timer: the clock, in seconds (``time.perf_counter``).
    Returns:
      a :class:`TunedConfig`: a dict ``{name: value}`` of the winner, with ``.report``.

    Raises RuntimeError when no config runs (each pruned or failing, with the reasons).
    """
    if objective not in OBJECTIVES:
        raise ValueError(
            f"autotune.search: objective={objective!r} is not supported; the objectives are "
            f"{OBJECTIVES}"
        )
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"autotune.search: args must be a tuple of the kernel's arguments, not "
            f"{type(args).__name__}"
        )
    space = _check_params(params)
    warmup = _positive_int("autotune.search", "warmup", warmup) if warmup else 0
    repeats = _positive_int("autotune.search", "repeats", repeats)
    if not isinstance(min_time, (int, float)) or isinstance(min_time, bool) or min_time < 0:
        raise ValueError(f"autotune.search: {min_time=!r} must be a non-negative number")
    args = tuple(args)
    t = as_tunable(kernel)
    key = t.key(args)
    ident = _identity(t.name, key)
    path = entry_path(t.name, key)

    if cache:
        entry = _read(path, ident)
        if entry is not None and entry["space"] == space and _in_space(entry["config"], space):
            report = SearchReport(t.name, ident["key"], path, cached=True)
            return TunedConfig(entry["config"], report)

    timings, pruned, failed = [], [], []
    configs = list(_configs(space))
    bar = _Progress(len(configs), f"autotune {t.name}", enabled=progress)
    for config in configs:
        bar.step(", ".join(f"{k}={v}" for k, v in config.items()))
        reason = t.check(args, config)
        if reason is not None:
            pruned.append((config, str(reason)))
            continue
        run = lambda config=config: t.run(args, config)
        try:
            jax.block_until_ready(run())  # compiles
        except Exception as e:
            failed.append((config, _error_text(e)))
            warnings.warn(
                f"autotune.search: {t.name} config {config} failed and is skipped: "
                f"{_error_text(e)}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        seconds = _time(run, warmup=warmup, repeats=repeats, min_time=min_time, timer=timer)
        timings.append((config, seconds))
    bar.close()

    if not timings:
        why = [f"{c}: pruned, {r}" for c, r in pruned] + [f"{c}: failed, {e}" for c, e in failed]
        raise RuntimeError(
            f"autotune.search: no config of {t.name} ran on these arguments: " + "; ".join(why)
        )
    best, seconds = min(timings, key=lambda cs: cs[1])  # the first of equals
    report = SearchReport(
        t.name, ident["key"], path, False, tuple(timings), tuple(pruned), tuple(failed)
    )
    if cache:
        entry = {
            "schema": SCHEMA,
            "version": VERSION,
            **ident,
            "objective": objective,
            "space": space,
            "config": best,
            "runtime_s": seconds,
        }
        _write(path, entry)
    return TunedConfig(best, report)
