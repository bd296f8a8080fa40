"""A comparison group as one unit of work (harness.run.group.GroupRun): a local run, a run whose
group is interrupted between passes and resumed, and the same group's passes run as Dask tasks
(each a fresh GroupRun from the saved state, as a JSON round trip) stop after the same passes for
the same reasons. The workers are fakes answering with synthetic round times, and the clock is
synthetic too, so the three runs see exactly the same rounds and the same elapsed time."""

import json

import pytest

from harness.results import schema
from harness.results.store import RunStore
from harness.run import distributed, group as group_module, roofs
from harness.worker import measure, protocol
from harness.config import load_config
from harness.run.group import GroupRun
from harness.run.runner import Runner, new_run_meta

CONFIG = """name: group-run
model: {kind: elman, hidden: 8}
task: {kind: random, input_size: 4, output_size: 4, seq_len: 5}
batch: [1, 2]
backends: [ref, 'ref:slow', 'bad:wrong']
timing: {warmup: 0, min_rounds: 10, min_time_s: 0.0, max_time_s: 0.028, timeout_s: 5, passes: 2, max_passes: 5,
         speedup_precision: 0.01}
"""

# per backend: its per-call seconds, and how much its passes disagree (bad:wrong's speedup drifts
# from pass to pass, so it stays short of the target until the cap; ref:slow's is steady)
BASE_S = {"ref": 1e-3, "ref:slow": 2e-3, "bad:wrong": 1.5e-3}
DRIFT = {"ref": 0.0, "ref:slow": 0.0, "bad:wrong": 0.04}


class Clock:
    """The synthetic clock: nanoseconds advanced by the rounds the fake workers 'take'."""

    def __init__(self):
        self.ns = 0


class FakeWorker:
    """Answers the runner's requests as a warmed, verified worker whose rounds take synthetic times."""

    clock: Clock
    spawned: list = []

    def __init__(self, environment, env, label, recorded=None, record=None):
        self.label, self.env, self.n_pass = label, dict(recorded or {}), 0
        self.rounds = 0

    def request(self, req, timeout_s):
        if isinstance(req, protocol.Init):
            # which pass of its group this fresh worker serves: its backend's workers at this batch so far
            key = (self.label, req.problem["batch"])
            self.n_pass = sum(1 for k in FakeWorker.spawned if k == key)
            FakeWorker.spawned.append(key)
            return protocol.Reply("ok", protocol.InitReply({}, "3", {}))
        if isinstance(req, protocol.WarmUp):
            return protocol.Reply("ok", protocol.WarmUpReply(0.0, 0.0), peak_rss_mb=1.0)
        if isinstance(req, protocol.Verify):
            return protocol.Reply("ok", protocol.VerifyReply(True, "W_hh", 0.1, "b"))
        if isinstance(req, protocol.Calibrate):
            return protocol.Reply("ok", protocol.CalibrateReply(1, 1e-3))
        if isinstance(req, protocol.GemmPeak):
            return protocol.Reply("ok", protocol.GemmPeakReply(1.0))
        if isinstance(req, protocol.Rounds):
            wobble = 1 + 0.001 * ((self.rounds * 7) % 5 - 2)  # a tiny, fixed pattern of noise
            t = BASE_S[self.label] * (1 + DRIFT[self.label] * (self.n_pass % 2)) * wobble
            self.rounds += 1
            FakeWorker.clock.ns += int(t * 1e9)
            return protocol.Reply("ok", protocol.RoundsReply([t], 1.0), peak_rss_mb=1.0)
        raise AssertionError(f"unexpected request {req!r}")

    def pause(self):
        pass

    def resume(self):
        pass

    def close(self, wait=True):
        pass


@pytest.fixture
def fakes(monkeypatch, fake_backends):
    clock = Clock()
    FakeWorker.clock, FakeWorker.spawned = clock, []
    monkeypatch.setattr(group_module, "WorkerProcess", FakeWorker)
    monkeypatch.setattr(roofs, "WorkerProcess", FakeWorker)
    monkeypatch.setattr(measure, "clock_ns", lambda: clock.ns)
    monkeypatch.setattr(measure, "_clock", lambda: clock.ns)
    return clock


def _passes(outcomes) -> list:
    return [(o.cell.backend, len(set(o.blocks)), o.stop_reason) for o in outcomes]


def _local(cfg, tmp_path):
    store = RunStore.create(tmp_path / "local", new_run_meta(cfg))
    Runner(cfg, store).run()
    by_id = {r["cell_id"]: r for r in store.timings}
    return [[(c.backend, by_id[c.cell_id]["n_passes"], by_id[c.cell_id]["stop_reason"]) for c in g]
            for g in cfg.groups()]


def test_local_resumed_and_dask_passes_stop_alike(fakes, write_config, tmp_path):
    cfg = load_config(write_config(CONFIG))
    local = _local(cfg, tmp_path)
    rows = RunStore.open(tmp_path / "local").timings
    assert rows and all(set(row) <= set(schema.TIMING_COLUMNS) for row in rows)  # every column declared once
    assert any(n > 2 for g in local for _, n, _ in g)  # the target asked for more passes than the floor
    assert {reason for g in local for _, _, reason in g} >= {"target", "cap"}

    resumed, dask = [], []
    for group in cfg.groups():
        # interrupted after every pass: each pass taken up by a fresh GroupRun from what run.json kept
        saved = None
        while True:
            state = GroupRun.restore(group, json.loads(json.dumps(saved)) if saved else None)
            state.run_pass()
            if state.finished:
                break
            saved = state.saved()
        resumed.append(_passes(state.ordered()))
        # the Dask path: one task per pass, the group's saved state travelling between them
        saved = None
        while True:
            result = distributed.run_group_task(cfg, group, json.loads(json.dumps(saved)) if saved else None)
            if result["saved"] is None:
                break
            saved = result["saved"]
        dask.append(_passes(result["outcomes"]))
    assert resumed == local
    assert dask == local
