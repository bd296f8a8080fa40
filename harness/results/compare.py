"""Two runs side by side: per cell, B's speedup over A (A's median time over B's: above 1, B is faster) with
its interval, significance, regressions. Every ratio the harness prints reads this way round (a reference's time
over this one's).

Cells are matched by ``cell_id``, or, where ids differ (a renamed sweep, another
config file), by the columns that say what a cell measures.

A cell with a speedup over its group's baseline in both runs is judged by those speedups'
95% intervals, each from rounds paired with the baseline inside its own run: the runs
agree when the intervals overlap, and the cell changed only when one interval lies wholly
beyond the other (a regression: B's below A's by more than the threshold). That is the
figure a run promises and the one a loaded machine disturbs least. The baseline itself,
and cells without intervals, are judged by their absolute times: the runs were timed
apart, so their rounds are not paired; the interval of the ratio of medians comes from
resampling each run's rounds independently, and significance from a Mann-Whitney U
test on the two sets of rounds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from harness.run.stats import mann_whitney_p, ratio_interval
from harness.spec.errors import HarnessError
from harness.spec.status import Status, FAILED

# ``pins``: jax@0.4.38 pairs with jax@0.4.38, never with the main environment's jax (whose version may
# change between the runs: that is what a comparison is for)
IDENTITY_COLUMNS = ["backend", "variant", "pins", "device", "model", "task", "workload", "dtype", "batch", "seq_len",
                    "input_size", "hidden_size", "output_size", "threads", "bptt", "layers", "activation", "head",
                    "output_act", "peephole", "bias", "tokens", "copy"]
ALPHA = 0.05


@dataclass
class CellChange:
    """One cell present in both runs."""

    cell: str  # readable name: backend and problem
    cell_id_a: str
    cell_id_b: str
    status_a: str
    status_b: str
    median_a_s: float | None = None
    median_b_s: float | None = None
    n_a: int = 0
    n_b: int = 0
    ratio: float | None = None  # B's speedup over A: median A / median B, above 1 faster in B (the one convention)
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    p_value: float | None = None
    significant: bool = False
    baseline_ratio: float | None = None  # the same speedup for the group's baseline backend (machine drift)
    speedup_a: float | None = None  # over the group's baseline, within run A, with its 95% interval
    speedup_a_lo: float | None = None
    speedup_a_hi: float | None = None
    speedup_b: float | None = None
    speedup_b_lo: float | None = None
    speedup_b_hi: float | None = None
    speedups_agree: bool | None = None  # the two intervals overlap (None: not both have one)
    loose: bool = False  # a side stopped short of its precision target (precision_met false)
    verdict: str = "within noise"  # regression | slower | faster | within noise | not timed | broken | fixed


@dataclass
class Comparison:
    """The outcome of comparing run B against run A."""

    run_a: str
    run_b: str
    threshold: float
    alpha: float
    machine_a: str
    machine_b: str
    cells: list[CellChange] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[CellChange]:
        """Cells significantly slower beyond the threshold (by their speedup intervals where both runs
        have them, else by their times), and cells that ran in A but fail in B."""
        return [c for c in self.cells if c.verdict in ("regression", "broken")]

    def to_json(self) -> str:
        """The whole comparison as JSON (NaN written as null)."""
        def clean(v):
            if isinstance(v, float) and not np.isfinite(v):
                return None
            return v

        cells = [{k: clean(v) for k, v in asdict(c).items()} for c in self.cells]
        data = {"run_a": self.run_a, "run_b": self.run_b, "threshold": self.threshold, "alpha": self.alpha,
                "machine_a": self.machine_a, "machine_b": self.machine_b, "cells": cells,
                "only_a": self.only_a, "only_b": self.only_b,
                "regressions": [c.cell for c in self.regressions]}
        return json.dumps(data, indent=2)


def _cell_name(row) -> str:
    from harness.results.labels import group_label

    return f"{row['label']} · {row['workload']} {group_label(row)}"


def _identity(row) -> tuple:
    from harness.results.labels import optional_text

    return tuple(optional_text(row.get(c)) if c in ("pins", "copy") else str(row.get(c)) for c in IDENTITY_COLUMNS)


def _match(a: pd.DataFrame, b: pd.DataFrame) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Pairs of row positions (A, B): by cell_id first, then by identifying columns among the rest."""
    ids_b = {cid: j for j, cid in enumerate(b["cell_id"])}
    pairs, rest_a = [], []
    used_b = set()
    for i, cid in enumerate(a["cell_id"]):
        j = ids_b.get(cid)
        if j is not None and j not in used_b:
            pairs.append((i, j))
            used_b.add(j)
        else:
            rest_a.append(i)
    rest_b = [j for j in range(len(b)) if j not in used_b]
    keys_b: dict[tuple, list[int]] = {}
    for j in rest_b:
        keys_b.setdefault(_identity(b.iloc[j]), []).append(j)
    only_a = []
    for i in rest_a:
        candidates = keys_b.get(_identity(a.iloc[i]), [])
        if len(candidates) == 1:  # an ambiguous match (several sweep points alike) is no match
            j = candidates.pop()
            pairs.append((i, j))
            used_b.add(j)
        else:
            only_a.append(i)
    only_b = [j for j in range(len(b)) if j not in used_b]
    return sorted(pairs), only_a, only_b


