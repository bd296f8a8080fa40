"""What ``harness run`` shows on the terminal, within an 80-column window: the progress line (its count and
time left first, the cell's name last, cut to fit), a plain line per finished pass when the output is no
terminal, and the summary table. Cells are named as the tables and plots name them."""

from __future__ import annotations

import time

import pandas as pd
from rich.markup import escape

from harness.results import standing
from harness.results.labels import backend_label, fmt_ratio, fmt_seconds, group_label, setting_label
from harness.results.schema import setting_values
from harness.spec.status import Status


#: a speedup whose interval is wider than its precision target, in the summary (its legend: the "marks:" line under it)
from harness.results.labels import MISSED_MARK  # noqa: E402,F401  (one home for the mark and its name)


def group_name(cells) -> str:
    """A comparison group's name on the progress line: its workload and :func:`group_label`, the paired
    keys' values joined (``float32|bfloat16``), as the summary table names the group."""
    from harness.results.schema import cell_columns

    rows = [cell_columns(c) for c in cells]
    paired = [k for k, _ in cells[0].paired]
    text = f"{rows[0]['workload']} {group_label(rows[0], omit=tuple(paired))}"
    for key in paired:
        values = "|".join(dict.fromkeys(str(r[key]) for r in rows))
        text += f" {values} thr" if key == "threads" else f" {values}"
    return text


def header(name: str, groups, folder) -> str:
    """The line that opens a run: its cells and the count the bar will show, in one number."""
    from harness.run.runner import planned_steps

    n_cells = sum(len(g) for g in groups)
    steps = planned_steps(groups)
    count = f"{n_cells} cells" if steps == n_cells else f"{n_cells} cells x passes = {steps} steps"
    return f"[bold]{escape(name)}[/]: {count} -> {escape(str(folder))}"


