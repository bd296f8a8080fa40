"""A comparison group's outcomes as result rows: the one place a row of ``timings.parquet``
(and its points of ``curves.parquet``) is made.

The runner only runs: it hands the outcomes of a finished group (:class:`harness.run.group.Outcome`)
to :meth:`harness.results.store.RunStore.add_group`, which calls :func:`group_rows` here. A row is
the cell's identifying columns (:func:`harness.results.schema.cell_columns`), its status, the
summary of its rounds, its GFLOP/s against the roof of its device, its speedup over the group's
baseline with the interval and precision of that speedup, and what the worker reported (verification,
versions, training curve).
"""

from __future__ import annotations

import statistics

from harness.results import caveats, schema
from harness.run import stats
from harness.run.stats import Stats, speedup_intervals
from harness.worker.cpu_roofs import peak_key, roof_library
from harness.spec.dtype import DType
from harness.spec.errors import HarnessError
from harness.spec.status import Status


def group_rows(outcomes: list, meta: dict, gemm_peaks: dict | None = None,
               gpu_roofs: dict | None = None) -> tuple[list[dict], list[dict]]:
    """The rows and curve points of one comparison group's outcomes, in the group's order.

    ``meta`` is the run's run.json mapping: the versions, worker variables and conformance summary the
    outcomes report are folded into it. ``gemm_peaks``/``gpu_roofs`` are the roofs measured on the host
    the group ran on. A group timed over paired settings (``pair_over``) holds one problem at each
    setting: each setting's cells get their speedups over its baseline as any group's, and every cell
    its ratio to the same backend at the first setting (:func:`setting_columns`)."""
    problems: dict = {}
    for o in outcomes:
        problems.setdefault(o.cell.key, []).append(o)
    rows, curves = [], []
    for same in problems.values():
        r, c = _problem_rows(same, meta, gemm_peaks, gpu_roofs)
        rows += r
        curves += c
    if outcomes[0].cell.paired:
        setting_columns(outcomes, rows)
    return rows, curves


def setting_columns(outcomes: list, rows: list[dict]) -> None:
    """Each row's ratio to the same backend (variant and versions alike) at the paired settings' first
    values, from the rounds they took in turn, with the paired 95% interval: ``setting_speedup`` above 1
    when this setting is the faster; 1 with equal bounds on that row itself; empty where either did not run."""
    first = {o.cell.backend: o for o in outcomes if o.cell.setting() == dict(o.cell.paired)}
    pairs = {}
    for i, (o, row) in enumerate(zip(outcomes, rows)):
        row["setting_baseline"] = o.cell.setting_baseline
        base = first.get(o.cell.backend)
        if base is None or o.status != Status.OK or base.status != Status.OK or not o.samples or not base.samples \
                or o.cell.problem.workload == "train":
            continue
        if base is o:
            row["setting_speedup"] = row["setting_speedup_lo"] = row["setting_speedup_hi"] = 1.0
        else:
            pairs[i] = (base.samples, o.samples, o.blocks)
    for i, (point, lo, hi) in speedup_intervals(pairs).items():  # the ratios' block variation pooled
        rows[i]["setting_speedup"], rows[i]["setting_speedup_lo"], rows[i]["setting_speedup_hi"] = point, lo, hi


