"""Every notebook in notebooks/ runs top to bottom (code cells executed in one namespace)."""

import json

import jax
import pytest

from tests._util import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {"__name__": "__notebook__"}
    # As a user runs them: JAX's default promotion rules, not the suite's strict ones.
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        for i, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)


def test_there_is_a_notebook():
    assert NOTEBOOKS
