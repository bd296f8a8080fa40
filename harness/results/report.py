"""``report.md`` and a self-contained ``report.html`` for one run, from its results folder only.

The report is built once as a list of blocks (headings, paragraphs, tables, images,
preformatted text) and rendered twice: to Markdown that links ``plots/*.png``, and to
HTML with every image embedded as a base64 data URI, so the file can be mailed or
archived alone.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness.run import stats
from harness.spec.errors import HarnessError
from harness.results.report_blocks import (Bullets, Fold, Heading, Hover, Image, Para, Pre, Table, _f,  # noqa: F401
                                           _first_line, _num, fmt_time)
from harness.results.report_sections import (_conformance_section, _devices_section, _failures_section,  # noqa: F401
                                             _labels, _machine_section, _run_section, _training_section,
                                             _versions_section, timing_summary)
from harness.results import caveats, standing
from harness.results.schema import SPEEDUP_BLOCK
from harness.spec.status import Status
from harness.spec.writes import check_file, prepare_folder, write_file


# -- formatting ----------------------------------------------------------------------------------
def spread_warnings(timings) -> list[str]:
    """Cells whose interquartile range exceeds SPREAD_LIMIT of the median: their figures deserve less trust."""
    from harness.results.labels import backend_label, group_label

    df = pd.DataFrame(timings)
    if df.empty:
        return []
    df["label"] = backend_label(df)
    warn = []
    for _, r in df.iterrows():
        if r.get("status") == Status.OK and r.get("median_s") and pd.notna(r.get("iqr_s")) and r.get("workload") != "train":
            rel = stats.spread(r["iqr_s"], r["median_s"])
            if np.isfinite(rel) and rel > stats.SPREAD_LIMIT:
                warn.append(f"{r['label']} ({r['workload']} {group_label(r)}): IQR is {rel:.0%} of the median")
    return warn


from harness.results.labels import MISSED_MARK, MISSED_NAME, imprecise  # noqa: E402,F401  (one home)


def fmt_speedup(row, mark: bool = False) -> str:
    """``1.23x [1.10, 1.40]`` or ``-``, followed by the mark of its standing (:mod:`harness.results.standing`)
    where it is not trusted: with ``mark`` (the report's tables, whose legend explains the marks)
    ``1.23x [1.10, 1.40] †`` with the evidence on hover, else the evidence in words beside it."""
    out = _fmt_ratio(row.get("speedup"), row.get("speedup_lo"), row.get("speedup_hi"))
    return _with_standing(out, row, "speedup", mark)


def fmt_median(row) -> str:
    """A cell's median time, marked where a disturbed machine timed it (contended, unsteady) with the evidence
    on hover: the reference's own row, which has no speedup to mark, carries it too."""
    out = fmt_time(row.get("median_s"))
    s = standing.of(row, "time")
    if out == "-" or s is None or not s.disturbed:
        return out
    return Hover(f"{out} {standing.MARKS[s]}", standing.why(row, "time"))


def _with_standing(out: str, row, column: str, mark: bool) -> str:
    """A ratio's text with its standing's mark, the evidence on hover (``mark``) or in words."""
    if out == "-":
        return out
    sign, evidence = standing.mark(row, column), standing.why(row, column)
    if not sign:
        return out
    return Hover(f"{out} {sign}", evidence) if mark else f"{out} {sign} {evidence}".rstrip()


def fmt_setting_speedup(row, mark: bool = True) -> str:
    """A paired setting's ratio (pair_over): the backend's time at the first setting over its time at
    this one, ``1.85x [1.80, 1.90]``, or ``-``, with the mark of its standing as :func:`fmt_speedup`'s."""
    s, lo, hi = row.get("setting_speedup"), row.get("setting_speedup_lo"), row.get("setting_speedup_hi")
    if _num(s) and _num(lo) and _num(hi) and lo == hi:  # the first setting's own row: no ratio to read
        return "1x (itself)"
    return _with_standing(_fmt_ratio(s, lo, hi), row, "setting", mark)


def _fmt_ratio(s, lo, hi) -> str:
    """``1.23x [1.10, 1.40]``, ``1.23x`` without an interval, ``-`` without a ratio."""
    from harness.results.labels import fmt_ratio

    return fmt_ratio(s, lo, hi)


def fmt_processes(row) -> str:
    """How many fresh worker processes a median comes from, with the spread of their own medians:
    ``2 (spread 2.6%)`` (the slowest minus the fastest, relative), ``1``, or ``-`` where unrecorded."""
    n = row.get("n_worker_processes")
    if not _num(n):
        return "-"
    spread = row.get("process_spread")
    return f"{int(n)} (spread {spread:.1%})" if _num(spread) else f"{int(n)}"


def precision_note(timings: pd.DataFrame, mark: str = MISSED_MARK) -> str | None:
    """One sentence on the speedups whose interval is wider than their precision target, or None when none is."""
    if "precision_met" not in timings:
        return None
    n = sum(imprecise(r) for r in timings.to_dict("records"))
    if not n:
        return None
    return (f"{n} speedup(s) hit max_time_s or max_passes before their 95% interval narrowed to the precision "
            f"target (marked {mark} {standing.imprecise_name(timings)}): read them as loose, not as tight figures.")


def legend_text(timings: pd.DataFrame, columns=("speedup",)) -> str:
    """The sentence under a table that names the marks its figures carry ("" when every one is trusted)."""
    words = standing.legend(timings, columns)
    return f"Marks: {words}." if words else ""


def speedup_note(group: pd.DataFrame) -> str:
    """Empty when a group's speedups are over its baseline; otherwise what they are over, and why."""
    head = group.iloc[0]
    status = head.get("baseline_status")
    if not isinstance(status, str) or status == Status.OK or head.get("workload") == "train":  # training has no speedups
        return ""
    over = group[group["speedup_over"].notna()] if "speedup_over" in group else group.iloc[:0]
    if over.empty:
        return f"baseline {head['baseline']} is {status} and no backend here ran ok: no speedups"
    ref = over.iloc[0]["speedup_over"]
    kind = "verified" if "verified_ratio" in group and group["verified_ratio"].notna().any() else "ok"
    return f"baseline {head['baseline']} is {status}: speedups are over {ref}, the fastest {kind} backend here"


# -- building the report -------------------------------------------------------------------------
@dataclass
class GroupAnswer:
    """A comparison group's answer: who is fastest (a name, ``tie: A and B``, or none named), what it gains
    over the baseline, its lead over the runner-up with that ratio's interval, and the winner's row (None
    when no winner may be named: a tie, a contended machine, nothing ran)."""

    fastest: str
    gain: str
    margin: str
    winner: object = None
    tie: bool = False

    def __iter__(self):  # fastest, gain, winner: what a caller unpacks
        return iter((self.fastest, self.gain, self.winner))


def group_answer(group: pd.DataFrame) -> GroupAnswer:
    """A comparison group's answer (its rows carry ``label``): the fastest backend that ran with its median,
    what it gains (its speedup over the baseline with the 95% interval) and its lead over the runner-up (the
    runner-up's time over its own, paired, with its interval: :func:`harness.results.standing.lead`). The
    fastest is named only where that lead's interval lies above 1x; otherwise the group is a tie, ``tie: jax
    and numpy``, with the lead beside it. Where the reference (the baseline, or the fastest ok stand-in of a
    failed one) is itself the fastest, the words say so with the runner-up's speedup, ``numpy fastest; next:
    jax 0.93x [0.9, 0.95]``, not a ``1x [1, 1]``."""
    ran = group[(group["status"] == Status.OK) & group["median_s"].notna()].sort_values("median_s", kind="stable")
    if ran.empty:
        return GroupAnswer("-", "-", "-")
    best = ran.iloc[0]
    text = f"{best['label']} ({fmt_time(best['median_s'])})"
    lo, hi = best.get("speedup_lo"), best.get("speedup_hi")
    is_reference = _num(lo) and _num(hi) and lo == hi
    if len(ran) == 1:
        gain = fmt_speedup(best, mark=True) if not is_reference else f"{best['label']} alone ran"
        fastest = caveats.fastest(group, best, text)
        return GroupAnswer(fastest, gain, "-", best if fastest == text else None)
    runner = ran.iloc[1]
    (point, m_lo, m_hi), lead, evidence = standing.lead(best, runner)
    margin = f"{_fmt_ratio(point, m_lo, m_hi)} over {runner['label']}"
    sign = standing.MARKS.get(lead, "") if lead is not None else ""
    if sign:
        margin = Hover(f"{margin} {sign}", evidence)
    if is_reference:
        runner_up = fmt_speedup(runner, mark=True)
        words = f"{best['label']} fastest; next: {runner['label']} {runner_up}"
        gain = Hover(words, runner_up.title) if isinstance(runner_up, Hover) else words
    else:
        gain = fmt_speedup(best, mark=True)
    fastest = caveats.fastest(group, best, text)  # never a winner from a contended machine
    if fastest != text:
        return GroupAnswer(fastest, gain, margin)
    if lead == standing.Standing.CONTENDED:
        return GroupAnswer(f"none named: the runner-up {runner['label']} timed on a contended machine", gain, margin)
    if not (_num(m_lo) and m_lo > 1):  # the lead's interval holds 1x (or there is none): no winner shown
        names = " and ".join(sorted([str(best["label"]), str(runner["label"])]))
        return GroupAnswer(f"tie: {names}", gain, margin, None, tie=True)
    return GroupAnswer(fastest, gain, margin, best)


def _winners(answers: list) -> str:
    """The Answer's first sentence: who was fastest in how many groups, ``The fastest backend per comparison
    group: native in 8 of 10 groups, numpy (the baseline) in 1; a tie in 1.`` ("" when no group named one)."""
    from harness.results.labels import backend_name

    named = [a.winner for a in answers if a.winner is not None]
    ties = sum(a.tie for a in answers)
    if not named and not ties:
        return ""
    counts: dict[str, int] = {}
    for row in named:
        who = row["label"] + (" (the baseline)" if str(row.get("baseline")) == backend_name(row) else "")
        counts[who] = counts.get(who, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])  # stable: ties in the order the table meets them
    parts = [f"{who} in {n}" + (f" of {len(answers)} groups" if i == 0 else "") for i, (who, n) in enumerate(ranked)]
    tied = (f"a tie (no lead over the runner-up beyond its 95% interval) in {ties}"
            + ("" if parts else f" of {len(answers)} groups")) if ties else ""
    return f"The fastest backend per comparison group: {'; '.join(p for p in (', '.join(parts), tied) if p)}."


