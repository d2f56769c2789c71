"""``ts.autotune``: the search (fake clocks make the fastest config known), pruning before
compiling, skipped failures, the JSON cache (reuse without timing, keys, corrupt and
foreign entries, ``TESSERA_CACHE_DIR``), and ``ts.op.matmul``'s tunable: its tile mapping,
its pruning and the kernel picking the cached config when it is lowered."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tessera_jax import autotune
from tessera_jax.contracts.matmul import MatmulSpec
from tessera_jax.pallas_kernels import matmul_configs as mc
from tessera_jax.pallas_kernels import matmul_mgpu as mg
from tessera_jax.primitives import matmul as matmul_module
from tests._util import rand


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Every test gets its own empty cache directory."""
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class FakeKernel:
    """A Tunable whose runtime is ``cost[config]`` seconds on a fake clock it advances,
    recording every config it runs (and optionally failing or refusing some)."""

    def __init__(self, cost, *, fail=(), too_big=(), name="fake"):
        self.cost, self.fail, self.too_big, self.name = cost, set(fail), set(too_big), name
        self.clock = 0.0
        self.ran: list = []
        self.checked: list = []

    def timer(self) -> float:
        return self.clock

    def __tessera_tunable__(self):
        def check(args, config):
            self.checked.append(config["BM"])
            return (
                f"BM={config['BM']} needs too much memory" if config["BM"] in self.too_big else None
            )

        def run(args, config):
            self.ran.append(config["BM"])
            if config["BM"] in self.fail:
                raise RuntimeError(f"BM={config['BM']}: cannot compile\nmore detail")
            self.clock += self.cost[config["BM"]]
            return args[0] * 2

        return autotune.Tunable(
            name=self.name,
            key=lambda args: tuple((x.shape, x.dtype) for x in args),
            check=check,
            run=run,
        )


def _search(k, args, **kw):
    params = kw.pop("params", {"BM": sorted(k.cost)})
    return autotune.search(kernel=k, args=args, params=params, progress=False, timer=k.timer, **kw)


COSTS = {64: 3e-3, 128: 1e-3, 256: 2e-3}


@pytest.mark.parametrize("costs", [COSTS, {64: 1e-4, 128: 5e-4, 256: 9e-4}])
def test_search_picks_the_fastest_config(costs):
    k = FakeKernel(costs)
    best = _search(k, (rand((8,)),))
    assert best == {"BM": min(costs, key=costs.get)}
    assert isinstance(best, dict) and not best.report.cached
    times = dict((c["BM"], s) for c, s in best.report.timings)
    np.testing.assert_allclose([times[b] for b in costs], list(costs.values()), rtol=1e-9)


def test_plain_callable_gets_its_params_as_keywords():
    calls = []

    def scale(x, *, factor, offset):
        calls.append((factor, offset))
        return x * factor + offset

    x = rand((16,))
    best = autotune.search(
        kernel=scale,
        args=(x,),
        params={"factor": [1.0, 2.0], "offset": [0, 1]},
        progress=False,
        warmup=1,
        repeats=1,
        min_time=0,
    )
    assert set(best) == {"factor", "offset"}
    assert {c for c in calls} == {(1.0, 0), (1.0, 1), (2.0, 0), (2.0, 1)}
    assert best.report.kernel.endswith("scale")


def test_pruned_configs_never_run():
    k = FakeKernel(COSTS, too_big={128})
    best = _search(k, (rand((8,)),))
    assert best == {"BM": 256}
    assert 128 not in k.ran and sorted(k.checked) == [64, 128, 256]
    assert best.report.pruned == (({"BM": 128}, "BM=128 needs too much memory"),)


def test_failing_config_is_skipped_with_a_note():
    k = FakeKernel(COSTS, fail={128})
    with pytest.warns(RuntimeWarning, match=r"config \{'BM': 128\} failed.*cannot compile"):
        best = _search(k, (rand((8,)),))
    assert best == {"BM": 256}
    assert best.report.failed == (({"BM": 128}, "RuntimeError: BM=128: cannot compile"),)


def test_no_config_runs_is_an_error_naming_each_reason():
    k = FakeKernel(COSTS, fail={64, 256}, too_big={128})
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="pruned.*failed"):
        _search(k, (rand((8,)),))


def test_second_search_reuses_the_cache_without_timing(_cache):
    k = FakeKernel(COSTS)
    x = rand((8,))
    first = _search(k, (x,))
    ran, clock = len(k.ran), k.clock
    again = _search(k, (x,))
    assert again == first and again.report.cached
    assert len(k.ran) == ran and k.clock == clock  # nothing ran, nothing was timed
    entry = json.loads(first.report.path.read_text())
    assert first.report.path.parent == _cache / "autotune"
    assert entry["config"] == {"BM": 128} and entry["kernel"] == "fake"
    assert entry["device_kind"] == jax.devices()[0].device_kind
    assert entry["jax_version"] == jax.__version__
    assert not [p for p in first.report.path.parent.iterdir() if p.suffix != ".json"]


