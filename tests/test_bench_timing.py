"""The benchmarks' in-graph timer (``benchmarks/_common.time_in_graph``), on the CPU: the
program it times calls the function the promised number of times, on the input sets in
turn, each call fed by the one before, and every result stays live."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import _common
from tests._util import rand


@pytest.mark.parametrize("n_sets", [1, 3, 12])
def test_time_in_graph_chains_every_call(n_sets):
    sets = [(rand((8, 8), jnp.float32), rand((8, 8), jnp.float32)) for _ in range(n_sets)]
    seen, jitted = [], {}

    def fn(x, w):
        seen.append(w)  # at trace time
        return jnp.tanh(x @ w)

    def chain(args, prev):
        return (prev, *args[1:])

    def jit(name, program):
        jitted[name] = jax.jit(program)
        return jitted[name]

    ms = _common.time_in_graph({"f": fn}, sets, chain, jit=jit, repeats=1, min_iters=1)
    calls = max(n_sets, _common.IN_GRAPH_MIN_CALLS)
    assert ms["f"] > 0
    assert len(seen) == calls  # traced once, one call each
    # The program's results: call i on set i mod n, fed by the call before, none dropped.
    sets_arg = tuple(tuple(s) for s in sets)
    results = jitted["f"](sets_arg)
    assert len(results) == calls
    x = sets[0][0]
    for i, got in enumerate(results):
        x = jnp.tanh(x @ sets[i % n_sets][1])
        np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-6)


def test_rotation_exceeds_the_cache():
    assert _common.rotation(_common.L2_ROTATE_BYTES) == 1
    assert _common.rotation(_common.L2_ROTATE_BYTES // 4) == 4
    assert _common.rotation(_common.L2_ROTATE_BYTES // 4 - 1) == 5
    assert _common.rotation(1) == 16  # capped
