"""Plots drawn from the results tables only (never from the runner's state).

Each plot is made only when the run has the data for it; ``make_plots`` returns the
files it wrote.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from harness.results.labels import backend_label, fmt_seconds, group_label, optional_text, setting_label  # noqa: F401  (re-exported for notebooks)
from harness.results.schema import PROBLEM_COLUMNS, SIZE_COLUMNS, cell_key, setting_values
from harness.spec.model import DTYPE_BYTES
from harness.spec.status import Status


def _setup():
    import sys

    import matplotlib

    # files only, no window; a notebook that already chose its backend keeps it (figures here are closed after saving)
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    return plt, sns


#: a hue per backend in registry order (numpy blue, torch orange, jax green, ...); its variants and pinned
#: versions are shades of it
_HUES = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173"]
#: hues for backends from plugins: none of them is a registry backend's
_PLUGIN_HUES = ["#6b6ecf", "#b5cf6b", "#e7ba52", "#d6616b", "#ce6dbd", "#9c9ede", "#cedb9c", "#e7969c"]
_SHADES = [0.0, 0.45, -0.35, 0.7, -0.55, 0.25, -0.2, 0.6]  # > 0 toward white, < 0 toward black


def _label_parts(label: str) -> tuple[str, str | None, str]:
    """``"jax:unroll=4 0.4.38"`` -> ``("jax", "unroll=4", "0.4.38")``: a label's backend, variant and the
    version or pins it carries (:func:`backend_label` writes ``name[:variant] VERSION`` or ``name@PINS``)."""
    import backends

    base, _, version = str(label).partition(" ")
    ref = backends.ref(base)
    return ref.name, ref.variant, version or ref.pin_text


def _hue(name: str) -> np.ndarray:
    import zlib

    import backends
    from matplotlib.colors import to_rgb

    names = list(backends.registry())
    hue = _HUES[names.index(name) % len(_HUES)] if name in names else \
        _PLUGIN_HUES[zlib.crc32(name.encode()) % len(_PLUGIN_HUES)]
    return np.array(to_rgb(hue))


def _shade_index(name: str, variant: str | None) -> int:
    """A variant's place among its backend's shades: the default first, then the class's variant order."""
    import zlib

    import backends

    try:
        variants = list(backends.backend_class(name).variants)
    except Exception:  # an unknown or broken backend still gets a stable shade
        variants = []
    if variant is None:
        return 0
    return variants.index(variant) if variant in variants else 1 + zlib.crc32(variant.encode()) % (len(_SHADES) - 1)


def _shade(base: np.ndarray, k: int) -> tuple[float, float, float]:
    f = _SHADES[k % len(_SHADES)]
    rgb = base + (1 - base) * f if f > 0 else base * (1 + f)
    return tuple(float(c) for c in rgb)


def backend_colour(label: str) -> tuple[float, float, float]:
    """The colour of a backend label alone: its backend's hue (registry order; a plugin's from hues no
    registry backend has), its variant a shade of it (the class's variant order)."""
    name, variant, _ = _label_parts(label)
    return _shade(_hue(name), _shade_index(name, variant))


def _palette(sns, labels) -> dict:
    """A colour per backend label of one plot: each backend's fixed hue, its variants their fixed shades
    (:func:`backend_colour`); where two labels of the plot would share a colour (versions of one variant,
    a variant whose shade another took), the later ones, in label order, take the next free shade."""
    out, taken = {}, {}
    for label in sorted(set(labels), key=lambda l: (_label_parts(l)[0], _label_parts(l)[2], str(l))):
        name, variant, _ = _label_parts(label)
        used = taken.setdefault(name, set())
        k = _shade_index(name, variant)
        while k % len(_SHADES) in used and len(used) < len(_SHADES):
            k += 1
        used.add(k % len(_SHADES))
        out[label] = _shade(_hue(name), k)
    return out