def winners_line(timings: pd.DataFrame) -> str:
    """Who was fastest in how many comparison groups (:func:`_winners`), from a run's rows."""
    from harness.results.labels import reading_order

    timed = timings[timings["workload"] != "train"] if len(timings) else timings
    if timed.empty:
        return ""
    df = timed.assign(label=_labels(timed))
    return _winners([group_answer(g) for _, g in reading_order(df.groupby(SPEEDUP_BLOCK, sort=False, dropna=False))])


def _answer_section(timings: pd.DataFrame, meta: dict | None = None) -> list:
    """The report's first table: per comparison group, in :func:`reading_order`, the fastest backend that ran
    (or the tie), what it gains over the baseline and its lead over the runner-up (:func:`group_answer`), the
    cells that did not run, and the speedups whose interval is wider than the precision target; above it,
    who was fastest in how many groups."""
    from harness.results.labels import group_label, reading_order

    timed = timings[timings["workload"] != "train"] if len(timings) else timings
    if timed.empty:
        return []
    df = standing.with_standing(timed).assign(label=_labels(timed))
    targets = standing.precision_targets(df)
    rows, answers = [], []
    for _, g in reading_order(df.groupby(SPEEDUP_BLOCK, sort=False, dropna=False)):
        head = g.iloc[0]
        answer = group_answer(g)
        answers.append(answer)
        missing = g[g["status"] != Status.OK]
        not_run = ", ".join(f"{r['label']}: {r['status']}" for _, r in missing.iterrows()) or "-"
        missed = sum(standing.of(r) == standing.Standing.IMPRECISE for r in g.to_dict("records"))  # as marked
        rows.append([f"{head['workload']} · {group_label(head)}", answer.fastest, answer.gain, answer.margin,
                     (str(missed) if missed else "-") if targets else "no precision target",
                     _first_line(not_run, 120)])
    first = _winners(answers)
    legend = legend_text(df)
    return [Heading(2, "Answer")] + [Para(line) for line in caveats.lines(meta or {}, timings)] + \
        ([Para(first)] if first else []) + [
            Para("Per comparison group, a sweep's batches in a run of rows: the fastest backend that ran (its median) "
                 "and its speedup over the baseline with the 95% interval (where the baseline is itself the fastest, "
                 "the runner-up's), and its lead over the runner-up (the runner-up's time over its own, from the "
                 "rounds they took in turn, with the paired 95% interval). A backend is named fastest only where "
                 "that lead's interval lies above 1x; otherwise the group is a tie. "
                 + ("" if targets else "The run set no precision target. ")
                 + (f"{legend} " if legend else "") + "Details in Results below."),
            Table(["problem", "fastest", "speedup [95% CI]", "lead over the runner-up [95% CI]",
                   f"{MISSED_MARK} in group" if targets else "precision", "did not run"], rows,
                  right={2, 3, 4})]


