"""Library versions as backends: the name grammar, config errors, labels and compare on synthetic
tables, and one small pinned environment (numpy@2.2.6) built in the harness's cache, plus a pin that
cannot be installed."""

import json
import os

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import backends
from harness.cli import app
from harness.results.compare import compare_runs
from harness.results.labels import backend_label, backend_name
from harness.results.store import RunStore, load_run
from harness.run import envs
from harness.config import load_config
from harness.spec import environments
from harness.spec.errors import HarnessError

PINNED = "numpy@2.2.6"  # small (one wheel), and not the main environment's numpy
MISSING = "numpy@0.0.1"  # no such release: pip refuses it after one look at the index


# -- the grammar ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, canonical, env", [
    ("numpy", "numpy", None),
    ("numpy:wildml", "numpy:wildml", None),
    ("numpy@1.26.4", "numpy@1.26.4", "numpy@1.26.4"),
    ("numpy:wildml@1.26.4", "numpy:wildml@1.26.4", "numpy@1.26.4"),  # a variant shares its backend's environment
    ("jax:unroll=4@0.4.38+jaxlib@0.4.38", "jax:unroll=4@0.4.38+jaxlib@0.4.38", "jax@0.4.38+jaxlib@0.4.38"),
    ("jax@0.4.38+NumPy@1.26.4+jaxlib@0.4.38", "jax@0.4.38+jaxlib@0.4.38+numpy@1.26.4",
     "jax@0.4.38+jaxlib@0.4.38+numpy@1.26.4"),  # companions sorted and normalised
    ("torch:fused@2.5.1+cpu", "torch:fused@2.5.1+cpu", "torch@2.5.1+cpu"),  # a local label stays in the version
    ("theano", "theano", "theano"),
])
def test_names_their_canonical_spelling_and_environment(name, canonical, env):
    assert backends.validate_name(name) == canonical
    assert backends.environment_of(canonical) == env
    assert backends.BackendRef.parse(name).name == name.split(":")[0].split("@")[0]


def test_a_pinned_instance_knows_its_pins_and_its_ref_parts_them():
    inst = backends.create("jax:unroll=4@0.4.38+jaxlib@0.4.38")
    assert inst.variant == "unroll=4" and inst.pins == {"jax": "0.4.38", "jaxlib": "0.4.38"}
    assert inst.full_name == "jax:unroll=4@0.4.38+jaxlib@0.4.38"  # what checks and messages call it
    assert inst.environment_name == "jax@0.4.38+jaxlib@0.4.38"
    r = backends.BackendRef.parse("jax:unroll=4@0.4.38")
    assert (r.name, r.variant) == ("jax", "unroll=4")
    r = backends.BackendRef.parse("jax:unroll=4@0.4.38+jaxlib@0.4.38")
    assert (r.base, r.pin_text) == ("jax:unroll=4", "0.4.38+jaxlib@0.4.38")
    assert backends.create("jax").pins == {}


@pytest.mark.parametrize("name, message", [
    ("theano@1.1.2", "theano cannot be pinned to a version (it runs in its own environment 'theano')"),
    ("native@1.0", "native cannot be pinned to a version"),
    ("jax@", "expected one exact version after 'jax@'"),
    ("jax@>=0.4", "expected one exact version after 'jax@'"),
    ("jax@0.4.38+jax@0.4.30", "jax is pinned twice"),
    ("jax@0.4.38+@1", "expected package@version"),
    ("numpy:nope@1.26.4", "unknown variant 'nope'"),
])
def test_bad_names_say_what_is_wrong(name, message):
    with pytest.raises(HarnessError, match=message.replace("(", r"\(").replace(")", r"\)")):
        backends.validate_name(name)


def test_a_config_versions_mapping_joins_pinned_backends_only(write_config):
    path = write_config("""
name: v
backends: [numpy, "numpy@1.26.4", "jax@0.4.38", "jax@0.6.2+numpy@2.2.6"]
baseline: "jax@0.4.38"
versions: {NumPy: "1.26.3"}
""")
    cfg = load_config(path)
    assert cfg.backends == ["numpy", "numpy@1.26.4", "jax@0.4.38+numpy@1.26.3",
                            "jax@0.6.2+numpy@2.2.6"]  # a name's own pins win; the main environment's is left alone
    assert cfg.baseline == "jax@0.4.38+numpy@1.26.3"
    assert {c.baseline for c in cfg.cells()} == {cfg.baseline}


