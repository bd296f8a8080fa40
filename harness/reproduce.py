"""``harness reproduce``: every experiment of ``docs/experiments.md`` that this machine can run,
within a time budget, resumable.

An experiment is a shipped config (one that a section heading of the experiments page names),
plain or with one of the profiles that need other hardware (``gpu``: a GPU; ``many-cores``: at
least :data:`MANY_CORES` cores). :func:`plan` decides, from the machine's facts alone, what runs
here and in which order: first what this machine can answer that the committed runs under
``results/examples/`` cannot (GPU, then many cores), then the rest, shortest first. Each
experiment's time is estimated from its committed run's ``run.json`` (start to finish), scaled by
cell count for a profile that has no run of its own. :func:`run_plan` runs the plan, one
``harness run`` process per experiment into ``OUT/<experiment>``, skipping (with the reason) what
the budget left cannot hold, and stopping an experiment that overruns the budget by more than
:data:`OVERRUN` so that a second call resumes it (``harness run --resume``). What a call decided
and did is kept in ``OUT/reproduce.json``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import shutil
import sys
import tarfile
import tempfile
import textwrap
import time
import zlib
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path

from harness.spec import writes
from harness.spec.errors import HarnessError
from harness.worker import lifeline

PROJECT_ROOT = Path(__file__).resolve().parents[1]
#: profiles that ask for hardware beyond a small CPU machine: (profile, what it needs)
HARDWARE_PROFILES = ("gpu", "many-cores")
#: cores from which a machine runs the ``many-cores`` profiles
MANY_CORES = 8
#: an experiment still running this far past the budget is stopped (it resumes on the next call)
OVERRUN = 0.10
#: a first build of an isolated environment (the estimate adds it where the environment is missing)
ENV_BUILD_S = 120.0
#: a worker's start, compile and verification, per cell and device, where no committed run gives a better figure
CELL_START_S = {"cpu": 4.0, "gpu": 8.0}
#: a training cell without a time budget of its own
TRAIN_CELL_S = 60.0
#: the GPU conformance check before the experiments: at most this long, the most telling backends first
GPU_CHECK_S = 120.0
#: the order of the GPU conformance check: the backends the GPU experiments time, the cuda variants'
#: default first; any other GPU backend follows, torch:compile (a compile per case) last
GPU_CHECK_ORDER = ("cuda", "torch:fused", "jax", "torch", "cuda:persistent", "cuda:fused", "cuda:streams",
                   "cuda:grouped", "cuda:naive")
#: the GPU experiments by what they answer: the seed's GPU LSTM ablation (the reason the cuda backend
#: exists), the CPU-versus-GPU crossover, mixed precision, then the default job; any other after these
GPU_ORDER = ("lstm_gpu", "lstm_cpu_gpu", "mixed_precision", "quick")
RECORD = "reproduce.json"
GPU_CHECK = "check-gpu.jsonl"
#: the longest a wait for an experiment goes without reading the clock again
WAIT_SLICE_S = 1.0


@dataclass(frozen=True)
class MachineFacts:
    """What decides which experiments run: cores and GPUs (names as nvidia-smi gives them)."""

    cores: int
    gpus: tuple[str, ...] = ()

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @classmethod
    def here(cls) -> "MachineFacts":
        from harness.run.machine import gpu_info

        return cls(cores=os.cpu_count() or 1, gpus=tuple(gpu_info()))

    def describe(self) -> str:
        gpu = ", ".join(self.gpus) if self.gpus else "no GPU"
        return f"{self.cores} cores, {gpu}"


@dataclass
class Experiment:
    """One config, plain or with a hardware profile."""

    config: Path
    profile: str | None = None
    cells: int = 0
    devices: frozenset = frozenset()
    environments: frozenset = frozenset()  # isolated environments its backends run in
    floor_s: float = 0.0  # what its cells should take by their settings alone (:func:`cell_seconds`)
    fingerprint: str | None = None  # its config's (harness.results.store.config_fingerprint): a run of it has this

    @property
    def name(self) -> str:
        return self.config.stem + (f"-{self.profile}" if self.profile else "")

    @property
    def label(self) -> str:
        return f"{self.config.as_posix()}" + (f" --profile {self.profile}" if self.profile else "")


@dataclass
class Decision:
    """Whether an experiment runs here, why, and how long it should take."""

    name: str
    config: str
    profile: str | None
    runs: bool
    why: str
    estimate_s: float | None
    basis: str
    tier: int  # 0 GPU, 1 many cores, 2 a config's GPU cells, 3 no committed run, 4 a re-measurement
    state: str = "new"  # new | resume | done (a finished run in the output folder) | foreign (another config's)
    skipped_for_budget: bool = False

    def line(self) -> str:
        est = f"~{self.estimate_s / 60:.1f} min" if self.estimate_s is not None else "~? min"
        verdict = "runs here" if self.runs else "skipped"
        return f"{self.config}{' --profile ' + self.profile if self.profile else ''}: {verdict}: {self.why}; {est} ({self.basis})"


#: the narrowest terminal the plan is laid out for (a ``COLUMNS`` below it is taken as this)
MIN_COLUMNS = 80


def fit(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` columns (:data:`MIN_COLUMNS` at least), broken between words,
    the later ones indented, so that no terminal wraps a line of the plan mid-word; a single word wider than
    that (a long path) stays whole, to be copied."""
    return textwrap.wrap(text, max(int(width), MIN_COLUMNS), subsequent_indent="    ", break_long_words=False,
                         break_on_hyphens=False) or [""]


