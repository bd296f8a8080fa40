"""`harness compare`: matching cells of two runs, ratio intervals, significance, regressions."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.results.compare import compare_runs, mann_whitney_p, ratio_interval
from harness.config import load_config
from harness.results.store import RunStore
from harness.run.runner import Runner, finish_meta, new_run_meta
from harness.run.stats import paired_speedup

CONFIG = """
name: pair
seed: 1
model: {kind: elman, hidden: 8}
task: {kind: random, vocab: 20, seq_len: 6, n_sequences: 16, n_eval: 8}
workloads: [train_step]
batch: [2]
backends: [ref, 'ref:slow', 'bad:unsupported']
timing: {warmup: 1, min_rounds: 6, min_time_s: 0.03, max_time_s: 1, timeout_s: 20}
"""
SLOW = "ref:slow"


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """One real run of the test backends (tests/fake_backends.py), shared by the module."""
    tests = str(Path(__file__).resolve().parent)
    base = tmp_path_factory.mktemp("compare")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_BACKENDS", "ref=fake_backends:RefBackend,bad=fake_backends:BadBackend")
        mp.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
        mp.syspath_prepend(tests)
        (base / "pair.yaml").write_text(CONFIG)
        cfg = load_config(base / "pair.yaml")
        store = RunStore.create(base / "a", new_run_meta(cfg))
        Runner(cfg, store).run()
        finish_meta(store)
        # the comparisons below are of the rows' figures: a machine busy while this run was timed (the guard's
        # reading) or processes that disagreed would make every verdict "contended" or "unsteady" (test_standing)
        for row in store.timings:
            row.update(contended=False, process_spread=None)
        store.save()
        yield base / "a"


def _edit(src: Path, dst: Path, edit) -> Path:
    """Copy a run and change its rows through the results store (``edit(rows)`` works in place)."""
    shutil.copytree(src, dst)
    store = RunStore.open(dst)
    edit(store.timings)
    store.meta["cells"] = {r["cell_id"]: r["status"] for r in store.timings}  # run.json records what it holds
    store.save()
    return dst


def _label(row) -> str:
    return row["backend"] if row["variant"] in ("plain",) else f"{row['backend']}:{row['variant']}"


def _set_samples(rows, label: str, scale: float, seed: int, noise: float = 0.02):
    """Give one cell deterministic rounds, 12 samples around ``scale`` ms with ``noise``, the baseline
    (``ref``) 12 rounds around 1 ms, and every cell the speedup these rounds make."""
    rng = np.random.default_rng(seed)
    base_rng = np.random.default_rng(100)
    for row in rows:
        if _label(row) in (label, "ref"):
            rounds = 1e-3 * (scale if _label(row) == label else 1.0) * (1 + noise * (
                rng if _label(row) == label else base_rng).standard_normal(12))
            row["samples_s"] = [float(v) for v in rounds]
            row["median_s"] = float(np.median(row["samples_s"]))
            row["n_samples"] = 12
    base = next(r for r in rows if _label(r) == "ref")
    for row in rows:
        if row.get("samples_s") is not None and len(row["samples_s"]):
            row["speedup"], row["speedup_lo"], row["speedup_hi"] = paired_speedup(base["samples_s"], row["samples_s"])


def _set_speedup(rows, label: str, point: float, lo: float, hi: float, met: bool | None = None):
    """Give one cell a reported speedup interval (and its precision flag) as a run would record it."""
    for row in rows:
        if _label(row) == label:
            row.update(speedup=point, speedup_lo=lo, speedup_hi=hi, precision_met=met)


def _invoke(*args):
    return CliRunner().invoke(app, ["compare", *map(str, args)], env={"COLUMNS": "220"})  # a row on one line


def test_identical_runs_pass(run_a, tmp_path):
    copy = shutil.copytree(run_a, tmp_path / "b")
    for b in (run_a, copy):
        result = _invoke(run_a, b)
        assert result.exit_code == 0, result.output
        assert "no regression" in result.output
    res = compare_runs(run_a, copy)
    timed = [c for c in res.cells if c.ratio is not None]
    assert len(timed) == 2 and all(c.ratio == 1.0 and c.p_value == 1.0 and not c.significant for c in timed)
    assert not res.only_a and not res.only_b
    assert next(c for c in res.cells if c.status_a == "unsupported").verdict == "not timed"


def test_a_backend_made_30_percent_slower_is_a_regression(run_a, tmp_path):
    a = _edit(run_a, tmp_path / "a", lambda rows: _set_samples(rows, SLOW, 2.0, seed=1))
    b = _edit(run_a, tmp_path / "b", lambda rows: _set_samples(rows, SLOW, 2.6, seed=2))
    result = _invoke(a, b)
    assert result.exit_code == 1, result.output
    assert "1 regression" in result.output and "ref:slow" in result.output.split("regression(s)")[1]
    data = json.loads(_invoke(a, b, "--json").output)
    assert len(data["regressions"]) == 1 and data["regressions"][0].startswith("ref:slow ·")
    slow = next(c for c in data["cells"] if c["cell"].startswith("ref:slow"))
    assert slow["verdict"] == "regression" and slow["p_value"] < 0.001
    # B's speedup over A (A's time over B's, the harness's one ratio): 2.0 / 2.6 = 0.77x, below 1 as B is slower
    assert 1 / 1.4 < slow["ratio_lo"] < 1 / 1.3 < slow["ratio_hi"] < 1 / 1.2
    assert "B/A: B's speedup over its baseline / A's" in result.output
    assert slow["ratio"] == pytest.approx(2.0 / 2.6, rel=0.02) and slow["judged_on"] == "speedups"
    assert slow["over"] == pytest.approx(2.0 / 2.6, rel=0.02) and slow["over_hi"] < 1
    plain = next(c for c in data["cells"] if c["cell"].startswith("ref ·"))
    assert plain["verdict"] == "within noise" and plain["ratio"] == 1.0
    # the same slowdown read the other way round is an improvement, not a regression
    back = compare_runs(b, a)
    assert not back.regressions and next(c for c in back.cells if c.cell.startswith("ref:slow")).verdict == "faster"


def test_a_significant_slowdown_below_the_threshold_passes(run_a, tmp_path):
    a = _edit(run_a, tmp_path / "a", lambda rows: _set_samples(rows, SLOW, 2.0, seed=1, noise=0.005))
    b = _edit(run_a, tmp_path / "b", lambda rows: _set_samples(rows, SLOW, 2.08, seed=2, noise=0.005))
    assert _invoke(a, b).exit_code == 0
    res = compare_runs(a, b)
    assert next(c for c in res.cells if c.cell.startswith("ref:slow")).verdict == "slower"
    assert _invoke(a, b, "--threshold", "1.01").exit_code == 1


def test_cells_in_one_run_only_are_listed(run_a, tmp_path):
    b = _edit(run_a, tmp_path / "b", lambda rows: rows.remove(next(r for r in rows if _label(r) == SLOW)))
    result = _invoke(run_a, b)
    assert result.exit_code == 0, result.output
    assert "only in A: ref:slow" in result.output
    res = compare_runs(b, run_a)
    assert res.only_b == [c for c in res.only_b if c.startswith("ref:slow")] and len(res.only_b) == 1


def test_cells_match_by_what_they_measure_when_ids_differ(run_a, tmp_path):
    def rename(rows):
        for r in rows:
            r["cell_id"] = "renamed|" + r["cell_id"]
            r["group"] = "renamed|" + r["group"]

    res = compare_runs(run_a, _edit(run_a, tmp_path / "b", rename))
    assert len(res.cells) == 3 and not res.only_a and not res.only_b


def test_a_cell_that_starts_failing_is_a_regression(run_a, tmp_path):
    def crash(rows):
        row = next(r for r in rows if _label(r) == "ref")
        row.update(status="error", error="worker exited with code 3", samples_s=[], median_s=None)

    result = _invoke(run_a, _edit(run_a, tmp_path / "b", crash))
    assert result.exit_code == 1 and "broken (ok -> error)" in result.output


def test_bad_threshold_is_a_usage_error(run_a):
    result = _invoke(run_a, run_a, "--threshold", "0.9")
    assert result.exit_code == 2 and "threshold" in result.output


def test_ratio_interval_and_mann_whitney():
    rng = np.random.default_rng(0)
    a = 1.0 + 0.05 * rng.standard_normal(30)
    b = 1.5 * (1.0 + 0.05 * rng.standard_normal(30))
    point, lo, hi = ratio_interval(a, b)
    assert lo < 1.5 < hi and hi - lo < 0.2 and lo <= point <= hi
    assert mann_whitney_p(a, b) < 1e-6
    assert mann_whitney_p(a, a[::-1]) == 1.0
    same = mann_whitney_p(a, 1.0 + 0.05 * rng.standard_normal(30))
    assert same > 0.01
    assert np.isnan(ratio_interval([], [1.0])[0]) and np.isnan(mann_whitney_p([1.0, 2.0], [1.0, 2.0, 3.0]))


def test_a_speedup_that_moved_within_its_intervals_is_within_noise(run_a, tmp_path):
    a = _edit(run_a, tmp_path / "a", lambda rows: _set_speedup(rows, SLOW, 0.50, 0.47, 0.53, True))
    b = _edit(run_a, tmp_path / "b", lambda rows: _set_speedup(rows, SLOW, 0.47, 0.44, 0.50, True))  # 6% lower
    res = compare_runs(a, b)
    slow = next(c for c in res.cells if c.cell.startswith("ref:slow"))
    assert slow.speedups_agree is True and slow.verdict == "within noise" and not slow.loose
    assert (slow.speedup_a, slow.speedup_b_hi) == (0.50, 0.50)
    # B over A, the figure judged: 0.94x, its interval from both runs' (their log half-widths in quadrature)
    assert slow.over == pytest.approx(0.94) and slow.over_lo < 0.9 and 1 < slow.over_hi < 1.05
    # two intervals that overlap can still differ: 0.50 [0.47, 0.53] against 0.45 [0.42, 0.48]
    c = _edit(run_a, tmp_path / "c", lambda rows: _set_speedup(rows, SLOW, 0.45, 0.42, 0.48, True))
    moved = next(x for x in compare_runs(a, c).cells if x.cell.startswith("ref:slow"))
    assert moved.speedups_agree is True and moved.over_hi < 1 and moved.verdict == "regression"
    assert _invoke(a, b).exit_code == 0
    base = next(c for c in res.cells if c.cell.startswith("ref ·"))
    assert base.speedups_agree is None and base.speedup_a is None  # the baseline is judged by its time


def test_speedups_apart_beyond_the_threshold_are_a_regression_and_loose_ones_are_marked(run_a, tmp_path):
    a = _edit(run_a, tmp_path / "a", lambda rows: _set_speedup(rows, SLOW, 0.50, 0.49, 0.51, True))
    b = _edit(run_a, tmp_path / "b", lambda rows: _set_speedup(rows, SLOW, 0.46, 0.40, 0.485, False))
    res = compare_runs(a, b)
    slow = next(c for c in res.cells if c.cell.startswith("ref:slow"))
    assert slow.speedups_agree is False and slow.significant and slow.verdict == "regression" and slow.loose
    result = _invoke(a, b)
    assert result.exit_code == 1 and "† a speedup's interval is wider than its precision target" in result.output
    # apart, but the speedup fell by less than the threshold: slower, not a regression
    assert next(c for c in compare_runs(a, b, threshold=1.1).cells if c.cell.startswith("ref:slow")).verdict == "slower"
    # the other way round B is faster, and a B interval above A's is never a regression
    back = next(c for c in compare_runs(b, a).cells if c.cell.startswith("ref:slow"))
    assert back.verdict == "faster" and not compare_runs(b, a).regressions
