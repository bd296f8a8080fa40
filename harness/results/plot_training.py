"""Training figures: loss against wall-clock, and time against the loss reached."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.results.labels import backend_label, fmt_seconds, group_label
from harness.spec.status import Status
from harness.results.plot_style import _grid, _palette, _save, _seconds_axis


def plot_loss_vs_time(curves: pd.DataFrame, out: Path):
    """Evaluation loss against training wall-clock, a line per backend (with several dtypes, a panel per
    backend and a line per dtype), with the target where the run set one and the loss floor where known."""
    if curves is None or curves.empty:
        return None
    df = curves[curves["split"] == "eval"].copy()
    if df.empty:
        return None
    df["label"] = backend_label(df)
    # several dtypes (mixed precision): a panel per backend with each dtype's curve on it, so that a low type's
    # curve is read against float32's on one axis; otherwise a panel per problem, a line per backend
    by_dtype = df["dtype"].nunique() > 1
    df["panel"] = df.apply(lambda r: (f"{r['label']} · " if by_dtype else "")
                           + f"{r['model']} H={r['hidden_size']} B={r['batch']}" + ("" if by_dtype else f" {r['dtype']}")
                           + f" {r['task']}" + (f" bptt {r['bptt']}" if r.get("bptt", "full") != "full" else ""), axis=1)
    panels = list(dict.fromkeys(df["panel"]))
    dtypes = [d for d in ("float32", "float64", "bfloat16", "float16") if d in set(df["dtype"])]
    plt, sns, fig, axes = _grid(len(panels), 2, 7, 4.5)
    palette = _palette(sns, df["label"])
    for ax, panel in zip(axes.flat, panels):
        d = df[df["panel"] == panel]
        if d["threads"].nunique() > 1:  # one line per backend and thread count
            d = d.assign(label=d["label"] + " " + d["threads"].astype(str) + " thr")
            palette.update(_palette(sns, d["label"]))
        if by_dtype:
            sns.lineplot(data=d, x="wall_s", y="loss", hue="label", style="dtype", style_order=dtypes, markers=True,
                         ax=ax, estimator=None, units="cell_id", palette=palette)
        else:
            sns.lineplot(data=d, x="wall_s", y="loss", hue="label", marker="o", ax=ax, estimator=None,
                         units="cell_id", palette=palette)
        target = d["target_loss"].dropna()
        if len(target):
            ax.axhline(float(target.iloc[0]), color="crimson", ls="--", lw=1, label=f"target {float(target.iloc[0]):g}")
        floor = d["loss_floor"].dropna() if "loss_floor" in d else []
        if len(floor):
            ax.axhline(float(floor.iloc[0]), color="gray", ls=":", lw=1, label=f"loss floor {float(floor.iloc[0]):.3g}")
        ends = d.groupby("cell_id")["wall_s"].max()
        ends = ends[ends > 0]
        if len(ends) > 1 and ends.max() > 8 * ends.min():
            # the fastest curves would be squeezed against the axis: logarithmic beyond the first step
            ax.set_xscale("symlog", linthresh=float(d.loc[d["wall_s"] > 0, "wall_s"].min()), linscale=0.3)
            ax.xaxis.set_minor_locator(plt.NullLocator())
            # the start (0) sits next to the first logarithmic tick: left unlabelled, so the two never overlap
            ax.xaxis.set_major_formatter(lambda v, _: "" if v == 0 else fmt_seconds(v))
            ax.set_xlim(0, float(ends.max()) * 1.3)
            ax.set_xlabel("training wall-clock (s, evaluation excluded; log scale)")
        else:
            ax.set_xlabel("training wall-clock (s, evaluation excluded)")
        losses = d.loc[d["loss"] > 0, "loss"]
        if len(losses) and losses.max() > 10 * losses.min():  # a fall of decades: a linear axis flattens it
            ax.set_yscale("log")
            ax.set_ylabel("evaluation loss (log scale)")
        else:
            ax.set_ylabel("evaluation loss")
        ax.set_title(panel, fontsize=10)
        if by_dtype:  # the panel names its backend: the legend tells the dtypes and the lines apart
            handles, names = ax.get_legend_handles_labels()
            keep = [(h, n) for h, n in zip(handles, names) if n in set(d["dtype"]) or n.startswith(("target", "loss floor"))]
            ax.legend(*zip(*keep), fontsize=8)
        else:
            ax.legend(fontsize=8)
    return _save(plt, fig, axes, len(panels), out)




def plot_train_tradeoff(timings: pd.DataFrame, out: Path):
    """Training time against the loss reached, a marker per backend x threads x batch (parallel minibatch)."""
    df = timings[(timings["status"] == Status.OK) & (timings["workload"] == "train")].copy()
    df = df[df["train_s"].notna() & df["final_loss"].notna()]
    if df.empty or len(df[["threads", "batch"]].drop_duplicates()) < 2:
        return None
    df["label"] = backend_label(df)
    df["problem"] = df.apply(lambda r: group_label(r, omit=("batch", "threads")), axis=1)
    panels = list(dict.fromkeys(df["problem"]))
    plt, sns, fig, axes = _grid(len(panels), 2, 7.5, 5)
    palette = _palette(sns, df["label"])
    shapes = dict(zip(sorted(df["threads"].unique()), "osD^vP*X"))
    for ax, problem in zip(axes.flat, panels):
        d = df[df["problem"] == problem]
        for (label, threads), g in d.groupby(["label", "threads"], sort=False):
            g = g.sort_values("batch")
            ax.plot(g["train_s"], g["final_loss"], marker=shapes[threads], ls=":", lw=0.8, color=palette[label],
                    label=f"{label}, {threads} thread" + ("s" if threads != 1 else ""))
        # every backend reaches (about) the same loss at one batch size: each batch named once, at the right edge
        for batch, g in d.groupby("batch"):
            ax.text(1.01, float(g["final_loss"].median()), f"B={batch}", transform=ax.get_yaxis_transform(),
                    va="center", ha="left", fontsize=8, color="#333333")
        ax.set_xscale("log")
        _seconds_axis(ax.xaxis)
        ax.set_xlabel("training time for the run's examples (evaluation excluded)")
        ax.set_ylabel("final evaluation loss")
        ax.set_title(f"{problem}\ntime against loss reached, per backend, threads and batch", fontsize=9)
        ax.legend(fontsize=8)
    return _save(plt, fig, axes, len(panels), out)
