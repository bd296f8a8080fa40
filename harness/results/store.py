"""The results folder: ``run.json``, ``timings.parquet``, ``curves.parquet``, ``plots/``.

Written incrementally and atomically (write to a temporary file, then rename), so an
interrupted run keeps every finished comparison group and ``--resume`` does the rest.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.spec import writes
from harness.spec.errors import HarnessError
from harness.results.schema import TIMING_COLUMNS
from harness.spec.status import CELL_FINAL

# mismatch: the backend's own step on this cell disagreed with the reference, so it was not timed


def _atomic_write(path: Path, write, run=None) -> None:
    """Write a file by the one write rule (:mod:`harness.spec.writes`): beside it, then renamed; never through
    a link or onto what is not a regular file, and inside no run folder but ``run``."""
    writes.write_file(path, write, run=run, noun="results")


def check_out_folder(path, option: str = "--out") -> Path:
    """Refuse, before anything is written, an output folder that cannot be one: an existing file, a path
    through a file, a folder inside another run's folder, one (or the nearest existing parent of a new one)
    this process cannot write into. Every command's folder ``--out`` goes through this, so each says it
    the same way (:func:`harness.spec.writes.check_folder`)."""
    return writes.check_folder(path, option, may_be_run=True)


def check_out_file(path, option: str = "--out", run=None) -> Path:
    """The same for an output file (:func:`harness.spec.writes.check_file`): absent or a regular file, never a
    link or a device, inside no run folder but ``run`` (the one the command writes for)."""
    return writes.check_file(path, option, run=run)


def config_fingerprint(config) -> str:
    """The config's digest that ``run.json`` records (:func:`harness.config.config_fingerprint`, imported
    here only when asked: loading a run needs no config machinery)."""
    from harness.config import config_fingerprint as digest

    return digest(config)


class FolderLock:
    """An exclusive lock on a results folder (``.lock``, held with flock while the run writes there):
    a second run into the same folder is refused instead of overwriting the first one's files. The
    kernel drops it when the process dies, so a killed run can be resumed."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._fh = writes.open_private(self.path / ".lock", "a+")  # a link there is refused, never followed
        except OSError as exc:
            raise writes.disk_error(self.path, exc, "results") from None
        try:
            fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._fh.close()
            raise HarnessError(f"{self.path}: another run is writing to this folder; wait for it or choose another --out") from None
        try:
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.write(f"{os.getpid()}\n")
            self._fh.flush()
        except OSError as exc:  # a full disk refuses even these few bytes: the same one-line error as any write
            self.release()
            raise writes.disk_error(self.path, exc, "results") from None

    def release(self) -> None:
        """Let other runs write here again."""
        if not self._fh.closed:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            try:
                self._fh.close()
            except OSError:  # its buffered pid line could not be written (a full disk): the lock is let go anyway
                pass


def write_json(path: Path, data: dict, run=None) -> None:
    def w(tmp):
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, default=str)

    _atomic_write(Path(path), w, run)


def write_table(path: Path, rows: list[dict], columns: list[str] | None = None, run=None) -> None:
    df = pd.DataFrame(rows)
    if columns:
        for c in columns:
            if c not in df.columns:
                df[c] = None
        df = df[columns + [c for c in df.columns if c not in columns]]
    def w(tmp):
        try:
            df.to_parquet(tmp, index=False)
        except (TypeError, ValueError) as exc:  # pyarrow's type errors: rows of a table that is not a run's
            raise HarnessError(f"{path}: cannot write results ({type(exc).__name__}: {str(exc)[:100]}); "
                               f"the results saved before are kept") from None

    _atomic_write(Path(path), w, run)


