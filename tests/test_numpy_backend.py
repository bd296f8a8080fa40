"""The NumPy backends against the reference: the conformance matrix, what each refuses, and no per-call buffers."""

import tracemalloc

import numpy as np
import pytest

import backends
from harness.spec import reference as ref
from harness.verify.check import Case, all_cases, make_data, initial_params, run_case
from harness.spec.model import ModelSpec, Problem

CASES = all_cases()


def _failures(results):
    return [f"{r.case} [{r.dtype}]: {r.status} {r.reason}" for r in results if r.status not in ("pass", "unsupported")]


def test_fast_passes_the_whole_conformance_matrix():
    backend = backends.create("numpy")
    results = [run_case(backend, case) for case in CASES]
    assert not _failures(results), "\n".join(_failures(results))
    assert all(r.status == "pass" for r in results), [r.reason for r in results if r.status != "pass"][:3]


def test_wildml_passes_every_case_it_supports():
    backend = backends.create("numpy:wildml")
    results = [run_case(backend, case) for case in CASES]
    assert not _failures(results), "\n".join(_failures(results))
    passed = {r.case for r in results if r.status == "pass"}
    # the tutorial's own model: batch 1, tokens, tanh, softmax, full and truncated, with and without bias
    assert "realistic wildml 8000x100 T=20 truncated:4" in passed
    assert "realistic wildml 8000x100 T=20 full" in passed
    assert any("B=1" in c and "truncated:3" in c for c in passed)
    assert any("nobias" in c for c in passed) and any("B=1" in c and "nobias" not in c for c in passed)


def _narrow(model: dict, tokens: bool, dtype: str, seed: int) -> Case:
    """Few rows (T*B) and a wider hidden layer, so the output layer's gradient is kept transposed."""
    spec = ModelSpec.from_mapping({"hidden": 16, **model})
    return Case(f"narrow {spec.describe()} {'tokens' if tokens else 'dense'}", spec, tokens, 7, 9, 5, 2, dtype, seed)


NARROW = [
    ({"kind": "elman", "bptt": {"tail": 2}}, True),
    ({"kind": "elman", "activation": "relu", "bptt": {"truncated": 2}, "layers": 2, "clip": 0.05}, True),
    ({"kind": "lstm", "peephole": True, "head": "mse", "output_act": "tanh", "bptt": {"tail": 3}, "layers": 2}, False),
    ({"kind": "lstm", "bias": False, "bptt": {"truncated": 1}, "layers": 2}, True),
    ({"kind": "elman", "activation": "sigmoid", "head": "mse", "bptt": "full"}, False),
    ({"kind": "gru", "bptt": {"truncated": 2}, "layers": 2, "clip": 0.05}, True),
    ({"kind": "gru", "reset_after": False, "head": "mse", "bptt": {"tail": 3}}, False),
    ({"kind": "gru", "bidirectional": True, "layers": 2}, True),
]


def _narrow_id(value) -> str:
    if isinstance(value, bool):
        return "tokens" if value else "dense"
    return ModelSpec.from_mapping({"hidden": 16, **value}).describe()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("model,tokens", NARROW, ids=_narrow_id)
def test_fast_with_few_rows_and_a_wide_hidden_layer(model, tokens, dtype):
    case = _narrow(model, tokens, dtype, seed=len(str(model)))
    res = run_case(backends.create("numpy"), case)
    assert res.status == "pass", (res.reason, res.details)


@pytest.mark.parametrize(
    "change,why",
    [
        ({"batch": 3}, "batch 1 only"),
        ({"model": ModelSpec.from_mapping({"kind": "lstm"})}, "lstm"),
        ({"tokens": False}, "dense"),
        ({"model": ModelSpec.from_mapping({"bptt": {"tail": 3}})}, "tail"),
        ({"model": ModelSpec.from_mapping({"head": "mse"})}, "mse"),
        ({"model": ModelSpec.from_mapping({"layers": 2})}, "layers 2"),
        ({"model": ModelSpec.from_mapping({"activation": "relu"})}, "relu"),
        ({"model": ModelSpec.from_mapping({"kind": "gru"})}, "gru"),
        ({"model": ModelSpec.from_mapping({"bidirectional": True})}, "one-direction"),
    ],
)
def test_wildml_refuses_what_the_tutorial_does_not_do(change, why):
    base = dict(model=ModelSpec.from_mapping({}), input_size=50, output_size=50, tokens=True, batch=1)
    problem = Problem(**{**base, **change})
    ok, reason = backends.create("numpy:wildml").supports(problem)
    assert not ok and reason.startswith("unsupported: numpy:wildml") and why in reason, reason
    assert backends.create("numpy").supports(problem) == (True, "")
    assert backends.create("numpy:wildml").supports(Problem(**base)) == (True, "")