def progress(console, store=None):
    """The progress display for ``console``: a rich bar on a terminal, :class:`PlainProgress` elsewhere, with a
    line per cell ``store`` (the run's :class:`~harness.results.store.RunStore`) records."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Column

    if not console.is_terminal:
        return PlainProgress(console, store)
    # the count and the time left first: a narrow window cuts the cell's name at its end, never them
    return Progress(MofNCompleteColumn(), TextColumn("eta"), TimeRemainingColumn(), BarColumn(bar_width=12),
                    TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
                    console=console, transient=False, expand=True)


class PlainProgress:
    """The progress display where the output is no terminal (a log file, CI): nothing redrawn, a plain line
    per finished cell, ``[12/24 0:01:05] train_step elman V=2000 H=100 T=20 B=1 float32 · jax: 474 µs, speedup
    1.32x [1.25, 1.38]`` (the steps done of the bar's count, the time since the start, the cell as the
    summary tables name it, its median and speedup or why it has none). Without a ``store`` to hear the
    cells from, a line each time the bar moves, ``[12/24 0:01:05] done: <the group and pass>``."""

    def __init__(self, console, store=None):
        self.console = console
        self.total, self.completed, self.description = 0.0, 0.0, ""
        self.started = time.monotonic()
        self.per_cell = store is not None
        if store is not None:
            store.listen(self.cells_done)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, description, total=None, **_):
        self.total, self.description = float(total or 0), str(description)
        return 0

    def update(self, task_id, total=None, advance=None, completed=None, description=None, **_):
        if total is not None:
            self.total = float(total)
        if description is not None:
            self.description = str(description)
        if completed is not None:
            self.completed = float(completed)
        if advance:
            self.advance(task_id, advance)

    def _prefix(self) -> str:
        seconds = int(time.monotonic() - self.started)
        return f"[{self.completed:.0f}/{self.total:.0f} {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}]"

    def advance(self, task_id, n):
        self.completed += n
        if self.per_cell:  # the cells' own lines follow when their group is done
            return
        # the group and pass that finished, without the phase it was last in ("round 5 (numpy, jax) · ...")
        done = self.description.partition(" · ")[2] or self.description
        self.console.print(f"{self._prefix()} done: {done}", highlight=False, soft_wrap=True, markup=False)

    def cells_done(self, rows: list[dict]) -> None:
        """A line per cell just recorded (:func:`cell_line`)."""
        df = pd.DataFrame(rows)
        if df.empty:
            return
        for label, (_, r) in zip(backend_label(df), df.iterrows()):
            self.console.print(f"{self._prefix()} {cell_line(r, label)}", highlight=False, soft_wrap=True, markup=False)


def cell_line(row, label: str) -> str:
    """A finished cell in a line: its group as the summary tables name it, its backend, its median and its
    speedup over the baseline with the interval (the reference's own: ``1x (the reference)``), a training cell's final
    loss, or the status of a cell that did not run."""
    text = f"{row['workload']} {group_label(row)} · {label}: "
    if row["status"] != Status.OK:
        return text + str(row["status"])
    text += fmt_seconds(row.get("median_s")) if pd.notna(row.get("median_s")) else "-"
    if row["workload"] == "train":
        loss = row.get("final_loss")
        return text + (f", final loss {loss:.3f}" if pd.notna(loss) else "")
    lo, hi = row.get("speedup_lo"), row.get("speedup_hi")
    if pd.notna(lo) and lo == hi:  # the reference's own ratio, whose interval has no width
        return text + ", 1x (the reference)"
    ratio = _ratio(row, "speedup")
    return text + (f", speedup {standing.marked(ratio, row)}" if ratio != "-" else "")


def summary_tables(timings: pd.DataFrame, meta: dict) -> list:
    """The summary of a finished run as rich renderables, a table per comparison group titled with the
    group's name, the tables sharing their columns' widths: backend, median (a cell that did not run: its
    status), under ``pair_over`` the paired speedup over the first setting with its interval (the question
    such a run asks), the speedup over the baseline with its 95% interval, compile time (without
    ``pair_over``), a note where a training cell has one; under each table, a line per reason a cell did not
    run, cut to the window (the report has it whole). Intervals never wrap."""
    from rich import box
    from rich.table import Table
    from harness.results.labels import reading_order
    from harness.results.report import group_answer, speedup_note

    df = standing.with_standing(timings).assign(label=backend_label(timings))
    paired = "setting_baseline" in df and df["setting_speedup"].notna().any()
    first = ""
    if paired:
        values = setting_values(str(df["setting_baseline"].dropna().iloc[0]))
        first = setting_label(values, list(values))
    groups = []
    for _, g in reading_order(df.groupby("group", sort=False)):  # in the order the report's Answer lists them
        rows, reasons = [], []
        for _, r in g.iterrows():
            ok = r["status"] == Status.OK
            # marked with its standing: contended, unsteady, imprecise, not significant (the legend under the tables)
            sp = escape(standing.marked(_ratio(r, "speedup"), r))
            row = {"backend": escape(r["label"]),
                   "median": escape(fmt_seconds(r.get("median_s")) if ok and pd.notna(r.get("median_s"))
                                    else str(r["status"]) if not ok else "-"),
                   f"over {first} [95% CI]": escape(standing.marked(_ratio(r, "setting_speedup"), r, "setting")),
                   "speedup [95% CI]": f"[yellow]{sp}[/]" if standing.mark(r) else sp,
                   "compile": f"{r['compile_s']:.2f} s" if pd.notna(r.get("compile_s")) else "-", "note": ""}
            if not ok:
                error = str(r.get("error") or "").strip()
                if error:
                    reasons.append(f"{r['label']}: {error.splitlines()[0]}")
            elif r["workload"] == "train":
                ttt = r.get("time_to_target_s")
                row["note"] = f"final loss {r['final_loss']:.3f}" + (f", target at {ttt:.2f} s" if pd.notna(ttt) else "")
            rows.append(row)
        head = g.iloc[0]
        lines = [f"[bold]{escape(head['workload'] + ' ' + group_label(head))}[/]"]
        if not paired and head["workload"] != "train":  # the answer under the group's name, then its rows
            answer = group_answer(g)
            gain, winner = answer.gain, answer.winner
            if answer.tie:
                lines.append(escape(f"{answer.fastest}; lead {answer.margin}"))
            elif gain != "-":
                lead = f"; lead {answer.margin}" if answer.margin != "-" and winner is not None else ""
                lines.append(escape((gain if winner is None or "fastest; next" in gain
                                     else f"fastest: {winner['label']} {gain}") + lead))
        if speedup_note(g):
            lines.append(f"[yellow]{escape(speedup_note(g))}[/]")
        groups.append(("\n".join(lines), rows, list(dict.fromkeys(reasons))))
    # under pair_over the compile times give way to the paired column: both intervals fit 80 columns
    heads = ["backend", "median"] + ([f"over {first} [95% CI]"] if paired else []) + ["speedup [95% CI]"] + \
        ([] if paired else ["compile"])
    widths = {h: max([len(h)] + [len(_plain(r[h])) for _, rows, _ in groups for r in rows]) for h in heads}
    out, shown = [], None
    for title, rows, reasons in groups:
        # a column with nothing in this group (a training group's speedups) gives way to its notes (final loss)
        columns = [h for h in heads if h in ("backend", "median") or any(_plain(r[h]) != "-" for r in rows)]
        columns += ["note"] if any(r["note"] for r in rows) else []
        table = Table(title=title,
                      title_justify="left", box=box.SIMPLE_HEAD, show_header=columns != shown, pad_edge=False,
                      padding=(0, 1))
        shown = columns
        for h in columns:
            if h == "note":
                table.add_column(h, overflow="fold", ratio=1, min_width=8)
            else:
                table.add_column(h, justify="left" if h == "backend" else "right", no_wrap=True,
                                 overflow="ellipsis", width=min(widths[h], 18) if h == "backend" else widths[h])
        for row in rows:
            table.add_row(*(row[h] for h in columns))
        out.append(table)
        if reasons:
            lines = Table.grid(padding=(0, 0, 0, 2))
            lines.add_column(no_wrap=True, overflow="ellipsis", style="dim")
            for why in reasons:
                lines.add_row(escape(why))
            out.append(lines)
    return out


def _ratio(row, column: str) -> str:
    """A row's ratio with its interval; the setting or baseline's own 1x, whose interval has no width, alone."""
    value, lo, hi = row.get(column), row.get(f"{column}_lo"), row.get(f"{column}_hi")
    if pd.notna(lo) and pd.notna(hi) and lo == hi:
        lo = hi = None
    return fmt_ratio(value, lo, hi)


def _plain(cell: str) -> str:
    from rich.text import Text

    return Text.from_markup(cell).plain


def print_summary(timings: pd.DataFrame, meta: dict, console) -> None:
    """The summary tables under one heading (what the speedups are over), on ``console``."""
    if timings.empty:
        return
    from harness.results.report import winners_line

    console.print(f"[bold]{escape(str(meta.get('name')))}[/]: median per call; speedup over "
                  f"{escape(str(meta.get('baseline')))}: its time / the backend's", highlight=False)
    first = winners_line(timings)
    if first:
        console.print(escape(first), highlight=False)
    for table in summary_tables(timings, meta):
        console.print(table)
    marks = standing.legend(timings, ("speedup", "setting"))
    if marks:
        console.print(f"marks: {escape(marks)}", highlight=False)
