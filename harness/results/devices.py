"""CPU against GPU: the same backend's time on both devices, per problem and batch.

A speedup compares backends within one comparison group (one device). A run that
measures both devices also answers "from which batch does the GPU pay?": this module
pairs each backend's GPU cell with its own CPU cell of the same problem, and the summary
table, the report and ``crossover.png`` show the ratio.
"""

from __future__ import annotations
from harness.spec.status import Status

import pandas as pd

#: the columns that, with the backend, identify one problem at one batch on either device
PROBLEM_COLUMNS = ["workload", "model", "task", "dtype", "batch", "seq_len", "input_size", "hidden_size",
                   "output_size", "bptt", "layers", "activation", "head", "output_act", "peephole", "bias",
                   "tokens", "sweep"]


def gpu_over_cpu(timings: pd.DataFrame) -> pd.DataFrame:
    """One row per backend, problem and batch timed ok on both devices: ``gpu_speedup`` =
    CPU median / GPU median (above 1: the GPU is faster), against the CPU's fastest thread count."""
    cols = ["backend", "variant"] + PROBLEM_COLUMNS
    empty = pd.DataFrame(columns=cols + ["cpu_threads", "cpu_median_s", "gpu_median_s", "gpu_speedup"])
    if timings.empty or "device" not in timings:
        return empty
    ok = timings[(timings["status"] == Status.OK) & timings["median_s"].notna()]
    keys = [c for c in cols if c in ok.columns]
    cpu = ok[ok["device"] == "cpu"].sort_values("median_s").drop_duplicates(keys)  # fastest thread count
    gpu = ok[ok["device"] == "gpu"].sort_values("median_s").drop_duplicates(keys)
    if cpu.empty or gpu.empty:
        return empty
    both = cpu[keys + ["threads", "median_s"]].merge(gpu[keys + ["median_s"]], on=keys, suffixes=("_cpu", "_gpu"))
    both = both.rename(columns={"threads": "cpu_threads", "median_s_cpu": "cpu_median_s", "median_s_gpu": "gpu_median_s"})
    both["gpu_speedup"] = both["cpu_median_s"] / both["gpu_median_s"]
    return both.sort_values(["workload", "backend", "variant", "batch"], kind="stable").reset_index(drop=True)