def test_both_refuse_the_gpu():
    problem = Problem(ModelSpec.from_mapping({}), 50, 50, True, batch=1, device="gpu")
    for name in ("numpy", "numpy:wildml"):
        ok, reason = backends.create(name).supports(problem)
        assert not ok and "CPU only" in reason


def test_fast_keeps_the_problem_dtype():
    case = Case("f32", ModelSpec.from_mapping({"kind": "lstm", "hidden": 8, "head": "mse", "peephole": True}),
                False, 5, 6, 7, 3, "float32")
    backend = backends.create("numpy")
    backend.prepare(case.problem(), initial_params(case))
    x, y = make_data(case)
    loss, grads = backend.loss_and_grads(x, y)
    backend.sgd_step(x, y, 0.1)
    assert all(g.dtype == np.float32 for g in grads.values())
    assert all(p.dtype == np.float32 for p in backend.get_params().values())
    assert backend.forward(x).dtype == np.float32
    assert np.isfinite(loss)


# -- allocation: the fast step reuses its buffers, so what it allocates does not grow with T ---------------

ALLOC_MODELS = [
    ({"kind": "elman", "bias": False, "bptt": {"truncated": 4}}, True),
    ({"kind": "lstm", "peephole": True, "head": "mse", "bptt": "full", "layers": 2}, False),
    ({"kind": "gru", "bptt": {"truncated": 4}, "layers": 2}, True),
    ({"kind": "gru", "reset_after": False, "head": "mse", "bptt": "full"}, False),
]
B_ALLOC, H_ALLOC = 8, 128  # T*B*H > numpy's ufunc buffer (8192 items) already at T = 10


def _peak_bytes(step) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        step()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _alloc_setup(model, tokens, T):
    spec = ModelSpec.from_mapping({"hidden": H_ALLOC, **model})
    case = Case("alloc", spec, tokens, 8, 8, T, B_ALLOC, "float64")
    params = initial_params(case)
    return spec, case, params, make_data(case)


@pytest.mark.parametrize("model,tokens", ALLOC_MODELS, ids=["elman-truncated-tokens", "lstm-peephole-mse-L2",
                                                            "gru-truncated-tokens-L2", "gru-before-mse"])
def test_fast_step_allocates_nothing_that_grows_with_sequence_length(model, tokens):
    peaks, ref_peaks = {}, {}
    for T in (10, 50):
        spec, case, params, (x, y) = _alloc_setup(model, tokens, T)
        backend = backends.create("numpy")
        backend.prepare(case.problem(), params)
        backend.warm_up((x, y))
        backend.sgd_step(x, y, 0.01)
        peaks[T] = _peak_bytes(lambda: backend.sgd_step(x, y, 0.01))
        p = ref.params_like(params, np.float64)
        ref_peaks[T] = _peak_bytes(lambda: ref.sgd_step(spec, p, x, y, 0.01))
    one_buffer = 50 * B_ALLOC * H_ALLOC * 8  # a single (T, B, H) float64 array at T = 50
    # the measurement sees numpy's allocations: the reference's per-call arrays grow with T
    assert ref_peaks[50] > ref_peaks[10] + 2 * one_buffer, ref_peaks
    # what remains is numpy's own per-call iterator buffers (at most bufsize items per operand)
    assert peaks[50] < 4 * np.getbufsize() * 8 + 16384 < one_buffer, peaks
    assert peaks[50] < peaks[10] + one_buffer / 20, peaks