# -- what the experiments are ----------------------------------------------------------------
def covered_configs(root: Path = PROJECT_ROOT) -> list[Path]:
    """The configs that the experiments page covers: those named in its section headings, in page order."""
    page = root / "docs" / "experiments.md"
    if not page.exists():
        raise HarnessError(f"{page}: not found (the experiments page lists the experiments to reproduce)")
    found: list[Path] = []
    for line in page.read_text().splitlines():
        if line.startswith("## "):
            for stem in re.findall(r"`configs/([\w.-]+)\.yaml`", line):
                path = Path("configs") / f"{stem}.yaml"
                if path not in found and (root / path).exists():
                    found.append(path)
    return found


def _profiles(path: Path) -> list[str]:
    import yaml

    names: list[str] = []
    try:
        for doc in yaml.safe_load_all(path.read_text()):
            for name in ((doc or {}).get("profiles") or {}):
                if name not in names:
                    names.append(name)
    except (OSError, yaml.YAMLError) as exc:
        raise HarnessError(f"{path}: {exc}") from exc
    return names


def experiments(root: Path = PROJECT_ROOT, configs: list[Path] | None = None) -> list[Experiment]:
    """Every experiment of the covered configs, with its cells' count, devices and environments."""
    import backends
    from harness.config import config_fingerprint, load_config

    out = []
    for rel in configs if configs is not None else covered_configs(root):
        path = root / rel
        for profile in [None] + [p for p in _profiles(path) if p in HARDWARE_PROFILES]:
            cfg = load_config(path, None, profile)
            cells = cfg.cells()
            envs = set()
            for cell in cells:
                try:
                    env = backends.environment_of(cell.ref)
                except Exception:  # an unknown backend is the run's to report
                    env = None
                if env:
                    envs.add(env)
            out.append(Experiment(Path(rel), profile, len(cells), frozenset(c.problem.device for c in cells),
                                  frozenset(envs), floor_s=sum(cell_seconds(c) for c in cells),
                                  fingerprint=config_fingerprint(cfg)))
    return out


def cell_seconds(cell) -> float:
    """One cell's time by its settings: its worker's start (compile and verification included) and its
    share of the timed rounds (the floor; midway to the cap when a precision target may keep it going),
    each pass; a training cell its time budget."""
    t = cell.timing
    start = CELL_START_S.get(cell.problem.device, CELL_START_S["cpu"])
    if cell.problem.workload == "train":
        return start + (cell.train.time_budget_s or TRAIN_CELL_S)
    timed = (t.min_time_s + t.max_time_s) / 2 if t.speedup_precision else t.min_time_s
    return (start * t.processes_per_pass + timed) * t.pass_count


# -- estimates -------------------------------------------------------------------------------
def _duration(meta: dict) -> float | None:
    try:
        start = datetime.fromisoformat(meta["started"])
        end = datetime.fromisoformat(meta["finished"])
    except (KeyError, TypeError, ValueError):
        return None
    seconds = (end - start).total_seconds()
    return seconds if seconds > 0 else None


def _read_meta(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "run.json").read_text())
    except (OSError, ValueError):
        return None


def committed_durations(examples: Path) -> dict[str, tuple[float, int, dict]]:
    """Per committed run folder: (seconds from start to finish, cells, machine)."""
    found = {}
    if examples.is_dir():
        for folder in sorted(p for p in examples.iterdir() if p.is_dir()):
            meta = _read_meta(folder)
            seconds = _duration(meta) if meta else None
            if seconds:
                found[folder.name] = (seconds, len(meta.get("cells") or {}), meta.get("machine") or {})
    return found


