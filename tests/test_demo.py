"""The main job: `python -m tessera_jax demo` trains, prints loss/grad norm, is deterministic."""

import subprocess
import sys

from tessera_jax.__main__ import demo, main


def test_demo_trains_and_is_deterministic(capsys):
    a = demo(steps=8, seed=3)
    b = demo(steps=8, seed=3)
    assert a["final_loss"] < a["first_loss"]
    assert a == b
    out = capsys.readouterr().out
    assert "loss" in out and "grad_norm" in out and a["fingerprint"] in out


def test_cli_entry_point():
    assert main(["demo", "--steps", "2"]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "tessera_jax", "demo", "--steps", "0"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "--steps=0 must be at least 1" in proc.stderr
