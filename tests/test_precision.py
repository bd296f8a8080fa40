"""The precision stop rule (timing.speedup_precision), driven with synthetic round times, and what a run records."""

import numpy as np
import pytest

from harness.run import stats
from harness.run.stats import ratio_interval
from harness.config import TimingConfig
from harness.run.stats import paired_speedup

TARGET = 0.02


def _rule(max_time_s: float, target: float | None = TARGET) -> stats.StopRule:
    return stats.stop_rule(TimingConfig(min_rounds=8, min_time_s=0.03, max_time_s=max_time_s,
                                          speedup_precision=target, passes=1))


def drive(rule: stats.StopRule, round_times, max_rounds: int = 2000) -> dict[str, list[float]]:
    """Feed rounds (``round_times(r) -> {cell: seconds}``, one call per round) until the rule stops.

    The clock is the synthetic one: the elapsed time is the sum of the rounds so far."""
    samples: dict[str, list[float]] = {}
    elapsed = 0.0
    for r in range(max_rounds):
        times = round_times(r)
        samples = samples or {c: [] for c in times}
        if rule.done(samples, {c: 1 for c in samples}, "base", elapsed):
            return samples
        for c, t in times.items():
            samples[c].append(t)
            elapsed += t
    raise AssertionError("the rule never stopped")


def _met(samples, cell) -> bool:
    point, lo, hi = paired_speedup(samples["base"], samples[cell])
    return stats.precision_met(point, lo, hi, len(samples[cell]), TARGET)


def quiet(seed=0):
    rng = np.random.default_rng(seed)
    return lambda r: {"base": 0.010 * (1 + 0.004 * rng.standard_normal()),
                      "fast": 0.005 * (1 + 0.004 * rng.standard_normal()),
                      "slow": 0.020 * (1 + 0.004 * rng.standard_normal())}


def test_a_quiet_machine_stops_as_soon_as_the_target_is_met():
    rule = _rule(max_time_s=10)
    samples = drive(rule, quiet())
    n = len(samples["base"])
    assert rule.reason == "target" and n == stats.MIN_PRECISION_ROUNDS  # far below the 30 s cap
    assert set(rule.widths) == {"fast", "slow"} and all(w <= TARGET for w in rule.widths.values())
    # what the rule stopped on is the interval the results report
    assert _met(samples, "fast") and _met(samples, "slow")
    assert rule.widths["fast"] == stats.half_width(*paired_speedup(samples["base"], samples["fast"]))


def test_without_a_target_the_floor_alone_stops_the_rounds():
    rule = _rule(max_time_s=10, target=None)
    samples = drive(rule, quiet())
    # min_rounds 8, but two processes of MIN_BLOCK_ROUNDS rounds each by default
    assert rule.reason == "floor" and len(samples["base"]) == 2 * stats.MIN_BLOCK_ROUNDS and rule.n_checks == 0


def test_a_drifting_machine_stays_tight_through_pairing():
    """The machine slows to half speed and back, slowly: each round's pair shares the drift."""
    rng = np.random.default_rng(1)

    def drifting(r):
        speed = 1 + 0.5 * np.sin(r / 6)
        return {"base": 0.010 * speed * (1 + 0.004 * rng.standard_normal()),
                "fast": 0.005 * speed * (1 + 0.004 * rng.standard_normal())}

    rule = _rule(max_time_s=10)
    samples = drive(rule, drifting)
    assert rule.reason == "target" and len(samples["base"]) <= 2 * stats.MIN_PRECISION_ROUNDS
    assert _met(samples, "fast")
    # the same rounds unpaired are nowhere near the target: the drift is far wider than 2%
    _, lo, hi = ratio_interval(samples["fast"], samples["base"])
    assert (hi - lo) / 2 > 5 * TARGET
    assert stats.disturbed(samples["base"]) == [False] * len(samples["base"])  # drift is no burst


