"""One report over several runs, from one machine or several (``harness report RUN_A RUN_B ... --out DIR``).

Cells of the runs stand side by side with a machine column; each run's speedup plot is drawn
in the colours every plot of the project uses; where one run has a problem's CPU cells and
another its GPU cells (the same shapes, as ``configs/lstm_cpu_gpu.yaml`` and its ``gpu`` profile
give on a CPU machine and a GPU machine), the CPU-versus-GPU crossover is drawn from both. Every
figure says which run and machine it came from.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.spec.errors import HarnessError
from harness.spec.status import Status
from harness.results.schema import cell_key
from harness.results.standing import Standing


from harness.results.labels import gemm_peak_text, machine_label  # noqa: E402  (one rule for naming a machine)


def _runs(paths):
    """The runs, each once: a folder named twice (or two copies of one run) would double its rows."""
    from harness.results.store import load_run

    runs, seen = [], {}
    for p in paths:
        if not (Path(p) / "run.json").exists():
            raise HarnessError(f"{p}: not a results folder (no run.json)")
        run = load_run(p)
        for key in (("folder", Path(p).resolve()), ("run", run.run_id, str(run.meta.get("started")))):
            if key in seen:
                same = "the same folder" if key[0] == "folder" else f"the same run ({run.run_id})"
                raise HarnessError(f"{p}: {same} as {seen[key]}, named twice; expected each run once")
            seen[key] = p
        runs.append((Path(p), run))
    ids = [run.run_id for _, run in runs]
    for path, run in runs:  # two runs of one id (started in the same second) told apart by their folders, as load_runs does
        if ids.count(run.run_id) > 1:
            run.meta = {**run.meta, "run_id": f"{run.run_id} ({path.name})"}
    return runs


def _state(meta: dict) -> str:
    """Whether a run finished: ``finished``, ``interrupted`` (it says so), or ``partial`` (no end recorded:
    killed, or still running)."""
    if meta.get("interrupted"):
        return "interrupted"
    return "finished" if meta.get("finished") else "partial (no end recorded)"


def machine_keys(runs) -> dict[str, str]:
    """A short key per machine the runs ran on (``m1``, ``m2``, ...), by :func:`machine_label`'s stable facts:
    two runs of one VM share a key whatever GEMM peak each measured; ``{description: key}``."""
    labels = dict.fromkeys(machine_label(run.meta) for _, run in runs)
    return {label: f"m{i + 1}" for i, label in enumerate(labels)}


def combined_timings(runs) -> pd.DataFrame:
    """Every run's rows with ``run_id``, ``machine`` (its short key, :func:`machine_keys`) and
    ``machine_text`` (what the key stands for) columns."""
    keys = machine_keys(runs)
    frames = []
    for _, run in runs:
        t = run.timings.copy()
        t["run_id"] = run.run_id
        t["machine_text"] = machine_label(run.meta)
        t["machine"] = keys[t["machine_text"].iloc[0]] if len(t) else ""
        frames.append(t)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def run_pairs(timings: pd.DataFrame, run_ids: list[str]) -> pd.DataFrame:
    """Each later run's common cells against the first run's: a row per cell and later run with ``run_id``,
    ``problem``, ``label`` (backend), both medians, and the later run's speedup over the first (the first's
    median over the later one's: above 1, faster in the later run) with a 95% interval from resampling each
    run's rounds on its own (they were not timed in turn) and ``precision``, the tighter of the two runs'
    precision targets (what a ratio's interval is held to in :func:`plot_runs`); cells that did not run in
    both have no ratio."""
    from harness.run.stats import ratio_interval
    from harness.results.labels import backend_label, group_label

    df = timings[timings["workload"] != "train"]
    if df.empty:
        return pd.DataFrame()
    df = df.assign(label=backend_label(df))  # before the cells are matched: a backend is part of what a cell is
    df = df[_in_every_run(df, len(run_ids))]
    if df.empty:
        return pd.DataFrame()
    out = []
    for _, g in df.groupby(cell_key(df.columns), sort=False, dropna=False):
        at = {r["run_id"]: r for _, r in g.drop_duplicates("run_id").iterrows()}
        a = at[run_ids[0]]
        for run in run_ids[1:]:
            b = at[run]
            row = {"run_id": run, "problem": f"{a['workload']} · {group_label(a)}", "label": a["label"],
                   "workload": a["workload"], "status_a": a["status"], "status_b": b["status"],
                   "median_a_s": a.get("median_s"), "median_b_s": b.get("median_s"),
                   "ratio": float("nan"), "ratio_lo": float("nan"), "ratio_hi": float("nan"),
                   # the worse of the two cells' own standings (contended, unsteady): a ratio of times from a
                   # disturbed machine is said to be so wherever it is shown
                   "time_standing": _worse(a, b), "time_standing_why": _worse_why(a, b, run_ids[0], run),
                   # the tighter of the two runs' precision targets, the mark's measure (None: neither set one)
                   "precision": min((float(p) for p in (a.get("speedup_precision"), b.get("speedup_precision"))
                                     if p is not None and p == p), default=None)}
            if a["status"] == Status.OK and b["status"] == Status.OK:
                sa, sb = (list(r.get("samples_s")) if r.get("samples_s") is not None else [] for r in (a, b))
                if sa and sb:
                    row["ratio"], row["ratio_lo"], row["ratio_hi"] = ratio_interval(sb, sa)  # median A / median B
                elif a.get("median_s") and b.get("median_s"):
                    row["ratio"] = float(a["median_s"]) / float(b["median_s"])
            out.append(row)
    return pd.DataFrame(out)


def _pair_text(pair) -> str:
    """One later run's ratio over the first, marked where either cell's time was disturbed."""
    from harness.results.labels import fmt_ratio
    from harness.results.report import Hover
    from harness.results.standing import MARKS, Standing

    text = fmt_ratio(pair["ratio"], pair["ratio_lo"], pair["ratio_hi"])
    kind = pair.get("time_standing")
    if text == "-" or not isinstance(kind, str) or not Standing(kind).disturbed:
        return text
    return Hover(f"{text} {MARKS[Standing(kind)]}", str(pair.get("time_standing_why") or ""))


def _worse(a, b) -> str | None:
    """The disturbed standing of either of two cells' times (contended before unsteady), else trusted."""
    from harness.results.standing import Standing, of

    mine = [of(r, "time") for r in (a, b)]
    for kind in (Standing.CONTENDED, Standing.UNSTEADY):
        if kind in mine:
            return kind.value
    return Standing.TRUSTED.value if any(s is not None for s in mine) else None


def _worse_why(a, b, run_a: str, run_b: str) -> str | None:
    from harness.results.standing import of, why

    for r, run in ((a, run_a), (b, run_b)):
        s = of(r, "time")
        if s is not None and s.disturbed:
            return f"in {run}: {why(r, 'time')}"
    return None


def crossover_sources(timings: pd.DataFrame) -> dict[str, list[str]]:
    """Which runs gave the CPU and which the GPU cells of the crossover ({} when no problem has both)."""
    from harness.results.devices import gpu_over_cpu

    ok = timings[(timings["status"] == Status.OK) & (timings["workload"] != "train")]
    pairs = gpu_over_cpu(ok)
    if pairs.empty:
        return {}
    out = {}
    for device in ("cpu", "gpu"):
        d = ok[ok["device"] == device]
        out[device] = sorted(set(d["run_id"]))
    return out


def _by_run_section(timings: pd.DataFrame, run_ids: list[str]) -> list:
    """The cells the runs have in common, a row each: per run its median and its speedup over that run's own
    baseline, and each later run's time against the first run's (above 1: faster in the later run)."""
    from harness.results.labels import backend_label, group_label
    from harness.results.report import Heading, Hover, Para, Table, fmt_median, fmt_speedup, legend_text

    df = timings[timings["workload"] != "train"].copy()
    if df.empty:
        return []
    df["label"] = backend_label(df)
    names = _run_keys(run_ids)
    common = df[_in_every_run(df, len(run_ids))]
    if common.empty:
        return [Heading(2, "Cells by run"), Para("The runs have no cell in common (the same problem and backend).")]
    pairs = {(p["run_id"], p["problem"], p["label"]): p for _, p in run_pairs(timings, run_ids).iterrows()}
    rows = []
    for _, g in common.groupby(cell_key(common.columns), sort=False, dropna=False):
        at = {r["run_id"]: r for _, r in g.drop_duplicates("run_id").iterrows()}
        first = at[run_ids[0]]
        row = [f"{first['workload']} · {group_label(first)}", first["label"]]
        for r in run_ids:
            c = at[r]
            sp, median = fmt_speedup(c, mark=True), fmt_median(c)
            titles = [t.title for t in (median, sp) if isinstance(t, Hover) and t.title]
            row.append(Hover(f"{median} ({sp})", "; ".join(titles)) if c["status"] == Status.OK else str(c["status"]))
        for r in run_ids[1:]:
            pair = pairs.get((r, f"{first['workload']} · {group_label(first)}", first["label"]))
            row.append(_pair_text(pair) if pair is not None else "-")
        rows.append(row)
    heads = ["problem", "backend"] + [f"{names[r]}: median (speedup)" for r in run_ids]
    heads += [f"{names[r]} against {names[run_ids[0]]} [95% CI]" for r in run_ids[1:]]
    return [Heading(2, "Cells by run"),
            Para(f"The {len(rows)} cells every run has: each run's median time per call and its speedup over that "
                 f"run's own baseline (95% interval), then each later run's speedup over the first (the first run's "
                 "median over the later one's: above 1x, faster in the later run) with a 95% interval from "
                 "resampling each run's rounds on its own. Medians of different runs were not timed in turn: read "
                 "their ratio with the machines and days in mind. "
                 + (legend_text(common, ("speedup", "time")) or "Every figure here is trusted.")),
            Table(heads, rows, right=set(range(2, len(heads))))]


def _fastest_section(timings: pd.DataFrame, run_ids: list[str]) -> list:
    """Per comparison group of each run, its answer as the run's own report gives it: the fastest backend (or
    the tie), its speedup over that run's baseline and its lead over the runner-up, paired within the run."""
    from harness.results.labels import backend_label, group_label, reading_order
    from harness.results.report import Heading, Para, Table, group_answer
    from harness.results.schema import SPEEDUP_BLOCK

    df = timings[timings["workload"] != "train"]
    if df.empty:
        return []
    df = df.assign(label=backend_label(df))
    keys = _run_keys(run_ids)
    rows = []
    for run in run_ids:
        mine = df[df["run_id"] == run]
        for _, g in reading_order(mine.groupby(SPEEDUP_BLOCK, sort=False, dropna=False)):
            answer = group_answer(g)
            head = g.iloc[0]
            rows.append([f"{head['workload']} · {group_label(head)}", keys[run], answer.fastest, answer.gain,
                         answer.margin])
    rows.sort(key=lambda r: r[0])  # a problem's runs side by side
    return [Heading(2, "Fastest per group, each run"),
            Para("Each run's answer per comparison group, as its own report gives it: the fastest backend that ran "
                 "and its speedup over that run's baseline, named only where its lead over the runner-up (the "
                 "runner-up's time over its own, from rounds taken in turn within the run) has a 95% interval above "
                 "1x; otherwise a tie."),
            Table(["problem", "run", "fastest", "speedup [95% CI]", "lead over the runner-up [95% CI]"], rows,
                  right={3, 4})]


def _answer(timings: pd.DataFrame, run_ids: list[str], runs) -> list:
    """The report's first table: each later run against the first, over the cells both timed: how many,
    the median of the later run's speedups over the first, and how many intervals lie wholly above 1x
    (faster), wholly below (slower) or hold it."""
    import numpy as np

    from harness.results.labels import fmt_ratio
    from harness.results.report import Heading, Para, Table

    keys = _run_keys(run_ids)
    machine = {run.run_id: machine_label(run.meta) for _, run in runs}
    pairs = run_pairs(timings, run_ids)
    rows = []
    for run in run_ids[1:]:
        d = pairs[pairs["run_id"] == run] if len(pairs) else pairs
        timed = d[d["ratio"].notna()] if len(d) else d
        where = "same machine" if machine[run] == machine[run_ids[0]] else "another machine"
        if timed.empty:
            rows.append([f"{keys[run]} against {keys[run_ids[0]]}", where, str(len(d)), "-", "-", "-", "-", "-"])
            continue
        disturbed = timed["time_standing"].isin([Standing.CONTENDED.value, Standing.UNSTEADY.value])
        steady = timed[~disturbed]
        spread = steady["ratio_lo"].notna()
        faster = int((steady["ratio_lo"] > 1).sum())
        slower = int((steady["ratio_hi"] < 1).sum())
        middle = float(np.exp(np.median(np.log(timed["ratio"].astype(float)))))
        rows.append([f"{keys[run]} against {keys[run_ids[0]]}", where, str(len(timed)), fmt_ratio(middle),
                     str(faster), str(slower), str(int(spread.sum()) - faster - slower), str(int(disturbed.sum()))])
    said = [f"{keys[run.run_id]}: {_disturbed_text(run.timings)}" for _, run in runs if _disturbed_text(run.timings)]
    return [Heading(2, "Answer")] + ([Para("Disturbed runs: " + "; ".join(said) + ". A cell contended or unsteady "
                                           "in either run is counted apart, neither faster nor slower.")]
                                     if said else []) + [
            Para(f"Each later run against the first ({keys[run_ids[0]]}), over the cells both timed: the median of "
                 "the later run's speedups over the first (the first's median time over the later one's: above 1x, "
                 "faster in the later run), and how many cells' 95% intervals lie wholly above 1x, wholly below, or "
                 "hold it, of the cells neither run timed on a disturbed machine (contended or unsteady: counted in "
                 "the last column). Per cell in Cells by run below."),
            Table(["runs", "where", "cells timed in both", "median speedup", "faster", "slower", "within noise",
                   "contended or unsteady"], rows, right={2, 3, 4, 5, 6, 7})]


def _disturbed_text(timings: pd.DataFrame) -> str:
    """``3 of 8 timed cells contended, 1 unsteady`` ("" for a run whose every timed cell is trusted)."""
    from harness.results.standing import counts

    n = counts(timings, "time")
    total = sum(n.values())
    parts = [f"{n[k]} {k.value}" for k in (Standing.CONTENDED, Standing.UNSTEADY) if n.get(k)]
    if not parts:
        return ""
    parts[0] = f"{parts[0].split()[0]} of {total} timed cells {parts[0].split(' ', 1)[1]}"
    return ", ".join(parts)


def _missed_count(timings: pd.DataFrame) -> str:
    """``3 of 16 (±5%)``: a run's speedups whose interval is wider than their precision target, of those timed
    with one; ``no precision target`` for a run that set none."""
    from harness.results.labels import imprecise
    from harness.results.standing import precision_targets, target_text

    rows = [r for r in timings.to_dict("records") if r.get("precision_met") is not None and not pd.isna(r["precision_met"])]
    targets = precision_targets(timings)
    if not rows or not targets:
        return "no precision target"
    return f"{sum(imprecise(r) for r in rows)} of {len(rows)} ({', '.join(target_text(t) for t in targets)})"


def _in_every_run(df: pd.DataFrame, n_runs: int) -> pd.Series:
    """Which rows are of a cell (:func:`harness.results.schema.cell_key`) that every one of the ``n_runs`` runs has."""
    return df.groupby(cell_key(df.columns), dropna=False)["run_id"].transform("nunique") == n_runs


def _run_keys(run_ids: list[str]) -> dict[str, str]:
    """A short name per run for the tables' headers: A, B, C, ..."""
    return {r: chr(ord("A") + i) if i < 26 else f"R{i + 1}" for i, r in enumerate(run_ids)}


def build_multi_report(paths) -> tuple[str, list, pd.DataFrame]:
    from harness.results.labels import backend_label, group_label
    from harness.results.report import Heading, Para, Table, fmt_median, fmt_speedup, legend_text

    runs = _runs(paths)
    if len(runs) < 2:
        raise HarnessError("a report over several runs needs at least two run folders")
    timings = combined_timings(runs)
    run_ids = [run.run_id for _, run in runs]
    keys = _run_keys(run_ids)
    machines = machine_keys(runs)
    blocks: list = _answer(timings, run_ids, runs)
    blocks.append(Heading(2, "Runs"))
    blocks.append(Table(["", "run", "config", "machine", "its float32 GEMM at start", "started", "cells",
                         "contended or unsteady", "interval wider than its target", "state"],
                        [[keys[run.run_id], f"`{run.run_id}`", f"`{run.meta.get('config_path', '?')}`",
                          machines[machine_label(run.meta)], gemm_peak_text(run.meta).replace("float32 GEMM ", "") or "-",
                          str(run.meta.get("started", "?"))[:19].replace("T", " "), str(len(run.timings)),
                          _disturbed_text(run.timings) or "none", _missed_count(run.timings), _state(run.meta)]
                         for _, run in runs]))
    blocks.append(Table(["machine", "what it is (host, CPU, cores, vector flags, GPU)"],
                        [[key, text] for text, key in machines.items()]))
    unfinished = [f"{keys[run.run_id]} ({_state(run.meta)})" for _, run in runs if _state(run.meta) != "finished"]
    if unfinished:
        blocks.append(Para(f"**Not every run finished:** {', '.join(unfinished)}. Such a run holds only the cells it "
                           "finished before it stopped: a cell it never ran is missing from the comparisons below, "
                           "not measured. `harness run CONFIG --resume RUN` finishes it."))
    blocks += _fastest_section(timings, run_ids)
    blocks += _by_run_section(timings, run_ids)
    df = timings.copy()
    df["label"] = backend_label(df)
    rest = df[~_in_every_run(df, len(run_ids)) | (df["workload"] == "train")]
    if rest.empty:
        return "benchmark report over several runs", blocks, timings
    blocks.append(Heading(2, "Other cells, side by side"))
    legend = legend_text(rest, ("speedup", "time"))
    blocks.append(Para("The cells not every run has (and training cells): median time per call and speedup over "
                       "each run's own baseline (95% interval), one row per cell of each run; the run column names "
                       "the run (as in Runs above) and the machine column where it was measured."
                       + (f" {legend}" if legend else "")))
    rest = rest.assign(problem=rest.apply(lambda r: f"{r['workload']} {group_label(r, omit=('device',))}", axis=1),
                       run_key=rest["run_id"].map(keys))
    rows = []
    for problem, g in rest.groupby("problem", sort=False):
        for _, r in g.sort_values(["device", "run_key", "label"], kind="stable").iterrows():
            rows.append([problem, r["run_key"], r["machine"], r["device"], r["label"], r["status"], fmt_median(r),
                         fmt_speedup(r, mark=True)])
    blocks.append(Table(["problem", "run", "machine", "device", "backend", "status", "median", "speedup [95% CI]"],
                        rows, right={6, 7}, status_col=5))
    return "benchmark report over several runs", blocks, timings


def write_multi_report(paths, out) -> list[Path]:
    """``report.md`` and ``report.html`` over several runs into ``out``, with their plots in ``out/plots``."""
    from harness.results import plots as P
    from harness.results.report import Heading, Image, Para, to_html, to_markdown
    from harness.spec import writes

    out = writes.check_folder(out, "--out")  # not one of the runs, nor inside any run folder
    md, page = out / "report.md", out / "report.html"
    for target in (md, page):
        writes.check_file(target, "--out", below=out, probe=False)
    title, blocks, timings = build_multi_report(paths)  # every run checked before anything is written
    writes.prepare_folder(out / "plots", below=out)
    figures: list = [Heading(2, "Plots")]
    made = P.plot_runs(run_pairs(timings, list(dict.fromkeys(timings["run_id"]))), _run_keys(
        list(dict.fromkeys(timings["run_id"]))), out / "plots" / "runs.png")
    if made:
        figures.append(Image(made, "Each later run's speedup over the first per cell it shares with it (the first "
                                   "run's median over the later one's: right of the dashed 1x line, faster in the "
                                   "later run), with its 95% interval, on one log axis."))
    for run_id, t in timings.groupby("run_id", sort=False):
        machine = f"{t['machine'].iloc[0]}, {t['machine_text'].iloc[0]}"
        made = P.plot_speedup(t, out / "plots" / f"speedup-{run_id}.png")
        if made:
            figures.append(Image(made, f"Speedup over the baseline, run {run_id} on {machine}."))
    sources = crossover_sources(timings)
    if sources:
        made = P.plot_crossover(timings, out / "plots" / "crossover.png")
        if made:
            where = {dev: ", ".join(f"{r} ({timings[timings['run_id'] == r]['machine_text'].iloc[0]})" for r in ids)
                     for dev, ids in sources.items()}
            figures.append(Image(made, f"CPU against GPU by batch: CPU cells from {where['cpu']}; "
                                       f"GPU cells from {where['gpu']}."))
    else:
        figures.append(Para("No problem was measured on a CPU in one run and on a GPU in another (or the same) run "
                            "with the same shapes, so there is no crossover to draw."))
    blocks += figures
    writes.write_file(md, to_markdown(title, blocks, out))
    writes.write_file(page, to_html(title, blocks))
    return [md, page] + [b.path for b in blocks if isinstance(b, Image)]
