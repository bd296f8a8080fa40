"""Speedup figures: over the baseline, over a paired setting, and one run against another."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from harness.results.labels import backend_label, group_label, setting_label
from harness.spec.status import Status
from harness.results.plot_style import _grid, _mark_untimed, _number_axis, _palette, _save, _seconds_axis
from harness.results.schema import cell_key, setting_values


def plot_speedup(timings: pd.DataFrame, out: Path):
    """A panel per comparison group: a bar per backend with its 95% interval, the baseline at 1; the
    group's cells that have no speedup (failed, unsupported, unavailable) listed under the bars with their status."""
    timed = (timings["status"] == Status.OK) & timings["speedup"].notna()
    df = timings[timed].copy()
    if df.empty:
        return None
    df["label"] = backend_label(df)
    df["panel"] = df.apply(group_label, axis=1) + " · " + df["workload"]
    rest = timings[~timed & timings["workload"].isin(df["workload"])].copy()
    rest["label"] = backend_label(rest)
    rest["panel"] = (rest.apply(group_label, axis=1) + " · " + rest["workload"]) if len(rest) else pd.Series(dtype=object)
    rest = rest[rest["panel"].isin(df["panel"])]
    panels = list(dict.fromkeys(df["panel"]))
    rows = max(int((df["panel"] == p).sum() + (rest["panel"] == p).sum()) for p in panels)
    plt, sns, fig, axes = _grid(len(panels), 3, 4.9, 0.5 * rows + 1.9)
    palette = _palette(sns, df["label"])
    for ax, panel in zip(axes.flat, panels):
        d = df[df["panel"] == panel].sort_values("speedup")
        missing = rest[rest["panel"] == panel]
        y = np.arange(len(d)) + len(missing)
        _mark_untimed(ax, list(missing["status"]))
        lo = (d["speedup"] - d["speedup_lo"]).clip(lower=0).fillna(0)
        hi = (d["speedup_hi"] - d["speedup"]).clip(lower=0).fillna(0)
        ax.barh(y, d["speedup"], xerr=[lo, hi], color=[palette[l] for l in d["label"]], capsize=3)
        ax.set_yticks(list(range(len(missing))) + list(y), list(missing["label"]) + list(d["label"]))
        ax.set_ylim(-0.6, len(missing) + len(d) - 0.4)
        ax.axvline(1.0, color="black", lw=1, ls="--")
        ax.set_xscale("log")
        right = d["speedup_hi"].fillna(d["speedup"]).to_numpy()
        top = float(np.nanmax(right))
        ax.set_xlim(min(0.8, float(np.nanmin(d["speedup_lo"].fillna(d["speedup"]))) * 0.7), top * 2.2)
        _number_axis(ax.xaxis, "x")
        ax.set_title(textwrap.fill(panel, 40), fontsize=10)
        over = d["speedup_over"].dropna() if "speedup_over" in d else d["baseline"]  # a failed baseline's stand-in
        ax.set_xlabel(f"speedup over {(over if len(over) else d['baseline']).iloc[0]} (bars: 95% CI)")
        for yi, s, r in zip(y, d["speedup"], right):
            ax.text(max(r, s) * 1.12, yi, f"{s:.3g}x", va="center", ha="left", fontsize=9)
    return _save(plt, fig, axes, len(panels), out)


