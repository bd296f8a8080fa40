"""The Halide backends against the reference: the conformance cases, what they refuse, threads and the AOT cache."""

import importlib.util

import numpy as np
import pytest

pytest.importorskip("halide")

import backends  # noqa: E402
from harness.spec import reference as ref  # noqa: E402
from harness.verify.check import TOLERANCES, Case, all_cases, compare, initial_params, make_data, run_case  # noqa: E402
from harness.spec.model import ModelSpec, Problem  # noqa: E402


def _jit(name: str):
    """A backend that compiles in process only, so tests leave no modules on disk."""
    backend = backends.create(name)
    backend.aot = False
    return backend


def _failures(results):
    return [f"{r.case} [{r.dtype}]: {r.status} {r.reason}" for r in results if r.status not in ("pass", "unsupported")]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["halide", "halide:naive"])
def test_passes_every_quick_case_it_supports(name):
    results = [run_case(_jit(name), case) for case in all_cases(quick=True)]
    assert not _failures(results), "\n".join(_failures(results))
    passed = {(r.case, r.dtype) for r in results if r.status == "pass"}
    # the elman cell with every head, tokens and dense input, both dtypes, and the WildML shape
    assert {"softmax", "mse", "mse-tanh"} <= {case.split()[1] for case, _ in passed}
    assert any("tokens" in c for c, _ in passed) and any("dense" in c for c, _ in passed)
    assert {"float32", "float64"} <= {d for _, d in passed}
    assert ("realistic wildml 8000x100 T=20 full", "float32") in passed
    refused = [r for r in results if r.status == "unsupported"]
    assert refused and all(r.reason.startswith("unsupported: ") for r in refused)


@pytest.mark.parametrize(
    "model,why",
    [
        ({"kind": "lstm"}, "elman cell only, not lstm"),
        ({"kind": "lstm", "peephole": True}, "elman cell only"),
        ({"bptt": {"truncated": 3}}, "bptt full only, not truncated:3"),
        ({"bptt": {"tail": 3}}, "bptt full only, not tail:3"),
    ],
)
def test_refuses_what_it_does_not_implement(model, why):
    problem = Problem(ModelSpec.from_mapping({"hidden": 8, **model}), 5, 6, False, "float32", 3, 7)
    for name in ("halide", "halide:naive"):
        ok, reason = backends.create(name).supports(problem)
        assert not ok and reason.startswith("unsupported: ") and why in reason, reason


def test_refuses_the_gpu_and_accepts_the_elman_options():
    base = dict(input_size=5, output_size=6, tokens=True, batch=3, seq_len=7)
    gpu = Problem(ModelSpec.from_mapping({}), device="gpu", **base)
    assert backends.create("halide").supports(gpu)[1].startswith("unsupported: halide runs on the CPU only")
    for model in ({"activation": "relu", "layers": 3, "clip": 1.0}, {"head": "mse", "output_act": "tanh", "bias": False}):
        for dtype in ("float32", "float64"):
            assert backends.create("halide:naive").supports(Problem(ModelSpec.from_mapping(model), dtype=dtype, **base)) == (True, "")


def test_names_and_availability(monkeypatch):
    assert backends.create("halide").full_name == "halide"
    assert backends.create("halide:scheduled").full_name == "halide"
    assert backends.create("halide:naive").full_name == "halide:naive"
    assert backends.create("halide").availability() == (True, "")
    assert backends.create("halide").environment_variables("scheduled", 2, "cpu", "float32") == {"HL_NUM_THREADS": "2"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    ok, why = backends.create("halide").availability()
    assert not ok and why.startswith("unavailable: halide not installed")


def _against_reference(backend, case: Case, threads: int) -> dict[str, float]:
    """Worst ratio to SPEC.md's bound of outputs, gradients and parameters after 3 steps, at ``threads``."""
    rtol, atol = TOLERANCES[case.dtype]
    params = initial_params(case)
    want_params = ref.params_like(params, np.float64)
    x, y = make_data(case)
    backend.prepare(case.problem("train", "cpu"), params, threads=threads)
    backend.warm_up((x, y))
    ratios = {"outputs": compare("outputs", backend.forward(x), ref.outputs(case.model, want_params, x), rtol, atol)[0]}
    loss, grads = backend.loss_and_grads(x, y)
    want_loss, want_grads = ref.loss_and_grads(case.model, want_params, x, y)
    ratios["loss"] = compare("loss", loss, want_loss, rtol, atol)[0]
    ratios.update({f"d{k}": compare(k, grads[k], g, rtol, atol)[0] for k, g in want_grads.items()})
    for step in range(3):
        xs, ys = make_data(case, step)
        backend.sgd_step(xs, ys, 0.1)
        _, want_params = ref.sgd_step(case.model, want_params, xs, ys, 0.1)
    got = backend.get_params()
    ratios.update({f"{k} after 3 steps": compare(k, got[k], v, rtol, atol)[0] for k, v in want_params.items()})
    return ratios


def test_parallel_schedule_with_partial_tiles_matches_the_reference():
    # batch 5 leaves a partial tile of the recurrence; hidden 12 a partial vector tile;
    # two layers with clipping cover the stacked backward pass and the clipped update
    spec = ModelSpec.from_mapping({"hidden": 12, "activation": "sigmoid", "layers": 2, "clip": 0.05,
                                   "head": "mse", "output_act": "tanh"})
    case = Case("parallel", spec, True, 9, 10, 6, 5, "float32", seed=7)
    ratios = _against_reference(_jit("halide"), case, threads=2)
    assert max(ratios.values()) <= 1.0, ratios


def test_ahead_of_time_module_is_built_once_then_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_HOME", str(tmp_path))
    spec = ModelSpec.from_mapping({"hidden": 6, "head": "softmax_xent", "bias": False})
    case = Case("aot", spec, True, 7, 8, 5, 2, "float64", seed=3)
    first, second = backends.create("halide:naive"), backends.create("halide:naive")
    r1 = _against_reference(first, case, threads=1)
    built = sorted(p.name for p in (tmp_path / "cache" / "halide").glob("*.so"))
    r2 = _against_reference(second, case, threads=1)
    if first._pipes.how["train"] == "jit":
        pytest.skip("no C++ compiler or Python headers here: the backend fell back to the JIT")
    assert first._pipes.how == {"train": "aot-build", "forward": "aot-build"}
    assert second._pipes.how == {"train": "aot-load", "forward": "aot-load"}
    assert len(built) == 2 and sorted(p.name for p in (tmp_path / "cache" / "halide").glob("*.so")) == built
    assert max(r1.values()) <= 1.0 and r1 == r2, (r1, r2)


def test_token_ids_are_range_checked():
    spec = ModelSpec.from_mapping({"hidden": 4})
    backend = _jit("halide")
    backend.prepare(Problem(spec, 5, 6, True, "float32", 2, 3, workload="forward"), ref.init_params(spec, 5, 6, 0, "float32"))
    with pytest.raises(IndexError, match=r"token ids must lie in \[0, 5\)"):
        backend.forward(np.full((3, 2), 5))
    with pytest.raises(IndexError, match="class ids"):
        backend.loss_and_grads(np.zeros((3, 2), int), np.full((3, 2), -1))