def test_a_shift_in_how_the_sides_compare_is_not_averaged_away(monkeypatch):
    """For the last 30% of the rounds the machine's state changes the ratio itself (another
    tenant's load slows one side more than the other): the median of all rounds hardly moves,
    so the bootstrap alone calls the run precise, but the next run may be all in the new state."""
    from harness.run import stats as timing

    rng = np.random.default_rng(4)
    base = [0.010 * (1 + 0.002 * rng.standard_normal()) for _ in range(40)]
    fast = [0.005 * (1 if r < 28 else 1.08) * (1 + 0.002 * rng.standard_normal()) for r in range(40)]
    point, lo, hi = paired_speedup(base, fast)
    assert stats.half_width(point, lo, hi) >= 0.03  # half the difference between the halves
    assert not stats.precision_met(point, lo, hi, 40, TARGET)
    assert stats.precision_met(*paired_speedup(base[:28], fast[:28]), 28, TARGET)  # the steady stretch alone
    monkeypatch.setattr(timing, "MIN_BLOCK_ROUNDS", 10**6)  # without the halves' term
    assert stats.half_width(*paired_speedup(base, fast)) < 0.01


def test_processes_that_disagree_widen_the_interval():
    """Round i ran in process i % 2; the second process of the fast cell runs 6% slower throughout
    (what a fresh process can differ by: its memory layout, the kernels a library picked)."""
    rng = np.random.default_rng(5)
    base = [0.010 * (1 + 0.002 * rng.standard_normal()) for _ in range(40)]
    fast = [0.005 * (1.06 if r % 2 else 1) * (1 + 0.002 * rng.standard_normal()) for r in range(40)]
    two = paired_speedup(base, fast, blocks=[r % 2 for r in range(40)])
    assert stats.half_width(*two) >= 0.028  # half the 6% between the processes
    assert not stats.precision_met(*two, 40, TARGET)
    same = [0.005 * (1 + 0.002 * rng.standard_normal()) for _ in range(40)]
    assert stats.precision_met(*paired_speedup(base, same, blocks=[r % 2 for r in range(40)]), 40, TARGET)  # agreeing processes


def test_the_process_count_is_validated():
    from pydantic import ValidationError

    assert TimingConfig().processes == 1
    for bad in (0, 17, 1.5):
        with pytest.raises(ValidationError):
            TimingConfig(processes=bad)


def _timing(**kw) -> TimingConfig:
    return TimingConfig(min_rounds=8, min_time_s=0.03, speedup_precision=TARGET, **kw)


def drive_passes(timing: TimingConfig, round_times) -> tuple[dict, list[int], list[str]]:
    """What the runner does over passes: before each, ``start_pass``; every round is labelled with its
    block; ``round_times(pass, r)`` gives the pass's round ``r``; passes follow while the rule asks for
    one. Returns the samples, the blocks and the reason each pass ended with."""
    rule, policy = stats.stop_rule(timing), timing
    samples: dict[str, list[float]] = {"base": [], "fast": []}
    blocks, reasons, elapsed = [], [], 0.0
    while not reasons or reasons[-1] == "pass":
        p = len(reasons)
        rule.start_pass(p, samples)
        r = 0
        while not rule.done(samples, {"base": 1, "fast": 1}, "base", elapsed, blocks):
            blocks.append(policy.round_block(p, r))
            for c, t in round_times(p, r).items():
                samples[c].append(t)
                elapsed += t
            r += 1
        reasons.append(rule.reason)
    return samples, blocks, reasons


def _state_per_pass(ratios, noise=0.003, seed=6):
    """A machine whose state differs between passes: in pass ``p`` fast takes base / ratios[p % len]."""
    rng = np.random.default_rng(seed)
    return lambda p, r: {"base": 0.010 * (1 + noise * rng.standard_normal()),
                         "fast": 0.010 / ratios[p % len(ratios)] * (1 + noise * rng.standard_normal())}


def test_passes_take_their_share_of_rounds_and_stop_at_the_target():
    timing = _timing(max_time_s=10, passes=2, max_passes=6)
    samples, blocks, reasons = drive_passes(timing, _state_per_pass([2.0]))
    per_pass = timing.pass_rounds
    assert per_pass == max(4, stats.MIN_BLOCK_ROUNDS)
    # every pass takes its share and no more; passes go on until the target
    assert reasons[-1] == "target" and set(reasons[:-1]) == {"pass"} and 2 <= len(reasons) <= 4
    assert blocks == [p for p in range(len(reasons)) for _ in range(per_pass)]
    point, lo, hi = paired_speedup(samples["base"], samples["fast"], blocks=blocks)
    assert stats.precision_met(point, lo, hi, len(blocks), TARGET) and point == pytest.approx(2.0, rel=0.01)