def paired_answer(timings: pd.DataFrame) -> list:
    """Under ``pair_over``, the question the run asks, answered first: per problem and backend, its median at
    the first setting and at each other one, and the speedup there over the first (that setting's time over
    this one's) with its paired 95% interval, or why a cell has none. Empty for a run without paired settings."""
    from harness.results.labels import group_label, setting_label
    from harness.results.schema import setting_values

    if "setting_baseline" not in timings:
        return []
    df = timings[timings["setting_baseline"].notna() & (timings["workload"] != "train")]
    if df.empty or df["setting_speedup"].isna().all():
        return []
    df = standing.with_standing(df).assign(label=_labels(df))
    base = setting_values(str(df["setting_baseline"].iloc[0]))
    keys = list(base)
    first = setting_label(base, keys)
    df = df.assign(setting=[setting_label(r, keys) for _, r in df.iterrows()],
                   problem=[f"{r['workload']} · {group_label(r, omit=tuple(keys))}" for _, r in df.iterrows()])
    rows = []
    for (problem, label), g in df.groupby(["problem", "label"], sort=False):
        at = {r["setting"]: r for _, r in g.iterrows()}
        ref = at.get(first)
        for setting, r in at.items():
            if setting == first:
                continue
            ok = r["status"] == Status.OK
            rows.append([problem, label, fmt_median(ref) if ref is not None and ref["status"] == Status.OK
                         else str(ref["status"]) if ref is not None else "-",
                         fmt_median(r) if ok else str(r["status"]),
                         fmt_setting_speedup(r) if ok else "-"])
    if not rows:
        return []
    others = " / ".join(dict.fromkeys(s for s in df["setting"] if s != first))
    legend = legend_text(df, ("setting", "time"))
    return [Heading(2, "Answer"),
            Para(f"The run paired {' and '.join(keys)} (pair_over): what {others} buys each backend against its own "
                 f"{first}, timed in turn in one group. The speedup is {first}'s median over {others}'s (above 1x, "
                 f"{others} is faster), with its paired 95% interval." + (f" {legend}" if legend else "")),
            Table(["problem", "backend", f"{first} median", f"{others} median", f"speedup over {first} [95% CI]"],
                  rows, right={2, 3, 4})]