def estimate(exp: Experiment, committed: dict, by_name: dict[str, Experiment]) -> tuple[float, str]:
    """Seconds the experiment should take, and what the figure rests on."""
    if exp.name in committed:
        seconds, _, machine = committed[exp.name]
        where = f"{machine.get('cores', '?')} cores" + (", GPU" if machine.get("gpus") else "")
        return seconds, f"its committed run, {where}"
    base = by_name.get(exp.config.stem)
    if exp.profile and base is not None and base.name in committed and base.cells:
        if _is_gpu(exp) and not committed[base.name][2].get("gpus"):
            # a CPU run's minutes say nothing of a GPU's: its cells' settings do
            return exp.floor_s, f"{exp.cells} cells by their timing settings (its committed run had no GPU)"
        seconds = committed[base.name][0] * exp.cells / base.cells
        return seconds, f"committed {base.name} run scaled to {exp.cells} cells"
    return exp.floor_s, f"no committed run: {exp.cells} cells by their timing settings"


# -- the plan --------------------------------------------------------------------------------
def _is_gpu(exp: Experiment) -> bool:
    """Whether the experiment needs a GPU: its ``gpu`` profile, or a config whose every cell is a GPU one."""
    return exp.profile == "gpu" or exp.devices == {"gpu"}


def _needs(exp: Experiment, machine: MachineFacts) -> str | None:
    """Why the experiment cannot run on this machine, or None."""
    if _is_gpu(exp) and not machine.has_gpu:
        return "needs a GPU (none here)"
    if exp.profile == "many-cores" and machine.cores < MANY_CORES:
        return f"needs >= {MANY_CORES} cores ({machine.cores} here)"
    return None


def _tier(exp: Experiment, machine: MachineFacts, committed: dict) -> tuple[int, str]:
    if _is_gpu(exp):
        return 0, "GPU: " + ("re-measures its committed GPU run" if exp.name in committed else "the committed runs have none")
    if exp.profile == "many-cores":
        return 1, f"{machine.cores} cores: the committed runs had 2"
    if "gpu" in exp.devices and machine.has_gpu:
        return 2, "its GPU cells: the committed run had no GPU"
    if exp.name not in committed:
        return 3, "no committed run"
    return 4, "re-measures its committed run here"


def _progress(folder: Path, exp: Experiment, read_run=None) -> tuple[str, float]:
    """State of the experiment's run folder: ``new``, ``resume``, ``done`` or ``foreign`` (a run of another
    config: :func:`_foreign`), and the share of cells left. ``read_run(folder)`` gives a run's run.json
    (the results layer's reader, which raises on a damaged run); without it run.json alone is read."""
    if not (folder / "run.json").exists():
        return "new", 1.0
    meta = _read_meta(folder) if read_run is None else read_run(folder)
    if meta is None:
        return "new", 1.0
    if _foreign(meta, exp):
        return "foreign", 0.0
    if meta.get("finished") and not meta.get("interrupted"):
        return "done", 0.0
    done = sum(1 for s in (meta.get("cells") or {}).values() if s)
    return "resume", max(0.0, 1.0 - done / exp.cells) if exp.cells else 1.0


def _foreign(meta: dict, exp: Experiment) -> str | None:
    """Why the run of ``meta`` is not one of ``exp`` (None when its config fingerprint is the experiment's)."""
    got = meta.get("config_fingerprint")
    if exp.fingerprint is None or got == exp.fingerprint:
        return None
    what = f"a run of another config (fingerprint {got})" if got else "a run that records no config fingerprint"
    return f"{what}, not of {exp.label} ({exp.fingerprint})"


