"""How cells, groups and durations are named on screen, in reports and in plots."""

from __future__ import annotations

from harness.spec.errors import HarnessError

import numpy as np
import pandas as pd


def optional_text(v) -> str:
    """A cell of an optional text column ("" for None, NaN, or a column an older run lacks)."""
    return "" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v)


# A speedup whose 95% interval is wider than its precision target (timing.speedup_precision) is marked and
# named so wherever a speedup is shown: the terminal, the report, the multi-run report, the page and the plots
# (harness.results.standing: the imprecise standing; a legend names the run's target, ``interval wider than ±5%``).
MISSED_MARK = "†"
MISSED_NAME = "interval wider than its precision target"


def imprecise(row) -> bool:
    """A speedup timed with a precision target that ran out of time (or passes) before reaching it."""
    met = row.get("precision_met")
    return met is not None and not pd.isna(met) and not bool(met)


def backend_name(row) -> str:
    """A row's backend as configs name it, ``name[:variant][@versions]``: what its ``baseline`` names."""
    import backends

    base = backends.full_name(row["backend"], row["variant"])
    pins = optional_text(row.get("pins"))
    return copy_suffix(f"{base}@{pins}" if pins else base, row.get("copy"))


def copy_suffix(name: str, copy) -> str:
    """``name`` of a backend's copy (``numpy#2``, an A/A check); ``name`` itself for the first."""
    text = optional_text(copy)
    return f"{name}#{int(float(text))}" if text else name


def backend_label(df: pd.DataFrame) -> pd.Series:
    """``name`` for a backend's default variant, ``name:variant`` otherwise, followed by the version of its
    package (``jax 0.4.38``) where the row's name pins one or another row pins a version of that backend
    (``jax 0.10.2`` beside a pinned ``jax 0.4.38``); two pin sets that would still share a label are told
    apart by their names (``jax@0.4.38+jaxlib@0.4.36``). Tables without pins keep their plain labels, also
    across runs whose main environments differ (a CPU and a GPU machine's jax are one backend there)."""
    import backends

    if not len(df):
        return pd.Series(dtype=str)
    base = [backends.full_name(b, v) for b, v in zip(df["backend"], df["variant"])]
    pins = [optional_text(v) for v in (df["pins"] if "pins" in df else [None] * len(df))]
    version = [optional_text(v) for v in (df["backend_version"] if "backend_version" in df else [None] * len(df))]
    pinned = {name for name, p in zip(df["backend"], pins) if p}
    labels = [f"{b} {v}" if v and (p or name in pinned) else b
              for name, b, p, v in zip(df["backend"], base, pins, version)]
    sets: dict[str, set] = {}
    for label, p in zip(labels, pins):
        sets.setdefault(label, set()).add(p)
    labels = [f"{b}@{p}" if p and len(sets[label]) > 1 else label for b, p, label in zip(base, pins, labels)]
    copies = df["copy"] if "copy" in df else [None] * len(df)
    labels = [copy_suffix(label, c) for label, c in zip(labels, copies)]
    return pd.Series(labels, index=df.index, dtype=object)


def group_label(row, omit: tuple[str, ...] = ()) -> str:
    """A short, readable name for a comparison group; ``omit`` drops fields a plot puts on an axis."""
    model = row["model"]
    if row.get("workload") == "benchmark":  # an imported pytest-benchmark that is no harness cell: its group's name
        return str(model)
    if str(row.get("peephole")) == "True":  # a bool, a numpy bool or missing (NaN)
        model += "+peephole"
    if model == "elman" and row.get("activation") not in (None, "tanh"):
        model += f"-{row['activation']}"
    if model == "gru" and str(row.get("reset_after")) == "False":  # Cho et al.'s form; cuDNN's is the default
        model += "-before"
    if str(row.get("bidirectional")) == "True":
        model = f"bi{model}"
    bits = [model, f"H={row['hidden_size']}", f"T={row['seq_len']}"]
    if "batch" not in omit:
        bits.append(f"B={row['batch']}")
    if "dtype" not in omit:
        bits.append(row["dtype"])
    bits.insert(1, f"V={row['input_size']}" if row.get("tokens") else f"D={row['input_size']}")
    if "threads" not in omit and row.get("threads", 1) != 1:
        bits.append(f"{row['threads']} thr")
    if "device" not in omit and row.get("device") == "gpu":
        bits.append("GPU")
    if row.get("bptt") and row["bptt"] != "full":
        bits.append(row["bptt"])
    if (row.get("layers") or 1) > 1:
        bits.append(f"L={row['layers']}")
    return " ".join(str(b) for b in bits)


def setting_label(values, keys) -> str:
    """A paired setting as a reader names it, from a row or a dict of its ``keys``' values: ``bfloat16``,
    ``2 thr``, ``bfloat16 2 thr``."""
    return " ".join(f"{values[k]} thr" if k == "threads" else str(values[k]) for k in keys)


#: the workloads in the order a reader follows them: a forward pass, then a step that trains on it, then training
WORKLOAD_ORDER = {"forward": 0, "train_step": 1, "train": 2}