def _problem_rows(outcomes: list, meta: dict, gemm_peaks: dict | None, gpu_roofs: dict | None):
    """The rows of the cells of one problem (cells that differ only by backend)."""
    base_name = outcomes[0].cell.baseline
    base = next((o for o in outcomes if o.cell.backend == base_name), None)
    over = speedup_reference(outcomes, base)  # the baseline, or the fastest verified cell when it failed
    # every speedup of the problem at once: their intervals pool the variation between worker processes
    # (the reference's own row is 1 with equal bounds: no pair, and nothing for the pool)
    intervals = speedup_intervals({o.cell.cell_id: (over.samples, o.samples, o.blocks) for o in outcomes
                                   if o.status == Status.OK and o.cell.problem.workload != "train"
                                   and over is not None and o.samples and o is not over})
    rows, curves = [], []
    versions = meta.setdefault("versions", {})
    for o in outcomes:
        row = schema.cell_columns(o.cell, o.host)
        p = o.cell.problem
        # a failed cell's partial samples are kept, but summarised by nothing: no median of a broken run
        summary = Stats.of(o.samples if o.status == Status.OK and o.samples else [])
        row.update(status=o.status, error=o.error[-4000:] if o.error else "", compile_s=o.compile_s,
                   peak_rss_mb=o.peak_rss_mb, **summary.as_dict(), baseline=base_name,
                   samples_s=[float(s) for s in (o.samples or [])], samples_block=list(o.blocks or []),
                   samples_position=list(o.positions) if o.positions is not None else None)
        if o.status == Status.OK and summary.n_samples:
            work = "train_step" if p.workload == "train" else p.workload
            row["gflops"] = p.flops(work) / summary.median_s / 1e9
        row.update(peak_columns(o.cell, gemm_peaks or {}, gpu_roofs))
        row["baseline_status"] = base.status if base is not None else "absent"
        if o.status == Status.OK and p.workload != "train" and over is not None and o.samples:
            row["speedup"], row["speedup_lo"], row["speedup_hi"] = intervals.get(o.cell.cell_id, (1.0, 1.0, 1.0))
            row["speedup_over"] = over.cell.backend
        row.update(precision_columns(o, over, row))
        row.update(process_columns(o))
        row.update(caveats.cell_columns(o, (meta.get("machine") or {}).get("cores")))
        caveats.record_environment(meta, o)
        if o.verify:
            row["verified_ratio"] = o.verify["ratio"]
            conformance_entry(meta, o.cell.backend, o.verify)
        if o.data_meta and "loss_floor" in o.data_meta:
            row["loss_floor"] = o.data_meta["loss_floor"]
        if o.versions:
            versions[o.cell.ref.environment_key] = o.versions
            row["backend_version"] = ran_version(o.cell.ref, o.versions) or row["backend_version"]
        if o.worker_env:
            record_worker_env(meta, o.cell.backend, o.cell.cell_id, o.worker_env)
            # a config variable the backend sets itself for its workers (XLA_FLAGS, JAX_PLATFORMS, ...):
            # run.json says the worker got the backend's value, not the config's
            replaced = {k: {"config": v, "worker": o.worker_env.get(k)} for k, v in o.cell.env.items()
                        if o.worker_env.get(k) != v}
            if replaced:
                meta.setdefault("env_overridden", {})[o.cell.backend] = replaced
        if o.train:
            t = o.train
            row.update(time_to_target_s=t["time_to_target_s"], train_s=t["train_s"], eval_s=t["eval_s"])
            evals = [c["loss"] for c in t["curve"] if c["split"] == "eval"]
            row["final_loss"] = evals[-1] if evals else None
            for c in t["curve"]:
                curves.append({k: row[k] for k in schema.CURVE_ID_COLUMNS}
                              | c | {"time_to_target_s": t["time_to_target_s"], "target_loss": o.cell.train.target_loss,
                                     "loss_floor": row.get("loss_floor")})
        rows.append(row)
    return rows, curves


def ran_version(ref, versions: dict) -> str | None:
    """The version of the backend's package that its worker reported (None when unknown)."""
    try:
        package = ref.backend_class().package
    except HarnessError:  # a backend that cannot be imported here (a plugin named in an old run)
        return None
    return versions.get(package) if package else None


def peak_columns(cell, gemm_peaks: dict, gpu_roofs: dict | None) -> dict:
    """The roof a cell's GFLOP/s is read against and what measured it: on a CPU the GEMM peak of its
    dtype and threads (NumPy's; under mixed precision the fastest library's), on a GPU cuBLAS's
    rate. A mixed-precision cell also carries its master dtype's (float32) roof, drawn beside."""
    p = cell.problem
    reduced = p.dtype.reduced
    if p.device == "cpu":
        return {"gemm_peak_gflops": gemm_peaks.get(peak_key(p.dtype, cell.threads)),
                "gemm_peak_library": roof_library(gemm_peaks, p.dtype, cell.threads),
                "master_peak_gflops": gemm_peaks.get(peak_key(p.master_dtype, cell.threads)) if reduced else None}
    roofs = gpu_roofs or {}
    rate = {d: f"gemm_{d.short}_gflops" for d in DType}
    return {"gemm_peak_gflops": roofs.get(rate[p.dtype]),
            "gemm_peak_library": "cublas" if roofs.get(rate[p.dtype]) is not None else None,
            "master_peak_gflops": roofs.get(rate[p.master_dtype]) if reduced else None,
            "gpu_tf32_gflops": roofs.get("gemm_tf32_gflops") if p.dtype == DType.FLOAT32 else None,
            "gpu_bandwidth_gbs": roofs.get("bandwidth_gbs")}


