"""Multi-process runs: ``ts.dist.initialize`` and the ``tessera-launch`` launcher.

The launches run real child processes on the CPU (gloo collectives between them),
each bounded by a timeout; the children are separate Pythons, so their environment
(JAX_PLATFORMS, PYTHONPATH) is set here rather than by conftest.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tessera_jax as ts
from tessera_jax.launch import process as launch
from tests._util import ROOT, assert_close, f64, np_tree, rand

# Bitwise across process layouts: checked on the code XLA optimises (tests/conftest.py).
pytestmark = pytest.mark.xla_optimized


# op, dtype, global shape: dim 0 holds the 4 parts (one per device of the 2×2 run).
CASES = [
    ("sum", jnp.float32, (4, 64)),
    ("sum", jnp.bfloat16, (8, 3, 5)),
    ("max", jnp.float32, (4, 7)),
]

WORKER = """
import sys

import numpy as np

import tessera_jax as ts

ts.dist.initialize()

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
inputs = np.load(sys.argv[1])
mesh = ts.dist.mesh(axes=("d",))
out = {}
for name in inputs.files:
    x = inputs[name]
    if name.endswith("bf16"):
        x = x.astype(jax.numpy.bfloat16)
    xg = jax.make_array_from_callback(x.shape, NamedSharding(mesh.jax_mesh, P("d")), lambda i: x[i])
    y = ts.op.all_reduce(xg, name.split("_")[0], "d", mesh=mesh)
    out[name] = np.asarray(y.addressable_data(0)).astype(np.float32)
np.savez(f"{sys.argv[2]}.{jax.process_index()}.npz", **out)
print("reduced", len(out), "cases on", jax.device_count(), "devices")
"""

# Rank 1 fails (exits 3, or SIGKILLs itself); the others sleep, and rank 0 has started a
# grandchild, which must die with it. Every pid is written to a file for the test.
FAILING = """
import os, signal, subprocess, sys, time

rank = int(os.environ["TESSERA_PROCESS_ID"])
out = sys.argv[1]
how = sys.argv[2]
if rank == 0:
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(f"{out}/grandchild", "w").write(str(grandchild.pid))
open(f"{out}/pid.{rank}", "w").write(str(os.getpid()))
print("started", flush=True)
if rank == 1:
    while len([f for f in os.listdir(out) if f.startswith("pid.")]) < 3:
        time.sleep(0.05)
    if how == "exit":
        print("giving up", file=sys.stderr, flush=True)
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""

# Both ranks reduce in a loop, so once rank 1 is killed rank 0 is blocked in a collective.
BLOCKED = """
import os, sys

import numpy as np

import tessera_jax as ts

ts.dist.initialize()

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

mesh = ts.dist.mesh(axes=("d",))
rows = NamedSharding(mesh.jax_mesh, P("d"))
x = jax.make_array_from_callback((2, 8), rows, lambda i: np.ones((1, 8), np.float32))
ts.op.all_reduce(x, "sum", "d", mesh=mesh).block_until_ready()
open(f"{sys.argv[1]}/pid.{jax.process_index()}", "w").write(str(os.getpid()))
while True:
    x = ts.op.all_reduce(x, "max", "d", mesh=mesh).block_until_ready()
"""

SLEEPER = """
import os, sys, time

open(f"{sys.argv[1]}/pid.{os.environ['TESSERA_PROCESS_ID']}", "w").write(str(os.getpid()))
time.sleep(120)
"""


def _env(*paths: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *map(str, paths)])
    return env


