"""The Operator/Kernel machinery and the TESSERA_KERNELS switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import tessera_jax as ts
from tessera_jax.primitives._core import OPERATORS, Kernel, Operator
from tests._util import rand

# A test operator: reference doubles; its "kernel" is a real pallas_call that doubles and
# adds 1000 so the test can tell which implementation ran.
_seen = []


def _kernel(x, *, interpret):
    _seen.append(interpret)

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2 + 1000

    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret
    )(x)


_op = Operator("test_double", reference=lambda x: x * 2, abstract_eval=lambda x: x)
_op.add_kernel(
    Kernel("pallas_double", _kernel, lambda avals, params, platform: None, platforms=("cuda",))
)


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
    op.add_kernel(Kernel("k", _kernel, lambda a, p, pl_: None, prefer=lambda a, p: False))
    op.add_kernel(Kernel("unsupported", _kernel, lambda a, p, pl_: "never"))
    assert op.select("cuda", [], {})[0] == "reference"
    with ts.kernel_mode("pallas"):
        assert op.select("cuda", [], {})[0] == "k"
    del OPERATORS["test_prefer"]


def test_bad_mode_and_duplicate_operator():
    with pytest.raises(ValueError, match="kernel_mode: mode='cuda' must be one of"):
        with ts.kernel_mode("cuda"):
            pass
    with pytest.raises(ValueError, match="operator 'test_double' is already defined"):
        Operator("test_double", reference=lambda x: x, abstract_eval=lambda x: x)


def test_every_operator_is_named_ts_in_jaxprs():
    for name, op in OPERATORS.items():
        assert op.prim.name == f"ts_{name}"
