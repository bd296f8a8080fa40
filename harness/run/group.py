"""A comparison group as one unit of work: its cells, its passes, its stop rule and its
interleaved rounds, run the same way by the local runner, by a Dask task and after ``--resume``.

The cells of one group (same problem, different backends) are timed side by side: each gets
its own warmed worker, and the workers take their rounds in turn (A B C A B C ...), so a drift
of the machine's speed hits every backend alike. With ``timing.passes`` the group is visited
several times with fresh workers (:meth:`GroupRun.run_pass`), and between passes the whole group,
its stop rule included, is kept as plain JSON (:meth:`GroupRun.saved`): a pass run in another
process, on another host or after an interrupt takes it up (:meth:`GroupRun.restore`) and stops
by the same rule.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field

from harness.run import envs, machine, stats
from harness.worker import measure, protocol
from harness.run.client import WorkerFailure, WorkerProcess, close_all, process_environ, worker_settings
from harness.config import Cell, TimingConfig
from harness.spec.errors import HarnessError
from harness.spec.status import Status, StopReason


@dataclass
class Outcome:
    """What happened to one cell."""

    cell: Cell
    status: str = Status.OK
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
    stop_reason: StopReason | None = None  # why the group's interleaved rounds stopped
    blocks: list | None = None  # per round, the (pass, process) block that took it (TimingConfig.round_block)
    processes: list | None = None  # per round, the fresh worker process that took it (TimingConfig.round_process)
    steering: dict | None = None  # its worker's variables that steer a numerical library, with their origins
    blas: list | None = None  # the BLAS libraries its worker loaded and the kernel each ran
    conditions: list | None = None  # what the machine did while its rounds were timed, one entry per pass (guard)
    positions: list | None = None  # per round, its place in the round's order (0: first; measure.round_order)


@dataclass
class GroupRun:
    """A comparison group across its passes: each cell's outcome, its rounds so far and the stop rule."""

    group: list[Cell]
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)  # the timed cells' rounds, all passes
    inner: dict[str, int] = field(default_factory=dict)  # calls per round, calibrated in the first pass
    blocks: list[int] = field(default_factory=list)  # the block of each of the group's rounds, in order
    processes: list[int] = field(default_factory=list)  # the worker process of each of the group's rounds, in order
    timed_s: float = 0.0  # seconds of interleaved rounds so far, all passes (the cap counts them)
    passes_done: int = 0
    wants_pass: bool = False  # the stop rule asked for another pass, and a timed cell is left for it
    rule: stats.StopRule = None  # the group's one stop rule, across its passes
    # (start, end, cell ids) on time.monotonic's clock of each stretch in which cells were timed in this
    # process: what the busy-machine guard reads its samples over (harness.run.guard); not kept between passes
    windows: list = field(default_factory=list)
    name: object = None  # how the progress line names the group, name(cells) (None: its own label)

    def __post_init__(self):
        if self.rule is None:
            self.rule = stats.stop_rule(self.policy)

    @property
    def policy(self) -> TimingConfig:
        return self.group[0].timing

    @property
    def finished(self) -> bool:
        """Visited, and the stop rule wants no further pass (or nothing is left to time)."""
        return self.passes_done > 0 and not self.wants_pass

    @property
    def pending(self) -> set[str] | None:
        """The cells the next pass is for, beside the baseline (None: all): those short of the target."""
        return self.rule.pending

    @property
    def key(self):
        """The group's cell key (its first setting's, under ``pair_over``): what run.json keeps it under."""
        return self.group[0].key

    @property
    def baseline_id(self) -> str | None:
        return next((c.cell_id for c in self.group if c.backend == self.group[0].baseline), None)

    def ordered(self) -> list[Outcome]:
        return [self.outcomes[c.cell_id] for c in self.group]

    # what run.json keeps of a group between its passes, so that --resume goes on where an interrupt stopped it
    _KEPT = ("status", "error", "compile_s", "samples", "peak_rss_mb", "versions", "data_meta", "train",
             "worker_env", "verify", "host", "stop_reason", "blocks", "processes", "steering", "blas", "conditions",
             "positions")

    # what saved() writes and restore() needs
    _SAVED = frozenset({"passes_done", "timed_s", "inner", "blocks", "timed", "rule", "outcomes"})

    def saved(self) -> dict:
        """The group between passes, as plain JSON values (run.json keeps it; a Dask task returns it)."""
        return {"passes_done": self.passes_done, "timed_s": self.timed_s, "inner": self.inner, "blocks": self.blocks,
                "processes": self.processes, "timed": list(self.samples), "rule": self.rule.state(),
                "outcomes": {cid: {k: getattr(o, k) for k in self._KEPT} for cid, o in self.outcomes.items()}}

    @classmethod
    def restore(cls, group: list[Cell], saved: dict | None) -> "GroupRun":
        """The group as :meth:`saved` kept it after its last finished pass (a fresh one without)."""
        state = cls(group)
        cells = {c.cell_id: c for c in group}
        if not saved or not cls._SAVED <= set(saved) or set(saved["outcomes"]) != set(cells):
            return state  # nothing kept, or kept for other cells or in another form: the group starts afresh
        state.outcomes = {cid: Outcome(cells[cid], **kept) for cid, kept in saved["outcomes"].items()}
        state.samples = {cid: state.outcomes[cid].samples or [] for cid in saved["timed"]}
        state.inner, state.blocks = dict(saved["inner"]), list(saved["blocks"])
        # kept by an earlier version: its processes were its blocks (one per process of each pass)
        state.processes = list(saved.get("processes", saved["blocks"]))
        state.timed_s, state.passes_done = float(saved["timed_s"]), int(saved["passes_done"])
        state.rule.restore(saved["rule"])
        state.wants_pass = True  # kept only between passes
        return state

    def run_pass(self, describe=None, record=None) -> list[Outcome]:
        """One pass over the group: fresh warmed workers for the cells being timed, rounds in turn until
        the stop rule ends the pass; the outcomes so far, in the group's order. The first pass also
        screens the cells and runs the training ones. ``describe(text)`` hears what is under way
        (after the label of the group and pass: ``self.name(cells)``, or the group's own); ``record`` lists the
        workers in the run folder."""
        group, policy = self.group, self.policy
        head = group[0]
        paired = {k for k, _ in head.paired}
        dtypes = "|".join(dict.fromkeys(c.problem.dtype for c in group)) if "dtype" in paired else head.problem.dtype
        threads = "|".join(dict.fromkeys(str(c.threads) for c in group)) if "threads" in paired else head.threads
        label = self.name(group) if self.name is not None else \
            f"{head.problem.workload} {head.problem.model.describe()} B={head.problem.batch} {dtypes} threads={threads}"
        if head.problem.workload == "train":  # a training run goes once, whatever the timing's passes
            label += " · training run"
        elif policy.pass_limit > 1:
            most = policy.pass_count if policy.pass_limit == policy.pass_count else f"{policy.pass_count}-{policy.pass_limit}"
            label += f" · pass {self.passes_done + 1} of {most}"

        tell = describe

        def describe(text):  # the backend and its phase first: a narrow terminal cuts the group's label, not them
            if tell is not None:
                tell(f"{text} · {label}")

        first = self.passes_done == 0
        self.wants_pass = False
        pending = self.pending
        workers: dict[str, list[WorkerProcess]] = {}
        # the cells of a group verify from the same parameters and data: the reference's answers are
        # computed by the first and read by the rest (kept for this pass only)
        memo = tempfile.mkdtemp(prefix="harness-reference-") if first else ""
        try:
            for cell in group:
                cid = cell.cell_id
                if first:
                    screened = self._screen(cell)
                    if screened is not None:
                        self.outcomes[cid] = screened
                        continue
                    if cell.problem.workload == "train":
                        began = time.monotonic()
                        self.outcomes[cid] = self._train_cell(cell, describe, record)
                        self.windows.append((began, time.monotonic(), [cid]))
                        continue
                elif cid not in self.samples or self.outcomes[cid].status != Status.OK:
                    continue
                elif pending is not None and cid not in pending and cid != self.baseline_id:
                    continue  # its speedup is already within the target
                started, procs = self._start_processes(cell, describe, record, verify=first, memo=memo)
                if first:
                    self.outcomes[cid] = started
                elif not procs:  # a later pass's fresh process failed where the first did not: the cell failed
                    self.outcomes[cid].status, self.outcomes[cid].error = started.status, started.error
                if procs:
                    workers[cid] = procs
                    self.samples.setdefault(cid, [])
            if workers:
                self._interleave(workers, describe)
        finally:  # after the pass: nothing is timed now, so the workers may exit together
            close_all([w for procs in workers.values() for w in procs])
            if memo:
                shutil.rmtree(memo, ignore_errors=True)
            self.passes_done += 1
            here = machine.host_name()
            for outcome in self.outcomes.values():
                outcome.host = outcome.host or here
        return self.ordered()

    def _start_processes(self, cell: Cell, describe, record, verify: bool = True,
                         memo: str = "") -> tuple[Outcome, list[WorkerProcess]]:
        """The cell's warmed workers of a pass (TimingConfig.processes_per_pass: ``timing.processes``, or more for
        ``min_processes``; the first one verified, if ``verify``), each paused as soon as it is ready, so that
        the next one's start and compile time are taken alone too."""
        n = cell.timing.processes_per_pass
        procs: list[WorkerProcess] = []
        outcome = None
        for k in range(n):
            say = describe if n == 1 else (lambda text, k=k: describe(f"{text} (process {k + 1} of {n})"))
            worker, started = self._start(cell, say, record, verify=verify and k == 0, memo=memo)
            if outcome is None:
                outcome = started
            elif worker is None:  # a later process failed where the first did not: the cell failed
                outcome.status, outcome.error = started.status, started.error
            if worker is None:
                for w in procs:
                    w.close()
                return outcome, []
            worker.pause()
            procs.append(worker)
        return outcome, procs

    def _train_cell(self, cell: Cell, describe, record) -> Outcome:
        worker, outcome = self._start(cell, describe, record)
        if worker is None:
            return outcome
        try:
            describe(f"{cell.backend}: training")
            budget = cell.train.time_budget_s
            timeout = cell.timing.timeout_s + (3 * budget if budget else 0)
            result = worker.request(protocol.Train(protocol.TrainSettings.of(cell.train, cell.seed)), timeout)
            trained = result.body
            outcome.train = asdict(trained)  # kept in run.json between passes, made into rows and curves
            outcome.samples = trained.step_samples
            outcome.peak_rss_mb = result.peak_rss_mb
            if trained.status != Status.OK:
                outcome.status, outcome.error = trained.status, str(trained.stop)
        except WorkerFailure as exc:
            outcome.status, outcome.error = exc.status, str(exc)
        finally:
            worker.close()
        return outcome

    def _interleave(self, workers: dict[str, list[WorkerProcess]], describe) -> None:
        """One pass of rounds of the group's warmed workers in turn, until the stop rule ends it. With
        several processes per cell, round ``i`` of the pass runs in the cell's process ``i % processes_per_pass``.
        The cells take each round in the order :func:`harness.worker.measure.round_order` gives the group's
        round (counted over all passes), and each cell's place in it is recorded."""
        group, policy = self.group, self.policy
        rule, outcomes, samples, inner = self.rule, self.outcomes, self.samples, self.inner
        base = self.baseline_id
        alive = dict(workers)

        def fail(cid, exc):
            outcomes[cid].status, outcomes[cid].error = exc.status, str(exc)
            for w in alive.pop(cid):
                w.close()

        def alone(cid, k: int = 0) -> WorkerProcess:
            """cid's k-th worker, with every other worker of the group paused while it is timed."""
            me = alive[cid][k]
            for procs in alive.values():
                for w in procs:
                    if w is not me:
                        w.pause()
            me.resume()
            return me

        rounds_s = 0.0  # this pass's seconds of rounds (the cap counts them, not the stop rule's own arithmetic)
        began = None  # when the pass's rounds began (the machine's conditions are read over that window)
        positions = {cid: list(outcomes[cid].positions or []) for cid in workers}
        try:
            for cid in list(alive):
                if cid in inner:  # calibrated in an earlier pass: every pass runs the same rounds
                    continue
                try:  # the processes of a cell run the same code on the same data: one calibration
                    inner[cid] = alone(cid).request(protocol.Calibrate(policy.target_round_s), policy.timeout_s).body.inner
                except WorkerFailure as exc:
                    fail(cid, exc)
            rule.start_pass(self.passes_done, {c: samples[c] for c in alive})
            began = time.monotonic()
            n_round = 0

            settled = {c: s for c, s in samples.items() if c not in alive and outcomes[c].status == Status.OK}

            def done() -> bool:
                return rule.done({c: samples[c] for c in alive}, {c: inner[c] for c in alive},
                                 base if base in alive else None, self.timed_s + rounds_s,
                                 self.blocks, settled)

            while alive and not done():
                describe(f"round {n_round + 1} ({', '.join(c.backend for c in group if c.cell_id in alive)})")
                order = measure.round_order(list(alive), len(self.blocks))
                self.blocks.append(policy.round_block(self.passes_done, n_round))
                self.processes.append(policy.round_process(self.passes_done, n_round))
                k = n_round % policy.processes_per_pass
                n_round += 1
                start = measure.clock_ns()
                for place, cid in enumerate(order):
                    if cid not in alive:
                        continue
                    positions.setdefault(cid, []).append(place)
                    try:
                        reply = alone(cid, k).request(protocol.Rounds(1, inner[cid]), policy.timeout_s)
                        samples[cid] += reply.body.samples
                        outcomes[cid].peak_rss_mb = max(outcomes[cid].peak_rss_mb or 0.0, reply.peak_rss_mb or 0.0)
                    except WorkerFailure as exc:
                        fail(cid, exc)
                rounds_s += measure.elapsed_s(start)
        finally:
            self.timed_s += rounds_s
            if began is not None:
                self.windows.append((began, time.monotonic(), list(workers)))
            for procs in alive.values():
                for w in procs:
                    w.resume()
        self.wants_pass = rule.reason == StopReason.PASS and bool(alive)
        for cid in workers:
            outcomes[cid].samples = samples[cid]
            outcomes[cid].blocks = self.blocks[:len(samples[cid])]
            outcomes[cid].processes = self.processes[:len(samples[cid])]
            outcomes[cid].positions = positions.get(cid, [])[:len(samples[cid])]
            met = rule.pending is not None and cid not in rule.pending and cid != base  # its own target
            outcomes[cid].stop_reason = StopReason.TARGET if met else rule.reason

    @staticmethod
    def _screen(cell: Cell) -> Outcome | None:
        """Availability and support, decided in this process without importing heavy libraries."""
        import backends
        from backends.base import screen

        try:
            status, why = screen(backends.create(cell.ref), cell.problem)
        except HarnessError as exc:
            return Outcome(cell, Status.UNAVAILABLE, str(exc))
        return None if status == Status.OK else Outcome(cell, status, why)

    @staticmethod
    def _start(cell: Cell, describe, record=None, verify: bool = True,
               memo: str = "") -> tuple[WorkerProcess | None, Outcome]:
        import backends

        outcome = Outcome(cell)
        p = cell.problem
        try:
            environment = backends.environment_of(cell.ref)
            if environment and envs.env_python(environment) is None:
                describe(f"creating isolated environment {environment!r} (first use)")
            # built before its settings are read: the first cell gets the BLAS and core type it chose, as every later one
            environment, settings = worker_settings(cell.ref, p.device, p.dtype, cell.threads, cell.env,
                                                    cell.fix_blas_kernel, cell.clean_env)
            env, outcome.steering = process_environ(environment, settings, cell.env, cell.clean_env)
            worker = WorkerProcess(environment, env, cell.ref.full, recorded=settings, record=record)
        except HarnessError as exc:
            outcome.status, outcome.error = Status.UNAVAILABLE, str(exc)
            return None, outcome
        outcome.worker_env = worker.env
        timing = cell.timing
        try:
            describe(f"{cell.backend}: starting")
            init = worker.request(protocol.Init(cell.ref.full, p.to_mapping(), cell.task.to_mapping(), cell.seed,
                                                cell.train.lr), timing.timeout_s)
            outcome.versions, outcome.data_meta, outcome.blas = init.body.versions, init.body.data_meta, init.body.blas
            describe(f"{cell.backend}: compiling / warming up")
            # training must start from the shared initial parameters: compile only, no warm steps; a
            # verified cell is checked from them too (its warm steps follow), so the group's cells share
            # one reference answer through ``memo``
            checks = p.workload != "train" and timing.verify and verify
            n_warm = 0 if p.workload == "train" or checks else timing.warmup
            warm = worker.request(protocol.WarmUp(n_warm), timing.timeout_s)
            outcome.compile_s, outcome.peak_rss_mb = warm.body.compile_s, warm.peak_rss_mb
            if checks:
                describe(f"{cell.backend}: verifying against the reference")
                outcome.verify = asdict(worker.request(protocol.Verify(memo), timing.timeout_s).body)
                if not outcome.verify["ok"]:
                    v = outcome.verify
                    raise WorkerFailure(Status.MISMATCH, f"does not match the reference on this cell: {v['worst']} "
                                                    f"off by {v['ratio']:.3g}x the bound {v['bound']}")
                if timing.warmup:
                    describe(f"{cell.backend}: warming up")
                    warm = worker.request(protocol.WarmUp(timing.warmup, compile=False), timing.timeout_s)
                    outcome.peak_rss_mb = warm.peak_rss_mb
        except WorkerFailure as exc:
            outcome.status, outcome.error = exc.status, str(exc)
            worker.close()
            return None, outcome
        return worker, outcome
