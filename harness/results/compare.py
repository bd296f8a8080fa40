"""Two runs side by side, cell by cell, in the form CI can act on.

The figure judged is the one host drift between the runs cannot move: each run's speedup over its own
baseline (rounds paired within the run), compared across the runs, ``B over A`` = B's speedup over its
baseline / A's (above 1x, the backend is faster in B relative to its baseline), with a 95% interval from
both runs' intervals (their log half-widths added in quadrature). The ratio of absolute times (A's median
over B's) is shown beside it as context; it is judged only for cells without a speedup interval (the
baseline itself), and only when both runs ran on the same machine with no cell contended or unsteady:
the runs were timed minutes or days apart, so their rounds are not paired, and a drifting host moves that
ratio as much as any change of code. Its interval comes from resampling each run's rounds on its own, its
significance from a Mann-Whitney U test.

A cell whose time was contended or unsteady (:mod:`harness.results.standing`) in either run gets that
verdict and never counts as a regression. The exit code (``harness compare``): 0 when no trusted cell
regressed and every cell could be judged; 1 when a cell regressed (B slower than A beyond the threshold,
its interval below 1x, both cells trusted) or a cell that ran in A fails in B; 3 when no cell regressed but
some could not be compared fairly (contended or unsteady in either run): rerun on a quiet machine.

Cells are matched by ``cell_id``, or, where ids differ (a renamed sweep, another
config file), by the columns that say what a cell measures.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from harness.results.standing import Standing
from harness.run.stats import mann_whitney_p, ratio_interval
from harness.spec.errors import HarnessError
from harness.spec.status import Status, FAILED

#: ``harness compare``'s exit codes: a regression between trusted cells; cells that could not be compared fairly
EXIT_REGRESSION = 1
EXIT_UNFAIR = 3

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
    backend: str = ""  # the backend as the tables name it
    problem: str = ""  # the problem (workload and group), the heading it is printed under
    median_a_s: float | None = None
    median_b_s: float | None = None
    n_a: int = 0
    n_b: int = 0
    # the drift-robust figure, judged: B's speedup over its baseline / A's, with a 95% interval
    # (above 1x, faster in B relative to the baseline); None for the baseline itself and cells without intervals
    over: float | None = None
    over_lo: float | None = None
    over_hi: float | None = None
    # context: A's median time over B's (above 1x, faster in B), judged only where ``judged_on`` says "time"
    ratio: float | None = None
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    p_value: float | None = None
    significant: bool = False
    baseline_ratio: float | None = None  # the same time ratio for the group's baseline backend (machine drift)
    speedup_a: float | None = None  # over the group's baseline, within run A, with its 95% interval
    speedup_a_lo: float | None = None
    speedup_a_hi: float | None = None
    speedup_b: float | None = None
    speedup_b_lo: float | None = None
    speedup_b_hi: float | None = None
    speedups_agree: bool | None = None  # the two intervals overlap (None: not both have one)
    loose: bool = False  # a side's interval is wider than its precision target (precision_met false)
    standing_a: str | None = None  # each cell's time standing (harness.results.standing): trusted, contended, unsteady
    standing_b: str | None = None
    judged_on: str | None = None  # "speedups" (the drift-robust ratio), "time" (absolute times), None (not judged)
    why: str = ""  # a verdict's reason where it is no plain figure (contended, not judged)
    # regression | slower | faster | within noise | contended | unsteady | not judged | not timed | broken | fixed
    verdict: str = "within noise"

    @property
    def unfair(self) -> bool:
        """A cell that could not be compared fairly: contended or unsteady in either run."""
        return self.verdict in (Standing.CONTENDED.value, Standing.UNSTEADY.value)


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
    disturbed_a: dict = field(default_factory=dict)  # {"contended": n, "unsteady": n, "timed": n} of each run's cells
    disturbed_b: dict = field(default_factory=dict)

    @property
    def same_machine(self) -> bool:
        return self.machine_a == self.machine_b

    @property
    def regressions(self) -> list[CellChange]:
        """Trusted cells significantly slower beyond the threshold, and cells that ran in A but fail in B."""
        return [c for c in self.cells if c.verdict in ("regression", "broken")]

    @property
    def unfair(self) -> list[CellChange]:
        """Cells that could not be compared fairly (contended or unsteady in either run)."""
        return [c for c in self.cells if c.unfair]

    @property
    def exit_code(self) -> int:
        """0: nothing regressed and every cell was judged fairly; :data:`EXIT_REGRESSION` on a regression;
        :data:`EXIT_UNFAIR` when none regressed but some cells could not be compared fairly."""
        return EXIT_REGRESSION if self.regressions else EXIT_UNFAIR if self.unfair else 0

    def to_json(self) -> str:
        """The whole comparison as JSON (NaN written as null)."""
        def clean(v):
            if isinstance(v, float) and not np.isfinite(v):
                return None
            return v

        cells = [{k: clean(v) for k, v in asdict(c).items()} for c in self.cells]
        data = {"run_a": self.run_a, "run_b": self.run_b, "threshold": self.threshold, "alpha": self.alpha,
                "machine_a": self.machine_a, "machine_b": self.machine_b, "same_machine": self.same_machine,
                "disturbed_a": self.disturbed_a, "disturbed_b": self.disturbed_b, "cells": cells,
                "only_a": self.only_a, "only_b": self.only_b,
                "regressions": [c.cell for c in self.regressions], "unfair": [c.cell for c in self.unfair],
                "exit_code": self.exit_code}
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
    """A run's machine as the reports name it (host, CPU, cores, vector flags, GPU): two runs are of one
    machine only where these agree."""
    from harness.results.labels import machine_label

    return machine_label(meta)


def _samples(row) -> np.ndarray:
    s = row.get("samples_s")
    return np.asarray([] if s is None else list(s), dtype=np.float64)


def _disturbed(timings: pd.DataFrame) -> dict:
    """How many of a run's timed cells were contended and unsteady (:mod:`harness.results.standing`)."""
    from harness.results.standing import counts

    n = counts(timings, "time")
    return {"timed": sum(n.values()), "contended": n.get(Standing.CONTENDED, 0), "unsteady": n.get(Standing.UNSTEADY, 0)}


