"""The scheduler: a config's cells as comparison groups, run pass by pass into one results folder.

What one group's pass does (workers, interleaved rounds, the stop rule) is
:class:`harness.run.group.GroupRun`; this module decides the order (every group's first pass,
then every group's second, ...: a group's passes lie apart in the run), measures the roofs,
keeps unfinished groups in run.json between passes and hands finished ones to the store.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime, timezone

from rich.markup import escape

from harness.worker import lifeline
from harness.run import guard, machine, roofs
from harness.run.client import kill_all_workers
from harness.config import Cell, RunConfig
from harness.run.group import GroupRun


class Runner:
    """Runs the cells of one config into one results folder.

    ``store`` is handed in (a :class:`harness.results.store.RunStore`, or anything with its
    ``meta``, ``done_cells``, ``unfinished``, ``keep_unfinished``, ``add_group`` and ``save``): the
    runner only runs, and hands each finished group's outcomes to ``store.add_group``, where the
    results layer makes its rows."""

    def __init__(self, config: RunConfig, store, console=None, sampler: "guard.Sampler | None" = None,
                 name_group=None):
        self.config = config
        self.store = store
        self.console = console
        self.name_group = name_group  # how the progress line names a group (None: the group's own label)
        # the busy-machine guard's readings through the run (harness.run.guard; a test hands in its own)
        self.sampler = sampler if sampler is not None else guard.Sampler()
        self.gemm_peaks: dict[str, float] = dict(store.meta.get("gemm_peak_gflops", {}))
        self.gpu_roofs: dict | None = store.meta.get("gpu_roofs")
        self.measured_peaks: dict[str, float] = {}  # the GEMM peaks this session measured (at its start)
        # the workers running, listed in the results folder for a --resume after this process was killed
        folder = getattr(store, "path", None)
        self.record = lifeline.WorkerRecord(folder) if folder is not None else None

    # -- progress helpers ----------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False, markup=False)

    # -- running ---------------------------------------------------------------------
    def pending_groups(self) -> list[list[Cell]]:
        """The comparison groups still to run (all of them, or those a resumed run lacks)."""
        done = self.store.done_cells()
        groups = self.config.groups()
        todo = [g for g in groups if not all(c.cell_id in done for c in g)]
        if len(todo) < len(groups):
            self._say(f"resuming: {len(groups) - len(todo)} of {len(groups)} comparison groups already done")
        return todo

    def run(self, progress=None, executor=None, groups: list[list[Cell]] | None = None) -> None:
        """Run every pending group (or just ``groups``) here, one at a time, or hand them to ``executor``
        (an object with ``run(runner, groups, progress, task_id)``, e.g. the Dask one), storing each as
        it finishes."""
        try:
            self._run(progress, executor, groups)
        finally:
            kill_all_workers()  # an interrupt at any phase must leave none behind

    def _run(self, progress, executor, groups) -> None:
        todo = self.pending_groups() if groups is None else groups
        # the bar counts passes over cells: a group of passes 3 moves it three times, not once at its end
        planned = {id(g): planned_steps([g]) for g in todo}
        if executor is not None:  # it counts each group once, when it comes back
            self.check_machine()  # each group's host samples its own machine while it times (distributed.py)
            task_id = progress.add_task("cells", total=sum(len(g) for g in todo)) if progress else None
            executor.run(self, todo, progress, task_id)
            return
        task_id = progress.add_task("cells", total=sum(planned.values())) if progress else None
        at_start = self.check_machine()
        started = time.monotonic()
        self.sampler.start()
        try:
            self._run_groups(todo, progress, task_id, planned)
            # the peaks this session measured at its start, measured again: the machine at the run's end
            end = roofs.peaks_again(self.config.cells(), self.measured_peaks, self._say, self.record)
        finally:
            self.sampler.stop()
        self.store.meta["conditions"] = guard.run_conditions(self.sampler, at_start, started, self.measured_peaks, end)
        self.store.save()

    def check_machine(self) -> dict | None:
        """A second's reading of the machine before anything runs; on a busy one, a warning that says who
        keeps it busy (:func:`harness.run.guard.busy_warning`)."""
        state = guard.busy_now(self.sampler)
        warning = guard.busy_warning(state)
        if warning:
            self._say(f"warning: {warning}")
        return state

    def _run_groups(self, todo, progress, task_id, planned) -> None:
        self.measure_roofs(self.config.cells())
        machine.record_host(self.store.meta, machine.host_name(), self.store.meta.get("machine"), self.gemm_peaks,
                            self.gpu_roofs)
        states = [GroupRun.restore(g, self.store.unfinished(g[0].key)) for g in todo]
        for state in states:
            state.name = self.name_group
        if any(s.passes_done for s in states):
            self._say(f"resuming: {sum(1 for s in states if s.passes_done)} comparison group(s) go on at their next pass")
        describe = _describer(progress, task_id)
        counted = {id(s): len(s.group) * s.passes_done for s in states}  # a resumed group's passes so far
        if progress is not None and any(counted.values()):
            progress.advance(task_id, sum(counted.values()))
        while states:  # one pass over every group not yet finished, in the config's order
            for state in list(states):
                state.run_pass(describe, self.record)
                self.note_conditions(state)
                if progress is not None:
                    self._count_pass(progress, task_id, state, planned, counted)
                if not state.finished:
                    self.store.keep_unfinished(state.key, state.saved())
                    continue
                states.remove(state)
                self.store.add_group(state.ordered(), self.gemm_peaks, self.gpu_roofs)

    def note_conditions(self, state: GroupRun) -> None:
        """Keep with each cell what the machine did while it was timed in the pass just run."""
        guard.note_windows(self.sampler, state)

    @staticmethod
    def _count_pass(progress, task_id, state, planned: dict, counted: dict) -> None:
        """Move the bar by the pass just run: a pass beyond the planned ones (the precision target asked
        for it) adds to the total; a group that finished short of them gives back what it did not run."""
        key = id(state.group)
        counted[id(state)] = counted.get(id(state), 0) + len(state.group)
        if counted[id(state)] > planned.get(key, 0) or state.finished:
            planned[key] = counted[id(state)]
        progress.update(task_id, total=sum(planned.values()), advance=len(state.group))

    def measure_roofs(self, cells: list[Cell]) -> None:
        """The roofs the cells' GFLOP/s are read against, where this run has not measured them yet:
        the CPU's GEMM peak per dtype and thread count, the GPU's GEMM rates and bandwidth."""
        self.measured_peaks = roofs.gemm_peaks(cells, self.gemm_peaks, self._say, self.record)
        self.gemm_peaks.update(self.measured_peaks)
        self.store.meta["gemm_peak_gflops"] = self.gemm_peaks
        if self.gpu_roofs is None:
            self.gpu_roofs = roofs.gpu_roofs(cells, self._say, self.record)
            if self.gpu_roofs is not None:
                self.store.meta["gpu_roofs"] = self.gpu_roofs


def planned_steps(groups) -> int:
    """What the progress bar counts for these comparison groups: a step per cell and planned pass (a training
    group runs once); the bar's total grows when the precision target asks for more passes."""
    return sum(len(g) * (1 if g[0].problem.workload == "train" else max(1, g[0].timing.pass_count)) for g in groups)


