"""pytest-benchmark JSON in and out.

``harness import`` turns a file written by ``pytest --benchmark-json`` (or saved with
``--benchmark-autosave``) into a run folder with the tables ``harness run`` writes, so ``harness
plot``, ``report`` and ``compare`` work on it; ``harness export --format pytest-benchmark`` writes a
run's timed cells the other way, readable by ``pytest-benchmark compare`` and ``--benchmark-compare``.

Benchmarks of the harness's own suite (``benchmarks/test_bench_backends.py``) carry their cell's
result columns in ``extra_info`` and import as exactly those cells. Any other benchmark imports as a
cell of its own: its name is the backend, its pytest-benchmark group the comparison group.

Speedups. ``harness run`` times a group's backends in turn and bootstraps the speedup over paired
rounds; pytest-benchmark runs one benchmark after the other, so imported rounds are not paired. With
the raw timings (``--benchmark-json`` always keeps them; saved files keep them with
``--benchmark-save-data``) the speedup's 95% interval resamples each side's rounds on its own
(:func:`harness.run.stats.ratio_interval`). A file without them gives the point speedup (ratio of
medians) and no interval. ``run.json`` says which under ``speedup_interval``.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from harness.spec.errors import HarnessError
from harness.spec.status import Status

FORMAT = "pytest-benchmark"
SUITE = "benchmarks/test_bench_backends.py::test_backend"
PAIRED_NOTE = "none: the file holds no raw timings (save them with --benchmark-save-data); speedup is the ratio of medians"
UNPAIRED_NOTE = ("bootstrap resampling each side's rounds on its own: pytest-benchmark times benchmarks one after "
                 "another, so rounds are not paired and machine drift between them is not cancelled")
STATS_COLUMNS = ("median_s", "iqr_s", "min_s", "mean_s", "stdev_s", "n_samples", "samples_s")


def benchmark_id(columns: dict) -> str:
    """The suite's test id of a cell, from its result columns: ``numpy-train_step-elman-V64-H32-T16-B4-float32``."""
    full = _backend(columns)
    inputs = f"V{columns['input_size']}" if columns["tokens"] else f"D{columns['input_size']}"
    return (f"{full}-{columns['workload']}-{columns['model']}-{inputs}-H{columns['hidden_size']}"
            f"-T{columns['seq_len']}-B{columns['batch']}-{columns['dtype']}")


def _backend(columns) -> str:
    """The backend of a cell's result columns as its config names it (``numpy:wildml``, ``jax@0.4.38``), read
    from its fields (a file of the suite may leave out a default variant)."""
    from harness.results.labels import backend_name

    return backend_name({"variant": None, **columns})


def benchmark_group(columns: dict) -> str:
    """The suite's pytest-benchmark group of a cell: its workload and readable comparison group."""
    from harness.results.labels import group_label

    return f"{columns['workload']} {group_label(columns)}"


# -- import ------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    # as strict as a config: "2" is no number, no NaN or infinity; keys of other pytest-benchmark versions are kept
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


Seconds = Field(ge=0)


class BenchStats(_Strict):
    median: float = Field(gt=0)
    min: float = Field(ge=0)
    mean: float = Field(gt=0)
    stddev: float = Field(ge=0)
    rounds: int = Field(ge=1)
    iqr: Optional[float] = Field(None, ge=0)
    data: Optional[list[float]] = None  # the raw timings (--benchmark-save-data)

    @field_validator("data")
    @classmethod
    def _positive(cls, v):
        if v is not None and any(not x > 0 for x in v):
            raise ValueError(f"expected positive timings, got {next(x for x in v if not x > 0)!r}")
        return v


class Benchmark(_Strict):
    name: Optional[str] = None
    fullname: Optional[str] = None
    group: Optional[str] = None
    params: Optional[dict[str, Any]] = None
    param: Optional[Union[str, int, float]] = None
    options: Optional[dict[str, Any]] = None
    extra_info: dict[str, Any] = Field(default_factory=dict)
    stats: BenchStats

    @field_validator("extra_info")
    @classmethod
    def _suite_cell(cls, v):
        # a cell of the harness's suite (cell_id and backend) names its comparison group too
        if "cell_id" in v and "backend" in v:
            for key in ("cell_id", "backend", "group"):
                if not isinstance(v.get(key), str) or not v[key]:
                    raise ValueError(f"a harness cell needs text {key}, got {str(v.get(key))[:60]!r}")
        return v