def plan(machine: MachineFacts, out: Path, examples: Path, budget_s: float | None = None,
         only: list[str] | None = None, exps: list[Experiment] | None = None,
         env_exists=None, spent_s: float = 0.0, check_gpu: bool = True, read_run=None) -> list[Decision]:
    """What runs here, in order, with the reason for everything that does not (dry-run and real run alike).
    On a GPU machine the budget keeps :data:`GPU_CHECK_S` for the conformance check that comes first.
    ``read_run``: how a run folder in ``out`` is read (see :func:`_progress`)."""
    exps = experiments() if exps is None else exps
    if only:
        known = {e.name for e in exps} | {e.config.stem for e in exps}
        unknown = [n for n in only if n not in known]
        if unknown:
            raise HarnessError(f"--only: no experiment {', '.join(unknown)} (known: {', '.join(e.name for e in exps)})")
        exps = [e for e in exps if e.name in only or (e.config.stem in only and e.profile is None)
                or (e.config.stem in only and e.profile is not None and not _needs(e, machine))]
    if env_exists is None:
        from harness.spec.environments import env_python

        env_exists = lambda name: env_python(name) is not None  # noqa: E731
    committed = committed_durations(examples)
    by_name = {e.name: e for e in exps}
    decisions = []
    for exp in exps:
        seconds, basis = estimate(exp, committed, by_name)
        tier, new = _tier(exp, machine, committed)
        state, left = _progress(out / exp.name, exp, read_run)
        seconds *= left
        if state == "resume":
            basis += f", {left:.0%} of its cells left"
        missing = sorted(e for e in exp.environments if not env_exists(e))
        why = _needs(exp, machine)
        if why is None and missing and state not in ("done", "foreign"):
            seconds += ENV_BUILD_S * len(missing)
            basis += f", + building the {', '.join(missing)} environment"
        runs = why is None and state not in ("done", "foreign")
        if state == "done":
            why = f"done: finished run in {out / exp.name}"
        elif state == "foreign":
            why = f"{out / exp.name} holds {_foreign(_read_meta(out / exp.name) or {}, exp)}: move it away to run it"
        elif why is None:
            why = new + (" (resumes)" if state == "resume" else "")
        decisions.append(Decision(exp.name, exp.config.as_posix(), exp.profile, runs, why, seconds, basis, tier, state))
    decisions.sort(key=lambda d: (not d.runs, d.tier, _gpu_rank(d), d.estimate_s or 0.0))
    if budget_s is not None:
        left = budget_s - spent_s - (GPU_CHECK_S if machine.has_gpu and check_gpu else 0.0)
        for d in decisions:
            if not d.runs:
                continue
            if d.estimate_s > left:
                d.runs, d.skipped_for_budget = False, True
                d.why = f"out of budget: needs ~{d.estimate_s / 60:.1f} min, {max(left, 0) / 60:.1f} min of the budget left"
            else:
                left -= d.estimate_s
    return decisions


def _gpu_rank(d: Decision) -> int:
    """Where a GPU experiment comes among the GPU ones (:data:`GPU_ORDER`); 0 for the rest."""
    if d.tier != 0:
        return 0
    stem = Path(d.config).stem
    return GPU_ORDER.index(stem) if stem in GPU_ORDER else len(GPU_ORDER)


# -- running it ------------------------------------------------------------------------------
def _set_parent_death_signal() -> None:
    """In the child, before exec: Ctrl-C stops it even when this process was started with SIGINT ignored
    (in the background), and SIGTERM (which ``harness run`` treats as Ctrl-C: it saves and exits,
    resumable) reaches it when this process dies."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    lifeline.parent_death_signal(signal.SIGTERM)


def _harness(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "harness.cli", *args]


def run_command(d: Decision, out: Path) -> list[str]:
    """The ``harness run`` command of one experiment: a new run, or ``--resume`` of its folder."""
    # absolute: the child runs in the project's folder, and its interrupt hint must hold from anywhere
    args = ["run", str(PROJECT_ROOT / d.config)]
    if d.profile:
        args += ["--profile", d.profile]
    folder = (out / d.name).absolute()
    args += ["--resume", str(folder)] if d.state == "resume" else ["--out", str(folder)]
    return _harness(args)


def _wait(proc: subprocess.Popen, deadline: float | None, clock=time.monotonic) -> tuple[int, bool]:
    """The child's exit code, and whether it was stopped at the deadline (SIGTERM: it saves and exits).

    The deadline is on ``clock``'s scale, read at least once a second (a test passes a clock it moves itself)."""
    while True:
        timeout = None if deadline is None else min(max(0.0, deadline - clock()), WAIT_SLICE_S)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            if clock() < deadline:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=120), True
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait(), True