@pytest.mark.parametrize("text, message", [
    ('backends: [numpy, "jax@0.4.38"]\nversions: {jaxlib: ">=0.4"}',
     "versions.jaxlib: expected one exact version after 'jaxlib@'"),
    ('backends: [numpy, "jax@0.4.38"]\nversions: {jaxlib: "0.4.38+numpy@1.26.4"}',
     "versions.jaxlib: expected one exact version"),
    ('backends: [numpy, jax]\nversions: {jaxlib: "0.4.38"}',
     "versions.jaxlib: pins a companion package in the environments of backends named with a version"),
    ('backends: [numpy, "jax@0.4.38"]\nversions: {jaxlib: 0.4}', "versions.jaxlib"),
    ('backends: [numpy, "theano@1.1.2"]', "backends[1]: backend 'theano@1.1.2': theano cannot be pinned"),
    ('backends: [numpy, "numpy@1.26.4"]\nbaseline: "numpy@1.26.3"', "baseline: expected one of the configured backends"),
])
def test_config_errors_name_the_file_and_key(write_config, text, message):
    path = write_config(f"name: v\n{text}\n")
    with pytest.raises(HarnessError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)


def test_a_pin_set_environment_has_a_recipe_from_its_name_and_a_user_may_name_it_by_backend():
    recipe = envs.find_recipe("jax@0.4.38+jaxlib@0.4.38")
    assert recipe.packages == ("jax==0.4.38", "jaxlib==0.4.38", "numpy", "PyYAML")
    assert envs.find_recipe("numpy@2.2.6").packages == ("numpy==2.2.6", "PyYAML")  # numpy pinned: not twice
    assert envs.find_recipe("jaxlib@0.4.38+jax@0.4.38") is None  # one folder per pin set: the canonical spelling
    assert envs.find_recipe("no-such-env") is None
    assert envs.environment_name("jax:unroll=4@0.4.38+jaxlib@0.4.38") == "jax@0.4.38+jaxlib@0.4.38"
    assert envs.environment_name("jaxlib@0.4.38+jax@0.4.38") == "jax@0.4.38+jaxlib@0.4.38"
    assert envs.environment_name("theano") == "theano"


def test_caches_of_an_isolated_environment_are_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("HARNESS_HOME", str(tmp_path))
    assert environments.cache_dir("jax") == tmp_path / "cache" / "jax"
    with environments.acting_for("jax@0.4.38"):
        assert environments.current_env() == "jax@0.4.38"
        assert environments.cache_dir("jax") == tmp_path / "cache" / "envs" / "jax@0.4.38" / "jax"
    assert environments.current_env() is None


def test_the_worker_refuses_a_pin_its_environment_does_not_hold():
    from harness.worker.worker import library_versions

    inst = backends.create("numpy@0.0.1")  # this process has the main environment's numpy
    with pytest.raises(RuntimeError, match=r"pins numpy 0\.0\.1, but the worker's environment .* has " + np.__version__):
        library_versions(inst)
    assert library_versions(backends.create("numpy"))["numpy"] == np.__version__


# -- labels and compare, on synthetic tables --------------------------------------------------


def _row(backend: str, version: str, cell: str = "c1", **extra) -> dict:
    r = backends.BackendRef.parse(backend)
    name, variant, pins = r.name, r.variant, r.pin_text or None
    return {"cell_id": f"{cell}|{backend}", "group": cell, "backend": name,
            "variant": variant or backends.default_variant(name), "pins": pins, "backend_version": version,
            "device": "cpu", "model": "elman", "task": "random", "workload": "train_step", "dtype": "float32",
            "batch": 1, "seq_len": 5, "input_size": 3, "hidden_size": 4, "output_size": 3, "threads": 1,
            "bptt": "full", "layers": 1, "activation": "tanh", "head": "softmax_xent", "output_act": "linear",
            "peephole": False, "bias": True, "tokens": False, "status": "ok", "baseline": "numpy", **extra}


