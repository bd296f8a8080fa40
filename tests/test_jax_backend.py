"""The JAX backend against the reference: the conformance matrix, every variant, and x64 isolation."""

import json
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("jax")

import backends  # noqa: E402
from backends.jax_backend import JaxBackend  # noqa: E402
from harness.verify.check import Case, all_cases, gru_or_bidirectional, run_case  # noqa: E402
from harness.spec.model import ModelSpec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _ci_gru_or_bidirectional(cases: list[Case]) -> list[Case]:
    """Of the quick matrix's GRU and bidirectional cases, the first of each cell (both GRU forms, each cell
    bidirectional) and a truncated reset-before GRU: each case is several XLA compiles, so CI takes these."""
    picked, cells = [], set()
    for c in filter(gru_or_bidirectional, cases):
        cell = c.cell
        if cell is not None and (cell not in cells or (cell == "gru-before" and c.bptt.startswith("truncated"))):
            cells.add(cell)
            picked.append(c)
    return picked


_ALL_QUICK = all_cases(quick=True)
QUICK = [c for c in _ALL_QUICK if not gru_or_bidirectional(c)] + _ci_gru_or_bidirectional(_ALL_QUICK)
_QUICK_KEYS = {(c.label, c.dtype) for c in QUICK}
REST = [c for c in all_cases() if (c.label, c.dtype) not in _QUICK_KEYS]  # GRU and bidirectional cases too


def _case_id(case: Case) -> str:
    return f"{case.label} {case.dtype}"


def _explain(res) -> str:
    return f"{res.backend} {res.case} [{res.dtype}]: {res.status} {res.reason} {res.details.get('traceback', '')}"


def _small(model: dict, tokens=True, dtype="float64", T=7, B=3) -> Case:
    spec = ModelSpec.from_mapping({"hidden": 4, **model})
    return Case(f"{spec.describe()} {'tokens' if tokens else 'dense'} B={B}", spec, tokens, 5, 6, T, B, dtype, seed=7)


def test_ci_subset_covers_every_gru_and_bidirectional_cell():
    picked = {c.cell for c in QUICK if gru_or_bidirectional(c)}
    assert picked == {"gru", "gru-before", "elman-tanh-bi", "lstm-bi", "lstm-peephole-bi", "gru-bi", "gru-before-bi"}
    assert any(c.label.startswith("gru-before") and "truncated" in c.label for c in QUICK)
    for case in filter(gru_or_bidirectional, all_cases(quick=True)):
        assert backends.create("jax").supports(case.problem()) == (True, ""), case.label


@pytest.mark.parametrize("case", QUICK, ids=_case_id)
def test_quick_matrix_default_variant(case):
    res = run_case(backends.create("jax"), case)
    assert res.status == "pass", _explain(res)


def _run_cases(cases: list[Case]) -> list[tuple[str, str, str]]:
    backend = backends.create("jax")
    return [(r.status, f"{r.case} [{r.dtype}]", r.reason) for r in (run_case(backend, c) for c in cases)]


