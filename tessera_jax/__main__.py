"""``python -m tessera_jax demo``: the main job.

Today: jit-compile and differentiate a small model built from ts operators
(a fused MLP with an RMSNorm, mean-squared-error loss), train it for a few
steps on a fixed synthetic regression task, and print the loss and the
gradient norm at each step plus a fingerprint of the final parameters. Every
number is deterministic: the same bits on every run of the same machine.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _init(key: jax.Array, d_in: int, d_hidden: int, d_out: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "W1": jax.random.normal(k1, (d_in, d_hidden), jnp.float32) / np.sqrt(d_in),
        "b1": jnp.zeros((d_hidden,), jnp.float32),
        "W2": jax.random.normal(k2, (d_hidden, d_out), jnp.float32) / np.sqrt(d_hidden),
        "b2": jnp.zeros((d_out,), jnp.float32),
        "g": jnp.ones((d_in,), jnp.float32),
    }


def _fingerprint(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def demo(steps: int = 20, seed: int = 0, batch: int = 64, lr: float = 0.1) -> dict[str, float]:
    import tessera_jax as ts

    d_in, d_hidden, d_out = 32, 64, 8
    kp, kx, kt = jax.random.split(jax.random.key(seed), 3)
    params = _init(kp, d_in, d_hidden, d_out)
    x = jax.random.normal(kx, (batch, d_in), jnp.float32)
    teacher = jax.random.normal(kt, (d_in, d_out), jnp.float32) / np.sqrt(d_in)
    y = ts.tanh(ts.matmul(x, teacher))

    @ts.autodiff
    def loss_fn(params, x, y):
        h = ts.rmsnorm(x, params["g"])
        pred = ts.op.fused_mlp(
            h, params["W1"], params["b1"], params["W2"], params["b2"], activation="gelu"
        )
        return ts.mse(pred, y)

    @ts.jit
    def step(params, x, y):
        loss, grads = ts.value_and_grad(loss_fn)(params, x, y)
        sq = [ts.sum(g * g) for g in jax.tree_util.tree_leaves(grads)]
        gnorm = ts.sqrt(ts.sum(jnp.stack(sq)))
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
        return params, loss, gnorm

    print(
        f"tessera_jax demo: jax {jax.__version__}, backend {jax.default_backend()}, "
        f"kernel mode {ts.get_kernel_mode()}"
    )
    print(f"model: rmsnorm → fused_mlp({d_in}→{d_hidden}→{d_out}, gelu) → mse; batch {batch}")
    t0 = time.perf_counter()
    first = last = None
    for i in range(steps):
        params, loss, gnorm = step(params, x, y)
        loss, gnorm = float(loss), float(gnorm)
        first = loss if first is None else first
        last = loss
        if i == 0 or (i + 1) % max(1, steps // 5) == 0 or i == steps - 1:
            print(f"step {i + 1:4d}  loss {loss:.6f}  grad_norm {gnorm:.6f}")
    elapsed = time.perf_counter() - t0
    fp = _fingerprint(params)
    print(f"final loss {last:.6f} (from {first:.6f}) in {elapsed:.2f}s; params fingerprint {fp}")
    return {"first_loss": first, "final_loss": last, "grad_norm": gnorm, "fingerprint": fp}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tessera_jax",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small ts model and print loss and gradient norm")
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.steps < 1:
            parser.error(f"--steps={args.steps} must be at least 1")
        demo(steps=args.steps, seed=args.seed, batch=args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
