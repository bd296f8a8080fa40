"""The cells a config expands into: :class:`Cell` (one measurement, with the keys that say which
comparison group it joins and what else its result depends on), :class:`RunConfig` (a validated
config, its cells and groups), each device's baseline, and the memory a group needs against the
memory this machine allows."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from backends import BackendRef
from harness.config.schema import DEFAULT_ENV, RawConfig, TimingConfig, TrainConfig
from harness.spec.dtype import DType
from harness.spec.errors import HarnessError
from harness.spec.model import Problem, TaskSpec


@dataclass(frozen=True)
class Cell:
    """One measurement: a backend on one problem, with its threads and data."""

    ref: BackendRef  # the backend, parsed once from its canonical name
    problem: Problem
    task: TaskSpec
    threads: int
    point: dict  # the sweep values of this cell ({} without a sweep)
    train: TrainConfig  # resolved train settings (a sweep may change them)
    timing: TimingConfig  # resolved timing settings
    baseline: str  # the backend its speedup is measured against
    env: dict  # extra environment variables of its worker
    seed: int  # data and initial parameters (its own document's seed)
    task_sha256: str | None = None  # the content of the task's text file (task.path), so a changed file is another cell
    # pair_over: the settings timed in one group with this cell, and their first listed values
    # (the setting the ratios are against), e.g. (("dtype", "float32"),)
    paired: tuple = ()
    clean_env: bool = False  # its worker inherits none of the caller's steering variables (config clean_env)
    fix_blas_kernel: bool = True  # an OpenBLAS older than the CPU gets the core type it knows (config fix_blas_kernel)
    copy: int = 1  # a second copy of a backend (``numpy#2``: an A/A check) is a cell of its own

    @property
    def backend(self) -> str:
        """The backend's canonical name (``jax:unroll=4@0.4.38``), as runs and tables record it, with its
        copy (``numpy#2``) for a copy."""
        return copy_name(self.ref.full, self.copy)

    @property
    def key(self) -> "CellKey":
        """What makes this cell's measurement what it is, backend aside: cells with one key are timed
        side by side, and two cells with one key and one backend are the same measurement."""
        p = self.problem
        return CellKey(workload=p.workload, device=p.device, dtype=p.dtype, model=p.model.describe(),
                       task=self.task.kind, seq_len=p.seq_len, input_size=p.input_size, output_size=p.output_size,
                       batch=p.batch, threads=self.threads, sweep=tuple(self.point.items()),
                       settings=self.settings_key())

    @property
    def group_key(self) -> str:
        """The key's text, as the results' ``group`` column and run.json name the comparison group."""
        return self.key.text

    def settings_key(self) -> str:
        """What else the cell's result depends on, where it differs from the defaults: the task's own
        sizes, train and timing settings (unless swept, hence in the sweep part), the seed and env."""
        parts = []
        for k, v in self.task.to_mapping().items():
            if v != getattr(_DEFAULT_TASK, k) and k not in ("kind", "seq_len", "input_size", "output_size"):
                parts.append(f"task.{k}={v}")
        if self.task_sha256:
            parts.append(f"task.sha256={self.task_sha256[:16]}")
        for section, settings, default in (("train", self.train, _DEFAULT_TRAIN), ("timing", self.timing, _DEFAULT_TIMING)):
            for k, v in settings.model_dump().items():
                if section == "train" and k == "loss_scale" and not self.problem.dtype.loss_scaled:
                    continue  # read by float16 steps alone
                if v != getattr(default, k) and f"{section}.{k}" not in self.point:
                    parts.append(f"{section}.{k}={v}")
        if self.seed:
            parts.append(f"seed={self.seed}")
        parts += [f"env.{k}={v}" for k, v in sorted(self.env.items()) if DEFAULT_ENV.get(k) != v]
        return ",".join(parts)

    @property
    def cell_id(self) -> str:
        """The cell's text (``cell_id`` column, run.json's ``cells``): its key's and its backend's."""
        return self.key.cell_id(self.backend)

    def setting(self) -> dict:
        """This cell's values of the paired settings (``{"dtype": "bfloat16"}``; ``{}`` without ``pair_over``)."""
        return {k: (self.problem.dtype if k == "dtype" else self.threads) for k, _ in self.paired}

    @property
    def setting_baseline(self) -> str:
        """The paired settings' first values, as the results name them: ``dtype=float32,threads=1``."""
        return ",".join(f"{k}={v}" for k, v in self.paired)

    @property
    def timing_key(self) -> "CellKey":
        """The comparison group whose rounds this cell takes in turn: its ``key``, or with ``pair_over``
        the key without the paired settings, so one backend's cells at each setting share it."""
        return self.key.without(*(k for k, _ in self.paired))


#: the labels of a key's numbered fields in its text (the others are written bare)
_LABELS = {"seq_len": "T", "input_size": "D", "output_size": "O", "batch": "B", "threads": "threads"}
#: what a key holds in place of a field it was made without (:meth:`CellKey.without`)
ANY = "*"


@dataclass(frozen=True)
class CellKey:
    """A cell's identity, backend aside, as fields: cells that differ only by backend share it and are
    timed side by side. ``key.without("dtype")`` is the key of every dtype at once (what ``pair_over``
    times together). Its text (:attr:`text`) is written here alone, for the store and run.json."""

    workload: str
    device: str
    dtype: str
    model: str  # the model's description (ModelSpec.describe)
    task: str  # the task's kind; its other sizes are in ``settings`` where not the defaults
    seq_len: int
    input_size: int
    output_size: int
    batch: int
    threads: int
    sweep: tuple = ()  # the sweep point, as (key path, value) pairs in the config's order
    settings: str = ""  # what else the result depends on, where it differs from the defaults

    def without(self, *names: str) -> "CellKey":
        """This key with the fields ``names`` left out: the key of the cells that differ only there."""
        unknown = set(names) - {f.name for f in fields(self)}
        if unknown:
            raise HarnessError(f"a cell key has no field {', '.join(sorted(unknown))}")
        return replace(self, **{name: ANY for name in names})

    @property
    def text(self) -> str:
        """The key as run folders name it: ``train_step|cpu|float32|elman-tanh H=4|random|T=7|D=5|O=6|B=3|threads=1|``
        (the sweep point and the settings last), a left-out field as ``dtype=*``."""
        parts = []
        for f in fields(self):
            value, label = getattr(self, f.name), _LABELS.get(f.name)
            if f.name == "sweep" and value != ANY:
                value = ",".join(f"{k}={v}" for k, v in value)
            if f.name == "settings" and not value:
                continue  # no settings beyond the defaults: no part for them
            parts.append(f"{label or f.name}=*" if value == ANY else f"{label}={value}" if label else str(value))
        return "|".join(parts)

    def cell_id(self, backend: str) -> str:
        """The text of the cell of ``backend`` under this key."""
        return f"{self.text}|{backend}"


@dataclass
class RunConfig:
    """A validated config and where it came from.

    A YAML file may hold several documents (``---``): each later one is merged over
    the first and adds its own cells to the same run, so one file can pair, say,
    ``train_step`` cells at two batch sizes with one short ``train`` curve.
    """

    parts: list[tuple[RawConfig, list[dict]]]  # per document: its config and sweep points
    path: str
    source: list[dict]

    @property
    def raw(self) -> RawConfig:
        return self.parts[0][0]

    @property
    def name(self) -> str:
        return self.raw.name

    @property
    def baselines(self) -> dict[str, str]:
        """The baseline of each device the first document times on."""
        return device_baselines(self.raw)

    @property
    def baseline(self) -> str:
        """The baseline's name, or ``cpu: a, gpu: b`` when the devices have different ones."""
        names = self.baselines
        if len(set(names.values())) == 1:
            return next(iter(names.values()))
        return ", ".join(f"{device}: {name}" for device, name in names.items())

    @property
    def backends(self) -> list[str]:
        """The backends the config names, each once (a copy, ``numpy#2``, is a cell of its backend)."""
        return list(dict.fromkeys(split_copy(b)[0] for raw, _ in self.parts for b in raw.backends))

    @property
    def task_files(self) -> dict[str, str]:
        """The text files the tasks read (task.path, resolved against the config's folder) -> their sha256."""
        return {point["task"].path: point["task_sha256"] for _, points in self.parts for point in points
                if point.get("task_sha256")}

    def groups(self) -> list[list[Cell]]:
        """The comparison groups, in the config's order: the cells of one problem, baseline first; with
        ``pair_over``, the cells of one problem at each paired setting, the first setting's first."""
        groups: dict[CellKey, list[Cell]] = {}
        for cell in self.cells():
            groups.setdefault(cell.timing_key, []).append(cell)
        return list(groups.values())

    def cells(self) -> list[Cell]:
        """Every cell, grouped: cells of one comparison group are adjacent, baseline first."""
        cells = []
        for r, points in self.parts:
            baselines = device_baselines(r)
            for point, device, dtype, workload, batch, threads in itertools.product(
                points, r.device, r.dtype, r.workloads, r.batch, r.threads
            ):
                baseline = baselines[device]
                order = [baseline] + [b for b in r.backends if b != baseline]
                task = point["task"]
                d_in, d_out = task.sizes()
                scale = point["train"].loss_scale if DType.of(dtype).loss_scaled else None
                prob = Problem(point["model"], d_in, d_out, task.tokens, dtype, batch, task.seq_len, device, workload,
                               scale)
                paired = tuple((k, (r.dtype if k == "dtype" else r.threads)[0]) for k in r.pair_over)
                for b in order:
                    name, copy = split_copy(b)
                    if copy > 1 and workload == "train":  # an A/A check is of a speedup: a training curve is not timed in turn
                        continue
                    cells.append(Cell(ref=BackendRef.parse(name), problem=prob, task=task, threads=threads,
                                      point=point["values"], train=point["train"], timing=point["timing"],
                                      baseline=baseline, env=dict(r.env), seed=r.seed,
                                      task_sha256=point.get("task_sha256"), paired=paired,
                                      clean_env=r.cleans(b), fix_blas_kernel=r.fix_blas_kernel, copy=copy))
        # the same measurement asked for twice (a repeated sweep value, a document repeating another) runs
        # once; a group's cells stay together in the order their group first appears
        groups: dict[CellKey, dict[str, Cell]] = {}
        for cell in cells:
            groups.setdefault(cell.key, {}).setdefault(cell.backend, cell)
        return [cell for group in groups.values() for cell in group.values()]

    def check_memory(self, limit_mb: float | None = None) -> None:
        """Refuse, before anything runs, a config whose comparison group would need more memory than
        the machine has (the group's workers run side by side), showing the estimate."""
        if limit_mb is None:
            limit_mb = memory_limit_mb()
        if not limit_mb:
            return
        for group in self.groups():  # the workers of one timing group (paired settings included) live side by side
            need_mb = sum(estimate_bytes(c) * _n_workers(c) for c in group) / 2**20
            if need_mb > limit_mb:
                c = group[0]
                p = c.problem
                raise HarnessError(
                    f"{self.path}: model.hidden/layers, batch, task sizes: expected a problem that fits in memory; "
                    f"{p.workload} {p.model.describe()} B={p.batch} T={p.seq_len} D={p.input_size} O={p.output_size} "
                    f"needs an estimated {_fmt_mb(need_mb)} for its {sum(map(_n_workers, group))} worker(s), "
                    f"this machine has {_fmt_mb(limit_mb)}")


def _n_workers(cell: Cell) -> int:
    """Worker processes a cell keeps alive beside the rest of its group (a training cell runs alone)."""
    if cell.problem.workload == "train":
        return 1
    return cell.timing.processes_per_pass


_DEFAULT_TRAIN = TrainConfig()
_DEFAULT_TIMING = TimingConfig()
_DEFAULT_TASK = TaskSpec()


def _fmt_mb(mb: float) -> str:
    return f"{mb / 1024:.3g} GB" if mb >= 1024 else f"{mb:.3g} MB"


def memory_limit_mb() -> float | None:
    """The memory this process tree may use: its cgroup's limit, else the machine's RAM."""
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text != "max":
            return int(text) / 2**20
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):
        return None


