"""The PyTorch backend against the reference: every conformance case each variant supports."""

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import backends  # noqa: E402
from harness.spec import reference as ref  # noqa: E402
from harness.verify.check import all_cases, initial_params, make_data, run_case  # noqa: E402
from harness.spec.model import REDUCED_DTYPES, ModelSpec, Problem  # noqa: E402

CASES = all_cases()
QUICK = all_cases(quick=True)
# torch.compile costs seconds per graph: a few cases that cover dense and token input,
# elman, lstm and both GRU forms, tail and truncated windows, two layers, a bidirectional layer, and the WildML shape
COMPILE_CASES = [c for c in CASES if (c.label, c.dtype) in {
    ("elman-tanh mse-tanh tail:3 dense B=3 nobias L=2", "float32"),
    ("lstm mse-tanh truncated:3 tokens B=3 nobias", "float32"),
    ("gru mse tail:3 dense B=3 nobias L=2", "float32"),
    ("gru-before-bi softmax full tokens B=3", "float64"),
    ("realistic wildml 8000x100 T=20 full", "float32"),
}]


def _id(case):
    return f"{case.label} {case.dtype}"


def _assert_passes(name, case, device="cpu"):
    res = run_case(backends.create(name), case, device)
    assert res.status in ("pass", "unsupported"), f"{res.status}: {res.reason}\n{res.details.get('traceback', '')}"
    return res


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_autograd_matches_reference(case):
    res = _assert_passes("torch:autograd", case)
    # mixed precision runs on a GPU only (tests/test_mixed_precision.py runs it with the product emulated)
    assert res.status == "pass" or case.dtype in REDUCED_DTYPES, "torch:autograd implements the whole spec"
    if case.dtype in REDUCED_DTYPES:
        assert res.status == "unsupported" and "on the CPU" in res.reason, res.reason


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_matches_reference_where_supported(case):
    _assert_passes("torch:fused", case)


def test_fused_covers_what_the_modules_express():
    fused = backends.create("torch:fused")
    supported = [c for c in CASES if fused.supports(c.problem())[0]]
    assert len(supported) >= len(CASES) // 3
    kinds = {(c.model.kind, c.model.bptt.mode, c.tokens, c.model.layers) for c in supported}
    assert ("lstm", "tail", True, 2) in kinds and ("elman", "full", False, 1) in kinds
    assert {("lstm", "truncated", True, 1), ("elman", "truncated", False, 1)} <= kinds
    assert any(k[1] == "truncated" and k[3] == 2 for k in kinds)
    assert {("gru", "truncated", True, 1), ("gru", "tail", False, 1)} <= kinds
    bidirectional = {(c.model.kind, c.tokens) for c in supported if c.model.bidirectional}
    assert {"elman", "lstm", "gru"} == {k for k, _ in bidirectional} and {True, False} == {t for _, t in bidirectional}


@pytest.mark.parametrize(
    "model, words",
    [
        ({"kind": "lstm", "peephole": True}, "peephole"),
        ({"kind": "elman", "activation": "sigmoid"}, "tanh and relu"),
        ({"kind": "gru", "reset_after": False}, "reset-after form only"),
    ],
)
def test_fused_says_unsupported_with_reason(model, words):
    spec = ModelSpec.from_mapping({"hidden": 4, **model})
    ok, why = backends.create("torch:fused").supports(Problem(spec, 5, 6, False))
    assert not ok and why.startswith("unsupported: ") and words in why
    assert backends.create("torch:autograd").supports(Problem(spec, 5, 6, False)) == (True, "")