def _machine(meta: dict) -> str:
    m = meta.get("machine") or {}
    gpus = m.get("gpus") or []
    return f"{m.get('cpu_model', '?')} x{m.get('cores', '?')}" + (f", {gpus[0]}" if gpus else "")


def _samples(row) -> np.ndarray:
    s = row.get("samples_s")
    return np.asarray([] if s is None else list(s), dtype=np.float64)


def compare_runs(run_a, run_b, threshold: float = 1.05, alpha: float = ALPHA) -> Comparison:
    """Compare run B against run A cell by cell; see :class:`Comparison`."""
    from harness.results.labels import backend_label, optional_text
    from harness.results.store import load_run

    if not threshold >= 1.0:
        raise HarnessError(f"--threshold: expected a ratio of at least 1 (1.05 = 5% slower), got {threshold}")
    a, b = load_run(run_a), load_run(run_b)
    ta = a.timings.reset_index(drop=True)
    tb = b.timings.reset_index(drop=True)
    ta = ta.assign(label=backend_label(ta))
    tb = tb.assign(label=backend_label(tb))
    pairs, only_a, only_b = _match(ta, tb)
    if not pairs:  # nothing compared is no evidence of "no regression" (a CI check pointed at the wrong run)
        raise HarnessError(f"{run_b}: no cell in common with {run_a} ({len(ta)} and {len(tb)} cells); "
                           f"expected two runs of the same config")
    result = Comparison(str(a.run_id), str(b.run_id), threshold, alpha, _machine(a.meta), _machine(b.meta),
                        only_a=[_cell_name(ta.iloc[i]) for i in only_a],
                        only_b=[_cell_name(tb.iloc[j]) for j in only_b])
    for i, j in pairs:
        ra, rb = ta.iloc[i], tb.iloc[j]
        change = CellChange(_cell_name(ra), ra["cell_id"], rb["cell_id"], ra["status"], rb["status"])
        va, vb = optional_text(ra.get("backend_version")), optional_text(rb.get("backend_version"))
        if va and vb and va != vb:  # the main environment's library moved between the runs: say so
            change.cell += f" ({ra['backend']} {va} -> {vb})"
        _speedups(change, ra, rb)
        sa, sb = _samples(ra), _samples(rb)
        if ra["status"] == Status.OK and rb["status"] == Status.OK and sa.size and sb.size:
            change.median_a_s, change.median_b_s = float(np.median(sa)), float(np.median(sb))
            change.n_a, change.n_b = int(sa.size), int(sb.size)
            change.ratio, change.ratio_lo, change.ratio_hi = ratio_interval(sb, sa)  # median A / median B
            change.p_value = mann_whitney_p(sa, sb)
            if change.speedups_agree is not None:
                _judge_speedups(change, threshold)
            else:
                excludes_one = np.isfinite(change.ratio_lo) and (change.ratio_lo > 1 or change.ratio_hi < 1)
                change.significant = bool(np.isfinite(change.p_value) and change.p_value < alpha and excludes_one)
                if change.significant and change.ratio < 1 / threshold:  # B slower than A by more than threshold
                    change.verdict = "regression"
                elif change.significant:
                    change.verdict = "slower" if change.ratio < 1 else "faster"
        elif ra["status"] == Status.OK and rb["status"] == Status.OK:  # rows without their rounds: the medians alone, untested
            change.median_a_s, change.median_b_s = float(ra["median_s"]), float(rb["median_s"])
            change.ratio = change.median_a_s / change.median_b_s
            if change.speedups_agree is not None:
                _judge_speedups(change, threshold)
        elif ra["status"] == Status.OK and rb["status"] in FAILED:
            change.verdict = "broken"
        elif ra["status"] in FAILED and rb["status"] == Status.OK:
            change.verdict = "fixed"
        else:
            change.verdict = "not timed"
        result.cells.append(change)
    _baseline_drift(result, ta, pairs)
    if not any((c.ratio is not None and np.isfinite(c.ratio)) or c.verdict in ("broken", "fixed") for c in result.cells):
        # cells in common but none timed in both runs: comparing them shows nothing, not "no regression"
        raise HarnessError(f"{run_b}: no cell timed in both runs ({len(result.cells)} cell(s) in common with "
                           f"{run_a}, none ok in both); nothing to compare")
    return result


