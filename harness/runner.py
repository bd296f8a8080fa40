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
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import groupby

from harness import envs, machine, measure, protocol, schema
# the worker client's names, importable from here as they always were
from harness.client import (WorkerFailure, WorkerProcess, classify_exit, worker_cpus,  # noqa: F401
                            worker_environment, worker_settings)
from harness.config import Cell, RunConfig
from harness.errors import HarnessError
from harness.results import RunStore
from harness.timing import Stats, paired_speedup


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
             "worker_env", "verify", "stop_reason", "blocks")

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
    """Runs the cells of one config into one results folder."""

    def __init__(self, config: RunConfig, store: RunStore, console=None):
        self.config = config
        self.store = store
        self.console = console
        self.gemm_peaks: dict[str, float] = dict(store.meta.get("gemm_peak_gflops", {}))
        self.gpu_roofs: dict | None = store.meta.get("gpu_roofs")
        self._live: set[WorkerProcess] = set()  # every worker started and not yet closed

    # -- progress helpers ----------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False, markup=False)

    # -- workers ---------------------------------------------------------------------
    def _spawn(self, environment: str | None, env: dict, label: str, recorded: dict | None = None) -> WorkerProcess:
        worker = WorkerProcess(environment, env, label, recorded)
        self._live.add(worker)
        return worker

    def _close(self, worker: WorkerProcess) -> None:
        self._live.discard(worker)
        worker.close()

    def _kill_all(self) -> None:
        """Kill every worker still running (an interrupt at any phase must leave none behind)."""
        while self._live:
            worker = self._live.pop()
            worker.kill()
            worker.stderr.close()

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
                self.store.add(*self._rows(state.ordered()))
                if progress is not None:
                    progress.advance(task_id, len(state.group))

    def run_group(self, group: list[Cell], progress=None, task_id=None) -> tuple[list[dict], list[dict]]:
        """Time one comparison group side by side, all its passes back to back, and return its
        result rows and curve points."""
        state = GroupTiming(group)
        while not state.finished:
            self._visit(state, progress, task_id)
        return self._rows(state.ordered())

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

    def _peak_columns(self, cell: Cell) -> dict:
        """The roof a cell's GFLOP/s is read against: the CPU's NumPy GEMM, or the GPU's cuBLAS rates."""
        p = cell.problem
        if p.device == "cpu":
            return {"gemm_peak_gflops": self.gemm_peaks.get(f"{p.dtype}|threads={cell.threads}")}
        roofs = self.gpu_roofs or {}
        fp32 = p.dtype == "float32"
        return {"gemm_peak_gflops": roofs.get("gemm_fp32_gflops" if fp32 else "gemm_fp64_gflops"),
                "gpu_tf32_gflops": roofs.get("gemm_tf32_gflops") if fp32 else None,
                "gpu_bandwidth_gbs": roofs.get("bandwidth_gbs")}

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
                from rich.markup import escape

                progress.update(task_id, description=escape(f"{label} · {text}"))

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

    # -- results rows ------------------------------------------------------------------
    def _rows(self, outcomes: list[Outcome]) -> tuple[list[dict], list[dict]]:
        import backends

        base_name = outcomes[0].cell.baseline
        base = next((o for o in outcomes if o.cell.backend == base_name), None)
        over = _speedup_reference(outcomes, base)  # the baseline, or the fastest verified cell when it failed
        rows, curves = [], []
        versions = self.store.meta.setdefault("versions", {})
        for o in outcomes:
            row = schema.cell_columns(o.cell)
            p = o.cell.problem
            # a failed cell's partial samples are kept, but summarised by nothing: no median of a broken run
            stats = Stats.of(o.samples if o.status == "ok" and o.samples else [])
            row.update(status=o.status, error=o.error[-4000:] if o.error else "", compile_s=o.compile_s,
                       peak_rss_mb=o.peak_rss_mb, **stats.as_dict(), baseline=base_name,
                       samples_s=[float(s) for s in (o.samples or [])], samples_block=list(o.blocks or []))
            if o.status == "ok" and stats.n_samples:
                work = "train_step" if p.workload == "train" else p.workload
                row["gflops"] = p.flops(work) / stats.median_s / 1e9
            row.update(self._peak_columns(o.cell))
            row["baseline_status"] = base.status if base is not None else "absent"
            if o.status == "ok" and p.workload != "train" and over is not None and o.samples:
                row["speedup"], row["speedup_lo"], row["speedup_hi"] = paired_speedup(over.samples, o.samples,
                                                                                      blocks=o.blocks)
                row["speedup_over"] = over.cell.backend
            row.update(_precision_columns(o, over, row))
            if o.verify:
                row["verified_ratio"] = o.verify["ratio"]
                _conformance_entry(self.store.meta, o.cell.backend, o.verify)
            if o.data_meta and "loss_floor" in o.data_meta:
                row["loss_floor"] = o.data_meta["loss_floor"]
            if o.versions:
                name = backends.split_name(o.cell.backend)[0]
                versions[name] = o.versions
            if o.worker_env:
                self.store.meta.setdefault("worker_env", {})[o.cell.backend] = o.worker_env
                # a config variable the backend sets itself for its workers (XLA_FLAGS, JAX_PLATFORMS, ...):
                # run.json says the worker got the backend's value, not the config's
                replaced = {k: {"config": v, "worker": o.worker_env.get(k)} for k, v in o.cell.env.items()
                            if o.worker_env.get(k) != v}
                if replaced:
                    self.store.meta.setdefault("env_overridden", {})[o.cell.backend] = replaced
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


