"""The report's sections that describe a run rather than answer it: how and where it ran, the libraries,
conformance, GPU against CPU, failures and training."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from harness.results.report_blocks import (Heading, Para, Pre, Table, _f, _first_line, _num, fmt_time, folded,
                                           short_paths)
from harness.spec.model import REDUCED_DTYPES
from harness.worker.cpu_roofs import read_peak_key
from harness.spec.status import FAILED, Status


def _labels(df: pd.DataFrame) -> pd.Series:
    from harness.results.labels import backend_label

    return backend_label(df)


def _when(stamp) -> str:
    try:
        return pd.Timestamp(stamp).tz_convert("UTC").strftime("%Y-%m-%d %H:%M:%S UTC")
    except (ValueError, TypeError):
        return str(stamp or "?")


def _duration(start, end) -> str:
    try:
        seconds = (pd.Timestamp(end) - pd.Timestamp(start)).total_seconds()
    except (ValueError, TypeError):
        return "?"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"



def _run_section(meta: dict, timings: pd.DataFrame, run_dir: Path) -> list:
    summary = meta.get("summary") or (timings["status"].value_counts().to_dict() if len(timings) else {})
    counts = ", ".join(f"{n} {s}" for s, n in sorted(summary.items())) or "no cells"
    when = f"started {_when(meta.get('started'))}"
    if meta.get("finished"):
        when += f", finished {_when(meta['finished'])} ({_duration(meta.get('started'), meta['finished'])})"
    elif meta.get("interrupted"):
        when += f", interrupted (finish it with `harness run {meta.get('config_path', 'CONFIG')} --resume {run_dir}`)"
    rows = [
        ["run id", f"`{meta.get('run_id', '?')}`"],
        ["config", f"`{meta.get('config_path', '?')}`"],
        ["when", when],
        ["cells", counts],
        ["baseline", f"`{meta.get('baseline', '?')}`"],
        ["git commit", f"`{meta.get('git_commit') or 'unknown'}`" + _changed(meta.get("git_changed"))],
    ]
    swapped = {name: entry for name, entry in (meta.get("backend_sources") or {}).items()
               if isinstance(entry, dict) and entry.get("origin") == "HARNESS_BACKENDS"}
    if swapped:  # classes chosen by the variable, not the registry: a built-in name may stand for another class
        rows.append(["HARNESS_BACKENDS", "; ".join(
            f"`{name}` = `{e.get('class')}`" + (f" (replaces the built-in `{e['replaces']}`)" if e.get("replaces") else "")
            for name, e in swapped.items())])
    if meta.get("env_overridden"):
        rows.append(["env set by backends", "; ".join(
            f"`{b}`: " + ", ".join(f"{k} (config {v.get('config')!r}, worker got {v.get('worker')!r})" for k, v in vs.items())
            for b, vs in meta["env_overridden"].items())])
    if meta.get("speedup_interval"):  # an imported run: its rounds were not taken in turn
        rows.append(["speedup intervals", str(meta["speedup_interval"])])
    timing = timing_summary(timings)
    if timing:
        rows.append(["timing", timing])
    return [Heading(2, "Run")] + folded([Table(["", ""], rows)], "How the run ran")


def _changed(files) -> str:
    """The files that differed from the commit, where the run recorded them (a few named, the rest counted)."""
    if not files:
        return ""
    shown = ", ".join(f"`{f}`" for f in files[:6])
    return f" (changed: {shown}" + (f" and {len(files) - 6} more" if len(files) > 6 else "") + ")"


def timing_summary(timings: pd.DataFrame) -> str | None:
    """How the timed cells were measured, from their rows: precision target, processes and passes,
    and how many speedups met the target (None for a run without these columns)."""
    if "precision_met" not in timings or "n_passes" not in timings:
        return None
    timed = timings[timings["n_passes"].notna() & (timings["n_passes"] > 0)]
    if timed.empty:
        return None
    parts = []
    targets = sorted({float(v) for v in timed["speedup_precision"].dropna()})
    if targets:
        parts.append("precision target " + ", ".join(f"±{t:.1%}" for t in targets))
    procs = sorted({int(v) for v in timed["n_processes"].dropna()})
    parts.append(f"{'-'.join(map(str, dict.fromkeys([procs[0], procs[-1]])))} process(es) per pass")
    lo, hi = int(timed["n_passes"].min()), int(timed["n_passes"].max())
    parts.append(f"{lo} pass(es)" if lo == hi else f"{lo}-{hi} passes")
    judged = [m for m in timed["precision_met"] if m is not None and not pd.isna(m)]
    if judged:
        parts.append(f"{sum(bool(m) for m in judged)} of {len(judged)} speedups met the target")
    return "; ".join(parts)


def _machine_section(meta: dict) -> list:
    m = meta.get("machine") or {}
    blas = m.get("numpy_blas") or {}
    rows = [
        ["CPU", str(m.get("cpu_model", "?"))],
        ["CPU features", ", ".join(m.get("cpu_flags") or []) or "-"],
        ["cores", str(m.get("cores", "?"))],
        ["memory", _f(m.get("memory_gb"), "g", " GB")],
        ["NumPy BLAS", " ".join(str(v) for v in (blas.get("name"), blas.get("version")) if v) or "-"],
        ["GPUs", "; ".join(m.get("gpus") or []) or "none"],
        ["platform", str(m.get("platform", "?"))],
        ["Python (runner)", str(meta.get("harness_python") or m.get("python", "?"))],
        ["load average at start", ", ".join(f"{v:.2f}" for v in m.get("loadavg") or []) or "-"],
        ["load average at end", ", ".join(f"{v:.2f}" for v in meta.get("loadavg_end") or []) or "-"],
        ["CPU steal during the run", _f((meta.get("steal_share") or 0) * 100 if meta.get("steal_share") is not None else None, ".2g", "%")],
    ]
    for key, gflops in sorted((meta.get("gemm_peak_gflops") or {}).items()):
        dtype, threads, library = read_peak_key(key)
        through = f" through {library}" if library else (" (the roof)" if dtype in REDUCED_DTYPES else "")
        rows.append([f"GEMM peak, {dtype}, threads {threads}{through}", _f(gflops, ".4g", " GFLOP/s")])
    env = meta.get("env") or {}
    if env:
        every = ", ".join(f"`{k}={v}`" for k, v in sorted(env.items()))
        rows.append(["environment of every worker", short_paths(every)])
    return [Heading(2, "Machine")] + folded([Table(["", ""], rows)], f"{m.get('cpu_model', '?')}: the machine in full")


def _versions_section(meta: dict) -> list:
    versions = meta.get("versions") or {}
    if not versions:
        return [Heading(2, "Library versions"), Para("No worker reported library versions (no cell got as far as starting).")]
    rows = []
    for backend, libs in sorted(versions.items()):
        if isinstance(libs, dict):
            text = ", ".join(f"{k} {v}" for k, v in libs.items())
        else:
            text = str(libs)
        rows.append([backend, short_paths(text)])
    out = [Heading(2, "Library versions")] + folded(
        [Table(["backend", "libraries (as its worker imported them)"], rows)],
        f"The libraries of {len(rows)} backend(s), as each worker imported them", always=True)
    # library flags a backend sets for its workers (XLA_FLAGS, THEANO_FLAGS, ...); thread counts vary per cell
    from harness.run.envs import THREAD_VARS

    common = meta.get("env") or {}
    own = []
    def shown(env: dict) -> str:
        extra = {k: v for k, v in env.items() if k not in THREAD_VARS and common.get(k) != v and k != "CUDA_VISIBLE_DEVICES"}
        return short_paths(", ".join(f"`{k}={v}`" for k, v in sorted(extra.items())))

    for backend, env in sorted((meta.get("worker_env") or {}).items()):
        # what differs between its cells, per setting, labelled by the thread count it went with
        settings = [s for s in (meta.get("worker_env_settings") or {}).get(backend, []) if shown(s["env"])]
        parts = [shown(env)] * bool(shown(env)) + [
            f"{shown(s['env'])} ({_setting_words(s)})" if len(settings) > 1 else shown(s["env"]) for s in settings]
        if parts:
            own.append([backend, "; ".join(parts)])
    if own:
        out += folded([Table(["backend", "its own worker environment"], own)],
                      f"The worker environment {len(own)} backend(s) set for themselves", always=True)
    return out


def _setting_words(setting: dict) -> str:
    """A worker setting of ``run.json``'s ``worker_env_settings`` in words: its thread count, else its cells'."""
    threads = setting["env"].get("OMP_NUM_THREADS")
    return f"threads {threads}" if threads else f"{len(setting['cells'])} cell(s)"


def _value(v) -> str:
    """A recorded value as a reader wants it: a ratio to three significant digits, not seventeen."""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _conformance_section(meta: dict, timings: pd.DataFrame) -> list:
    out: list = [Heading(2, "Conformance")]
    record = meta.get("conformance")
    if record is None:
        from harness.results.labels import backend_name

        # the names the command takes (jax@0.4.38), not the labels (jax 0.4.38)
        names = ",".join(dict.fromkeys(backend_name(r) for _, r in timings.iterrows())) if len(timings) else ""
        command = f"harness check --backends {names}" if names else "harness check"
        out.append(Para("This run holds no conformance record. Timings say nothing about correctness: "
                        f"`{command}` is the conformance step, comparing each backend "
                        "against the NumPy reference with SPEC.md tolerances on this machine."))
        return out
    if isinstance(record, dict) and record and all(isinstance(v, dict) for v in record.values()):
        keys = [k for k in dict.fromkeys(k for v in record.values() for k in v) if k != "cell_ratios"]
        table = Table(["backend"] + keys, [[b] + [_value(v.get(k, "")) for k in keys] for b, v in record.items()])
        out += folded([table], f"Conformance of {len(record)} backend(s)")
        same = _alike_worst(record)
        if same:
            out.append(Para(same))
    elif isinstance(record, list) and record and all(isinstance(v, dict) for v in record):
        keys = list(dict.fromkeys(k for v in record for k in v))
        out += folded([Table(keys, [[_value(v.get(k, "")) for k in keys] for v in record],
                             status_col=keys.index("status") if "status" in keys else None)],
                      f"Conformance: {len(record)} record(s)")
    else:
        out += folded([Pre(json.dumps(record, indent=2, default=str))], "The conformance record")
    return out


def _alike_worst(record: dict) -> str:
    """A sentence where every backend's worst ratio is the same figure ("" otherwise): there every backend
    rounded like the reference at the element closest to its bound, so that figure cannot tell them apart."""
    worst = [v.get("worst_ratio") for v in record.values() if isinstance(v.get("worst_ratio"), (int, float))]
    if len(worst) < 2 or len({f"{w:.4g}" for w in worst}) != 1:
        return ""
    where = {v.get("worst_quantity") for v in record.values()} - {None}
    at = f" (at {', '.join(sorted(where))})" if where else ""
    typical = " The median ratio over each backend's cells is the figure that tells them apart." \
        if all("median_ratio" in v for v in record.values()) else ""
    return (f"Every backend's worst ratio is the same, {worst[0]:.4g}{at}: where each came closest to its bound, "
            f"every backend rounded like the reference, so the worst ratio cannot tell an accurate backend from a "
            f"barely passing one.{typical}")


def _devices_section(timings: pd.DataFrame) -> list:
    """Each backend's GPU time against its own CPU time, per problem and batch (runs with both devices)."""
    from harness.results.devices import gpu_over_cpu
    from harness.results.plots import group_label

    ratios = gpu_over_cpu(timings)
    if ratios.empty:
        return []
    ratios = ratios.assign(label=_labels(ratios))
    rows = [[r["label"], f"{r['workload']} · {group_label(r, omit=('batch', 'threads', 'device'))}", str(r["batch"]),
             f"{fmt_time(r['cpu_median_s'])} ({r['cpu_threads']} thr)", fmt_time(r["gpu_median_s"]),
             f"{r['gpu_speedup']:.3g}x"] for _, r in ratios.iterrows()]
    return [Heading(2, "GPU over CPU, same backend"),
            Para("Each backend's median on the CPU (its fastest thread count) over its median on the GPU, "
                 "for the same problem and batch: above 1, the GPU is faster."),
            Table(["backend", "problem", "batch", "CPU", "GPU", "GPU speedup"], rows, right={2, 3, 4, 5})]


