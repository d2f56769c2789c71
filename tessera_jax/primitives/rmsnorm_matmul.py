"""rmsnorm fused into the following matmul: ``ts_rmsnorm_matmul(x, weight, b)``.

With ``r = 1/sqrt(mean(x²) + eps)`` over the last axis (a row's statistic)::

    out = rmsnorm(x, weight, eps) @ b = (x · r · weight) @ b

one primitive, so that no normalised activation ``x̂`` has to exist in memory. Its XLA
lowering is the unfused math (``ts.rmsnorm``'s reference, statistics in f32 for 8-/16-bit
inputs, the normalised value rounded to ``x.dtype``, then ``ts.matmul``'s reference); the
Hopper kernel uses the factorisation::

    (x · r · weight) @ b = diag(r) · (x @ (weight[:, None] · b))

``r`` in one f32 read of x (a row kernel, whose summation order depends on K only),
``weight`` folded into ``b`` (a ``(K, N)`` pass, rounded once to b's dtype), and ``r``
applied to the rows of the f32 accumulator in the Mosaic GPU matmul's epilogue
(``matmul_mgpu.matmul(..., row_scale=r)``). x̂ is never rounded: the kernel rounds
``weight·b`` instead, and the result differs from the unfused path by those roundings (a
few bf16 ulps of the output, the tests' tolerance). A row whose squares overflow f32
(elements above ~1.8e19) would overflow the accumulator too: the kernel takes the unfused
path whenever any row's ``mean(x²)`` is infinite (a ``lax.cond`` on the statistics); a row
holding NaN gives NaN as in ``ts.rmsnorm``. ``auto`` mode takes the kernel where it measured
faster than XLA's norm-then-dot (see :func:`prefer`); elsewhere on a GPU the two operators
run, each by its own dispatch (:func:`unfused_operators`: the rmsnorm row kernel, not the
reference's XLA formula). Training steps differentiate ``b`` and run the unfused graph
(below).

Operands: ``x (..., K)`` and ``b (K, N)`` of one float dtype, ``weight (K,)`` of any float
dtype; static ``spec`` (:class:`RMSNormMatmulSpec`: eps, output and accumulate dtypes).

Adjoints: the JVP recomputes through the unfused decomposition in ts operators,
``ts_matmul(ts_rmsnorm(x, weight), b)``, whose rules give the tangents (and, transposed,
``dx``, ``dweight``, ``db``: the rmsnorm backward kernel and the matmul adjoint products).
Where ``b`` is differentiated, ``db = x̂ᵀ·dy`` needs x̂ in memory anyway, and the primal is
the decomposition's (see ``_jvp``): training steps run the unfused graph.
Batching: a mapped x is one more leading dimension; a mapped weight or b runs the
decomposition under vmap. Sharding (``sharding/rules.py``): rows and N pass through, K
(the normalised, contracted axis) is gathered if sharded, as for ``ts.rmsnorm``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tessera_jax._config import get_kernel_mode
from tessera_jax.contracts.matmul import MatmulSpec
from tessera_jax.numerics.dtypes import as_np_dtype
from tessera_jax.pallas_kernels import device, norms_gpu
from tessera_jax.pallas_kernels import matmul_configs as _mc
from tessera_jax.pallas_kernels import matmul_mgpu as _mgpu
from tessera_jax.primitives._core import (
    Kernel,
    Operator,
    ad,
    as_array,
    batching,
    compute_dtype,
    not_mapped,
    zero_tangent,
)
from tessera_jax.primitives.matmul import matmul_op, matmul_reference
from tessera_jax.primitives.norms import rmsnorm_op, rmsnorm_reference

_WIDE_FLOATS = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
_F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class RMSNormMatmulSpec:
    """The static parameters of one ``ts_rmsnorm_matmul`` bind.

    Attributes:
      eps: added to the mean square (finite, > 0).
      out_dtype: the result's dtype.
      accumulate_dtype: the product's accumulator (``ts_matmul``'s, f32 for 16-bit).
    """

    eps: float
    out_dtype: np.dtype
    accumulate_dtype: np.dtype

    def __post_init__(self):
        object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "out_dtype", np.dtype(self.out_dtype))
        object.__setattr__(self, "accumulate_dtype", np.dtype(self.accumulate_dtype))

    @property
    def product(self) -> MatmulSpec:
        """The plain ``ts_matmul`` spec of the product that follows the norm."""
        return MatmulSpec(out_dtype=self.out_dtype, accumulate_dtype=self.accumulate_dtype)


# --- the primitive ------------------------------------------------------------------------


def rmsnorm_matmul_reference(x, weight, b, *, spec: RMSNormMatmulSpec):
    """The XLA lowering of ``ts_rmsnorm_matmul`` (and its kernel's oracle): ``ts.rmsnorm``'s
    reference, then ``ts.matmul``'s (a 2-D b shared by x's leading dimensions)."""
    y = rmsnorm_reference(x, weight, eps=spec.eps, has_weight=True)
    return matmul_reference(y, b, spec=spec.product)


def _abstract_eval(x, weight, b, *, spec: RMSNormMatmulSpec):
    del weight
    return jax.core.ShapedArray((*x.shape[:-1], b.shape[-1]), spec.out_dtype)


rmsnorm_matmul_op = Operator(
    "rmsnorm_matmul",
    reference=rmsnorm_matmul_reference,
    abstract_eval=_abstract_eval,
    spec=lambda params: params["spec"],
)


def _unfused(x, weight, b, *, spec: RMSNormMatmulSpec):
    """The decomposition in ts operators, whose JVP/transpose/batching rules the fused
    operator's adjoints and vmap reuse (``ts_matmul`` takes x of rank >= 2)."""
    x2 = x[None] if x.ndim == 1 else x
    y = rmsnorm_op.bind(x2, weight, eps=spec.eps, has_weight=True)
    out = matmul_op.bind(y, b, spec=spec.product)
    return out[0] if x.ndim == 1 else out