def precision_columns(o, base, row: dict) -> dict:
    """schema.PRECISION_COLUMNS of one timed cell: its speedup's precision against the target (the
    interval the row reports, by the test the stop rule used) and its disturbed rounds, all kept."""
    if o.status != Status.OK or not o.samples or o.cell.problem.workload == "train":
        return {}
    target = o.cell.timing.speedup_precision
    mine = stats.disturbed(o.samples)
    cols = dict.fromkeys(schema.PRECISION_COLUMNS)
    per_pass = o.cell.timing.processes_per_pass  # a round's block is its process, numbered pass after pass
    cols.update(speedup_precision=target, stop_reason=o.stop_reason, n_disturbed_rounds=sum(mine),
                n_processes=o.cell.timing.processes, n_passes=len({b // per_pass for b in o.blocks or []}))
    if o is not base and "speedup" in row:
        n = min(len(base.samples), len(o.samples))
        theirs = stats.disturbed(base.samples)[:n]
        cols["n_disturbed_shared"] = sum(a and b for a, b in zip(mine, theirs))
        cols["n_disturbed_one_sided"] = sum(a != b for a, b in zip(mine, theirs))
        point, lo, hi = row["speedup"], row["speedup_lo"], row["speedup_hi"]
        cols["speedup_half_width"] = stats.half_width(point, lo, hi)
        if target is not None:
            cols["precision_met"] = stats.precision_met(point, lo, hi, n, target)
    return cols


def process_columns(o) -> dict:
    """schema.PROCESS_COLUMNS of one timed cell: the fresh worker processes its median comes from, how far
    their own medians lie apart (slowest minus fastest, over the cell's median), and each round's process."""
    if o.status != Status.OK or not o.samples or o.cell.problem.workload == "train":
        return {}
    labels = list(o.processes if o.processes is not None else (o.blocks or []))[:len(o.samples)]
    if len(labels) != len(o.samples):  # rounds of unknown processes: only their count is unknown
        return {}
    by_process: dict[int, list[float]] = {}
    for label, s in zip(labels, o.samples):
        by_process.setdefault(int(label), []).append(float(s))
    medians = [statistics.median(v) for v in by_process.values()]
    spread = (max(medians) - min(medians)) / statistics.median(o.samples) if len(medians) > 1 else None
    return {"n_worker_processes": len(by_process), "process_spread": spread, "samples_process": [int(v) for v in labels]}


def speedup_reference(outcomes: list, base):
    """What a group's speedups are measured against: its baseline when that ran (and verified) ok;
    otherwise the fastest cell that did, named on every row (``speedup_over``) and in the summaries."""
    if base is not None and base.status == Status.OK and base.samples:
        return base
    ran = [o for o in outcomes if o.status == Status.OK and o.samples and o.cell.problem.workload != "train"]
    return min(ran, key=lambda o: statistics.median(o.samples), default=None)


def conformance_entry(meta: dict, backend: str, verify: dict) -> None:
    """run.json's per-backend summary of the cell checks (a ratio <= 1 is within SPEC bounds)."""
    entry = meta.setdefault("conformance", {}).setdefault(
        backend, {"verified_cells": 0, "mismatches": 0, "worst_ratio": 0.0, "bound": verify["bound"]})
    entry["verified_cells"] += 1
    entry["mismatches"] += 0 if verify["ok"] else 1
    if verify["ratio"] >= entry["worst_ratio"] and verify.get("worst"):  # the quantity that came closest to its bound
        entry["worst_quantity"] = verify["worst"]
    entry["worst_ratio"] = max(entry["worst_ratio"], verify["ratio"])
    # every cell's worst ratio, so that a reader sees the typical one beside the worst (the median of them)
    ratios = entry.setdefault("cell_ratios", [])
    ratios.append(round(float(verify["ratio"]), 6))
    entry["median_ratio"] = float(statistics.median(ratios))


def record_worker_env(meta: dict, backend: str, cell_id: str, env: dict) -> None:
    """Add one cell's worker variables to ``run.json``: ``worker_env[backend]`` holds those every cell of the
    backend got alike, and ``worker_env_settings[backend]`` each distinct setting (``threads: [1, 2]`` sets
    other thread counts and cores) with its cells and the variables it got beyond or unlike those: a cell's
    whole environment is its backend's ``worker_env`` updated with its setting's ``env``."""
    common = (meta.get("worker_env") or {}).get(backend)
    settings = (meta.get("worker_env_settings") or {}).get(backend)
    if common is None:
        whole: list[tuple[dict, list]] = []
    elif settings is None:  # a run.json written before settings were recorded: one setting, its cells unknown
        whole = [(dict(common), [])]
    else:
        whole = [({**common, **s["env"]}, list(s["cells"])) for s in settings]
    for env_of, cells in whole:
        if env_of == env:
            if cell_id not in cells:
                cells.append(cell_id)
            break
    else:
        whole.append((dict(env), [cell_id]))
    shared = {k: v for k, v in whole[0][0].items() if all(e.get(k) == v for e, _ in whole)}
    meta.setdefault("worker_env", {})[backend] = shared
    meta.setdefault("worker_env_settings", {})[backend] = [
        {"cells": cells, "env": {k: v for k, v in e.items() if k not in shared}} for e, cells in whole]
