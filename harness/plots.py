"""Plots drawn from the results tables only (never from the runner's state).

Each plot is made only when the run has the data for it; ``make_plots`` returns the
files it wrote.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

SIZE_COLUMNS = ("hidden_size", "batch", "seq_len", "input_size", "output_size")


def _setup():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    return plt, sns


def backend_label(df: pd.DataFrame) -> pd.Series:
    """``name`` for a backend's default variant, ``name:variant`` otherwise."""
    import backends

    def label(row):
        try:
            default = backends.backend_class(row["backend"]).variants[0]
        except Exception:  # an unknown plugin backend in an old run still gets a label
            default = None
        return row["backend"] if row["variant"] in (default, None) else f"{row['backend']}:{row['variant']}"

    return df.apply(label, axis=1) if len(df) else pd.Series(dtype=str)


def group_label(row) -> str:
    """A short, readable name for a comparison group."""
    bits = [row["model"], f"H={row['hidden_size']}", f"T={row['seq_len']}", f"B={row['batch']}", row["dtype"]]
    if row.get("tokens"):
        bits.insert(1, f"V={row['input_size']}")
    else:
        bits.insert(1, f"D={row['input_size']}")
    if row.get("threads", 1) != 1:
        bits.append(f"{row['threads']} thr")
    if row.get("device") == "gpu":
        bits.append("GPU")
    if row.get("bptt") and row["bptt"] != "full":
        bits.append(row["bptt"])
    return " ".join(str(b) for b in bits)


def plot_speedup(timings: pd.DataFrame, out: Path):
    """A panel per comparison group: a bar per backend with its 95% interval, the baseline at 1."""
    df = timings[(timings["status"] == "ok") & timings["speedup"].notna()].copy()
    if df.empty:
        return None
    plt, sns = _setup()
    df["label"] = backend_label(df)
    df["panel"] = df.apply(group_label, axis=1) + " · " + df["workload"]
    panels = list(dict.fromkeys(df["panel"]))
    ncol = min(3, len(panels))
    nrow = -(-len(panels) // ncol)
    n_backends = df["label"].nunique()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(nrow, ncol, figsize=(5.6 * ncol, (0.5 * n_backends + 1.8) * nrow), squeeze=False)
    palette = dict(zip(sorted(df["label"].unique()), sns.color_palette("tab10", n_backends)))
    for ax, panel in zip(axes.flat, panels):
        d = df[df["panel"] == panel].sort_values("speedup")
        y = np.arange(len(d))
        lo = (d["speedup"] - d["speedup_lo"]).clip(lower=0).fillna(0)
        hi = (d["speedup_hi"] - d["speedup"]).clip(lower=0).fillna(0)
        ax.barh(y, d["speedup"], xerr=[lo, hi], color=[palette[l] for l in d["label"]], capsize=3)
        ax.set_yticks(y, d["label"])
        ax.axvline(1.0, color="black", lw=1, ls="--")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        right = d["speedup_hi"].fillna(d["speedup"]).to_numpy()
        top = float(np.nanmax(right))
        ax.set_xlim(min(0.8, float(np.nanmin(d["speedup_lo"].fillna(d["speedup"]))) * 0.7), top * 2.2)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel(f"speedup over {d['baseline'].iloc[0]} (bars: 95% CI)")
        for yi, s, r in zip(y, d["speedup"], right):
            ax.text(max(r, s) * 1.08, yi, f"{s:.3g}x", va="center", fontsize=8)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_loss_vs_time(curves: pd.DataFrame, out: Path):
    """Evaluation loss against training wall-clock, a line per backend, with target and loss floor."""
    if curves is None or curves.empty:
        return None
    df = curves[curves["split"] == "eval"].copy()
    if df.empty:
        return None
    plt, sns = _setup()
    df["label"] = backend_label(df)
    df["panel"] = df.apply(lambda r: f"{r['model']} H={r['hidden_size']} B={r['batch']} {r['dtype']} {r['task']}", axis=1)
    panels = list(dict.fromkeys(df["panel"]))
    ncol = min(2, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(7 * ncol, 4.5 * nrow), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        d = df[df["panel"] == panel]
        sns.lineplot(data=d, x="wall_s", y="loss", hue="label", marker="o", ax=ax, estimator=None, units="cell_id")
        target = d["target_loss"].dropna()
        if len(target):
            ax.axhline(float(target.iloc[0]), color="crimson", ls="--", lw=1, label=f"target {float(target.iloc[0]):g}")
        floor = d["loss_floor"].dropna() if "loss_floor" in d else []
        if len(floor):
            ax.axhline(float(floor.iloc[0]), color="gray", ls=":", lw=1, label=f"loss floor {float(floor.iloc[0]):.3g}")
        ax.set_xlabel("training wall-clock (s, evaluation excluded)")
        ax.set_ylabel("evaluation loss")
        ax.set_title(panel, fontsize=10)
        ax.legend(fontsize=8)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_scaling(timings: pd.DataFrame, out: Path):
    """Log-log time per call against every size a sweep varied, a line per backend."""
    df = timings[(timings["status"] == "ok") & (timings["workload"] != "train")].copy()
    if df.empty:
        return None
    varying = [c for c in SIZE_COLUMNS if df[c].nunique() > 1]
    if not varying:
        return None
    plt, sns = _setup()
    df["label"] = backend_label(df)
    fig, axes = plt.subplots(1, len(varying), figsize=(6 * len(varying), 4.5), squeeze=False)
    for ax, col in zip(axes.flat, varying):
        others = [c for c in varying if c != col]
        d = df
        for c in others:  # hold the other varied sizes at their most common value
            d = d[d[c] == d[c].mode().iloc[0]]
        d = d.groupby(["label", "workload", col], as_index=False)["median_s"].median()
        sns.lineplot(data=d, x=col, y="median_s", hue="label", style="workload", marker="o", ax=ax)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylabel("median time per call (s)")
        ax.set_title(f"scaling with {col}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def make_plots(run_dir) -> list[Path]:
    """Draw every plot the run has data for into ``run_dir/plots``."""
    from harness.results import load_run

    run = load_run(run_dir)
    plots = Path(run_dir) / "plots"
    plots.mkdir(exist_ok=True)
    made = [
        plot_speedup(run.timings, plots / "speedup.png"),
        plot_loss_vs_time(run.curves, plots / "loss_vs_time.png"),
        plot_scaling(run.timings, plots / "scaling.png"),
    ]
    return [p for p in made if p is not None]
