"""The results folder: ``run.json``, ``timings.parquet``, ``curves.parquet``, ``plots/``.

Written incrementally and atomically (write to a temporary file, then rename), so an
interrupted run keeps every finished comparison group and ``--resume`` does the rest.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.errors import HarnessError

TIMING_COLUMNS = [
    "cell_id", "group", "backend", "variant", "device", "model", "task", "workload", "dtype", "batch",
    "seq_len", "input_size", "hidden_size", "output_size", "threads", "bptt", "layers", "activation",
    "head", "output_act", "peephole", "bias", "tokens", "sweep", "status", "error", "compile_s",
    "median_s", "iqr_s", "min_s", "mean_s", "stdev_s", "n_samples", "peak_rss_mb", "gflops",
    "gemm_peak_gflops", "baseline", "speedup", "speedup_lo", "speedup_hi", "time_to_target_s",
    "train_s", "eval_s", "final_loss", "loss_floor", "verified_ratio", "samples_s",
]
# mismatch: the backend's own step on this cell disagreed with the reference, so it was not timed
FINAL_STATUSES = {"ok", "error", "timeout", "oom", "diverged", "mismatch", "unsupported", "unavailable"}


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: Path, data: dict) -> None:
    def w(tmp):
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, default=str)

    _atomic_write(Path(path), w)


def write_table(path: Path, rows: list[dict], columns: list[str] | None = None) -> None:
    df = pd.DataFrame(rows)
    if columns:
        for c in columns:
            if c not in df.columns:
                df[c] = None
        df = df[columns + [c for c in df.columns if c not in columns]]
    _atomic_write(Path(path), lambda tmp: df.to_parquet(tmp, index=False))


@dataclass
class RunStore:
    """A results folder being written."""

    path: Path
    meta: dict = field(default_factory=dict)
    timings: list[dict] = field(default_factory=list)
    curves: list[dict] = field(default_factory=list)

    @classmethod
    def create(cls, path: Path, meta: dict) -> "RunStore":
        path = Path(path)
        if (path / "run.json").exists():
            raise HarnessError(f"{path}: a run already exists there; use --resume {path} to finish it or choose another --out")
        store = cls(path, meta)
        store.save()
        return store

    @classmethod
    def open(cls, path: Path) -> "RunStore":
        """Reopen an existing run (for --resume)."""
        path = Path(path)
        if not (path / "run.json").exists():
            raise HarnessError(f"{path}: not a results folder (no run.json)")
        meta = json.loads((path / "run.json").read_text())
        timings = pd.read_parquet(path / "timings.parquet").to_dict("records") if (path / "timings.parquet").exists() else []
        curves = pd.read_parquet(path / "curves.parquet").to_dict("records") if (path / "curves.parquet").exists() else []
        for row in timings:  # parquet hands list columns back as arrays
            if row.get("samples_s") is not None:
                row["samples_s"] = [float(v) for v in row["samples_s"]]
        return cls(path, meta, timings, curves)

    def done_cells(self) -> set[str]:
        return {r["cell_id"] for r in self.timings if r.get("status") in FINAL_STATUSES}

    def add(self, rows: list[dict], curves: list[dict]) -> None:
        """Record finished cells (replacing older rows of the same cells) and save at once."""
        ids = {r["cell_id"] for r in rows}
        self.timings = [r for r in self.timings if r["cell_id"] not in ids] + rows
        self.curves = [c for c in self.curves if c["cell_id"] not in ids] + curves
        statuses = self.meta.setdefault("cells", {})
        for r in rows:
            statuses[r["cell_id"]] = r["status"]
        self.save()

    def save(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_table(self.path / "timings.parquet", self.timings, TIMING_COLUMNS)
        write_table(self.path / "curves.parquet", self.curves)
        write_json(self.path / "run.json", self.meta)


@dataclass
class Run:
    """A loaded run: ``meta`` (run.json), ``timings`` and ``curves`` (DataFrames)."""

    path: Path
    meta: dict
    timings: pd.DataFrame
    curves: pd.DataFrame

    @property
    def run_id(self) -> str:
        return self.meta.get("run_id", self.path.name)


def load_run(path) -> Run:
    """Load one results folder."""
    path = Path(path)
    if not (path / "run.json").exists():
        raise HarnessError(f"{path}: not a results folder (no run.json)")
    meta = json.loads((path / "run.json").read_text())
    timings = pd.read_parquet(path / "timings.parquet") if (path / "timings.parquet").exists() else pd.DataFrame(columns=TIMING_COLUMNS)
    curves = pd.read_parquet(path / "curves.parquet") if (path / "curves.parquet").exists() else pd.DataFrame()
    return Run(path, meta, timings, curves)


def load_runs(paths) -> Run:
    """Several runs concatenated, each row tagged with its ``run_id``."""
    runs = [load_run(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not runs:
        raise HarnessError("load_runs: no run folders given")
    timings = pd.concat([r.timings.assign(run_id=r.run_id) for r in runs], ignore_index=True)
    curves = pd.concat([r.curves.assign(run_id=r.run_id) for r in runs], ignore_index=True)
    meta = {"runs": {r.run_id: r.meta for r in runs}}
    return Run(Path(os.path.commonpath([str(r.path) for r in runs])), meta, timings, curves)