class Record:
    """``OUT/reproduce.json``: the machine, each call's plan and what each experiment did."""

    def __init__(self, out: Path, machine: MachineFacts):
        self.path = out / RECORD
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.data.setdefault("experiments", {})
        self.data.setdefault("calls", [])
        self.data["machine"] = {"cores": machine.cores, "gpus": list(machine.gpus)}

    def save(self) -> None:
        """Write the record, merged with what another call into the same folder wrote since (under a lock):
        two calls at once each keep their calls and experiments."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with writes.open_private(self.path.with_name(f".{RECORD}.lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                on_disk = json.loads(self.path.read_text())
            except (OSError, ValueError):
                on_disk = {}
            mine = {c.get("started") for c in self.data["calls"]}
            theirs = [c for c in on_disk.get("calls") or [] if isinstance(c, dict) and c.get("started") not in mine]
            self.data["calls"] = sorted(theirs + self.data["calls"], key=lambda c: str(c.get("started")))
            for name, entry in (on_disk.get("experiments") or {}).items():
                self.data["experiments"].setdefault(name, entry)
            writes.write_file(self.path, json.dumps(self.data, indent=2, default=str))


def gpu_backends() -> list[str]:
    """Every available backend (name:variant) with a GPU device, in :data:`GPU_CHECK_ORDER`."""
    import backends

    names = [r.full_name for r in backends.list_backends() if r.available and "gpu" in r.devices]
    rank = {n: k for k, n in enumerate(GPU_CHECK_ORDER)}
    return sorted(names, key=lambda n: (n == "torch:compile", rank.get(n, len(rank))))


def gpu_check(out: Path, record: Record, say, deadline: float | None, names: list[str] | None = None,
              clock=time.monotonic) -> None:
    """``harness check --device gpu --quick`` of every GPU backend, one backend at a time in
    :data:`GPU_CHECK_ORDER`, within :data:`GPU_CHECK_S` (and the budget), once per output folder; each
    backend's cases are kept in ``OUT/check-gpu.jsonl`` as it finishes, and what the time left
    unchecked is named (each timed cell is verified against the reference before its rounds anyway).
    The time is on ``clock``'s scale (:func:`_wait`)."""
    kept = record.data.get("gpu_check", {})
    if kept.get("finished"):
        say(f"GPU check: done earlier ({out / GPU_CHECK})")
        return
    names = gpu_backends() if names is None else names
    if not names:
        record.data["gpu_check"] = {"backends": [], "finished": True, "note": "no available backend has a GPU device"}
        record.save()
        say("GPU check: no available backend has a GPU device")
        return
    started = clock()
    stop_at = started + GPU_CHECK_S if deadline is None else min(deadline, started + GPU_CHECK_S)
    exit_codes: dict[str, int] = dict(kept.get("exit_codes") or {})
    todo = [n for n in names if n not in exit_codes]
    say(f"GPU check: {len(todo)} backends, at most {GPU_CHECK_S:.0f} s: {', '.join(todo)}")
    unchecked: list[str] = []
    for k, name in enumerate(todo):
        if clock() >= stop_at:
            unchecked = todo[k:]
            break
        cmd = _harness(["check", "--backends", name, "--device", "gpu", "--quick", "--json"])
        with writes.open_private(out / f"{GPU_CHECK}.part", "w") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, cwd=PROJECT_ROOT, preexec_fn=_set_parent_death_signal)
            rc, stopped = _wait(proc, stop_at, clock)
        if stopped:
            unchecked = todo[k:]
            break
        with writes.open_private(out / GPU_CHECK, "a") as sink:
            sink.write((out / f"{GPU_CHECK}.part").read_text())
        exit_codes[name] = rc
        say(f"GPU check: {name}: {'passed' if rc == 0 else f'exit code {rc}, see ' + str(out / GPU_CHECK)}")
    (out / f"{GPU_CHECK}.part").unlink(missing_ok=True)
    record.data["gpu_check"] = {"backends": names, "exit_codes": exit_codes, "unchecked": unchecked,
                                "seconds": round(clock() - started, 1) + float(kept.get("seconds") or 0),
                                "finished": not unchecked, "file": GPU_CHECK}
    record.save()
    if unchecked:
        say(f"GPU check: out of its {GPU_CHECK_S:.0f} s, not checked: {', '.join(unchecked)} (the next call goes on)")


class ExperimentStatus(str, Enum):
    """How one experiment's run ended: ``finished`` (every cell), ``failed`` (its command failed or left
    cells unfinished), ``stopped`` (at the end of the budget; the next call resumes it) or ``interrupted``."""

    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:
        return self.value


@dataclass
class ExperimentRun:
    """One experiment's run in a call of ``harness reproduce`` (a cell's outcome is ``run.group.Outcome``)."""

    name: str
    status: ExperimentStatus
    seconds: float
    exit_code: int | None = None
    notes: list[str] = field(default_factory=list)