def test_labels_add_the_version_where_a_backend_is_pinned_or_at_several_versions():
    df = pd.DataFrame([_row("numpy", "2.4.6"), _row("jax", "0.10.2"), _row("jax@0.4.38+jaxlib@0.4.38", "0.4.38"),
                       _row("jax:unroll=4@0.4.38", "0.4.38"), _row("numpy:wildml", "2.4.6")])
    assert list(backend_label(df)) == ["numpy", "jax 0.10.2", "jax 0.4.38", "jax:unroll=4 0.4.38", "numpy:wildml"]
    assert backend_name(df.iloc[2]) == "jax@0.4.38+jaxlib@0.4.38"
    # two pin sets of one release are still two backends
    two = pd.DataFrame([_row("jax@0.4.38+jaxlib@0.4.38", "0.4.38"), _row("jax@0.4.38+jaxlib@0.4.36", "0.4.38")])
    assert list(backend_label(two)) == ["jax@0.4.38+jaxlib@0.4.38", "jax@0.4.38+jaxlib@0.4.36"]
    # a run without pins keeps its plain labels, and so do runs of two machines whose main environments
    # differ (one backend on a CPU and a GPU machine) and an older table without the columns
    plain = pd.DataFrame([_row("jax", "0.10.2"), _row("numpy", "2.4.6"), _row("jax", "0.11.2", "c2")])
    assert list(backend_label(plain)) == ["jax", "numpy", "jax"]
    assert list(backend_label(plain.drop(columns=["pins", "backend_version"]))) == ["jax", "numpy", "jax"]


def _run(path, rows: list[dict]):
    store = RunStore.create(path, {"run_id": path.name, "name": "v", "machine": {}})
    store.add(rows, [])  # recorded in run.json too, as a run records its cells
    store.close()
    return path


def _timed(backend, version, cell, scale, baseline="numpy"):
    samples = [scale * (1 + 0.01 * i) for i in range(10)]
    return _row(backend, version, cell, samples_s=samples, median_s=float(np.median(samples)), n_samples=10,
                baseline=baseline)


def test_compare_pairs_cells_by_backend_and_pinned_version(tmp_path):
    a = _run(tmp_path / "a", [_timed("numpy", "2.4.6", "a", 1e-3), _timed("jax", "0.10.2", "a", 2e-3),
                              _timed("jax@0.4.38", "0.4.38", "a", 3e-3)])
    # another config's run: no cell id in common, the main environment's jax has moved on, and its pinned
    # jax is another release: it pairs with nothing, least of all with the unpinned jax
    b = _run(tmp_path / "b", [_timed("numpy", "2.4.6", "b", 1e-3), _timed("jax", "0.11.0", "b", 2e-3),
                              _timed("jax@0.6.2", "0.6.2", "b", 3e-3)])
    result = compare_runs(a, b)
    names = [c.cell for c in result.cells]
    assert len(names) == 2 and names[0].startswith("numpy ·")
    assert names[1].startswith("jax 0.10.2 ·") and names[1].endswith("(jax 0.10.2 -> 0.11.0)")
    assert [n.split(" ·")[0] for n in result.only_a] == ["jax 0.4.38"]
    assert [n.split(" ·")[0] for n in result.only_b] == ["jax 0.6.2"]
    # the same pins pair, and a pinned baseline is recognised as the baseline
    c = _run(tmp_path / "c", [_timed("numpy", "2.4.6", "c", 1e-3, "jax@0.4.38"),
                              _timed("jax@0.4.38", "0.4.38", "c", 3.3e-3, "jax@0.4.38")])
    d = _run(tmp_path / "d", [_timed("numpy", "2.4.6", "d", 1e-3, "jax@0.4.38"),
                              _timed("jax@0.4.38", "0.4.38", "d", 3e-3, "jax@0.4.38")])
    result = compare_runs(d, c)
    assert [c.cell.split(" ·")[0] for c in result.cells] == ["numpy", "jax 0.4.38"]
    # the pinned jax's own speedup of B (3.3 ms) over A (3 ms): A's time over B's
    assert all(c.baseline_ratio == pytest.approx(1 / 1.1) for c in result.cells)


# -- a real pinned environment, and one that cannot be built --------------------------------