class BenchmarkFile(_Strict):
    benchmarks: list[Benchmark] = Field(min_length=1)
    machine_info: Optional[dict[str, Any]] = None
    commit_info: Optional[dict[str, Any]] = None
    datetime: Optional[str] = None
    version: Optional[str] = None


def _validation_error(path: Path, exc: ValidationError) -> HarnessError:
    err = exc.errors()[0]
    where = ""
    for part in err["loc"]:
        where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return HarnessError(f"{path}: {where}: required key is missing")
    got = repr(err.get("input"))
    return HarnessError(f"{path}: {where}: {msg}, got {got[:60]}{'...' if len(got) > 60 else ''}")


def read_json(path) -> dict:
    """A pytest-benchmark JSON file, validated as strictly as a config (the parts the import reads)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise HarnessError(f"{path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise HarnessError(f"{path}: not valid JSON: {exc}") from None
    benches = data.get("benchmarks") if isinstance(data, dict) else None
    if not isinstance(benches, list):
        raise HarnessError(f"{path}: not a pytest-benchmark file (expected a 'benchmarks' list at the top level)")
    if not benches:
        raise HarnessError(f"{path}: holds no benchmarks (did every benchmark fail or skip?)")
    try:
        BenchmarkFile.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(path, exc) from None
    return data


def import_json(path, out=None, baseline: str | None = None) -> Path:
    """Write the run folder of a pytest-benchmark JSON file (default ``results/<name>-<time>``); returns it.

    ``baseline`` names the backend speedups are measured against (default: the one each benchmark of
    the harness's suite recorded, else the first benchmark of each group)."""
    from harness.run import machine
    from harness.results.store import RunStore

    path = Path(path)
    data = read_json(path)
    rows, kept = [], {}
    for b in data["benchmarks"]:
        row, original = _row(b)
        if row["cell_id"] in kept:
            raise HarnessError(f"{path}: two benchmarks are the same cell ({row['cell_id']})")
        rows.append(row)
        kept[row["cell_id"]] = original
    have_data = all(r["samples_s"] for r in rows)
    _speedups(rows, baseline)
    when = _stamp(data.get("datetime"))
    commit = data.get("commit_info") or {}
    run_id = f"{path.stem}-{when.strftime('%Y%m%d-%H%M%S')}"
    meta = {
        "run_id": run_id, "name": path.stem, "config_path": str(path),
        "source": {"format": FORMAT, "path": str(path.resolve()), "version": data.get("version")},
        "baseline": baseline or _baselines(rows), "machine": _machine(data.get("machine_info") or {}),
        "git_commit": (commit.get("id") or "") + ("-dirty" if commit.get("dirty") else "") or None,
        "started": when.isoformat(), "finished": when.isoformat(), "imported": datetime.now(timezone.utc).isoformat(),
        "harness_python": (data.get("machine_info") or {}).get("python_version"),
        "speedup_interval": UNPAIRED_NOTE if have_data else PAIRED_NOTE,
        # what the columns cannot hold, so that an export gives the same benchmarks back
        "pytest_benchmark": {"machine_info": data.get("machine_info"), "commit_info": data.get("commit_info"),
                             "benchmarks": kept},
        "importer_host": machine.host_name(),
    }
    from harness.results.store import check_out_folder

    out = check_out_folder(Path(out) if out is not None else Path("results") / run_id)
    if (out / "run.json").exists():
        raise HarnessError(f"{out}: a run already exists there; choose another --out")
    store = RunStore.create(out, meta)
    store.add(rows, [])
    statuses = store.meta["cells"]
    store.meta["summary"] = {s: sum(1 for v in statuses.values() if v == s) for s in sorted(set(statuses.values()))}
    store.save()
    return out


def _row(bench: dict) -> tuple[dict, dict]:
    """The timings row of one benchmark, and what of it the row cannot hold (for the export)."""
    from harness.results.schema import TIMING_COLUMNS
    from harness.run.stats import Stats

    info = bench.get("extra_info") or {}
    stats = bench["stats"]
    data = [float(v) for v in stats.get("data") or []]
    if "cell_id" in info and "backend" in info:  # a cell of the harness's suite (or an exported run)
        row = {c: info[c] for c in TIMING_COLUMNS if c in info and c not in STATS_COLUMNS}
        full = _backend(row)
    else:  # any other benchmark: a cell of its own, compared within its pytest-benchmark group
        name = str(bench.get("name") or bench.get("fullname") or "benchmark")
        group = bench.get("group") or str(bench.get("fullname", name)).split("[")[0]
        row = {"cell_id": f"{group}|{name}", "group": group, "backend": name, "variant": "default",
               "model": group, "workload": "benchmark", "device": "cpu", "sweep": json.dumps(bench.get("params") or {})}
        row.update({c: info[c] for c in TIMING_COLUMNS if c in info and c not in row and c not in STATS_COLUMNS})
        full = name
    if data:
        summary = Stats.of(data).as_dict()
    else:
        summary = {"median_s": stats["median"], "iqr_s": stats.get("iqr"), "min_s": stats["min"], "mean_s": stats["mean"],
                   "stdev_s": stats["stddev"], "n_samples": int(stats["rounds"])}
    row.update(summary, status="ok", error="", samples_s=data, speedup=None, speedup_lo=None, speedup_hi=None)
    row["full_name"] = full
    flops = _flops(row)
    row["gflops"] = flops / row["median_s"] / 1e9 if flops and row["median_s"] else None
    original = {k: bench.get(k) for k in ("name", "fullname", "group", "params", "param", "options")}
    original["stats"] = {k: v for k, v in stats.items() if k != "data"}
    return row, original


def _flops(row: dict) -> float | None:
    """GEMM FLOPs of one call of the row's cell (SPEC.md), None for a benchmark that is no harness cell."""
    from harness.spec.model import ModelSpec, Problem

    try:
        bptt = str(row.get("bptt") or "full")
        mode, _, k = bptt.partition(":")
        model = {"kind": row["model"], "hidden": int(row["hidden_size"]), "bias": bool(row["bias"]), "head": row["head"],
                 "output_act": row["output_act"], "bptt": "full" if mode == "full" else {mode: int(k)},
                 "layers": int(row.get("layers") or 1), "peephole": bool(row.get("peephole"))}
        if row["model"] == "elman":
            model["activation"] = row["activation"]
        problem = Problem(ModelSpec.from_mapping(model), int(row["input_size"]), int(row["output_size"]), bool(row["tokens"]),
                          row["dtype"], int(row["batch"]), int(row["seq_len"]), row.get("device") or "cpu", row["workload"])
        return problem.flops()
    except (KeyError, TypeError, ValueError, HarnessError):
        return None


def _speedups(rows: list[dict], baseline: str | None) -> None:
    """Speedup of every row over its group's baseline (median over median), with an interval when both
    sides have their rounds; the ``full_name`` helper key is dropped."""
    from harness.run.stats import ratio_interval

    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    for members in groups.values():
        name = baseline or members[0].get("baseline") or members[0]["full_name"]
        base = next((r for r in members if r["full_name"] == name), None)
        for r in members:
            r["baseline"] = name
            if base is None or not (base["median_s"] and r["median_s"]):
                continue
            if r is base:
                r["speedup"] = r["speedup_lo"] = r["speedup_hi"] = 1.0
            elif base["samples_s"] and r["samples_s"]:
                r["speedup"], r["speedup_lo"], r["speedup_hi"] = ratio_interval(r["samples_s"], base["samples_s"])
            else:
                r["speedup"] = base["median_s"] / r["median_s"]
    for r in rows:
        del r["full_name"]


def _baselines(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["baseline"] for r in rows))
    return names[0] if len(names) == 1 else ", ".join(names)