def _interval(row) -> tuple[float, float, float] | None:
    """A row's speedup with its 95% interval, or None without a finite one."""
    try:
        v = tuple(float(row.get(k)) for k in ("speedup", "speedup_lo", "speedup_hi"))
    except (TypeError, ValueError):
        return None
    return v if all(np.isfinite(v)) else None


def _flag(row, name: str) -> bool | None:
    v = row.get(name)
    return None if v is None or pd.isna(v) else bool(v)


def _speedups(change: CellChange, ra, rb) -> None:
    """Both runs' speedups and whether their intervals overlap. The baseline's is its own 1x [1, 1]:
    an interval of no width is no interval to compare."""
    if ra["status"] != Status.OK or rb["status"] != Status.OK:
        return
    a, b = _interval(ra), _interval(rb)
    a, b = (None if v is None or v[1] == v[2] else v for v in (a, b))
    if a is not None:
        change.speedup_a, change.speedup_a_lo, change.speedup_a_hi = a
    if b is not None:
        change.speedup_b, change.speedup_b_lo, change.speedup_b_hi = b
    if a is not None and b is not None:
        change.speedups_agree = bool(a[1] <= b[2] and b[1] <= a[2])
        change.loose = _flag(ra, "precision_met") is False or _flag(rb, "precision_met") is False


def _judge_speedups(change: CellChange, threshold: float) -> None:
    """The verdict from the speedup intervals: a change only where they do not overlap, a regression
    where B's interval lies below A's and the speedup fell by more than ``threshold``."""
    if change.speedups_agree:
        return
    change.significant = True
    if change.speedup_b_hi < change.speedup_a_lo:
        change.verdict = "regression" if change.speedup_a / change.speedup_b > threshold else "slower"
    else:
        change.verdict = "faster"


def _baseline_drift(result: Comparison, ta: pd.DataFrame, pairs) -> None:
    """Attach to every cell its group's baseline's speedup of B over A: a shift of the machine shows there too."""
    from harness.results.labels import backend_name

    base_ratio = {}
    for (i, _), change in zip(pairs, result.cells):
        row = ta.iloc[i]
        if backend_name(row) == row["baseline"]:  # the canonical name[:variant][@versions], as configs write it
            base_ratio[row["group"]] = change.ratio
    for (i, _), change in zip(pairs, result.cells):
        change.baseline_ratio = base_ratio.get(ta.iloc[i]["group"])


