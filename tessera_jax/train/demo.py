"""``python -m tessera_jax demo``: train a small decoder-only transformer built from ts
operators on a ``dp × tp`` mesh, deterministically.

It learns the bundled corpus (byte tokens) with AdamW, shows a progress bar with the
loss and tokens/s, prints a greedy sample and ``fingerprint: <hex>``, a hash of the
final parameters' bytes. The fingerprint is the same on every run, on any valid mesh
(``dp`` dividing 8, ``tp`` dividing the model's chunks), in one process or several
(``tessera-launch --nproc 2 --devices-per-proc 4 -m tessera_jax demo``): see
``tessera_jax/train/model.py`` for how. With ``--checkpoint-dir`` the state is saved
every ``--checkpoint-every`` steps and at the end, and ``--resume`` continues from the
newest intact checkpoint, on this run's mesh — a run that was stopped and resumed ends
with the fingerprint of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from tessera_jax import _compat
from tessera_jax.sharding.runtime import initialize
from tessera_jax.train import data, model, step
from tessera_jax.train.checkpoint import Checkpoints, fingerprint, host_value
from tessera_jax.train.model import DP, TP, ModelConfig

# XLA's GPU autotuner times candidate GEMM configs and keeps the fastest, so two processes
# can compile the same matmul to kernels that round differently; this flag makes it choose
# deterministically (and avoids ops with nondeterministic atomics).
DETERMINISTIC_XLA_FLAG = "--xla_gpu_deterministic_ops=true"

SAMPLE_PROMPT = "The "


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=150, help="total training steps (default 150)")
    p.add_argument(
        "--devices", type=int, default=None, help="use the first N devices (default: all)"
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="dp=…,tp=… (default: tp=2 on the CPU with an even device count, else tp=1)",
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per step, a multiple of 8")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument(
        "--groups",
        type=int,
        default=step.GROUPS,
        help=f"gradient groups, a power of two; the fingerprint is the same for every dp "
        f"dividing it (default {step.GROUPS})",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128, help="d_model (heads of 16 dims)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sample", type=int, default=120, metavar="N", help="bytes of greedy sample to print"
    )
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=50, metavar="K")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process run with ts.dist.initialize() (automatic under "
        "tessera-launch; needed under srun or mpirun)",
    )


def parse_mesh(text: str | None, n_devices: int, platform: str) -> tuple[int, int]:
    """``"dp=4,tp=2"`` → ``(4, 2)``; a missing size is what the devices leave."""
    if text is None:
        tp = 2 if platform == "cpu" and n_devices % 2 == 0 else 1
        return n_devices // tp, tp
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in (DP, TP) or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--mesh={text!r} must look like dp=4,tp=2 (positive sizes)")
        sizes[name] = int(value)
    if DP not in sizes:
        sizes[DP] = n_devices // sizes[TP] if n_devices % sizes[TP] == 0 else 0
    if TP not in sizes:
        sizes[TP] = n_devices // sizes[DP] if n_devices % sizes[DP] == 0 else 0
    if sizes[DP] * sizes[TP] != n_devices:
        raise ValueError(f"--mesh={text!r} does not cover the {n_devices} devices in use")
    return sizes[DP], sizes[TP]


@functools.lru_cache(maxsize=4)
def _next_token(cfg: ModelConfig):
    return jax.jit(lambda p, t: jnp.argmax(model.logits(cfg, p, t)[0, -1]))


def _greedy_sample(cfg: ModelConfig, params: Any, prompt: str, n: int) -> str:
    """Greedy continuation of ``prompt`` on one local device (the host's copy of the
    parameters, every chunk local)."""
    params = jax.device_put(params, jax.local_devices()[0])
    f = _next_token(cfg)
    tokens = list(data.encode(prompt))
    pad = int(data.encode(" ")[0])
    for _ in range(n):
        window = tokens[-cfg.seq_len :]
        window = [pad] * (cfg.seq_len - len(window)) + window
        tokens.append(int(f(params, jnp.asarray([window], jnp.int32))))
    return data.decode(tokens)


def run(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Trains as ``args`` say; returns the final loss, first loss and fingerprint."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags and not _compat.backends_started():
        os.environ["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_XLA_FLAG}".strip()
    if args.distributed or os.environ.get("TESSERA_COORDINATOR"):
        initialize()
    elif "JAX_NUM_CPU_DEVICES" not in os.environ and not _compat.backends_started():
        jax.config.update("jax_num_cpu_devices", 8)
    primary = jax.process_index() == 0
    say = log if primary else (lambda *a, **k: None)

    for name in ("steps", "batch", "seq", "layers", "width", "groups", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    devices = jax.devices()
    if args.devices is not None:
        if not 1 <= args.devices <= len(devices):
            raise ValueError(f"--devices={args.devices} must be in [1, {len(devices)}]")
        if jax.process_count() > 1 and args.devices != len(devices):
            raise ValueError(
                f"--devices={args.devices}: a multi-process run uses all {len(devices)} devices"
            )
        devices = devices[: args.devices]
    platform = devices[0].platform
    dp, tp = parse_mesh(args.mesh, len(devices), platform)
    mesh = step.make_mesh(devices, dp, tp)
    cfg = ModelConfig(
        d_model=args.width,
        n_layers=args.layers,
        n_heads=max(4, args.width // 16),
        d_ff=4 * args.width,
        seq_len=args.seq,
    )
    step.check_layout(cfg, mesh, args.batch, args.groups)
    optim = step.OptimConfig()
    settings = {
        "model": dataclasses.asdict(cfg),
        "batch": args.batch,
        "groups": args.groups,
        "seed": args.seed,
    }

    say(
        f"tessera_jax demo: jax {jax.__version__}, {len(devices)} {platform} device(s) in "
        f"{jax.process_count()} process(es), mesh dp={dp} × tp={tp}"
    )
    say(
        f"model: {cfg.n_layers}-layer decoder, d_model {cfg.d_model}, {cfg.n_heads} heads, "
        f"{cfg.n_params / 1e6:.2f}M params; batch {args.batch} × {args.seq} bytes; AdamW"
    )

    tokens = data.encode(data.corpus())
    state = step.init_state(cfg, optim, mesh, args.seed)
    start = 0
    ckpt = Checkpoints(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.resume:
        if ckpt is None:
            raise ValueError("--resume needs --checkpoint-dir")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        found = ckpt.restore_latest(abstract, log=say)
        if found is None:
            say(f"no checkpoint in {ckpt.directory}: starting from step 0")
        else:
            start, state, meta = found
            saved = {k: meta.get(k) for k in settings}
            if saved != settings:
                raise ValueError(
                    f"--resume: the checkpoint at step {start} was written with {saved}, "
                    f"this run has {settings}"
                )
            say(f"resumed from step {start} ({ckpt.directory / str(start)})")

    train_step = step.make_train_step(cfg, optim, mesh, args.groups)
    first = last = None
    t0 = time.perf_counter()
    bar = tqdm(
        range(start, args.steps),
        initial=start,
        total=args.steps,
        disable=not primary,
        desc="train",
        dynamic_ncols=True,
        mininterval=1.0,
    )
    for i in bar:
        windows = step.place_windows(
            mesh,
            data.batch(tokens, i, batch_size=args.batch, seq_len=args.seq, seed=args.seed),
            args.groups,
        )
        state, loss = train_step(state, windows)
        last = float(loss)
        first = last if first is None else first
        done = i + 1 - start
        tok_s = done * args.batch * args.seq / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{last:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        if ckpt is not None and ((i + 1) % args.checkpoint_every == 0 or i + 1 == args.steps):
            ckpt.save(i + 1, state, {**settings, "mesh": {"dp": dp, "tp": tp}})
    bar.close()
    if ckpt is not None:
        ckpt.close()

    params = jax.tree.map(host_value, state["params"])
    fp = fingerprint(params)
    if last is not None:
        say(f"final loss {last:.4f} (step 1 of this run: {first:.4f}), step {args.steps}")
    sample = ""
    if primary and args.sample > 0:
        sample = _greedy_sample(cfg, params, SAMPLE_PROMPT, args.sample)
        say("sample: " + repr(sample))
    say(
        f"the fingerprint is the same for this model, batch, seed and step count on any mesh "
        f"with dp | {args.groups} and tp | {cfg.chunks}, in one process or several, on "
        f"{platform} devices"
    )
    if platform == "gpu" and DETERMINISTIC_XLA_FLAG not in os.environ.get("XLA_FLAGS", ""):
        say(
            f"warning: XLA_FLAGS lacks {DETERMINISTIC_XLA_FLAG} (JAX started before the demo "
            "could set it): XLA's GPU autotuner may pick other kernels in another process, "
            "so this fingerprint may not reproduce"
        )
    say(f"fingerprint: {fp}")
    return {"first_loss": first, "final_loss": last, "fingerprint": fp, "sample": sample}