def run_plan(decisions: list[Decision], out: Path, machine: MachineFacts, budget_s: float | None,
             say=print, check_gpu: bool = True, clock=time.monotonic) -> list[ExperimentRun]:
    """Run what the plan says, in its order; re-plan the budget against the clock before each one.

    ``clock`` (seconds, monotonic) is what the budget is measured on."""
    out.mkdir(parents=True, exist_ok=True)
    record = Record(out, machine)
    call = {"started": datetime.now(timezone.utc).isoformat(), "budget_min": budget_s / 60 if budget_s else None,
            "plan": [asdict(d) for d in decisions]}
    record.data["calls"].append(call)
    record.save()
    t0 = clock()
    deadline = None if budget_s is None else t0 + budget_s * (1 + OVERRUN)
    outcomes: list[ExperimentRun] = []
    try:
        if check_gpu and machine.has_gpu:
            gpu_check(out, record, say, deadline, clock=clock)
        for d in decisions:
            if not d.runs:
                continue
            left = None if budget_s is None else budget_s - (clock() - t0)
            if left is not None and d.estimate_s > left:
                d.runs, d.skipped_for_budget = False, True
                d.why = f"out of budget: needs ~{d.estimate_s / 60:.1f} min, {max(left, 0) / 60:.1f} min of the budget left"
                say(f"skip {d.name}: {d.why}")
                record.data["experiments"][d.name] = {**record.data["experiments"].get(d.name, {}), "last": d.why}
                continue
            cmd = run_command(d, out)
            say(f"== {d.name}: {' '.join(cmd[3:])} (~{d.estimate_s / 60:.1f} min)")
            started = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, preexec_fn=_set_parent_death_signal)
            try:
                rc, stopped = _wait(proc, deadline, clock)
            except KeyboardInterrupt:
                rc, stopped = _wait(proc, clock(), clock)  # saves and exits (Ctrl-C reached it too)
                outcomes.append(ExperimentRun(d.name, ExperimentStatus.INTERRUPTED, time.monotonic() - started, rc))
                _keep(record, d, outcomes[-1])
                raise
            done = _progress(out / d.name, Experiment(Path(d.config), d.profile))[0] == "done"
            status = (ExperimentStatus.STOPPED if stopped else ExperimentStatus.FINISHED if rc == 0 and done
                      else ExperimentStatus.FAILED)
            outcomes.append(ExperimentRun(d.name, status, time.monotonic() - started, rc))
            _keep(record, d, outcomes[-1])
            if stopped:
                say(f"{d.name}: stopped at the end of the budget; what finished is saved, the next call resumes it")
                break
    finally:
        call["finished"] = datetime.now(timezone.utc).isoformat()
        call["seconds"] = round(clock() - t0, 1)
        call["outcomes"] = [asdict(o) for o in outcomes]
        record.save()
    return outcomes


def _keep(record: Record, d: Decision, o: ExperimentRun) -> None:
    entry = record.data["experiments"].setdefault(d.name, {"config": d.config, "profile": d.profile, "seconds": 0.0})
    entry["seconds"] = round(entry.get("seconds", 0.0) + o.seconds, 1)
    entry.update({"status": o.status, "exit_code": o.exit_code, "estimate_s": round(d.estimate_s or 0, 1),
                  "folder": d.name, "last": datetime.now(timezone.utc).isoformat()})
    record.save()


def archive(out: Path, path: Path, exps: list[Experiment] | None = None, note=None) -> list[str]:
    """The finished run folders of ``out`` in one gzipped tar at ``path``, each under its experiment's
    name, as ``results/examples/`` names the committed runs: ``harness unpack FILE`` (:func:`unpack`), then
    ``harness docs``, fills the tables from them. Interrupted and unfinished runs stay out. It holds regular
    files and folders only: a run folder that is a symbolic link, and a link, device or FIFO inside a run,
    are left out, each named to ``note``. Written by the one write rule (:mod:`harness.spec.writes`).
    Returns the names of the runs it holds."""
    note = note or (lambda line: None)
    exps = experiments() if exps is None else exps
    names = []
    for e in exps:
        folder = out / e.name
        if folder.is_symlink():  # packed as a bare link it would carry no data, and followed, anyone's files
            note(f"left out {e.name}: a symbolic link to {os.readlink(folder)}, not a run folder of {out}")
        elif folder.is_dir() and _progress(folder, e)[0] == "done":
            names.append(e.name)

    def member(m: tarfile.TarInfo):
        if Path(m.name).name == ".lock":  # the writing run's lock, not part of the run
            return None
        if not (m.isfile() or m.isdir()):
            what = "a symbolic link" if m.issym() else "a hard link" if m.islnk() else "not a regular file"
            note(f"left out {m.name}: {what}")
            return None
        return m

    def pack(tmp: Path) -> None:
        with tarfile.open(tmp, "w:gz") as tar:
            for name in names:
                tar.add(out / name, arcname=name, filter=member)

    writes.write_file(path, pack, "--archive")
    return names


#: the most bytes one member of an archive of runs may hold, and all its members together (a run's tables and
#: plots are megabytes; a member past this is no run's, and is refused before a byte of it is written)
UNPACK_MEMBER_BYTES = 1 << 30
UNPACK_TOTAL_BYTES = 4 << 30
#: what a run writes at the top of its folder: an existing run folder holding anything else (a user's notes)
#: is not replaced by :func:`unpack`
RUN_ENTRIES = ("run.json", "timings.parquet", "curves.parquet", "report.md", "report.html", "plots", ".lock",
               lifeline.WORKERS_FILE)