def new_run_meta(config: RunConfig) -> dict:
    """The run.json of a run that is starting."""
    now = datetime.now(timezone.utc)
    run_id = f"{config.name}-{now.strftime('%Y%m%d-%H%M%S')}"
    return {
        "run_id": run_id, "name": config.name, "config_path": config.path,
        "config": [raw.model_dump() for raw, _ in config.parts],
        "config_source": config.source, "baseline": config.baseline, "machine": machine.machine_info(),
        "git_commit": machine.git_commit(), "git_changed": machine.git_changes(),
        "started": now.isoformat(), "finished": None,
        "env": dict(config.raw.env), "cpu_times_start": machine.cpu_times(), "harness_python": sys.version.split()[0],
        "task_files": config.task_files, "backend_sources": backend_sources(config.backends),
    }


def backend_sources(names) -> dict:
    """Where each backend's class comes from; a built-in name that ``HARNESS_BACKENDS`` points at another
    class says which class it replaced, so that a run with a swapped backend can be told from a normal one."""
    import backends

    registry = backends.registry()
    out = {}
    for full in names:
        name = backends.ref(full).name
        module, cls = registry.get(name, ("?", "?"))
        entry = {"origin": backends.origin(name), "class": f"{module}:{cls}"}
        if entry["origin"] == "HARNESS_BACKENDS" and name in backends.REGISTRY:
            entry["replaces"] = ":".join(backends.REGISTRY[name])
        out[name] = entry
    return out


def finish_meta(store, interrupted: bool = False) -> None:
    """Close the run's metadata: end time, load and steal share over the run."""
    meta = store.meta
    meta["finished"] = None if interrupted else datetime.now(timezone.utc).isoformat()
    meta["interrupted"] = interrupted
    end = machine.cpu_times()
    meta["steal_share"] = machine.steal_share(meta.get("cpu_times_start", {}), end)
    meta["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    statuses = meta.get("cells", {})
    meta["summary"] = {s: sum(1 for v in statuses.values() if v == s) for s in sorted(set(statuses.values()))}
    store.save()


def _describer(progress, task_id):
    """What a group's pass says it is doing, shown as the progress bar's description (None: no bar)."""
    if progress is None:
        return None
    return lambda text: progress.update(task_id, description=escape(text))
