"""Config -> cells -> worker processes -> results.

The cells of one comparison group (same problem, different backends) are timed
side by side: each gets its own warmed worker, and the workers take their rounds in
turn (A B C A B C ...), so a drift of the machine's speed hits every backend alike
and the speedup comes from paired rounds with a bootstrap interval. With
``timing.passes`` a group is visited that many times (every group's first pass, then
every group's second, ...), with fresh workers each time, so that its rounds come from
moments of the run that lie apart.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import groupby

from harness.run import envs, lifeline, machine, measure, protocol
# the worker client's names, importable from here as they always were
from harness.run.client import (WorkerFailure, WorkerProcess, classify_exit, worker_cpus,  # noqa: F401
                            worker_environment, worker_settings)
from harness.run.config import Cell, RunConfig
from harness.spec.errors import HarnessError


@dataclass
class Outcome:
    """What happened to one cell."""

    cell: Cell
    status: str = "ok"
    error: str = ""
    compile_s: float | None = None
    samples: list | None = None
    peak_rss_mb: float | None = None
    versions: dict | None = None
    data_meta: dict | None = None
    train: dict | None = None
    worker_env: dict | None = None
    verify: dict | None = None
    host: str | None = None  # where it ran (a run spread over a cluster names each cell's host)
    stop_reason: str | None = None  # why the group's interleaved rounds stopped (floor | target | cap)
    blocks: list | None = None  # per round, the (pass, process) block that took it (TimingPolicy.round_block)


@dataclass
class GroupTiming:
    """A comparison group across its passes: each cell's outcome and its rounds so far."""

    group: list[Cell]
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)  # the timed cells' rounds, all passes
    inner: dict[str, int] = field(default_factory=dict)  # calls per round, calibrated in the first pass
    blocks: list[int] = field(default_factory=list)  # the block of each of the group's rounds, in order
    timed_s: float = 0.0  # seconds of interleaved rounds so far, all passes (the cap counts them)
    passes_done: int = 0
    wants_pass: bool = False  # the stop rule asked for another pass
    pending: list[str] | None = None  # the cells that pass is for (None: all), beside the baseline
    rule: measure.StopRule | None = None

    @property
    def policy(self) -> measure.TimingPolicy:
        return measure.TimingPolicy.of(self.group[0].timing)

    @property
    def finished(self) -> bool:
        """Visited, and the stop rule wants no further pass (or nothing is left to time)."""
        return self.passes_done > 0 and not self.wants_pass

    @property
    def baseline_id(self) -> str | None:
        return next((c.cell_id for c in self.group if c.backend == self.group[0].baseline), None)

    def ordered(self) -> list[Outcome]:
        return [self.outcomes[c.cell_id] for c in self.group]

    # what run.json keeps of a group between its passes, so that --resume goes on where an interrupt stopped it
    _KEPT = ("status", "error", "compile_s", "samples", "peak_rss_mb", "versions", "data_meta", "train",
             "worker_env", "verify", "host", "stop_reason", "blocks")

    def saved(self) -> dict:
        return {"passes_done": self.passes_done, "timed_s": self.timed_s, "inner": self.inner, "blocks": self.blocks,
                "timed": list(self.samples), "pending": self.pending,
                "outcomes": {cid: {k: getattr(o, k) for k in self._KEPT} for cid, o in self.outcomes.items()}}

    @classmethod
    def restore(cls, group: list[Cell], saved: dict | None) -> "GroupTiming":
        """The group as run.json kept it after its last finished pass (a fresh one without)."""
        state = cls(group)
        cells = {c.cell_id: c for c in group}
        if not saved or set(saved.get("outcomes", {})) != set(cells):
            return state
        state.outcomes = {cid: Outcome(cells[cid], **kept) for cid, kept in saved["outcomes"].items()}
        state.samples = {cid: state.outcomes[cid].samples or [] for cid in saved["timed"]}
        state.inner, state.blocks = dict(saved["inner"]), list(saved["blocks"])
        state.timed_s, state.passes_done = float(saved["timed_s"]), int(saved["passes_done"])
        state.pending = saved.get("pending")
        state.wants_pass = True  # kept only between passes
        return state


