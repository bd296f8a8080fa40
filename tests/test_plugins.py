"""Backends from installed packages (entry-point group ``rnn_harness.backends``): the example plugin
installs, lists and passes its own conformance tests; broken plugins are unavailable, never a crash."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

import backends
from harness.cli import app

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rnn-harness-plugin-example"
TIMEOUT_S = 300  # the machine may be loaded; these usually take seconds


def _env(extra_path: Path) -> dict:
    env = dict(os.environ)
    env.pop("HARNESS_BACKENDS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(extra_path), str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory) -> Path:
    """The example plugin built and installed by pip into a folder of its own (put on PYTHONPATH)."""
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "--target", str(target), str(EXAMPLE)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (target / "rnn_harness_plugin_example").is_dir()
    return target


def test_installed_plugin_shows_in_harness_list(installed_example):
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "list", "--json"], capture_output=True, text=True,
                          env=_env(installed_example), cwd=ROOT, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    rows = {r["full_name"]: r for r in json.loads(proc.stdout)}
    assert rows["example"]["available"], rows["example"]
    assert rows["example"]["origin"] == "plugin rnn-harness-plugin-example"
    assert rows["numpy"]["origin"] == "built-in"


@pytest.mark.heavy  # the whole conformance matrix, in a fresh interpreter
def test_plugin_own_tests_pass_through_the_public_helper(installed_example):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                          capture_output=True, text=True, env=_env(installed_example), cwd=EXAMPLE, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


BROKEN_MODULE = '''
from backends.base import Backend


class RaisingAvailability(Backend):
    name = "raising"

    def availability(self):
        raise RuntimeError("licence server unreachable")


class NotABackend:
    name = "notabackend"


class Misnamed(Backend):
    name = "othername"


class RaisingInit(Backend):
    name = "raisinginit"

    def __init__(self, variant=None):
        raise ValueError("needs a config file")
'''

BROKEN_ENTRY_POINTS = {
    "raising": "broken_plugin:RaisingAvailability",
    "notabackend": "broken_plugin:NotABackend",
    "misnamed": "broken_plugin:Misnamed",
    "raisinginit": "broken_plugin:RaisingInit",
    "missing": "no_such_module_for_rnn_harness:Thing",
    "noattr": "broken_plugin:NoSuchClass",
    "malformed": "broken_plugin",
    "numpy": "broken_plugin:RaisingAvailability",  # the name of a built-in backend
}


@pytest.fixture
def broken_plugins(tmp_path, monkeypatch):
    """A distribution on sys.path (as pip would leave it) declaring one broken backend of each kind."""
    (tmp_path / "broken_plugin.py").write_text(BROKEN_MODULE)
    info = tmp_path / "broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    lines = "\n".join(f"{k} = {v}" for k, v in BROKEN_ENTRY_POINTS.items())
    (info / "entry_points.txt").write_text(f"[rnn_harness.backends]\n{lines}\n")
    monkeypatch.delenv("HARNESS_BACKENDS", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return tmp_path


EXPECTED_REASONS = {
    "raising": "availability() raised RuntimeError: licence server unreachable",
    "notabackend": "is not a subclass of backends.base.Backend",
    "misnamed": "the class calls itself 'othername'",
    "raisinginit": "could not be created: ValueError: needs a config file",
    "missing": "failed to import",
    "noattr": "failed to import",
    "malformed": "expected an entry point 'module:Class'",
    "numpy (broken-plugin)": "the name 'numpy' is taken by a built-in backend",
}


def test_broken_plugins_are_listed_unavailable_with_their_reason(broken_plugins):
    rows = {r.full_name: r for r in backends.list_backends()}
    for name, reason in EXPECTED_REASONS.items():
        assert not rows[name].available, name
        assert rows[name].reason.startswith("unavailable:") and reason in rows[name].reason, (name, rows[name].reason)
        assert rows[name].origin == "plugin broken-plugin"
    assert rows["numpy"].available and rows["numpy"].origin == "built-in"  # a plugin cannot replace a built-in

    result = CliRunner().invoke(app, ["list"])
    assert result.exit_code == 0, result.output
    assert "licence server unreachable" in result.output and "raisinginit" in result.output


def test_harness_backends_variable_overrides_plugins(broken_plugins, monkeypatch):
    monkeypatch.setenv("HARNESS_BACKENDS", "raising=backends.numpy_backend:NumpyBackend")
    assert backends.origin("raising") == "HARNESS_BACKENDS"
    # the variable's class is what runs; its name check fails loudly rather than silently renaming
    assert "calls itself 'numpy'" in next(r.reason for r in backends.list_backends() if r.name == "raising")


def test_broken_plugins_in_a_run_are_unavailable_cells(broken_plugins, write_config, tmp_path):
    cfg = write_config(textwrap.dedent("""
        name: plugins
        seed: 1
        dtype: float64
        model: {kind: elman, hidden: 4}
        task: {kind: random, input_size: 3, output_size: 3, seq_len: 3, n_sequences: 4}
        workloads: [forward]
        batch: [2]
        backends: [numpy, raising, missing, raisinginit, notabackend]
        timing: {warmup: 0, min_rounds: 3, min_time_s: 0.01, max_time_s: 1, timeout_s: 120}
    """))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    from harness import load_run

    t = load_run(out).timings.set_index("backend")
    assert t.loc["numpy", "status"] == "ok"
    for name in ("raising", "missing", "raisinginit", "notabackend"):
        assert t.loc[name, "status"] == "unavailable", (name, t.loc[name, "error"])
    assert "licence server unreachable" in t.loc["raising", "error"]


def test_check_reports_a_broken_plugin_without_crashing(broken_plugins):
    result = CliRunner().invoke(app, ["check", "--backends", "raising,missing"])
    # each broken plugin is a result with its reason, not a crash; a check that could test nothing
    # named in --backends fails (exit 1), as a CI command must
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "licence server unreachable" in result.output and "failed to import" in result.output
    assert "Traceback" not in result.output


# -- harness.testing in this process -------------------------------------------------------------
def _few_cases():
    from harness.testing import conformance_cases

    return [c for c in conformance_cases(quick=True) if c.label.startswith("elman")][:3]


def test_check_backend_passes_a_correct_backend_and_returns_every_result(fake_backends):
    from harness.testing import check_backend

    results = check_backend("ref", cases=_few_cases())
    assert [r.status for r in results] == ["pass"] * 3
    assert all(r.worst_ratio <= 1 for r in results)


def test_check_backend_catches_a_one_percent_error(fake_backends):
    from harness.testing import ConformanceError, check_backend

    with pytest.raises(ConformanceError, match=r"bad:wrong: 3 of 3 conformance case\(s\) failed\n  fail: elman"):
        check_backend("bad:wrong", cases=_few_cases())


def test_check_backend_refuses_a_check_that_checked_nothing(fake_backends):
    from harness.testing import ConformanceError, check_backend

    with pytest.raises(ConformanceError, match="no conformance case passed.*supports nothing"):
        check_backend("bad:unsupported", cases=_few_cases())


def test_check_helpers_fail_on_an_unavailable_or_unknown_backend(broken_plugins):
    from harness.testing import ConformanceError, check_backend, check_case

    with pytest.raises(ConformanceError, match="licence server unreachable"):
        check_backend("raising", cases=_few_cases())
    with pytest.raises(ConformanceError, match="failed to import"):
        check_case("missing", _few_cases()[0])
    with pytest.raises(ConformanceError, match="unknown backend 'nosuch'"):
        check_backend("nosuch")


def test_check_case_skips_an_unsupported_case_with_the_reason():
    from harness.testing import check_case, conformance_cases

    lstm = next(c for c in conformance_cases(quick=True) if c.label.startswith("lstm"))
    assert check_case("numpy", lstm).status == "pass"
    with pytest.raises(pytest.skip.Exception, match="batch 1 only"):
        check_case("numpy:wildml", next(c for c in conformance_cases() if c.batch == 3))


# -- what a plugin author reads --------------------------------------------------------------------------
def test_an_error_without_a_message_names_where_it_was_raised_and_a_missing_method_names_itself():
    """A bare `raise NotImplementedError` in a backend shows its function, file and line, not an empty
    `NotImplementedError: `; a protocol method the class does not implement says which."""
    from backends.base import Backend
    from harness.verify.check import all_cases, run_case

    class Bare(Backend):
        name = "bare"

        def prepare(self, problem, params, device="cpu", threads=1):
            self.params = params

        def forward(self, x):
            raise NotImplementedError

    case = next(c for c in all_cases(quick=True) if c.cell == "elman-tanh")
    res = run_case(Bare(), case)
    line = Bare.forward.__code__.co_firstlineno + 1
    assert res.status == "error" and res.reason == f"NotImplementedError (no message) raised in forward() at {__file__}:{line}"

    class NoForward(Bare):
        forward = Backend.forward

    assert run_case(NoForward(), case).reason == "NotImplementedError: NoForward does not implement forward()"


def test_a_backend_that_does_not_declare_the_gru_is_told_how_to_without_history():
    from backends.base import Backend, supports
    from harness.verify.check import all_cases

    class ElmanOnly(Backend):
        name = "elmanonly"

    gru = next(c for c in all_cases(quick=True) if c.cell == "gru").problem()
    ok, why = supports(ElmanOnly(), gru)
    assert not ok and why == ("unsupported: elmanonly does not declare the GRU cell (a backend that implements it "
                              "lists 'gru' in its class's `knows`)")


def test_check_finds_the_cases_a_backend_for_a_corner_of_the_spec_supports(fake_backends, monkeypatch):
    """A backend that runs only a dense one-layer tanh Elman cell supports none of the quick subset's cases:
    `--quick` checks it on a pairwise-covering subset of the cases it supports instead, and the whole
    matrix has its dtype and bias variants, so both check it in float32 and float64, with and without biases."""
    monkeypatch.setenv("HARNESS_BACKENDS", "dense=fake_backends:DenseElmanBackend")
    for args in (["--quick"], []):
        result = CliRunner().invoke(app, ["check", "--backends", "dense", "--json", *args])
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
        passed = {(r["dtype"], "nobias" not in r["case"]) for r in rows if r["status"] == "pass"}
        assert passed == {("float64", True), ("float64", False), ("float32", True), ("float32", False)}, args
        assert {r["status"] for r in rows} == ({"pass"} if args else {"pass", "unsupported"})


def test_the_guide_quotes_the_example_backend_whole():
    """docs/backends.md shows the example plugin's backend as it is: the two cannot drift apart."""
    import re

    guide = (ROOT / "docs" / "backends.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", guide, re.S | re.M)
    source = (EXAMPLE / "src" / "rnn_harness_plugin_example" / "backend.py").read_text()
    assert source in blocks