def unpack(path: Path, into: Path) -> list[str]:
    """The runs of an archive that ``--archive`` made, each into ``into/<run>`` (``results/examples``): the
    archive a regular file; its members only regular files and folders, each under a run's name (a plain
    folder name), no absolute path, no ``..``, no link of any kind, no name twice, none past
    :data:`UNPACK_MEMBER_BYTES`. Each run goes only where nothing is or over a run folder that holds nothing
    a run does not write (:func:`_check_place`): never over a folder that is not a run, or a user's file.
    Each run is streamed into a folder beside its target, checked as a run (``run.json`` and its tables),
    then replaces the folder of that name whole. Nothing is written when anything is refused, and no
    staging folder outlives the call. Returns the run names."""
    from harness.results.store import read_folder

    into = _into_folder(into)
    staged: dict[str, Path] = {}
    try:
        with _open_archive(path) as raw:
            try:
                with tarfile.open(fileobj=raw, mode="r:*") as tar:
                    runs = _runs_of(path, tar.getmembers())
                    for run in runs:
                        _check_place(into, run)
                    for run, ms in runs.items():
                        staged[run] = _stage(tar, path, into, run, ms, read_folder)
            except (OSError, tarfile.TarError, EOFError, zlib.error) as exc:
                raise HarnessError(f"{path}: not a readable archive ({getattr(exc, 'strerror', None) or exc})") from None
        for run, folder in staged.items():
            _check_place(into, run)  # again, just before the swap: what may have appeared meanwhile
            _replace(into, run, folder)
    finally:
        for folder in staged.values():
            shutil.rmtree(folder, ignore_errors=True)
    return list(staged)


def _into_folder(into: Path) -> Path:
    """``--into`` as :func:`unpack` takes it: an existing folder, inside no run, one this process can write in."""
    into = Path(into)
    if not os.path.lexists(into):
        raise HarnessError(f"--into {into}: no such folder; make it first, or name the folder the runs go into")
    return writes.check_folder(into, "--into")