def estimate_bytes(cell: Cell) -> float:
    """A lower estimate of one cell's worker memory: parameters with their gradients and a copy,
    the activations BPTT keeps (T x B x H per layer and gate), the outputs, and the data set."""
    p, m, task = cell.problem, cell.problem.model, cell.task
    item = p.master_dtype.n_bytes  # mixed precision keeps parameters, gradients and state in float32
    h = m.hidden
    # closed forms, not loops over layers: an absurd layer count must be refused at once
    params = m.param_count(p.input_size, p.output_size)
    activations = p.seq_len * p.batch * (h * m.layers * m.directions * (2 * m.gates + 1) + 2 * p.output_size)
    n_seq = task.n_sequences + task.n_eval
    per_step_in = 1 if p.tokens else p.input_size
    per_step_out = 1 if m.head == "softmax_xent" else p.output_size
    data = n_seq * p.seq_len * (per_step_in + per_step_out)
    if task.kind == "lm_markov":
        data += (task.vocab or 0) * task.branching
    return float(item) * (3 * params + activations + data)


def device_baselines(raw: RawConfig) -> dict[str, str]:
    """The baseline of each device of ``raw``: the one named for it, else the configured one if it
    runs on that device, else the first configured backend that does (a GPU group of a mixed run
    gets a GPU baseline instead of a baseline that cannot run there)."""
    named = raw.baseline if isinstance(raw.baseline, dict) else {}
    default = raw.baseline if isinstance(raw.baseline, str) else raw.backends[0]
    out = {}
    for device in raw.device:
        if device in named:
            out[device] = named[device]
            continue
        candidates = [default] + [b for b in raw.backends if b != default]
        out[device] = next((b for b in candidates if device in _devices_of(b)), default)
    return out


def split_copy(full_name: str) -> tuple[str, int]:
    """A configured backend's name and copy: ``"numpy#2"`` -> ``("numpy", 2)``, ``"numpy"`` -> ``("numpy", 1)``.

    A copy is the same backend timed again as a cell of its own, in processes of its own, beside the
    first: its speedup over that one is an A/A check (it must hold 1), which ``baseline_twice`` asks
    for the baseline."""
    name, sep, copy = str(full_name).rpartition("#")
    if not sep:
        return str(full_name), 1
    if not (copy.isdigit() and 2 <= int(copy) <= 9 and name):
        raise HarnessError(f"backend {full_name!r}: expected a copy number from 2 to 9 after '#' (numpy#2)")
    return name, int(copy)


def copy_name(full_name: str, copy: int) -> str:
    """The name of the ``copy``-th copy of a backend (the backend's own name for the first)."""
    return full_name if copy == 1 else f"{full_name}#{copy}"


def _devices_of(full_name: str) -> tuple[str, ...]:
    """The devices a backend implements (none when it cannot be imported here)."""
    try:
        return BackendRef.parse(split_copy(full_name)[0]).backend_class().devices
    except HarnessError:
        return ()
