"""The verification bound (harness.spec.tolerance): correct float32 work passes where float32 itself moves
the answer (a ReLU's kink, a large batch), and deliberately wrong backends are still caught."""

from dataclasses import replace

import numpy as np
import pytest

from harness.worker import protocol
from harness.spec import reference as ref
from harness.verify.check import Case, all_cases, run_case
from harness.config import load_config
from harness.spec.model import ModelSpec
from harness.spec.tolerance import SPEC_TOLERANCES, Tolerance, compare
from harness.worker.worker import CellState, verify_step
from wrong_backends import WrongBackend

WRONG = ("scaled", "nobias", "window")
GRU_WRONG = ("gateorder", "nobhn", "resetform")
BIGBATCH = """
name: bigbatch
seed: 10
dtype: [float32, float64]
model: {kind: elman, hidden: 8, bias: false, bptt: full}
task: {kind: lm_markov, vocab: 20, seq_len: 5, n_sequences: 32, n_eval: 8}
workloads: [train_step]
batch: [64, 256, 1000]
threads: [1]
backends: [numpy]
timing: {warmup: 1, min_rounds: 3, min_time_s: 0.1, max_time_s: 0.5, timeout_s: 30}
"""


def _cell_state(cell) -> CellState:
    p = cell.problem
    return CellState(protocol.Init(cell.backend, p.to_mapping(), cell.task.to_mapping(), cell.seed,
                                   cell.train.lr))


def _spec_ratio_of_update(problem, params, x, y, lr, got_after) -> float:
    """What SPEC's float32 bound alone (the rule before the reference's own float32 error counted) says."""
    rtol, atol = SPEC_TOLERANCES[problem.dtype]
    before = ref.params_like(params, np.float64)
    _, want = ref.sgd_step(problem.model, before, x, y, lr)
    eps = float(np.finfo(problem.dtype).eps)
    return max(compare(k, np.asarray(got_after[k], np.float64) - before[k], want[k] - before[k], rtol, atol,
                       4 * eps * np.abs(before[k]))[0] for k in want)


# -- large batch: a token table updated one occurrence at a time ----------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_verifies_at_every_batch_up_to_1000(write_config, dtype):
    cells = [c for c in load_config(write_config(BIGBATCH)).cells() if c.problem.dtype == dtype]
    assert sorted(c.problem.batch for c in cells) == [64, 256, 1000]
    for cell in cells:
        state = _cell_state(cell)
        state.warmup(1)
        start = state.backend.get_params()
        result = state.verify()
        assert result["ok"], (cell.problem.batch, result)
        if dtype == "float32" and cell.problem.batch == 1000:
            # SPEC's bound alone rejects this correct step: the table's rows round once per occurrence
            assert _spec_ratio_of_update(cell.problem, start, state.x, state.y, state.lr, state.backend.get_params()) > 1
        if dtype == "float64":
            assert "ref32" not in result["bound"]  # float64 is judged by SPEC's bound alone


@pytest.mark.parametrize("variant", WRONG)
def test_wrong_backends_caught_at_batch_1000(write_config, variant):
    cell = next(c for c in load_config(write_config(BIGBATCH)).cells()
                if c.problem.dtype == "float32" and c.problem.batch == 1000)
    state = _cell_state(cell)
    backend = WrongBackend(variant)
    backend.prepare(cell.problem, ref.params_like(state.backend.get_params(), "float32"))
    result = verify_step(cell.problem, backend, state.x, state.y, state.lr)
    assert not result["ok"], result


# -- a ReLU's kink: pre-activations within float32 rounding of zero --------------------------------

def _kink_problem(bptt, seed, H=64, T=6, B=8):
    """A ReLU RNN whose first pre-activations sit within float32 rounding of zero for half the units
    of the first batch row: b_h cancels that row's first input projection in float64 for those units.
    Which side of the kink each unit takes is then float32 rounding's choice, as at DeepBench's
    shape (input = hidden = 1760), where it happens to one of 704,000 pre-activations after a warm-up step."""
    model = ModelSpec.from_mapping({"kind": "elman", "activation": "relu", "hidden": H, "head": "mse", "bptt": bptt})
    problem = Case("kink", model, False, H, H, T, B, "float32", seed=seed).problem()
    rng = np.random.default_rng(seed)
    params = ref.params_like(ref.init_params(model, H, H, seed), "float32")
    x = rng.normal(size=(T, B, H)).astype(np.float32)
    y = (0.5 * rng.normal(size=(T, B, H))).astype(np.float32)
    half = H // 2  # the other half keeps its bias: an error there cannot hide in the kink's allowance
    cancel = -(x[0, 0].astype(np.float64) @ params["W_xh"].astype(np.float64))
    params["b_h"][:half] = cancel[:half].astype(np.float32)
    return problem, params, x, y