@pytest.mark.parametrize("other", [((16,), jnp.float32), ((8,), jnp.bfloat16)])
def test_cache_is_keyed_by_shapes_and_dtypes(other):
    k = FakeKernel(COSTS)
    _search(k, (rand((8,)),))
    ran = len(k.ran)
    shape, dtype = other
    best = _search(k, (rand(shape, dtype),))
    assert not best.report.cached and len(k.ran) > ran


def test_a_changed_space_is_tuned_again():
    k = FakeKernel(COSTS)
    x = rand((8,))
    _search(k, (x,), params={"BM": [64, 256]})
    best = _search(k, (x,), params={"BM": [64, 128, 256]})
    assert best == {"BM": 128} and not best.report.cached


def test_cache_off_times_every_search():
    k = FakeKernel(COSTS)
    x = rand((8,))
    _search(k, (x,), cache=False)
    best = _search(k, (x,), cache=False)
    assert not best.report.cached and not best.report.path.exists()


def _tampered(entry):
    return [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({**entry, "schema": "someone.else"}),
        json.dumps({**entry, "version": 99}),
        json.dumps({**entry, "kernel": "other"}),  # a foreign entry at this path
        json.dumps({**entry, "key": [[[9], "float32"]]}),
        json.dumps({**entry, "config": {"BM": "128"}}),  # a type the space does not hold
        json.dumps({**entry, "config": {"BM": 512}}),
        json.dumps({**entry, "runtime_s": "fast"}),
    ]


@pytest.mark.parametrize("case", range(9))
def test_corrupt_or_foreign_entry_warns_and_is_retuned(case):
    k = FakeKernel(COSTS)
    x = rand((8,))
    first = _search(k, (x,))
    path = first.report.path
    path.write_text(_tampered(json.loads(path.read_text()))[case])
    ran = len(k.ran)
    with pytest.warns(autotune.CacheWarning, match="ignoring the cache entry"):
        best = _search(k, (x,))
    assert best == {"BM": 128} and not best.report.cached and len(k.ran) > ran
    assert json.loads(path.read_text())["config"] == {"BM": 128}  # rewritten, valid
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _search(k, (x,)).report.cached


def test_cache_dir_defaults_to_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TESSERA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert autotune.cache_dir() == tmp_path / "xdg" / "tessera_jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert autotune.cache_dir() == tmp_path / "home" / ".cache" / "tessera_jax"


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"objective": "memory"}, ValueError, r"objective='memory' is not supported"),
        ({"params": {}}, ValueError, "non-empty dict"),
        ({"params": {"BM": []}}, ValueError, r"params\['BM'\]=\[\] must be a non-empty list"),
        ({"params": {"BM": [64, 64]}}, ValueError, "repeats a value"),
        ({"params": {"BM": [(64, 1)]}}, TypeError, "stored as JSON"),
        ({"params": {"B M": [64]}}, ValueError, "must be an identifier"),
        ({"repeats": 0}, ValueError, "repeats=0 must be a positive int"),
        ({"args": [1, 2], "kernel": 3}, TypeError, "must be a callable"),
    ],
)
def test_bad_arguments(kw, err, match):
    call = {"kernel": FakeKernel(COSTS), "args": (rand((8,)),), "params": {"BM": [64]}}
    call.update(kw)
    with pytest.raises(err, match=match):
        autotune.search(**call, progress=False)


# --- ts.op.matmul -------------------------------------------------------------------------

BF16 = jnp.bfloat16


def _operands(m=128, n=128, k=128, dtype=BF16):
    return rand((m, k), dtype), rand((k, n), dtype)


def test_matmul_tunable_maps_params_to_the_tile_and_prunes():
    a, b = _operands()
    t = autotune.as_tunable(ts.op.matmul)
    assert t.name == mc.TUNING_NAME
    spec = MatmulSpec(out_dtype=BF16, accumulate_dtype=jnp.float32)
    assert t.key((a, b)) == mc.tuning_key(spec, (a, b))
    cfg = mc.config_from_tuned({"BM": 64, "BN": 128, "BK": 64, "stages": 3}, BF16, BF16)
    assert (cfg.tile_shape, cfg.num_stages) == ((64, 128, 64), 3)
    with ts.kernel_mode("interpret"):
        assert t.check((a, b), {"BM": 64, "BN": 128, "BK": 64}) is None
        assert "multiple of the wgmma M" in t.check((a, b), {"BM": 96, "BN": 128, "BK": 64})
        why = t.check((a, b), {"BM": 128, "BN": 256, "BK": 64, "stages": 8})
        assert "shared memory" in why
    with pytest.raises(ValueError, match="'BQ' is not one of"):
        t.check((a, b), {"BM": 64, "BN": 128, "BK": 64, "BQ": 1})


