"""pytest-benchmark timings of one SGD step of the NumPy backends.

Run with ``pytest benchmarks/test_bench_numpy.py``; compare variants only within
one run (the machine is shared and noisy), e.g. with ``--benchmark-group-by=group``.
"""

import numpy as np
import pytest

import backends
from harness import reference as ref
from harness.spec import ModelSpec, Problem

pytest.importorskip("pytest_benchmark")

LR = 0.005


def _prepared(name: str, model: dict, input_size: int, output_size: int, tokens: bool, T: int, B: int):
    spec = ModelSpec.from_mapping(model)
    problem = Problem(spec, input_size, output_size, tokens, "float32", B, T)
    params = ref.init_params(spec, input_size, output_size, seed=10, dtype="float32")
    rng = np.random.default_rng(0)
    x = rng.integers(0, input_size, size=(T, B)) if tokens else rng.normal(size=(T, B, input_size)).astype("float32")
    if spec.head == "softmax_xent":
        y = rng.integers(0, output_size, size=(T, B))
    else:
        y = (0.5 * rng.normal(size=(T, B, output_size))).astype("float32")
    backend = backends.create(name)
    ok, why = backend.supports(problem)
    assert ok, why
    backend.prepare(problem, params)
    backend.warm_up((x, y))
    return backend, x, y


@pytest.mark.benchmark(group="wildml vocab 8000 H 100 T 20 B 1 float32 truncated:4")
@pytest.mark.parametrize("name", ["numpy", "numpy:wildml"])
def test_sgd_step_wildml_shape(benchmark, name):
    model = {"kind": "elman", "hidden": 100, "bias": False, "bptt": {"truncated": 4}}
    backend, x, y = _prepared(name, model, 8000, 8000, True, 20, 1)
    loss = benchmark(backend.sgd_step, x, y, LR)
    assert 0 < loss < np.log(8000) + 0.1  # many steps on one sentence only lower it


@pytest.mark.benchmark(group="dense 512 H 512 T 50 B 32 float32")
@pytest.mark.parametrize(
    "model",
    [
        {"kind": "elman", "head": "softmax_xent"},
        {"kind": "elman", "head": "mse"},
        {"kind": "lstm", "head": "softmax_xent"},
    ],
    ids=["elman-softmax", "elman-mse", "lstm-softmax"],
)
def test_sgd_step_deepbench_shape(benchmark, model):
    backend, x, y = _prepared("numpy", {"hidden": 512, **model}, 512, 512, False, 50, 32)
    loss = benchmark(backend.sgd_step, x, y, LR)
    assert np.isfinite(loss)
