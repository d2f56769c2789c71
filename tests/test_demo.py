"""The main job: `python -m tessera_jax demo` trains a transformer on a dp×tp mesh; its
fingerprint does not depend on the mesh, the process count, or stopping and resuming."""

import argparse
import functools
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax import _compat, _config
from tessera_jax.__main__ import main
from tessera_jax.train import data, demo, model, step
from tessera_jax.train.checkpoint import fingerprint
from tests._util import ROOT, subjaxprs

# A model small enough for CI: a few steps compile and run in seconds.
TINY = ["--layers", "1", "--width", "64", "--seq", "32", "--batch", "8", "--sample", "0"]


def run(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return demo.run(parser.parse_args([*TINY, *argv]), log=lambda *a, **k: None)


def fingerprint_of(output: str) -> str:
    found = re.findall(r"fingerprint: ([0-9a-f]{16})", output)
    assert found, output[-2000:]
    return found[-1]


@pytest.fixture(scope="module")
def reference():
    """4 steps on all 8 devices (the default mesh, dp=4 × tp=2)."""
    return run("--steps", "4")


# The in-process runs share compiled programs (step.py caches them per mesh): one worker.
# Their fingerprints are compared with subprocesses', which compile with XLA's optimisations.
pytestmark = [pytest.mark.xdist_group("demo"), pytest.mark.xla_optimized]


def test_fingerprint_is_mesh_invariant(reference):
    assert reference["final_loss"] < reference["first_loss"]
    for argv in (
        ["--devices", "1"],
        ["--devices", "2", "--mesh", "dp=2,tp=1"],
        ["--mesh", "dp=2,tp=4"],
    ):
        assert run("--steps", "4", *argv)["fingerprint"] == reference["fingerprint"], argv
    assert run("--steps", "4")["fingerprint"] == reference["fingerprint"]  # and run to run


def test_resume_on_another_mesh_and_corrupt_checkpoints(reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run("--steps", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "1")
    assert sorted(os.listdir(ckpt)) == ["1", "2"]
    # Resumed on 2 devices (dp=1 × tp=2) from the 8-device checkpoint.
    out = run("--steps", "4", "--devices", "2", "--checkpoint-dir", ckpt, "--resume")
    assert out["fingerprint"] == reference["fingerprint"]

    # Damage the newest checkpoint (4): its bytes no longer read back as saved.
    files = [p for p in (pathlib.Path(ckpt) / "4").rglob("*") if p.is_file() and p.stat().st_size]
    for p in files:
        if "meta" not in p.parts:
            p.write_bytes(b"\0" * p.stat().st_size)
    messages = []
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([*TINY, "--steps", "4", "--checkpoint-dir", ckpt, "--resume"])
    out = demo.run(args, log=messages.append)
    assert any("checkpoint" in m and "corrupt" in m for m in messages), messages
    assert any("resumed from step 2" in m for m in messages), messages
    assert out["fingerprint"] == reference["fingerprint"]
    assert (pathlib.Path(ckpt) / "corrupt" / "4").is_dir()  # kept, moved aside

    with pytest.raises(ValueError, match="was written with"):
        run("--steps", "5", "--checkpoint-dir", ckpt, "--resume", "--seed", "1")
    with pytest.raises(ValueError, match="--resume needs --checkpoint-dir"):
        run("--steps", "2", "--resume")


def _demo_cmd(*argv):
    return [sys.executable, "-m", "tessera_jax", "demo", *TINY, *argv]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    return env


def test_killed_run_resumes_to_the_same_fingerprint(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        _demo_cmd("--steps", "400", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    try:
        while not (ckpt / "2").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The run died somewhere after step 2, maybe while saving: resume from what is there.
    steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert steps and steps[-1] >= 2
    out = run("--steps", "4", "--checkpoint-dir", str(ckpt), "--resume")
    assert out["fingerprint"] == reference["fingerprint"]


def test_two_processes_match_one(reference):
    """tessera-launch --nproc 2 --devices-per-proc 4: the 8-device fingerprint."""
    cmd = [sys.executable, "-m", "tessera_jax.launch", "--nproc", "2", "--devices-per-proc", "4"]
    proc = subprocess.run(
        [*cmd, "-m", "tessera_jax", "demo", *TINY, "--steps", "4", "--sample", "8"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "8 cpu device(s) in 2 process(es), mesh dp=4 × tp=2" in proc.stdout
    assert "sample: 'The " in proc.stdout and "final loss" in proc.stdout
    assert fingerprint_of(proc.stdout) == reference["fingerprint"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps=0 must be >= 1"),
        (["--batch", "12"], "--batch=12 must be a multiple of the 8 gradient groups"),
        (["--groups", "2"], "the mesh's dp=4 must divide the 2 gradient groups"),
        (["--groups", "3"], "--groups=3 must be a power of two"),
        (["--mesh", "dp=2,tp=3"], "does not cover the 8 devices"),
        (["--mesh", "dp=1,tp=8"], "tp=8 must divide the model's 4 tensor-parallel chunks"),
        (["--mesh", "pp=8"], "must look like dp=4,tp=2"),
        (["--devices", "9"], "--devices=9 must be in [1, 8]"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", *TINY, *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_data_is_a_function_of_the_step():
    tokens = data.encode(data.corpus())
    a = data.batch(tokens, 7, batch_size=8, seq_len=32, seed=0)
    assert (
        a.shape == (8, 33) and (a == data.batch(tokens, 7, batch_size=8, seq_len=32, seed=0)).all()
    )
    assert not (a == data.batch(tokens, 8, batch_size=8, seq_len=32, seed=0)).all()
    assert data.decode(data.encode("tile → mesh")) == "tile → mesh"


def test_model_config_errors():
    with pytest.raises(ValueError, match="n_heads=6 must be a multiple of chunks=4"):
        model.ModelConfig(d_model=96, n_heads=6)
    with pytest.raises(ValueError, match="chunks=3 must be a power of two"):
        model.ModelConfig(chunks=3)


def test_tree_sum_is_the_canonical_order():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 5)), jnp.float32)
    want = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))
    assert (np.asarray(model.tree_sum(x, None)) == np.asarray(want)).all()


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_streamed_group_sums_are_the_canonical_tree(n):
    rng = np.random.default_rng(n)
    w = jnp.asarray(rng.standard_normal((n, 3, 5)), jnp.float32)
    vg = lambda p, wi: (jnp.sum(wi * p), {"a": wi * p, "b": jnp.sin(wi) + p})
    loss, grads = step._group_sums(vg, jnp.float32(1.5), w)
    items = [vg(jnp.float32(1.5), w[i]) for i in range(n)]
    want_loss, want = jax.tree.map(lambda *xs: jnp.stack(xs), *items)
    assert np.asarray(loss) == np.asarray(model.tree_sum(want_loss, None))
    for k in want:
        np.testing.assert_array_equal(grads[k], model.tree_sum(want[k], None))


def test_unrolled_step_is_mesh_invariant():
    """The straight-line step (the GPU default) gives one set of bits on any mesh, in
    bf16 too: XLA may not keep a bf16 intermediate in f32 in one program's fusion and round
    it in another's (``xla_allow_excess_precision``); and with its gradients summed over
    4 parts by another all-reduce algorithm (``grad_algo``)."""
    cfg = model.ModelConfig(
        d_model=64, n_layers=2, n_heads=4, d_ff=128, seq_len=8, chunks=2, compute_dtype="bfloat16"
    )
    optim = step.OptimConfig()
    tokens = data.encode(data.corpus())
    window = data.batch(tokens, 0, batch_size=8, seq_len=cfg.seq_len, seed=0)
    # One initial state (on the host: the step donates its input) laid out on each mesh;
    # test_fingerprint_is_mesh_invariant initialises on every mesh.
    init = step.init_state(cfg, optim, step.make_mesh(jax.devices()[:1], 1, 1), 0)
    specs = step.state_specs(optim.optimizer(), init)
    init = jax.device_get(init)
    fps = set()
    for dp, tp, grad_algo in ((1, 1, None), (2, 2, None), (4, 2, "ring")):
        mesh = step.make_mesh(jax.devices()[: dp * tp], dp, tp)
        f = step.make_train_step(cfg, optim, mesh, 4, unroll=True, grad_algo=grad_algo)
        state = jax.device_put(init, step.shardings(mesh, specs))
        state, _ = f(state, step.place_windows(mesh, window, 4))
        fps.add(fingerprint(state["params"]))
    assert len(fps) == 1


@pytest.mark.parametrize("unroll", [True, False])
def test_grad_algo_sums_the_gradients(unroll):
    """``grad_algo`` names the all-reduce of the loss and gradients over ``dp`` (the
    model's own sums over ``tp`` keep their rule); a name ``ts.all_reduce`` does not
    know is an error."""
    cfg = model.ModelConfig(d_model=64, n_layers=1, n_heads=4, d_ff=128, seq_len=8, chunks=2)
    optim = step.OptimConfig()
    window = data.batch(data.encode(data.corpus()), 0, batch_size=8, seq_len=8, seed=0)
    mesh = step.make_mesh(jax.devices(), 4, 2)
    state, windows = step.init_state(cfg, optim, mesh, 0), step.place_windows(mesh, window, 4)

    def algos(grad_algo):
        f = step.make_train_step(cfg, optim, mesh, 4, unroll, False, grad_algo)
        return set(re.findall(r"algo='?(\w+)", str(jax.make_jaxpr(f)(state, windows))))

    assert algos(None) == {"auto", "binary_tree"}  # small messages over 4 parts: the tree
    assert algos("ring") == {"auto", "ring"}
    with pytest.raises(ValueError, match="grad_algo='psum' must be None or one of"):
        step.make_train_step(cfg, optim, mesh, 4, grad_algo="psum")


def _operator_problems(jaxpr, names, out):
    """Every ts operator bind in ``jaxpr`` (nested jaxprs included) as what its kernels'
    ``supports``/``prefer`` see: the primitive, its operands' shapes and dtypes, its params."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            avals = tuple((v.aval.shape, str(v.aval.dtype)) for v in eqn.invars)
            out.add((eqn.primitive.name, avals, repr(sorted(eqn.params.items()))))
        for sub in subjaxprs(eqn.params):
            _operator_problems(sub, names, out)
    return out


@pytest.mark.parametrize("unroll", [True, False])
def test_every_operator_sees_the_same_problems_on_every_mesh(unroll):
    """Kernel dispatch (``prefer``, tiles) and a kernel's bits depend on the per-device
    shapes an operator sees, and a kernel and XLA round differently. The step's groups
    have one shape on every mesh, so on a GPU too every operator takes the same path
    whatever dp and tp are; this holds it (the CPU runs every operator's reference, so the
    fingerprint tests cannot)."""
    cfg = model.ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, seq_len=8, chunks=2)
    optim = step.OptimConfig()
    window = data.batch(data.encode(data.corpus()), 0, batch_size=8, seq_len=8, seed=0)
    names = {op.prim.name for op in ts.op.OPERATORS.values()}
    problems = []
    for dp, tp in ((1, 1), (2, 2), (4, 2)):
        mesh = step.make_mesh(jax.devices()[: dp * tp], dp, tp)
        f = step.make_train_step(cfg, optim, mesh, 4, unroll=unroll, deterministic=False)
        # The state's types only (make_jaxpr traces): no init program to compile.
        state = jax.eval_shape(functools.partial(step.init_state, cfg, optim, mesh, 0))
        jaxpr = jax.make_jaxpr(f)(state, step.place_windows(mesh, window, 4)).jaxpr
        problems.append(_operator_problems(jaxpr, names, set()))
    assert problems[0] and {"ts_matmul", "ts_flash_attention_fwd"} <= {p[0] for p in problems[0]}
    assert problems[1] == problems[0]
    assert problems[2] == problems[0]


def _loss_and_grads(cfg: model.ModelConfig, tp: int, window: np.ndarray):
    """The loss and gradients of one group on a ``1 × tp`` mesh, as the step computes them."""
    params = model.init(cfg, jax.random.key(0))
    specs = model.param_specs(params)
    vg = jax.value_and_grad(functools.partial(model.loss, cfg, tp_axis=model.TP))
    f = _compat.shard_map(
        vg,
        mesh=step.make_mesh(jax.devices()[:tp], 1, tp),
        in_specs=(specs, P()),
        out_specs=(P(), specs),
        check_vma=False,
    )
    return jax.device_get(jax.jit(f)(params, window))


# Small models whose gradients once depended on tp on the CPU, through the way XLA
# compiles a fused loop by what else it holds (model.py's docstring; the attention's own
# part is test_attention.py's test_bits_do_not_depend_on_the_loop_around_the_call).
TP_HOLES = {
    # a one-part all-reduce's select joined the norm backward's loop, which then
    # vectorised its row sums differently
    "single-leaf select": (dict(d_model=32, n_heads=2, d_ff=64), (1, 2)),
    # over 4 parts a small all-reduce gathered and added locally, inside the norm's loop
    "gathered sum": (dict(d_model=32, n_heads=8, d_ff=64, chunks=4), (2, 4)),
}


@pytest.mark.parametrize("hole", TP_HOLES)
def test_small_model_gradients_do_not_depend_on_tp(hole):
    sizes, tps = TP_HOLES[hole]
    cfg = model.ModelConfig(**{"n_layers": 1, "seq_len": 8, "chunks": 2, **sizes})
    window = data.batch(data.encode(data.corpus()), 0, batch_size=4, seq_len=8, seed=0)
    (loss_a, grads_a), (loss_b, grads_b) = (_loss_and_grads(cfg, tp, window) for tp in tps)
    assert loss_a == loss_b
    for path, a in jax.tree_util.tree_leaves_with_path(grads_a):
        b = functools.reduce(lambda t, k: t[k.key], path, grads_b)
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_deterministic_compile_options_exist_in_this_jaxlib():
    """The training step compiles with them; a renamed XLA option would fail here first."""
    f = jax.jit(lambda x: x * 2, compiler_options=_config.deterministic_compile_options())
    assert float(f(jnp.float32(1.5))) == 3.0


def test_unoptimized_cpu_programs_ask_for_the_older_emitters():
    """The CPU suite's compile setting (tests/conftest.py): where this jaxlib has XLA's
    older CPU fusion emitters, a program compiled without optimisations asks for them and
    an optimised one does not; jaxlib 0.11 has none."""
    from jax._src import compiler

    if not _compat.compile_unoptimized_cpu_programs_quickly():
        assert _compat.JAX_VERSION >= (0, 11)
        pytest.skip("this jaxlib has only the fusion emitters")
    before = compiler._DISABLE_MOST_OPTIMIZATIONS.value
    try:
        got = {}
        for disabled in (True, False):
            jax.config.update("jax_disable_most_optimizations", disabled)
            got[disabled] = dict(compiler.get_compile_options(1, 1).env_option_overrides)
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
    assert got[True].get(_compat._OLD_CPU_EMITTERS) is False
    assert _compat._OLD_CPU_EMITTERS not in got[False]


def test_deterministic_options_round_low_precision_as_written():
    """A bf16 product is rounded before the f32 add that follows it, as the program says,
    not kept in f32 by the fusion (which XLA allows by default, and does here)."""
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.standard_normal(4096), jnp.bfloat16) for _ in range(2))
    z = jnp.asarray(rng.standard_normal(4096), jnp.float32)
    f = lambda x, y, z: (x * y).astype(jnp.float32) + z
    prod = np.asarray(x, np.float32) * np.asarray(y, np.float32)
    want = prod.astype(jnp.bfloat16).astype(np.float32) + np.asarray(z)
    got = jax.jit(f, compiler_options=_config.deterministic_compile_options())(x, y, z)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ts.jit(f, deterministic=True)(x, y, z), want)


def test_step_without_compile_options_nests_in_a_jit():
    """``deterministic=False`` lets a tool such as ``ts.profile`` jit the step again."""
    cfg = model.ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=8, chunks=1)
    optim, mesh = step.OptimConfig(), step.make_mesh(jax.devices()[:1], 1, 1)
    state = step.init_state(cfg, optim, mesh, 0)
    windows = step.place_windows(mesh, np.zeros((2, 9), np.int32), 2)
    with pytest.raises(ValueError, match="compiler_options"):
        jax.jit(step.make_train_step(cfg, optim, mesh, 2)).trace(state, windows)
    f = step.make_train_step(cfg, optim, mesh, 2, deterministic=False)
    jax.jit(f).trace(state, windows)