def _open_archive(path: Path):
    """The archive opened for reading: a regular file (a link to one taken as named), never a FIFO or a
    device, which a read would hang on or never finish."""
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise HarnessError(f"{path}: {writes.kind_of(st.st_mode)}, not a regular file; expected an archive of "
                               f"runs that `harness reproduce --archive` wrote")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise HarnessError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise HarnessError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # it changed between the check and the open
        os.close(fd)
        raise HarnessError(f"{path}: {writes.kind_of(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _runs_of(path: Path, members: list[tarfile.TarInfo]) -> dict[str, list[tarfile.TarInfo]]:
    """The archive's members by run, each checked (:func:`_member_run`); a name twice, a member past
    :data:`UNPACK_MEMBER_BYTES`, members past :data:`UNPACK_TOTAL_BYTES` together, or a run without its
    ``run.json`` refused."""
    from pathlib import PurePosixPath

    runs: dict[str, list[tarfile.TarInfo]] = {}
    seen: set[str] = set()
    total = 0
    for m in members:
        run = _member_run(path, m)
        name = "/".join(PurePosixPath(m.name).parts)
        if name in seen:
            raise HarnessError(f"{path}: member {name[:200]!r} appears twice; an archive of runs names each file "
                               f"once (which one would be the run's?)")
        seen.add(name)
        if m.isfile():
            total += m.size
            if m.size > UNPACK_MEMBER_BYTES or total > UNPACK_TOTAL_BYTES:
                limit = (f"{UNPACK_MEMBER_BYTES} bytes a member" if m.size > UNPACK_MEMBER_BYTES
                         else f"{UNPACK_TOTAL_BYTES} bytes in all")
                raise HarnessError(f"{path}: member {name[:200]!r} holds {m.size} bytes, past the {limit} that an "
                                   f"archive of runs holds")
        runs.setdefault(run, []).append(m)
    if not runs:
        raise HarnessError(f"{path}: holds no run folder")
    for run, ms in runs.items():
        if not any(m.isfile() and "/".join(PurePosixPath(m.name).parts) == f"{run}/run.json" for m in ms):
            raise HarnessError(f"{path}: {run}: no {run}/run.json, not a run folder")
    return runs


def _check_place(into: Path, run: str) -> None:
    """``into/run`` may take the unpacked run: nothing is there, or a run folder (``run.json`` and
    ``timings.parquet``) holding only what a run writes (:data:`RUN_ENTRIES`), with no link, device or FIFO,
    and no run writing to it now. Anything else, a user's folder or file, is refused, named."""
    target = into / run
    name = f"--into {writes._cut(into)}"
    writes.check_no_links(into, target, "--into")
    st = os.lstat(target) if os.path.lexists(target) else None
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise HarnessError(f"{name}: {writes._cut(target)} is {writes.kind_of(st.st_mode)}, not a run folder; unpack "
                           f"puts a run only where nothing is or over a run folder: move it away or choose another --into")
    if not writes.is_run_folder(target):
        raise HarnessError(f"{name}: {writes._cut(target)} is a folder that is not a run (no run.json and "
                           f"timings.parquet); unpack puts a run only where nothing is or over a run folder: move it "
                           f"away or choose another --into")
    try:
        entries = sorted(os.listdir(target))
    except OSError as exc:
        raise HarnessError(f"{name}: cannot read {writes._cut(target)} ({exc.strerror or exc})") from None
    foreign = [e for e in entries if e not in RUN_ENTRIES and not re.fullmatch(writes.TEMP_PATTERN, e)]
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise HarnessError(f"{name}: the run folder {writes._cut(target)} holds {', '.join(writes._cut(e, 80) for e in foreign[:3])}"
                           f"{more}, which no run writes; unpack replaces a run folder whole: move them away first")
    writes.check_only_files(target, "--into")
    if writes.held_lock(target / ".lock"):
        raise HarnessError(f"{name}: a run is writing to {writes._cut(target)}; wait for it to finish")


def _replace(into: Path, run: str, folder: Path) -> None:
    """The staged ``folder`` in place of ``into/run`` (a run folder :func:`_check_place` let through, or nothing)."""
    old = into / run
    try:
        if os.path.lexists(old):
            aside = Path(tempfile.mkdtemp(dir=into, prefix=f".{run}.old-"))
            try:
                os.replace(old, aside / run)
                os.replace(folder, old)
            finally:
                shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(folder, old)
    except OSError as exc:
        raise writes.disk_error(old, exc, "runs") from None


def _member_run(path: Path, m: tarfile.TarInfo) -> str:
    """The run a member of an archive belongs to; HarnessError for one :func:`unpack` refuses."""
    from pathlib import PurePosixPath

    parts = PurePosixPath(m.name).parts
    if m.name.startswith("/") or not parts or any(p in ("..", ".", "") for p in parts) or "\\" in m.name:
        raise HarnessError(f"{path}: member {m.name[:200]!r}: an absolute path or one with '..'; expected "
                           f"RUN/... paths only")
    if not (m.isfile() or m.isdir()):
        what = "a symbolic link" if m.issym() else "a hard link" if m.islnk() else "not a regular file"
        raise HarnessError(f"{path}: member {m.name[:200]!r} is {what}; an archive of runs holds regular files "
                           f"and folders only")
    if parts[0].startswith(".") or not re.fullmatch(r"[\w.+-]+", parts[0]):
        raise HarnessError(f"{path}: member {m.name[:200]!r}: expected a run's plain folder name first")
    return parts[0]


def _stage(tar, path: Path, into: Path, run: str, members, read_folder) -> Path:
    """One run's members streamed into a new folder beside its target (never a member whole in memory), and
    checked as a run; the folder is removed when anything fails."""
    from pathlib import PurePosixPath

    try:
        folder = Path(tempfile.mkdtemp(dir=into, prefix=f".{run}.new-"))
    except OSError as exc:
        raise writes.disk_error(into / run, exc, "runs") from None
    try:
        for m in members:
            target = folder.joinpath(*PurePosixPath(m.name).parts[1:])
            if m.isdir():
                writes.make_folder(target, below=folder)
            else:
                writes.write_file(target, _copier(tar, path, m), below=folder, run=folder)
        read_folder(folder)  # the one rule for a run: run.json and tables that are this run's
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def _copier(tar, path: Path, m: tarfile.TarInfo):
    """A writer of member ``m`` into the file it is given, in chunks, stopping past the member's stated size."""

    def copy(tmp: Path) -> None:
        source = tar.extractfile(m)
        n = 0
        with open(tmp, "wb") as sink:
            while True:
                try:
                    chunk = source.read(1 << 20)
                except (OSError, tarfile.TarError, EOFError, zlib.error) as exc:
                    raise HarnessError(f"{path}: not a readable archive ({getattr(exc, 'strerror', None) or exc})") from None
                if not chunk:
                    break
                n += len(chunk)
                if n > m.size or n > UNPACK_MEMBER_BYTES:
                    raise HarnessError(f"{path}: member {m.name[:200]!r} holds more than the {m.size} bytes it states")
                sink.write(chunk)

    return copy