@pytest.mark.fullmatrix
def test_rest_of_full_matrix_default_variant():
    # Each case costs a few XLA compiles; the cases are shared out over the cores.
    workers = max(1, min(2, os.cpu_count() or 1))
    chunks = [REST[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = [r for chunk in pool.map(_run_cases, chunks) for r in chunk]
    assert len(results) == len(REST)
    bad = [r for r in results if r[0] != "pass"]
    assert not bad, bad


# One case per variant, different ones, so each loop form meets truncation lanes, tails and layers.
VARIANT_CASES = {
    "unroll=1": _small({"kind": "lstm", "peephole": True, "bptt": {"truncated": 2}, "layers": 2}, tokens=False),
    "unroll=4": _small({"kind": "elman", "activation": "relu", "head": "mse", "bptt": {"tail": 3}, "layers": 2}),
    "unroll=T": _small({"kind": "elman", "activation": "sigmoid", "bptt": {"truncated": 3}, "clip": 0.5}, dtype="float32"),
    "python": _small({"kind": "lstm", "head": "mse", "output_act": "tanh", "bptt": {"truncated": 2}, "bias": False}),
}


@pytest.mark.parametrize("variant", list(VARIANT_CASES))
def test_other_variants(variant):
    res = run_case(backends.create(f"jax:{variant}"), VARIANT_CASES[variant])
    assert res.status == "pass", _explain(res)


# The GRU's hand-written step and the reverse scan under each loop form: truncation lanes, a tail
# with a layer above, an unrolled reverse scan, and the Python loop run backwards.
VARIANT_GRU_CASES = {
    "unroll=1": _small({"kind": "gru", "reset_after": False, "bptt": {"tail": 3}, "layers": 2}, tokens=False),
    "unroll=4": _small({"kind": "gru", "bptt": {"truncated": 2}, "head": "mse"}),
    "unroll=T": _small({"kind": "lstm", "bidirectional": True}, tokens=False, dtype="float32"),
    "python": _small({"kind": "gru", "reset_after": False, "bidirectional": True, "bias": False}),
}


@pytest.mark.parametrize("variant", list(VARIANT_GRU_CASES))
def test_other_variants_gru_and_bidirectional(variant):
    res = run_case(backends.create(f"jax:{variant}"), VARIANT_GRU_CASES[variant])
    assert res.status == "pass", _explain(res)


@pytest.mark.parametrize("model", [{"bptt": {"truncated": 1}, "layers": 2}, {"bptt": {"truncated": 6}}, {"bptt": {"tail": 1}}],
                         ids=["truncated:1", "truncated:T-1", "tail:1"])
def test_window_edges(model):
    # T = 7: the shortest windows, and a window that spans the whole sequence (the full gradient).
    res = run_case(backends.create("jax"), _small({"kind": "elman", **model}))
    assert res.status == "pass", _explain(res)


_X64_SCRIPT = """
import json, sys
import numpy as np
print_ = {"jax_imported_by_module": None}
import backends.jax_backend
print_["jax_imported_by_module"] = "jax" in sys.modules
import jax
from harness.verify.check import Case, initial_params, make_data, run_case
from harness.spec.model import ModelSpec
import backends
spec = ModelSpec.from_mapping({"kind": "lstm", "hidden": 4, "bptt": {"truncated": 2}})
case = lambda dtype: Case("x64", spec, True, 5, 6, 7, 3, dtype, seed=3)
b = backends.create("jax")
x64 = lambda: bool(jax.dtypes.canonicalize_dtype(np.float64) == np.float64)
print_["x64_before"] = x64()
c = case("float32")
b.prepare(c.problem(), initial_params(c))
print_["x64_after_float32"] = x64()
print_["float64"] = run_case(b, case("float64")).status
print_["x64_after_float64"] = x64()
print_["float32_after"] = run_case(b, case("float32")).status
c = case("float32")
b.prepare(c.problem(), initial_params(c))
x, y = make_data(c)
loss, grads = b.loss_and_grads(x, y)
b.sgd_step(x, y, 0.1)
print_["grad_dtypes"] = sorted({str(g.dtype) for g in grads.values()})
print_["param_dtypes"] = sorted({str(p.dtype) for p in b.get_params().values()})
print_["loss_shape"] = list(np.shape(b.sgd_step(x, y, 0.1)))  # a 0-d device scalar
print(json.dumps(print_))
"""


def test_float32_stays_float32_after_float64_in_one_process():
    # A fresh process with the worker's environment for a float32 cell: x64 starts off.
    env = dict(os.environ, **JaxBackend.environment_variables("default", 1, "cpu", "float32"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _X64_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "jax_imported_by_module": False,
        "x64_before": False,
        "x64_after_float32": False,
        "float64": "pass",
        "x64_after_float64": True,
        "float32_after": "pass",
        "grad_dtypes": ["float32"],
        "param_dtypes": ["float32"],
        "loss_shape": [],
    }


def test_environment_variables_and_versions():
    single = JaxBackend.environment_variables("default", 1, "cpu", "float64")
    assert single["JAX_ENABLE_X64"] == "1" and single["JAX_PLATFORMS"] == "cpu"
    assert "--xla_cpu_multi_thread_eigen=false" in single["XLA_FLAGS"]
    multi = JaxBackend.environment_variables("default", 2, "cpu", "float32")
    assert multi["JAX_ENABLE_X64"] == "0" and "XLA_FLAGS" not in multi
    assert "JAX_PLATFORMS" not in JaxBackend.environment_variables("default", 1, "gpu", "float32")
    v = JaxBackend().versions()
    assert v["jax"] and v["jaxlib"] and "XLA_FLAGS" in v


def test_availability_without_jax(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a))
    ok, why = JaxBackend().availability()
    assert not ok and why == "unavailable: jax not installed (pip install 'rnn-harness[jax]')"


def test_variants_and_registry():
    assert JaxBackend.variants[0] == "default"
    assert set(JaxBackend.variants) == {"default", "unroll=1", "unroll=4", "unroll=T", "python", "autotune"}
    assert backends.create("jax:unroll=T").full_name == "jax:unroll=T"
    assert JaxBackend().availability() == (True, "")


@pytest.mark.gpu
def test_gpu_quick_matrix():
    backend = backends.create("jax")
    ok, why = backend.device_availability("gpu")
    if not ok:
        pytest.skip(why)
    bad = [_explain(r) for r in (run_case(backend, c, device="gpu") for c in QUICK) if r.status != "pass"]
    assert not bad, bad
