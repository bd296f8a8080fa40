"""The statistics the runner and the results share (:mod:`harness.run.stats`)."""

import pytest

def test_paired_interval_over_blocks_uses_the_t_quantile():
    import numpy as np

    from harness.run.stats import paired_speedup

    rng = np.random.default_rng(1)
    base = 1.0 + 0.01 * rng.standard_normal(40)
    other = np.concatenate([0.5 + 0.005 * rng.standard_normal(20), 0.55 + 0.005 * rng.standard_normal(20)])
    blocks = [0] * 20 + [1] * 20
    point, lo, hi = paired_speedup(base, other, blocks=blocks)
    per_block = [np.median(base[s]) / np.median(other[s]) for s in (slice(0, 20), slice(20, 40))]
    standard_error = abs(per_block[0] - per_block[1]) / 2
    # two blocks that disagree, with no other pair to pool with: the block term has one degree of freedom,
    # t(0.975, 1) = 12.7 (a little less with the rounds' own term beside it) standard errors each way, as a
    # ratio (point times e^(-+w): never to zero or below); a normal quantile, 1.96, would give a sixth of that
    w = 10 * standard_error
    assert lo <= point * np.exp(-w / point) and hi >= point * np.exp(w / point)
    assert 0 < lo < point * np.exp(-1.96 * 6 * standard_error / point)


def _simulated_runs(n_runs: int, n_blocks: int, rounds_per_block: int, process_sd: float, round_sd: float,
                    truths=(1.0, 1.5, 2.0, 2.5, 3.0), seed: int = 3):
    """Runs of one comparison group on a machine where every fresh worker process shifts its backend's
    times by a lognormal factor (``process_sd``) and every round by another (``round_sd``); the first
    speedup is an A/A pair (the baseline's own code in processes of its own, truth 1). Per speedup:
    the truth, the points and the intervals of every run."""
    import numpy as np

    from harness.run.stats import speedup_intervals

    rng = np.random.default_rng(seed)
    n = n_blocks * rounds_per_block
    labels = [r % n_blocks for r in range(n)]  # processes take rounds in turn, as a group run does
    out = {t: [] for t in truths}
    for _ in range(n_runs):
        def times(level):
            shift = rng.normal(0, process_sd, n_blocks)[labels]
            return level * np.exp(shift + round_sd * rng.standard_normal(n))

        base = times(0.010)
        pairs = {t: (base, times(0.010 / t), labels) for t in truths}
        for t, interval in speedup_intervals(pairs).items():
            out[t].append(interval)
    return out


def _coverage_and_width(runs: dict) -> tuple[float, float]:
    """How often an interval held the truth, and the median half-width (in the logarithm) over the 1.96
    standard deviations of the points from run to run that a 95% interval needs."""
    import numpy as np

    held, widths, needs = [], [], []
    for truth, intervals in runs.items():
        points = np.log([p for p, _, _ in intervals])
        needs.append(1.96 * np.std(points - np.log(truth), ddof=1))
        for p, lo, hi in intervals:
            held.append(lo <= truth <= hi)
            widths.append(np.log(hi / lo) / 2)
    return float(np.mean(held)), float(np.median(widths) / np.median(needs))



@pytest.mark.parametrize("n_blocks, rounds_per_block", [(2, 8), (3, 5)], ids=["two processes", "three passes"])
def test_intervals_hold_the_truth_about_95_percent_of_the_time_with_process_effects(n_blocks, rounds_per_block):
    """Both regimes of the shipped configs: one pass of two processes (the default timing) and three
    passes of one (configs/quick.yaml). Each process moves a speedup by about 1%, as much as the rounds'
    noise: an interval from a pair's two or three blocks alone (t with 1 or 2 degrees of freedom) was
    several times too wide, one that ignores the blocks too narrow; pooling the group's blocks is right."""
    runs = _simulated_runs(40, n_blocks, rounds_per_block, process_sd=0.01, round_sd=0.01)
    coverage, width = _coverage_and_width(runs)
    assert 0.85 <= coverage <= 0.99 and 0.7 <= width <= 1.5, (coverage, width)
    held_one = [lo <= 1.0 <= hi for _, lo, hi in runs[1.0]]  # the A/A pair
    assert sum(held_one) >= 0.85 * len(held_one)