def _fmt_speedups(c: CellChange) -> str:
    if c.speedup_a is None and c.speedup_b is None:
        return "-"

    from harness.results.labels import fmt_ratio

    def one(p, lo, hi):
        return fmt_ratio(p, lo, hi)

    from harness.results.labels import MISSED_MARK, MISSED_NAME

    mark = {True: "overlap", False: "apart", None: ""}[c.speedups_agree] + (f" ({MISSED_MARK} {MISSED_NAME})" if c.loose else "")
    return (f"A {one(c.speedup_a, c.speedup_a_lo, c.speedup_a_hi)}\nB {one(c.speedup_b, c.speedup_b_lo, c.speedup_b_hi)}"
            + (f"\n{mark}" if mark else ""))


def _fmt_ratio(c: CellChange) -> str:
    from harness.results.labels import fmt_ratio

    return fmt_ratio(c.ratio, c.ratio_lo, c.ratio_hi)


VERDICT_STYLE = {"regression": "bold red", "broken": "bold red", "slower": "yellow", "faster": "green",
                 "fixed": "green", "within noise": "", "not timed": "dim"}


def print_comparison(result: Comparison, console) -> None:
    """The comparison as a rich table plus the unmatched cells and a verdict line."""
    from rich.markup import escape
    from rich.table import Table

    from harness.results.labels import fmt_ratio, fmt_seconds

    title = (f"B {result.run_b} against A {result.run_a}: B's speedup over A (A's median over B's: above 1x, "
             "B is faster)")
    table = Table(title=title)
    for col, justify in (("cell", "left"), ("A median", "right"), ("B median", "right"),
                         ("B over A [95% CI]", "right"), ("p (M-W U)", "right"), ("B over A / baseline's", "right"),
                         ("speedup over baseline [95% CI]", "right"), ("verdict", "left")):
        table.add_column(col, justify=justify, no_wrap=col == "verdict")
    for c in result.cells:
        p = f"{c.p_value:.2g}" if c.p_value is not None and np.isfinite(c.p_value) else "-"
        rel = "-"
        if c.ratio is not None and c.baseline_ratio and np.isfinite(c.ratio) and np.isfinite(c.baseline_ratio):
            rel = fmt_ratio(c.ratio / c.baseline_ratio)
        verdict = c.verdict if c.verdict != "not timed" else f"not timed ({c.status_a} -> {c.status_b})"
        if c.verdict in ("broken", "fixed"):
            verdict = f"{c.verdict} ({c.status_a} -> {c.status_b})"
        style = VERDICT_STYLE.get(c.verdict, "")
        table.add_row(escape(c.cell), fmt_seconds(c.median_a_s) if c.median_a_s else "-",
                      fmt_seconds(c.median_b_s) if c.median_b_s else "-", _fmt_ratio(c), p, rel, _fmt_speedups(c),
                      f"[{style}]{escape(verdict)}[/]" if style else escape(verdict))
    if result.cells:
        console.print(table)
    else:
        console.print(f"no cells in common between {escape(result.run_a)} and {escape(result.run_b)}", highlight=False)
    if result.machine_a != result.machine_b:
        console.print(f"note: different machines: A {escape(result.machine_a)}; B {escape(result.machine_b)}", highlight=False)
    for name, cells in (("only in A", result.only_a), ("only in B", result.only_b)):
        for cell in cells:
            console.print(f"  {name}: {escape(cell)}", highlight=False)
    regs = result.regressions
    if regs:
        console.print(f"[bold red]{len(regs)} regression(s)[/] (speedup intervals apart and the speedup down by "
                      f"more than {result.threshold:g}x; for the baseline and cells without one, time significant at "
                      f"alpha {result.alpha} and B over A below {1 / result.threshold:.3g}x; or newly failing):",
                      highlight=False)
        for c in regs:
            figure = _fmt_speedups(c).replace("\n", "; ") if c.speedups_agree is not None else _fmt_ratio(c)
            console.print(escape(f"  {c.cell}: {figure} {c.status_a} -> {c.status_b}"), highlight=False)
    else:
        console.print(f"no regression beyond {result.threshold:g}x (alpha {result.alpha})", highlight=False)
