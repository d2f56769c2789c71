"""Whether the training step gives the same bits in separate processes.

Each of ``--procs`` fresh processes compiles the step of ``benchmarks/train.py``'s model,
runs ``--steps`` steps from the same initial state and batches, and prints the
parameters' fingerprint; the script then says whether they all agree. Within a process
the step is repeatable; across processes, compile-time choices (XLA's GPU autotuning picks
kernels by timing) could change the bits, which is what this checks.

    python3 benchmarks/process_determinism.py [--procs 3] [--batch 8 --groups 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from benchmarks.train import add_model_arguments, bench_config
from tessera_jax.train import data, step
from tessera_jax.train.checkpoint import fingerprint


def one_run(args) -> str:
    mesh = step.make_mesh(jax.devices()[:1], 1, 1)
    cfg = bench_config(args.layers, args.width, args.seq)
    optim = step.OptimConfig()
    tokens = data.encode(data.corpus())
    f = step.make_train_step(cfg, optim, mesh, args.groups)
    state = step.init_state(cfg, optim, mesh, 0)
    for i in range(args.steps):
        window = data.batch(tokens, i, batch_size=args.batch, seq_len=args.seq, seed=0)
        state, _ = f(state, step.place_windows(mesh, window, args.groups))
    return fingerprint(state["params"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    add_model_arguments(p)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(f"fingerprint: {one_run(args)}", flush=True)
        return
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *(argv or sys.argv[1:])]
    fps = []
    for i in range(args.procs):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        fps.append(out.split("fingerprint: ")[-1].strip())
        print(f"process {i}: {fps[-1]}", flush=True)
    print("same bits in every process" if len(set(fps)) == 1 else "DIFFERENT bits across processes")
    sys.exit(0 if len(set(fps)) == 1 else 1)


if __name__ == "__main__":
    main()