def compare_runs(run_a, run_b, threshold: float = 1.05, alpha: float = ALPHA) -> Comparison:
    """Compare run B against run A cell by cell; see :class:`Comparison` and the module's words."""
    from harness.results.labels import backend_label, group_label, optional_text
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
                        only_b=[_cell_name(tb.iloc[j]) for j in only_b],
                        disturbed_a=_disturbed(ta), disturbed_b=_disturbed(tb))
    # an absolute-time ratio is judged only between quiet, steady runs of one machine
    quiet = result.same_machine and not any(result.disturbed_a[k] or result.disturbed_b[k]
                                            for k in ("contended", "unsteady"))
    for i, j in pairs:
        ra, rb = ta.iloc[i], tb.iloc[j]
        change = CellChange(_cell_name(ra), ra["cell_id"], rb["cell_id"], ra["status"], rb["status"],
                            backend=str(ra["label"]), problem=f"{ra['workload']} {group_label(ra)}")
        va, vb = optional_text(ra.get("backend_version")), optional_text(rb.get("backend_version"))
        if va and vb and va != vb:  # the main environment's library moved between the runs: say so
            change.cell += f" ({ra['backend']} {va} -> {vb})"
            change.backend += f" ({va} -> {vb})"
        _judge(change, ra, rb, threshold, alpha, quiet, result.same_machine)
        result.cells.append(change)
    _baseline_drift(result, ta, pairs)
    if not any((c.ratio is not None and np.isfinite(c.ratio)) or c.verdict in ("broken", "fixed") for c in result.cells):
        # cells in common but none timed in both runs: comparing them shows nothing, not "no regression"
        raise HarnessError(f"{run_b}: no cell timed in both runs ({len(result.cells)} cell(s) in common with "
                           f"{run_a}, none ok in both); nothing to compare")
    return result


