"""Absolute times from several fresh worker processes: timing.min_processes, the rounds' processes, the
spread between them in the results and the report."""

import harness
import pytest

from harness.results import report
from harness.results.rows import process_columns
from harness.worker import measure
from harness.config import TimingConfig, load_config
from harness.run.group import GroupRun, Outcome
from harness.results.store import RunStore
from harness.run.runner import Runner, finish_meta, new_run_meta

TIMING = "timing: {warmup: 1, min_rounds: 4, min_time_s: 0.05, max_time_s: 1, timeout_s: 4, passes: 1}\n"
ALONE = """
name: alone
seed: 1
model: {kind: elman, hidden: 8}
task: {kind: random, vocab: 20, seq_len: 6, n_sequences: 16, n_eval: 8}
workloads: [train_step]
batch: [2]
backends: [ref]
"""


def _policy(**kw) -> TimingConfig:
    """Timing settings of one pass unless ``kw`` says otherwise."""
    return TimingConfig(**{"passes": 1, **kw})


def test_every_timed_cell_samples_two_processes_by_default_over_its_passes():
    assert TimingConfig().min_processes == 2
    # by default a pass for each of the two processes (at the same cost: a process each); one pass where
    # a single process is asked for, or several processes in each pass
    assert TimingConfig().pass_count == 2 and TimingConfig().processes_per_pass == 1
    assert TimingConfig(min_processes=1).pass_count == 1 and TimingConfig(processes=2).pass_count == 1
    assert TimingConfig(min_processes=5).pass_count == 2 and TimingConfig(min_processes=5).processes_per_pass == 3
    assert _policy().processes_per_pass == 2  # one pass: both processes in it
    assert _policy(passes=2).processes_per_pass == 1  # two passes: a fresh process each
    assert _policy(passes=3, min_processes=5).processes_per_pass == 2
    assert _policy(processes=3).processes_per_pass == 3
    assert _policy(min_processes=1).processes_per_pass == 1
    # the rounds alternate between the processes, and each process is a block of the speedup's interval
    assert [_policy().round_process(p, r) for p in (0, 1) for r in range(3)] == [0, 1, 0, 2, 3, 2]
    assert [_policy().round_block(p, r) for p in (0, 1) for r in range(3)] == [0, 1, 0, 2, 3, 2]
    assert _policy(min_rounds=10).pass_rounds == 10  # the floor's rounds, shared by the two processes
    with pytest.raises(Exception):
        TimingConfig(min_processes=0)


def test_process_columns_give_the_count_and_the_spread_of_the_processes_medians(fake_backends, write_config):
    cell = load_config(write_config(ALONE)).cells()[0]
    samples = [1.00, 1.10, 1.02, 1.12, 0.98, 1.08]  # process 1 runs ~10% slower
    o = Outcome(cell, samples=samples, blocks=[0] * 6, processes=[0, 1, 0, 1, 0, 1])
    cols = process_columns(o)
    assert cols["n_worker_processes"] == 2 and cols["samples_process"] == [0, 1, 0, 1, 0, 1]
    assert cols["process_spread"] == pytest.approx((1.10 - 1.00) / 1.05)
    one = process_columns(Outcome(cell, samples=samples, blocks=[0] * 6, processes=[0] * 6))
    assert one["n_worker_processes"] == 1 and one["process_spread"] is None
    # an outcome kept by an earlier version knew its blocks only: they were its processes
    assert process_columns(Outcome(cell, samples=samples, blocks=[0, 0, 0, 1, 1, 1]))["n_worker_processes"] == 2
    assert process_columns(Outcome(cell, status="error", samples=samples, processes=[0] * 6)) == {}


def test_a_group_kept_between_passes_keeps_its_rounds_processes(fake_backends, write_config):
    group = load_config(write_config(ALONE)).groups()[0]
    run = GroupRun(group)
    cid = group[0].cell_id
    run.outcomes[cid] = Outcome(group[0], samples=[1.0, 2.0], blocks=[0, 0], processes=[0, 1])
    run.samples[cid], run.blocks, run.processes = [1.0, 2.0], [0, 0], [0, 1]
    back = GroupRun.restore(group, run.saved())
    assert back.processes == [0, 1] and back.outcomes[cid].processes == [0, 1]
    older = run.saved()
    del older["processes"]
    assert GroupRun.restore(group, older).processes == [0, 0]


