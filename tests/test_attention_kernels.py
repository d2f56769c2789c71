"""The Hopper flash-attention kernels (forward, dQ, dK/dV) against the float64 reference.

``TestAttentionKernelsInterpret`` runs the kernels in the Mosaic GPU interpreter on the CPU
(``TESSERA_KERNELS=interpret``) at small shapes, sampled to keep the interpreter's time
small: a ragged causal GQA case through forward and backward, and a non-causal case with
the interpreter's race detection on, run twice for bitwise repeatability.
``TestAttentionKernelsGPU`` (``-m gpu``) runs the compiled kernels at real shapes. Each case
first asserts that the operators chose the kernel, so a kernel that silently declined would
fail the test instead of testing the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tessera_jax import _compat
from tessera_jax.contracts.attention import AttentionSpec, FlashAttentionConfig
from tessera_jax.pallas_kernels import attention_mgpu as am
from tests._util import assert_close, chosen_kernels, f64, rand, sample
from tests.test_attention import np_attention, np_attention_grads


def _chosen(f, *args) -> list[str]:
    """The implementation each flash-attention primitive in ``f``'s program lowers to."""
    ops = ("flash_attention_fwd", "flash_attention_bwd")
    return [impl for _, impl in chosen_kernels(f, *args, ops=ops)]


@functools.partial(jax.jit, static_argnames="causal")
def _fwd_bwd(q, k, v, do, causal):
    """``(out, dq, dk, dv)`` of ``ts.flash_attention`` (jitted once per shape and mode)."""
    out, vjp = jax.vjp(functools.partial(ts.flash_attention, causal=causal), q, k, v)
    return (out, *vjp(do))


def _check(case, dtype, *, repeat: int = 1, factor: float = 2.0):
    """Forward and gradients through the kernels vs float64; ``repeat`` runs must agree
    bit for bit."""
    b, sq, skv, hq, hkv, d, causal = case
    q, k, v = (
        rand((b, sq, hq, d), dtype),
        rand((b, skv, hkv, d), dtype),
        rand((b, skv, hkv, d), dtype),
    )
    do = rand((b, sq, hq, d), dtype)
    f = functools.partial(_fwd_bwd, causal=causal)
    assert _chosen(f, q, k, v, do) == ["mosaic_gpu", "mosaic_gpu"]
    runs = [_fwd_bwd(q, k, v, do, causal=causal) for _ in range(repeat)]
    for later in runs[1:]:
        for x, y in zip(runs[0], later):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    out, dq, dk, dv = runs[0]
    assert_close(out, np_attention(f64(q), f64(k), f64(v), causal), factor=factor)
    want = np_attention_grads(f64(q), f64(k), f64(v), f64(do), causal)
    for got, ref in zip((dq, dk, dv), want):
        assert_close(got, ref, factor=factor)


# (batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, causal)
# Padded query and key tails, a GQA group of 2, seq_q < seq_kv (the bottom-right diagonal).
RAGGED_GQA = (1, 72, 100, 2, 1, 64, True)
# head_dim 256: the dK/dV kernel's warpgroups share key rows and split roles, the dQ
# kernel's V ring is shorter than its K ring.
RAGGED_D256 = (1, 72, 100, 1, 1, 256, True)


class TestAttentionKernelsInterpret:
    @pytest.fixture(autouse=True)
    def _mode(self):
        with ts.kernel_mode("interpret"):
            yield

    # The interpreter is slowest on these two: one of them per run (TESSERA_TEST_FULL=1: both).
    @pytest.mark.parametrize(
        "case",
        sample([pytest.param(RAGGED_GQA, id="gqa"), pytest.param(RAGGED_D256, id="d256")], 1),
    )
    def test_ragged_causal(self, case):
        _check(case, jnp.bfloat16)

    # head_dim 256: the dK/dV warpgroups hand Pᵀ over through shared memory. One per run.
    @pytest.mark.parametrize("head_dim", sample([64, 256], 1))
    def test_non_causal_no_races_bitwise_repeatable(self, head_dim):
        """Race detection on; two runs give the same bits (no atomics, a fixed order of
        accumulation)."""
        _fwd_bwd.clear_cache()  # trace under the race-detecting interpreter parameters
        with _compat.gpu_interpret_mode(detect_races=True):
            _check((1, 128, 128, 1, 1, head_dim, False), jnp.float16, repeat=2)
        assert _compat.races_detected() is False
        _fwd_bwd.clear_cache()  # later tests: not the race-detecting program


@pytest.mark.gpu
class TestAttentionKernelsGPU:
    @pytest.fixture(autouse=True)
    def _mode(self):
        with ts.kernel_mode("pallas"):
            yield

    @pytest.mark.parametrize(
        "case",
        [
            (2, 1024, 1024, 8, 2, 128, True),
            (2, 1024, 1024, 8, 8, 128, False),
            (1, 1000, 1000, 4, 1, 64, True),  # ragged, MQA
            (1, 333, 1100, 4, 2, 64, True),  # seq_q < seq_kv, both ragged
            (1, 700, 300, 2, 2, 128, True),  # seq_q > seq_kv: fully masked rows
            RAGGED_GQA,
            (2, 1024, 1024, 8, 2, 256, True),
            (1, 1000, 1000, 4, 4, 256, False),  # ragged
            (1, 333, 1100, 4, 1, 256, True),  # seq_q < seq_kv, both ragged, MQA
        ],
    )
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    def test_forward_and_gradients(self, case, dtype):
        _check(case, dtype, repeat=3)

    @pytest.mark.parametrize("causal", [False, True])
    def test_forward_head_dim_256(self, causal):
        q, k, v = (rand((1, 512, 4, 256), jnp.bfloat16) for _ in range(3))
        f = functools.partial(ts.flash_attention, causal=causal)
        assert _chosen(f, q, k, v) == ["mosaic_gpu"]
        want = np_attention(f64(q), f64(k), f64(v), causal)
        assert_close(jax.jit(f)(q, k, v), want, factor=2)


