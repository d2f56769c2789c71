"""Attention benchmark: ``ts.flash_attention`` (Hopper Mosaic GPU kernels) vs cuDNN vs XLA.

Runs on the GPU machine, one process, every implementation checked against an f32 XLA
reference before it is timed::

    PYTHONUNBUFFERED=1 python3 benchmarks/attention.py [--only SUBSTR ...] [--json PATH]
    PYTHONUNBUFFERED=1 python3 benchmarks/attention.py --sweep   # forward, then backward knobs
    PYTHONUNBUFFERED=1 python3 benchmarks/attention.py --sweep-fwd --only bf16  # forward only
    PYTHONUNBUFFERED=1 python3 benchmarks/attention.py --sweep-bwd --only d64   # backward only
    PYTHONUNBUFFERED=1 python3 benchmarks/attention.py --sweep-decode  # key chunks, decoding
    PYTHONUNBUFFERED=1 python3 benchmarks/attention.py --sweep-dq-dkv  # decode backwards
    PYTHONUNBUFFERED=1 python3 benchmarks/attention.py --power   # watts and clocks, D=128

Implementations: ``ts.flash_attention`` with ``TESSERA_KERNELS=pallas`` (the kernels of
``pallas_kernels/attention_mgpu.py``; ``impl = "mosaic_gpu"``) and with ``xla`` (the
blocked reference, what ``auto`` mode lowers to where the kernels are not preferred;
``impl = "ts_reference"``),
``jax.nn.dot_product_attention(implementation="cudnn")`` (the baseline) and
``implementation="xla"``; forward+backward cases also run cuDNN compiled with
``xla_gpu_deterministic_ops`` (``impl = "cudnn_deterministic"``: its deterministic backward).
Each case is forward (``fwd-…``) or forward+backward
(``fwdbwd-…``: the value and the three gradients of ``sum(out · dout)``), causal or not.
FLOPs: ``4·B·S²·H·D`` forward, halved when causal; forward+backward 3.5× that.
The feature cases (``fwd-noncausal-kvlen-…``, ``…-window-…``, ``…-decode-…``, short
sequences, head dims 96/80, decoding at head dim 64: :data:`FEATURE_CASES`) run
``ts.flash_attention`` in ``auto`` mode (``impl = "ts_auto"``) against
``jax.nn.dot_product_attention``'s default (``baseline = "xla"``), cuDNN where it takes
the case, on short shapes the kernels forced (``mosaic_gpu``), and on decode shapes,
whose forward ``auto`` mode runs in the Triton decode kernel
(``pallas_kernels/attention_decode.py``), the Mosaic GPU forward kernel called directly
(``mosaic_gpu``, forward only); on decode shapes shorter than the Mosaic forward's
``DECODE_MIN_KV`` the kernels forced (``ts_pallas``: beside ``ts_auto`` it shows whether
``auto``'s key-count thresholds hold) and the blocked reference (``ts_reference``,
forward only: the path the decode forward's thresholds weigh it against);
``--ref-blocks`` adds the reference per block size.
Besides the time, each record says whether three calls gave bitwise identical results
(``bitwise_repeatable``) and the compiled program's temporary memory (``temp_bytes``).
Timing: ``benchmarks/_common.time_interleaved`` (``timing = "per_call"``); the short and
decode cases and shapes under :data:`IN_GRAPH_FLOPS`, shorter than the host's dispatch of
a call, per call inside one program through several K/V caches
(``benchmarks/_common.time_in_graph``, ``"in_graph"``). Prints
a table last and writes JSON records ``{suite: "attention", case, device, jax, impl,
baseline, ms, baseline_ms, ratio = baseline_ms / ms, tflops, rel_err, bitwise_repeatable,
temp_bytes, timing}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.gpu import attention_mgpu as jax_fa3  # noqa: E402

import tessera_jax as ts  # noqa: E402
from benchmarks._common import (  # noqa: E402
    device_name,
    power_draw,
    record,
    results_path,
    rotation,
    time_in_graph,
    time_interleaved,
    write_records,
)
from benchmarks._common import normal as rand  # noqa: E402
from tessera_jax.contracts.attention import AttentionSpec  # noqa: E402
from tessera_jax.pallas_kernels import attention_decode as ad  # noqa: E402
from tessera_jax.pallas_kernels import attention_mgpu as am  # noqa: E402
from tessera_jax.primitives.attention import FlashAttentionConfig  # noqa: E402
from tessera_jax.primitives.attention import _prepare as _prepare_attention  # noqa: E402

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

# (batch, seq, heads, head_dim); every shape runs causal and not, fwd and fwd+bwd.
SHAPES = [
    (4, 4096, 16, 128),
    (4, 4096, 16, 64),
    (4, 4096, 16, 256),
    (16, 1024, 16, 128),
    (1, 16384, 16, 128),
    (2, 512, 8, 128),
    # head_dim 64 causal rows of 512 to 2048 keys: one wave, four tiles a CTA
    (32, 512, 16, 64),
    (16, 1024, 16, 64),
    (8, 2048, 16, 64),
]
BASELINE = "cudnn"
# The largest f32 score matrix (bytes) of a case whose error is measured against XLA's f32
# attention; beyond it, against the blocked reference's (``ts_reference`` in f32).
REF_SCORE_BYTES = 8 << 30

# The cases behind the promise that ``ts.flash_attention`` is never slower than
# ``jax.nn.dot_product_attention``'s default (XLA): each optional feature, decode shapes
# (a few queries against a long kv cache), short sequences and head dims the kernels do
# not take. Their baseline is XLA; cuDNN runs beside it where it accepts the case.
# (batch, seq_q, seq_kv, heads, head_dim, feature); every case runs fwd and fwd+bwd, and
# causal and not except decode (jax.nn aligns a causal mask top-left, we bottom-right).
FEATURES = ("mask", "keypad", "bias", "kvlen", "qkvlen", "window", "segments")
DECODE_FEATURES = ("mask", "bias", "window")
FEATURE_CASES = [
    *((4, s, s, 16, 128, f) for s in (1024, 4096) for f in FEATURES),
    *((4, sq, skv, 16, 128, "decode") for sq in (1, 8, 16) for skv in (4096, 32768)),
    *((1, sq, skv, 8, 128, "decode") for sq in (1, 16) for skv in (4096, 32768)),
    # GQA: 32 query heads on 8 kv heads (``GQA_GROUP``)
    *(
        (b, sq, skv, 32, 128, "decode-gqa")
        for b in (1, 4)
        for sq in (1, 16)
        for skv in (4096, 32768)
    ),
    # Caches shorter than the Mosaic forward's DECODE_MIN_KV: auto's thresholds for the
    # decode kernels (attention_decode.MIN_KV, attention_mgpu.DECODE_BWD_MIN_KV) lie here.
    *(
        (b, sq, skv, h, 128, "decode")
        for b, h in ((1, 8), (4, 16))
        for sq in (1, 16)
        for skv in (256, 512, 1024, 2048)
    ),
    *((1, sq, skv, 32, 128, "decode-gqa") for sq in (1, 16) for skv in (1024, 2048)),
    *((4, s, s, 16, 128, "short") for s in (128, 256, 512)),
    # Decoding with a mask, a bias or a window (``decode-<feature>``): the Triton decode
    # forward takes them from attention_decode.MIN_KV keys.
    *(
        (b, sq, skv, h, 128, f"decode-{f}")
        for f in DECODE_FEATURES
        for b, sq, h in ((1, 16, 8), (4, 1, 16))
        for skv in (2048, 32768)
    ),
    *((4, 4096, 4096, 16, d, "headdim") for d in (96, 80)),
    # Head dim 64 decoding: the Triton decode kernels' other head dim.
    *(
        (b, sq, skv, h, 64, "decode")
        for b, sq, h in ((1, 16, 8), (4, 1, 16))
        for skv in (4096, 32768)
    ),
]
FEATURE_BASELINE = "xla"
# Cases of a few tens of microseconds, shorter than the host's dispatch of a jitted call:
# timed per call inside one program (``timing = "in_graph"``), as a model's layers run.
IN_GRAPH_FEATURES = ("short", "decode", *(f"decode-{f}" for f in ("gqa", *DECODE_FEATURES)))
# Shapes of fewer FLOPs (B2 S512 H8 D128) are timed inside one program too: per call from
# the host, their forward+backward measured shorter than their forward.
IN_GRAPH_FLOPS = 1e10
# Query heads per kv head of the ``decode-gqa`` cases.
GQA_GROUP = 4


def _ts(q, k, v, causal):
    return ts.flash_attention(q, k, v, causal=causal)


def _jax_nn(q, k, v, causal, implementation):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)


def _fwdbwd(f):
    """``(out, dq, dk, dv)`` of ``sum(f(q, k, v, *extra) · dout)``."""

    def g(q, k, v, do, *extra):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, *extra), q, k, v)
        return (out, *vjp(do))

    return g


def _fwd_only(f):
    """``f`` taking (and ignoring) the ``dout`` operand, so every case has one signature."""
    return lambda q, k, v, do, *extra: f(q, k, v, *extra)


# XLA options an implementation is compiled with: cuDNN's deterministic attention backward
# (cuDNN frontend's ``set_deterministic_algorithm``, which XLA sets under this flag) is the
# like-for-like baseline of our backward, which is deterministic by construction.
COMPILER_OPTIONS = {"cudnn_deterministic": {"xla_gpu_deterministic_ops": True}}


# impl -> (function, TESSERA_KERNELS mode it is compiled and called under)
def _impls(causal: bool, backward: bool, only: tuple[str, ...] = ()) -> dict:
    """Every implementation, or those named in ``only`` (the baseline always runs)."""
    cudnn = functools.partial(_jax_nn, causal=causal, implementation="cudnn")
    fns = {
        "mosaic_gpu": (functools.partial(_ts, causal=causal), "pallas"),
        "ts_reference": (functools.partial(_ts, causal=causal), "xla"),
        "cudnn": (cudnn, "auto"),
        "xla": (functools.partial(_jax_nn, causal=causal, implementation="xla"), "auto"),
    }
    if backward:
        fns["cudnn_deterministic"] = (cudnn, "auto")
    wrap = _fwdbwd if backward else _fwd_only
    keep = set(only) | {BASELINE} if only else set(fns)
    return {n: (wrap(f), mode) for n, (f, mode) in fns.items() if n in keep}


def _compiled(fn, mode: str, args, options=None):
    """``fn`` jitted (with XLA ``options``) and called under kernel mode ``mode`` (part of
    the jit key), and the compiled program's temporary bytes."""
    jitted = jax.jit(fn, compiler_options=options)

    def call(*a):
        with ts.kernel_mode(mode):
            return jitted(*a)

    with ts.kernel_mode(mode):
        mem = jitted.lower(*args).compile().memory_analysis()
    return call, int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1


