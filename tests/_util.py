"""Shared test helpers: random inputs, float64 references, per-dtype tolerances."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
import zlib
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from tessera_jax import _compat
from tessera_jax.pallas_kernels import norms_gpu
from tessera_jax.primitives._core import OPERATORS

# The repository's root: what a child process puts on its PYTHONPATH.
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "kernels"

# Relative tolerance of ||out - ref|| / ||ref|| against a float64 reference, by the
# dtype the op computes in. 8-bit formats have 3 (e4m3) or 2 (e5m2) mantissa bits.
RTOL = {
    np.dtype(np.float64): 1e-12,
    np.dtype(np.float32): 2e-6,
    np.dtype(np.float16): 2e-3,
    np.dtype(jnp.bfloat16): 1e-2,
    np.dtype(jnp.float8_e4m3fn): 8e-2,
    np.dtype(jnp.float8_e5m2): 1.5e-1,
}

_counter = itertools.count()


# TESSERA_TEST_SEED shifts every input, to look for tolerances that only hold by luck.
_SEED = int(os.environ.get("TESSERA_TEST_SEED", "0"))


def _seed() -> int:
    """A fresh seed for every call: tests never reuse an input."""
    return 1000 + 7919 * _SEED + next(_counter)


def key() -> jax.Array:
    """A fresh PRNG key for every call: tests never reuse an input."""
    return jax.random.key(_seed())


def start_test(nodeid: str) -> None:
    """Starts the seed sequence at a point given by the test's id (conftest calls it before
    each test): a test's inputs are then the same whichever worker runs it and whatever ran
    before, so a failure reproduces with the test alone."""
    global _counter
    _counter = itertools.count(zlib.crc32(nodeid.encode()) << 12)


def rand(shape, dtype=jnp.float32, *, scale=1.0) -> jax.Array:
    """Standard-normal random values (never zeros), rounded to ``dtype``, from a fresh
    seed. Drawn in NumPy: a draw compiles no XLA program, where jax.random and an eager
    ``astype`` compile one for every new shape, and the suite draws thousands of shapes."""
    x = np.random.default_rng(_seed()).standard_normal(shape, dtype=np.float32)
    return jnp.asarray((x * np.float32(scale)).astype(np.dtype(dtype)))


def f64(x) -> np.ndarray:
    """An array as a float64 (or complex128) numpy array for references (widened in NumPy,
    which compiles nothing)."""
    a = np.asarray(x)
    return a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)


def by_row_blocks(f, parts: int, *args):
    """``f(*args)`` on one device, block by block: ``f`` of each of ``parts`` equal row
    blocks of ``args``, its outputs concatenated along the rows. The reference for a
    product sharded over rows: XLA's CPU dot may round a row differently with the row
    count (its blocking follows it, as on AVX2 machines), so a sharded product matches one
    device's product of the same blocks, not of the whole array, bit for bit."""
    n = args[0].shape[0] // parts
    outs = [f(*(a[i * n : (i + 1) * n] for a in args)) for i in range(parts)]
    return jax.tree.map(lambda *blocks: jnp.concatenate(blocks), *outs)


def rel_err(out, ref) -> float:
    out, ref = f64(out), np.asarray(ref)
    denom = np.linalg.norm(ref.ravel())
    return float(np.linalg.norm((out - ref).ravel()) / (denom if denom > 0 else 1.0))


def assert_close(out, ref, dtype=None, *, rtol=None, factor=1.0):
    """``||out - ref|| / ||ref||`` under the tolerance of ``dtype`` (default: out's)."""
    dtype = np.dtype(dtype if dtype is not None else jnp.asarray(out).dtype)
    tol = (rtol if rtol is not None else RTOL.get(dtype, 1e-5)) * factor
    assert np.all(np.isfinite(f64(out))), "output has non-finite values"
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.3e} ({dtype})"


def matmul_params(**overrides):
    """The static parameters of a ``ts_matmul`` bind: an f32 product of untransposed
    operands with no epilogue, updated by ``overrides``."""
    params = dict(
        transpose_a=False,
        transpose_b=False,
        out_dtype=np.dtype(np.float32),
        accumulate_dtype=np.dtype(np.float32),
        tile_shape=None,
        activation=None,
        has_bias=False,
        has_residual=False,
        has_scale=False,
    )
    params.update(overrides)
    return params