def _launch(args: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tessera_jax.launch", *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie awaiting its reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _all_dead(pids: list[int], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pids(d: Path, names: list[str], within_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while not all((d / n).exists() and (d / n).read_text() for n in names):
        assert time.monotonic() < deadline, f"the children never wrote {names}"
        time.sleep(0.05)
    return [int((d / n).read_text()) for n in names]


def test_two_processes_reduce_like_one(tmp_path):
    """2 processes × 2 CPU devices: the deterministic all_reduce gives the bits of the
    canonical tree, which one process with 4 devices also gives."""
    inputs = {}
    for op, dtype, shape in CASES:
        name = f"{op}_{'bf16' if dtype == jnp.bfloat16 else 'f32'}"
        inputs[name] = np.asarray(rand(shape, dtype).astype(jnp.float32))
    np.savez(tmp_path / "inputs.npz", **inputs)
    (tmp_path / "worker.py").write_text(WORKER)
    args = ["--nproc", "2", "--devices-per-proc", "2", str(tmp_path / "worker.py")]
    proc = _launch([*args, str(tmp_path / "inputs.npz"), str(tmp_path / "out")], _env())
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    for rank in (0, 1):
        assert f"[rank {rank}] reduced 3 cases on 4 devices" in stdout

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    for (op, dtype, shape), (name, x) in zip(CASES, inputs.items()):
        x = x.astype(dtype)
        parts = x.reshape(4, shape[0] // 4, *shape[1:])
        if op == "sum":
            expected = np_tree(parts)
            assert_close(expected, f64(parts).sum(0), dtype)
        else:
            expected = parts.max(0)
        one = ts.op.all_reduce(jax.device_put(x, NamedSharding(mesh, P("d"))), op, "d", mesh=mesh)
        np.testing.assert_array_equal(np.asarray(one), expected)
        for rank in (0, 1):
            got = np.load(tmp_path / f"out.{rank}.npz")[name].astype(dtype)
            np.testing.assert_array_equal(got, expected, err_msg=f"{name} on rank {rank}")


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_failed_rank_stops_the_run(tmp_path, how):
    """One rank fails while the others sleep: the launcher ends every process (and the
    grandchild) within 30 s and names the rank and its status."""
    (tmp_path / "failing.py").write_text(FAILING)
    start = time.monotonic()
    proc = _launch(["--nproc", "3", str(tmp_path / "failing.py"), str(tmp_path), how], _env())
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"the launcher took {elapsed:.1f} s"
    if how == "exit":
        assert proc.returncode == 3
        assert "tessera-launch: rank 1 exited with status 3" in stderr
        assert "[rank 1] giving up" in stderr
    else:
        assert proc.returncode == 128 + signal.SIGKILL
        assert "tessera-launch: rank 1 was killed by SIGKILL (signal 9)" in stderr
    assert stdout.count("] started") == 3 and "[rank 2] started" in stdout
    pids = _pids(tmp_path, ["pid.0", "pid.1", "pid.2", "grandchild"], within_s=0)
    assert _all_dead(pids), [p for p in pids if _alive(p)]


def test_killed_jax_worker_stops_the_run(tmp_path):
    """A JAX worker killed from outside while its peer waits in a collective: the launcher
    ends the run within 30 s, naming the rank."""
    (tmp_path / "blocked.py").write_text(BLOCKED)
    proc = _launch(["--nproc", "2", str(tmp_path / "blocked.py"), str(tmp_path)], _env())
    try:
        pids = _pids(tmp_path, ["pid.0", "pid.1"])
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    elapsed = time.monotonic() - killed
    assert elapsed < 30, f"the launcher took {elapsed:.1f} s"
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    assert "tessera-launch: rank 1 was killed by SIGKILL (signal 9)" in stderr
    assert _all_dead(pids), [p for p in pids if _alive(p)]


def test_sigterm_to_launcher_ends_the_children(tmp_path):
    """SIGTERM to the launcher (a job scheduler's cancel) ends every child; ``-m module``."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    proc = _launch(["--nproc", "2", "-m", "sleeper", str(tmp_path)], _env(tmp_path))
    try:
        pids = _pids(tmp_path, ["pid.0", "pid.1"])
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM; terminated all 2 processes" in stderr
    assert _all_dead(pids), [p for p in pids if _alive(p)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "0", "x.py"], "--nproc='0' must be an int >= 1"),
        (["--nproc", "two", "x.py"], "--nproc='two' must be an int >= 1"),
        (["--nproc=2", "--devices-per-proc", "0", "x.py"], "--devices-per-proc='0' must be"),
        (["--nproc", "2"], "no program given"),
        (["--nproc", "2", "-m"], "-m must be followed by a module name"),
        (["--nproc", "2", "does/not/exist.py"], "script='does/not/exist.py' is not a file"),
    ],
)
def test_bad_launcher_arguments(capsys, args, message):
    if args[-1] == "x.py":
        args = [*args[:-1], __file__]
    assert launch.main(args) == 2
    err = capsys.readouterr().err
    assert f"tessera-launch: error: {message}" in err, err


def test_launcher_requires_nproc(capsys):
    with pytest.raises(SystemExit) as e:
        launch.main([__file__])
    assert e.value.code == 2
    assert "--nproc" in capsys.readouterr().err


def test_console_script():
    """``tessera-launch`` is installed as a console script calling ``launch.main``."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    entry = r'^tessera-launch = "tessera_jax\.launch\.process:main"$'
    assert re.search(entry, scripts, re.M), scripts
    assert callable(launch.main)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_processes": 0}, ValueError, "num_processes=0 must be an int >= 1"),
        ({"num_processes": "2"}, TypeError, "num_processes='2' must be an int >= 1"),
        ({"num_processes": True}, TypeError, "num_processes=True must be an int"),
        ({"process_id": -1}, ValueError, "process_id=-1 must be an int >= 0"),
        (
            {"num_processes": 2, "process_id": 2},
            ValueError,
            "process_id=2 must be in [0, num_processes=2)",
        ),
        ({"coordinator_address": 1234}, TypeError, "coordinator_address=1234 must be"),
        ({"coordinator_address": "localhost"}, ValueError, "must be 'host:port'"),
        ({"coordinator_address": "h:70000"}, ValueError, "with a port in [1, 65535]"),
        ({"local_device_ids": [0, -1]}, ValueError, "local_device_ids entry=-1"),
        ({"local_device_ids": "0,1"}, TypeError, "local_device_ids='0,1' must be"),
        ({"local_device_ids": []}, TypeError, "local_device_ids=[] must be"),
        ({"initialization_timeout": 0}, ValueError, "initialization_timeout=0"),
    ],
)
def test_initialize_argument_errors(kwargs, error, message):
    with pytest.raises(error, match="^ts.dist.initialize: ") as e:
        ts.dist.initialize(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TESSERA_COORDINATOR": "nohost"}, "TESSERA_COORDINATOR='nohost' must be 'host:port'"),
        (
            {"TESSERA_COORDINATOR": "127.0.0.1:1", "TESSERA_NUM_PROCESSES": "two"},
            "TESSERA_NUM_PROCESSES='two' must be an int >= 1",
        ),
        ({"TESSERA_COORDINATOR": "127.0.0.1:1"}, "TESSERA_NUM_PROCESSES or TESSERA_PROCESS_ID"),
        (
            {
                "TESSERA_COORDINATOR": "127.0.0.1:1",
                "TESSERA_NUM_PROCESSES": "2",
                "TESSERA_PROCESS_ID": "0",
                "TESSERA_DEVICES_PER_PROC": "0",
            },
            "TESSERA_DEVICES_PER_PROC='0' must be an int >= 1",
        ),
    ],
)
def test_initialize_environment_errors(monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="^ts.dist.initialize: ") as e:
        ts.dist.initialize()
    assert message in str(e.value)


def test_initialize_with_no_run_to_join():
    """Outside the launcher and any cluster, with no arguments, the error says what to do."""
    env = {k: v for k, v in _env().items() if not k.startswith(("TESSERA_", "SLURM_", "OMPI_"))}
    code = "import tessera_jax as ts; ts.dist.initialize()"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 1
    assert (
        "ValueError: ts.dist.initialize: no run to join: coordinator_address, num_processes, "
        "process_id not given"
    ) in run.stderr, run.stderr


def test_initialize_after_the_backend_started():
    jax.devices()  # the backend of this (pytest) process has started
    with pytest.raises(RuntimeError, match="must run before any JAX computation"):
        ts.dist.initialize("127.0.0.1:1", 1, 0)