# --- what the kernels decline (no kernel runs: fast) ----------------------------------------


def _spec(causal=False, config=None, **features):
    config = FlashAttentionConfig() if config is None else config
    return AttentionSpec(causal=causal, scale=0.125, config=config, **features)


def _avals(b, sq, skv, hq, hkv, d, dtype, backward=False):
    q = jax.ShapeDtypeStruct((b, sq, hq, d), dtype)
    kv = jax.ShapeDtypeStruct((b, skv, hkv, d), dtype)
    if not backward:
        return (q, kv, kv)
    return (q, kv, kv, q, jax.ShapeDtypeStruct((b, hq, sq), jnp.float32), q)


@pytest.mark.parametrize(
    "avals, spec, reason",
    [
        (_avals(1, 128, 128, 2, 2, 64, jnp.float32), _spec(), "dtype float32"),
        (_avals(1, 128, 128, 2, 2, 96, jnp.bfloat16), _spec(), "head_dim 96"),
        (_avals(0, 128, 128, 2, 2, 64, jnp.bfloat16), _spec(), "an empty operand"),
        (_avals(1, 128, 128, 2, 2, 192, jnp.bfloat16, True), _spec(), "head_dim 192"),
        (
            _avals(1, 128, 128, 2, 2, 64, jnp.bfloat16),
            _spec(config=FlashAttentionConfig(64, 64)),
            "config=",
        ),
    ],
)
def test_supports_declines_with_a_reason(avals, spec, reason):
    why = am.supports(spec, avals)
    assert why is not None and reason in why
    assert (
        am.supports(_spec(config=FlashAttentionConfig()), _avals(1, 200, 72, 4, 2, 64, jnp.float16))
        is None
    )


def test_declined_case_runs_the_reference():
    """f32 in interpret mode: the kernel declines, the blocked reference runs."""
    q, k, v = (rand((1, 16, 2, 64)) for _ in range(3))
    with ts.kernel_mode("interpret"):
        assert _chosen(ts.flash_attention, q, k, v) == ["reference"]


def test_hardware_names_the_platform():
    assert "not cpu" in am.hardware("cpu")


@pytest.mark.parametrize(
    "features, name",
    [
        (dict(local_window_size=(128, 0)), "local_window_size"),
        (dict(has_mask=True), "mask"),
        (dict(has_dlse=True), "dlse"),
    ],
)
def test_supports_declines_features_it_does_not_implement(features, name):
    """Masks, windows, lengths… (the spec's ``features``) run the blocked reference."""
    why = am.supports(_spec(**features), _avals(1, 128, 128, 2, 2, 64, jnp.bfloat16))
    assert why is not None and name in why


def test_prefer_from_the_measured_sequence_lengths():
    assert am.prefer(_spec(), _avals(2, 4096, 4096, 16, 16, 128, jnp.bfloat16))
    assert am.prefer(_spec(), _avals(1, 512, 2048, 8, 2, 64, jnp.bfloat16, backward=True))
    assert not am.prefer(_spec(), _avals(1, 128, 4096, 8, 8, 128, jnp.bfloat16))


@pytest.mark.parametrize("block_kv", [32, 256])
def test_forward_block_kv_override_is_checked(block_kv):
    q = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"block_kv={block_kv} must be one of"):
        am.flash_fwd(_spec(config=FlashAttentionConfig()), q, q, q, block_kv=block_kv)


@pytest.mark.parametrize(
    "head_dim, override, match",
    [
        (256, dict(dq_block_kv=128), "dq_block_kv=128 must be one of"),
        (64, dict(dq_block_kv=32), "dq_block_kv=32 must be one of"),
        (256, dict(dkv_stages=3), "dkv_stages=3 must be one of"),
        (128, dict(dkv_stages=1), "dkv_stages=1 must be one of"),
        (256, dict(dkv_paired=True), "dkv_paired=True applies to head_dim 64, 128, not 256"),
    ],
)
def test_backward_overrides_are_checked(head_dim, override, match):
    """A tuning override whose ring does not fit shared memory (or is not a choice) is a
    ValueError before any kernel is built."""
    q = jnp.zeros((1, 128, 1, head_dim), jnp.bfloat16)
    lse = jnp.zeros((1, 1, 128), jnp.float32)
    with pytest.raises(ValueError, match=match):
        am.flash_bwd(_spec(), q, q, q, q, lse, q, **override)


def test_backward_schedule_override_must_be_a_bool():
    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 1, 128), jnp.float32)
    with pytest.raises(TypeError, match="dkv_paired=1 must be a bool"):
        am.flash_bwd(_spec(), q, q, q, q, lse, q, dkv_paired=1)