@dataclass
class RunStore:
    """A results folder being written."""

    path: Path
    meta: dict = field(default_factory=dict)
    timings: list[dict] = field(default_factory=list)
    curves: list[dict] = field(default_factory=list)

    lock: FolderLock | None = None
    #: run.json as it stands on disk (None before the first save): what a save that a kill parts leaves in force
    on_disk: dict | None = field(default=None, repr=False)
    #: what hears of cells once they are saved (:meth:`listen`): the terminal's line per finished cell
    listeners: list = field(default_factory=list, repr=False)

    def listen(self, callback) -> None:
        """Call ``callback(rows)`` with the rows of the cells each :meth:`add` records, once they are saved."""
        self.listeners.append(callback)

    @classmethod
    def create(cls, path: Path, meta: dict, lock: bool = False) -> "RunStore":
        """A new run in ``path``; with ``lock`` the folder stays locked until :meth:`close` (or exit)."""
        path = Path(path)
        taken = HarnessError(f"{path}: a run already exists there; use --resume {path} to finish it or choose another --out")
        if os.path.lexists(path / "run.json"):  # refused before the lock: a refused --out leaves nothing in the run
            if writes.held_lock(path / ".lock"):
                raise HarnessError(f"{path}: another run is writing to this folder; wait for it or choose another --out")
            raise taken
        held = FolderLock(path) if lock else None
        if os.path.lexists(path / "run.json"):  # one started meanwhile
            if held:
                held.release()
            raise taken
        return cls(path, meta, lock=held)._first_save()

    def _first_save(self) -> "RunStore":
        """Write the new run's ``run.json``; a failed write releases the folder's lock."""
        try:
            self.save()
        except HarnessError:
            self.close()
            raise
        return self

    @classmethod
    def create_unique(cls, parent: Path, meta: dict) -> "RunStore":
        """A new locked run in ``parent/<run_id>``; a run id already taken there (two runs started in the
        same second) gets a suffix, so two runs never share an id or a folder."""
        base = meta["run_id"]
        for n in range(1, 1000):
            run_id = base if n == 1 else f"{base}-{n}"
            path = Path(parent) / run_id
            if (path / "run.json").exists():
                continue
            try:
                held = FolderLock(path)
            except HarnessError:
                if (path / ".lock").exists():  # another run holds it
                    continue
                raise
            if (path / "run.json").exists():
                held.release()
                continue
            return cls(path, {**meta, "run_id": run_id}, lock=held)._first_save()
        raise HarnessError(f"{parent}: no free folder for run {base}")

    @classmethod
    def open(cls, path: Path, lock: bool = False, fingerprint: str | None = None) -> "RunStore":
        """Reopen an existing run (for --resume); with ``fingerprint``, only if it was started with
        the config of that :func:`config_fingerprint`."""
        path = Path(path)
        if not (path / "run.json").exists():
            raise HarnessError(f"{path}: not a results folder (no run.json)")
        held = FolderLock(path) if lock else None
        try:
            meta, timings, curves = _read_folder(path)
            started = meta.get("config_fingerprint")
            if fingerprint is not None and started is None:
                raise HarnessError(f"{path}: --resume: run.json records no config fingerprint (a run of an older "
                                   f"harness, or edited), so it cannot show the run was started with this config; "
                                   f"start a new run with another --out")
            if fingerprint is not None and started != fingerprint:
                raise HarnessError(f"{path}: --resume: this run was started with another config (or other --backends / "
                                   f"--profile); resume it with the config and options it was started with "
                                   f"({meta.get('config_path', 'see run.json')})")
        except HarnessError:
            if held:
                held.release()
            raise
        store = cls(path, meta, timings, curves, lock=held, on_disk=copy.deepcopy(meta))
        if _parted(path):  # the tables still hold the rows read_folder left out: write them as read
            store.save()
        return store

    def close(self) -> None:
        """Release the folder's lock (if this store holds it)."""
        if self.lock is not None:
            self.lock.release()

    def done_cells(self) -> set[str]:
        return {r["cell_id"] for r in self.timings if r.get("status") in CELL_FINAL}

    def unfinished(self, key) -> dict | None:
        """What :meth:`keep_unfinished` kept of the comparison group of cell key ``key`` between its passes
        (None if nothing)."""
        return self.meta.get("unfinished_groups", {}).get(key.text)

    def keep_unfinished(self, key, saved: dict) -> None:
        """Keep the passes so far of the group of cell key ``key`` in run.json (saved at once), so --resume
        goes on at its next pass; :meth:`add` of its rows (whose ``group`` is that key's text) lets it go."""
        self.meta.setdefault("unfinished_groups", {})[key.text] = saved
        self.save()

    def add_group(self, outcomes: list, gemm_peaks: dict | None = None, gpu_roofs: dict | None = None) -> None:
        """Record a finished comparison group from its outcomes (:func:`harness.results.rows.group_rows`,
        against the roofs of the host it ran on) and save at once."""
        from harness.results.rows import group_rows

        self.add(*group_rows(outcomes, self.meta, gemm_peaks, gpu_roofs))

    def add(self, rows: list[dict], curves: list[dict]) -> None:
        """Record finished cells (replacing older rows of the same cells) and save at once."""
        unfinished = self.meta.get("unfinished_groups", {})
        for group in {r.get("group") for r in rows}:
            unfinished.pop(group, None)
        if not unfinished:
            self.meta.pop("unfinished_groups", None)
        ids = {r["cell_id"] for r in rows}
        self.timings = [r for r in self.timings if r["cell_id"] not in ids] + rows
        self.curves = [c for c in self.curves if c["cell_id"] not in ids] + curves
        statuses = self.meta.setdefault("cells", {})
        for r in rows:
            statuses[r["cell_id"]] = r["status"]
        self.save()
        for callback in self.listeners:
            callback(rows)

    def save(self) -> None:
        """Write the tables and run.json. Each file is replaced atomically, but a kill can still land between
        them, so run.json goes first with the cells whose rows are about to land named under ``saving`` (the
        rest of it as on disk), then the tables, then run.json as it now is: a folder read between two of
        these writes is the run as before this save (:func:`read_folder` leaves those rows out)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.on_disk is not None:
            recorded = self.on_disk.get("cells") or {}
            landing = [c for c in self.meta.get("cells") or {} if c not in recorded]
            if landing:
                write_json(self.path / "run.json", {**self.on_disk, "saving": landing}, run=self.path)
        write_table(self.path / "timings.parquet", self.timings, TIMING_COLUMNS, run=self.path)
        write_table(self.path / "curves.parquet", self.curves, run=self.path)
        write_json(self.path / "run.json", self.meta, run=self.path)
        self.on_disk = copy.deepcopy(self.meta)


# what a timings table must hold to be one: identifying text columns, and measurements that are numbers
_TEXT_COLUMNS = ("cell_id", "group", "backend", "status")
_NUMBER_COLUMNS = ("compile_s", "median_s", "iqr_s", "min_s", "mean_s", "stdev_s", "n_samples", "speedup",
                   "speedup_lo", "speedup_hi", "batch", "seq_len", "hidden_size", "threads")


def _damaged(path: Path, why: str, resuming: bool) -> HarnessError:
    tail = "; cannot resume this run, start a new run with another --out" if resuming else ""
    return HarnessError(f"{path}: damaged ({why}){tail}")


def _check_timings(df: pd.DataFrame) -> str | None:
    """Why ``df`` is not a timings table a run wrote (None when it is one)."""
    missing = [c for c in _TEXT_COLUMNS if c not in df.columns]
    if missing:
        return f"timings.parquet: not a timings table, no {missing[0]} column"
    for c in _TEXT_COLUMNS:
        if not df[c].map(lambda v: isinstance(v, str) or v is None).all():
            return f"timings.parquet: column {c} holds no text"
    for c in _NUMBER_COLUMNS:
        if c in df.columns and not pd.api.types.is_numeric_dtype(df[c]) and not df[c].isna().all():
            return f"timings.parquet: column {c} holds no numbers"
    return None


def _check_of_this_run(meta: dict, timings: pd.DataFrame, curves: pd.DataFrame) -> str | None:
    """Why the tables are not this run's (None when they are): every cell run.json records has its one
    row in timings.parquet and every row a cell run.json records; every curve is of one of those cells."""
    cells = meta.get("cells") or {}
    if not isinstance(cells, dict):
        return "run.json: cells: expected a mapping of cell id -> status"
    ids = list(timings["cell_id"])
    have = set(ids)
    twice = len(ids) - len(have)
    if twice:
        return f"timings.parquet: {twice} cell(s) with more than one row"
    foreign = [c for c in ids if c not in cells]
    if foreign:
        return (f"timings.parquet: {len(foreign)} row(s) of cells run.json does not record (another run's "
                f"table?)")
    missing = [c for c in cells if c not in have]
    if missing:
        return (f"timings.parquet: no row for {len(missing)} of the {len(cells)} cells run.json records"
                + (" (an empty table)" if not ids else ""))
    if len(curves) and not set(curves["cell_id"]) <= have:
        return "curves.parquet: curves of cells run.json does not record (another run's table?)"
    return None


def _parted(path: Path) -> bool:
    """Whether the run.json of ``path`` (readable: :func:`read_folder` said so) is that of a parted save."""
    return "saving" in json.loads((path / "run.json").read_text(encoding="utf-8"))


def read_folder(path: Path, resuming: bool = False) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """run.json and the tables of a results folder: the one rule for "this is a run" that everything
    reading runs goes by. One HarnessError ``FOLDER: damaged (...)`` when run.json or a table is missing,
    truncated, unreadable, not what a run writes, or not this run's (its cell ids are not run.json's)."""
    path = Path(path)
    if not (path / "run.json").exists():
        raise HarnessError(f"{path}: not a results folder (no run.json)")
    try:
        meta = json.loads((path / "run.json").read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _damaged(path, f"run.json: {str(exc)[:100]}", resuming) from None
    tables = []
    for name in ("timings.parquet", "curves.parquet"):
        if not (path / name).is_file():  # every run writes both with its run.json, from its first save
            raise _damaged(path, f"{name}: missing", resuming)
        try:
            tables.append(pd.read_parquet(path / name))
        except Exception as exc:  # pyarrow raises its own error types for a truncated or foreign file
            raise _damaged(path, f"{name}: {type(exc).__name__}: {str(exc)[:100]}", resuming) from None
    timings, curves = tables
    landing = meta.pop("saving", None)
    if landing is not None:  # a save a kill parted: the rows of these cells landed, their record did not
        if not isinstance(landing, list) or not all(isinstance(c, str) for c in landing):
            raise _damaged(path, "run.json: saving: expected a list of cell ids", resuming)
        left_out = set(landing) - set(meta.get("cells") or {})
        if "cell_id" in timings.columns:
            timings = timings[~timings["cell_id"].isin(left_out)].reset_index(drop=True)
        if len(curves) and "cell_id" in curves.columns:
            curves = curves[~curves["cell_id"].isin(left_out)].reset_index(drop=True)
    if len(timings.columns) == 0:  # a table written with no row and no column: a run that has no cell yet
        timings = pd.DataFrame(columns=TIMING_COLUMNS)
    why = _check_timings(timings)
    if why is None and len(curves) and "cell_id" not in curves.columns:
        why = "curves.parquet: not a curves table, no cell_id column"
    if why is None:
        why = _check_of_this_run(meta, timings, curves)
    if why:
        raise _damaged(path, why, resuming)
    return meta, timings, curves


def _read_folder(path: Path) -> tuple[dict, list[dict], list[dict]]:
    """run.json and the tables of a run to be resumed, as rows; HarnessError when one is damaged."""
    meta, timings, curves = read_folder(path, resuming=True)
    timings, curves = timings.to_dict("records"), curves.to_dict("records")
    for row in timings:  # parquet hands list columns back as arrays
        if row.get("samples_s") is not None:
            row["samples_s"] = [float(v) for v in row["samples_s"]]
        for key in ("samples_block", "samples_position"):
            if row.get(key) is not None:
                row[key] = [int(v) for v in row[key]]
    return meta, timings, curves


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
    """Load one results folder. Its timings gain what a reader needs beside the stored columns: ``label``,
    the backend as the config names it (``torch:fused``, ``jax@0.4.38``, ``numpy#2``), and the standing of
    each figure (:data:`harness.results.standing.STANDING_COLUMNS`: trusted, contended, unsteady, imprecise
    or not significant, with the evidence)."""
    path = Path(path)
    meta, timings, curves = read_folder(path)
    return Run(path, meta, reader_columns(timings), curves)


def reader_columns(timings: pd.DataFrame) -> pd.DataFrame:
    """A run's timings with ``label`` and the standing columns (one run's rows: a speedup's reference is
    looked up among them)."""
    from harness.results.labels import backend_name
    from harness.results.standing import with_standing

    df = timings.copy()
    records = [{"variant": None, **r} for r in df.to_dict("records")]  # an imported run may name no variant
    df["label"] = pd.Series([backend_name(r) for r in records], index=df.index, dtype=object) \
        if len(df) else pd.Series(dtype=object)
    return with_standing(df)


def load_runs(paths) -> Run:
    """Several runs concatenated, each row tagged with its ``run_id`` (two runs of the same id, e.g.
    started in the same second into folders of their own, are told apart by their folder names)."""
    runs = [load_run(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not runs:
        raise HarnessError("load_runs: no run folders given")
    ids = [r.run_id for r in runs]
    tags = [i if ids.count(i) == 1 else f"{i} ({r.path.name})" for i, r in zip(ids, runs)]
    timings = pd.concat([r.timings.assign(run_id=t) for r, t in zip(runs, tags)], ignore_index=True)
    curves = pd.concat([r.curves.assign(run_id=t) for r, t in zip(runs, tags)], ignore_index=True)
    meta = {"runs": {t: r.meta for r, t in zip(runs, tags)}}
    return Run(Path(os.path.commonpath([str(r.path) for r in runs])), meta, timings, curves)
