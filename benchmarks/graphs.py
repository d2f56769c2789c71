"""Graph benchmarks: what ``ts.graph`` rewrites buy, one section per feature.

Runs on the GPU machine, one process::

    PYTHONUNBUFFERED=1 python3 benchmarks/graphs.py [--section attention] [--json PATH]

Section ``attention`` (:func:`bench_attention`): seed 004's attention module, written as
``ts.matmul → scale → causal mask → ts.softmax → ts.matmul`` over ``(batch, seq, heads,
dim)`` inputs, run as written (``graph:unrewritten``, the module with no passes), as the
attention fusion rewrites it (``graph:rewritten``) and ``ts.flash_attention`` called
directly (the baseline), forward only, bf16, causal and not. Every implementation is
checked against the direct call before it is timed, and the rewritten graph's operators
are recorded (``rewritten_ops``: one ``ts_flash_attention_fwd``). FLOPs: ``4·B·S²·H·D``,
halved when causal. Timing: ``benchmarks/_common.time_interleaved``.

Section ``capture`` (:func:`bench_capture`): 100 small ts operators on a 64x64 array,
dispatched eagerly (one dispatch each) against the same sequence captured with
``ts.graph.capture`` and replayed by ``ts.graph.launch`` (one compiled program), with XLA's
command buffers (CUDA graphs) on and off, and ``ts.jit(capture_graph=True/False)`` of the
same function. Eager time is nearly all dispatch at this size; ``ratio`` = eager time /
variant time, target >= 2. Each record says which command-buffer option it compiled with
(``command_buffer``: they are built from the compiled thunks, so only the timing shows them).

Records ``{suite: "graphs", section, case, device, jax, impl, baseline, ms,
baseline_ms, ratio = baseline_ms / ms, rel_err, …}`` go to
``graphs-<device>.json``, merged with the records of the file's other sections.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import tessera_jax as ts  # noqa: E402
from benchmarks._common import (  # noqa: E402
    device_name,
    normal,
    record,
    results_path,
    time_interleaved,
    write_records,
)

# (batch, seq, heads, head_dim) of the target.
ATTENTION_SHAPES = [(4, 4096, 16, 128)]


def attention_module(causal: bool) -> ts.graph.GraphModule:
    """Seed 004's attention over ``(batch, seq, heads, dim)`` inputs, as a user writes it:
    heads moved before the sequence for the two products, then moved back."""

    @ts.graph.module("attention")
    def attention(q, k, v):
        qh = q.transpose(0, 2, 1, 3)  # (B, H, S, D)
        kt = k.transpose(0, 2, 3, 1)  # (B, H, D, S): K.T per head
        vh = v.transpose(0, 2, 1, 3)
        s = ts.matmul(qh, kt) * (1.0 / math.sqrt(q.shape[-1]))
        if causal:
            n = s.shape[-1]
            s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
        a = ts.softmax(s, axis=-1)
        return ts.matmul(a, vh).transpose(0, 2, 1, 3)

    return attention


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def bench_attention(shapes=ATTENTION_SHAPES, dtype=jnp.bfloat16) -> list[dict]:
    """Unrewritten vs rewritten graph vs ``ts.flash_attention``; one record per impl."""
    records = []
    for b, s, h, d in shapes:
        q, k, v = (normal(i, (b, s, h, d), dtype) for i in range(3))
        for causal in (False, True):
            module = attention_module(causal)
            graph = module.lower(q, k, v)
            direct = jax.jit(lambda q, k, v, c=causal: ts.flash_attention(q, k, v, causal=c))
            fns = {"graph:rewritten": jax.jit(module), "ts.flash_attention": direct}
            slow = {"graph:unrewritten": jax.jit(module.with_passes(()))}
            ref = direct(q, k, v)
            errs = {name: _rel(f(q, k, v), ref) for name, f in {**fns, **slow}.items()}
            # The two programs that should be as fast are interleaved with each other only:
            # the unrewritten graph moves gigabytes of scores per call, which would heat the
            # GPU during the others' turns.
            times = time_interleaved(fns, (q, k, v), repeats=9)
            times.update(time_interleaved(slow, (q, k, v), repeats=3))
            flops = 4 * b * s * s * h * d / (2 if causal else 1)
            case = f"attention-{jnp.dtype(dtype).name}-{b}x{s}x{h}x{d}-" + (
                "causal" if causal else "full"
            )
            base = times["ts.flash_attention"]
            for name, ms in times.items():
                rec = record(
                    "graphs",
                    case,
                    name,
                    "ts.flash_attention",
                    ms,
                    base,
                    section="attention",
                    tflops=flops / ms / 1e9,
                    rel_err=errs[name],
                )
                if name == "graph:rewritten":
                    rec["rewritten_ops"] = list(graph.ts_ops)
                records.append(rec)
    return records


def _ops(x, w):
    """100 small ts operators: 25 rounds of matmul, tanh, relu and a row softmax (the
    scale of ``w`` keeps the values in range)."""
    h = x
    for _ in range(25):
        h = ts.softmax(ts.relu(ts.tanh(ts.matmul(h, w))), axis=1)
    return h


def bench_capture(*, size: int = 64, dtype=jnp.float32, repeats: int = 9) -> list[dict]:
    """The "capture" section's records: eager against replayed (command buffers on and
    off), and ``ts.jit(capture_graph=...)``, for :func:`_ops` on ``size``-square arrays."""
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
        name = f"ts.graph.launch{impl[6:]}" if impl.startswith("replay") else impl
        records.append(
            record(
                "graphs",
                case,
                name,
                "eager",
                ms,
                t["eager"],
                section="capture",
                rel_err=errs[impl],
                command_buffer=command_buffer[impl],
            )
        )
    return records


SECTIONS = {"attention": bench_attention, "capture": bench_capture}


def merge_records(path: Path, records: list[dict]) -> Path:
    """Writes ``records`` to ``path``, keeping the file's records of other sections."""
    sections = {r["section"] for r in records}
    old = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in old if r.get("section") not in sections]
    return write_records(path, kept + records)


def _table(records: list[dict]) -> str:
    rows = [f"{'case':38s} {'impl':20s} {'ms':>9s} {'TFLOP/s':>8s} {'ratio':>6s} {'rel_err':>8s}"]
    for r in records:
        tflops = f"{r['tflops']:8.1f}" if "tflops" in r else f"{'-':>8s}"
        rows.append(
            f"{r['case']:38s} {r['impl']:20s} {r['ms']:9.3f} {tflops} "
            f"{r['ratio']:6.3f} {r['rel_err']:8.1e}"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    records = []
    for name in args.section or sorted(SECTIONS):
        records += SECTIONS[name]()
    print(_table(records))
    path = args.json or results_path(f"graphs-{device_name(family=True)}.json")
    print("wrote", merge_records(path, records))


if __name__ == "__main__":
    main()
