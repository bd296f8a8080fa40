"""Theano in its isolated environment: availability from the main one, and the quick
conformance matrix run there through ``harness check``'s own path."""

import os
import sys

import pytest

from harness.run import envs
from harness.spec.errors import HarnessError


def scan_graph_ci_cases():
    """The cases CI compiles for the scan-graph backends (Theano, PyTensor), each a graph compiled cold:
    the representative Elman and LSTM cases (every head, bptt mode, input kind and dtype), and one GRU
    case from the quick matrix that takes the reset-before form in a bidirectional layer (the graph
    code that differs most from the LSTM's; a second GRU case cost about a minute of CI over the three
    compiled backends). The other GRU and bidirectional cases are behind ``-m fullmatrix`` and
    ``harness check``."""
    from harness.verify.check import all_cases, one_direction_elman_lstm, representative_cases

    small = [c for c in all_cases(quick=True) if not c.label.startswith("realistic")]
    bi = next(c for c in small if c.model.kind == "gru" and not c.model.reset_after and c.model.bidirectional)
    return one_direction_elman_lstm(representative_cases()) + [bi]


def test_availability_never_imports_theano_here():
    from backends.theano_backend import TheanoBackend

    ok, why = TheanoBackend().availability()
    assert "theano" not in sys.modules
    exists = envs.env_python("theano") is not None
    creatable, reason = envs.can_create("theano")
    assert ok == (exists or creatable)
    if exists:
        assert why == ""
    else:
        assert why == ("environment will be created on first use" if creatable else f"unavailable: {reason}")


def test_every_case_is_supported_without_theano():
    from backends.theano_backend import TheanoBackend
    from harness.spec.model import REDUCED_DTYPES
    from harness.verify.check import all_cases

    cases = all_cases()
    assert any(c.model.kind == "gru" for c in cases) and any(c.model.bidirectional for c in cases)
    for case in cases:
        if case.dtype in REDUCED_DTYPES:  # mixed precision is refused, with the reason
            ok, why = TheanoBackend().supports(case.problem())
            assert not ok and why.startswith("unsupported:"), case.label
            continue
        assert TheanoBackend().supports(case.problem()) == (True, ""), case.label
    assert not TheanoBackend().supports(cases[0].problem(device="gpu"))[0]
    assert "theano" not in sys.modules


@pytest.fixture(scope="module")
def theano_env():
    if envs.env_python("theano") is None:
        creatable, reason = envs.can_create("theano")
        if not creatable:
            pytest.skip(reason)
    try:
        return envs.ensure_env("theano")
    except HarnessError as exc:
        if os.environ.get("CI"):  # CI reaches PyPI: a failed build is a failure there
            raise
        pytest.skip(f"the theano environment could not be built here: {exc}")


@pytest.mark.heavy  # builds Theano's environment (minutes, once per HARNESS_HOME) and compiles each scan graph
def test_representative_conformance_in_the_environment(theano_env):
    from harness.run.conformance import _check_isolated
    from harness.verify.check import all_cases

    quick = all_cases(quick=True)
    chosen = scan_graph_ci_cases()
    where = {(c.label, c.dtype): i for i, c in enumerate(quick)}
    results = _check_isolated("theano", cases=quick, quick=True, device="cpu",
                              indices=[where[(c.label, c.dtype)] for c in chosen])
    broken = [f"{r.status} {r.case} [{r.dtype}]: {r.reason}" for r in results if r.status != "pass"]
    assert not broken, "\n".join(broken)
    assert [(r.case, r.dtype) for r in results] == [(c.label, c.dtype) for c in chosen]
    assert any("tail" in r.case for r in results) and any("truncated" in r.case for r in results)
    assert any(r.case.startswith("lstm") for r in results) and any(r.case.startswith("gru") for r in results)
    assert any("-bi " in r.case for r in results)
    assert all(r.worst_ratio <= 1.0 for r in results)


@pytest.mark.fullmatrix
def test_quick_conformance_in_the_environment(theano_env):
    from backends import blas
    from harness.verify.check import all_cases
    from harness.run.conformance import run_conformance

    results = run_conformance(["theano"], quick=True)
    by_status = {}
    for r in results:
        by_status.setdefault(r.status, []).append(r)
    broken = [f"{r.status} {r.case} [{r.dtype}]: {r.reason}"
              for r in results if r.status not in ("pass", "unsupported")]
    assert not broken, "\n".join(broken)

    assert {(r.case, r.dtype) for r in results} == {(c.label, c.dtype) for c in all_cases(quick=True)}
    expected = {(c.label, c.dtype) for c in all_cases(quick=True) if c.dtype in ("float32", "float64")}
    passed = by_status["pass"]
    assert len(passed) == len(expected)
    assert any("tail" in r.case for r in passed) and any("truncated" in r.case for r in passed)
    assert any("lstm" in r.case for r in passed)
    assert any(r.case.startswith("gru-before") for r in passed) and any("-bi " in r.case for r in passed)
    assert all(r.worst_ratio <= 1.0 for r in passed)

    choice = blas.read_choice(envs.env_dir("theano"))
    assert choice is not None and choice["by_threads"]
    assert blas.choice_for(choice)["choice"] in ("numpy", "openblas")