def _jvp(primals, tangents, *, spec: RMSNormMatmulSpec):
    """Tangents through the unfused decomposition. With a tangent of ``b`` its transpose
    needs x̂ in memory (``db = x̂ᵀ·dy``), so the primal is the decomposition's product of
    that x̂ (nothing left for the fusion to save); otherwise the fused primal, and the
    tangent ``ts_matmul(ts_rmsnorm_tangent(…), b)`` never materialises x̂."""
    live = [type(t) is not ad.Zero for t in tangents]
    if not any(live):
        y = rmsnorm_matmul_op.bind(*primals, spec=spec)
        return y, zero_tangent(y)

    def of_live(*args):
        it = iter(args)
        full = [next(it) if z else p for p, z in zip(primals, live)]
        return _unfused(*full, spec=spec)

    args = [p for p, z in zip(primals, live) if z]
    dargs = [t for t, z in zip(tangents, live) if z]
    y_unfused, dy = jax.jvp(of_live, args, dargs)
    if live[2]:
        return y_unfused, dy
    return rmsnorm_matmul_op.bind(*primals, spec=spec), dy


ad.primitive_jvps[rmsnorm_matmul_op.prim] = _jvp


def _batch(args, dims, *, spec: RMSNormMatmulSpec):
    x, weight, b = args
    dx, dw, db = dims
    if dw is not_mapped and db is not_mapped:  # x's batch is one more row dimension
        return rmsnorm_matmul_op.bind(jnp.moveaxis(x, dx, 0), weight, b, spec=spec), 0
    in_axes = tuple(None if d is not_mapped else d for d in dims)
    out = jax.vmap(functools.partial(_unfused, spec=spec), in_axes=in_axes)(x, weight, b)
    return out, 0


batching.primitive_batchers[rmsnorm_matmul_op.prim] = _batch


# --- the public function ------------------------------------------------------------------


def _check_float(name: str, arg: str, v: Any) -> jax.Array:
    v = as_array(name, arg, v)
    if np.dtype(v.dtype) not in _WIDE_FLOATS:
        raise TypeError(
            f"{name}: {arg}.dtype={np.dtype(v.dtype)} is not supported; expected float16, "
            "bfloat16, float32 or float64"
        )
    return v