def _results_section(timings: pd.DataFrame) -> list:
    from harness.results.labels import group_label, reading_order

    out: list = [Heading(2, "Results")]
    if timings.empty:
        out.append(Para("The run holds no cells."))
        return out
    df = standing.with_standing(timings).assign(label=_labels(timings))
    out.append(Para("Median time per call over calibrated rounds; IQR is the interquartile range of the rounds; "
                    "speedup is baseline median / backend median from rounds timed in turn, with a 95% paired-bootstrap "
                    "interval, widened to cover a drift between the rounds' halves and, with several worker processes "
                    "or passes, the t interval of their speedups' mean; compile is the warm-up (JIT/compile) time, "
                    "excluded from the rounds; processes: the fresh worker processes a median's rounds came from (in turn, "
                    "all passes), with the spread of their own medians (slowest minus fastest). Rounds slowed "
                    "by a burst of load are kept: on both sides of a pair the pairing cancels them, on one side "
                    "they widen the interval (timings.parquet counts them per cell)."))
    for _, g in reading_order(df.groupby(SPEEDUP_BLOCK, sort=False, dropna=False)):  # as the Answer lists them
        head = g.iloc[0]
        out.append(Heading(3, f"{head['workload']} · {group_label(head)}"))
        if speedup_note(g):
            out.append(Para(speedup_note(g) + "."))
        # a group timed over paired settings (pair_over): each cell against its own backend at the first setting
        setting = g["setting_baseline"].dropna() if "setting_baseline" in g else g.iloc[:0]
        paired = bool(len(setting)) and g["setting_speedup"].notna().any()
        rows = []
        for _, r in g.iterrows():
            rows.append([r["label"], r["status"], fmt_median(r), fmt_time(r.get("iqr_s")),
                         fmt_speedup(r, mark=True)] + ([fmt_setting_speedup(r)] if paired else [])
                        + [fmt_time(r.get("compile_s")), _f(r.get("n_samples") or None, ".0f"),
                           fmt_processes(r), _f(r.get("gflops"), ".3g")])
        heads = ["backend", "status", "median", "IQR", "speedup [95% CI]"]
        heads += [f"over its {setting.iloc[0]} [95% CI]"] if paired else []
        heads += ["compile", "rounds", "processes", "GFLOP/s"]
        out.append(Table(heads, rows, right=set(range(2, len(heads))), status_col=1))
    legend = legend_text(df, ("speedup", "setting", "time"))
    if legend:
        out.append(Para(legend + " The evidence of each: on hover in report.html, and in timings.parquet "
                                 "(`harness.load_run(...).timings`: the `*_standing` and `*_standing_why` columns)."))
    note = precision_note(timings, MISSED_MARK)
    if note:
        out.append(Para(note + " Each one's half-width and target: on hover in report.html, and in timings.parquet."))
    warnings = spread_warnings(timings.to_dict("records"))
    if warnings:
        out += [Para("Noisy cells (an IQR above 10% of the median: these medians deserve less trust):"), Bullets(warnings)]
    return out


