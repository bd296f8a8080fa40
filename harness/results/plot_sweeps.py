"""Sweep figures: time against each size varied, threads, threads x batch, and CPU against GPU by batch."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from harness.results.labels import backend_label, fmt_seconds, group_label, optional_text
from harness.spec.status import Status
from harness.results.plot_style import (_grid, _measured_ticks, _palette, _save, _seconds_axis, backend_marker,
                                        direct_labels)
from harness.results.schema import PROBLEM_COLUMNS, SIZE_COLUMNS


# Columns that, together with the backend, identify what a cell measures.
_OMIT_KEY = {"batch": "batch", "threads": "threads", "device": "device"}


def _family_label(row, axis_col: str) -> str:
    """The problem a line of a sweep plot follows, without the swept column."""
    label = group_label(row, omit=tuple(_OMIT_KEY[c] for c in (axis_col,) if c in _OMIT_KEY))
    if axis_col in ("hidden_size", "seq_len", "input_size"):
        prefix = {"hidden_size": "H=", "seq_len": "T=", "input_size": ("V=", "D=")}[axis_col]
        label = " ".join(b for b in label.split() if not b.startswith(prefix))
    return f"{label} · {row['workload']}"


def _lines_along(df: pd.DataFrame, col: str) -> pd.DataFrame:
    """Rows of every (backend, problem) line that holds all else fixed and has >= 2 values of ``col``."""
    fixed = [c for c in PROBLEM_COLUMNS if c != col and c in df.columns]
    keys = ["backend", "variant"] + fixed
    filled = df[keys].astype(str)
    if "pins" in df.columns:  # jax@0.4.38 is a line of its own (None in the main environment: no text to join)
        filled = filled.assign(pins=df["pins"].map(optional_text))
    line_id = filled.apply("|".join, axis=1)
    counts = df.groupby(line_id)[col].transform("nunique")
    return df.assign(line=line_id)[counts >= 2]


def plot_scaling(timings: pd.DataFrame, out: Path):
    """Log-log time per call against each size a sweep varied with all else fixed: a panel per size and problem."""
    df = timings[(timings["status"] == Status.OK) & (timings["workload"] != "train")].copy()
    if df.empty:
        return None
    df["label"] = backend_label(df)
    panels = []
    for col in SIZE_COLUMNS:
        lines = _lines_along(df, col)
        if lines.empty:
            continue
        lines = lines.assign(family=lines.apply(_family_label, axis=1, axis_col=col))
        panels += [(col, family, d) for family, d in lines.groupby("family", sort=False)]
    if not panels:
        return None
    plt, sns, fig, axes = _grid(len(panels), 3, 6.2, 4.6)
    palette = _palette(sns, df["label"])
    for ax, (col, family, d) in zip(axes.flat, panels):
        ends = []
        for label, line in d.sort_values(col).groupby("label", sort=False):
            # a variant's marker as well as its shade: six shades of one hue alone do not tell cuda variants apart
            ax.plot(line[col], line["median_s"], marker=backend_marker(label), color=palette[label], label=label,
                    markeredgecolor="#222222", markeredgewidth=0.5)
            last = line.iloc[-1]
            ends.append((label, last[col], last["median_s"], palette[label]))
        ax.set_xscale("log")
        ax.set_yscale("log")
        _measured_ticks(ax.xaxis, d[col])
        ax.set_xlabel(col)
        ax.set_ylabel("median time per call")
        ax.set_title(f"scaling with {col}\n{family}", fontsize=9)
        direct_labels(ax, ends)  # each line named at its end: no legend to match shades against
        _seconds_axis(ax.yaxis)
    return _save(plt, fig, axes, len(panels), out)




def plot_threads_batch(timings: pd.DataFrame, out: Path):
    """Heatmap of time per example over threads x batch, a panel per backend and problem."""
    df = timings[(timings["status"] == Status.OK) & (timings["workload"] != "train")].copy()
    if df.empty or df["threads"].nunique() < 2 or df["batch"].nunique() < 2:
        return None
    df["label"] = backend_label(df)
    df["problem"] = df.apply(lambda r: f"{group_label(r, omit=('batch', 'threads'))} · {r['workload']}", axis=1)
    df["per_example_s"] = df["median_s"] / df["batch"]
    panels = [(key, g) for key, g in df.groupby(["label", "problem"], sort=False)
              if g["threads"].nunique() >= 2 and g["batch"].nunique() >= 2]
    if not panels:
        return None
    from matplotlib.colors import LogNorm

    n_batch = max(g["batch"].nunique() for _, g in panels)
    n_threads = max(g["threads"].nunique() for _, g in panels)
    plt, sns, fig, axes = _grid(len(panels), 3, max(4.8, 1.05 * n_batch + 2.6), 0.55 * n_threads + 2.1)
    for ax, ((label, problem), g) in zip(axes.flat, panels):
        pv = g.pivot_table(index="threads", columns="batch", values="per_example_s", aggfunc="median").sort_index()
        notes = pv.map(fmt_seconds)
        sns.heatmap(pv, annot=notes, fmt="", cmap="rocket_r", ax=ax, linewidths=0.5, annot_kws={"fontsize": 8},
                    norm=LogNorm(vmin=float(np.nanmin(pv.values)), vmax=float(np.nanmax(pv.values)) * 1.0001),
                    cbar_kws={"label": "time per example"})
        _seconds_axis(ax.collections[0].colorbar.ax.yaxis)
        ax.set_title(f"{label}\n{problem}", fontsize=9)
        ax.set_xlabel("batch")
        ax.set_ylabel("threads")
        ax.tick_params(axis="y", rotation=0)
    return _save(plt, fig, axes, len(panels), out)


def plot_threads(timings: pd.DataFrame, out: Path):
    """Time per step against threads, a line per backend (dotted: its one-thread time divided
    by the thread count), a panel per problem that was run at two or more thread counts."""
    df = timings[(timings["status"] == Status.OK) & timings["median_s"].notna()].copy()
    if df.empty or df["threads"].nunique() < 2:
        return None
    df["label"] = backend_label(df)
    df["problem"] = df.apply(lambda r: f"{group_label(r, omit=('threads',))} · {r['workload']}", axis=1)
    panels = [(problem, g) for problem, g in df.groupby("problem", sort=False)
              if g.groupby("label")["threads"].nunique().max() >= 2]
    if not panels:
        return None
    plt, sns, fig, axes = _grid(len(panels), 3, 5.6, 4.4)
    palette = _palette(sns, df["label"])
    for ax, (problem, g) in zip(axes.flat, panels):
        ends = []
        for label, line in g.groupby("label", sort=True):
            line = line.groupby("threads", as_index=False)[["median_s", "iqr_s"]].median().sort_values("threads")
            half = (line["iqr_s"].fillna(0) / 2).to_numpy()
            ax.errorbar(line["threads"], line["median_s"], yerr=half, marker=backend_marker(label), capsize=3,
                        color=palette[label], label=label)
            if 1 in set(line["threads"]) and len(line) >= 2:
                one = float(line.loc[line["threads"] == 1, "median_s"].iloc[0])
                ax.plot(line["threads"], one / line["threads"], ls=":", lw=1, color=palette[label])
            ends.append((label, line["threads"].iloc[-1], line["median_s"].iloc[-1], palette[label]))
        ax.set_xscale("log")
        ax.set_yscale("log")
        _measured_ticks(ax.xaxis, g["threads"])
        ax.set_xlabel("threads (dotted: ideal from 1 thread)")
        ax.set_ylabel("median time per call (bars: IQR)")
        ax.set_title(f"thread scaling\n{textwrap.fill(problem, 60)}", fontsize=9)
        direct_labels(ax, ends)  # each line named at its end: no legend to match shades against
        _seconds_axis(ax.yaxis)
    return _save(plt, fig, axes, len(panels), out)




def crossover_batch(cpu_best: pd.Series, gpu_best: pd.Series):
    """Smallest batch from which the GPU is faster at every measured larger batch; None if never."""
    both = pd.concat({"cpu": cpu_best, "gpu": gpu_best}, axis=1).dropna().sort_index()
    if both.empty:
        return None
    gpu_wins = (both["gpu"] < both["cpu"]).to_numpy()
    if not gpu_wins[-1]:
        return None
    first = len(gpu_wins)
    while first > 0 and gpu_wins[first - 1]:
        first -= 1
    return both.index[first]


def plot_crossover(timings: pd.DataFrame, out: Path):
    """Per problem, two panels: time per example against batch for CPU and GPU cells, with the
    crossover marked; and each backend's GPU-over-CPU speedup against batch (same backend)."""
    from harness.results.devices import gpu_over_cpu

    df = timings[(timings["status"] == Status.OK) & (timings["workload"] != "train")].copy()
    if df.empty or not {"cpu", "gpu"} <= set(df["device"]):
        return None
    df["label"] = backend_label(df)
    df["problem"] = df.apply(lambda r: f"{group_label(r, omit=('batch', 'threads', 'device'))} · {r['workload']}", axis=1)
    df["per_example_s"] = df["median_s"] / df["batch"]
    panels = [(p, g) for p, g in df.groupby("problem", sort=False)
              if set(g["device"]) >= {"cpu", "gpu"} and g["batch"].nunique() >= 2]
    if not panels:
        return None
    plt, sns, fig, axes = _grid(2 * len(panels), 2, 7.5, 5)
    palette = _palette(sns, df["label"])
    for i, (problem, g) in enumerate(panels):
        ax, ratio_ax = axes.flat[2 * i], axes.flat[2 * i + 1]
        styles = {"cpu": iter(["-", "-.", (0, (1, 1)), (0, (3, 1, 1, 1, 1, 1))]),
                  "gpu": iter(["--", (0, (5, 2, 1, 2)), (0, (8, 2))])}
        combos = g[["device", "threads"]].drop_duplicates().sort_values(["device", "threads"])
        style = {(dev, thr): next(styles[dev], "-") for dev, thr in combos.itertuples(index=False)}
        for (label, device, threads), line in g.groupby(["label", "device", "threads"], sort=False):
            line = line.sort_values("batch")
            several = (combos["device"] == device).sum() > 1
            name = f"{label} {device.upper()}" + (f" {threads} thr" if several else "")
            ax.plot(line["batch"], line["per_example_s"], marker="o" if device == "cpu" else "s",
                    ls=style[(device, threads)], color=palette[label], label=name)
        best = g.groupby(["device", "batch"])["per_example_s"].min()
        cross = crossover_batch(best.get("cpu", pd.Series(dtype=float)), best.get("gpu", pd.Series(dtype=float)))
        if cross is None:
            note = "CPU faster at every batch measured with both"
        elif cross == min(set(best["cpu"].index) & set(best["gpu"].index)):
            note = "GPU faster at every batch measured with both"
        else:
            ax.axvline(cross, color="gray", lw=1, ls=":")
            note = f"GPU faster from batch {cross}"
        ax.set_xscale("log")
        ax.set_yscale("log")
        _measured_ticks(ax.xaxis, g["batch"])
        _seconds_axis(ax.yaxis)
        ax.set_xlabel("batch")
        ax.set_ylabel("median time per example")
        ax.set_title(f"{problem}\n{note} (best backend per device)", fontsize=9)
        ax.legend(fontsize=8)
        _plot_device_ratio(ratio_ax, gpu_over_cpu(g.drop(columns=["label"])), palette, problem)
    return _save(plt, fig, axes, 2 * len(panels), out)


def _plot_device_ratio(ax, ratios: pd.DataFrame, palette, problem: str) -> None:
    """Each backend's CPU median over its own GPU median, against batch; 1 marks a tie."""
    if ratios.empty:
        ax.text(0.5, 0.5, "no backend timed on both devices", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    ratios = ratios.assign(label=backend_label(ratios))
    for label, line in ratios.groupby("label", sort=False):
        line = line.sort_values("batch")
        ax.plot(line["batch"], line["gpu_speedup"], marker="s", color=palette.get(label), label=label)
    ax.axhline(1.0, color="gray", lw=1, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _measured_ticks(ax.xaxis, ratios["batch"])
    ax.set_xlabel("batch")
    ax.set_ylabel("GPU speedup over the same backend on CPU")
    ax.set_title(f"{problem}\nabove 1: the GPU is faster (CPU at its fastest thread count)", fontsize=9)
    ax.legend(fontsize=8)
