"""``ts.profile`` of one training step: ours (the demo's deterministic step, at two gradient
group counts) and the same model in plain JAX (``benchmarks/train.py``'s), on one device.

Shows where a step's device time goes, per ts operator and per XLA kernel, and the idle
time between kernels: what bounds ``benchmarks/train.py``'s ratio. On the GPU machine::

    PYTHONUNBUFFERED=1 python3 benchmarks/profile_train.py [--groups 8 2] [--plain onehot]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from benchmarks.train import add_model_arguments, bench_config, make_plain_step
from tessera_jax.train import data, step

# benchmarks/train.py's plain variants: (layers unrolled, one-hot embedding).
PLAIN = {"scan": (False, False), "unrolled": (True, False), "onehot": (True, True)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--groups", type=int, nargs="+", default=[2, 8])
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument(
        "--plain", nargs="*", choices=sorted(PLAIN), default=sorted(PLAIN), help="plain steps"
    )
    args = p.parse_args(argv)

    devices = jax.devices()[:1]
    mesh = step.make_mesh(devices, 1, 1)
    cfg = bench_config(args.layers, args.width, args.seq)
    optim = step.OptimConfig()
    tokens = data.encode(data.corpus())
    host = data.batch(tokens, 0, batch_size=args.batch, seq_len=args.seq, seed=0)
    for groups in args.groups:
        # ts.profile jits the step again, and jax takes compile options on the outermost
        # jit only: the step's own (deterministic) options are left out here.
        f = step.make_train_step(cfg, optim, mesh, groups, deterministic=False)
        state = step.init_state(cfg, optim, mesh, 0)
        windows = step.place_windows(mesh, host, groups)
        print(f"=== ours, groups={groups}")
        print(ts.profile(f, state, windows, steps=args.steps))
    attn_impl = "cudnn" if devices[0].platform == "gpu" else None
    window = jax.device_put(host, NamedSharding(mesh, P(("dp", "tp"))))
    for name in args.plain:
        unroll, onehot = PLAIN[name]
        plain = make_plain_step(cfg, optim, mesh, attn_impl, unroll, onehot)
        state = step.init_state(cfg, optim, mesh, 0)
        print(f"=== plain jax, {name} (attention: {attn_impl or 'xla'})")
        print(ts.profile(plain, state, window, steps=args.steps))


if __name__ == "__main__":
    main()