def _plots_section(plots: list[Path], note: str) -> list:
    out: list = [Heading(2, "Plots")]
    if note:
        out.append(Para(note))
    if not plots:
        out.append(Para("The run has no data any plot needs."))
    for p in plots:
        out.append(Image(p, _captions().get(p.name, p.stem.replace("_", " "))))
    return out


def build_report(run_dir, plots: list[Path] | None = None, plot_note: str = "") -> tuple[str, list]:
    """The report's title and blocks for a results folder."""
    from harness.results.store import load_run

    run = load_run(run_dir)
    title = f"{run.meta.get('name', run.run_id)}: benchmark report"
    if plots is None:
        plots = sorted((Path(run_dir) / "plots").glob("*.png"), key=_plot_order)
    answer, paired = _answer_section(run.timings, run.meta), paired_answer(run.timings)
    if paired and answer:  # the caveats, the paired question, then the speedups over the baseline
        n_caveats = sum(1 for _ in caveats.lines(run.meta, run.timings))
        answer = (answer[:1 + n_caveats] + paired[1:] + [Heading(3, "Against the baseline")]
                  + answer[1 + n_caveats:])
    # the answer and the figures first; how, where and with what the run ran after them, the long parts
    # folded (as asv and pytest-benchmark put the environment after the results)
    blocks = (answer + _results_section(run.timings) + _devices_section(run.timings)
              + _plots_section(plots, plot_note) + _failures_section(run.timings)
              + _training_section(run.timings, run.curves)
              + _run_section(run.meta, run.timings, Path(run_dir)) + _machine_section(run.meta)
              + _versions_section(run.meta) + _conformance_section(run.meta, run.timings))
    return title, blocks


