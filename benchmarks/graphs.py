"""Operator graphs: capture and replay against eager dispatch.

Section "capture" (:func:`bench_capture`): a sequence of 100 small ts operators on a
64x64 array, dispatched eagerly (one dispatch each) against the same sequence captured
with ``ts.graph.capture`` and replayed by ``ts.graph.launch`` (one compiled program), with
XLA's command buffers (CUDA graphs) on and off. Eager time is nearly all dispatch at this
size; the replay pays one launch of one program, so the target is ratio >= 2 (``ratio`` =
eager time / replay time). ``ts.jit(capture_graph=True/False)`` of the same function is
timed too: it is the same program, with the same command-buffer option.

    python benchmarks/graphs.py        # records: benchmarks/results/graphs-<device>.json

Records of the other sections already in that file are kept: each section replaces only
its own records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts
from benchmarks._common import (
    RESULTS,
    device_name,
    normal,
    results_path,
    time_interleaved,
    write_records,
)


def _ops(x, w):
    """100 small ts operators: 25 rounds of matmul, tanh, relu and a row softmax (the
    scale of ``w`` keeps the values in range)."""
    h = x
    for _ in range(25):
        h = ts.softmax(ts.relu(ts.tanh(ts.matmul(h, w))), axis=1)
    return h


def bench_capture(
    *, size: int = 64, dtype=jnp.float32, repeats: int = 9, device: str | None = None
) -> list[dict]:
    """The "capture" section's records: eager against replayed (command buffers on and
    off), and ``ts.jit(capture_graph=...)``, for :func:`_ops` on ``size``-square arrays."""
    device = device or device_name()
    x = normal(0, (size, size), dtype)
    w = normal(1, (size, size), dtype, scale=size**-0.5)
    x2 = normal(2, (size, size), dtype)
    n_ops = 100
    graphs = {}
    for cb in (True, False):
        with ts.graph.capture(x=x, w=w, command_buffer=cb) as g:
            last = _ops(x, w)
        assert len(g) == n_ops, g.ops
        g.set_outputs(last)  # only the last result, the one the eager loop keeps
        graphs[cb] = g
    # The same graph returning all 100 results (the default), which the program must write.
    with ts.graph.capture(x=x, w=w) as g_all:
        _ops(x, w)
    jits = {cb: ts.jit(_ops, capture_graph=cb) for cb in (True, False)}
    plain = jax.jit(_ops)
    fns = {
        "eager": lambda: _ops(x2, w),
        "replay[command_buffer]": lambda: ts.graph.launch(graphs[True], x=x2)[-1],
        "replay[no_command_buffer]": lambda: ts.graph.launch(graphs[False], x=x2)[-1],
        "replay[command_buffer,all_outputs]": lambda: ts.graph.launch(g_all, x=x2)[-1],
        "ts.jit[capture_graph=True]": lambda: jits[True](x2, w),
        "ts.jit[capture_graph=False]": lambda: jits[False](x2, w),
        "jax.jit[xla_default]": lambda: plain(x2, w),
    }
    # The command-buffer option each variant compiles with. (XLA builds command buffers
    # from the compiled thunks: they do not show in the optimized HLO, only in the timing.)
    gpu = jax.default_backend() == "gpu"
    command_buffer = {impl: "on" if gpu else "none on this backend" for impl in fns}
    if gpu:
        command_buffer["replay[no_command_buffer]"] = "off"
        command_buffer["ts.jit[capture_graph=False]"] = "off"
        command_buffer["jax.jit[xla_default]"] = "xla default"
    # Correct first: every variant against the eager sequence on new inputs.
    ref = np.asarray(fns["eager"](), np.float64)
    errs = {}
    for impl, f in fns.items():
        out = np.asarray(f(), np.float64)
        errs[impl] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        assert errs[impl] < 1e-3, (impl, errs[impl])

    t = time_interleaved(fns, (), repeats=repeats)
    case = f"capture-{n_ops}ops-{size}x{size}-{jnp.dtype(dtype).name}"
    records = []
    for impl, ms in t.items():
        if impl == "eager":
            continue
        records.append(
            dict(
                suite="graphs",
                case=case,
                device=device,
                jax=jax.__version__,
                impl=f"ts.graph.launch{impl[6:]}" if impl.startswith("replay") else impl,
                baseline="eager",
                ms=ms,
                baseline_ms=t["eager"],
                ratio=t["eager"] / ms,
                rel_err=errs[impl],
                command_buffer=command_buffer[impl],
            )
        )
    return records


def merge_section(path, records: list[dict], prefix: str) -> list[dict]:
    """The records already in ``path`` (the repository's copy when ``path`` is not there
    yet) whose case does not start with ``prefix``, followed by ``records``."""
    old = []
    for p in (path, RESULTS / os.path.basename(path)):
        if os.path.exists(p):
            old = json.loads(open(p).read())
            break
    return [r for r in old if not str(r.get("case", "")).startswith(prefix)] + records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="the record file (default: results/graphs-<device>.json)")
    p.add_argument("--section", choices=["capture"], default="capture")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    device = device_name(family=True)
    path = args.json or results_path(f"graphs-{device}.json")
    records = bench_capture(repeats=args.repeats, device=device)
    print(f"{'case':28s} {'impl':42s} {'ms':>8s} {'eager ms':>9s} {'ratio':>6s}  command buffer")
    for r in records:
        print(
            f"{r['case']:28s} {r['impl']:42s} {r['ms']:8.4f} {r['baseline_ms']:9.4f} "
            f"{r['ratio']:6.2f}  {r['command_buffer']}"
        )
    print("written:", write_records(path, merge_section(path, records, "capture-")))


if __name__ == "__main__":
    main()