def _precision_columns(o: Outcome, base: Outcome | None, row: dict) -> dict:
    """schema.PRECISION_COLUMNS of one timed cell: its speedup's precision against the target (the
    interval the row reports, by the test the stop rule used) and its disturbed rounds, all kept."""
    if o.status != "ok" or not o.samples or o.cell.problem.workload == "train":
        return {}
    target = o.cell.timing.speedup_precision
    mine = measure.disturbed(o.samples)
    cols = dict.fromkeys(schema.PRECISION_COLUMNS)
    processes = o.cell.timing.processes
    cols.update(speedup_precision=target, stop_reason=o.stop_reason, n_disturbed_rounds=sum(mine),
                n_processes=processes, n_passes=len({b // processes for b in o.blocks or []}))
    if o is not base and "speedup" in row:
        n = min(len(base.samples), len(o.samples))
        theirs = measure.disturbed(base.samples)[:n]
        cols["n_disturbed_shared"] = sum(a and b for a, b in zip(mine, theirs))
        cols["n_disturbed_one_sided"] = sum(a != b for a, b in zip(mine, theirs))
        point, lo, hi = row["speedup"], row["speedup_lo"], row["speedup_hi"]
        cols["speedup_half_width"] = measure.half_width(point, lo, hi)
        if target is not None:
            cols["precision_met"] = measure.precision_met(point, lo, hi, n, target)
    return cols


def _speedup_reference(outcomes: list[Outcome], base: Outcome | None) -> Outcome | None:
    """What a group's speedups are measured against: its baseline when that ran (and verified) ok;
    otherwise the fastest cell that did, named on every row (``speedup_over``) and in the summaries."""
    if base is not None and base.status == "ok" and base.samples:
        return base
    ran = [o for o in outcomes if o.status == "ok" and o.samples and o.cell.problem.workload != "train"]
    return min(ran, key=lambda o: statistics.median(o.samples), default=None)


def _conformance_entry(meta: dict, backend: str, verify: dict) -> None:
    """run.json's per-backend summary of the cell checks (a ratio <= 1 is within SPEC bounds)."""
    entry = meta.setdefault("conformance", {}).setdefault(
        backend, {"verified_cells": 0, "mismatches": 0, "worst_ratio": 0.0, "bound": verify["bound"]})
    entry["verified_cells"] += 1
    entry["mismatches"] += 0 if verify["ok"] else 1
    entry["worst_ratio"] = max(entry["worst_ratio"], verify["ratio"])


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
        "task_files": config.task_files, "backend_sources": backend_sources(config.backends),
    }


def backend_sources(names) -> dict:
    """Where each backend's class comes from; a built-in name that ``HARNESS_BACKENDS`` points at another
    class says which class it replaced, so that a run with a swapped backend can be told from a normal one."""
    import backends

    registry = backends.registry()
    out = {}
    for full in names:
        name = backends.split_name(full)[0]
        module, cls = registry.get(name, ("?", "?"))
        entry = {"origin": backends.origin(name), "class": f"{module}:{cls}"}
        if entry["origin"] == "HARNESS_BACKENDS" and name in backends.REGISTRY:
            entry["replaces"] = ":".join(backends.REGISTRY[name])
        out[name] = entry
    return out


def finish_meta(store: RunStore, interrupted: bool = False) -> None:
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
