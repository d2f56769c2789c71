"""Where a decoding step's forward+backward spends its time inside one program (H200).

Sections (``python benchmarks/archive/decode_bwd_chain_probe.py SECTION``):

``chain``   ``ts.flash_attention`` (``auto``) and jax.nn's XLA path, forward+backward at
            decode shapes, 16 calls chained in one program (``benchmarks/_common.
            time_in_graph``): time per call, and ``ts.profile``'s device span, kernel time
            and kernel count per call. Run it twice, the second time with
            ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` (XLA's CUDA graphs off).
``split``   ``attention_mgpu.flash_bwd`` alone, chained the same way, per ``dq_split_keys``
            (key chunks per CTA, summed after in key order) against no split.
``thunks``  One forward+backward call of each, compiled with ``--xla_dump_to``: prints
            XLA's thunk sequence after its thunk passes (what runs, and in which command
            buffer).
``delta``   The backward's Δ from ``norms_gpu.row_dot(..., seq_pad=)`` (head-major and
            padded by the row kernel) against the row kernel's plain rows transposed and
            padded by XLA: the same bits or not.
``ab``      ``ts_auto``'s forward+backward with each of those two forms of Δ (the old one
            patched into ``attention_mgpu.row_delta`` while its program traces), beside
            XLA, chained in one program each, timed interleaved in one process.
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as ts
from benchmarks import attention as A
from benchmarks._common import chained, time_in_graph
from tessera_jax.pallas_kernels import attention_mgpu as am
from tessera_jax.pallas_kernels import norms_gpu

D = 128


def _operands(b, sq, skv, h):
    q, do = A.rand(0, (b, sq, h, D), A.BF16), A.rand(3, (b, sq, h, D), A.BF16)
    k, v = A.rand(1, (b, skv, h, D), A.BF16), A.rand(2, (b, skv, h, D), A.BF16)
    return q, k, v, do


def _impls():
    return {
        "ts_auto": A._fwdbwd(functools.partial(A._ts, causal=False)),
        "xla": A._fwdbwd(functools.partial(A._jax_nn, causal=False, implementation="xla")),
    }


def chain():
    tag = os.environ.get("XLA_FLAGS", "default flags")
    for b, sq, skv, h in [(1, 1, 512, 8), (4, 1, 256, 16)]:
        q, k, v, do = _operands(b, sq, skv, h)
        sets = [(q, *kv, do) for kv in A._kv_sets(k, v)]
        calls = max(len(sets), 8)
        for name, fn in _impls().items():
            run = jax.jit(chained(fn, calls, A._chain(True)))
            p = ts.profile(run, tuple(tuple(s) for s in sets), steps=10, warmup=3)
            ms = time_in_graph({name: fn}, sets, A._chain(True), repeats=5, target_ms=40)[name]
            kernels = sum(x.time_s for x in p.kernels) / calls * 1e6
            n = sum(x.calls for x in p.kernels) / calls
            print(
                f"{tag:34s} b{b} sq{sq} skv{skv} h{h} {name:8s} in_graph {ms * 1e3:6.1f} us/call"
                f" | profile: device {p.device_s / calls * 1e6:6.1f} kernels {kernels:6.1f} us,"
                f" {n:.1f} kernels/call",
                flush=True,
            )


def split():
    shapes = [(1, 8, 8, 1, 256), (1, 8, 8, 1, 512), (1, 8, 8, 16, 256), (1, 8, 8, 16, 512)]
    shapes += [(4, 16, 16, 1, 256), (4, 16, 16, 16, 512), (1, 8, 8, 1, 1024)]
    shapes += [(1, 8, 8, 16, 2048), (4, 16, 16, 1, 1024), (1, 32, 8, 1, 512)]
    for b, h, hkv, sq, skv in shapes:
        case = f"b{b}-h{h}-hkv{hkv}-sq{sq}-skv{skv}"
        spec, args, sets = A._decode_operands(b, sq, skv, h, hkv, D, True)
        splits = [None] + [n for n in (64, 128, 256, 512, 1024) if n < skv]
        fns = {
            f"split={n}": jax.jit(functools.partial(am.flash_bwd, spec, dq_split_keys=n))
            for n in splits
        }
        A._time_variants(case, fns, args, "split=None", None, sets, A._next_do)


def thunks():
    if os.environ.get("PROBE_IMPL") is None:  # one process per implementation
        for name in _impls():
            with tempfile.TemporaryDirectory() as d:
                env = dict(os.environ, PROBE_IMPL=name, XLA_FLAGS=f"--xla_dump_to={d}")
                subprocess.run([sys.executable, __file__, "thunks"], env=env, check=True)
                (path,) = glob.glob(f"{d}/*jit_g.thunk_sequence_after_thunk_passes.txt")
                print(f"==== {name}\n{Path(path).read_text()}", flush=True)
        return
    q, k, v, do = _operands(1, 1, 512, 8)
    jax.jit(_impls()[os.environ["PROBE_IMPL"]]).lower(q, k, v, do).compile()


def _delta_transposed_and_padded(out, dout, interpret=False, seq_pad=None):
    rows = jnp.swapaxes(norms_gpu.row_dot(out, dout, interpret=interpret), 1, 2)
    pad = (seq_pad or out.shape[1]) - out.shape[1]
    return jnp.pad(rows, ((0, 0), (0, 0), (0, pad)))


def delta():
    shapes = [((1, 1, 8, 128), 128), ((4, 16, 16, 128), 128), ((2, 200, 4, 64), 256)]
    shapes += [((1, 300, 2, 256), 384), ((2, 4096, 16, 128), 4096), ((1, 64, 32, 128), 128)]
    for shape, pad in shapes:
        o, do = A.rand(1, shape, A.BF16), A.rand(2, shape, A.BF16)
        old = jax.jit(functools.partial(_delta_transposed_and_padded, seq_pad=pad))(o, do)
        new = jax.jit(functools.partial(norms_gpu.row_dot, seq_pad=pad))(o, do)
        same = np.array_equal(np.asarray(old).view(np.uint32), np.asarray(new).view(np.uint32))
        print(f"delta bits {shape} pad {pad}: {'SAME' if same else 'DIFFERENT'}", flush=True)


def ab():
    forms = {"new": am.row_delta, "old": _delta_transposed_and_padded, "xla": am.row_delta}
    for b, sq, skv, h in [(1, 1, 256, 8), (4, 1, 256, 16), (1, 16, 512, 8), (4, 16, 512, 16)]:
        q, k, v, do = _operands(b, sq, skv, h)
        sets = [(q, *kv, do) for kv in A._kv_sets(k, v)]
        fns = {"new": _impls()["ts_auto"], "old": _impls()["ts_auto"], "xla": _impls()["xla"]}

        def jit(name, program):
            am.row_delta = forms[name]
            try:
                compiled = jax.jit(program).lower(tuple(tuple(s) for s in sets)).compile()
                print(f"   {name}: {compiled.as_text().count(' fusion(')} fusions", flush=True)
                return compiled
            finally:
                am.row_delta = forms["new"]

        ms = time_in_graph(fns, sets, A._chain(True), jit=jit, repeats=7, target_ms=40)
        new, old, xla = (ms[n] * 1e3 for n in ("new", "old", "xla"))
        print(
            f"b{b} sq{sq} skv{skv} h{h}: new {new:.1f} us, old {old:.1f} us, xla {xla:.1f} us;"
            f" new/old speedup {old / new:.3f}, vs xla new {xla / new:.3f} old {xla / old:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    sections = {"chain": chain, "split": split, "thunks": thunks, "delta": delta, "ab": ab}
    sections[sys.argv[1]]()