def _failures_section(timings: pd.DataFrame) -> list:
    from harness.results.labels import group_label

    out: list = [Heading(2, "Failed and unsupported cells")]
    if timings.empty:
        out.append(Para("The run holds no cells."))
        return out
    bad = timings[timings["status"] != Status.OK]
    if bad.empty:
        out.append(Para("Every cell ran."))
        return out
    bad = bad.assign(label=_labels(bad))
    rows = [[r["label"], f"{r['workload']} · {group_label(r)}", r["status"], _first_line(r.get("error"))]
            for _, r in bad.iterrows()]
    out.append(Table(["backend", "problem", "status", "reason"], rows, status_col=2))
    failed = bad[bad["status"].isin(FAILED) & (bad["error"].fillna("").str.strip() != "")]
    # one block per distinct failure: the same crash in every cell of a sweep is shown once
    for (label, status, text), g in failed.groupby(["label", "status", "error"], sort=False):
        where = f"{g.iloc[0]['workload']} · {group_label(g.iloc[0])}" if len(g) == 1 else f"{len(g)} cells"
        tail = "\n".join(str(text).strip().splitlines()[-25:])
        out.append(Pre(tail, summary=f"{label}: {status} ({where})"))
    return out


def _training_section(timings: pd.DataFrame, curves: pd.DataFrame) -> list:
    from harness.results.labels import group_label

    # cells that never started are listed with their reasons under the failures already
    train = timings[(timings["workload"] == "train") & ~timings["status"].isin([Status.UNSUPPORTED, Status.UNAVAILABLE])] \
        if len(timings) else timings
    if train.empty:
        return []
    train = train.assign(label=_labels(train))
    targets = {}
    if len(curves) and "target_loss" in curves:
        targets = curves.dropna(subset=["target_loss"]).groupby("cell_id")["target_loss"].first().to_dict()
    rows = []
    for _, r in train.iterrows():
        reached = fmt_time(r.get("time_to_target_s")) if _num(r.get("time_to_target_s")) else (
            "not reached" if _num(targets.get(r["cell_id"])) else "no target")
        rows.append([r["label"], group_label(r), r["status"], _f(r.get("final_loss"), ".4g"), _f(r.get("loss_floor"), ".4g"),
                     _f(targets.get(r["cell_id"]), "g"), reached, fmt_time(r.get("train_s")), fmt_time(r.get("eval_s")),
                     fmt_time(r.get("median_s"))])
    return [Heading(2, "Training"),
            Para("Training from the shared initial parameters; the loss floor is the task's own lowest achievable "
                 "evaluation loss; time to target counts training time only, evaluation excluded."),
            Table(["backend", "problem", "status", "final loss", "loss floor", "target", "time to target", "training",
                   "evaluation", "median step"], rows, right={3, 4, 5, 6, 7, 8, 9}, status_col=2)]