def rmsnorm_matmul(
    x: jax.Array,
    weight: jax.Array,
    b: jax.Array,
    *,
    eps: float = 1e-6,
    out_dtype: Any = None,
) -> jax.Array:
    """``rmsnorm(x, weight, eps) @ b`` as one operator (``ts_rmsnorm_matmul``).

    The unfused value, ``ts.matmul(ts.rmsnorm(x, weight, eps), b)``, is what the XLA
    lowering computes; the Hopper kernel writes no normalised activation (see the module
    docstring for its factorisation and rounding).

    Arguments:
      x: ``(..., K)`` activations, float16, bfloat16, float32 or float64.
      weight: the norm's scale ``(K,)``, any of those dtypes (applied in f32 for 16-bit x).
      b: ``(K, N)`` weights of ``x``'s dtype.
      eps: a finite float > 0 added to the mean square.
      out_dtype: the result's float dtype (default ``x.dtype``).
    Returns:
      ``(..., N)`` array of ``out_dtype``.

    Gradients flow to ``x``, ``weight`` and ``b`` (through the unfused decomposition).
    """
    name = "rmsnorm_matmul"
    x = _check_float(name, "x", x)
    weight = _check_float(name, "weight", weight)
    b = _check_float(name, "b", b)
    if x.ndim == 0:
        raise ValueError(f"{name}: x.shape=() has rank 0; x must be (..., K)")
    if b.ndim != 2:
        raise ValueError(f"{name}: b.shape={b.shape} has rank {b.ndim}; b must be (K, N)")
    k = x.shape[-1]
    if weight.shape != (k,):
        raise ValueError(
            f"{name}: weight.shape={weight.shape} must be (K,) = ({k},), the last dimension of "
            f"x.shape={x.shape}"
        )
    if b.shape[0] != k:
        raise ValueError(
            f"{name}: b.shape[0]={b.shape[0]} must equal x.shape[-1]={k} (x.shape={x.shape}, "
            f"b.shape={b.shape})"
        )
    if b.dtype != x.dtype:
        raise TypeError(
            f"{name}: b.dtype={np.dtype(b.dtype)} must equal x.dtype={np.dtype(x.dtype)} (cast "
            "one of them: the fused product takes one operand dtype)"
        )
    ok = isinstance(eps, (int, float, np.integer, np.floating)) and not isinstance(eps, bool)
    if not ok:
        raise TypeError(f"{name}: eps={eps!r} must be a Python float")
    if not (math.isfinite(float(eps)) and float(eps) > 0):
        raise ValueError(f"{name}: eps={float(eps)} must be a finite float > 0")
    if out_dtype is None:
        out = np.dtype(x.dtype)
    else:
        try:
            out = as_np_dtype(out_dtype)
        except TypeError as e:
            raise TypeError(f"{name}: out_dtype={out_dtype!r}: {e}") from None
        if out not in _WIDE_FLOATS:
            raise TypeError(
                f"{name}: out_dtype={out} must be float16, bfloat16, float32 or float64"
            )
    spec = RMSNormMatmulSpec(eps=eps, out_dtype=out, accumulate_dtype=compute_dtype(x.dtype))
    return rmsnorm_matmul_op.bind(x, weight, b, spec=spec)


# --- the Hopper kernel --------------------------------------------------------------------


def _problem(avals) -> tuple[int, int, int]:
    """``(M, N, K)`` of the product, x's leading dimensions flattened into M."""
    x, _, b = avals
    return math.prod(x.shape[:-1]), b.shape[-1], x.shape[-1]


def supports(spec: RMSNormMatmulSpec, avals) -> str | None:
    """None if the Mosaic GPU path can run the case (never raises): 16-bit ``x``/``b``, a
    ``(K,)`` weight and 2-D ``b``, no empty dimension, and a product the matmul kernel runs
    with a row scale (its tile, shared memory, output dtype)."""
    x, w, b = avals
    dt = np.dtype(x.dtype)
    if dt not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)) or np.dtype(b.dtype) != dt:
        return f"x, b dtypes {dt} x {np.dtype(b.dtype)} (the kernel takes one 16-bit dtype)"
    if w.shape != x.shape[-1:] or b.ndim != 2:
        return f"weight {w.shape} and b {b.shape} (the kernel takes (K,) and (K, N))"
    m, n, k = _problem(avals)
    if 0 in (m, n, k):
        return f"an empty product (M, N, K) = {(m, n, k)}"
    rows = jax.ShapeDtypeStruct((m, k), dt)
    why = norms_gpu.supports((), (rows,))  # mean_square's row kernel
    if why is not None:
        return f"the row statistics' kernel: {why}"
    return _mgpu.supports(spec.product, (rows, b), row_scaled=True)


# The fused kernel saves the write and re-read of x̂ (4·M·K bytes in 16 bits) at the cost of
# one more read of x (2·M·K bytes, the statistics), a pass over b (weight·b) and runs the
# product on the Mosaic GPU matmul. Measured on the H100 (benchmarks/results/norms-h100.json,
# the rmsnorm_matmul cases, M=16384, K=4096) it beats XLA's norm-then-dot at N=1024 and falls
# behind it at N=4096 (the Mosaic GEMM trails cuBLAS there by more than the saving), so
# ``auto`` takes it up to PREFER_MAX_N columns, from PREFER_MIN_ROWS rows and K >=
# PREFER_MIN_K, whole tiles. On an H200 (norms-h200.json) at K=4096, N=1024 it also lost to
# the two operators (``unfused_operators``, which ``auto`` runs instead) at M=8192 and 4096,
# where the pass over b and the extra launches weigh more against a shorter product.
PREFER_MIN_ROWS = 16384
PREFER_MIN_K = 1024
PREFER_MAX_N = 1024