def test_passes_that_disagree_keep_a_cell_from_its_target():
    """Each pass alone is tight (±0.3% noise), but the machine's state moves the ratio by 6% from one pass
    to the next: the interval covers it, the passes run out, and the cell is flagged."""
    timing = _timing(max_time_s=10, passes=2, max_passes=4)
    samples, blocks, reasons = drive_passes(timing, _state_per_pass([2.0, 2.12]))
    assert reasons == ["pass", "pass", "pass", "cap"]
    point, lo, hi = paired_speedup(samples["base"], samples["fast"], blocks=blocks)
    assert stats.half_width(point, lo, hi) >= 0.03 and not stats.precision_met(point, lo, hi, len(blocks), TARGET)
    # what one pass alone would have claimed
    first = [i for i, b in enumerate(blocks) if b == 0]
    assert stats.half_width(*paired_speedup([samples["base"][i] for i in first], [samples["fast"][i] for i in first])) < 0.01


def test_a_cell_whose_speedup_is_precise_leaves_the_later_passes():
    """steady keeps its ratio in every pass, shifty moves 6% from one pass to the next: after the
    passes asked for, only shifty (and the baseline it is paired with) is timed again."""
    timing = _timing(max_time_s=10, passes=3, max_passes=5)
    rule, policy = stats.stop_rule(timing), timing
    rng = np.random.default_rng(9)
    samples = {"base": [], "steady": [], "shifty": []}
    blocks, timed, elapsed = [], [], 0.0
    for p in range(5):
        cells = ["base", "steady", "shifty"] if rule.pending is None else ["base", *sorted(rule.pending)]
        timed.append(cells)
        rule.start_pass(p, {c: samples[c] for c in cells})
        r = 0
        while not rule.done({c: samples[c] for c in cells}, dict.fromkeys(cells, 1), "base", elapsed, blocks):
            blocks.append(policy.round_block(p, r))
            times = {"base": 0.010, "steady": 0.005, "shifty": 0.005 * (1.06 if p % 2 else 1.0)}
            for c in cells:
                samples[c].append(times[c] * (1 + 0.002 * rng.standard_normal()))
                elapsed += samples[c][-1]
            r += 1
        if rule.reason != "pass":
            break
    assert timed[:3] == [["base", "steady", "shifty"]] * 3 and timed[3:] == [["base", "shifty"]] * 2
    assert rule.reason == "cap" and rule.pending == {"shifty"}
    n = len(samples["steady"])
    assert stats.precision_met(*paired_speedup(samples["base"][:n], samples["steady"], blocks=blocks), n, TARGET)


