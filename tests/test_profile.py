"""``ts.profile``: per-operator device time from the JAX profiler's trace, on the CPU.

One profile of a small model of ts operators is shared by the tests (module fixture): a
profile compiles the model and runs it under the profiler, which is the slow part.
"""

import gzip
import json
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax import profiling
from tests._util import rand

M, K, N = 32, 64, 48


def model(x, w, g):
    """rmsnorm → matmul → gelu → (a non-ts add) → softmax."""
    h = ts.gelu(ts.matmul(ts.rmsnorm(x, g), w))
    return ts.softmax(h + 1.0, axis=-1)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile")
    args = (rand((M, K)), rand((K, N)), rand((K,)))
    return ts.profile(model, *args, steps=3, plot=folder / "roofline.png", trace_dir=folder)


def _used(fn, *args) -> set[str]:
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return {e.primitive.name for e in eqns if e.primitive.name.startswith("ts_")}


def test_a_row_per_ts_operator(result):
    used = _used(model, jnp.ones((M, K)), jnp.ones((K, N)), jnp.ones((K,)))
    assert used == {"ts_rmsnorm", "ts_matmul", "ts_gelu", "ts_softmax"}
    names = {r.name for r in result.rows}
    # Every operator has a row, unless XLA fused all its ops into another row's kernels.
    assert used - set(result.unattributed) <= names
    fused_into = {f for r in result.rows for f in r.fused}
    assert set(result.unattributed) <= fused_into
    assert "ts_matmul" in names  # a product always keeps a kernel of its own
    assert "(idle)" == result.rows[-1].name
    assert {r.kind for r in result.rows if r.name in used} == {"operator"}


def test_times_are_positive_and_sum_to_the_device_time(result):
    for r in result.rows:
        assert r.time_s >= 0 and (r.time_s > 0 or r.name == "(idle)"), r
        assert r.kernels > 0 or r.name == "(idle)", r
    total = sum(r.time_s for r in result.rows) - result.overlap_s
    np.testing.assert_allclose(total, result.device_s, rtol=1e-9)
    assert 0 < result.device_s <= result.host_s
    assert result.overlap_s >= 0


def test_kernels_add_up_to_their_rows(result):
    assert result.kernels and len({k.name for k in result.kernels}) == len(result.kernels)
    times = [k.time_s for k in result.kernels]
    assert times == sorted(times, reverse=True) and min(times) >= 0
    for r in result.rows[:-1]:  # (idle) has no kernel
        mine = [k for k in result.kernels if k.row == r.name]
        assert mine, r.name
        np.testing.assert_allclose(sum(k.time_s for k in mine), r.time_s, rtol=1e-9)
        np.testing.assert_allclose(sum(k.calls for k in mine), r.kernels, rtol=1e-9)
    assert {k.row for k in result.kernels} == {r.name for r in result.rows[:-1]}
    assert all(k.launched for k in result.kernels)


def test_kernel_table(result):
    lines = result.kernel_table(top=2).splitlines()
    assert len(lines) == 2 + 2 + (len(result.kernels) > 2)
    assert result.kernels[0].name[:28] in lines[2] and result.kernels[1].row[:28] in lines[3]
    if len(result.kernels) > 2:
        assert f"and {len(result.kernels) - 2} more kernels" in lines[-1]
    assert len(result.kernel_table().splitlines()) == 2 + len(result.kernels)
    with pytest.raises(ValueError, match="top=0 must be an int >= 1 or None"):
        result.kernel_table(top=0)


def test_matmul_flops_and_bytes(result):
    row = result.row("ts_matmul")
    assert row.flops == 2 * M * N * K
    assert row.bytes == 4 * (M * K + K * N + M * N)
    assert row.dtype == "float32"
    assert row.flops_per_s == pytest.approx(row.flops / row.time_s)
    assert row.intensity == pytest.approx(row.flops / row.bytes)


@pytest.mark.parametrize(
    "a_shape,b_shape,flops",
    [((3, 8, 16), (16, 4), 2 * 3 * 8 * 4 * 16), ((5, 7), (7, 9), 2 * 5 * 9 * 7)],
)
def test_operator_cost_of_matmul(a_shape, b_shape, flops):
    jaxpr = jax.make_jaxpr(ts.matmul)(jnp.ones(a_shape), jnp.ones(b_shape)).jaxpr
    costs = profiling._program_costs(jaxpr, profiling._ts_names(), num_devices=1)
    assert costs["ts_matmul"].flops == flops
    out = int(np.prod(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))) * a_shape[-2]
    out *= b_shape[-1]
    assert costs["ts_matmul"].bytes == 4 * (np.prod(a_shape) + np.prod(b_shape) + out)


