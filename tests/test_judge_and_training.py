"""The conformance cases' labels follow from their fields; the one judging rule takes the worker's memo and
huge-page advice as callables; the training loop's stop reasons, rate and curve."""

from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import numpy as np

import backends
from harness.spec.status import Status, TrainStop
from harness.verify import judge
from harness.verify.check import (FIRST_CELLS, Case, all_cases, initial_params, make_data, representative_cases,
                                  with_loss_scale)
from harness.worker import protocol
from harness.worker.training import TrainingLoop


# -- cases: fields first, the label from them ----------------------------------------------------------

def test_labels_follow_from_the_fields():
    cases = all_cases()
    small = next(c for c in cases if c.cell == "lstm" and c.head == "mse" and c.bptt == "tail:3"
                 and not c.tokens and not c.model.bias and c.model.layers == 2)
    assert small.label == "lstm mse tail:3 dense B=3 nobias L=2"
    wildml = [c.label for c in cases if c.realistic and c.name == "wildml" and c.dtype == "float32"]
    assert wildml == ["realistic wildml 8000x100 T=20 truncated:4", "realistic wildml 8000x100 T=20 full"]
    bigru = next(c for c in cases if c.realistic and c.name == "gru-before-bi")
    assert bigru.label == "realistic gru-before-bi L=2 D=32 H=64 T=25 B=16" and bigru.cell is None
    assert with_loss_scale(small, 128.0).label == small.label + " scale=128"
    hand = Case("kink", small.model, False, 4, 4, 5, 2, "float32")
    assert hand.label == "kink" and hand.cell is None and replace(hand, loss_scale=2.0).label == "kink scale=2"


def test_every_case_is_named_once_per_dtype_and_the_quick_matrix_keeps_its_cells():
    for quick in (True, False):
        keys = [(c.label, c.dtype) for c in all_cases(quick)]
        assert len(keys) == len(set(keys))
    assert {c.cell for c in all_cases(quick=True) if c.cell in FIRST_CELLS} == set(FIRST_CELLS)
    assert not any(c.realistic for c in representative_cases())


# -- the judging rule ------------------------------------------------------------------------------------

def test_verify_step_reads_the_reference_through_keep_and_runs_the_backend_inside_backend_calls():
    case = next(c for c in all_cases(quick=True) if c.dtype == "float32" and not c.realistic)
    keys, inside = [], []

    def keep(compute, *key):
        keys.append(key[0])
        return compute()

    @contextmanager
    def calls():
        inside.append(True)
        yield

    for workload in ("train_step", "forward"):
        b = backends.create("numpy")
        b.prepare(case.problem(workload), initial_params(case), device="cpu", threads=1)
        x, y = make_data(case)
        verdict = judge.verify_step(case.problem(workload), b, x, y, 0.1, keep=keep, backend_calls=calls)
        assert verdict.ok and verdict.reply()["ok"] is True and verdict.ratio == verdict.ratios[verdict.worst]
    assert keys[0] == "step" and keys[-1] == "outputs" and inside == [True, True]


def test_a_non_finite_reference_fails_the_verdict_and_names_the_quantity_wherever_it_stands():
    start = {"W": np.ones((2, 2))}
    got = {"a": np.ones(3), "b": np.ones(3), "c": np.ones(3)}
    for bad in got:  # NaN's order with max depends on where it stands: every position must fail
        want = {k: np.ones(3) for k in got} | {bad: np.array([1.0, np.nan, 1.0])}
        verdict = judge.judge(judge.Tolerance.of("float64"), got, lambda params, precision: want, start, "float64")
        assert not verdict.ok and verdict.ratio == float("inf") and verdict.worst == f"{bad}: the reference is non-finite"


# -- the training loop -------------------------------------------------------------------------------------

class _Steps:
    """A backend whose step's loss is read from a list, and the data of ``n`` sequences."""

    def __init__(self, losses):
        self.losses, self.lrs = list(losses), []

    def sgd_step(self, x, y, lr):
        self.lrs.append(lr)
        return self.losses.pop(0)

    def sync(self):
        pass


def _loop(losses, evals, n=8, batch=2, **settings):
    backend, evals = _Steps(losses), list(evals)
    data = SimpleNamespace(n_sequences=n, batch=lambda rows: (rows, rows))
    base = dict(epochs=2, eval_every=4, target_loss=None, patience=1, time_budget_s=None, halve_lr_on_rise=False,
                seed=0)
    loop = TrainingLoop(backend, data, batch, lambda: evals.pop(0), 0.4, protocol.TrainSettings(**{**base, **settings}))
    return loop.run(), backend


def test_the_loop_runs_every_epoch_and_evaluates_every_eval_every_examples():
    reply, _ = _loop([1.0] * 8, [3.0, 2.9, 2.8, 2.7, 2.6])
    assert reply.stop == TrainStop.EPOCHS and reply.status == Status.OK and reply.examples == 16
    ev = [r for r in reply.curve if r["split"] == "eval"]
    assert [r["examples"] for r in ev] == [0, 4, 8, 12, 16] and [r["epoch"] for r in ev] == [0, 0, 0, 1, 1]
    assert len(reply.step_samples) == 8 and reply.final_lr == 0.4


def test_the_rate_halves_on_a_rising_evaluation_loss_and_the_target_stops_it():
    reply, backend = _loop([1.0] * 8, [3.0, 3.5, 2.0, 1.0, 1.0], halve_lr_on_rise=True, target_loss=2.0,
                           patience=2)
    assert reply.stop == TrainStop.TARGET and reply.examples == 12 and reply.time_to_target_s is not None
    assert backend.lrs == [0.4, 0.4, 0.2, 0.2, 0.2, 0.2] and reply.final_lr == 0.2


def test_a_target_met_at_the_start_stops_even_where_an_epoch_takes_no_step():
    reply, _ = _loop([], [1.0], n=1, batch=2, target_loss=2.0)
    assert reply.stop == TrainStop.TARGET and reply.examples == 0 and len(reply.curve) == 1


def test_a_non_finite_loss_is_diverged():
    reply, _ = _loop([1.0, float("nan")], [3.0])
    assert reply.status == Status.DIVERGED and reply.stop == "training loss became nan" and reply.examples == 2
    reply, _ = _loop([1.0] * 2, [3.0, float("inf")])
    assert reply.status == Status.DIVERGED and reply.stop == "evaluation loss became inf"