def test_a_lone_backend_is_timed_in_two_fresh_processes_and_the_report_says_so(fake_backends, write_config, tmp_path,
                                                                               monkeypatch):
    from harness.run.client import _process_state as _state
    from harness.run.client import live_workers
    from harness.run.client import WorkerProcess

    cfg = load_config(write_config(ALONE + TIMING))
    store = RunStore.create(tmp_path / "run", new_run_meta(cfg))
    runner = Runner(cfg, store)
    runner.gemm_peaks = {"float32|threads=1": 1.0}
    rounds: list[int] = []
    original = WorkerProcess.request

    def watched(self, req, timeout_s):
        if req.cmd == "rounds":
            rounds.append(self.proc.pid)
            others = [w for w in live_workers() if w is not self and w.proc.poll() is None]
            assert [_state(w.proc.pid) for w in others] == ["T"]  # the cell's other process is stopped meanwhile
        return original(self, req, timeout_s)

    monkeypatch.setattr(WorkerProcess, "request", watched)
    runner.run()
    finish_meta(store)
    assert len(set(rounds)) == 2 and all(a != b for a, b in zip(rounds, rounds[1:]))  # in turn
    row = harness.load_run(tmp_path / "run").timings.iloc[0]
    assert row["status"] == "ok" and row["n_worker_processes"] == 2 and row["n_processes"] == 1
    assert row["process_spread"] >= 0 and list(row["samples_process"]) == [i % 2 for i in range(len(rounds))]
    assert report.fmt_processes(row) == f"2 (spread {row['process_spread']:.1%})"
    md = (tmp_path / "run" / "report.md")
    report.write_report(tmp_path / "run")
    assert "| processes |" in md.read_text() and "2 (spread" in md.read_text()


WILDML_B16 = """
name: thp
seed: 10
model: {kind: elman, hidden: 100, activation: tanh, bias: false, head: softmax_xent, bptt: {truncated: 4}}
task: {kind: lm_markov, vocab: 2000, seq_len: 20, n_sequences: 32, n_eval: 8}
batch: [16]
backends: [numpy]
"""


def _init(cell):
    from harness.worker import protocol

    p = cell.problem
    return protocol.Init(cell.backend, p.to_mapping(), cell.task.to_mapping(), cell.seed, cell.train.lr)


def test_a_verification_runs_the_reference_without_numpys_huge_page_advice(write_config, monkeypatch):
    import numpy as np

    from harness.worker import worker
    from harness.spec import reference

    core = getattr(np, "_core", None) or np.core

    def advised() -> bool:
        was = core.multiarray._set_madvise_hugepage(False)
        core.multiarray._set_madvise_hugepage(was)
        return was

    seen = []
    cell = load_config(write_config(WILDML_B16.replace("vocab: 2000", "vocab: 20"))).cells()[0]
    state = worker.CellState(_init(cell))
    for owner, name, who in ((reference, "sgd_step", "reference"), (state.backend, "sgd_step", "backend")):
        def watched(*args, _f=getattr(owner, name), _who=who, **kwargs):
            seen.append((_who, advised()))
            return _f(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)
    before = core.multiarray._set_madvise_hugepage(True)
    try:
        assert state.verify("")["ok"]
        assert ("reference", False) in seen and ("reference", True) not in seen  # its arrays are not advised
        assert seen[0] == ("backend", True)  # the backend's step as in a plain process
        assert advised() is True  # and the timed steps' again afterwards
    finally:
        core.multiarray._set_madvise_hugepage(before)


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "unknown"
    return text.split("[")[1].split("]")[0] if "[" in text else "unknown"


@pytest.mark.skipif(_thp_mode() != "madvise", reason="transparent huge pages are not in madvise mode here")
def test_the_timed_steps_of_a_worker_get_no_huge_pages_from_its_verification(write_config):
    """In a worker's environment (the raised malloc thresholds), the reference's 5 MiB float64 arrays of a
    WildML step at batch 16 were advised huge pages that the heap kept for the timed steps' buffers."""
    import os
    import subprocess
    import sys

    from harness.run.client import worker_environment

    path = write_config(WILDML_B16)
    cell = load_config(path).cells()[0]
    _, env = worker_environment(cell.backend, "cpu", cell.problem.dtype, cell.threads, cell.env)
    assert env["MALLOC_MMAP_THRESHOLD_"] and env["MALLOC_TRIM_THRESHOLD_"]
    code = f"""
import re
from harness.worker import worker
from harness.config import load_config
from tests.test_absolute_times import _init
cell = load_config({str(path)!r}).cells()[0]
state = worker.CellState(_init(cell))
state.warmup(0)
assert state.verify("")["ok"]
state.warmup(2, compile=False)
state.rounds(3, 2)
print(re.search(r"AnonHugePages:\\s+(\\d+)", open("/proc/self/smaps_rollup").read()).group(1))
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == 0
