"""Every plot that draws a speedup marks one whose interval is short of its precision target with the one mark
(results/labels.py) and says on its axis what the mark means: over the baseline (speedup.png), over a paired
setting (settings.png) and one run against another (the multi-run runs.png)."""

from pathlib import Path

import pandas as pd
import pytest

import harness
from harness.results.labels import MISSED_MARK
from harness.results.standing import STANDING_COLUMNS

EXAMPLES = Path(__file__).resolve().parents[1] / "results" / "examples"


def _drawn(monkeypatch, draw) -> list[str]:
    """The texts a speedup figure draws: its values beside the intervals and its axes' labels."""
    pytest.importorskip("matplotlib")
    from harness.results import plot_speedup

    texts: list[str] = []

    def keep(plt, fig, axes, n, out, **kw):
        texts.extend(t.get_text() for ax in fig.axes for t in ax.texts + [ax.xaxis.label])
        plt.close(fig)
        return out

    monkeypatch.setattr(plot_speedup, "_save", keep)
    assert draw() is not None
    return texts


def test_settings_plot_marks_paired_speedups_wider_than_the_target(monkeypatch, tmp_path):
    from harness.results.plot_speedup import plot_settings

    t = harness.load_run(EXAMPLES / "mixed_precision").timings
    texts = _drawn(monkeypatch, lambda: plot_settings(t, tmp_path / "settings.png"))
    # native's bfloat16 over float32, 1.9x [1.84, 1.95]: ±2.6% against a ±2% target
    assert any(s.endswith(f"x {MISSED_MARK}") for s in texts)
    assert any(f"{MISSED_MARK} interval wider than ±2%" in s for s in texts)  # named for what it measures
    loose = t.drop(columns=list(STANDING_COLUMNS)).assign(speedup_precision=0.5)  # judged again, by a looser target
    texts = _drawn(monkeypatch, lambda: plot_settings(loose, tmp_path / "settings.png"))
    assert not any(MISSED_MARK in s for s in texts)


def test_runs_plot_marks_a_ratio_wider_than_the_runs_target(monkeypatch, tmp_path):
    from harness.results.plot_speedup import plot_runs

    pairs = pd.DataFrame([
        {"run_id": "b", "problem": "train_step · elman", "label": "numpy", "status_a": "ok", "status_b": "ok",
         "ratio": 1.0, "ratio_lo": 0.9, "ratio_hi": 1.1, "precision": 0.02},
        {"run_id": "b", "problem": "train_step · elman", "label": "native", "status_a": "ok", "status_b": "ok",
         "ratio": 1.5, "ratio_lo": 1.49, "ratio_hi": 1.51, "precision": 0.02}])
    keys = {"a": "A", "b": "B"}
    texts = _drawn(monkeypatch, lambda: plot_runs(pairs, keys, tmp_path / "runs.png"))
    assert f"1x {MISSED_MARK}" in texts and "1.5x" in texts
    assert any(f"{MISSED_MARK} interval wider than ±2%" in s for s in texts)
    texts = _drawn(monkeypatch, lambda: plot_runs(pairs.assign(precision=None), keys, tmp_path / "runs.png"))
    assert not any(MISSED_MARK in s for s in texts)


def test_run_pairs_carry_the_tighter_target_of_the_two_runs():
    from harness.results.multi import run_pairs

    t = harness.load_run(EXAMPLES / "quick").timings
    both = pd.concat([t.assign(run_id="a"), t.assign(run_id="b", speedup_precision=t["speedup_precision"] / 2)])
    pairs = run_pairs(both, ["a", "b"])
    timed = pairs[pairs["ratio"].notna()]
    assert len(timed) and timed["precision"].dropna().eq(t["speedup_precision"].dropna().iloc[0] / 2).all()