def _captions() -> dict[str, str]:
    """Each plot's caption, from the one registry of plots."""
    from harness.results.plots import PLOTS

    return {plot.file: plot.caption for plot in PLOTS}


def _plot_order(p: Path):
    names = list(_captions())
    return (names.index(p.name) if p.name in names else len(names), p.name)


# -- rendering -------------------------------------------------------------------------------------
def _md_cell(text: str) -> str:
    if isinstance(text, Hover) and str(text).endswith("..."):  # Markdown has no hover: a cut text whole
        text = text.title
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(title: str, blocks: list, base: Path) -> str:
    """Markdown with images linked relative to ``base`` (the run folder)."""
    out = [f"# {title}", ""]
    for b in blocks:
        out += _md_block(b, base)
    return "\n".join(out).rstrip() + "\n"


def _md_block(b, base: Path) -> list[str]:
    """One block's Markdown lines, a blank line after it."""
    out: list[str] = []
    if isinstance(b, Heading):
        out += ["#" * b.level + " " + b.text, ""]
    elif isinstance(b, Para):
        out += [b.text, ""]
    elif isinstance(b, Table):
        out.append("| " + " | ".join(_md_cell(h) for h in b.headers) + " |")
        out.append("|" + "|".join("---:" if i in b.right else "---" for i in range(len(b.headers))) + "|")
        out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
        out.append("")
    elif isinstance(b, Bullets):
        out += [f"- {item}" for item in b.items] + [""]
    elif isinstance(b, Image):
        rel = b.path.relative_to(base) if b.path.is_relative_to(base) else b.path
        out += [f"![{b.path.stem}]({rel.as_posix()})", "", f"*{b.caption}*", ""]
    elif isinstance(b, Pre):
        if b.summary:
            out.append(f"**{b.summary}**")
            out.append("")
        out += ["```", b.text.replace("```", "'''"), "```", ""]
    elif isinstance(b, Fold):  # GitHub renders <details> in Markdown; the blank lines let the Markdown inside render
        out += [f"<details><summary>{_inline(b.summary)}</summary>", ""]
        for inner in b.blocks:
            out += _md_block(inner, base)
        out += ["</details>", ""]
    return out


