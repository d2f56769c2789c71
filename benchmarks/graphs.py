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

Records ``{suite: "graphs", section, case, device, jax, impl, baseline, ms,
baseline_ms, ratio = baseline_ms / ms, tflops, rel_err}`` go to
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
                rec = dict(
                    suite="graphs",
                    section="attention",
                    case=case,
                    device=device_name(family=True),
                    jax=jax.__version__,
                    impl=name,
                    baseline="ts.flash_attention",
                    ms=ms,
                    baseline_ms=base,
                    ratio=base / ms,
                    tflops=flops / ms / 1e9,
                    rel_err=errs[name],
                )
                if name == "graph:rewritten":
                    rec["rewritten_ops"] = list(graph.ts_ops)
                records.append(rec)
    return records


SECTIONS = {"attention": bench_attention}


def merge_records(path: Path, records: list[dict]) -> Path:
    """Writes ``records`` to ``path``, keeping the file's records of other sections."""
    sections = {r["section"] for r in records}
    old = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in old if r.get("section") not in sections]
    return write_records(path, kept + records)


def _table(records: list[dict]) -> str:
    rows = [f"{'case':38s} {'impl':20s} {'ms':>9s} {'TFLOP/s':>8s} {'ratio':>6s} {'rel_err':>8s}"]
    for r in records:
        rows.append(
            f"{r['case']:38s} {r['impl']:20s} {r['ms']:9.3f} {r['tflops']:8.1f} "
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
    path = args.json or results_path(f"graphs-{device_name()}.json")
    print("wrote", merge_records(path, records))


if __name__ == "__main__":
    main()