def test_matmul_tunable_prunes_where_the_kernel_cannot_run():
    a, b = _operands()
    t = autotune.as_tunable(ts.op.matmul)
    with ts.kernel_mode("xla"):  # tuning runs it under `pallas`: no Mosaic GPU on a CPU
        why = t.check((a, b), {"BM": 64, "BN": 128, "BK": 64})
    assert "Mosaic GPU kernel does not run it" in why and "cpu" in why


class _Built(Exception):
    pass


def _lowered_config(monkeypatch, a, b, **kw):
    """The config the Hopper kernel is built with when ``ts.matmul(a, b)`` is lowered in
    interpret mode (the build is stopped there: nothing runs)."""
    seen = []

    def build(p):
        seen.append(p.config)
        raise _Built

    monkeypatch.setattr(mg, "_build", build)
    with ts.kernel_mode("interpret"), pytest.raises(_Built):
        jax.jit(lambda x, y: ts.matmul(x, y, **kw)).lower(a, b)
    return seen[0]


def test_matmul_kernel_picks_the_cached_config(monkeypatch):
    a, b = _operands()
    spec = MatmulSpec(out_dtype=BF16, accumulate_dtype=jnp.float32)
    heuristic = _lowered_config(monkeypatch, a, b)
    assert heuristic.tile_shape == (128, 256, 64)
    assert mg.tuned_config(spec, (a, b)) is None
    # The tunable's own key and check, a fake run (timing the interpreter is slow).
    cost = {64: 2e-3, 128: 1e-3}
    clock = [0.0]

    def fake_run(self, args, config):
        clock[0] += cost[config["BM"]]
        return args[0]

    monkeypatch.setattr(matmul_module._MatmulTunable, "run", fake_run)
    with ts.kernel_mode("interpret"):
        best = autotune.search(
            kernel=ts.op.matmul,
            args=(a, b),
            params={"BM": [64, 128], "BN": [128], "BK": [64], "stages": [3]},
            progress=False,
            timer=lambda: clock[0],
        )
    assert best == {"BM": 128, "BN": 128, "BK": 64, "stages": 3}
    tuned = mg.tuned_config(spec, (a, b))
    assert (tuned.tile_shape, tuned.num_stages) == ((128, 128, 64), 3)
    cfg = _lowered_config(monkeypatch, a, b)
    assert (cfg.tile_shape, cfg.num_stages) == ((128, 128, 64), 3)
    # An explicit tile_shape wins over the cache; other shapes keep the heuristic.
    assert _lowered_config(monkeypatch, a, b, tile_shape=(64, 128, 64)).tile_shape == (64, 128, 64)
    a2, b2 = _operands(n=256)
    assert _lowered_config(monkeypatch, a2, b2).tile_shape == (128, 256, 64)


def test_trial_config_is_what_lookup_answers():
    a, b = _operands()
    spec = MatmulSpec(out_dtype=BF16, accumulate_dtype=jnp.float32)
    key = mc.tuning_key(spec, (a, b))
    with autotune.trial(mc.TUNING_NAME, key, {"BM": 64, "BN": 128, "BK": 64}):
        assert mg.tuned_config(spec, (a, b)).tile_shape == (64, 128, 64)
        assert autotune.lookup(mc.TUNING_NAME, (*key[:-1], ("float32",))) is None
    assert autotune.lookup(mc.TUNING_NAME, key) is None


def test_unwritable_cache_warns_and_still_returns_the_winner(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(blocker / "cache"))  # under a file: no mkdir
    k = FakeKernel(COSTS)
    with pytest.warns(autotune.CacheWarning, match="could not write"):
        assert _search(k, (rand((8,)),)) == {"BM": 128}


def test_progress_without_tqdm_prints_one_line_per_config(monkeypatch, capsys):
    monkeypatch.setattr(autotune, "tqdm", None)
    k = FakeKernel(COSTS)
    autotune.search(
        kernel=k, args=(rand((8,)),), params={"BM": [64, 128]}, timer=k.timer, cache=False
    )
    err = capsys.readouterr().err.splitlines()
    assert err == ["autotune fake: 1/2 BM=64", "autotune fake: 2/2 BM=128"]