def _step_verdict(backend, problem, params, x, y, lr=0.01):
    backend.prepare(problem, {k: v.copy() for k, v in params.items()})
    return verify_step(problem, backend, x, y, lr)


@pytest.mark.parametrize("bptt", ["full", {"truncated": 3}])
def test_kink_numpy_passes_and_wrong_backends_are_caught(bptt):
    import backends

    problem, params, x, y = _kink_problem(bptt, seed=0)
    numpy_backend = backends.create("numpy")
    numpy_backend.prepare(problem, {k: v.copy() for k, v in params.items()})
    numpy_backend.sgd_step(x, y, 0.01)
    # the kink is there: SPEC's bound alone rejects the correct step by orders of magnitude
    assert _spec_ratio_of_update(problem, params, x, y, 0.01, numpy_backend.get_params()) > 100
    verdict = _step_verdict(backends.create("numpy"), problem, params, x, y)
    assert verdict["ok"], verdict
    for variant in WRONG:
        for tensor in (("W_xh", "W_hh") if variant == "scaled" else (None,)):
            backend = WrongBackend(variant)
            if tensor:
                backend.scaled_tensor = tensor
            verdict = _step_verdict(backend, problem, params, x, y)
            assert not verdict["ok"] and verdict["ratio"] > 3, (variant, tensor, verdict)


def test_kink_forward_passes():
    import backends

    problem, params, x, y = _kink_problem("full", seed=1)
    problem = replace(problem, workload="forward")
    assert _step_verdict(backends.create("numpy"), problem, params, x, y)["ok"]


# -- ordinary shapes: the conformance check ----------------------------------------------------------

def _cases():
    picked = {}
    for c in all_cases():
        key = (c.cell, c.bptt, c.dtype)
        if c.model.bias and c.batch == 3 and key not in picked:
            picked[key] = c
    return [picked[k] for k in (("elman-tanh", "full", "float32"), ("elman-relu", "truncated:3", "float32"),
                                ("lstm", "full", "float64"), ("lstm-peephole", "truncated:3", "float32"),
                                ("gru", "full", "float32"), ("gru", "tail:3", "float64"),
                                ("gru-before", "truncated:3", "float32"), ("gru-before", "full", "float64"),
                                ("elman-tanh-bi", "full", "float32"), ("gru-bi", "full", "float64"),
                                ("gru-before-bi", "full", "float32"))]


def _wrong_variants(case):
    """Every error that the case's model can show: the GRU's own ones for a GRU (b_hn only where the model
    has it), a scaled reverse-direction tensor for a bidirectional one; no shorter window where the model
    asks for full BPTT of a bidirectional layer (there is no one-direction window to shorten)."""
    m = case.model
    out = [(v, None) for v in WRONG if not (v == "window" and m.bidirectional)]
    if m.bidirectional:
        out.append(("scaled", "W_hh_rev"))
    if m.kind == "gru":
        out += [(v, None) for v in GRU_WRONG if v != "nobhn" or "b_hn" in m.param_names()]
    return out


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c.label} {c.dtype}")
def test_conformance_catches_wrong_backends_at_ordinary_shapes(case):
    import backends

    assert run_case(backends.create("numpy"), case).status == "pass"
    for variant, tensor in _wrong_variants(case):
        backend = WrongBackend(variant)
        if tensor:
            backend.scaled_tensor = tensor
        res = run_case(backend, case)
        assert res.status == "fail", (variant, tensor, res)
        assert res.worst_ratio > 3, (variant, tensor, res)


def test_gru_errors_are_caught_at_the_realistic_shape():
    import backends

    for case in (c for c in all_cases(quick=True) if c.label.startswith("realistic gru")):
        assert run_case(backends.create("numpy"), case).status == "pass"
        for variant, tensor in _wrong_variants(case):
            backend = WrongBackend(variant)
            if tensor:
                backend.scaled_tensor = tensor
            backend.window_k = 4  # a window one step short of T = 25 is invisible: the GRU forgets over 23 steps
            res = run_case(backend, case)
            assert res.status == "fail" and res.worst_ratio > 3, (case.label, variant, tensor, res)


def test_conformance_catches_wrong_backends_at_the_kink(monkeypatch):
    """``harness check``'s path (loss, gradients, three steps) on a kink-prone case."""
    import backends

    import harness.verify.check as check

    problem, params, x, y = _kink_problem("full", seed=2)
    case = Case("kink", problem.model, False, problem.input_size, problem.output_size, problem.seq_len,
                problem.batch, "float32", seed=2)
    # the case's own data are random: make its first step kink-prone the same way

    def data(case_, step=0):
        return (x, y) if step == 0 else (x[::-1].copy(), y[::-1].copy())

    def init(case_):
        return {k: v.copy() for k, v in params.items()}

    monkeypatch.setattr(check, "make_data", data)
    monkeypatch.setattr(check, "initial_params", init)
    # at the check's lr (0.1) this ReLU network's loss rises from 10.6 to 14.7 in the three steps: a
    # diverging run spreads one unit's kink over every parameter, element by element, in an order of
    # its own for each correct float32 computation; at 0.01 the steps stay a training run
    monkeypatch.setattr(check, "LR", 0.01)
    assert run_case(backends.create("numpy"), case).status == "pass"
    for variant in WRONG:
        assert run_case(WrongBackend(variant), case).status == "fail", variant


