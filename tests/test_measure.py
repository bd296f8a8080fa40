"""The one timing policy: clock loop, calibration, stop rule; and the one screening of a cell."""

import pytest

from harness.spec import timing
from harness.worker import measure
from harness.run import stats
from harness.config import TimingConfig


def test_rounds_sync_before_every_clock_read_and_report_seconds_per_call(monkeypatch):
    events, now = [], [0]

    def call():  # 2 ms on the test's clock (nanoseconds), whatever the machine's own takes
        events.append("call")
        now[0] += 2_000_000

    monkeypatch.setattr(measure, "_clock", lambda: now[0])
    samples = measure.time_rounds(call, lambda: events.append("sync"),
                                  n_rounds=2, inner=3, after_round=lambda: events.append("check"))
    assert samples == pytest.approx([0.002, 0.002])
    assert events == (["sync"] + ["call"] * 3 + ["sync", "check"]) * 2


def test_interleaved_rounds_alternate_the_order():
    order = []
    out = measure.time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, n_rounds=4)
    assert order == ["a", "b", "b", "a", "b", "a", "a", "b"] and [len(v) for v in out.values()] == [4, 4]


def test_the_round_order_varies_every_round_and_balances_places():
    """Every contender takes every place equally often and precedes each other one as often as it
    follows it: with three, the six rounds of a cycle are the six orders."""
    rounds = [measure.round_order(list("abc"), r) for r in range(6)]
    assert len({tuple(o) for o in rounds}) == 6
    for k in "abc":
        assert sorted(o.index(k) for o in rounds) == [0, 0, 1, 1, 2, 2]
    five = [measure.round_order(list("abcde"), r) for r in range(10)]
    assert all(sorted(o.index(k) for o in five) == sorted(list(range(5)) * 2) for k in "abcde")
    assert all(five[r] != five[r + 1] for r in range(9))


def test_calibration_aims_at_the_round_length_within_its_cap():
    assert measure.calibrate(0.001, 0.05) == 50
    assert measure.calibrate(1.0, 0.05) == 1
    assert measure.calibrate(0.0, 0.05) == measure.MAX_INNER == 10_000


def test_policy_comes_from_the_config_and_owns_no_defaults():
    cfg = TimingConfig(min_rounds=4, min_time_s=0.4)
    policy = cfg
    assert policy.warmup == cfg.warmup and policy.timeout_s == cfg.timeout_s
    assert policy.target_round_s == pytest.approx(0.1)
    assert TimingConfig(round_s=0.02, min_rounds=3).target_round_s == 0.02
    assert TimingConfig(min_time_s=0.0).target_round_s == timing.MIN_ROUND_S


def test_default_stop_rule_needs_rounds_and_time_or_hits_the_cap():
    rule = stats.stop_rule(TimingConfig(min_rounds=3, min_time_s=0.3, max_time_s=2.0, min_processes=1))
    inner = {"a": 10, "b": 10}
    assert not rule.done({"a": [], "b": []}, inner, "a", 0.0)
    assert not rule.done({"a": [0.01] * 3, "b": [0.01] * 2}, inner, "a", 0.5)  # b lacks a round
    assert not rule.done({"a": [0.005] * 3, "b": [0.01] * 3}, inner, "a", 0.5)  # a lacks time (0.15 s)
    assert rule.done({"a": [0.01] * 3, "b": [0.01] * 3}, inner, "a", 0.5) and rule.reason == "floor"
    # the cap is max_time_s per cell that started, also after one of them failed
    assert not rule.done({"a": [0.001]}, {"a": 1}, "a", 3.9)
    assert rule.done({"a": [0.001]}, {"a": 1}, "a", 4.0) and rule.reason == "cap"
    assert rule.n_checks == 0  # no precision target: no interval computed


def test_screening_says_who_lacks_the_device():
    from backends.base import Backend, screen
    from harness.spec.model import ModelSpec, Problem

    class CpuOnly(Backend):
        name = "cpu-only"

    class NoGpuHere(Backend):
        name = "gpu-capable"
        devices = ("cpu", "gpu")

        def device_availability(self, device):
            return False, "unavailable: no GPU on this machine"

    class Picky(Backend):
        name = "picky"

        def supports(self, problem):
            return False, "unsupported: batch 3"

    gpu = Problem(ModelSpec(kind="elman", hidden=4), 5, 5, True, "float32", 3, 4, "gpu", "train_step")
    cpu = Problem(ModelSpec(kind="elman", hidden=4), 5, 5, True, "float32", 3, 4, "cpu", "train_step")
    assert screen(CpuOnly(), gpu) == ("unsupported", "unsupported: cpu-only runs on the CPU only (device gpu)")
    assert screen(NoGpuHere(), gpu) == ("unavailable", "unavailable: no GPU on this machine")
    assert screen(NoGpuHere(), cpu) == ("ok", "")
    assert screen(Picky(), cpu) == ("unsupported", "unsupported: batch 3")


def test_numpy_gpu_cells_are_unsupported_not_unavailable(write_config, run_config):
    path = write_config("name: g\nmodel: {kind: elman, hidden: 4}\ntask: {kind: random, vocab: 5, seq_len: 3}\n"
                        "backends: [numpy]\ndevice: gpu\n")
    t = run_config(path, peaks={"float32|threads=1": 1.0}).timings
    assert list(t["status"]) == ["unsupported"] and t["error"].iloc[0].startswith("unsupported:")