def plot_settings(timings: pd.DataFrame, out: Path):
    """Per problem, each backend's time at every paired setting against its own at the first one
    (``setting_speedup``: above 1, this setting is the faster), with the paired 95% interval; a 1x line;
    cells that did not run listed with their status."""
    if "setting_baseline" not in timings:
        return None
    # training cells run alone, never paired: they have no setting ratio to draw
    df = timings[timings["setting_baseline"].notna() & (timings["workload"] != "train")].copy()
    if df.empty:
        return None
    base = setting_values(df["setting_baseline"].iloc[0])
    keys = list(base)
    df["setting"] = df.apply(lambda r: setting_label(r, keys), axis=1)
    df = df[df["setting"] != setting_label(base, keys)]  # each backend's first setting is its own 1x
    if df.empty:
        return None
    df["label"] = backend_label(df)
    df["panel"] = df.apply(lambda r: group_label(r, omit=tuple(keys)), axis=1) + " · " + df["workload"]
    panels = list(dict.fromkeys(df["panel"]))
    rows = max(int((df["panel"] == p).sum()) for p in panels)
    plt, sns, fig, axes = _grid(len(panels), 3, 5.2, 0.5 * rows + 1.9)
    palette = _palette(sns, df["label"])
    against = ", ".join(f"{k}={v}" for k, v in base.items())
    for ax, panel in zip(axes.flat, panels):
        d = df[df["panel"] == panel]
        timed = d[d["setting_speedup"].notna()].sort_values("setting_speedup")
        missing = d[d["setting_speedup"].isna()]
        y = np.arange(len(timed)) + len(missing)
        _mark_untimed(ax, [s if s != Status.OK else f"no {against} cell" for s in missing["status"]])
        lo = (timed["setting_speedup"] - timed["setting_speedup_lo"]).clip(lower=0)
        hi = (timed["setting_speedup_hi"] - timed["setting_speedup"]).clip(lower=0)
        ax.barh(y, timed["setting_speedup"], xerr=[lo, hi], color=[palette[l] for l in timed["label"]], capsize=3)
        names = [f"{l} · {s}" for l, s in zip(missing["label"], missing["setting"])] + \
                [f"{l} · {s}" for l, s in zip(timed["label"], timed["setting"])]
        ax.set_yticks(list(range(len(missing))) + list(y), names)
        ax.set_ylim(-0.6, len(names) - 0.4)
        ax.axvline(1.0, color="black", lw=1, ls="--")
        ax.set_xscale("log")
        if len(timed):
            right = timed["setting_speedup_hi"].to_numpy()
            ax.set_xlim(min(0.8, float(timed["setting_speedup_lo"].min()) * 0.7), max(1.25, float(right.max()) * 2.2))
            for yi, v, r in zip(y, timed["setting_speedup"], right):
                ax.text(r * 1.12, yi, f"{v:.3g}x", va="center", ha="left", fontsize=9)
        _number_axis(ax.xaxis, "x")
        ax.set_title(textwrap.fill(panel, 40), fontsize=10)
        ax.set_xlabel(textwrap.fill(f"speedup over the same backend at {against} (paired 95% CI)", 40))
    return _save(plt, fig, axes, len(panels), out)




def plot_runs(timings: pd.DataFrame, out: Path):
    """Several runs' common cells: each later run's median time against the first run's, log-log, a point
    per cell in its backend's colour, the diagonal where the two agree (below it: faster in the later run).
    ``timings`` holds every run's rows with ``run_id`` and ``machine`` columns, the first run's first."""
    ok = timings[(timings["status"] == Status.OK) & timings["median_s"].notna() & (timings["workload"] != "train")]
    runs = list(dict.fromkeys(timings["run_id"]))
    if len(runs) < 2 or ok.empty:
        return None
    ok = ok.assign(label=backend_label(ok))
    key = cell_key(ok.columns)
    first = ok[ok["run_id"] == runs[0]].drop_duplicates(key).set_index(key)["median_s"]
    pairs = []
    for run in runs[1:]:
        other = ok[ok["run_id"] == run].drop_duplicates(key).set_index(key)["median_s"]
        both = first.index.intersection(other.index)
        if len(both):
            pairs.append((run, pd.DataFrame({"a": first.loc[both], "b": other.loc[both]}).reset_index()))
    if not pairs:
        return None
    plt, sns, fig, axes = _grid(len(pairs), 3, 5.0, 4.6)
    machine = dict(zip(timings["run_id"], timings["machine"]))
    palette = _palette(sns, pd.concat([d["label"] for _, d in pairs]))
    for ax, (run, d) in zip(axes.flat, pairs):
        for label, g in d.groupby("label", sort=True):
            ax.scatter(g["a"], g["b"], s=28, color=palette[label], label=label, edgecolor="white", linewidth=0.5)
        lo, hi = float(min(d["a"].min(), d["b"].min())) / 1.5, float(max(d["a"].max(), d["b"].max())) * 1.5
        ax.plot([lo, hi], [lo, hi], color="black", lw=1, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        _seconds_axis(ax.xaxis)
        _seconds_axis(ax.yaxis)
        ax.set_xlabel(textwrap.fill(f"{runs[0]} ({machine[runs[0]]})", 60), fontsize=8)
        ax.set_ylabel(textwrap.fill(f"{run} ({machine[run]})", 50), fontsize=8)
        ax.set_title(f"median time per call, {len(d)} cells in common\nbelow the line: faster in the later run",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    return _save(plt, fig, axes, len(pairs), out)
