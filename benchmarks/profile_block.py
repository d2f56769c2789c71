"""``ts.profile`` on a small pre-norm transformer block written with ts operators.

Runs anywhere (the CPU with ``--small``); on the GPU machine::

    PYTHONUNBUFFERED=1 python3 benchmarks/profile_block.py [--grad] [--plot PATH]

The block: ``rmsnorm → matmul (qkv) → flash_attention (causal) → matmul → + residual →
rmsnorm → matmul → gelu → matmul → + residual``, bf16 activations and weights. ``--grad``
profiles the loss's value and gradient instead of the forward. Prints the table and the
largest kernels, and writes one record per row, ``{suite, case, device, jax, impl: row
name, kind, ms, kernels, tflops, gbps}`` to ``profile-<device>.json`` (``$OUT`` on the GPU
machine); the trace's path is printed with the table.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tessera_jax as ts  # noqa: E402
from benchmarks._common import device_name, normal, results_path, write_records  # noqa: E402


def block(params, x, *, heads: int):
    """One pre-norm block; ``x`` is ``(batch, seq, d_model)``."""
    b, s, d = x.shape
    h = ts.rmsnorm(x, params["g1"])
    qkv = ts.matmul(h, params["w_qkv"]).reshape(b, s, 3, heads, d // heads)
    att = ts.flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    x = x + ts.matmul(att.reshape(b, s, d), params["w_o"])
    h = ts.rmsnorm(x, params["g2"])
    return x + ts.matmul(ts.gelu(ts.matmul(h, params["w_up"])), params["w_down"])


def make(batch: int, seq: int, d: int, dtype) -> tuple[dict, jax.Array]:
    params = {
        "g1": jnp.ones((d,), dtype),
        "g2": jnp.ones((d,), dtype),
        "w_qkv": normal(1, (d, 3 * d), dtype, scale=d**-0.5),
        "w_o": normal(2, (d, d), dtype, scale=d**-0.5),
        "w_up": normal(3, (d, 4 * d), dtype, scale=d**-0.5),
        "w_down": normal(4, (4 * d, d), dtype, scale=(4 * d) ** -0.5),
    }
    return params, normal(0, (batch, seq, d), dtype)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--grad", action="store_true", help="profile value and gradient")
    parser.add_argument("--plot", default=None, help="roofline PNG path")
    parser.add_argument("--json", default=None, help="records path")
    args = parser.parse_args(argv)
    batch, seq, d, heads = (2, 128, 128, 2) if args.small else (4, 2048, 1024, 8)
    dtype = jnp.float32 if args.small else jnp.bfloat16
    params, x = make(batch, seq, d, dtype)
    fwd = functools.partial(block, heads=heads)
    if args.grad:
        loss = lambda p, x: jnp.sum(fwd(p, x).astype(jnp.float32) ** 2)
        fn, case = jax.value_and_grad(loss), "fwdbwd"
    else:
        fn, case = fwd, "fwd"
    result = ts.profile(fn, params, x, plot=args.plot)
    print(result, flush=True)
    print(result.kernel_table(top=12), flush=True)
    case = f"block-{case}-b{batch}-s{seq}-d{d}-{jnp.dtype(dtype).name}"
    records = [
        {
            "suite": "profile",
            "case": case,
            "device": device_name(family=True),
            "jax": jax.__version__,
            "impl": r.name,
            "kind": r.kind,
            "ms": r.time_s * 1e3,
            "kernels": r.kernels,
            "tflops": None if r.flops_per_s is None else r.flops_per_s / 1e12,
            "gbps": None if r.bytes_per_s is None else r.bytes_per_s / 1e9,
        }
        for r in result.rows
    ]
    path = args.json or results_path(f"profile-{device_name(family=True)}.json")
    print("wrote", write_records(path, records))


if __name__ == "__main__":
    main()