def test_scan_counts_its_body_per_iteration():
    def f(x, w):
        return jax.lax.scan(lambda c, _: (ts.matmul(c, w), None), x, None, length=3)[0]

    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((8, 8))).jaxpr
    costs = profiling._program_costs(jaxpr, profiling._ts_names(), num_devices=1)
    assert costs["ts_matmul"].flops == 3 * 2 * 4 * 8 * 8


def test_cond_makes_the_count_unknown():
    def f(p, x, w):
        return jax.lax.cond(p, lambda: ts.matmul(x, w), lambda: x @ w)

    jaxpr = jax.make_jaxpr(f)(True, jnp.ones((4, 8)), jnp.ones((8, 8))).jaxpr
    costs = profiling._program_costs(jaxpr, profiling._ts_names(), num_devices=1)
    assert costs["ts_matmul"].flops is None and costs["ts_matmul"].bytes is None


def test_lowering_names_the_operator():
    # XLA's op metadata carries the ts primitive's name: how kernels are attributed.
    hlo = jax.jit(lambda a, b: ts.matmul(a, b) + 1.0).lower(jnp.ones((4, 8)), jnp.ones((8, 2)))
    text = hlo.compile().as_text()
    assert re.search(r'op_name="[^"]*/ts_matmul/dot_general"', text)
    assert re.search(r'op_name="jit\(<lambda>\)/add"', text)


def test_table_plot_and_trace(result):
    text = str(result)
    assert text.splitlines()[0].startswith("ts.profile on cpu")
    for r in result.rows:
        assert r.name[:28] in text
    assert "XLA cost analysis" in text and "operator formulas" in text
    with open(result.plot_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert result.trace_path.endswith(".trace.json.gz")
    with gzip.open(result.trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("args", {}).get("hlo_op") for e in events)
    assert result.perfetto_path is not None and os.path.exists(result.perfetto_path)
    # The program's totals come from XLA; they include the non-ts add.
    assert result.xla_flops is not None and result.xla_flops >= result.row("ts_matmul").flops


def test_collective_time_and_bandwidth():
    mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])

    def f(x):
        body = lambda p: ts.all_reduce(p, axis="dp", deterministic=False)
        return jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P())(x)

    x = jax.device_put(rand((2 * 64, 32)), NamedSharding(mesh, P("dp")))
    out = ts.profile(f, x, steps=2)
    row = out.row("ts_all_reduce")
    assert row.kind == "collective" and row.time_s > 0
    assert row.bytes == 64 * 32 * 4  # each device's payload
    assert out.collective_s == pytest.approx(row.time_s)
    assert out.collective_bytes == row.bytes
    assert "algorithm bandwidth" in str(out)


def _device(kind: str, platform: str = "gpu"):
    return types.SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize(
    "kind,bf16,hbm",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12, 3.35e12),
        ("NVIDIA H200", 989.4e12, 4.8e12),
        ("NVIDIA H100 PCIe", 756.0e12, 2.0e12),
    ],
)
def test_peaks_by_device_kind(kind, bf16, hbm):
    peaks = profiling.device_peaks(_device(kind))
    assert peaks.flops_per_s["bfloat16"] == bf16
    assert peaks.bytes_per_s == hbm
    assert "datasheet" in peaks.source


def test_unknown_gpu_has_no_made_up_peaks():
    with pytest.raises(ValueError, match=r"profile: no peaks known for device_kind='Foo GPU'"):
        profiling.device_peaks(_device("Foo GPU"))


def test_bad_input(tmp_path):
    x = jnp.ones((4, 4))
    with pytest.raises(TypeError, match=r"profile: fn=3 must be callable"):
        ts.profile(3, x)
    missing = tmp_path / "nope" / "roofline.png"
    with pytest.raises(ValueError, match=r"profile: plot=.*nope.*does not exist"):
        ts.profile(ts.relu, x, plot=missing)
    with pytest.raises(ValueError, match=r"profile: steps=0 must be an int >= 1"):
        ts.profile(ts.relu, x, steps=0)
    with pytest.raises(TypeError, match=r"profile: peaks=.* must be a ts.profiling.Peaks"):
        ts.profile(ts.relu, x, peaks={"flops": 1})
