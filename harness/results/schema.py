"""The results schema: the columns that identify a cell, defined once.

A row of ``timings.parquet`` starts with :func:`cell_columns` of its cell; a row of
``curves.parquet`` repeats :data:`CURVE_ID_COLUMNS` of that row.
"""

from __future__ import annotations

import json

SIZE_COLUMNS = ("hidden_size", "batch", "seq_len", "input_size", "output_size")
PROBLEM_COLUMNS = ("model", "task", "workload", "dtype", "device", "threads", "bptt", "layers", "activation", "head",
                   "output_act", "peephole", "bias", "tokens") + SIZE_COLUMNS
CURVE_ID_COLUMNS = ("cell_id", "group", "backend", "variant", "device", "model", "task", "dtype", "batch",
                    "hidden_size", "threads", "bptt", "pins", "backend_version")
# A backend named with versions (jax@0.4.38+jaxlib@0.4.38) runs in an environment of its own: ``pins`` is
# what its name pins after the '@' (None: the main environment), ``backend_version`` the version of its
# package the cell ran with (a cell whose worker never started: the pinned version, or None).
VERSION_COLUMNS = ("pins", "backend_version")


def cell_columns(cell, host: str | None = None) -> dict:
    """The identifying columns of a config cell: its ids, backend and variant, problem and sweep point,
    and the host it ran on."""
    import backends
    from harness.spec.environments import split_pin_items

    p, m = cell.problem, cell.problem.model
    name, variant, pins = cell.ref.name, cell.ref.variant, cell.ref.pin_text or None
    if variant is None:  # the default variant, or "default" for a backend that cannot even be imported here
        variant = backends.default_variant(name) or "default"
    return {
        "cell_id": cell.cell_id, "group": cell.group_key, "backend": name, "variant": variant,
        "device": p.device, "model": m.kind, "task": cell.task.kind, "workload": p.workload, "dtype": p.dtype,
        "batch": p.batch, "seq_len": p.seq_len, "input_size": p.input_size, "hidden_size": m.hidden,
        "output_size": p.output_size, "threads": cell.threads, "bptt": str(m.bptt), "layers": m.layers,
        "activation": m.activation if m.kind == "elman" else m.kind, "head": m.head, "output_act": m.output_act,
        "peephole": m.peephole, "bias": m.bias, "tokens": p.tokens,
        "reset_after": m.reset_after if m.kind == "gru" else None, "bidirectional": m.bidirectional, "sweep": json.dumps(cell.point, default=str),
        "host": host,  # a run spread over a cluster names where each cell ran
        "pins": pins, "backend_version": split_pin_items(pins)[0] if pins else None,  # rows.py: the version it ran with
        "copy": cell.copy if cell.copy > 1 else None,  # numpy#2: the backend timed again beside itself (A/A)
    }


# The precision of a speedup (timing.speedup_precision) and what the stop rule saw, per row:
# the target, the achieved relative half-width of the 95% interval, whether it met the target,
# why the cell's rounds stopped (floor | target | cap), and the rounds a burst of load slowed:
# this cell's own, and for a speedup those slowed on both sides (kept: pairing cancels them)
# or on one side only (kept: they widen the interval); the worker processes that took the
# cell's rounds in turn (timing.processes) and the passes over its group it took rounds in
# (timing.passes, max_passes; the block of each round is in samples_block).
PRECISION_COLUMNS = ("speedup_precision", "speedup_half_width", "precision_met", "stop_reason",
                     "n_disturbed_rounds", "n_disturbed_shared", "n_disturbed_one_sided", "n_processes",
                     "n_passes")

# The processes behind a timed cell's absolute time (timing.processes, min_processes, passes): how many
# fresh worker processes its rounds came from, all passes, the spread of their own medians (slowest minus
# fastest, relative to the cell's median; None from one process) and, per round, the process that took it.
PROCESS_COLUMNS = ("n_worker_processes", "process_spread", "samples_process")

# What shaped a cell (harness.results.caveats): whether it was timed while other processes loaded the cores
# and the evidence (their CPU in cores, load, steal), whether its worker ran without the caller's steering
# variables (config clean_env), the variables that forced a kernel or a cache size in its worker with their
# origin (OPENBLAS_CORETYPE=Haswell (caller)), and the BLAS kernels its worker ran (openblas 0.3.31 Haswell).
GUARD_COLUMNS = ("contended", "contention", "env_clean", "env_forced", "blas_kernel")


# Every column of ``timings.parquet``, in its order: a row (harness.results.rows) has no other.
TIMING_COLUMNS = [
    "cell_id", "group", "backend", "variant", "device", "model", "task", "workload", "dtype", "batch",
    "seq_len", "input_size", "hidden_size", "output_size", "threads", "bptt", "layers", "activation",
    "head", "output_act", "peephole", "bias", "tokens", "sweep", "status", "error", "compile_s",
    "median_s", "iqr_s", "min_s", "mean_s", "stdev_s", "n_samples", "peak_rss_mb", "gflops",
    "gemm_peak_gflops", "baseline", "speedup", "speedup_lo", "speedup_hi", "time_to_target_s",
    "train_s", "eval_s", "final_loss", "loss_floor", "verified_ratio", "samples_s",
    "samples_block",
    # each round's place in the order its group's cells took it (0: first; harness.worker.measure.round_order)
    "samples_position",
    # the cell's host, the GPU roofs its GFLOP/s is read against, what its speedup is over (the
    # baseline, or the fastest verified cell when the baseline failed) and how the baseline ended
    "host", "gpu_tf32_gflops", "gpu_bandwidth_gbs", "speedup_over", "baseline_status",
    # pair_over: the first values of the paired settings ("dtype=float32"), and the cell's time against the
    # same backend there, from rounds in turn, with the paired 95% interval
    "setting_baseline", "setting_speedup", "setting_speedup_lo", "setting_speedup_hi",
    "reset_after", "bidirectional",
    # what measured gemm_peak_gflops (numpy, jax, torch, cublas) and, for a mixed-precision cell, the
    # roof of its float32 master dtype, drawn beside its own
    "gemm_peak_library", "master_peak_gflops",
    *PRECISION_COLUMNS,
    *VERSION_COLUMNS,
    *PROCESS_COLUMNS,
    *GUARD_COLUMNS,
    # a backend's second copy in its group (numpy#2, an A/A check; None for the first): labels end in #2
    "copy",
]

# The rows that share one baseline cell and one speedup column: a comparison group, split by the settings
# it paired (pair_over: a paired group holds each problem at every dtype and thread count). Tables and the
# report show one block per such split; for a group that paired nothing it is the group itself.
SPEEDUP_BLOCK = ["group", "dtype", "threads"]


def setting_values(text) -> dict[str, str]:
    """A ``setting_baseline`` value read back: ``"dtype=float32,threads=1"`` -> ``{"dtype": "float32", "threads": "1"}``."""
    return dict(part.split("=", 1) for part in str(text).split(","))


def cell_key(columns) -> list[str]:
    """The columns (of those present) that make rows of different runs the same cell: the problem and
    the backend's display label (``label``, which the reader adds)."""
    return [k for k in dict.fromkeys(["workload", *PROBLEM_COLUMNS, "label"]) if k in columns]