RUN = """
name: pinned
seed: 3
model: {kind: elman, hidden: 6, bias: true}
task: {kind: lm_markov, vocab: 12, seq_len: 5, n_sequences: 8, n_eval: 4}
workloads: [train_step]
batch: [2]
backends: [numpy, "%s", "%s"]
baseline: "%s"
timing: {warmup: 1, min_rounds: 3, min_time_s: 0.01, max_time_s: 1, timeout_s: 120}
""" % (PINNED, MISSING, PINNED)


@pytest.fixture(scope="module")
def pinned_env():
    """numpy 2.2.6's environment in the harness's cache (built once, reused by later runs of the suite)."""
    name = envs.environment_name(PINNED)
    if envs.env_python(name) is None:
        ok, why = envs.can_create(name)
        if not ok:
            pytest.skip(why)
        try:
            envs.ensure_env(name)
        except HarnessError as exc:
            if os.environ.get("CI"):  # CI reaches PyPI: a failed build is a failure there
                raise
            pytest.skip(f"the {name} environment could not be built here: {exc}")
    return name


@pytest.mark.heavy  # builds a version environment
def test_a_pinned_cell_runs_in_its_environment_and_an_uninstallable_pin_is_unavailable(pinned_env, tmp_path):
    (tmp_path / "pinned.yaml").write_text(RUN)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(tmp_path / "pinned.yaml"), "--out", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output  # an unavailable backend is a result, as always
    run = load_run(out)
    rows = {backend_name(r): r for _, r in run.timings.iterrows()}
    assert set(rows) == {"numpy", PINNED, MISSING}

    pinned, main, missing = rows[PINNED], rows["numpy"], rows[MISSING]
    assert pinned["status"] == "ok" and pinned["backend_version"] == "2.2.6" and pinned["pins"] == "2.2.6"
    assert main["status"] == "ok" and main["backend_version"] == np.__version__
    assert main["speedup_over"] == PINNED  # the pinned baseline
    assert run.meta["versions"][PINNED]["numpy"] == "2.2.6"
    assert run.meta["versions"]["numpy"]["numpy"] == np.__version__
    assert run.meta["worker_env"][PINNED] is not None

    assert missing["status"] == "unavailable" and missing["backend_version"] == "0.0.1"
    error = missing["error"]
    assert "\n" not in error and "could not create environment 'numpy@0.0.1'" in error
    assert "numpy==0.0.1" in error and len(error) < 600  # pip's reason, its list of releases cut short
    assert not environments.env_dir(MISSING).exists()

    labels = dict(zip(backend_label(run.timings), run.timings["pins"].fillna("")))
    assert labels == {f"numpy {np.__version__}": "", "numpy 2.2.6": "2.2.6", "numpy 0.0.1": "0.0.1"}


@pytest.mark.heavy  # builds a version environment
def test_env_commands_create_list_and_remove_pinned_environments(pinned_env, tmp_path, monkeypatch):
    runner = CliRunner()
    listed = runner.invoke(app, ["env", "list"], env={"COLUMNS": "250"})
    assert listed.exit_code == 0 and PINNED in listed.output and "numpy 2.2.6" in listed.output
    again = runner.invoke(app, ["env", "create", PINNED])
    assert again.exit_code == 0 and f"environment {PINNED} ready" in again.output

    bad = runner.invoke(app, ["env", "create", "theano@1.1.2"])
    assert bad.exit_code == 2 and "theano cannot be pinned" in bad.output  # a bad name: bad input

    # remove, on a private home so the cached environment stays for the next run of the suite
    monkeypatch.setenv("HARNESS_HOME", str(tmp_path / "home"))
    folder = environments.env_dir(PINNED)
    folder.mkdir(parents=True)
    (folder / environments.MARKER).write_text(json.dumps({"name": PINNED, "packages": {"numpy": "2.2.6"}}))
    environments.env_cache_dir(PINNED).mkdir(parents=True)
    removed = runner.invoke(app, ["env", "remove", "numpy:wildml@2.2.6"])  # named by a backend that runs there
    assert removed.exit_code == 0, removed.output
    assert not folder.exists() and not environments.env_cache_dir(PINNED).exists()
    gone = runner.invoke(app, ["env", "remove", PINNED])
    assert gone.exit_code == 2 and "does not exist" in gone.output