def _inline(text: str) -> str:
    """Escape for HTML, then turn `code` spans into <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(str(text)))


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1d2330;
       max-width: 1180px; margin: 24px auto; padding: 0 20px; line-height: 1.45; }
h1 { font-size: 1.7em; border-bottom: 2px solid #3b6fb6; padding-bottom: 6px; }
h2 { font-size: 1.3em; margin-top: 1.8em; border-bottom: 1px solid #d5dae3; padding-bottom: 4px; }
h3 { font-size: 1.02em; margin: 1.2em 0 0.4em; color: #2c4a78; }
table { border-collapse: collapse; margin: 0.4em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #d5dae3; padding: 4px 9px; text-align: left; vertical-align: top; }
th { background: #eef2f8; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.st-ok td.status, tr.st-pass td.status { background: #e6f4e6; }
tr.st-error td, tr.st-timeout td, tr.st-oom td, tr.st-diverged td, tr.st-mismatch td, tr.st-fail td { background: #fdecec; }
tr.st-unsupported td, tr.st-unavailable td { background: #f6f6f6; color: #555; }
code { background: #f1f3f6; padding: 0 3px; border-radius: 3px; font-size: 0.92em; }
pre { background: #f6f8fa; border: 1px solid #e1e4e8; padding: 8px; overflow-x: auto; font-size: 0.82em; }
figure { margin: 1em 0 2em; }
figure { overflow-x: auto; }
figure img { max-width: none; height: auto; border: 1px solid #e1e4e8; }
p.contents { font-size: 0.9em; color: #444; }
td[title] { text-decoration: underline dotted #8a94a6; cursor: help; }
figcaption { color: #555; font-size: 0.9em; margin-top: 4px; }
details summary { cursor: pointer; margin: 4px 0; }
"""


def _title(cell) -> str:
    return f' title="{html.escape(cell.title)}"' if isinstance(cell, Hover) and cell.title else ""


def _td_class(table: Table, i: int) -> str:
    names = (["num"] if i in table.right else []) + (["status"] if i == table.status_col else [])
    return f' class="{" ".join(names)}"' if names else ""


#: a browser's pixels per inch at 100% zoom: a plot shown at its drawn size in inches has the label sizes it
#: was drawn with
CSS_DPI = 96


def _css_width(png: bytes) -> int | None:
    """The width in CSS pixels at which a plot's labels read at the size they were drawn (its PNG header's
    width scaled from the drawing's resolution to the browser's); None for an image that is no PNG."""
    import struct

    from harness.results.plot_style import PLOT_DPI

    if png[:8] != b"\x89PNG\r\n\x1a\n" or len(png) < 24:
        return None
    return round(struct.unpack(">I", png[16:20])[0] * CSS_DPI / PLOT_DPI)


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")


def _contents(blocks: list) -> str:
    """A line of links to the report's sections and to each of its plots, so the plots are one click from the top."""
    links = []
    for b in blocks:
        if isinstance(b, Heading) and b.level == 2:
            links.append(f'<a href="#{_anchor(b.text)}">{html.escape(b.text)}</a>')
        elif isinstance(b, Image):
            links.append(f'<a href="#{_anchor("plot " + b.path.stem)}">{html.escape(b.path.stem)}</a>')
    return " · ".join(links)


def to_html(title: str, blocks: list) -> str:
    """A single HTML file: styles inline, images as base64 data URIs, nothing fetched from elsewhere."""
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(title)}</title>", f"<style>{CSS}</style>", "</head><body>",
           f"<h1>{html.escape(title)}</h1>"]
    contents = _contents(blocks)
    if contents:
        out.append(f'<p class="contents">{contents}</p>')
    for b in blocks:
        out += _html_block(b)
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _html_block(b) -> list[str]:
    """One block's HTML."""
    out: list[str] = []
    if isinstance(b, Heading):
        anchor = f' id="{_anchor(b.text)}"' if b.level == 2 else ""
        out.append(f"<h{b.level}{anchor}>{_inline(b.text)}</h{b.level}>")
    elif isinstance(b, Para):
        out.append(f"<p>{_inline(b.text)}</p>")
    elif isinstance(b, Table):
        out.append("<table>")
        if any(b.headers):
            out.append("<tr>" + "".join(f"<th>{_inline(h)}</th>" for h in b.headers) + "</tr>")
        for row in b.rows:
            cls = ""
            if b.status_col is not None:
                cls = f' class="st-{re.sub(r"[^a-z]", "", str(row[b.status_col]).lower())}"'
            cells = "".join(f"<td{_td_class(b, i)}{_title(c)}>{_inline(c)}</td>" for i, c in enumerate(row))
            out.append(f"<tr{cls}>{cells}</tr>")
        out.append("</table>")
    elif isinstance(b, Bullets):
        out.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in b.items) + "</ul>")
    elif isinstance(b, Image):
        raw = b.path.read_bytes()
        data = base64.b64encode(raw).decode("ascii")
        width = _css_width(raw)
        size = f' width="{width}"' if width else ""
        out.append(f'<figure id="{_anchor("plot " + b.path.stem)}"><img alt="{html.escape(b.path.stem)}"{size} '
                   f'src="data:image/png;base64,{data}">'
                   f"<figcaption>{_inline(b.caption)}</figcaption></figure>")
    elif isinstance(b, Pre):
        pre = f"<pre>{html.escape(b.text)}</pre>"
        out.append(f"<details><summary>{_inline(b.summary)}</summary>{pre}</details>" if b.summary else pre)
    elif isinstance(b, Fold):
        out.append(f"<details><summary>{_inline(b.summary)}</summary>")
        for inner in b.blocks:
            out += _html_block(inner)
        out.append("</details>")
    return out


