"""Training throughput: the demo's deterministic transformer step vs the same model in
plain JAX (jnp, ``jax.nn.dot_product_attention``, XLA's all-reduce) on the same devices.

Both train the same parameters with the same AdamW on the same batches, in bf16 with f32
parameters, data-parallel over every local device. ``ratio`` = plain-JAX step time /
ours. Records: ``benchmarks/results/train-<device>.json`` (``suite: "train"``).

    python benchmarks/train.py --layers 12 --width 1024 --seq 2048 --batch 8
    tessera-launch --nproc 2 --devices-per-proc 2 benchmarks/train.py --groups 8
    python benchmarks/train.py --groups 4 --batch 16 --grad-algo binary_tree

Under ``tessera-launch`` every process joins one run (``ts.dist.initialize``) and the
mesh spans every process's GPUs; process 0 prints and writes the record.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks._common import device_name, results_path, write_records
from tessera_jax.primitives.collectives.api import ALGOS
from tessera_jax.sharding.runtime import initialize
from tessera_jax.train import data, model, step
from tessera_jax.train.checkpoint import fingerprint
from tessera_jax.train.model import ModelConfig


def plain_loss(cfg: ModelConfig, params, window, attn_impl=None, unroll=False, onehot=False):
    """The demo's model in plain JAX (``cfg.chunks == 1``); ``attn_impl`` is
    ``jax.nn.dot_product_attention``'s ``implementation``; ``unroll``: the layers as
    straight-line code (a Python loop over layers, as in most flax models) instead of
    ``lax.scan``; ``onehot``: the embedding as a one-hot matmul, as ours, instead of the
    usual row gather (whose gradient is a scatter-add)."""
    cdt = jnp.dtype(cfg.compute_dtype)
    tokens, targets = window[:, :-1], window[:, 1:]
    b, s = tokens.shape
    h_, dh = cfg.n_heads, cfg.head_dim

    def norm(x, g):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * g).astype(cdt)

    if onehot:
        x = jax.nn.one_hot(tokens, cfg.vocab, dtype=cdt) @ params["embed"].astype(cdt)
    else:
        x = params["embed"].astype(cdt)[tokens]
    x = x + jnp.asarray(model._positions(s, cfg.d_model), cdt)

    def body(x, lp):
        qkv = norm(x, lp["ln1"]) @ lp["wqkv"][0].astype(cdt)
        q, k, v = jnp.split(qkv.reshape(b, s, 3 * h_, dh), 3, axis=2)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attn_impl)
        a = a.reshape(b, s, h_ * dh)
        x = x + a @ lp["wo"][0].astype(cdt)
        # erf GELU, as ours (``activation="gelu"``).
        up = jax.nn.gelu(norm(x, lp["ln2"]) @ lp["w1"][0].astype(cdt), approximate=False)
        return x + up @ lp["w2"][0].astype(cdt), None

    x, _ = jax.lax.scan(body, x, params["layers"], unroll=unroll)
    logits = (norm(x, params["ln_f"]) @ params["head"].astype(cdt)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def bench_config(layers: int, width: int, seq: int) -> ModelConfig:
    """The benchmarked model: 64-wide heads, a 4x MLP, bf16 compute, one tp chunk."""
    return ModelConfig(
        d_model=width,
        n_layers=layers,
        n_heads=width // 64,
        d_ff=4 * width,
        seq_len=seq,
        chunks=1,
        compute_dtype="bfloat16",
    )


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmarked model's size flags (``bench_config``) and the global batch."""
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)