def prefer(spec: RMSNormMatmulSpec, avals) -> bool:
    """Whether the fused kernel is expected to beat XLA's norm-then-dot (``auto`` mode)."""
    del spec  # the rule is a function of the shapes
    m, n, k = _problem(avals)
    if m < PREFER_MIN_ROWS or k < PREFER_MIN_K or n > PREFER_MAX_N or n < _mc.TILE_ROWS:
        return False
    dt = np.dtype(avals[0].dtype)
    cfg = _mc.default_config(m, n, k, dt, dt, num_sms=device.sm_counts(interpret=False).tuned)
    cm, cn = cfg.cluster_tile
    return m % cm == 0 and n % cn == 0 and k % cfg.block_k == 0


def mean_square(x2: jax.Array, *, interpret: bool = False) -> jax.Array:
    """``mean(x2²)`` over each row of ``(M, K)`` in f32. The row kernel's summation order
    depends on K only, where XLA's own reduction takes the order of the emitter its GPU
    autotuner picks by timing: the bits would follow the program (a mesh's shard, another
    process). Products of 16-bit x are exact in f32."""
    return norms_gpu.row_dot(x2, x2, interpret=interpret) / np.float32(x2.shape[-1])


def fused_kernel(spec: RMSNormMatmulSpec, x, weight, b, *, interpret: bool = False):
    """``diag(r) · (x @ round(weight·b))`` with r in f32 and the row scale in the Mosaic GPU
    matmul's epilogue; the unfused reference where a row's mean square overflows f32."""
    k, n = x.shape[-1], b.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    s = mean_square(x2, interpret=interpret) + np.float32(spec.eps)
    r = lax.rsqrt(s)  # a NaN in the row makes r NaN: the row's output is NaN
    wb = (weight.astype(_F32)[:, None] * b.astype(_F32)).astype(b.dtype)

    def fused(x2, wb, r, weight, b):
        del weight, b
        return _mgpu.matmul(spec.product, x2, wb, row_scale=r, interpret=interpret)

    def unfused(x2, wb, r, weight, b):
        del wb, r
        return rmsnorm_matmul_reference(x2, weight, b, spec=spec)

    out = lax.cond(jnp.any(jnp.isinf(s)), unfused, fused, x2, wb, r, weight, b)
    return out.reshape(*lead, n)


rmsnorm_matmul_op.add_kernel(
    Kernel(
        name="mosaic_gpu",
        fn=fused_kernel,
        supports=supports,
        prefer=prefer,
        platforms=("cuda",),
        hardware=_mgpu.hardware,
    )
)


def unfused_operators(spec: RMSNormMatmulSpec, x, weight, b, *, interpret: bool = False):
    """``ts_matmul(ts_rmsnorm(x, weight), b)``, each operator by its own dispatch: the
    rmsnorm row kernel where ``auto`` takes it, then cuBLAS or the matmul kernels. Where the
    fused kernel is not taken, this rather than the operator's reference: the reference
    normalises with ``ts.rmsnorm``'s XLA formula, slower on a GPU than the row kernel. The
    nested operators are picked in the kernel mode in force, so ``interpret`` must agree
    with it, as it does when the dispatch calls this."""
    mode = get_kernel_mode()
    if interpret != (mode == "interpret"):
        raise ValueError(
            f"rmsnorm_matmul.unfused_operators: {interpret=} must agree with the kernel mode "
            f"in force ({mode!r}), in which the nested operators are picked"
        )
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (not -1: K may be 0)
    # Traced here (Operator.apply), not bound: a bound primitive's lowering would pick
    # later, by the sharding rule's partitioner, outside the mode. (The GPU's picks: this
    # kernel runs on GPUs.)
    y = rmsnorm_op.apply("cuda", x2, weight, eps=spec.eps, has_weight=True)
    out = matmul_op.apply("cuda", y, b, spec=spec.product)
    return out.reshape(*x.shape[:-1], b.shape[-1])


# After the fused kernel: the first kernel that supports a case (and, in ``auto`` mode,
# prefers it) wins, and this one supports every case on a GPU.
rmsnorm_matmul_op.add_kernel(
    Kernel(
        name="unfused_operators",
        fn=unfused_operators,
        supports=lambda spec, avals: None,
        platforms=("cuda",),
    )
)
