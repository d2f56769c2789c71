"""The distribution examples of the seeds, scaled to 8 CPU devices, written as in the seeds.

Elsewhere: seed 000 §4 (deterministic all-reduce) in test_collectives.py
(test_all_reduce_seed000_global_view_and_run_to_run), seed 002 §4.4 tp_gemm in
test_mesh.py (test_index_launch_tp_gemm), seed 002 §4.5–4.6 in test_regions.py
(test_seed002_norm_layer_and_step), seed 003 "Effect-Aware Autodiff" in
test_collectives.py (test_seed003_distributed_loss). Departures are marked SEED:.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax import dist, op
from tests._util import by_row_blocks, rand

# Bitwise across meshes and runs: checked on the code XLA optimises (tests/conftest.py).
pytestmark = pytest.mark.xla_optimized


def test_seed001_gradient_aggregation():
    """Seed 001 §4.4: grads = op.all_reduce(local_grads, op="sum", axis="dp")."""
    mesh = dist.Mesh(axes=["dp"], devices=range(8))
    x, w = rand((32, 6)), rand((6,))
    X = dist.tensor(x.shape, ts.ShardSpec(("batch",), ("dp",)), mesh, "f32", x)

    @ts.index_launch(axis="dp")
    def data_parallel_step(x_local, w):
        local_grads = jax.grad(lambda w: ts.sum((x_local @ w) ** 2))(w)
        grads = op.all_reduce(local_grads, op="sum", axis="dp")
        return grads

    grads = data_parallel_step(X.parts("dp"), w)
    assert grads.shape == (6,) and grads.sharding.spec == P()
    # The canonical tree of the 8 local gradients (returned per part, stacked).
    local = ts.index_launch(axis="dp")(
        lambda x_local, w: jax.grad(lambda w: ts.sum((x_local @ w) ** 2))(w)[None]
    )(X.parts("dp"), w)
    assert local.shape == (8, 6)
    assert np.asarray(grads).tobytes() == np.asarray(op.sum(local, axis=0)).tobytes()
    full = jax.grad(lambda w: ts.sum((x @ w) ** 2))(w)
    np.testing.assert_allclose(grads, full, rtol=1e-5)


def test_seed003_mesh_construction():
    # SEED: "cuda:i" devices → "cpu:i"; the 16-device hybrid mesh (4, 2, 2) → (2, 2, 2).
    dp_mesh = ts.dist.mesh(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], axes=("dp",), shape=(4,))
    tp_mesh = ts.dist.mesh(devices=["cpu:0", "cpu:1"], axes=("tp",), shape=(2,))
    hybrid_mesh = ts.dist.mesh(
        devices=[f"cpu:{i}" for i in range(8)], axes=("dp", "tp", "pp"), shape=(2, 2, 2)
    )
    assert dp_mesh.shape == (4,) and tp_mesh.shape == (2,) and hybrid_mesh.shape == (2, 2, 2)
    assert hybrid_mesh.jax_mesh.axis_names == ("dp", "tp", "pp")


def test_seed003_tensor_sharding():
    # SEED: 8192-wide weights → 64; batch_size = 16.
    dp_mesh = ts.dist.mesh(devices=[f"cpu:{i}" for i in range(4)], axes=("dp",), shape=(4,))
    tp_mesh = ts.dist.mesh(devices=["cpu:0", "cpu:1"], axes=("tp",), shape=(2,))
    batch_size = 16
    W_col = ts.dist.tensor(
        shape=(64, 64),
        layout=ts.ShardSpec(partition=("col",), mesh_axes=("tp",)),
        mesh=tp_mesh,
        dtype="bf16",
    )
    X_row = ts.dist.tensor(
        shape=(batch_size, 64),
        layout=ts.ShardSpec(partition=("row",), mesh_axes=("dp",)),
        mesh=dp_mesh,
        dtype="bf16",
    )
    # SEED: the seed's 2D example is cut off after `mesh_`; completed as in seed 004.
    mesh_2d = ts.dist.Mesh(axes=["tp", "pp"], devices=range(8), shape=(4, 2))
    W_2d = ts.dist.tensor(
        shape=(64, 64),
        layout=ts.ShardSpec(partition=("row", "col"), mesh_axes=("tp", "pp")),
        mesh=mesh_2d,
        dtype="bf16",
    )
    assert W_col.dtype == jnp.bfloat16 and W_col.sharding.spec == P(None, "tp")
    assert {s.data.shape for s in W_col.addressable_shards} == {(64, 32)}
    assert X_row.sharding.spec == P("dp")
    assert {s.data.shape for s in X_row.addressable_shards} == {(4, 64)}
    assert {s.data.shape for s in W_2d.addressable_shards} == {(16, 32)}


def test_seed004_mesh_and_shardspec():
    """Seed 004 §2.4–2.5: a 3D mesh (72 GPUs → 8 CPU devices) and a 2D-sharded weight."""
    with pytest.raises(ValueError, match="pass shape"):
        # SEED: as written (no shape) the 3-axis mesh is ambiguous: a clear error.
        dist.Mesh(axes=["tp", "pp", "dp"], devices=range(8))
    mesh = dist.Mesh(axes=["tp", "pp", "dp"], devices=range(8), shape=(2, 2, 2))
    # SEED: 1_000_000² → 64²; the layout is spelled dist.ShardSpec as in the seed.
    W = dist.tensor(
        shape=(64, 64),
        layout=dist.ShardSpec(partition=("row", "col"), mesh_axes=("tp", "pp")),
        mesh=mesh,
        dtype="bf16",
    )
    assert W.sharding.spec == P("tp", "pp")
    # replicated over dp: each (32, 32) block lives on the 2 dp devices
    assert len(W.addressable_shards) == 8
    assert {s.data.shape for s in W.addressable_shards} == {(32, 32)}


def test_seed002_nvl72_train_step_scaled():
    """Seed 002 §4.7: a dp × tp × pp mesh (4 × 9 × 2 → 2 × 2 × 2) and a jitted train step
    on sharded data; the loss is a deterministic sum, the same on 1 and 8 devices."""
    mesh = dist.Mesh(axes=["dp", "tp", "pp"], devices=range(8), shape=(2, 2, 2))
    x, w, y = rand((16, 8)), rand((8, 8)), rand((16, 8))
    batch = (
        dist.tensor(x.shape, ts.ShardSpec(("batch",), (("dp", "pp"),)), mesh, "f32", x),
        dist.tensor(y.shape, ts.ShardSpec(("batch",), (("dp", "pp"),)), mesh, "f32", y),
    )
    W = dist.tensor(w.shape, ts.ShardSpec(("col",), ("tp",)), mesh, "f32", w)

    def model(W, batch):
        return ts.relu(ts.matmul(batch[0], W))

    def loss_fn(out, batch):
        return ts.sum((out - batch[1]) ** 2)

    # Seed 002's @jit(capture_graph=True): on GPUs the step compiles with XLA's command
    # buffers (CUDA graphs) on; the result is the same program's.
    @ts.jit(capture_graph=True)
    def train_step(W, batch):
        out = model(W, batch)
        loss = loss_fn(out, batch)
        return loss

    loss = train_step(W, batch)
    # On one device: each device's block of the product (4 batch rows × 4 columns), then
    # the loss.
    per_device = lambda xi: jnp.concatenate([model(w[:, j : j + 4], (xi,)) for j in (0, 4)], 1)
    single = jax.jit(loss_fn)(by_row_blocks(per_device, 4, x), (x, y))
    assert np.asarray(loss).tobytes() == np.asarray(single).tobytes()