def make_plain_step(cfg, optim, mesh, attn_impl, unroll, onehot=False):
    opt = optim.optimizer()
    batch_sharding = NamedSharding(mesh, P(("dp", "tp")))

    @jax.jit
    def plain_step(state, window):
        window = jax.lax.with_sharding_constraint(window, batch_sharding)
        loss, grads = jax.value_and_grad(
            lambda p: plain_loss(cfg, p, window, attn_impl, unroll, onehot)
        )(state["params"])
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, loss

    return plain_step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument(
        "--groups",
        type=int,
        default=None,
        help="gradient groups (default: the device count, at least 2: the 1- and 2-device "
        "runs give the same bits)",
    )
    p.add_argument(
        "--unroll",
        choices=("auto", "yes", "no"),
        default="auto",
        help="our step's layers and groups as straight-line code (auto: on GPUs)",
    )
    p.add_argument(
        "--grad-algo",
        choices=ALGOS,
        help="also time our step with its gradients summed by this all-reduce algorithm "
        "(make_train_step's grad_algo), interleaved with the default: e.g. binary_tree "
        "against the NVLink kernel that auto takes on GPUs",
    )
    p.add_argument("--steps", type=int, default=5, help="steps per timing")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="the record file (default: results/train-<device>.json)")
    args = p.parse_args(argv)
    if os.environ.get("TESSERA_COORDINATOR"):  # a child of tessera-launch
        initialize()

    devices = jax.devices()
    mesh = step.make_mesh(devices, len(devices), 1)
    cfg = bench_config(args.layers, args.width, args.seq)
    groups = args.groups or max(2, 1 << (len(devices) - 1).bit_length())
    step.check_layout(cfg, mesh, args.batch, groups)
    optim = step.OptimConfig()
    tokens = data.encode(data.corpus())
    host = [
        data.batch(tokens, i, batch_size=args.batch, seq_len=args.seq, seed=0)
        for i in range(args.steps)
    ]
    unroll = {"auto": None, "yes": True, "no": False}[args.unroll]
    ours_step = step.make_train_step(cfg, optim, mesh, groups, unroll)
    # cuDNN's fused attention where there is one (XLA's materialises S×S per layer).
    attn_impl = "cudnn" if devices[0].platform == "gpu" else None
    ours_in = [step.place_windows(mesh, w, groups) for w in host]
    plain_sharding = NamedSharding(mesh, P(("dp", "tp")))
    # Each process supplies its own devices' rows (device_put needs them all local).
    plain_in = [jax.make_array_from_callback(w.shape, plain_sharding, w.__getitem__) for w in host]
    # The baseline is the faster of the two ways plain JAX models write their layers;
    # plain-onehot is also timed: the usual gather's gradient is a scatter-add, slow on
    # GPUs for a small vocabulary, and the one-hot form is what our model uses.
    fns = {"ours": (ours_step, ours_in)}
    if args.grad_algo:
        variant = step.make_train_step(cfg, optim, mesh, groups, unroll, grad_algo=args.grad_algo)
        fns[f"ours[{args.grad_algo}]"] = (variant, ours_in)
    for name, plain_unroll, onehot in (
        ("plain-scan", False, False),
        ("plain-unrolled", True, False),
        ("plain-onehot", True, True),
    ):
        plain_step = make_plain_step(cfg, optim, mesh, attn_impl, plain_unroll, onehot)
        fns[name] = (plain_step, plain_in)
    states = {name: step.init_state(cfg, optim, mesh, 0) for name in fns}

    def run(name):
        f, inputs = fns[name]
        t0 = time.perf_counter()
        for w in inputs:
            states[name], loss = f(states[name], w)
        jax.block_until_ready(states[name])
        return (time.perf_counter() - t0) / len(inputs) * 1e3, float(loss)

    losses, compile_s = {}, {}
    for name in fns:  # compile and warm up
        t0 = time.perf_counter()
        losses[name] = run(name)[1]
        compile_s[name] = time.perf_counter() - t0
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name in fns:
            times[name].append(run(name)[0])
    ms = {name: statistics.median(t) for name, t in times.items()}
    plain = min(("plain-scan", "plain-unrolled"), key=ms.get)
    ms["plain"], losses["plain"] = ms[plain], losses[plain]

    # Bitwise repeatability of our step: two fresh runs of the same steps.
    def fresh_fingerprint(f):
        state = step.init_state(cfg, optim, mesh, 0)
        for w in ours_in:
            state, _ = f(state, w)
        return fingerprint(state["params"])

    fps = [fresh_fingerprint(ours_step) for _ in range(2)]

    tokens_per_step = args.batch * args.seq
    procs = jax.process_count()
    case = f"L{args.layers}-d{args.width}-s{args.seq}-b{args.batch}-g{groups}-bf16-x{len(devices)}"
    case += f"-p{procs}" if procs > 1 else ""
    record = {
        "suite": "train",
        "case": case,
        "device": device_name(),
        "devices": len(devices),
        "processes": procs,
        "jax": jax.__version__,
        "impl": "tessera_jax.train (deterministic)",
        "baseline": f"plain jax (jnp, jax.nn.dot_product_attention[{attn_impl}], XLA psum, "
        f"layers {'unrolled' if plain == 'plain-unrolled' else 'in lax.scan'})",
        "unrolled": bool(unroll if unroll is not None else devices[0].platform == "gpu"),
        "ms": ms["ours"],
        "baseline_ms": ms["plain"],
        "plain_scan_ms": ms["plain-scan"],
        "plain_unrolled_ms": ms["plain-unrolled"],
        "plain_onehot_ms": ms["plain-onehot"],
        "ratio_vs_plain_onehot": ms["plain-onehot"] / ms["ours"],
        "first_step_s": {name: round(t, 1) for name, t in compile_s.items()},
        "ratio": ms["plain"] / ms["ours"],
        "tokens_per_s": tokens_per_step / ms["ours"] * 1e3,
        "baseline_tokens_per_s": tokens_per_step / ms["plain"] * 1e3,
        "tokens_per_s_per_device": tokens_per_step / ms["ours"] * 1e3 / len(devices),
        "params": cfg.n_params,
        "groups": groups,
        "loss_after_warmup": losses["ours"],
        "baseline_loss_after_warmup": losses["plain"],
        "repeatable": fps[0] == fps[1],
        "fingerprint": fps[0],
    }
    if args.grad_algo:  # the same steps, timed interleaved with ours: the same bits
        name = f"ours[{args.grad_algo}]"
        fp = fresh_fingerprint(fns[name][0])
        record["grad_algo"] = {
            "algo": args.grad_algo,
            "ms": ms[name],
            "speedup_vs_default": ms["ours"] / ms[name],
            "fingerprint": fp,
            "same_fingerprint": fp == fps[0],
        }
    if jax.process_index() != 0:
        return
    print(
        f"{'case':40s} {'ours ms':>9s} {'scan ms':>9s} {'unrl ms':>9s} {'1hot ms':>9s} "
        f"{'ratio':>6s} {'tok/s':>10s} repeatable  first steps (s)"
    )
    print(
        f"{case:40s} {ms['ours']:9.2f} {ms['plain-scan']:9.2f} {ms['plain-unrolled']:9.2f} "
        f"{ms['plain-onehot']:9.2f} "
        f"{record['ratio']:6.3f} {record['tokens_per_s']:10.0f} {record['repeatable']!s:10s}  "
        + " ".join(f"{k}={v:.0f}" for k, v in compile_s.items())
    )
    if args.grad_algo:
        g = record["grad_algo"]
        print(
            f"grad_algo={g['algo']}: {g['ms']:.2f} ms (default {ms['ours']:.2f}), "
            f"fingerprint {g['fingerprint']} (default {fps[0]})"
        )
    path = results_path(args.json or f"train-{device_name(count=True)}.json")
    write_records(path, [record])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