def _log_axis(axis, fmt) -> None:
    """Readable labels on a log axis (call after plotting): 1-2-5 ticks on short ranges, fewer on long ones."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(abs(v) for v in axis.get_view_interval())
    decades = np.log10(hi / lo) if lo > 0 else 10
    subs = (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0, 3.0) if decades <= 4 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    axis.set_minor_formatter(NullFormatter())


def _seconds_axis(axis) -> None:
    _log_axis(axis, fmt_seconds)


def _number_axis(axis, suffix: str = "") -> None:
    _log_axis(axis, lambda v: f"{v:g}{suffix}")


def _measured_ticks(axis, values) -> None:
    """Log-scaled axis whose ticks are exactly the (integer) values measured."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ticks = sorted({int(v) for v in values})
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(lambda v, _: f"{int(round(v))}")


def _grid(n_panels: int, max_cols: int, panel_w: float, panel_h: float):
    """A figure of ``n_panels`` panels, at most ``max_cols`` to a row: ``(plt, sns, fig, axes)``."""
    plt, sns = _setup()
    # as many to a row as fit, with the fewest empty slots (four panels: 2 x 2, not 3 + 1)
    ncol = min(range(1, min(max_cols, n_panels) + 1), key=lambda c: (-(-n_panels // c) * c - n_panels, -c))
    nrow = -(-n_panels // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(panel_w * ncol, panel_h * nrow), squeeze=False)
    return plt, sns, fig, axes


def _save(plt, fig, axes, n_panels: int, out: Path, **savefig) -> Path:
    """Hide the unused panels, lay out, write ``out`` (PNG) and an SVG beside it, and free the figure."""
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=144, **savefig)
    fig.savefig(out.with_suffix(".svg"), **savefig)
    plt.close(fig)
    return out


def _mark_untimed(ax, reasons: list[str]) -> None:
    """The panel's first rows: its cells that have no bar, each with why (their status)."""
    for k, why in enumerate(reasons):
        ax.text(0.03, k, f"not timed: {why}", va="center", fontsize=8, color="#a00000", style="italic",
                transform=ax.get_yaxis_transform())


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


def plot_loss_vs_time(curves: pd.DataFrame, out: Path):
    """Evaluation loss against training wall-clock, a line per backend, with target and loss floor."""
    if curves is None or curves.empty:
        return None
    df = curves[curves["split"] == "eval"].copy()
    if df.empty:
        return None
    df["label"] = backend_label(df)
    df["panel"] = df.apply(lambda r: f"{r['model']} H={r['hidden_size']} B={r['batch']} {r['dtype']} {r['task']}"
                           + (f" bptt {r['bptt']}" if r.get("bptt", "full") != "full" else ""), axis=1)
    panels = list(dict.fromkeys(df["panel"]))
    plt, sns, fig, axes = _grid(len(panels), 2, 7, 4.5)
    palette = _palette(sns, df["label"])
    for ax, panel in zip(axes.flat, panels):
        d = df[df["panel"] == panel]
        if d["threads"].nunique() > 1:  # one line per backend and thread count
            d = d.assign(label=d["label"] + " " + d["threads"].astype(str) + " thr")
            palette.update(_palette(sns, d["label"]))
        sns.lineplot(data=d, x="wall_s", y="loss", hue="label", marker="o", ax=ax, estimator=None, units="cell_id",
                     palette=palette)
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
        ax.legend(fontsize=8)
    return _save(plt, fig, axes, len(panels), out)


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
        for label, line in d.sort_values(col).groupby("label", sort=False):
            ax.plot(line[col], line["median_s"], marker="o", color=palette[label], label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _measured_ticks(ax.xaxis, d[col])
        _seconds_axis(ax.yaxis)
        ax.set_xlabel(col)
        ax.set_ylabel("median time per call")
        ax.set_title(f"scaling with {col}\n{family}", fontsize=9)
        ax.legend(fontsize=8)
    return _save(plt, fig, axes, len(panels), out)


def arithmetic_intensity(df: pd.DataFrame) -> pd.Series:
    """Estimated FLOP per byte of one time step's matrix products (input, recurrent, output).

    Each weight matrix is read once per step and the step's activations once each, the
    best any backend can do; the estimate depends on sizes only (B, D, H, O, dtype).
    """
    gates = df["model"].map({"lstm": 4, "gru": 3}).fillna(1).to_numpy(dtype=float)
    itemsize = df["dtype"].map(DTYPE_BYTES).to_numpy(dtype=float)  # what a product reads: 2 bytes under mixed precision
    b, d, h, o = (df[c].to_numpy(dtype=float) for c in ("batch", "input_size", "hidden_size", "output_size"))
    layers = df["layers"].fillna(1).to_numpy(dtype=float) if "layers" in df else np.ones(len(df))
    tokens = df["tokens"].fillna(False).to_numpy(dtype=bool) if "tokens" in df else np.zeros(len(df), bool)
    d_in = np.where(tokens, 0.0, d)  # a token input is a row lookup, no product
    weights = gates * h * (d_in + h) + (layers - 1) * gates * h * (h + h) + h * o
    flops = 2 * b * weights
    moved = itemsize * (weights + b * (d_in + layers * (h + gates * h + h) + o))
    return pd.Series(flops / moved, index=df.index)


def _gpu_roofs(ax, d: pd.DataFrame) -> None:
    """The GPU's other roofs: its TF32 GEMM rate (dashed) and its memory bandwidth's slope."""
    import numpy as np

    tf32 = d["gpu_tf32_gflops"].dropna() if "gpu_tf32_gflops" in d else pd.Series(dtype=float)
    if len(tf32):
        ax.axhline(float(tf32.iloc[0]), color="black", lw=1, ls="--")
        ax.text(0.01, float(tf32.iloc[0]), f" TF32 GEMM {float(tf32.iloc[0]):.3g} GFLOP/s (not used: TF32 off)",
                transform=ax.get_yaxis_transform(), va="bottom", ha="left", fontsize=8)
    bandwidth = d["gpu_bandwidth_gbs"].dropna() if "gpu_bandwidth_gbs" in d else pd.Series(dtype=float)
    if len(bandwidth):
        bw = float(bandwidth.iloc[0])
        x = np.geomspace(*ax.get_xlim(), 50)
        roof = d["gemm_peak_gflops"].dropna()
        y = np.minimum(bw * x, float(roof.iloc[0])) if len(roof) else bw * x  # the roofline's sloped part
        ax.plot(x, y, color="black", lw=1, ls=":")
        ax.text(x[0], bw * x[0], f" memory {bw:.3g} GB/s", va="bottom", ha="left", fontsize=8, rotation=20)


_ROOF_SOURCES = {"numpy": "NumPy", "jax": "JAX, float32 sums", "torch": "PyTorch", "cublas": "cuBLAS"}


def _roof_source(d: pd.DataFrame) -> str:
    """What measured a panel's roof, for its label: the library, a 1024\u00b3 product (GPU: TF32 off)."""
    gpu = d["device"].iloc[0] == "gpu"
    libs = d["gemm_peak_library"].dropna() if "gemm_peak_library" in d else pd.Series(dtype=object)
    lib = str(libs.iloc[0]) if len(libs) else ("cublas" if gpu else "numpy")
    return f"{_ROOF_SOURCES.get(lib, lib)}, " + ("TF32 off" if gpu and d["dtype"].iloc[0] == "float32" else
                                                 "4096\u00b3" if gpu else "1024\u00b3")


def plot_roofline(timings: pd.DataFrame, out: Path):
    """Achieved GFLOP/s per cell against arithmetic intensity, under the GEMM peak measured at run start."""
    df = timings[(timings["status"] == Status.OK) & timings["gflops"].notna()].copy()
    if df.empty:
        return None
    df["label"] = backend_label(df)
    df["intensity"] = arithmetic_intensity(df)
    df["panel"] = df.apply(lambda r: f"{r['device'].upper()} · {r['dtype']} · {r['threads']} thread"
                           + ("s" if r["threads"] != 1 else ""), axis=1)
    panels = list(dict.fromkeys(df.sort_values(["device", "dtype", "threads"])["panel"]))
    plt, sns, fig, axes = _grid(len(panels), 2, 7.5, 5.2)
    labels = sorted(df["label"].unique())
    palette = _palette(sns, df["label"])
    markers = dict(zip(["forward", "train_step", "train"], ["o", "s", "^"]))
    for ax, panel in zip(axes.flat, panels):
        d = df[df["panel"] == panel]
        for (label, workload), g in d.groupby(["label", "workload"], sort=False):
            ax.scatter(g["intensity"], g["gflops"], color=palette[label], marker=markers.get(workload, "o"),
                       s=46, edgecolor="white", linewidth=0.6, zorder=3)
        peaks = d["gemm_peak_gflops"].dropna()
        # a CPU panel's roof is NumPy's GEMM (a mixed-precision panel's the fastest library's), a GPU
        # panel's cuBLAS's, all measured at run start
        peak = float(peaks.iloc[0]) if len(peaks) else None
        gpu = d["device"].iloc[0] == "gpu"
        ax.set_xscale("log")
        ax.set_yscale("log")
        roofs = [float(d[c].max()) for c in ("master_peak_gflops", "gpu_tf32_gflops") if c in d and d[c].notna().any()]
        top = max([float(d["gflops"].max()), peak or 0, *roofs])
        ax.set_ylim(float(d["gflops"].min()) / 3, top * 2)
        ax.set_xlim(float(d["intensity"].min()) / 2, float(d["intensity"].max()) * 2)
        _number_axis(ax.xaxis)
        _number_axis(ax.yaxis)
        if gpu:
            _gpu_roofs(ax, d)
        master = d["master_peak_gflops"].dropna() if "master_peak_gflops" in d else pd.Series(dtype=float)
        if len(master):  # mixed precision: the float32 roof beside the low type's
            ax.axhline(float(master.iloc[0]), color="black", lw=1, ls="-.")
            ax.text(0.99, float(master.iloc[0]), f"float32 GEMM peak {float(master.iloc[0]):.3g} GFLOP/s ",
                    transform=ax.get_yaxis_transform(), va="bottom", ha="right", fontsize=8)
        if peak is not None:
            ax.axhline(peak, color="black", lw=1.3)
            ax.text(0.01, peak, f" {d['dtype'].iloc[0]} GEMM peak {peak:.3g} GFLOP/s ({_roof_source(d)})",
                    transform=ax.get_yaxis_transform(), va="bottom", ha="left", fontsize=8)
            share = ax.twinx()
            share.set_yscale("log")
            share.set_ylim(*(v / peak * 100 for v in ax.get_ylim()))
            share.grid(False)
            _number_axis(share.yaxis, "%")
            share.set_ylabel("% of GEMM peak")
        ax.set_xlabel("arithmetic intensity of a step's matrix products (FLOP/byte, estimated)")
        ax.set_ylabel("achieved GFLOP/s")
        ax.set_title(panel, fontsize=10)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker="o", color=palette[l], label=l) for l in labels]
    handles += [Line2D([], [], ls="", marker=markers[w], color="gray", label=w)
                for w in markers if w in set(df["workload"])]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False)
    return _save(plt, fig, axes, len(panels), out, bbox_inches="tight")


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
        for label, line in g.groupby("label", sort=True):
            line = line.groupby("threads", as_index=False)[["median_s", "iqr_s"]].median().sort_values("threads")
            half = (line["iqr_s"].fillna(0) / 2).to_numpy()
            ax.errorbar(line["threads"], line["median_s"], yerr=half, marker="o", capsize=3, color=palette[label],
                        label=label)
            if 1 in set(line["threads"]) and len(line) >= 2:
                one = float(line.loc[line["threads"] == 1, "median_s"].iloc[0])
                ax.plot(line["threads"], one / line["threads"], ls=":", lw=1, color=palette[label])
        ax.set_xscale("log")
        ax.set_yscale("log")
        _measured_ticks(ax.xaxis, g["threads"])
        _seconds_axis(ax.yaxis)
        ax.set_xlabel("threads")
        ax.set_ylabel("median time per call (bars: IQR)")
        ax.set_title(f"thread scaling\n{textwrap.fill(problem, 60)}", fontsize=9)
        ax.legend(fontsize=8, title="dotted: ideal from 1 thread", title_fontsize=7)
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


@dataclass(frozen=True)
class Plot:
    """One plot a run can have: its file under ``plots/``, what draws it from the run's tables
    (``draw(run, path)``, None when the run has nothing to show there) and its caption in the report."""

    file: str
    draw: Callable
    caption: str


# The plots, in the order the report shows them: a new plot is added here, and only here.
PLOTS = (
    Plot("speedup.png", lambda run, out: plot_speedup(run.timings, out),
         "Speedup over the baseline per comparison group, from rounds timed in turn; bars are the 95% intervals "
         "of the table."),
    Plot("settings.png", lambda run, out: plot_settings(run.timings, out),
         "Each backend's time at a paired setting (pair_over: dtype, threads) against its own at the first "
         "one, from rounds taken in turn in one group; bars are the paired 95% intervals, 1x the line."),
    Plot("loss_vs_time.png", lambda run, out: plot_loss_vs_time(run.curves, out),
         "Evaluation loss against training wall-clock (evaluation time excluded), with the target and the task's "
         "loss floor."),
    Plot("scaling.png", lambda run, out: plot_scaling(run.timings, out),
         "Median time per call against each size the run varied, all else fixed."),
    Plot("roofline.png", lambda run, out: plot_roofline(run.timings, out),
         "Achieved GFLOP/s per cell against the estimated arithmetic intensity of a step's matrix products; "
         "the line is the GEMM peak measured at the start of the run."),
    Plot("threads_batch.png", lambda run, out: plot_threads_batch(run.timings, out),
         "Time per example over threads x batch."),
    Plot("threads.png", lambda run, out: plot_threads(run.timings, out),
         "Time per step against threads, a line per backend; dotted, its one-thread time divided by the thread "
         "count (perfect scaling)."),
    Plot("crossover.png", lambda run, out: plot_crossover(run.timings, out),
         "CPU and GPU time per example against batch size; the dotted line marks where the GPU starts to win."),
    Plot("train_tradeoff.png", lambda run, out: plot_train_tradeoff(run.timings, out),
         "Training time for the run's examples against the loss reached, per backend, threads and batch."),
)


def make_plots(run_dir) -> list[Path]:
    """Draw every plot the run has data for into ``run_dir/plots`` (PNG, and SVG beside each), each file
    stamped with what it was drawn from (:func:`plots_digest`) and listed in ``plots/plots.json``;
    files an earlier drawing left there that this one does not draw are removed."""
    from harness.results.store import load_run

    run = load_run(run_dir)
    folder = Path(run_dir) / "plots"
    folder.mkdir(exist_ok=True)
    made = [p for p in (plot.draw(run, folder / plot.file) for plot in PLOTS) if p is not None]
    files = sorted(f.name for p in made for f in (p, p.with_suffix(".svg")) if f.exists())
    digest = plots_digest(run_dir)
    for name in files:
        _stamp(folder / name, _file_digest(digest, name))
    for old in _drawn_files(folder):
        if old.name not in files:
            old.unlink()
    (folder / MANIFEST).write_text(json.dumps({"digest": digest, "files": files}, indent=1) + "\n")
    return made


# -- plots checked like tables: what drew each file, and whether today's code draws the same ----------
#: the list of a run's plots and what they were drawn from, beside them
MANIFEST = "plots.json"
#: the text key of the stamp in a PNG, and its marker in an SVG
STAMP_KEY = "harness-plot"
#: the code that decides what a plot shows: a change here redraws every committed run's plots
PLOT_CODE = ("harness/results/plots.py", "harness/results/labels.py", "harness/results/schema.py")
#: the tables a plot is drawn from
PLOT_INPUTS = ("timings.parquet", "curves.parquet")


def _drawn_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".png", ".svg")) if folder.is_dir() else []


