"""A differentiated fused linear layer ``act(x @ w + b)`` in bf16: what the training step's
MLP up-projection costs, forward and backward.

Timed, in one process: the forward forms (the undifferentiated layer; the two-output
``ts_matmul_with_derivative`` that a differentiated layer binds, y and ``act'(z)`` in bf16,
on XLA's path and on the Hopper kernel; and an f32 pre-activation followed by the
activation and its f32 derivative, the form it replaces), then forward + backward of
``ts.op.linear`` against the same layer in jnp (``jax.nn.gelu(x @ w + b)``). ``ratio`` =
jnp ms / ours. Records: ``benchmarks/results/linear-grad-<device>.json``.

    python benchmarks/linear_grad.py [--shape 8192 1024 4096] [--activation gelu]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import tessera_jax as ts
from benchmarks._common import (
    device_name,
    normal,
    record,
    results_path,
    time_interleaved,
    write_records,
)
from tessera_jax.contracts.matmul import MatmulSpec, activation_derivative, apply_activation
from tessera_jax.pallas_kernels import matmul_mgpu
from tessera_jax.primitives.matmul import matmul_reference, matmul_with_derivative_reference

_JNP_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def forward_forms(activation: str) -> dict:
    """The forward forms, each ``f(x, w, b)``; the kernel's only where it runs here."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    spec = MatmulSpec(bf16, f32, activation=activation, has_bias=True)
    pre = MatmulSpec(f32, f32, has_bias=True)

    def f32_pre_activation(x, w, b):
        z = matmul_reference(x, w, b, spec=pre)
        return apply_activation(z, activation).astype(bf16), activation_derivative(z, activation)

    fns = {
        "forward": functools.partial(matmul_reference, spec=spec),
        "forward+derivative": functools.partial(matmul_with_derivative_reference, spec=spec),
        "f32 pre-activation+derivative": f32_pre_activation,
    }
    if matmul_mgpu.hardware("cuda" if jax.default_backend() == "gpu" else "cpu") is None:
        fns["forward (kernel)"] = functools.partial(matmul_mgpu.matmul, spec)
        fns["forward+derivative (kernel)"] = functools.partial(
            matmul_mgpu.matmul, spec, with_derivative=True
        )
    return {name: jax.jit(f) for name, f in fns.items()}


def forward_backward(activation: str, ct: jax.Array) -> dict:
    """``(y, dx, dw, db)`` of ``ts.op.linear`` and of the same layer in jnp."""
    act = _JNP_ACTIVATIONS[activation]

    def with_vjp(f):
        def run(x, w, b):
            y, f_vjp = jax.vjp(f, x, w, b)
            return y, f_vjp(ct)

        return jax.jit(run)

    return {
        "ts": with_vjp(functools.partial(ts.op.linear, activation=activation)),
        "jnp": with_vjp(lambda x, w, b: act(x @ w + b)),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shape", type=int, nargs=3, default=[8192, 1024, 4096], metavar=("M", "K", "N")
    )
    p.add_argument("--activation", choices=sorted(_JNP_ACTIVATIONS), default="gelu")
    p.add_argument("--json", help="the record file (default: results/linear-grad-<device>.json)")
    args = p.parse_args(argv)
    m, k, n = args.shape
    x = normal(0, (m, k), jnp.bfloat16)
    w = normal(1, (k, n), jnp.bfloat16, scale=k**-0.5)
    b = normal(2, (n,), jnp.bfloat16)
    ct = normal(3, (m, n), jnp.bfloat16)
    case = f"{m}x{k}x{n}-{args.activation}-bf16"

    fwd = time_interleaved(forward_forms(args.activation), (x, w, b))
    both = time_interleaved(forward_backward(args.activation, ct), (x, w, b))
    records = [
        record(
            "linear_grad",
            case,
            f"ts {name}",
            "forward (the undifferentiated layer)",
            ms,
            fwd["forward"],
            part="forward",
        )
        for name, ms in fwd.items()
    ]
    records.append(
        record(
            "linear_grad",
            case,
            "ts.op.linear",
            "jnp (x @ w + b, jax.nn activation)",
            both["ts"],
            both["jnp"],
            part="forward+backward",
        )
    )
    print(f"{'case':28s} {'part':18s} {'implementation':34s} {'ms':>8s}")
    for name, ms in fwd.items():
        print(f"{case:28s} {'forward':18s} {name:34s} {ms:8.3f}")
    for name, ms in both.items():
        print(f"{case:28s} {'forward+backward':18s} {name:34s} {ms:8.3f}")
    path = results_path(args.json or f"linear-grad-{device_name(family=True)}.json")
    write_records(path, records)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