def sweep_order(key: str, value):
    """A swept key's value as it sorts in tables and panels: workloads in :data:`WORKLOAD_ORDER`, numbers
    (batch, threads) ascending, other values (dtype) by their text."""
    if key == "workload":
        return (WORKLOAD_ORDER.get(value, 9), str(value))
    try:
        return (0, float(value))
    except (TypeError, ValueError):
        return (1, str(value))


def reading_order(blocks) -> list:
    """Comparison groups (``(key, rows)`` pairs, as ``groupby`` yields them) in the order a reader looks for
    an answer: by workload, then by problem in the order the run met them, then device, dtype (run order)
    and threads, the batch innermost and ascending, so that a batch sweep reads as one run of rows (B=1,
    16, 64) and not in the order the config happened to list its parts."""
    blocks = list(blocks)
    heads = [rows.iloc[0] for _, rows in blocks]
    problems = [group_label(h, omit=("batch", "dtype", "threads", "device")) for h in heads]
    first_problem = {p: i for i, p in reversed(list(enumerate(problems)))}
    first_dtype = {str(h["dtype"]): i for i, h in reversed(list(enumerate(heads)))}

    def key(i):
        h = heads[i]
        return (sweep_order("workload", h["workload"]), first_problem[problems[i]], str(h.get("device") or ""),
                first_dtype[str(h["dtype"])], sweep_order("threads", h.get("threads")),
                sweep_order("batch", h.get("batch")))

    return [blocks[i] for i in sorted(range(len(blocks)), key=key)]


#: how every ratio is named on screen, in reports, plots and the page: a reference's time over this one's
SPEEDUP_MEANS = "a reference's time over this one's: above 1x, this one is faster"


def _finite(v) -> bool:
    try:
        return v is not None and bool(np.isfinite(float(v)))
    except (TypeError, ValueError):
        return False


def fmt_ratio(value, lo=None, hi=None) -> str:
    """A speedup (:data:`SPEEDUP_MEANS`) with its 95% interval where it has one: ``1.23x [1.10, 1.40]``,
    ``1.23x``, or ``-`` without a finite value."""
    if not _finite(value):
        return "-"
    value = float(value)
    return f"{value:.3g}x [{float(lo):.3g}, {float(hi):.3g}]" if _finite(lo) and _finite(hi) else f"{value:.3g}x"


def fmt_rate(gflops) -> str:
    """A compute rate in GFLOP/s with a readable unit: ``202 GFLOP/s``, ``51.3 TFLOP/s``."""
    if not _finite(gflops):
        return "-"
    v = float(gflops)
    return f"{v / 1e3:.3g} TFLOP/s" if abs(v) >= 1e3 else f"{v:.3g} GFLOP/s"


def fmt_bandwidth(gbs) -> str:
    """A memory bandwidth in GB/s with a readable unit: ``45.2 GB/s``, ``2.93 TB/s``."""
    if not _finite(gbs):
        return "-"
    v = float(gbs)
    return f"{v / 1e3:.3g} TB/s" if abs(v) >= 1e3 else f"{v:.3g} GB/s"


def fmt_seconds(v) -> str:
    """A duration with a readable unit: ``1.23 ms``, ``45.6 µs``, ``2.5 s``."""
    if v is None or not np.isfinite(v):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(v) >= scale or unit == "ns":
            return f"{v / scale:.3g} {unit}"
    return f"{v:.3g} s"


def machine_label(meta: dict) -> str:
    """A machine as a reader tells them apart, by what does not change between its runs: host, CPU model,
    cores, the vector flags that decide the kernels (AVX-512 with or without AVX512-BF16 and AMX, else AVX2),
    and the GPU. A measured figure (the GEMM peak at a run's start) is no name: the same VM measures 101 one day and
    202 the next (:func:`gemm_peak_text` gives it where a reader wants it)."""
    m = meta.get("machine") or {}
    flags = set(m.get("cpu_flags") or [])
    wide = "AVX-512" + (" + AVX512-BF16" if "avx512_bf16" in flags else "") + (" + AMX" if "amx_tile" in flags else "")
    vector = wide if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    gpus = m.get("gpus") or []
    bits = [m.get("cpu_model", "?"), f"{m.get('cores', '?')} cores"]
    bits += [vector] if vector else []
    bits.append(gpus[0].split(",")[0] if gpus else "no GPU")
    return f"{m.get('hostname', '?')} ({', '.join(bits)})"


def gemm_peak_text(meta: dict) -> str:
    """The float32 GEMM peak a run measured at its start, ``float32 GEMM 202 GFLOP/s`` ("" if none): NumPy's
    product where the run keeps it apart (the plain key is the best of every library, the engine's FMA
    kernel among them, which is no GEMM)."""
    from harness.spec.dtype import DType
    from harness.worker.cpu_roofs import read_peak_key

    by_library: dict = {}
    for key, rate in (meta.get("gemm_peak_gflops") or {}).items():
        try:
            dtype, _, library = read_peak_key(str(key))
        except HarnessError:
            continue
        if dtype == DType.FLOAT32 and rate is not None:
            by_library.setdefault(library, []).append(float(rate))
    peaks = by_library.get("numpy") or by_library.get(None)
    return f"float32 GEMM {fmt_rate(max(peaks))}" if peaks else ""
