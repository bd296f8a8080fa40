"""The folders of a ``harness run``, opened before its first cell: the options checked, the configs loaded,
each config's run folder created (or an interrupted run's folder reopened to finish it, ending the workers
its killed runner left running), and every folder closed however the runs end. Running a config into its
folder is :func:`harness.run.session.run_into`; the command line parses the options and prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.config import load_config
from harness.config.cells import RunConfig
from harness.results.store import RunStore, check_out_folder, config_fingerprint
from harness.run.runner import new_run_meta
from harness.run.session import end_stale_workers, executor_for
from harness.spec.errors import HarnessError


@dataclass
class OpenRuns:
    """Configs with their open run folders, in the order given, and the executor they run on (None: the
    local sequential runner); a context manager that closes the folders (and their locks)."""

    runs: list[tuple[RunConfig, RunStore]] = field(default_factory=list)
    executor: object | None = None
    #: pids of the workers an interrupted run's killed runner had left running, ended on reopening it
    ended_workers: list[int] = field(default_factory=list)

    def __iter__(self):
        return iter(self.runs)

    def __enter__(self) -> "OpenRuns":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every folder."""
        for _, store in self.runs:
            store.close()


def open_runs(configs: list[Path], backends: list[str] | None = None, profile: str | None = None,
              out: Path | None = None, resume: Path | None = None, executor: str = "local",
              scheduler: str | None = None, workers: int | None = None) -> OpenRuns:
    """Load ``configs`` (``backends`` overriding their lists, ``profile`` applied) and open a run folder for
    each: ``out`` itself for one config, else a new folder under ``out`` (default ``results/``) per config;
    with ``resume``, the interrupted run there, which the one config must have started. ``executor``,
    ``scheduler`` and ``workers`` are ``harness run``'s options. Raises HarnessError before any folder is
    left open."""
    if out is not None:
        check_out_folder(out)
    opened = OpenRuns(executor=executor_for(executor, scheduler, workers))
    if resume is not None and len(configs) > 1:
        raise HarnessError("--resume takes one config (the one the run was started with)")
    loaded = [load_config(c, backends, profile) for c in configs]
    if resume is None and opened.executor is not None:  # before any folder exists: no worker can hold these threads
        opened.executor.check_cells([c for config in loaded for c in config.cells()])
    try:
        if resume is not None:
            store = RunStore.open(resume, lock=True, fingerprint=config_fingerprint(loaded[0]))
            opened.runs.append((loaded[0], store))
            opened.ended_workers = end_stale_workers(store.path)
        else:
            for config in loaded:
                opened.runs.append((config, _new_folder(config, out, one=len(loaded) == 1)))
    except BaseException:
        opened.close()
        raise
    return opened


def _new_folder(config: RunConfig, out: Path | None, one: bool) -> RunStore:
    """A new run's folder with its starting run.json: ``out`` itself (locked) when it names one config's
    folder, else a fresh name under ``out`` or ``results/``."""
    meta = new_run_meta(config)
    meta["config_fingerprint"] = config_fingerprint(config)
    if out is None or not one:
        return RunStore.create_unique(out or Path("results"), meta)
    return RunStore.create(out, meta, lock=True)