def _judge(change: CellChange, ra, rb, threshold: float, alpha: float, quiet: bool, same_machine: bool) -> None:
    """One cell's figures and verdict (the module's rules)."""
    from harness.results.standing import of, why

    if ra["status"] == Status.OK and rb["status"] in FAILED:
        change.verdict = "broken"
        return
    if ra["status"] in FAILED and rb["status"] == Status.OK:
        change.verdict = "fixed"
        return
    if ra["status"] != Status.OK or rb["status"] != Status.OK:
        change.verdict = "not timed"
        return
    _speedups(change, ra, rb)
    sa, sb = _samples(ra), _samples(rb)
    if sa.size and sb.size:
        change.median_a_s, change.median_b_s = float(np.median(sa)), float(np.median(sb))
        change.n_a, change.n_b = int(sa.size), int(sb.size)
        change.ratio, change.ratio_lo, change.ratio_hi = ratio_interval(sb, sa)  # median A / median B
        change.p_value = mann_whitney_p(sa, sb)
    elif pd.notna(ra.get("median_s")) and pd.notna(rb.get("median_s")):  # rows without their rounds: medians alone
        change.median_a_s, change.median_b_s = float(ra["median_s"]), float(rb["median_s"])
        change.ratio = change.median_a_s / change.median_b_s
    sta, stb = of(ra, "time"), of(rb, "time")
    change.standing_a, change.standing_b = (s.value if s is not None else None for s in (sta, stb))
    for kind in (Standing.CONTENDED, Standing.UNSTEADY):  # the machine, not the code, may have moved these
        for st, row, run in ((sta, ra, "A"), (stb, rb, "B")):
            if st == kind:
                change.verdict, change.why = kind.value, f"{kind.value} in {run}: {why(row, 'time')}"
                return
    if change.over is not None:
        change.judged_on = "speedups"
        _verdict(change, change.over, change.over_lo, change.over_hi, threshold)
        return
    if not quiet:
        change.verdict = "not judged"
        change.why = ("the runs ran on different machines: only speedups within each run are judged"
                      if not same_machine else
                      "absolute time only, and a run had contended or unsteady cells: a drifting host moves it")
        return
    if change.ratio is None or not np.isfinite(change.ratio):
        change.verdict = "not judged"
        change.why = "no time in one run"
        return
    change.judged_on = "time"
    lo, hi = change.ratio_lo, change.ratio_hi
    has = lo is not None and hi is not None and np.isfinite(lo) and np.isfinite(hi)
    tested = change.p_value is not None and np.isfinite(change.p_value) and change.p_value < alpha
    if not (has and tested):
        change.verdict = "within noise"
        return
    _verdict(change, change.ratio, lo, hi, threshold)


def _verdict(change: CellChange, value: float, lo: float, hi: float, threshold: float) -> None:
    """The verdict of a judged ratio (above 1x, faster in B): a change only where its interval excludes 1x, a
    regression where it lies below 1x and the ratio is below 1/threshold."""
    if not (lo is not None and hi is not None and np.isfinite(lo) and np.isfinite(hi)):
        change.verdict = "within noise"
        return
    if hi < 1:
        change.significant = True
        change.verdict = "regression" if value < 1 / threshold else "slower"
    elif lo > 1:
        change.significant = True
        change.verdict = "faster"
    else:
        change.verdict = "within noise"


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


def over_interval(a: tuple[float, float, float], b: tuple[float, float, float]) -> tuple[float, float, float]:
    """B's speedup over A's, ``b / a``, with a 95% interval from the two intervals (independent runs): each
    side's log half-width on the side that moves the ratio that way, added in quadrature."""
    (pa, la, ha), (pb, lb, hb) = a, b
    point = pb / pa
    down = np.hypot(np.log(pb / lb), np.log(ha / pa))
    up = np.hypot(np.log(hb / pb), np.log(pa / la))
    return float(point), float(point * np.exp(-down)), float(point * np.exp(up))


def _speedups(change: CellChange, ra, rb) -> None:
    """Both runs' speedups, whether their intervals overlap, and the drift-robust ratio between them. The
    baseline's is its own 1x [1, 1]: an interval of no width is no interval to compare."""
    a, b = _interval(ra), _interval(rb)
    a, b = (None if v is None or v[1] == v[2] or min(v) <= 0 else v for v in (a, b))
    if a is not None:
        change.speedup_a, change.speedup_a_lo, change.speedup_a_hi = a
    if b is not None:
        change.speedup_b, change.speedup_b_lo, change.speedup_b_hi = b
    if a is not None and b is not None:
        change.speedups_agree = bool(a[1] <= b[2] and b[1] <= a[2])
        change.loose = _flag(ra, "precision_met") is False or _flag(rb, "precision_met") is False
        change.over, change.over_lo, change.over_hi = over_interval(a, b)


def _baseline_drift(result: Comparison, ta: pd.DataFrame, pairs) -> None:
    """Attach to every cell its group's baseline's time ratio of B over A: a shift of the machine shows there too."""
    from harness.results.labels import backend_name

    base_ratio = {}
    for (i, _), change in zip(pairs, result.cells):
        row = ta.iloc[i]
        if backend_name(row) == row["baseline"]:  # the canonical name[:variant][@versions], as configs write it
            base_ratio[row["group"]] = change.ratio
    for (i, _), change in zip(pairs, result.cells):
        change.baseline_ratio = base_ratio.get(ta.iloc[i]["group"])


VERDICT_STYLE = {"regression": "bold red", "broken": "bold red", "slower": "yellow", "faster": "green",
                 "fixed": "green", "within noise": "", "not timed": "dim", "contended": "magenta",
                 "unsteady": "magenta", "not judged": "dim"}