def np_tree(stacked) -> np.ndarray:
    """The canonical pairwise tree over axis 0, written independently in NumPy:
    ``((x0+x1)+(x2+x3))+…``, an odd last node passing up; 16-bit floats accumulate in f32
    and round once."""
    stacked = np.asarray(stacked)
    out_dtype = stacked.dtype
    acc = np.float32 if str(out_dtype) in ("bfloat16", "float16") else out_dtype
    nodes = [np.asarray(s, dtype=acc) for s in stacked]
    while len(nodes) > 1:
        nxt = [nodes[i] + nodes[i + 1] for i in range(0, len(nodes) - 1, 2)]
        if len(nodes) % 2:
            nxt.append(nodes[-1])
        nodes = nxt
    return nodes[0].astype(out_dtype)


def np_activation(z, activation):
    """The epilogue activations (``None``, relu, gelu, gelu_tanh) in float64 NumPy."""
    if activation is None:
        return z
    if activation == "relu":
        return np.maximum(z, 0)
    if activation == "gelu":
        return 0.5 * z * (1 + scipy.special.erf(z / np.sqrt(2)))
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def seed003_quantized_policy():
    """Seed 003's "Custom Numeric Policies" example, verbatim but for
    ``@ts.precision_policy``: int8 storage with a per-tensor f32 scale."""
    import tessera_jax as ts

    @ts.precision_policy
    class QuantizedPolicy:
        storage = ts.int8
        scale = ts.f32
        compute = ts.f32
        accumulate = ts.f32

        def quantize(self, x: ts.f32) -> ts.int8:
            scale = ts.max(ts.abs(x)) / 127.0
            return ts.round(x / scale).astype(ts.int8), scale

        def dequantize(self, x: ts.int8, scale: ts.f32) -> ts.f32:
            return x.astype(ts.f32) * scale

    return QuantizedPolicy


def cuda_lowering(f, *args) -> str:
    """The StableHLO text of ``jax.jit(f)`` lowered for cuda, built on this CPU machine: a
    Mosaic GPU kernel goes through its real lowering (layouts, TMA descriptor checks)."""
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Tests that lower a Pallas Triton kernel for cuda on this CPU machine.
triton_lowers_here = pytest.mark.skipif(
    not _compat.TRITON_LOWERS_WITHOUT_GPU,
    reason="this jax lowers Pallas' Triton kernels only with a local GPU (the -m gpu twins "
    "compile them there)",
)


def _xla_row_dot(a, b, *, interpret=False, seq_pad=None):
    del interpret
    out = jnp.einsum("...d,...d->...", a.astype(jnp.float32), b.astype(jnp.float32))
    if seq_pad is None:
        return out
    return jnp.pad(jnp.swapaxes(out, 1, 2), ((0, 0), (0, 0), (0, seq_pad - a.shape[1])))


def cuda_lowering_xla_row_dot(f, *args) -> str:
    """``cuda_lowering`` of a function that calls ``norms_gpu.row_dot`` beside Mosaic GPU
    kernels (attention's Δ, rmsnorm_matmul's statistics): the Mosaic GPU kernels go
    through their real lowering, XLA's reduction stands in for the row kernel, which
    (Pallas' Triton backend) lowers only with a local GPU from jax 0.11. Its ``-m gpu``
    twins compile it; test_norm_kernels lowers it for cuda where this jax can."""
    with mock.patch.object(norms_gpu, "row_dot", _xla_row_dot):
        return cuda_lowering(f, *args)


def mosaic_gpu_calls(hlo_text: str) -> list[str]:
    """The lines of ``hlo_text`` that call a Mosaic GPU kernel."""
    return [ln for ln in hlo_text.splitlines() if "custom_call @mosaic_gpu" in ln]


# The suite has 10 minutes on 2 cores, so CI runs a fixed sample of the largest grids;
# TESSERA_TEST_FULL=1 runs every case, and TESSERA_TEST_SEED draws another sample.
_FULL = os.environ.get("TESSERA_TEST_FULL") == "1"


def always_and_sample(always, cases, k: int) -> list:
    """``always`` (cases every run takes), then ``k`` more of the other ``cases`` (all of
    them under TESSERA_TEST_FULL=1), in their order."""
    always = list(always)
    return always + sample([c for c in cases if c not in always], k)


def sample(cases, k: int) -> list:
    """``k`` of ``cases`` (all of them under TESSERA_TEST_FULL=1), in their order; the
    same on every xdist worker."""
    cases = list(cases)
    if _FULL or len(cases) <= k:
        return cases
    rng = np.random.default_rng(4242 + _SEED)
    return [cases[i] for i in sorted(rng.choice(len(cases), size=k, replace=False))]


def sample_grid(k: int, **axes) -> tuple[str, list]:
    """``pytest.mark.parametrize`` arguments for ``k`` cases of the product of ``axes``."""
    return ",".join(axes), sample(itertools.product(*axes.values()), k)