@pytest.mark.parametrize("name", ["torch:autograd", "torch:fused"])
def test_truncated_and_tail_gradients_differ_and_follow_the_reference(name):
    """Both stop-gradient formulations give the reference's (distinct) gradients on a longer sequence
    (for truncated: more windows than steps per window, two layers)."""
    case = next(c for c in CASES if c.label.startswith("lstm softmax truncated:3 tokens B=3") and c.dtype == "float64")
    got = {}
    for bptt in ({"truncated": 2}, {"tail": 4}):
        spec = ModelSpec.from_mapping({**case.model.to_mapping(), "bptt": bptt, "layers": 2})
        params = ref.init_params(spec, case.input_size, case.output_size, seed=4)
        rng = np.random.default_rng(5)
        x = rng.integers(0, case.input_size, size=(12, 2))
        y = rng.integers(0, case.output_size, size=(12, 2))
        be = backends.create(name)
        be.prepare(Problem(spec, case.input_size, case.output_size, True, "float64", 2, 12), params)
        loss, grads = be.loss_and_grads(x, y)
        want_loss, want = ref.loss_and_grads(spec, params, x, y)
        assert loss == pytest.approx(want_loss, rel=1e-12)
        for k in want:
            np.testing.assert_allclose(grads[k], want[k], rtol=1e-9, atol=1e-12, err_msg=f"{bptt} {k}")
        got[str(bptt)] = grads
    a, b = got.values()
    assert max(np.abs(a[k] - b[k]).max() for k in a) > 1e-3


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_fused_keeps_spec_names_and_layouts(kind):
    case = next(c for c in CASES if c.model.kind == kind and c.model.layers == 2 and c.model.bias and not c.tokens
                and not c.model.peephole and c.model.bptt.mode == "full" and c.model.bidirectional == (kind == "gru"))
    params = initial_params(case)
    be = backends.create("torch:fused")
    be.prepare(case.problem(), params)
    got = be.get_params()
    assert list(got) == case.model.param_names()
    for k, v in params.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    x, y = make_data(case)
    _, grads = be.loss_and_grads(x, y)
    assert {k: g.shape for k, g in grads.items()} == {k: v.shape for k, v in params.items()}
    if kind == "gru":  # b_hn is the last third of nn.GRU's bias_hh; its first two thirds stay zero
        be.sgd_step(x, y, 0.1)
        bias_hh = be._net.mod.bias_hh_l1_reverse.detach().numpy()
        assert not bias_hh[: 2 * case.model.hidden].any()
        np.testing.assert_array_equal(bias_hh[2 * case.model.hidden:], be.get_params()["b_hn_1_rev"])


def test_compile_cases_exist():
    assert len(COMPILE_CASES) == 5 and sum((c.label, c.dtype) == COMPILE_DEFAULT for c in COMPILE_CASES) == 1


# torch.compile takes seconds per graph: a plain `pytest` compiles the bidirectional GRU, `-m heavy` the others
COMPILE_DEFAULT = ("gru-before-bi softmax full tokens B=3", "float64")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("case", [c if (c.label, c.dtype) == COMPILE_DEFAULT else pytest.param(c, marks=pytest.mark.heavy)
                                  for c in COMPILE_CASES], ids=_id)
def test_compile_matches_reference(case):
    res = _assert_passes("torch:compile", case)
    assert res.status == "pass"


@pytest.mark.heavy
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype", REDUCED_DTYPES)
def test_compile_traces_the_mixed_precision_product(dtype, monkeypatch):
    """torch.compile takes the low-precision product (an autograd function) into its one-step graphs, forward
    and backward: the compiled step lands on the spec's roundings as the eager one does (product emulated)."""
    from backends import low_precision
    from harness.spec.tolerance import ROUNDED

    monkeypatch.setattr(low_precision, "EMULATE_ON_CPU", True)
    case = next(c for c in CASES if c.dtype == dtype and c.model.kind == "gru" and c.model.bptt.mode == "truncated")
    res = _assert_passes("torch:compile", case)
    assert res.status == "pass" and res.worst_ratio < 0.5 and res.details["ratios"][ROUNDED] < 0.05, res.details


def test_only_compile_is_compile_heavy():
    assert backends.create("torch:compile").compile_heavy
    assert not backends.create("torch:autograd").compile_heavy
    assert not backends.create("torch:fused").compile_heavy


def test_unavailable_without_torch(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    ok, why = backends.create("torch").availability()
    assert not ok and why.startswith("unavailable: torch not installed")


def test_gpu_reports_missing_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = backends.create("torch:fused").device_availability("gpu")
    assert (ok, why) == (False, "unavailable: no CUDA device (torch.cuda.is_available() is False)")
    assert backends.create("torch:fused").device_availability("cpu") == (True, "")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch:autograd", "torch:compile"])
def test_gpu_mixed_precision_matches_reference(name):
    """On a GPU the spec's product is cuBLAS's (aten::mm.dtype): the quick matrix's mixed-precision cases and
    the realistic ones pass, landing on the spec's roundings (compile: two cases, seconds per graph)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from harness.spec.tolerance import ROUNDED

    cases = [c for c in QUICK + [c for c in CASES if c.label.startswith("realistic")] if c.dtype in REDUCED_DTYPES]
    for case in cases if name != "torch:compile" else cases[:2]:
        res = _assert_passes(name, case, device="gpu")
        assert res.status == "pass" and res.details["ratios"][ROUNDED] < 0.05, (case.label, case.dtype, res.details)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch:autograd", "torch:fused", "torch:compile"])
def test_gpu_matches_reference(name):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cases = QUICK if name != "torch:compile" else COMPILE_CASES
    statuses = [_assert_passes(name, case, device="gpu").status for case in cases]
    assert "pass" in statuses