def _run_line(name: str, run: str, n: dict) -> str:
    parts = [f"{n[k]} {k}" for k in ("contended", "unsteady") if n.get(k)]
    if not parts:
        return f"{name} {run}: {n.get('timed', 0)} timed cells, none contended or unsteady"
    return (f"{name} {run}: {' and '.join(parts)} of {n.get('timed', 0)} timed cells; their verdicts say so and "
            f"never count as regressions: rerun {name} on a quiet machine to judge them")


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(1, width - 1)] + "…"


def print_comparison(result: Comparison, console) -> None:
    """The comparison in at most the console's width (80 columns fit): what disturbed each run and whether the
    machines differ first, then per problem a heading and a line per cell (backend, B over A with its
    interval, the time ratio as context, the verdict), the unmatched cells and the verdict line. Columns are
    dropped before numbers are cut."""
    from rich.markup import escape

    from harness.results.labels import fmt_ratio

    width = max(60, min(int(getattr(console, "width", 80) or 80), 80))

    def say(text: str, style: str = "") -> None:  # prose in lines of the table's width, whatever the console's
        for line in textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False) or [""]:
            console.print(f"[{style}]{escape(line)}[/]" if style else escape(line), highlight=False, soft_wrap=True)

    say(f"B {result.run_b} against A {result.run_a}", "bold")
    for name, run, n in (("A", result.run_a, result.disturbed_a), ("B", result.run_b, result.disturbed_b)):
        say(_run_line(name, run, n), "bold magenta" if n.get("contended") or n.get("unsteady") else "")
    if not result.same_machine:
        say(f"different machines: A {result.machine_a}; B {result.machine_b}. Only each run's speedups over its own "
            "baseline are compared; absolute times across machines are shown as context, never judged.", "bold yellow")
    say("B/A: B's speedup over its baseline / A's (above 1x: faster in B); time: A's median / B's (context).")
    over_w, time_w, verdict_w = 22, 7, 24
    show_time = width >= 2 + 12 + over_w + time_w + verdict_w + 3  # the context column goes first
    room = width - 2 - over_w - verdict_w - 2 - ((time_w + 1) if show_time else 0)
    backend_w = min(room, max([len("backend")] + [len(c.backend or c.cell) for c in result.cells]))
    head = f"  {'backend':<{backend_w}} {'B/A [95% CI]':>{over_w}}" + (f" {'time':>{time_w}}" if show_time else "") \
        + f" {'verdict'}"
    last = None
    for c in result.cells:
        if c.problem != last:
            say(_fit(c.problem or c.cell, width), "bold")
            say(head, "dim")
            last = c.problem
        over = fmt_ratio(c.over, c.over_lo, c.over_hi) if c.over is not None else "-"
        if c.loose and over != "-":
            over += " †"
        time = fmt_ratio(c.ratio) if c.ratio is not None else "-"
        verdict = c.verdict
        if c.verdict in ("broken", "fixed", "not timed"):
            verdict = f"{c.verdict} ({c.status_a} -> {c.status_b})"
        line = f"  {_fit(c.backend or c.cell, backend_w):<{backend_w}} {_fit(over, over_w):>{over_w}}" \
            + (f" {_fit(time, time_w):>{time_w}}" if show_time else "") + " "
        style = VERDICT_STYLE.get(c.verdict, "")
        verdict = _fit(verdict, width - len(line))
        console.print(escape(line) + (f"[{style}]{escape(verdict)}[/]" if style else escape(verdict)),
                      highlight=False, soft_wrap=True)
    if any(c.loose for c in result.cells):
        say("† a speedup's interval is wider than its precision target: the B/A interval is as loose.")
    for name, cells in (("only in A", result.only_a), ("only in B", result.only_b)):
        for cell in cells:
            say(f"  {name}: {cell}")
    unfair = result.unfair
    if unfair:
        say(f"{len(unfair)} cell(s) could not be compared fairly (contended or unsteady in a run: see the first "
            f"lines); exit code {EXIT_UNFAIR} unless a trusted cell regressed.", "magenta")
    regs = result.regressions
    if regs:
        say(f"{len(regs)} regression(s) between trusted cells (B/A below {1 / result.threshold:.3g}x with its "
            f"interval below 1x; for the baseline on one quiet machine, its time at alpha {result.alpha}; or newly "
            f"failing):", "bold red")
        for c in regs:
            figure = (fmt_ratio(c.over, c.over_lo, c.over_hi) if c.judged_on == "speedups"
                      else f"time {fmt_ratio(c.ratio, c.ratio_lo, c.ratio_hi)}" if c.judged_on == "time" else "")
            say(f"  {c.cell}: {figure} ({c.status_a} -> {c.status_b})")
    else:
        say(f"no regression beyond {result.threshold:g}x between trusted cells")
