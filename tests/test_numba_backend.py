"""The Numba backend against the reference: the conformance matrix, its vectorised maths, and its disk cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")
pytest.importorskip("scipy")  # numba's np.dot calls scipy's BLAS

import backends  # noqa: E402
from backends import numba_backend as nbm  # noqa: E402
from harness.spec import reference as ref  # noqa: E402
from harness.verify.check import (Case, all_cases, gru_or_bidirectional, initial_params, make_data,  # noqa: E402
                                  run_case)
from harness.spec.model import REDUCED_DTYPES, ModelSpec, Problem  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# one test process takes them all (pytest -n 2 --dist loadgroup): each compiles the step once per dtype on a cold
# cache, and two processes would compile the same one side by side
pytestmark = pytest.mark.xdist_group("numba")
# every case shares the one compiled step, so CI takes the whole quick matrix (but mixed precision, which numba
# refuses: tests/test_mixed_precision.py)
QUICK = [c for c in all_cases(quick=True) if c.dtype not in REDUCED_DTYPES]


@pytest.fixture(scope="module")
def backend():
    return backends.create("numba")


def _failures(results):
    return [f"{r.case} [{r.dtype}]: {r.status} {r.reason}" for r in results if r.status != "pass"]


@pytest.mark.parametrize("case", QUICK, ids=[f"{c.label} {c.dtype}" for c in QUICK])
def test_quick_matrix_passes(backend, case):
    res = run_case(backend, case)
    assert res.status == "pass", f"{res.reason}\n{res.details.get('traceback', '')}"


@pytest.mark.heavy
def test_whole_matrix_passes(backend):
    results = [run_case(backend, case) for case in all_cases() if case.dtype not in REDUCED_DTYPES]
    assert not _failures(results), "\n".join(_failures(results))


def test_supports_gru_and_bidirectional_layers(backend):
    cases = [c for c in all_cases(quick=True) if gru_or_bidirectional(c) and c.dtype not in REDUCED_DTYPES]
    assert {c.model.kind for c in cases} == {"elman", "lstm", "gru"} and any(c.model.bidirectional for c in cases)
    for case in cases:
        assert backend.supports(case.problem()) == (True, ""), case.label


def _case(model: dict, tokens: bool, dtype: str = "float64", T: int = 7, B: int = 2, seed: int = 5) -> Case:
    spec = ModelSpec.from_mapping({"hidden": 6, **model})
    return Case(f"{spec.describe()} {'tokens' if tokens else 'dense'}", spec, tokens, 5, 4, T, B, dtype, seed)


# windows that cover the whole sequence (one lane), a single-step window, and layers with lanes
EDGE_CASES = [
    _case({"kind": "elman", "bptt": {"truncated": 6}}, True),
    _case({"kind": "elman", "bptt": {"truncated": 30}, "layers": 2}, False),
    _case({"kind": "lstm", "peephole": True, "bptt": {"truncated": 1}, "layers": 3}, True),
    _case({"kind": "elman", "activation": "relu", "bptt": {"tail": 1}, "layers": 2, "head": "mse"}, False),
    _case({"kind": "lstm", "bptt": {"tail": 9}, "head": "mse", "output_act": "tanh"}, False, "float32"),
    _case({"kind": "elman", "activation": "sigmoid", "bptt": {"truncated": 2}, "layers": 2, "clip": 0.01}, True,
          "float32", T=1, B=1),
    # GRU lanes fed from the layer above, a one-step window, a tail, a one-step sequence
    _case({"kind": "gru", "bptt": {"truncated": 1}, "layers": 3}, True),
    _case({"kind": "gru", "reset_after": False, "bptt": {"truncated": 2}, "layers": 2, "head": "mse"}, False),
    _case({"kind": "gru", "reset_after": False, "bptt": {"tail": 2}, "bias": False}, True, "float32"),
    _case({"kind": "gru", "bptt": {"tail": 1}, "layers": 2, "head": "mse", "output_act": "tanh"}, False, T=1, B=1),
    # bidirectional layers stacked three deep, an odd T (the flips' middle step) and T = 1
    _case({"kind": "gru", "reset_after": False, "bidirectional": True, "layers": 3}, False, T=5),
    _case({"kind": "lstm", "peephole": True, "bidirectional": True, "layers": 2, "clip": 0.05}, True, T=1, B=3),
    _case({"kind": "elman", "activation": "relu", "bidirectional": True, "layers": 2, "head": "mse"}, True,
          "float32", T=4),
]


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.label for c in EDGE_CASES])
def test_edge_bptt_windows_and_shapes(backend, case):
    res = run_case(backend, case)
    assert res.status == "pass", f"{res.reason}\n{res.details.get('traceback', '')}"


def _prepared(case: Case):
    b = backends.create("numba")
    b.prepare(case.problem(), initial_params(case))
    b.warm_up(make_data(case))
    return b


@pytest.mark.parametrize("model", [{"kind": "elman", "bptt": {"truncated": 2}},
                                   {"kind": "gru", "reset_after": False, "bidirectional": True}],
                         ids=["elman", "gru-before-bi"])
def test_token_gradient_buffer_is_clean_between_calls(model):
    """Steps update only the gathered rows of W_xh (each direction's); gradients asked for afterwards must
    still be exact."""
    case = _case(model, True, T=9, B=3)
    b = _prepared(case)
    params = ref.params_like(initial_params(case), np.float64)
    for step in range(3):
        x, y = make_data(case, step)
        loss, grads = b.loss_and_grads(x, y)
        want_loss, want = ref.loss_and_grads(case.model, params, x, y)
        assert loss == pytest.approx(want_loss, rel=1e-12)
        for k, g in want.items():
            np.testing.assert_allclose(grads[k], g, rtol=1e-9, atol=1e-13, err_msg=f"step {step} {k}")
        b.sgd_step(x, y, 0.3)
        _, params = ref.sgd_step(case.model, params, x, y, 0.3)
    for k, v in b.get_params().items():
        np.testing.assert_allclose(v, params[k], rtol=1e-9, atol=1e-13, err_msg=k)


@pytest.mark.parametrize("model", [{"kind": "lstm", "peephole": True},
                                   {"kind": "gru", "reset_after": False, "bidirectional": True, "layers": 2}],
                         ids=["lstm-peephole", "gru-before-bi"])
def test_prepare_resets_and_params_are_copies(model):
    # the reset-before GRU keeps W_hh packed (its two halves apart): the names still give SPEC.md's layout
    case = _case(model, False)
    b = _prepared(case)
    x, y = make_data(case)
    b.sgd_step(x, y, 0.5)
    moved = b.get_params()
    assert any(not np.array_equal(moved[k], v) for k, v in initial_params(case).items())
    moved["W_hh"][:] = 0  # a copy: the backend's weights are untouched
    assert np.any(b.get_params()["W_hh"] != 0)
    b.prepare(case.problem(), initial_params(case))
    for k, v in initial_params(case).items():
        np.testing.assert_array_equal(b.get_params()[k], v)


@pytest.mark.parametrize("model", [{"kind": "lstm", "layers": 2, "bptt": {"truncated": 2}},
                                   {"kind": "gru", "layers": 2, "bptt": {"truncated": 2}},
                                   {"kind": "gru", "reset_after": False, "bidirectional": True}],
                         ids=["lstm", "gru", "gru-before-bi"])
def test_other_sequence_lengths_and_batches_after_warm_up(model):
    case = _case(model, True, T=6, B=2)
    b = _prepared(case)
    params = ref.params_like(initial_params(case), np.float64)
    rng = np.random.default_rng(3)
    for T, B in ((11, 1), (2, 5), (6, 2)):
        x = rng.integers(0, case.input_size, (T, B))
        y = rng.integers(0, case.output_size, (T, B))
        np.testing.assert_allclose(b.forward(x), ref.outputs(case.model, params, x), rtol=1e-10, atol=1e-14)
        loss, grads = b.loss_and_grads(x, y)
        want_loss, want = ref.loss_and_grads(case.model, params, x, y)
        assert loss == pytest.approx(want_loss, rel=1e-12)
        for k, g in want.items():
            np.testing.assert_allclose(grads[k], g, rtol=1e-9, atol=1e-13, err_msg=f"T={T} B={B} {k}")


def test_bad_inputs_are_refused():
    case = _case({"kind": "elman"}, True)
    b = _prepared(case)
    x, y = make_data(case)
    with pytest.raises(ValueError, match="token id"):
        b.forward(np.full_like(x, case.input_size))
    with pytest.raises(ValueError, match="class id"):
        b.loss_and_grads(x, np.full_like(y, -1))
    with pytest.raises(ValueError, match="shape"):
        b.forward(x[..., None].astype(float))
    with pytest.raises(ValueError, match="shape"):
        b.sgd_step(x, y[:-1], 0.1)


def test_cpu_only_and_reports_versions():
    spec = ModelSpec.from_mapping({"kind": "elman", "hidden": 4})
    b = backends.create("numba")
    assert b.supports(Problem(spec, 3, 3, True, device="gpu"))[0] is False
    assert b.supports(Problem(spec, 3, 3, True, "float32"))[0] is True
    assert set(b.versions()) >= {"numba", "llvmlite", "numpy"}


def test_unavailable_without_numba(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numba" else real(name, *a))
    ok, why = backends.create("numba").availability()
    assert not ok and why.startswith("unavailable: numba not installed")


@pytest.fixture(scope="module")
def elementwise():
    """A compiled loop applying the backend's exp (0) or tanh (1) to every element."""
    import numba

    nbm._compiled()  # registers the vectorisable versions with Numba

    @numba.njit
    def apply(x, which):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = nbm._exp(x[i]) if which == 0 else nbm._tanh(x[i])
        return out

    return apply


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exp_and_tanh_are_within_two_ulp(elementwise, dtype):
    eps = np.finfo(dtype).eps
    # float32 is judged against float64; float64 against long double where that is wider
    wide = np.float64 if dtype == "float32" else np.longdouble
    bound = 2 * eps if np.finfo(wide).eps < eps else 3 * eps
    lo, hi = nbm._EXP_RANGE[np.dtype(dtype).itemsize * 8]
    grid = np.concatenate([np.linspace(lo, hi, 400_001), np.linspace(-1, 1, 100_001),
                           np.geomspace(1e-30, 1, 3001), -np.geomspace(1e-30, 1, 3001)]).astype(dtype)
    want_exp = np.exp(grid.astype(wide))
    rel = np.abs(elementwise(grid, 0) - want_exp) / want_exp
    assert rel.max() <= bound, rel.max() / eps
    t = grid[np.abs(grid) < 25]
    want_tanh = np.tanh(t.astype(wide))
    nz = want_tanh != 0
    rel = np.abs(elementwise(t, 1)[nz] - want_tanh[nz]) / np.abs(want_tanh[nz])
    assert rel.max() <= bound, rel.max() / eps


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exp_and_tanh_special_values(elementwise, dtype):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -1e4, 40.0, -40.0], dtype)
    e = elementwise(x, 0)
    assert np.isnan(e[0]) and e[2] == 0 and e[3] == 1 and e[5] == 0 and np.isfinite(e[1]) and e[1] > 1e38
    th = elementwise(x, 1)
    assert np.isnan(th[0])
    assert list(th[1:]) == [1, -1, 0, 0, -1, 1, -1]


_CHILD = """
import json
from harness.verify.check import all_cases, initial_params, make_data
from backends.numba_backend import NumbaBackend
case = all_cases(quick=True)[0]
b = NumbaBackend()
b.prepare(case.problem(), initial_params(case))
b.warm_up(make_data(case))
st = b._run.stats
print(json.dumps({"path": st.cache_path, "hits": sum(st.cache_hits.values()), "misses": sum(st.cache_misses.values())}))
"""


def test_second_process_loads_the_compiled_step_from_disk():
    def child():
        out = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = child()  # compiles (and writes) unless an earlier process already did
    assert list(Path(first["path"]).glob("*_run-*.nbi")) and list(Path(first["path"]).glob("*_run-*.nbc"))
    second = child()
    assert second["hits"] >= 1 and second["misses"] == 0, second
