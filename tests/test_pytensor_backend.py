"""PyTensor with each linker against the reference, and the BLAS shim its C code links."""

import ctypes
import importlib.util
import sys

import numpy as np
import pytest

if importlib.util.find_spec("pytensor") is None:  # not importorskip: the backend sets its flags before importing
    pytest.skip("pytensor is not installed", allow_module_level=True)

import backends  # noqa: E402
from backends import blas  # noqa: E402
from harness.spec.model import REDUCED_DTYPES  # noqa: E402
from harness.verify.check import all_cases, run_case  # noqa: E402
from test_theano_backend import scan_graph_ci_cases  # noqa: E402


def test_blas_shim_forwards_to_openblas(tmp_path):
    info = blas.build_shim(tmp_path, [p for p in sys.path if p.endswith("site-packages")])
    if not info["ldflags"]:
        pytest.skip(info["reason"])
    assert info["ldflags"] == f"-L{tmp_path} -l{blas.SHIM_NAME}"
    lib = ctypes.CDLL(str(tmp_path / f"lib{blas.SHIM_NAME}.so"))
    rng = np.random.default_rng(0)
    for dtype, routine in ((np.float32, lib.sgemm_), (np.float64, lib.dgemm_)):
        a, b = rng.normal(size=(3, 5)).astype(dtype), rng.normal(size=(5, 4)).astype(dtype)
        c = np.zeros((3, 4), dtype)
        ct = ctypes.c_float if dtype == np.float32 else ctypes.c_double
        i = lambda v: ctypes.byref(ctypes.c_int(v))  # noqa: E731
        ptr = lambda arr: arr.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        # column-major C^T = B^T A^T is row-major C = A B
        routine(b"N", b"N", i(4), i(3), i(5), ctypes.byref(ct(1)), ptr(b), i(4), ptr(a), i(5),
                ctypes.byref(ct(0)), ptr(c), i(4))
        np.testing.assert_allclose(c, a @ b, rtol=1e-5)


def test_blas_choice_is_looked_up_by_thread_count_and_described_unambiguously():
    choice = {"by_threads": {
        "1": {"choice": "openblas", "ldflags": "-lx", "median_ms": {"numpy": 7.8, "openblas": 5.3}},
        "2": {"choice": "numpy", "ldflags": "", "median_ms": {"numpy": 30.0, "openblas": 108.0}},
    }}
    assert blas.choice_for(choice, threads=1)["choice"] == "openblas"
    assert blas.choice_for(choice, threads=2)["choice"] == "numpy"
    assert blas.choice_for(choice, threads=8)["choice"] == "numpy"  # the largest count measured below it
    assert blas.choice_for(None, threads=1) == {"choice": "numpy", "ldflags": ""}
    assert blas.describe(choice) == (
        "1 thread(s): openblas (OpenBLAS 5.3 ms, numpy's BLAS 7.8 ms per step); "
        "2 thread(s): numpy (OpenBLAS 108.0 ms, numpy's BLAS 30.0 ms per step)")


@pytest.mark.parametrize("variant", ["c", "numba", "jax"])
def test_every_case_is_supported_on_the_cpu(variant):
    backend = backends.create(f"pytensor:{variant}")
    cases = all_cases()
    assert any(c.model.kind == "gru" for c in cases) and any(c.model.bidirectional for c in cases)
    for case in cases:
        if case.dtype in REDUCED_DTYPES:  # mixed precision is refused, with the reason
            ok, why = backend.supports(case.problem())
            assert not ok and why.startswith("unsupported:"), case.label
            continue
        assert backend.supports(case.problem()) == (True, ""), case.label
    assert not backend.supports(cases[0].problem(device="gpu"))[0]


def _conformance(full_name: str, cases):
    backend = backends.create(full_name)
    ok, why = backend.availability()
    if not ok:
        pytest.skip(why)
    results = [run_case(backend, case) for case in cases]
    broken = [f"{r.status} {r.case} [{r.dtype}]: {r.reason}" for r in results if r.status != "pass"]
    assert not broken, "\n".join(broken)
    return results


def test_one_graph_through_the_jax_linker():
    """A plain `pytest` builds one PyTensor graph (the JAX linker's compile takes seconds; the C linker's first
    compile, of PyTensor's own modules and the scan graph, minutes cold): the graph code the C and Numba
    linkers share. The representative cases of every linker: ``-m heavy``."""
    pytest.importorskip("jax")
    _conformance("pytensor:jax", scan_graph_ci_cases()[:1])


@pytest.mark.heavy  # a scan graph compiled cold per case and linker (the C linker's first: minutes)
@pytest.mark.parametrize("variant", ["c", "numba", "jax"])
def test_representative_conformance(variant):
    if variant != "c":
        pytest.importorskip(variant)
    cases = scan_graph_ci_cases()
    assert any(c.model.bptt.mode == "truncated" for c in cases)
    assert any(c.model.kind == "gru" for c in cases) and any(c.model.bidirectional for c in cases)
    # the Numba linker compiles each graph for ~80 s cold (the truncated graph, with its windows'
    # scan, several minutes): CI checks one small graph, `harness check` the rest; the truncated
    # graph's code is the one the C and JAX linkers run here
    if variant == "numba":
        cases = cases[:1]
    _conformance(f"pytensor:{variant}", cases)


@pytest.mark.fullmatrix
@pytest.mark.parametrize("variant", ["c", "numba", "jax"])
def test_quick_conformance(variant):
    if variant != "c":
        pytest.importorskip(variant)
    results = _conformance(f"pytensor:{variant}", [c for c in all_cases(quick=True) if c.dtype in ("float32", "float64")])
    assert any(r.case.startswith("gru-before") for r in results) and any("-bi " in r.case for r in results)


def test_jax_linker_runs_xla_on_the_threads_asked_for():
    from backends.jax_backend import SINGLE_THREAD_XLA_FLAGS
    from backends.pytensor_backend import PytensorBackend

    one = PytensorBackend.environment_variables("jax", 1, "cpu", "float32")
    assert one["XLA_FLAGS"] == SINGLE_THREAD_XLA_FLAGS and one["JAX_PLATFORMS"] == "cpu"
    assert "XLA_FLAGS" not in PytensorBackend.environment_variables("jax", 2, "cpu", "float32")
    assert "XLA_FLAGS" not in PytensorBackend.environment_variables("c", 1, "cpu", "float32")
