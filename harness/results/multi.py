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
    df = df[_in_every_run(df, len(run_ids))] if len(df) else df
    if df.empty:
        return pd.DataFrame()
    df = df.assign(label=backend_label(df))
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
    from harness.results.labels import backend_label, fmt_ratio, group_label
    from harness.results.report import MISSED_MARK, MISSED_NAME, Heading, Hover, Para, Table, fmt_speedup, fmt_time

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
            sp = fmt_speedup(c, mark=True)
            row.append(Hover(f"{fmt_time(c.get('median_s'))} ({sp})", sp.title if isinstance(sp, Hover) else "")
                       if c["status"] == Status.OK else str(c["status"]))
        for r in run_ids[1:]:
            pair = pairs.get((r, f"{first['workload']} · {group_label(first)}", first["label"]))
            row.append(fmt_ratio(pair["ratio"], pair["ratio_lo"], pair["ratio_hi"]) if pair is not None else "-")
        rows.append(row)
    heads = ["problem", "backend"] + [f"{names[r]}: median (speedup)" for r in run_ids]
    heads += [f"{names[r]} against {names[run_ids[0]]} [95% CI]" for r in run_ids[1:]]
    return [Heading(2, "Cells by run"),
            Para(f"The {len(rows)} cells every run has: each run's median time per call and its speedup over that "
                 f"run's own baseline (95% interval), then each later run's speedup over the first (the first run's "
                 "median over the later one's: above 1x, faster in the later run) with a 95% interval from "
                 "resampling each run's rounds on its own. Medians of different runs were not timed in turn: read "
                 f"their ratio with the machines and days in mind. {MISSED_MARK} {MISSED_NAME}: the speedup's interval missed its "
                 "precision target."),
            Table(heads, rows, right=set(range(2, len(heads))))]


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
            rows.append([f"{keys[run]} against {keys[run_ids[0]]}", where, str(len(d)), "-", "-", "-", "-"])
            continue
        spread = timed["ratio_lo"].notna()
        faster = int((timed["ratio_lo"] > 1).sum())
        slower = int((timed["ratio_hi"] < 1).sum())
        middle = float(np.exp(np.median(np.log(timed["ratio"].astype(float)))))
        rows.append([f"{keys[run]} against {keys[run_ids[0]]}", where, str(len(timed)), fmt_ratio(middle),
                     str(faster), str(slower), str(int(spread.sum()) - faster - slower)])
    return [Heading(2, "Answer"),
            Para(f"Each later run against the first ({keys[run_ids[0]]}), over the cells both timed: the median of "
                 "the later run's speedups over the first (the first's median time over the later one's: above 1x, "
                 "faster in the later run), and how many cells' 95% intervals lie wholly above 1x, wholly below, or "
                 "hold it. Per cell in Cells by run below."),
            Table(["runs", "where", "cells timed in both", "median speedup", "faster", "slower", "within noise"],
                  rows, right={2, 3, 4, 5, 6})]


def _missed_count(timings: pd.DataFrame) -> str:
    """``3 of 16``: a run's speedups that missed their precision target, of those timed with one."""
    from harness.results.labels import imprecise

    rows = [r for r in timings.to_dict("records") if r.get("precision_met") is not None and not pd.isna(r["precision_met"])]
    return f"{sum(imprecise(r) for r in rows)} of {len(rows)}" if rows else "-"


def _in_every_run(df: pd.DataFrame, n_runs: int) -> pd.Series:
    """Which rows are of a cell (:func:`harness.results.schema.cell_key`) that every one of the ``n_runs`` runs has."""
    return df.groupby(cell_key(df.columns), dropna=False)["run_id"].transform("nunique") == n_runs


def _run_keys(run_ids: list[str]) -> dict[str, str]:
    """A short name per run for the tables' headers: A, B, C, ..."""
    return {r: chr(ord("A") + i) if i < 26 else f"R{i + 1}" for i, r in enumerate(run_ids)}


def build_multi_report(paths) -> tuple[str, list, pd.DataFrame]:
    from harness.results.labels import backend_label, group_label
    from harness.results.report import MISSED_MARK, MISSED_NAME, Heading, Para, Table, fmt_speedup, fmt_time

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
                         f"{MISSED_MARK} {MISSED_NAME}", "state"],
                        [[keys[run.run_id], f"`{run.run_id}`", f"`{run.meta.get('config_path', '?')}`",
                          machines[machine_label(run.meta)], gemm_peak_text(run.meta).replace("float32 GEMM ", "") or "-",
                          str(run.meta.get("started", "?"))[:19].replace("T", " "), str(len(run.timings)),
                          _missed_count(run.timings), _state(run.meta)] for _, run in runs]))
    blocks.append(Table(["machine", "what it is (host, CPU, cores, vector flags, GPU)"],
                        [[key, text] for text, key in machines.items()]))
    unfinished = [f"{keys[run.run_id]} ({_state(run.meta)})" for _, run in runs if _state(run.meta) != "finished"]
    if unfinished:
        blocks.append(Para(f"**Not every run finished:** {', '.join(unfinished)}. Such a run holds only the cells it "
                           "finished before it stopped: a cell it never ran is missing from the comparisons below, "
                           "not measured. `harness run CONFIG --resume RUN` finishes it."))
    blocks += _by_run_section(timings, run_ids)
    df = timings.copy()
    df["label"] = backend_label(df)
    rest = df[~_in_every_run(df, len(run_ids)) | (df["workload"] == "train")]
    if rest.empty:
        return "benchmark report over several runs", blocks, timings
    blocks.append(Heading(2, "Other cells, side by side"))
    blocks.append(Para("The cells not every run has (and training cells): median time per call and speedup over "
                       "each run's own baseline (95% interval), one row per cell of each run; the machine column says "
                       "where it was measured."))
    rest = rest.assign(problem=rest.apply(lambda r: f"{r['workload']} {group_label(r, omit=('device',))}", axis=1))
    rows = []
    for problem, g in rest.groupby("problem", sort=False):
        for _, r in g.sort_values(["device", "machine", "label"], kind="stable").iterrows():
            rows.append([problem, r["machine"], r["device"], r["label"], r["status"], fmt_time(r.get("median_s")),
                         fmt_speedup(r, mark=True)])
    blocks.append(Table(["problem", "machine", "device", "backend", "status", "median", "speedup [95% CI]"], rows,
                        right={5, 6}, status_col=4))
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
