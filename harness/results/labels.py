"""How cells, groups and durations are named on screen, in reports and in plots."""

from __future__ import annotations

import numpy as np
import pandas as pd


def backend_label(df: pd.DataFrame) -> pd.Series:
    """``name`` for a backend's default variant, ``name:variant`` otherwise."""
    import backends

    def label(row):
        return backends.full_name(row["backend"], row["variant"])

    return df.apply(label, axis=1) if len(df) else pd.Series(dtype=str)


def group_label(row, omit: tuple[str, ...] = ()) -> str:
    """A short, readable name for a comparison group; ``omit`` drops fields a plot puts on an axis."""
    model = row["model"]
    if row.get("workload") == "benchmark":  # an imported pytest-benchmark that is no harness cell: its group's name
        return str(model)
    if str(row.get("peephole")) == "True":  # a bool, a numpy bool or missing (NaN)
        model += "+peephole"
    if model == "elman" and row.get("activation") not in (None, "tanh"):
        model += f"-{row['activation']}"
    bits = [model, f"H={row['hidden_size']}", f"T={row['seq_len']}"]
    if "batch" not in omit:
        bits.append(f"B={row['batch']}")
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


def fmt_seconds(v) -> str:
    """A duration with a readable unit: ``1.23 ms``, ``45.6 us``, ``2.5 s``."""
    if v is None or not np.isfinite(v):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(v) >= scale or unit == "ns":
            return f"{v / scale:.3g} {unit}"
    return f"{v:.3g} s"