class Runner:
    """Runs the cells of one config into one results folder.

    ``store`` is handed in (a :class:`harness.results.store.RunStore`, or anything with its
    ``meta``, ``done_cells``, ``unfinished``, ``keep_unfinished``, ``add_group`` and ``save``): the
    runner only runs, and hands each finished group's outcomes to ``store.add_group``, where the
    results layer makes its rows."""

    def __init__(self, config: RunConfig, store, console=None):
        self.config = config
        self.store = store
        self.console = console
        self.gemm_peaks: dict[str, float] = dict(store.meta.get("gemm_peak_gflops", {}))
        self.gpu_roofs: dict | None = store.meta.get("gpu_roofs")
        self._live: set[WorkerProcess] = set()  # every worker started and not yet closed
        # ... listed in the results folder too, for a --resume after this process was killed
        folder = getattr(store, "path", None)
        self._record = lifeline.WorkerRecord(folder) if folder is not None else None

    # -- progress helpers ----------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False)

    # -- workers ---------------------------------------------------------------------
    def _spawn(self, environment: str | None, env: dict, label: str, recorded: dict | None = None) -> WorkerProcess:
        worker = WorkerProcess(environment, env, label, recorded)
        self._live.add(worker)
        if self._record is not None:
            self._record.add(worker.proc.pid)
        return worker

    def _close(self, worker: WorkerProcess) -> None:
        self._live.discard(worker)
        worker.close()
        if self._record is not None:
            self._record.remove(worker.proc.pid)

    def _kill_all(self) -> None:
        """Kill every worker still running (an interrupt at any phase must leave none behind)."""
        while self._live:
            worker = self._live.pop()
            worker.kill()
            worker.stderr.close()
            if self._record is not None:
                self._record.remove(worker.proc.pid)

    # -- running ---------------------------------------------------------------------
    def pending_groups(self) -> list[list[Cell]]:
        """The comparison groups still to run (all of them, or those a resumed run lacks)."""
        cells = self.config.cells()
        done = self.store.done_cells()
        groups = [list(g) for _, g in groupby(cells, key=lambda c: c.group_key)]
        todo = [g for g in groups if not all(c.cell_id in done for c in g)]
        if len(todo) < len(groups):
            self._say(f"resuming: {len(groups) - len(todo)} of {len(groups)} comparison groups already done")
        return todo

    def run(self, progress=None, executor=None) -> None:
        """Run every pending group here, one at a time, or hand them to ``executor`` (an object
        with ``run(runner, groups, progress, task_id)``, e.g. the Dask one), storing each as it finishes."""
        try:
            self._run(progress, executor)
        finally:
            self._kill_all()

    def _run(self, progress, executor) -> None:
        todo = self.pending_groups()
        task_id = progress.add_task("cells", total=sum(len(g) for g in todo)) if progress else None
        if executor is not None:
            executor.run(self, todo, progress, task_id)
            return
        self._measure_gemm_peaks()
        self._measure_gpu_roofs()
        self.store.meta.setdefault("hosts", {})[machine.host_name()] = {
            "machine": self.store.meta.get("machine"), "gemm_peak_gflops": self.gemm_peaks, "gpu_roofs": self.gpu_roofs}
        states = [GroupTiming.restore(g, self.store.unfinished(g[0].group_key)) for g in todo]
        if any(s.passes_done for s in states):
            self._say(f"resuming: {sum(1 for s in states if s.passes_done)} comparison group(s) go on at their next pass")
        while states:  # one pass over every group not yet finished, in the config's order
            for state in list(states):
                self._visit(state, progress, task_id)
                if not state.finished:
                    self.store.keep_unfinished(state.group[0].group_key, state.saved())
                    continue
                states.remove(state)
                self.store.add_group(state.ordered(), self.gemm_peaks, self.gpu_roofs)
                if progress is not None:
                    progress.advance(task_id, len(state.group))

    def run_group(self, group: list[Cell], progress=None, task_id=None) -> list[Outcome]:
        """Time one comparison group side by side, all its passes back to back, store its rows, and
        return its outcomes."""
        state = GroupTiming(group)
        while not state.finished:
            self._visit(state, progress, task_id)
        self.store.add_group(state.ordered(), self.gemm_peaks, self.gpu_roofs)
        return state.ordered()

    def _measure_gemm_peaks(self, cells: list[Cell] | None = None) -> None:
        """The machine's GEMM peak per dtype and thread count, for roofline and %-of-peak figures."""
        for dtype, threads, extra in {(c.problem.dtype, c.threads): (c.problem.dtype, c.threads, c.env)
                                      for c in (cells or self.config.cells()) if c.problem.device == "cpu"}.values():
            key = f"{dtype}|threads={threads}"
            if key not in self.gemm_peaks:
                _, env = worker_environment("numpy", "cpu", dtype, threads, extra)
                w = self._spawn(None, env, "gemm-peak")
                try:
                    self.gemm_peaks[key] = w.request(protocol.GemmPeak(dtype, 1024), 120)["gflops"]
                except WorkerFailure as exc:
                    self._say(f"warning: GEMM peak measurement failed: {exc}")
                finally:
                    self._close(w)
        self.store.meta["gemm_peak_gflops"] = self.gemm_peaks

    def _measure_gpu_roofs(self, cells: list[Cell] | None = None) -> None:
        """The GPU's GEMM rates and memory bandwidth, once, when GPU cells are to run (roofline and % of peak)."""
        gpu_cells = [c for c in (cells or self.config.cells()) if c.problem.device == "gpu"]
        if self.gpu_roofs is not None or not gpu_cells:
            return
        _, env = worker_environment("torch", "gpu", "float32", 1, gpu_cells[0].env)
        w = self._spawn(None, env, "gpu-roofs")
        try:
            self.gpu_roofs = dict(w.request(protocol.GpuRoofs(), 300).body)
            self.store.meta["gpu_roofs"] = self.gpu_roofs
        except WorkerFailure as exc:  # no GPU here, or no torch: GPU cells say why themselves
            self._say(f"note: GPU roofs not measured: {str(exc).splitlines()[0]}")
        finally:
            self._close(w)

    def _screen(self, cell: Cell) -> Outcome | None:
        """Availability and support, decided in this process without importing heavy libraries."""
        import backends
        from backends.base import screen

        try:
            status, why = screen(backends.create(cell.backend), cell.problem)
        except HarnessError as exc:
            return Outcome(cell, "unavailable", str(exc))
        return None if status == "ok" else Outcome(cell, status, why)

    def _start(self, cell: Cell, describe, verify: bool = True) -> tuple[WorkerProcess | None, Outcome]:
        outcome = Outcome(cell)
        p = cell.problem
        try:
            environment, settings = worker_settings(cell.backend, p.device, p.dtype, cell.threads, cell.env)
            if environment and envs.env_python(environment) is None:
                describe(f"creating isolated environment {environment!r} (first use)")
            env = {**envs.worker_environ(environment), **settings}
            worker = self._spawn(environment, env, cell.backend, recorded=settings)
        except HarnessError as exc:
            outcome.status, outcome.error = "unavailable", str(exc)
            return None, outcome
        outcome.worker_env = worker.env
        timing = cell.timing
        try:
            describe(f"{cell.backend}: starting")
            init = worker.request(protocol.Init(cell.backend, p.to_mapping(), cell.task.to_mapping(), cell.seed,
                                                cell.threads, cell.train.lr), timing.timeout_s)
            outcome.versions, outcome.data_meta = init.get("versions"), init.get("data_meta")
            describe(f"{cell.backend}: compiling / warming up")
            # training must start from the shared initial parameters: compile only, no warm steps
            n_warm = 0 if p.workload == "train" else timing.warmup
            warm = worker.request(protocol.WarmUp(n_warm), timing.timeout_s)
            outcome.compile_s, outcome.peak_rss_mb = warm["compile_s"], warm.peak_rss_mb
            if p.workload != "train" and timing.verify and verify:
                describe(f"{cell.backend}: verifying against the reference")
                outcome.verify = worker.request(protocol.Verify(), timing.timeout_s).body
                if not outcome.verify["ok"]:
                    v = outcome.verify
                    raise WorkerFailure("mismatch", f"does not match the reference on this cell: {v['worst']} "
                                                    f"off by {v['ratio']:.3g}x the bound {v['bound']}")
        except WorkerFailure as exc:
            outcome.status, outcome.error = exc.status, str(exc)
            self._close(worker)
            return None, outcome
        return worker, outcome

    def _visit(self, state: GroupTiming, progress, task_id) -> None:
        """One pass over a group: fresh warmed workers for the cells being timed, rounds in turn until
        the stop rule ends the pass. The first pass also screens the cells and runs the training ones."""
        group, policy = state.group, state.policy
        head = group[0]
        label = f"{head.problem.workload} {head.problem.model.describe()} B={head.problem.batch} {head.problem.dtype} threads={head.threads}"
        if policy.pass_limit > 1:
            most = policy.passes if policy.pass_limit == policy.passes else f"{policy.passes}-{policy.pass_limit}"
            label += f" · pass {state.passes_done + 1} of {most}"

        def describe(text):
            if progress is not None:
                progress.update(task_id, description=f"{label} · {text}")

        first = state.passes_done == 0
        state.wants_pass = False
        workers: dict[str, list[WorkerProcess]] = {}
        try:
            for cell in group:
                cid = cell.cell_id
                if first:
                    screened = self._screen(cell)
                    if screened is not None:
                        state.outcomes[cid] = screened
                        continue
                    if cell.problem.workload == "train":
                        state.outcomes[cid] = self._train_cell(cell, describe)
                        continue
                elif cid not in state.samples or state.outcomes[cid].status != "ok":
                    continue
                elif state.pending is not None and cid not in state.pending and cid != state.baseline_id:
                    continue  # its speedup is already within the target
                started, procs = self._start_processes(cell, describe, verify=first)
                if first:
                    state.outcomes[cid] = started
                elif not procs:  # a later pass's fresh process failed where the first did not: the cell failed
                    state.outcomes[cid].status, state.outcomes[cid].error = started.status, started.error
                if procs:
                    workers[cid] = procs
                    state.samples.setdefault(cid, [])
            if workers:
                self._interleave(state, workers, describe)
        finally:
            for procs in workers.values():
                for w in procs:
                    self._close(w)
            state.passes_done += 1
            here = machine.host_name()
            for outcome in state.outcomes.values():
                outcome.host = outcome.host or here

    def _start_processes(self, cell: Cell, describe, verify: bool = True) -> tuple[Outcome, list[WorkerProcess]]:
        """The cell's ``timing.processes`` warmed workers (the first one verified, if ``verify``), each
        paused as soon as it is ready, so that the next one's start and compile time are taken alone too."""
        n = cell.timing.processes
        procs: list[WorkerProcess] = []
        outcome = None
        for k in range(n):
            say = describe if n == 1 else (lambda text, k=k: describe(f"{text} (process {k + 1} of {n})"))
            worker, started = self._start(cell, say, verify=verify and k == 0)
            if outcome is None:
                outcome = started
            elif worker is None:  # a later process failed where the first did not: the cell failed
                outcome.status, outcome.error = started.status, started.error
            if worker is None:
                for w in procs:
                    self._close(w)
                return outcome, []
            worker.pause()
            procs.append(worker)
        return outcome, procs

    def _train_cell(self, cell: Cell, describe) -> Outcome:
        worker, outcome = self._start(cell, describe)
        if worker is None:
            return outcome
        try:
            describe(f"{cell.backend}: training")
            budget = cell.train.time_budget_s
            timeout = cell.timing.timeout_s + (3 * budget if budget else 0)
            result = worker.request(protocol.Train(protocol.TrainSettings.of(cell.train, cell.seed)), timeout)
            outcome.train = result.body
            outcome.samples = result["step_samples"]
            outcome.peak_rss_mb = result.peak_rss_mb
            if result["status"] != "ok":
                outcome.status, outcome.error = result["status"], str(result["stop"])
        except WorkerFailure as exc:
            outcome.status, outcome.error = exc.status, str(exc)
        finally:
            self._close(worker)
        return outcome

    def _interleave(self, state: GroupTiming, workers: dict[str, list[WorkerProcess]], describe) -> None:
        """One pass of rounds of the group's warmed workers in turn, until the stop rule ends it. With
        several processes per cell, round ``i`` of the pass runs in the cell's process ``i % processes``."""
        group, policy = state.group, state.policy
        if state.rule is None:
            state.rule = measure.stop_rule(policy)
        rule, outcomes, samples, inner = state.rule, state.outcomes, state.samples, state.inner
        base = state.baseline_id
        alive = dict(workers)

        def fail(cid, exc):
            outcomes[cid].status, outcomes[cid].error = exc.status, str(exc)
            for w in alive.pop(cid):
                self._close(w)

        def alone(cid, k: int = 0) -> WorkerProcess:
            """cid's k-th worker, with every other worker of the group paused while it is timed."""
            me = alive[cid][k]
            for procs in alive.values():
                for w in procs:
                    if w is not me:
                        w.pause()
            me.resume()
            return me

        start = None
        try:
            for cid in list(alive):
                if cid in inner:  # calibrated in an earlier pass: every pass runs the same rounds
                    continue
                try:  # the processes of a cell run the same code on the same data: one calibration
                    inner[cid] = alone(cid).request(protocol.Calibrate(policy.target_round_s), policy.timeout_s)["inner"]
                except WorkerFailure as exc:
                    fail(cid, exc)
            rule.start_pass(state.passes_done, {c: samples[c] for c in alive})
            start = measure.clock_ns()
            n_round = 0

            def done() -> bool:
                return rule.done({c: samples[c] for c in alive}, {c: inner[c] for c in alive},
                                 base if base in alive else None, state.timed_s + measure.elapsed_s(start),
                                 state.blocks)

            while alive and not done():
                describe(f"round {n_round + 1} ({', '.join(c.backend for c in group if c.cell_id in alive)})")
                state.blocks.append(policy.round_block(state.passes_done, n_round))
                k = n_round % policy.processes
                n_round += 1
                for cid in list(alive):
                    try:
                        reply = alone(cid, k).request(protocol.Rounds(1, inner[cid]), policy.timeout_s)
                        samples[cid] += reply["samples"]
                        outcomes[cid].peak_rss_mb = max(outcomes[cid].peak_rss_mb or 0.0, reply.peak_rss_mb or 0.0)
                    except WorkerFailure as exc:
                        fail(cid, exc)
        finally:
            if start is not None:
                state.timed_s += measure.elapsed_s(start)
            for procs in alive.values():
                for w in procs:
                    w.resume()
        state.wants_pass = rule.reason == "pass" and bool(alive)
        state.pending = sorted(rule.pending) if rule.pending is not None else None
        for cid in workers:
            outcomes[cid].samples = samples[cid]
            outcomes[cid].blocks = state.blocks[:len(samples[cid])]
            met = state.pending is not None and cid not in state.pending and cid != base  # its own target
            outcomes[cid].stop_reason = "target" if met else rule.reason


def new_run_meta(config: RunConfig) -> dict:
    """The run.json of a run that is starting."""
    now = datetime.now(timezone.utc)
    run_id = f"{config.name}-{now.strftime('%Y%m%d-%H%M%S')}"
    return {
        "run_id": run_id, "name": config.name, "config_path": config.path,
        "config": [raw.model_dump() for raw, _ in config.parts],
        "config_source": config.source, "baseline": config.baseline, "machine": machine.machine_info(),
        "git_commit": machine.git_commit(), "started": now.isoformat(), "finished": None,
        "env": dict(config.raw.env), "cpu_times_start": machine.cpu_times(), "harness_python": sys.version.split()[0],
    }


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
