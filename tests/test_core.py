"""The Operator/Kernel machinery and the TESSERA_KERNELS switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import tessera_jax as ts
from tessera_jax.primitives._core import OPERATORS, Kernel, Operator
from tests._util import rand, run_python

# A test operator: reference doubles; its "kernel" is a real pallas_call that doubles and
# adds 1000 so the test can tell which implementation ran.
_seen = []


def _kernel(spec, x, *, interpret):
    del spec
    _seen.append(interpret)

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2 + 1000

    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret
    )(x)


_op = Operator("test_double", reference=lambda x: x * 2, abstract_eval=lambda x: x)
_op.add_kernel(Kernel("pallas_double", _kernel, lambda spec, avals: None, platforms=("cuda",)))


def test_mode_selects_the_lowering_and_is_part_of_the_jit_key():
    x = rand((8, 128))
    f = jax.jit(lambda x: _op.bind(x))
    np.testing.assert_allclose(f(x), x * 2)  # auto on cpu: the reference
    with ts.kernel_mode("interpret"):
        np.testing.assert_allclose(f(x), x * 2 + 1000)  # the same jitted f relowers
    with ts.kernel_mode("xla"):
        np.testing.assert_allclose(f(x), x * 2)
    assert _seen and all(_seen)


def test_pallas_mode_on_cpu_skips_cuda_only_kernels():
    with ts.kernel_mode("pallas"):
        np.testing.assert_allclose(_op.bind(rand((4,))) * 0 + 1, jnp.ones(4))
        assert _op.select("cpu", [], {})[0] == "reference"
        assert _op.select("cuda", [], {})[0] == "pallas_double"


def test_auto_mode_consults_prefer():
    op = Operator("test_prefer", reference=lambda x: x, abstract_eval=lambda x: x)
    op.add_kernel(Kernel("k", _kernel, lambda s, a: None, prefer=lambda s, a: False))
    op.add_kernel(Kernel("unsupported", _kernel, lambda s, a: "never"))
    assert op.select("cuda", [], {})[0] == "reference"
    with ts.kernel_mode("pallas"):
        assert op.select("cuda", [], {})[0] == "k"
    del OPERATORS["test_prefer"]


def test_hardware_interpretable_and_reasons():
    """Every kernel speaks one vocabulary: platforms and hardware decide where the compiled
    kernel may run, interpretable whether interpret mode may run it, and reasons() says
    why each kernel declined a case."""
    op = Operator("test_vocab", reference=lambda x, **_: x, abstract_eval=lambda x, **_: x)
    op.add_kernel(Kernel("old_gpu", _kernel, lambda s, a: None, hardware=lambda p: "too old"))
    op.add_kernel(Kernel("peer", _kernel, lambda s, a: None, interpretable=False))
    op.add_kernel(Kernel("small", _kernel, lambda s, a: None if s == (("n", 1),) else "n != 1"))
    op.add_kernel(Kernel("gone", _kernel, lambda s, a: None, missing="no such backend"))
    try:
        with ts.kernel_mode("pallas"):
            assert op.select("cuda", [], {"n": 2})[0] == "peer"
            assert op.reasons("cuda", [], {"n": 2}) == {
                "old_gpu": "too old",
                "small": "n != 1",
                "gone": "no such backend",
            }
        with ts.kernel_mode("interpret"):
            assert op.select("cpu", [], {"n": 2})[0] == "old_gpu"  # hardware not asked
            assert op.reasons("cpu", [], {"n": 2})["peer"] == "no interpreter runs it"
            assert op.reasons("cpu", [], {"n": 2})["gone"] == "no such backend"
        with ts.kernel_mode("pallas"):
            assert op.reasons("cpu", [], {"n": 1})["small"] == "runs on cuda, not cpu"
    finally:
        del OPERATORS["test_vocab"]


def test_operator_decodes_its_spec_once_for_every_kernel():
    seen = []
    op = Operator(
        "test_spec",
        reference=lambda x, **_: x,
        abstract_eval=lambda x, **_: x,
        spec=lambda params: ("decoded", params["k"]),
    )
    op.add_kernel(Kernel("k", _kernel, lambda s, a: seen.append(s)))
    try:
        with ts.kernel_mode("pallas"):
            op.select("cuda", [], {"k": 3})
        assert seen == [("decoded", 3)]
    finally:
        del OPERATORS["test_spec"]


def test_eager_calls_take_a_cached_jitted_bind():
    """Outside any trace, binding twice with the same parameters reuses one jitted function
    (jax's C++ dispatch path); inside jit the primitive shows in the jaxpr as itself."""
    x = rand((4,))
    np.testing.assert_allclose(_op.bind(x), x * 2)
    first = _op._eager(())
    np.testing.assert_allclose(_op.bind(x + 1), (x + 1) * 2)
    assert _op._eager(()) is first
    assert "ts_test_double" in str(jax.make_jaxpr(_op.bind)(x))


def test_bad_mode_and_duplicate_operator():
    with pytest.raises(ValueError, match="kernel_mode: mode='cuda' must be one of"):
        with ts.kernel_mode("cuda"):
            pass
    with pytest.raises(ValueError, match="operator 'test_double' is already defined"):
        Operator("test_double", reference=lambda x: x, abstract_eval=lambda x: x)


def test_every_operator_is_named_ts_in_jaxprs():
    for name, op in OPERATORS.items():
        assert op.prim.name == f"ts_{name}"


def test_ts_and_ts_op_export_the_same_operators():
    """Every public function of ``ts.op`` is reachable as ``ts.<name>`` (the same object)."""
    import tessera_jax.op as op_module

    names = [n for n in dir(op_module) if not n.startswith("_") and callable(getattr(ts.op, n))]
    names = [n for n in names if n not in ("OPERATORS", "FlashAttentionConfig")]
    assert names
    for n in names:
        assert getattr(ts, n) is getattr(ts.op, n), n


# A jax without Pallas' Triton backend (deprecated from 0.11): the modules that import it
# fail to import, as when it is removed.
_NO_TRITON = """
import sys
for m in ("jax.experimental.pallas.triton", "jax._src.pallas.triton", "jax._src.lib.triton"):
    sys.modules[m] = None
import jax, jax.numpy as jnp, numpy as np
import tessera_jax as ts
from tessera_jax import _compat
from tessera_jax.pallas_kernels import norms_gpu
from tessera_jax.primitives.attention import flash_attention_bwd_op, flash_attention_fwd_op
from tessera_jax.primitives.matmul import matmul_op
from tessera_jax.primitives.norms import rmsnorm_op
from tests._util import assert_close, chosen_kernels, example, rand

assert _compat.pallas_triton is None and "no Pallas Triton backend" in _compat.TRITON_MISSING
x, w = rand((8, 72)), rand((72,)) + 1.0
def run():
    f = lambda x, w: (ts.rmsnorm(x, w) * ts.softmax(x) + ts.log_softmax(x)).sum()
    return jax.value_and_grad(f, argnums=(0, 1))(x, w)
with ts.kernel_mode("xla"):
    want = run()
for mode in ("auto", "pallas", "interpret"):
    with ts.kernel_mode(mode):
        got = run()
        why = rmsnorm_op.reasons("cuda", [jax.typeof(x), jax.typeof(w)], {"eps": 1e-6})
        assert why["pallas_rows"] == _compat.TRITON_MISSING, why
        for op in (flash_attention_fwd_op, flash_attention_bwd_op):
            (k,) = (k for k in op.kernels if k.name == "triton_decode")
            assert k.unavailable(mode, "cuda") == _compat.TRITON_MISSING
        (k,) = (k for k in matmul_op.kernels if k.name == "pallas_portable")
        portable = None if mode == "interpret" else _compat.TRITON_MISSING  # plain Pallas
        assert k.unavailable(mode, "cuda") == portable
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))

# Rows of a multiple of 128 go to the Mosaic ports where a mode takes kernels at all.
rows = [jax.ShapeDtypeStruct((8, 128), jnp.float32), jax.ShapeDtypeStruct((128,), jnp.float32)]
for mode, want in (("auto", "reference"), ("pallas", "reference"), ("interpret", "mosaic_rows")):
    with ts.kernel_mode(mode):  # (this CPU compiles no GPU kernel)
        assert rmsnorm_op.select("cpu", rows, {"eps": 1e-6})[0] == want, mode
x128, w128 = rand((8, 128)), rand((128,)) + 1.0
with ts.kernel_mode("interpret"):  # through the operator, in the Mosaic GPU interpreter
    got = jax.jit(ts.rmsnorm)(x128, w128)
with ts.kernel_mode("xla"):
    assert_close(got, jax.jit(ts.rmsnorm)(x128, w128), factor=2)

a, b = rand((2, 5, 3, 64), jnp.bfloat16), rand((2, 5, 3, 64), jnp.bfloat16)
d = norms_gpu.row_dot(a, b, seq_pad=8)
ref = np.einsum("bshd,bshd->bhs", np.asarray(a, np.float64), np.asarray(b, np.float64))
assert d.shape == (2, 3, 8) and not np.asarray(d[..., 5:]).any()
np.testing.assert_allclose(d[..., :5], ref, rtol=1e-5, atol=1e-5)
assert np.array_equal(d, jax.jit(lambda a, b: norms_gpu.row_dot(a, b, seq_pad=8))(a, b))

# The Mosaic attention kernels, whose backward takes its delta from row_dot.
q, k, v = (rand((1, 128, 2, 64), jnp.bfloat16) for _ in range(3))
loss = lambda q, k, v: (ts.flash_attention(q, k, v, causal=True).astype(jnp.float32) ** 2).sum()
grads = jax.grad(loss, argnums=(0, 1, 2))
with ts.kernel_mode("interpret"):
    assert set(chosen_kernels(grads, q, k, v)) == {
        ("flash_attention_fwd", "mosaic_gpu"),
        ("flash_attention_bwd", "mosaic_gpu"),
    }
    got = grads(q, k, v)
with ts.kernel_mode("xla"):
    want = grads(q, k, v)
for g, r in zip(got, want):
    assert_close(g, r, factor=2)

try:
    example("scale").run(x[0], 2.0)
except NotImplementedError as e:
    assert "tile kernel 'scale'" in str(e) and _compat.TRITON_MISSING in str(e), e
else:
    raise AssertionError("a tile kernel launched without the Triton backend")
print("ok")
"""


def test_without_pallas_triton():
    """Under a jax without Pallas' Triton backend the package imports; the norm and decode
    kernels step aside with that reason (the references run, the same bits as ``xla``
    mode; rows of a multiple of 128 go to the norms' Mosaic ports), ``row_dot`` sums on the
    canonical tree (the Mosaic attention backward's delta too), and a tile kernel raises at
    launch."""
    proc = run_python(_NO_TRITON, timeout=300, JAX_PLATFORMS="cpu")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