def test_without_blocks_the_intervals_miss_what_a_rerun_changes():
    """The same machine, the rounds labelled as one block (as every default run's were): the interval
    covers the rounds' noise only and misses the truth far more often than 5% of the time."""
    import numpy as np

    from harness.run.stats import speedup_intervals

    rng = np.random.default_rng(5)
    held = []
    for _ in range(40):
        labels = [r % 2 for r in range(16)]
        base = 0.01 * np.exp(rng.normal(0, 0.01, 2)[labels] + 0.01 * rng.standard_normal(16))
        other = 0.005 * np.exp(rng.normal(0, 0.01, 2)[labels] + 0.01 * rng.standard_normal(16))
        (_, lo, hi), = speedup_intervals({0: (base, other, [0] * 16)}).values()
        held.append(lo <= 2.0 <= hi)
    assert np.mean(held) < 0.85


def test_a_backend_far_more_process_dependent_than_the_rest_keeps_its_own_estimate():
    """One pair's processes disagree by 6%, the others' agree: the pool does not lend the steady pairs
    that pair's variance (nor that pair the steady ones' precision)."""
    import numpy as np

    from harness.run.stats import half_width, speedup_intervals

    rng = np.random.default_rng(7)
    labels = [r // 8 for r in range(24)]  # three passes of eight rounds

    def times(level, shifts):
        return level * np.asarray(shifts)[labels] * np.exp(0.002 * rng.standard_normal(24))

    base = times(0.010, [1, 1, 1])
    pairs = {f"steady{i}": (base, times(0.005, [1, 1, 1]), labels) for i in range(4)}
    pairs["shifty"] = (base, times(0.005, [1, 1.06, 1]), labels)
    out = speedup_intervals(pairs)
    assert half_width(*out["shifty"]) > 0.05
    assert all(half_width(*out[f"steady{i}"]) < 0.01 for i in range(4))
    assert out["shifty"][1] < 2 / 1.02 < out["shifty"][2]


def test_a_group_run_varies_and_records_each_rounds_order(fake_backends, write_config, tmp_path, monkeypatch):
    """The group's cells take every round in the order measure.round_order gives it (not the baseline
    first every time), and each row says where the cell stood in each of its rounds."""
    import harness
    from harness.config import load_config
    from harness.results.store import RunStore
    from harness.run.client import WorkerProcess
    from harness.run.runner import Runner, new_run_meta

    cfg = load_config(write_config("name: order\nseed: 1\nmodel: {kind: elman, hidden: 8}\n"
                                   "task: {kind: random, vocab: 20, seq_len: 6, n_sequences: 16, n_eval: 8}\n"
                                   "workloads: [train_step]\nbatch: [2]\nbackends: [ref, 'ref:slow']\n"
                                   "timing: {warmup: 1, min_rounds: 4, min_time_s: 0.05, max_time_s: 1, timeout_s: 60}\n"))
    store = RunStore.create(tmp_path / "run", new_run_meta(cfg))
    runner = Runner(cfg, store)
    runner.gemm_peaks = {"float32|threads=1": 1.0}
    timed = []
    original = WorkerProcess.request

    def watched(self, req, timeout_s):
        if req.cmd == "rounds":
            timed.append(self.label)
        return original(self, req, timeout_s)

    monkeypatch.setattr(WorkerProcess, "request", watched)
    runner.run()
    firsts = timed[::2]
    assert len(set(firsts)) == 2  # both cells went first in some round
    t = harness.load_run(tmp_path / "run").timings.set_index("backend").sort_values("variant")
    plain, slow = (list(v) for v in t["samples_position"])
    assert len(plain) >= 10 and plain == [(0, 1, 1, 0)[r % 4] for r in range(len(plain))]
    assert [1 - p for p in plain] == slow


def test_baseline_twice_times_the_baseline_again_as_an_a_a_check(fake_backends, write_config, tmp_path):
    """``baseline_twice: true`` adds the baseline's second copy (``ref#2``) to every group, timed in
    processes of its own; its row says which copy it is, its label ends in #2, and its speedup over the
    baseline holds 1. A copy is named after its original, which must come first."""
    import harness
    from harness.config import load_config
    from harness.results.labels import backend_label
    from harness.results.store import RunStore
    from harness.run.runner import Runner, new_run_meta
    from harness.spec.errors import HarnessError

    head = ("name: aa\nseed: 1\nmodel: {kind: elman, hidden: 8}\n"
            "task: {kind: random, vocab: 20, seq_len: 6, n_sequences: 16, n_eval: 8}\nworkloads: [train_step]\n"
            "batch: [2]\ntiming: {warmup: 1, min_rounds: 4, min_time_s: 0.05, max_time_s: 1, timeout_s: 60}\n")
    cfg = load_config(write_config(head + "backends: [ref, 'ref:slow']\nbaseline_twice: true\n"))
    assert [c.backend for c in cfg.cells()] == ["ref", "ref:slow", "ref#2"]
    assert [c.copy for c in cfg.cells()] == [1, 1, 2] and len({c.cell_id for c in cfg.cells()}) == 3
    with pytest.raises(HarnessError, match=r"backends\[0\]: 'ref:slow#2' is a copy of 'ref:slow'; expected 'ref:slow'"):
        load_config(write_config(head + "backends: ['ref:slow#2', ref]\n"))
    with pytest.raises(HarnessError, match="expected a copy number from 2 to 9"):
        load_config(write_config(head + "backends: [ref, 'ref#x']\n"))
    store = RunStore.create(tmp_path / "run", new_run_meta(cfg))
    runner = Runner(cfg, store)
    runner.gemm_peaks = {"float32|threads=1": 1.0}
    runner.run()
    t = harness.load_run(tmp_path / "run").timings
    assert list(backend_label(t)) == ["ref", "ref:slow", "ref#2"]
    aa = t[backend_label(t) == "ref#2"].iloc[0]
    assert aa["status"] == "ok" and aa["backend"] == "ref" and aa["copy"] == 2
    base = t[backend_label(t) == "ref"].iloc[0]
    assert base["speedup"] == base["speedup_lo"] == base["speedup_hi"] == 1.0  # the baseline's own row: no pair
    assert aa["speedup_lo"] < aa["speedup"] < aa["speedup_hi"] and aa["speedup_over"] == "ref"


def test_target_not_met_is_marked_alike_in_the_terminal_report_plots_and_multi_run_report(tmp_path):
    """One mark and one name: the terminal's text, the report's cells, the speedup plot's labels and the
    multi-run report's count per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import harness
    from harness.results import plot_speedup, plots
    from harness.results.labels import MISSED_MARK, imprecise
    from harness.results.standing import STANDING_COLUMNS
    from harness.results.multi import _missed_count
    from harness.results.report import fmt_speedup

    from pathlib import Path

    t = harness.load_run(Path(__file__).resolve().parent.parent / "results" / "examples" / "quick").timings
    row = next(r for r in t.to_dict("records") if r["speedup_standing"] == "imprecise")
    assert f"{MISSED_MARK} interval ±" in fmt_speedup(row) and "wider than its ±" in fmt_speedup(row)
    assert str(fmt_speedup(row, mark=True)).endswith(MISSED_MARK)
    # a table whose precision is rejudged: the standing columns go with it, to be computed again
    met = t.drop(columns=list(STANDING_COLUMNS)).assign(
        precision_met=[True if m is not None and m == m else m for m in t["precision_met"]])
    judged = int(t["precision_met"].notna().sum())
    assert _missed_count(t) == f"{sum(imprecise(r) for r in t.to_dict('records'))} of {judged} (±5%)"
    assert _missed_count(met) == f"0 of {judged} (±5%)"
    drawn = []
    real_save = plot_speedup._save

    def keep(plt_, fig, axes, n, out, **kw):
        drawn.extend(txt.get_text() for ax in fig.axes for txt in ax.texts + [ax.xaxis.label])
        return real_save(plt_, fig, axes, n, out, **kw)

    plot_speedup._save = keep
    try:
        plots.plot_speedup(t, tmp_path / "a.png")
        assert any(s.endswith(f"x {MISSED_MARK}") for s in drawn)
        assert any(f"{MISSED_MARK} interval wider than ±5%" in s for s in drawn)
        drawn.clear()
        plots.plot_speedup(met, tmp_path / "b.png")
        assert not any(MISSED_MARK in s for s in drawn)
    finally:
        plot_speedup._save = real_save
        plt.close("all")
