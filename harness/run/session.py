"""A run's life cycle around the runner: the executor the options name, the workers a killed runner
left behind, running a config into its open store and closing the store's metadata however the run
ends, and the command that resumes it. The CLI opens the stores (the results layer) and prints; what
happens between opening and printing lives here, so a test or a notebook runs a config as the CLI does.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from harness.config.cells import RunConfig
from harness.run.client import kill_all_workers
from harness.run.runner import Runner, finish_meta
from harness.spec.errors import HarnessError


def executor_for(kind: str, scheduler: str | None = None, workers: int | None = None):
    """The executor object for ``--executor`` (None: the local sequential runner)."""
    from harness.run.distributed import DaskExecutor

    if kind == "local":
        if scheduler or workers:
            raise HarnessError("--scheduler and --workers go with --executor dask / dask-local")
        return None
    if kind == "dask":
        if not scheduler:
            raise HarnessError("--executor dask needs --scheduler ADDRESS (e.g. tcp://head-node:8786)")
        return DaskExecutor(scheduler=scheduler)
    if kind == "dask-local":
        if scheduler:
            raise HarnessError("--executor dask-local starts its own cluster; --scheduler goes with --executor dask")
        if workers is not None and workers < 1:
            raise HarnessError(f"--workers: expected a positive integer, got {workers}")
        return DaskExecutor(n_workers=workers or 2)
    raise HarnessError(f"--executor: expected local, dask or dask-local, got {kind!r}")


def end_stale_workers(folder: Path) -> list[int]:
    """End the workers a killed runner of the run in ``folder`` left running; their pids (with the
    kernel's guarantee, Linux, there are none: each worker died with its runner)."""
    from harness.worker.lifeline import end_stale

    return end_stale(folder)


def run_into(config: RunConfig, store, progress=None, executor=None, console=None, name_group=None) -> None:
    """Run ``config``'s pending groups into the open ``store`` and close its metadata.

    An interrupt (KeyboardInterrupt) or a HarnessError ends the workers, closes the metadata as
    interrupted (what finished is kept; ``--resume`` goes on) and goes on up; a store that cannot even
    write that keeps the first error. A HarnessError from closing a run that finished goes up too.
    ``name_group`` names a group on the progress line (the terminal's naming; None: the group's label)."""
    try:
        Runner(config, store, console=console, name_group=name_group).run(progress, executor)
    except (KeyboardInterrupt, HarnessError):
        kill_all_workers()
        try:
            finish_meta(store, interrupted=True)
        except HarnessError:
            pass  # the disk refuses this too: the error on its way up says what went wrong first
        raise
    finish_meta(store)


def resume_command(config: str, folder: Path, profile: str | None = None, backends_opt: str | None = None) -> str:
    """The command that finishes an interrupted run: its config and folder as they were given, with the
    options its fingerprint holds (--profile, --backends), quoted for a shell."""
    args = ["harness", "run", str(config)]
    if profile is not None:
        args += ["--profile", profile]
    if backends_opt is not None:
        args += ["--backends", backends_opt]
    return shlex.join(args + ["--resume", str(folder)])