def _stamp(text) -> datetime:
    try:
        when = datetime.fromisoformat(str(text))
    except ValueError:
        return datetime.now(timezone.utc)
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _machine(info: dict) -> dict:
    """pytest-benchmark's machine_info in the keys of :func:`harness.run.machine.machine_info`."""
    cpu = info.get("cpu") or {}
    return {"hostname": info.get("node"), "platform": "-".join(str(info[k]) for k in ("system", "release", "machine") if info.get(k)),
            "python": info.get("python_version"), "cpu_model": cpu.get("brand_raw"), "cores": cpu.get("count"),
            "cpu_flags": None, "memory_gb": None, "numpy_blas": None, "gpus": [], "loadavg": None}


# -- export ------------------------------------------------------------------------------------------
def export_json(run_dir, out=None) -> tuple[Path, int, list[str]]:
    """Write a run's timed cells as pytest-benchmark JSON (default ``RUN_DIR/pytest-benchmark.json``).

    Returns the path, the number of benchmarks written and why the other rows were left out (failed
    cells, training runs and rows without timings have no place in the format)."""
    from harness.results.store import check_out_file, load_run, write_json

    own = Path(run_dir) / "pytest-benchmark.json"  # the one file an export may write in a run folder: its own run's
    out = Path(out) if out is not None else own
    mine = run_dir if os.path.realpath(out) == os.path.realpath(own) else None
    check_out_file(out, run=mine)  # before anything is read or written
    try:
        from pytest_benchmark import __version__ as version
        from pytest_benchmark.stats import Stats
    except ImportError:
        raise HarnessError("export --format pytest-benchmark needs pytest-benchmark: pip install pytest-benchmark") from None
    run = load_run(run_dir)
    kept = (run.meta.get("pytest_benchmark") or {})
    originals = kept.get("benchmarks") or {}
    benches, left_out = [], []
    for _, r in run.timings.iterrows():
        row = {k: _plain(v) for k, v in r.items()}
        label = row["cell_id"]
        if row.get("status") != Status.OK:
            left_out.append(f"{label}: status {row.get('status')}")
            continue
        if row.get("workload") == "train":
            left_out.append(f"{label}: a training run, not a per-call timing")
            continue
        original = originals.get(label) or {}
        samples = [float(v) for v in row.get("samples_s") or []]
        if samples:
            stats = Stats()
            for v in samples:
                stats.update(v)
            stats = {**stats.as_dict(), "data": samples, "iterations": 1}
        elif original.get("stats"):
            stats = dict(original["stats"])
        else:
            left_out.append(f"{label}: no timings to summarise")
            continue
        is_cell = row.get("workload") != "benchmark"
        name = original.get("name") or f"test_backend[{benchmark_id(row)}]"
        info = {k: v for k, v in row.items() if v is not None and k not in STATS_COLUMNS and k != "run_id"}
        benches.append({
            "group": original.get("group") or (benchmark_group(row) if is_cell else row.get("group")),
            "name": name, "fullname": original.get("fullname") or f"{SUITE}[{benchmark_id(row)}]",
            "params": original.get("params") or ({"cell_id": benchmark_id(row)} if is_cell else None),
            "param": original.get("param") or (benchmark_id(row) if is_cell else None),
            "extra_info": info, "options": original.get("options") or {"source": "harness run", "timer": "perf_counter"},
            "stats": stats,
        })
    meta = run.meta
    commit = str(meta.get("git_commit") or "")
    doc = {
        "machine_info": kept.get("machine_info") or _machine_info(meta),
        "commit_info": kept.get("commit_info") or {"id": commit.removesuffix("-dirty") or None, "dirty": commit.endswith("-dirty"),
                                                   "project": "rnn-harness", "branch": None},
        "benchmarks": benches, "datetime": meta.get("finished") or meta.get("started"), "version": version,
    }
    if not benches:
        raise HarnessError(f"{run_dir}: no timed cells to export ({'; '.join(left_out[:3]) or 'the run is empty'})")
    write_json(out, doc, run=mine)
    return out, len(benches), left_out


def _machine_info(meta: dict) -> dict:
    """The run's machine in pytest-benchmark's keys."""
    m = meta.get("machine") or {}
    platform = str(m.get("platform") or "")
    return {"node": m.get("hostname"), "processor": "", "machine": "x86_64" if "x86_64" in platform else "",
            "python_implementation": "CPython", "python_version": m.get("python") or meta.get("harness_python"),
            "release": "", "system": platform.split("-")[0] if platform else "",
            "cpu": {"brand_raw": m.get("cpu_model"), "count": m.get("cores")}, "harness_machine": m}


def _plain(v):
    """A table value as plain JSON: numpy scalars and arrays unwrapped, NaN as None."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v
