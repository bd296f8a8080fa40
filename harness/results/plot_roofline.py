"""The roofline: achieved GFLOP/s against the estimated arithmetic intensity, under the measured roofs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from harness.results.labels import backend_label, fmt_bandwidth, fmt_rate
from harness.spec.status import Status
from harness.results.plot_style import _grid, _log_axis, _number_axis, _palette, _save
from harness.spec.model import DTYPE_BYTES
from harness.worker.cpu_roofs import HARDWARE


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
        ax.text(0.01, float(tf32.iloc[0]), f" TF32 GEMM {fmt_rate(tf32.iloc[0])} (not used: TF32 off)",
                transform=ax.get_yaxis_transform(), va="bottom", ha="left", fontsize=8)
    bandwidth = d["gpu_bandwidth_gbs"].dropna() if "gpu_bandwidth_gbs" in d else pd.Series(dtype=float)
    if len(bandwidth):
        bw = float(bandwidth.iloc[0])
        x = np.geomspace(*ax.get_xlim(), 50)
        roof = d["gemm_peak_gflops"].dropna()
        y = np.minimum(bw * x, float(roof.iloc[0])) if len(roof) else bw * x  # the roofline's sloped part
        ax.plot(x, y, color="black", lw=1, ls=":")
        # the label above its line, along it: the angle of the slope as drawn, not a fixed one
        x0, x1 = x[2], x[6]
        (px0, py0), (px1, py1) = ax.transData.transform([(x0, bw * x0), (x1, bw * x1)])
        angle = float(np.degrees(np.arctan2(py1 - py0, px1 - px0)))
        ax.annotate(f"memory {fmt_bandwidth(bw)}", (x0, bw * x0), xytext=(0, 4), textcoords="offset points",
                    va="bottom", ha="left", fontsize=8, rotation=angle, rotation_mode="anchor")


_ROOF_SOURCES = {"numpy": "NumPy", "jax": "JAX, float32 sums", "torch": "PyTorch", "cublas": "cuBLAS"}


def _roof_library(d: pd.DataFrame) -> str:
    libs = d["gemm_peak_library"].dropna() if "gemm_peak_library" in d else pd.Series(dtype=object)
    return str(libs.iloc[0]) if len(libs) else ("cublas" if d["device"].iloc[0] == "gpu" else "numpy")


def _roof_name(d: pd.DataFrame) -> str:
    """What a panel's roof is: a GEMM's peak, or the core's FMA peak where the engine's own FMA kernel beat
    every library's product (:data:`harness.worker.cpu_roofs.HARDWARE`)."""
    return "FMA peak" if _roof_library(d) == HARDWARE else "GEMM peak"


def _roof_source(d: pd.DataFrame) -> str:
    """What measured a panel's roof, for its label: the library, a 1024\u00b3 product (GPU: TF32 off)."""
    gpu = d["device"].iloc[0] == "gpu"
    lib = _roof_library(d)
    if lib == HARDWARE:
        return "the native engine's register-only FMA kernel"
    return f"{_ROOF_SOURCES.get(lib, lib)}, " + ("TF32 off" if gpu and d["dtype"].iloc[0] == "float32" else
                                                 "4096\u00b3" if gpu else "1024\u00b3")


def _share_ticks(axis) -> None:
    """The share of the peak, ticked up to 100% and no further: above the roof a share means nothing."""
    from matplotlib.ticker import FixedLocator, NullLocator

    lo, hi = sorted(axis.get_view_interval())
    ticks = [c * 10.0 ** k for k in range(-6, 3) for c in (1, 3) if lo <= c * 10.0 ** k <= min(hi, 100)]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(lambda v, _: f"{v:g}%")


def plot_roofline(timings: pd.DataFrame, out: Path):
    """Achieved GFLOP/s per cell against arithmetic intensity, under the GEMM peak measured at run start."""
    df = timings[(timings["status"] == Status.OK) & timings["gflops"].notna()].copy()
    if df.empty:
        return None
    df["label"] = backend_label(df)
    df["intensity"] = arithmetic_intensity(df)
    # what is true of the whole panel: a GPU cell's CPU thread count says nothing about the GPU
    df["panel"] = df.apply(lambda r: f"GPU · {r['dtype']}" if r["device"] == "gpu" else
                           f"CPU · {r['dtype']} · {r['threads']} thread" + ("s" if r["threads"] != 1 else ""), axis=1)
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
        tera = top >= 1e3  # TFLOP/s where the roofs reach them: no 300000 on the axis
        _log_axis(ax.yaxis, (lambda v: f"{v / 1e3:g}") if tera else (lambda v: f"{v:g}"))
        if gpu:
            _gpu_roofs(ax, d)
        master = d["master_peak_gflops"].dropna() if "master_peak_gflops" in d else pd.Series(dtype=float)
        if len(master):  # mixed precision: the float32 roof beside the low type's
            ax.axhline(float(master.iloc[0]), color="black", lw=1, ls="-.")
            ax.text(0.99, float(master.iloc[0]), f"float32 GEMM peak {fmt_rate(master.iloc[0])} ",
                    transform=ax.get_yaxis_transform(), va="bottom", ha="right", fontsize=8)
        if peak is not None:
            ax.axhline(peak, color="black", lw=1.3)
            ax.text(0.01, peak, f" {d['dtype'].iloc[0]} {_roof_name(d)} {fmt_rate(peak)} ({_roof_source(d)})",
                    transform=ax.get_yaxis_transform(), va="bottom", ha="left", fontsize=8)
            share = ax.twinx()
            share.set_yscale("log")
            share.set_ylim(*(v / peak * 100 for v in ax.get_ylim()))
            share.grid(False)
            _share_ticks(share.yaxis)
            share.set_ylabel(f"% of the {d['dtype'].iloc[0]} {_roof_name(d)}")
        ax.set_xlabel("arithmetic intensity of a step's matrix products (FLOP/byte, estimated)")
        ax.set_ylabel("achieved TFLOP/s" if tera else "achieved GFLOP/s")
        ax.set_title(panel, fontsize=10)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker="o", color=palette[l], label=l) for l in labels]
    handles += [Line2D([], [], ls="", marker=markers[w], color="gray", label=w)
                for w in markers if w in set(df["workload"])]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False)
    return _save(plt, fig, axes, len(panels), out, bbox_inches="tight")
