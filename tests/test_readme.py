"""The README's tour runs as written."""

import re

import numpy as np

from tests._util import ROOT

README = ROOT / "README.md"


def test_readme_tour_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "ts_matmul" in out and "ts_softmax" in out
    assert "('ts_flash_attention_fwd',)" in out  # the graph tour: attention rewritten
    assert "matmul: A.shape[-1]=128 must equal B.shape[-2]=256" in out
    ts, x = namespace["ts"], namespace["x"]
    np.testing.assert_array_equal(
        np.asarray(namespace["total"]), np.asarray(ts.sum(x.repeat(2, 0), axis=0))
    )