def plotting_code_digest() -> str:
    """A hash of the plotting code and of what colours depend on (the registry's backends and their variants)."""
    import hashlib

    import backends

    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for rel in PLOT_CODE:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes())
    for name in backends.registry():
        try:
            variants = list(backends.backend_class(name).variants)
        except Exception:
            variants = []
        h.update(f"{name}:{','.join(map(str, variants))};".encode())
    return h.hexdigest()


def plots_digest(run_dir) -> str:
    """What a run's plots are drawn from: its tables' bytes and the plotting code (:func:`plotting_code_digest`)."""
    import hashlib

    h = hashlib.sha256(plotting_code_digest().encode())
    for name in PLOT_INPUTS:
        path = Path(run_dir) / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"-"))
    return h.hexdigest()[:32]


def _file_digest(digest: str, name: str) -> str:
    import hashlib

    return hashlib.sha256(f"{digest}/{name}".encode()).hexdigest()[:32]


def _stamp(path: Path, value: str) -> None:
    """Write ``value`` into the file: a PNG text chunk, or a comment after an SVG's XML declaration."""
    if path.suffix == ".png":
        from PIL import Image
        from PIL.PngImagePlugin import PngInfo

        with Image.open(path) as image:
            image.load()
            info = PngInfo()
            for k, v in image.text.items():
                if k != STAMP_KEY:
                    info.add_text(k, v)
            info.add_text(STAMP_KEY, value)
            image.save(path, pnginfo=info)
    else:
        text = path.read_text()
        head, sep, rest = text.partition("?>")
        path.write_text(f"{head}{sep}\n<!-- {STAMP_KEY}: {value} -->{rest}" if sep else f"<!-- {STAMP_KEY}: {value} -->\n{text}")