# -- the rule itself ---------------------------------------------------------------------------------

def test_float64_is_judged_by_spec_alone_and_float32_asks_for_the_low_reference_only_when_needed():
    t64, t32 = Tolerance.of("float64"), Tolerance.of("float32")
    assert t64.sensitivity == 0 and t64.low_dtype is None and "ref32" not in t64.describe()
    calls = []

    def low():
        calls.append(1)
        return {"a": np.array([1.0, 2.0 + 1e-2])}

    want = np.array([1.0, 2.0])
    assert t32.judge({"a": (want * (1 + 1e-4), want)}, low=low)["a"] < 0.1
    assert not calls  # within SPEC's bound: no second reference run
    off = want + np.array([0.0, 1e-2])  # off by what float32 itself moves the answer by
    assert t32.judge({"a": (off, want)}, low=low)["a"] < 1 and calls
    assert t64.judge({"a": (off, want)}, low=low)["a"] > 1e3  # float64: no such allowance
    assert t32.judge({"a": (off * 1.01, want)}, low=low)["a"] > 1


# -- a group whose baseline did not verify --------------------------------------------------------

@pytest.mark.slow
def test_failed_baseline_speedups_are_over_the_fastest_verified_backend_and_say_so(fake_backends, write_config,
                                                                                  tmp_path, run_config):
    from harness.results.report import speedup_note, write_report

    text = """
name: failed-baseline
seed: 1
model: {kind: elman, hidden: 8}
task: {kind: random, vocab: 20, seq_len: 6, n_sequences: 16, n_eval: 8}
workloads: [train_step]
batch: [2]
backends: ['bad:wrong', ref, 'ref:slow']
baseline: 'bad:wrong'
timing: {warmup: 1, min_rounds: 4, min_time_s: 0.05, max_time_s: 1, timeout_s: 60}
"""
    run = run_config(write_config(text))
    t = run.timings.set_index(run.timings["backend"] + ":" + run.timings["variant"])
    assert t.loc["bad:wrong", "status"] == "mismatch" and np.isnan(t.loc["bad:wrong", "speedup"])
    assert (t["baseline_status"] == "mismatch").all()
    assert t.loc["ref:plain", "speedup_over"] == "ref" and t.loc["ref:slow", "speedup_over"] == "ref"
    assert t.loc["ref:plain", "speedup"] == pytest.approx(1.0) and t.loc["ref:slow", "speedup"] < 1
    note = speedup_note(run.timings)
    assert note == "baseline bad:wrong is mismatch: speedups are over ref, the fastest verified backend here"
    report = next(p for p in write_report(tmp_path / "run") if p.suffix == ".md").read_text()
    assert note in report


def test_a_verified_baseline_needs_no_note():
    import pandas as pd

    from harness.results.report import speedup_note

    rows = pd.DataFrame([{"baseline": "numpy", "baseline_status": "ok", "status": "ok", "speedup_over": "numpy"}])
    assert speedup_note(rows) == ""
    rows = pd.DataFrame([{"baseline": "numpy", "baseline_status": "error", "status": "error", "speedup_over": None}])
    assert speedup_note(rows) == "baseline numpy is error and no backend here ran ok: no speedups"


# -- a loss handed back as a device scalar -----------------------------------------------------------

class _DeviceScalar:
    """What an asynchronous backend may return from ``sgd_step``: ``float()`` converts it (waiting for the
    step), but NumPy cannot read it, as with a CUDA tensor."""

    def __init__(self, value):
        self.value = value

    def __float__(self):
        return float(self.value)

    def __array__(self, *args, **kwargs):
        raise TypeError("can't convert a device tensor to numpy")


def test_a_loss_returned_as_a_device_scalar_is_verified_and_checked():
    import backends
    from harness.verify.check import all_cases, run_case

    class DeviceLoss(type(backends.create("numpy"))):
        def sgd_step(self, x, y, lr):
            return _DeviceScalar(super().sgd_step(x, y, lr))

    problem, params, x, y = _kink_problem("full", seed=1)
    assert _step_verdict(DeviceLoss(), problem, params, x, y)["ok"]
    case = next(c for c in all_cases(quick=True) if c.dtype == "float32")
    result = run_case(DeviceLoss(), case)
    assert result.status == "pass", (result.reason, result.details)