def _rel(out, ref) -> float:
    out, ref = out.astype(F32), ref.astype(F32)
    return float(jnp.linalg.norm((out - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def _same_bits(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
        for x, y in zip(a, b)
    )


def _chain(backward: bool):
    """:func:`benchmarks._common.time_in_graph`'s link from one call of a case's function
    to the next: the next query is this call's output (plus its query gradient)."""

    def chain(args, result):
        q = (result[0] + result[1]) if backward else result
        return (q.astype(args[0].dtype), *args[1:])

    return chain


def _kv_sets(k, v) -> list[tuple]:
    """``(k, v)`` and more random K/V of its shape, enough to rotate through
    (:func:`benchmarks._common.rotation`): each in-graph call reads its own from memory."""
    more = range(1, rotation(k.nbytes + v.nbytes))
    return [(k, v)] + [tuple(rand(10 * i + j, k.shape, k.dtype) for j in (1, 2)) for i in more]


def _times(fns: dict, args, sets=None, chain=None, **kw) -> dict[str, float]:
    """Milliseconds per call of each of ``fns``: called from the host on ``args``
    (:func:`time_interleaved`), or with ``sets`` inside one program, each call fed by the
    one before through ``chain`` (:func:`time_in_graph`, which takes ``kw``)."""
    if sets is None:
        return time_interleaved(fns, args, repeats=5, target_ms=40)
    return time_in_graph(fns, sets, chain, repeats=5, target_ms=40, **kw)


def _timing(sets) -> str:
    """A record's ``timing`` field for :func:`_times` with or without ``sets``."""
    return "per_call" if sets is None else "in_graph"


def _measure(case, fns, args, ref, flops, baseline, backward, sets=None) -> list[dict]:
    """Records of each ``name: (fn, kernel mode)`` in ``fns`` on ``args``: error against
    ``ref``, bitwise repeatability over 3 calls, compiled temporary memory, then the
    times of all of them, interleaved, and ratios against ``baseline``. With ``sets``
    (argument tuples like ``args``, with K/V of their own) the times are per call inside
    one program through the sets (:func:`benchmarks._common.time_in_graph`; record
    ``timing = "in_graph"``), else of calls from the host (``"per_call"``)."""
    jitted, errs, temp, repeat = {}, {}, {}, {}
    for name, (fn, mode) in fns.items():
        try:
            jitted[name], temp[name] = _compiled(fn, mode, args, COMPILER_OPTIONS.get(name))
            runs = [jitted[name](*args) for _ in range(3)]
            runs = [r if backward else (r,) for r in runs]
            errs[name] = max(_rel(o, r) for o, r in zip(runs[0], ref))
            repeat[name] = _same_bits(runs[0], runs[1]) and _same_bits(runs[0], runs[2])
        except Exception as e:
            jitted.pop(name, None)
            traceback.print_exc()
            print(f"!! {case} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    del ref
    if sets is None:
        ms = _times(jitted, args)
    else:

        def jit(name, program):
            return _compiled(program, fns[name][1], (sets,), COMPILER_OPTIONS.get(name))[0]

        ms = _times({n: fns[n][0] for n in jitted}, args, sets, _chain(backward), jit=jit)
    base_ms = ms.get(baseline)
    recs = []
    for name in jitted:
        recs.append(
            record(
                "attention",
                case,
                name,
                baseline,
                ms[name],
                base_ms,
                tflops=flops / (ms[name] * 1e-3) / 1e12,
                rel_err=errs[name],
                bitwise_repeatable=repeat[name],
                temp_bytes=temp[name],
                timing=_timing(sets),
            )
        )
        r = recs[-1]
        ratio = f"x{r['ratio']:.3f}" if r["ratio"] else "-"
        print(
            f"   {case} {name:28s} {r['ms']:8.3f} ms {r['tflops']:6.1f} TF/s {ratio} "
            f"err {r['rel_err']:.1e} repeat {r['bitwise_repeatable']} temp {r['temp_bytes']}",
            flush=True,
        )
    return recs


def run_case(shape, causal: bool, backward: bool, impls: tuple[str, ...] = ()) -> list[dict]:
    b, s, h, d = shape
    mode = "fwdbwd" if backward else "fwd"
    case = f"{mode}-{'causal' if causal else 'noncausal'}-b{b}-s{s}-h{h}-d{d}-bf16"
    args = tuple(rand(i, (b, s, h, d), BF16) for i in range(4))
    flops = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
    # The f32 reference: XLA's, or where its scores would not fit beside its backward (B1
    # S16384 H16: 16 GiB of them) our blocked one, in O(S) memory.
    ref_impl = "xla" if b * h * s * s * 4 <= REF_SCORE_BYTES else "ts_reference"
    ref_fn, ref_mode = _impls(causal, backward)[ref_impl]
    with ts.kernel_mode(ref_mode):
        ref = jax.jit(ref_fn)(*(x.astype(F32) for x in args))
    ref = ref if backward else (ref,)
    sets = None
    if flops < IN_GRAPH_FLOPS:  # (a call shorter than the host's dispatch of it)
        sets = [(args[0], *kv, args[3]) for kv in _kv_sets(args[1], args[2])]
    fns = _impls(causal, backward, impls)
    return _measure(case, fns, args, ref, flops, BASELINE, backward, sets)


def _feature_kwargs(feature: str, b: int, sq: int, skv: int, h: int, causal: bool) -> dict:
    """The keyword arguments of one feature case, under jax.nn's names (segment ids under
    ours; jax.nn gets the equivalent ``mask``). Lengths and segments are ragged per batch.
    A decode case's window (``decode-window``) spans an eighth of the cache."""
    if feature == "decode-window":
        return dict(local_window_size=(skv // 8, 0))
    feature = feature.removeprefix("decode-")
    frac = np.array([1.0, 0.75, 0.5, 0.875])[np.arange(b) % 4]
    kv_len = jnp.asarray(np.maximum(1, (frac * skv).astype(np.int32)))
    if feature == "mask":
        keep = jax.random.bernoulli(jax.random.key(7), 0.9, (b, 1, sq, skv))
        return dict(mask=keep)
    if feature == "keypad":  # jax.nn's key-padding mask: the kernels stream it per key
        return dict(mask=(jnp.arange(skv) < kv_len[:, None])[:, None, None, :])
    if feature == "bias":
        return dict(bias=rand(8, (1, h, sq, skv), BF16))
    if feature == "kvlen":
        return dict(key_value_seq_lengths=kv_len)
    if feature == "qkvlen":
        q_len = jnp.asarray(np.maximum(1, (frac * sq).astype(np.int32)))
        return dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
    if feature == "window":
        return dict(local_window_size=(256, 0 if causal else 256))
    if feature == "segments":
        # Four packed sequences per row, of unequal lengths.
        def ids(n):
            bounds = np.array([0, 0.4, 0.55, 0.8]) * n
            seg = np.searchsorted(bounds, np.arange(n), side="right").astype(np.int32)
            return jnp.broadcast_to(jnp.asarray(seg), (b, n))

        return dict(q_segment_ids=ids(sq), kv_segment_ids=ids(skv))
    return {}


def prepare_feature(q, k, v, causal: bool, kw: dict):
    """``(q, k, v, extras, spec)`` the Mosaic GPU kernels take for a feature case's
    keyword arguments ``kw`` (:func:`_feature_kwargs`'s names)."""
    return _prepare_attention(
        q,
        k,
        v,
        causal=causal,
        scale=None,
        config=None,
        mask=kw.get("mask"),
        bias=kw.get("bias"),
        q_lengths=kw.get("query_seq_lengths"),
        kv_lengths=kw.get("key_value_seq_lengths"),
        window=kw.get("local_window_size"),
        q_seg=kw.get("q_segment_ids"),
        kv_seg=kw.get("kv_segment_ids"),
    )


def _jax_nn_kwargs(kw: dict, sq: int, skv: int) -> dict:
    """``kw`` for jax.nn.dot_product_attention: segment ids become the mask they mean, and
    so does a window where ``sq != skv`` (jax.nn aligns its window top-left, we
    bottom-right)."""
    kw = dict(kw)
    if "q_segment_ids" in kw:
        qs, ks = kw.pop("q_segment_ids"), kw.pop("kv_segment_ids")
        kw["mask"] = qs[:, None, :, None] == ks[:, None, None, :]
    if "local_window_size" in kw and sq != skv:
        left, right = kw.pop("local_window_size")
        diag = jnp.arange(sq)[:, None] + (skv - sq)
        key = jnp.arange(skv)[None, :]
        window = (key >= diag - left) & (key <= diag + right)
        kw["mask"] = window if "mask" not in kw else kw["mask"] & window
    return kw


def feature_case_name(case, causal: bool, backward: bool) -> str:
    b, sq, skv, h, d, feature = case
    seq = f"s{sq}" if sq == skv else f"sq{sq}-skv{skv}"
    tag = "" if feature in ("short", "headdim") else f"{feature}-"
    mode = "fwdbwd" if backward else "fwd"
    return f"{mode}-{'causal' if causal else 'noncausal'}-{tag}b{b}-{seq}-h{h}-d{d}-bf16"


def run_feature_case(
    case, causal: bool, backward: bool, impls: tuple[str, ...] = (), ref_blocks=()
) -> list[dict]:
    """``ts.flash_attention`` in ``auto`` mode (``impl = "ts_auto"``) against jax.nn's
    default (XLA, the baseline) and cuDNN where it accepts the case, or only those of them
    named in ``impls`` beside the baseline; ``ref_blocks`` adds the blocked reference with
    those ``block_kv`` (0: one block of all keys)."""
    b, sq, skv, h, d, feature = case
    name = feature_case_name(case, causal, backward)
    q = rand(0, (b, sq, h, d), BF16)
    h_kv = h // GQA_GROUP if feature == "decode-gqa" else h
    k, v = (rand(i, (b, skv, h_kv, d), BF16) for i in (1, 2))
    do = rand(3, (b, sq, h, d), BF16)
    kw = _feature_kwargs(feature, b, sq, skv, h, causal)
    # The feature's arrays are arguments, not constants: a 512 MiB bias folded into the
    # program crashes XLA's compiler. The window's sizes are static.
    static = {n: kw.pop(n) for n in ("local_window_size",) if n in kw}

    def ts_fn(config=None):
        return lambda q, k, v, kw: ts.flash_attention(
            q, k, v, causal=causal, config=config, **kw, **static
        )

    def nn_fn(implementation):
        return lambda q, k, v, kw: jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=causal,
            implementation=implementation,
            **_jax_nn_kwargs({**kw, **static}, sq, skv),
        )

    fns = {"ts_auto": (ts_fn(), "auto"), "xla": (nn_fn(None), "auto")}
    fns["cudnn"] = (nn_fn("cudnn"), "auto")
    if feature == "short":  # the kernels take the case, but auto may not
        fns["mosaic_gpu"] = (ts_fn(), "pallas")
    elif feature.startswith("decode") and skv < am.DECODE_MIN_KV:
        fns["ts_pallas"] = (ts_fn(), "pallas")  # the kernels, whether auto prefers them or not
        if not backward:  # the path auto took before the decode forward took the case
            fns["ts_reference"] = (ts_fn(), "xla")
    elif feature.startswith("decode") and not backward:
        # ts_auto runs the Triton decode forward here; this is the Mosaic GPU one.
        def mosaic(q, k, v, kw):
            q, k, v, extras, spec = prepare_feature(q, k, v, causal, {**kw, **static})
            return am.flash_fwd(spec, q, k, v, *extras)[0]

        fns["mosaic_gpu"] = (mosaic, "auto")
    if impls:
        fns = {n: f for n, f in fns.items() if n in impls or n == FEATURE_BASELINE}
    for blk in ref_blocks:
        cfg = FlashAttentionConfig(block_kv=blk or skv)
        fns[f"ts_reference[block_kv={blk or 'all'}]"] = (ts_fn(cfg), "xla")
    wrap = _fwdbwd if backward else _fwd_only
    args = (q, k, v, do, kw)
    ref = jax.jit(wrap(nn_fn("xla")))(*(x.astype(F32) for x in args[:4]), kw)
    ref = ref if backward else (ref,)
    flops = 4.0 * b * sq * skv * h * d * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
    fns = {impl: (wrap(fn), mode) for impl, (fn, mode) in fns.items()}
    sets = None
    if feature in IN_GRAPH_FEATURES:
        sets = [(q, *kv_i, do, kw) for kv_i in _kv_sets(k, v)]
    return _measure(name, fns, args, ref, flops, FEATURE_BASELINE, backward, sets)


def _jax_fa3(causal: bool, d: int):
    """jax's own Mosaic GPU FA3 forward (f16 only, no score scale) with our forward's key
    block, or None where its tiles do not fit shared memory."""
    bkv = am.FWD_BLOCK_KV[d]
    if 2 * 64 * d * 2 + 2 * 2 * bkv * d * 2 > am.SMEM_BYTES:
        return None
    cfg = jax_fa3.TuningConfig(block_q=64, block_kv=bkv, max_concurrent_steps=2, causal=causal)
    return jax.jit(lambda q, k, v: jax_fa3.attention(q, k, v, cfg))


def run_sweep() -> list[dict]:
    """The forward's sweep, then the backward's."""
    return _sweep_fwd() + _sweep_bwd()


def _flash_fwd_out(spec, q, k, v, *, bkv=None, pipelined=None, pingpong=None, regs=None):
    out, _ = am.flash_fwd(
        spec, q, k, v, block_kv=bkv, pipelined=pipelined, pingpong=pingpong, compute_regs=regs
    )
    return out


def _sweep_fwd(only: list[str] = ()) -> list[dict]:
    """The forward kernel with each ``block_kv`` that fits, serial and pipelined
    (``Problem.fwd_pipelined``), the latter with and without the ping-pong
    (``Problem.fwd_pingpong``), and at its defaults with the other ``compute_regs``, vs
    cuDNN, B4 S4096 H16, bf16; in f16 also jax's own Mosaic GPU FA3 forward (its kernel
    applies no score scale: checked against cuDNN at scale 1). ``repeatable``: three calls
    gave the same bits."""
    recs = []
    for d, dtype in itertools.product((64, 128, 256), (BF16, F16)):
        b, s, h = 4, 4096, 16
        dt = np.dtype(dtype).name.replace("float", "f")  # bf16, f16
        names = [
            f"sweep-fwd-{'causal' if c else 'noncausal'}-b{b}-s{s}-h{h}-d{d}-{dt}"
            for c in (False, True)
        ]
        if only and not any(x in n for x in only for n in names):
            continue
        q, k, v = (rand(i, (b, s, h, d), dtype) for i in range(3))
        for causal in (False, True):
            case = names[causal]
            if only and not any(x in case for x in only):
                continue
            spec = AttentionSpec(causal=causal, scale=d**-0.5, config=FlashAttentionConfig())
            fns = {
                "cudnn": jax.jit(functools.partial(_jax_nn, causal=causal, implementation="cudnn"))
            }
            loops = ((False, True), (True, True), (True, False))  # (pipelined, pingpong)
            for bkv, (pipelined, pingpong) in itertools.product(am.FWD_BLOCK_KV_CHOICES, loops):
                if am._fwd_stages(d, bkv) >= 2:
                    loop = ",pipelined" * pipelined + ",no-pingpong" * (not pingpong)
                    fns[f"mosaic_gpu[block_kv={bkv}{loop}]"] = jax.jit(
                        functools.partial(
                            _flash_fwd_out, spec, bkv=bkv, pipelined=pipelined, pingpong=pingpong
                        )
                    )
            regs = am.COMPUTE_REGS[not causal]  # the count the other masking takes
            fns[f"mosaic_gpu[compute_regs={regs}]"] = jax.jit(
                functools.partial(_flash_fwd_out, spec, regs=regs)
            )
            refs = {name: fns["cudnn"] for name in fns}
            if dtype == F16 and (fa3 := _jax_fa3(causal, d)) is not None:
                fns["jax_fa3"] = fa3
                refs["jax_fa3"] = jax.jit(
                    lambda q, k, v, causal=causal: jax.nn.dot_product_attention(
                        q, k, v, scale=1.0, is_causal=causal, implementation="cudnn"
                    )
                )
            errs, same = {}, {}
            for name in list(fns):
                try:
                    outs = [np.asarray(fns[name](q, k, v)) for _ in range(3)]
                    errs[name] = _rel(outs[0], refs[name](q, k, v))
                    same[name] = all(np.array_equal(outs[0], o) for o in outs[1:])
                except Exception as e:
                    print(f"!! sweep d{d} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    del fns[name]
            ms = _times(fns, (q, k, v))
            flops = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0)
            for name in fns:
                r = _sweep_record(case, name, "cudnn", ms, flops, None, errs[name])
                r["repeatable"] = same[name]
                recs.append(r)
                print(
                    f"   {case} {name:34s} {r['ms']:7.3f} ms {r['tflops']:6.1f} TF/s "
                    f"x{r['ratio']:.3f} err {r['rel_err']:.1e} repeatable {same[name]}",
                    flush=True,
                )
    return recs


def _bwd_variants(d: int, causal: bool) -> dict:
    """The backward's tuning knobs that fit shared memory at head_dim ``d``, one at a time
    away from the tuned defaults: ``{name: flash_bwd keyword arguments}``."""
    out = {"mosaic_gpu": {}}
    regs = am.COMPUTE_REGS[not causal]  # the count the other masking takes
    out[f"mosaic_gpu[compute_regs={regs}]"] = dict(compute_regs=regs)
    for bkv in am.DQ_BLOCK_KV_CHOICES:
        if bkv != am.DQ_BLOCK_KV[d] and min(am._dq_stages(d, bkv)) >= 1:
            out[f"mosaic_gpu[dq_block_kv={bkv}]"] = dict(dq_block_kv=bkv)
    for n in am.DKV_STAGES_CHOICES:
        if n != am.DKV_STAGES[d] and am._dkv_smem(d, n) <= am.SMEM_BYTES:
            out[f"mosaic_gpu[dkv_stages={n}]"] = dict(dkv_stages=n)
    if d in am.DKV_PAIRED:  # (head_dim 256's dK/dV warpgroups split roles instead)
        paired = not am.DKV_PAIRED[d]
        out[f"mosaic_gpu[dkv_paired={paired}]"] = dict(dkv_paired=paired)
    if d in am.DKV_DQ:  # dQ from the dK/dV kernel (one kernel) or the dQ kernel
        fused = not am.DKV_DQ[d]
        out[f"mosaic_gpu[dkv_dq={fused}]"] = dict(dkv_dq=fused)
    return out


def _time_variants(
    case: str, fns: dict, args, base: str, flops: float | None = None, sets=None, chain=None
) -> list:
    """Sweep records of the jitted ``fns`` on ``args``: error against ``base``'s result,
    then the times of all of them, interleaved, and ratios against ``base``; with
    ``sets`` and ``chain``, per call inside one program (:func:`time_in_graph`)."""
    ref = fns[base](*args)
    errs = {n: max(_rel(x, y) for x, y in zip(f(*args), ref)) for n, f in fns.items()}
    ms = _times(fns, args, sets, chain)
    recs = []
    for name in fns:
        recs.append(_sweep_record(case, name, base, ms, flops, sets, errs[name]))
        print(f"   {case} {name:30s} {ms[name]:7.3f} ms x{ms[base] / ms[name]:.3f}")
    return recs


def _sweep_record(case, name, base, ms, flops, sets, rel_err) -> dict:
    """A sweep record of variant ``name`` against ``base`` from their times ``ms``
    (:func:`_times`, with ``sets`` or not); ``tflops`` where ``flops`` is given."""
    rec = record("attention-sweep", case, name, base, ms[name], ms[base], timing=_timing(sets))
    if flops is not None:
        rec["tflops"] = flops / (ms[name] * 1e-3) / 1e12
    return dict(rec, rel_err=rel_err)


def _sweep_bwd(only: list[str] = ()) -> list[dict]:
    """The backward kernels with each tuning knob that fits (baseline: the tuned defaults),
    B4 S4096 H16."""
    recs = []
    for d in (64, 128, 256):
        b, s, h = 4, 4096, 16
        for causal in (False, True):
            case = f"sweep-bwd-{'causal' if causal else 'noncausal'}-b{b}-s{s}-h{h}-d{d}-bf16"
            if only and not any(x in case for x in only):
                continue
            q, k, v, do = (rand(i, (b, s, h, d), BF16) for i in range(4))
            spec = AttentionSpec(causal=causal, scale=d**-0.5, config=FlashAttentionConfig())
            out, lse = jax.jit(functools.partial(am.flash_fwd, spec))(q, k, v)
            args = (q, k, v, out, lse, do)
            fns = {
                name: jax.jit(functools.partial(am.flash_bwd, spec, **kw))
                for name, kw in _bwd_variants(d, causal).items()
            }
            flops = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0) * 2.5
            recs += _time_variants(case, fns, args, "mosaic_gpu", flops)
    return recs


DECODE_SPLITS = (512, 1024, 2048, 4096, 8192)
DKV_TILES = (1, 2, 4, 8, 16)


def _decode_operands(b, sq, skv, h, hkv, d, backward: bool):
    """A non-causal spec, the forward's (or with ``backward``, the backward kernels')
    operands at a decode shape, and their sets over more K/V caches (:func:`_kv_sets`)."""
    q, do = (rand(i, (b, sq, h, d), BF16) for i in (0, 3))
    k, v = (rand(i, (b, skv, hkv, d), BF16) for i in (1, 2))
    spec = AttentionSpec(causal=False, scale=d**-0.5, config=FlashAttentionConfig())
    kv = _kv_sets(k, v)
    if not backward:
        return spec, (q, k, v), [(q, *kv_i) for kv_i in kv]
    fwd = jax.jit(functools.partial(am.flash_fwd, spec))
    return spec, (q, k, v, *fwd(q, k, v), do), [(q, *kv_i, *fwd(q, *kv_i), do) for kv_i in kv]


def _next_do(args, res):
    """The next backward call's operands: this call's dQ as its dO."""
    return (*args[:5], res[0])


def _sweep_decode(only: list[str] = ()) -> list[dict]:
    """The forward and the backward kernels at decode shapes (D128; B4 H16, B1 H8 and B1
    with 32 query heads on 8 kv heads; 1 to 16 queries against 4096 and 32768 keys) with
    their keys per chunk (``split_keys``, ``dq_split_keys``) of :data:`DECODE_SPLITS`, and
    the backward with the dK/dV kernel's key tiles per CTA (``dkv_tiles``) of
    :data:`DKV_TILES` and with the dQ kernel computing dK and dV too (``dq_dkv``), against
    no split (baseline), timed inside one program (:func:`time_in_graph`): the forward's
    output is the next call's query, the dQ kernel's dQ the next call's dO."""
    recs = []
    d = 128
    heads = ((4, 16, 16), (1, 8, 8), (1, 32, 8))
    shapes = itertools.product(heads, (1, 8, 16), (4096, 32768), ("fwd", "bwd"))
    for (b, h, hkv), sq, skv, kernel in shapes:
        kv = f"-hkv{hkv}" if hkv != h else ""
        case = f"sweep-decode-{kernel}-noncausal-b{b}-sq{sq}-skv{skv}-h{h}{kv}-d{d}-bf16"
        if only and not any(x in case for x in only):
            continue
        spec, args, sets = _decode_operands(b, sq, skv, h, hkv, d, kernel == "bwd")
        splits = {"mosaic_gpu[no split]": skv}
        splits.update({f"mosaic_gpu[split_keys={n}]": n for n in DECODE_SPLITS if n < skv})
        triton = {}
        if kernel == "fwd":
            variants = {name: dict(split_keys=n) for name, n in splits.items()}
            chain = lambda args, res: (res[0], *args[1:])  # the next query: this output
            kernel_fn = am.flash_fwd
            triton = {
                f"triton_decode[split_keys={n}]": jax.jit(
                    functools.partial(ad.decode_fwd, spec, config=ad.DecodeConfig(split_keys=n))
                )
                for n in (skv, *(n for n in DECODE_SPLITS if n < skv))
            }
        else:
            # The two kernels: the dQ kernel's chunks, the dK/dV kernel's key tiles per CTA
            # beside the dQ kernel's default chunks; then the dQ kernel computing dK and dV.
            variants = {name: dict(dq_split_keys=n, dq_dkv=False) for name, n in splits.items()}
            variants.update({f"mosaic_gpu[dkv_tiles={t}]": dict(dkv_tiles=t) for t in DKV_TILES})
            variants["mosaic_gpu[dq_dkv]"] = dict(dq_dkv=True)
            chain = _next_do
            kernel_fn = am.flash_bwd
        fns = {
            name: jax.jit(functools.partial(kernel_fn, spec, **kw)) for name, kw in variants.items()
        }
        fns.update(triton)
        recs += _time_variants(case, fns, args, "mosaic_gpu[no split]", None, sets, chain)
    return recs


# (batch, query heads, kv heads, seq_q, seq_kv) of the ``--sweep-dq-dkv`` cases, D128.
DQ_DKV_SHAPES = [
    *((b, h, h, sq, skv) for b, h in ((1, 8), (4, 16)) for sq in (1, 16) for skv in (4096, 32768)),
    *((b, 32, 8, sq, skv) for b, sq, skv in ((1, 1, 32768), (4, 1, 32768), (1, 16, 4096))),
    (1, 32, 8, 1, 4096),
]


def _sweep_dq_dkv(only: list[str] = ()) -> list[dict]:
    """The backward at decode shapes (:data:`DQ_DKV_SHAPES`, GQA groups folded into the
    rows) with the dQ kernel computing dK and dV (``dq_dkv``, the default there) and with
    the Triton decode backward (``triton_decode``: ``attention_decode.flash_bwd``, 16-row
    products, 64 keys a step as ``BWD_CONFIG`` or 128 where that fits shared memory)
    against the dQ and dK/dV kernels (baseline), timed inside one program as
    :func:`_sweep_decode` does; ``rel_err`` against the two kernels, whose bits differ
    from more than one row."""
    recs = []
    d = 128
    for b, h, hkv, sq, skv in DQ_DKV_SHAPES:
        case = f"sweep-dqdkv-bwd-noncausal-b{b}-sq{sq}-skv{skv}-h{h}-hkv{hkv}-d{d}-bf16"
        if only and not any(x in case for x in only):
            continue
        spec, args, sets = _decode_operands(b, sq, skv, h, hkv, d, True)
        variants = {"mosaic_gpu[two kernels]": False, "mosaic_gpu[dq_dkv]": True}
        fns = {
            name: jax.jit(functools.partial(am.flash_bwd, spec, dq_dkv=on))
            for name, on in variants.items()
        }
        rows = ad.padded_rows(h // hkv * sq)
        for bkv in (64, 128):
            config = dataclasses.replace(ad.BWD_CONFIG, block_kv=bkv)
            if ad.smem_bytes(config, rows, d, backward=True) <= am.SMEM_BYTES:
                fns[f"triton_decode[block_kv={bkv}]"] = jax.jit(
                    functools.partial(ad.flash_bwd, spec, config=config)
                )
        recs += _time_variants(case, fns, args, "mosaic_gpu[two kernels]", None, sets, _next_do)
    return recs


def run_power() -> list[dict]:
    """Board power and SM clock of ours and cuDNN at B4 S4096 H16 D128 bf16, non-causal,
    forward and forward+backward, each timed twice in alternation
    (:func:`benchmarks._common.power_draw`): whether both run at the power cap, where the
    faster one is the one spending less energy per attention."""
    recs = []
    b, s, h, d = 4, 4096, 16, 128
    args = tuple(rand(i, (b, s, h, d), BF16) for i in range(4))
    for backward in (False, True):
        fns = {
            name: _compiled(fn, mode, args)[0]
            for name, (fn, mode) in _impls(False, backward, ("mosaic_gpu",)).items()
        }
        case = f"{'fwdbwd' if backward else 'fwd'}-noncausal-b{b}-s{s}-h{h}-d{d}-bf16"
        for rep in range(2):
            for name, fn in fns.items():
                r = dict(suite="attention-power", case=case, device=device_name(family=True))
                r.update(jax=jax.__version__, impl=name, repeat=rep, **power_draw(fn, args))
                recs.append(r)
                print(
                    f"   {case} {name:12s} {r['ms']:7.3f} ms {r['watts']:5.0f} W "
                    f"{r['sm_mhz']:6.0f} MHz throttle {r['throttle_reasons']}",
                    flush=True,
                )
    return recs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*", default=[], help="substrings of case names to run")
    p.add_argument("--json", default=None, help="output path (default $OUT/ or results/)")
    p.add_argument(
        "--impls", nargs="*", default=[], help="only these implementations (and the baseline)"
    )
    p.add_argument(
        "--ref-blocks",
        nargs="*",
        type=int,
        default=[],
        help="feature cases: also the blocked reference with these block_kv (0: all keys)",
    )
    p.add_argument("--sweep", action="store_true", help="only the block_kv sweeps")
    p.add_argument("--sweep-fwd", action="store_true", help="only the forward's sweep")
    p.add_argument("--sweep-bwd", action="store_true", help="only the backward's sweep")
    p.add_argument("--sweep-decode", action="store_true", help="only the key chunks of decoding")
    p.add_argument(
        "--sweep-dq-dkv", action="store_true", help="only the decode backwards (Mosaic, Triton)"
    )
    p.add_argument("--power", action="store_true", help="only power and clocks at D=128")
    args = p.parse_args()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind}", flush=True)
    if args.power:
        name = f"attention-{device_name(family=True)}-power.json"
        write_records(Path(args.json or results_path(name)), run_power())
        return
    if args.sweep or args.sweep_fwd or args.sweep_bwd or args.sweep_decode or args.sweep_dq_dkv:
        name = f"attention-{device_name(family=True)}-sweep.json"
        if args.sweep:
            recs = run_sweep()
        else:
            recs = _sweep_fwd(args.only) if args.sweep_fwd else []
            recs += _sweep_bwd(args.only) if args.sweep_bwd else []
            recs += _sweep_decode(args.only) if args.sweep_decode else []
            recs += _sweep_dq_dkv(args.only) if args.sweep_dq_dkv else []
        write_records(Path(args.json or results_path(name)), recs)
        return
    cases = {}
    for shape in SHAPES:
        for backward in (False, True):
            for causal in (False, True):
                b, s, h, d = shape
                name = (
                    f"{'fwdbwd' if backward else 'fwd'}-{'causal' if causal else 'noncausal'}"
                    f"-b{b}-s{s}-h{h}-d{d}-bf16"
                )
                cases[name] = (run_case, shape, causal, backward)
    for fcase in FEATURE_CASES:
        for backward in (False, True):
            for causal in (False,) if fcase[-1].startswith("decode") else (False, True):
                cases[feature_case_name(fcase, causal, backward)] = (
                    functools.partial(run_feature_case, ref_blocks=tuple(args.ref_blocks)),
                    fcase,
                    causal,
                    backward,
                )
    if args.only:  # in the order the patterns are given: the first ones run first
        names = [n for x in args.only for n in cases if x in n]
        cases = {n: cases[n] for n in dict.fromkeys(names)}
    path = Path(args.json or results_path(f"attention-{device_name(family=True)}.json"))
    recs = []
    for name, (run, shape, causal, backward) in cases.items():
        try:
            recs.extend(run(shape, causal, backward, tuple(args.impls)))
        except Exception as e:
            traceback.print_exc()
            print(f"!! case {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        write_records(path, recs)  # after every case: a run cut short keeps what it measured
    # ratio = the record's baseline (cuDNN, or XLA where that is jax.nn's default) / impl
    print(f"\n{'case':40s} {'impl':11s} {'ms':>8s} {'TF/s':>6s} ratio    vs     err     repeat")
    for r in recs:
        ratio = f"x{r['ratio']:.3f}" if r["ratio"] else "-"
        print(
            f"{r['case']:40s} {r['impl']:11s} {r['ms']:8.3f} {r['tflops']:6.1f} {ratio:8s} "
            f"{r['baseline'] or '-':6s} {r['rel_err']:.1e} {r['bitwise_repeatable']}"
        )


if __name__ == "__main__":
    main()