def read_stamp(path: Path) -> str | None:
    """The stamp a plot file carries (None: none, or not a readable image)."""
    try:
        if path.suffix == ".png":
            from PIL import Image

            with Image.open(path) as image:
                return image.text.get(STAMP_KEY)
        found = re.search(rf"<!-- {STAMP_KEY}: (\w+) -->", path.read_text()[:4000])
        return found.group(1) if found else None
    except (OSError, ValueError, SyntaxError):
        return None


def check_plots(run_dir) -> list[str]:
    """Why the run's plots are not what ``harness plot`` draws from it today (empty: they are)."""
    folder = Path(run_dir) / "plots"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        listed, digest = list(manifest["files"]), str(manifest["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{folder}: no {MANIFEST} (not drawn by today's harness plot)"]
    problems = []
    if digest != plots_digest(run_dir):
        problems.append(f"{folder}: drawn from other rows or by other plotting code than today's")
    for name in listed:
        stamp = read_stamp(folder / name)
        if stamp is None:
            problems.append(f"{folder / name}: missing, or without the stamp of the drawing")
        elif stamp != _file_digest(digest, name):
            problems.append(f"{folder / name}: not the plot drawn under this name")
    extra = [p.name for p in _drawn_files(folder) if p.name not in listed]
    if extra:
        problems.append(f"{folder}: {', '.join(extra)} not drawn by harness plot")
    return problems