def sampled_tests(names: list[str], k: int):
    """A decorator for the test functions ``names``: each runs if it is among ``k`` of them
    sampled for this run (all under TESSERA_TEST_FULL=1), else skips saying so."""
    chosen = set(sample(names, k))

    def mark(test):
        assert test.__name__ in names, test.__name__
        reason = f"not in this run's sample of {k} of {len(names)} tests (TESSERA_TEST_FULL=1)"
        return pytest.mark.skipif(test.__name__ not in chosen, reason=reason)(test)

    return mark


def chosen_kernels(f, *args, ops=None, platform=None) -> list[tuple[str, str]]:
    """``(operator, implementation)`` for each ts primitive (of ``ops``, names; default
    every operator) in ``f``'s program, gradients and inner jaxprs included, in the kernel
    mode in force — by the rule the lowering itself uses, for ``platform`` (default: the
    default device's)."""
    if platform is None:
        platform = jax.devices()[0].platform
        platform = "cuda" if platform == "gpu" else platform
    by_prim = {op.prim: op for name, op in OPERATORS.items() if ops is None or name in ops}
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            op = by_prim.get(eqn.primitive)
            if op is not None:
                avals = [v.aval for v in eqn.invars]
                found.append((op.name, op.select(platform, avals, eqn.params)[0]))
            for v in eqn.params.values():
                for item in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


def assert_same_bits_with_x64(f, args, chosen, want_chosen) -> None:
    """``f(*args)`` with 64-bit types on (``jax_enable_x64``) gives the bits it gives
    without, and ``chosen(f, *args)`` (the kernels the operators pick) is ``want_chosen``
    there: the kernels trace with 64-bit types off (``device.int32_tracing``)."""
    want = jax.tree.leaves(f(*args))
    with _compat.enable_x64(True):
        assert chosen(f, *args) == want_chosen
        got = jax.tree.leaves(f(*args))
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def skip_unsampled_twin(request, k: int) -> None:
    """In an interpret-mode twin class: skips this case unless it is among ``k`` sampled
    cases of its test function (all of them under TESSERA_TEST_FULL=1). The GPU twin
    (``-m gpu``) runs every case; the interpreter's share of the CPU suite stays bounded."""
    node = request.node
    if not hasattr(node, "callspec"):
        return
    ids = [
        it.callspec.id
        for it in request.session.items
        if it.parent is node.parent and it.originalname == node.originalname
    ]
    if node.callspec.id not in sample(ids, k):
        pytest.skip(f"interpret twin not in this run's sample of {k} (TESSERA_TEST_FULL=1)")


def np_activation_derivative(z, activation):
    """The derivative of :func:`np_activation`'s activations in float64 NumPy (relu's is 0
    at 0)."""
    if activation == "relu":
        return (z > 0).astype(np.float64)
    if activation == "gelu":
        return 0.5 * (1 + scipy.special.erf(z / np.sqrt(2))) + z * np.exp(-0.5 * z * z) / np.sqrt(
            2 * np.pi
        )
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (z + 0.044715 * z**3))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)


def subjaxprs(params):
    """The jaxprs nested in an equation's ``params`` (pjit, shard_map, scan, cond, remat,
    custom rules)."""
    for v in params.values():
        for item in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner


# Primitives whose summation order XLA chooses (on GPUs, its autotuner, by timing).
XLA_ORDERED_SUMS = frozenset({"reduce_sum", "dot_general", "cumsum"})


def xla_ordered_sums(f, *args) -> list[str]:
    """The primitives in ``f``'s program, outside its Pallas kernels, whose summation order
    XLA picks: glue around a kernel that must keep its bits from one program to the next
    (a mesh, another process) sums on the canonical tree instead."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                continue
            if eqn.primitive.name in XLA_ORDERED_SUMS:
                found.append(eqn.primitive.name)
            for sub in subjaxprs(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


def run_python(child: str, timeout: float | None = None, **env: str):
    """``python -c child`` in a child process from the repository's root, with it on the
    PYTHONPATH and ``env`` set; its output captured (a ``CompletedProcess``)."""
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", child],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def example(name: str):
    """The tile-language example ``examples/kernels/<name>.py``, imported as a module."""
    spec = importlib.util.spec_from_file_location(f"tile_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_no_serialised_wgmma(child: str, kernels: int) -> None:
    """Compiles in a child process with ptxas's report on (one "Compiling entry function"
    line per kernel, at least ``kernels`` of them) and fails on any C7513 warning."""
    proc = run_python(child, MOSAIC_GPU_DUMP_PTXAS="1")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "compiled" in proc.stdout, log[-3000:]
    assert log.count("Compiling entry function") >= kernels, log[-3000:]
    serialised = [line for line in log.splitlines() if "C7513" in line]
    assert not serialised, "\n".join(serialised)