def write_report(run_dir) -> list[Path]:
    """(Re)draw the plots, then write ``report.md`` and ``report.html`` into the run folder."""
    from harness.results.plots import make_plots

    run_dir = Path(run_dir)
    if not (run_dir / "run.json").exists():
        raise HarnessError(f"{run_dir}: not a results folder (no run.json)")
    md, page = run_dir / "report.md", run_dir / "report.html"
    for target in (md, page):  # every output checked before any is written (harness.spec.writes)
        check_file(target, run=run_dir, probe=False)
    prepare_folder(run_dir / "plots", below=run_dir)
    note = ""
    try:
        plots = sorted(make_plots(run_dir), key=_plot_order)
    except Exception as exc:  # a plot that fails must not cost the report: show what is on disk
        plots = None
        note = f"Redrawing the plots failed ({type(exc).__name__}: {exc}); these are the plots already on disk."
    title, blocks = build_report(run_dir, plots, note)
    stamp = f"<!-- {REPORT_STAMP}: {report_digest(run_dir)} -->\n"
    write_file(md, to_markdown(title, blocks, run_dir) + stamp, run=run_dir)
    write_file(page, to_html(title, blocks) + stamp, run=run_dir)
    return [md, page]


#: the marker of what a report was written from, its last line
REPORT_STAMP = "harness-report"
#: the modules that decide what a report says: a change in one rewrites every committed report
# caveats: the Answer opens with it; standing: the mark of every figure
REPORT_CODE = ("report.py", "report_blocks.py", "report_sections.py", "caveats.py", "standing.py")


def report_digest(run_dir) -> str:
    """What a run's report is written from: its plots' inputs and code, its run.json, and the report's code."""
    import hashlib

    from harness.results.plots import plots_digest

    run_dir = Path(run_dir)
    h = hashlib.sha256(plots_digest(run_dir).encode())
    for module in REPORT_CODE:
        h.update((Path(__file__).parent / module).read_bytes())
    h.update((run_dir / "run.json").read_bytes())
    return h.hexdigest()[:32]


def check_report(run_dir) -> list[str]:
    """Why the run's report.md and report.html are not what ``harness report`` writes today (empty: they are)."""
    import re

    run_dir = Path(run_dir)
    want = report_digest(run_dir)
    problems = []
    for name in ("report.md", "report.html"):
        try:
            tail = (run_dir / name).read_text(encoding="utf-8")[-200:]
        except OSError:
            problems.append(f"{run_dir / name}: missing")
            continue
        found = re.search(rf"<!-- {REPORT_STAMP}: (\w+) -->", tail)
        if found is None or found.group(1) != want:
            problems.append(f"{run_dir / name}: not what today's harness report writes from this run")
    return problems