def test_two_blocks_must_agree_closely_and_more_blocks_narrow_the_interval():
    rng = np.random.default_rng(8)
    base = list(0.010 * (1 + 0.001 * rng.standard_normal(40)))
    fast = [0.005 * (1.01 if r >= 20 else 1.0) * (1 + 0.001 * rng.standard_normal()) for r in range(40)]
    two = paired_speedup(base, fast, blocks=[r // 20 for r in range(40)])
    assert stats.half_width(*two) > 0.05  # 1% apart: t with one degree of freedom is 12.7 standard errors
    alternating = [0.005 * (1.01 if (r // 10) % 2 else 1.0) * (1 + 0.001 * rng.standard_normal()) for r in range(40)]
    four = paired_speedup(base, alternating, blocks=[r // 10 for r in range(40)])
    assert stats.half_width(*four) < 0.02  # four blocks, same 1% spread: t(3) = 3.18 over a halved error


def test_the_time_cap_ends_the_passes():
    timing = _timing(max_time_s=0.1, passes=2, max_passes=4)
    samples, blocks, reasons = drive_passes(timing, lambda p, r: {"base": 0.02, "fast": 0.01})
    per_pass = timing.pass_rounds
    # the first pass fits (5 rounds of 30 ms), the second is cut at the cap: max_time_s for each of the two cells
    assert reasons == ["pass", "cap"] and blocks.count(0) == per_pass and 0 < blocks.count(1) < per_pass
    assert 0.2 <= sum(samples["base"]) + sum(samples["fast"]) < 0.2 + 0.03


def test_the_pass_counts_are_validated_and_set_the_rounds_per_pass(write_config):
    from pydantic import ValidationError

    from harness.config import load_config
    from harness.spec.errors import HarnessError

    assert TimingConfig().pass_count == 2 and TimingConfig().max_passes is None
    for bad in (0, 17, 1.5):
        with pytest.raises(ValidationError):
            TimingConfig(passes=bad)
        with pytest.raises(ValidationError):
            TimingConfig(max_passes=bad)
    with pytest.raises(HarnessError, match="timing.max_passes: expected at least timing.passes"):
        load_config(write_config("name: p\nmodel: {kind: elman, hidden: 4}\ntask: {kind: random, vocab: 5, seq_len: 3}\n"
                                 "backends: [numpy]\ntiming: {passes: 3, max_passes: 2}\n"))
    policy = lambda **kw: TimingConfig(**{"passes": 1, **kw})  # noqa: E731 (one pass unless said)
    assert policy(min_rounds=8, min_processes=1).pass_rounds == 8 and policy(min_rounds=8).pass_limit == 1  # one process
    assert policy(min_rounds=8).pass_rounds == 2 * stats.MIN_BLOCK_ROUNDS  # by default two, each a block
    assert policy(min_rounds=30, passes=3).pass_rounds == 10 and policy(passes=2, max_passes=5).pass_limit == 5
    assert policy(min_rounds=8, passes=2, processes=2).pass_rounds == 2 * stats.MIN_BLOCK_ROUNDS
    assert [policy(passes=2, processes=2).round_block(p, r) for p in (0, 1) for r in range(3)] == [0, 1, 0, 2, 3, 2]
    assert [policy(passes=2).round_block(p, r) for p in (0, 1) for r in range(3)] == [0, 0, 0, 1, 1, 1]


def _bursty(one_sided: bool, seed: int = 2):
    """In about a third of the rounds a burst of load slows ``fast`` by half; ``base`` too unless ``one_sided``."""
    rng = np.random.default_rng(seed)

    def times(r):
        burst = 1.5 if rng.random() < 0.35 else 1.0
        return {"base": 0.010 * (burst if not one_sided else 1) * (1 + 0.004 * rng.standard_normal()),
                "fast": 0.005 * burst * (1 + 0.004 * rng.standard_normal())}
    return times


def test_bursts_on_both_sides_cancel_in_the_pairs():
    rule = _rule(max_time_s=10)
    samples = drive(rule, _bursty(one_sided=False))
    assert rule.reason == "target" and _met(samples, "fast")
    assert len(samples["base"]) <= 2 * stats.MIN_PRECISION_ROUNDS
    shared = [a and b for a, b in zip(stats.disturbed(samples["base"]), stats.disturbed(samples["fast"]))]
    assert sum(shared) >= 2  # flagged, and kept


def test_one_sided_bursts_widen_the_interval_until_the_cap():
    rule = _rule(max_time_s=0.3)  # 0.6 s for the two cells: about 38 rounds of 16 ms
    samples = drive(rule, _bursty(one_sided=True))
    n = len(samples["base"])
    assert rule.reason == "cap" and 30 <= n <= 45
    assert not _met(samples, "fast") and rule.widths["fast"] > TARGET
    flagged = stats.disturbed(samples["fast"])
    assert sum(flagged) >= 10 and not any(stats.disturbed(samples["base"]))
    # the interval is computed on a schedule, not every round
    assert rule.n_checks < n / 3


def test_the_cap_counts_cells_that_failed_and_a_missing_baseline_falls_back_to_the_floor():
    rule = _rule(max_time_s=1.0)
    times = {"base": [0.01] * 12, "fast": [0.005] * 12}
    assert not rule.done({"fast": times["fast"][:3], "base": times["base"][:3]}, {"fast": 1, "base": 1}, "base", 0.1)
    # the baseline failed: no speedup to make precise; the floor decides
    assert rule.done({"fast": times["fast"]}, {"fast": 1}, None, 0.2) and rule.reason == "floor"
    alone = _rule(max_time_s=1.0)  # the baseline alone is left: no speedup either
    assert alone.done({"base": times["base"]}, {"base": 1}, "base", 0.2) and alone.reason == "floor"
    short = _rule(max_time_s=1.0)
    assert not short.done({"base": [0.01] * 3, "fast": [0.005] * 3}, {"base": 1, "fast": 1}, "base", 1.9)
    assert short.done({"base": [0.01] * 3}, {"base": 1}, "base", 2.0) and short.reason == "cap"


def test_precision_needs_enough_rounds_and_a_finite_interval():
    assert stats.half_width(2.0, 1.96, 2.02) == pytest.approx(0.02)
    assert np.isnan(stats.half_width(2.0, float("nan"), float("nan")))
    assert stats.precision_met(2.0, 1.99, 2.01, stats.MIN_PRECISION_ROUNDS, 0.02)
    assert not stats.precision_met(2.0, 1.99, 2.01, stats.MIN_PRECISION_ROUNDS - 1, 0.02)
    assert not stats.precision_met(2.0, 1.9, 2.01, 50, 0.02)
    assert not stats.precision_met(2.0, float("nan"), float("nan"), 50, 0.02)


def test_the_setting_is_validated():
    from pydantic import ValidationError

    assert TimingConfig().speedup_precision is None
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValidationError):
            TimingConfig(speedup_precision=bad)
    assert TimingConfig(speedup_precision=0.03).speedup_precision == 0.03


def test_rows_record_precision_and_disturbed_rounds(write_config):
    """The columns a timed group's rows carry, from the rounds the stop rule left (no workers needed)."""
    from harness.results import schema
    from harness.config import load_config
    from harness.results.rows import precision_columns as _precision_columns
    from harness.run.group import Outcome

    cfg = load_config(write_config("name: p\nmodel: {kind: elman, hidden: 4}\ntask: {kind: random, vocab: 5, seq_len: 3}\n"
                                   "backends: [numpy, 'numpy:wildml']\ntiming: {speedup_precision: 0.02}\n"))
    base_cell, other_cell = cfg.cells()
    rng = np.random.default_rng(3)
    base_s = list(0.010 * (1 + 0.004 * rng.standard_normal(40)))
    other_s = list(0.005 * (1 + 0.004 * rng.standard_normal(40)))
    base_s[5] *= 1.5  # one burst on both sides, one on the other cell alone
    other_s[5] *= 1.5
    other_s[9] *= 1.5
    base = Outcome(base_cell, samples=base_s, stop_reason="target")
    other = Outcome(other_cell, samples=other_s, stop_reason="target")
    row = dict(zip(("speedup", "speedup_lo", "speedup_hi"), paired_speedup(base_s, other_s)))
    cols = _precision_columns(other, base, row)
    assert set(cols) == set(schema.PRECISION_COLUMNS)
    assert cols["precision_met"] is True and cols["speedup_half_width"] <= 0.02 and cols["stop_reason"] == "target"
    assert (cols["n_disturbed_rounds"], cols["n_disturbed_shared"], cols["n_disturbed_one_sided"]) == (2, 1, 1)
    base_cols = _precision_columns(base, base, {"speedup": 1.0, "speedup_lo": 1.0, "speedup_hi": 1.0})
    assert base_cols["n_disturbed_rounds"] == 1 and base_cols["precision_met"] is None
    assert set(base_cols) == set(schema.PRECISION_COLUMNS)
    loose = _precision_columns(Outcome(other_cell, samples=other_s[:12], stop_reason="cap"), base,
                               {"speedup": 2.0, "speedup_lo": 1.8, "speedup_hi": 2.3})
    assert loose["precision_met"] is False and loose["speedup_half_width"] == pytest.approx(0.15)


def _rows_for_tables():
    common = {"group": "g", "workload": "train_step", "model": "elman", "task": "random", "dtype": "float32",
              "batch": 1, "hidden_size": 8, "seq_len": 4, "input_size": 4, "output_size": 4, "threads": 1,
              "device": "cpu", "bptt": "full", "layers": 1, "tokens": False, "status": "ok", "median_s": 0.001,
              "compile_s": 0.1, "baseline": "numpy", "speedup_precision": 0.02}
    return [dict(common, backend="numpy", variant="fast", speedup=1.0, speedup_lo=1.0, speedup_hi=1.0),
            dict(common, backend="native", variant="default", speedup=2.0, speedup_lo=1.99, speedup_hi=2.02,
                 speedup_half_width=0.01, precision_met=True),
            dict(common, backend="jax", variant="default", speedup=1.5, speedup_lo=1.3, speedup_hi=1.71,
                 speedup_half_width=0.14, precision_met=False)]


def test_tables_flag_a_speedup_that_missed_its_target(capsys):
    import pandas as pd

    from harness import cli
    from harness.results.report import fmt_speedup, imprecise, precision_note

    rows = _rows_for_tables()
    assert [imprecise(r) for r in rows] == [False, False, True]
    assert fmt_speedup(rows[1]) == "2x [1.99, 2.02]"
    assert fmt_speedup(rows[2]) == "1.5x [1.3, 1.71] † interval ±14.0%, wider than its ±2% target"
    assert precision_note(pd.DataFrame(rows)).startswith("1 speedup(s) hit max_time_s or max_passes")
    assert precision_note(pd.DataFrame(rows[:2])) is None
    assert precision_note(pd.DataFrame([{k: v for k, v in rows[0].items() if k != "speedup_precision"}])) is None

    class Store:
        timings = rows
        meta = {"name": "t", "baseline": "numpy"}

    cli._print_summary(Store())
    out = capsys.readouterr()
    # the terminal's summary fits 80 columns: the speedup is marked, the mark explained under the tables and on
    # the "imprecise:" line, named for what it measures
    assert "1.5x [1.3, 1.71] †" in out.out and "2x [1.99, 2.02] †" not in out.out
    assert "marks: † interval wider than ±2%" in out.out
    err = " ".join(out.err.split())  # the note wraps at the window's width
    assert "imprecise:" in err and "1 speedup(s)" in err and "(marked † interval wider than ±2%)" in err


@pytest.mark.slow
def test_a_run_records_precision_through_the_results_folder(fake_backends, write_config, run_config):
    """Workers, stop rule and parquet together: a cell that cannot reach an impossible target is flagged."""
    import pandas as pd

    path = write_config("name: prec\nmodel: {kind: elman, hidden: 8}\n"
                        "task: {kind: random, vocab: 20, seq_len: 6, n_sequences: 16, n_eval: 8}\n"
                        "backends: [ref, 'ref:slow']\n"
                        "timing: {warmup: 1, min_rounds: 3, min_time_s: 0.02, max_time_s: 0.4, timeout_s: 20, "
                        "round_s: 0.005, speedup_precision: 0.000001}\n")
    t = run_config(path, peaks={"float32|threads=1": 1.0}).timings.set_index("variant")
    assert list(t["stop_reason"]) == ["cap", "cap"] and t.loc["slow", "n_samples"] >= stats.MIN_PRECISION_ROUNDS
    assert not bool(t.loc["slow", "precision_met"]) and t.loc["slow", "speedup_half_width"] > 0
    assert t.loc["slow", "speedup_precision"] == 0.000001 and t.loc["slow", "n_disturbed_one_sided"] >= 0
    assert pd.isna(t.loc["plain", "precision_met"])  # the baseline's own 1x has nothing to meet


def test_the_report_says_how_the_speedups_were_timed():
    import pandas as pd

    from harness.results.report import timing_summary

    rows = [dict(r, n_processes=1, n_passes=n) for r, n in zip(_rows_for_tables(), (3, 4, 6))]
    assert timing_summary(pd.DataFrame(rows)) == ("precision target ±2.0%; 1 process(es) per pass; 3-6 passes; "
                                                  "1 of 2 speedups met the target")
    assert timing_summary(pd.DataFrame(_rows_for_tables())) is None  # a run from before passes
