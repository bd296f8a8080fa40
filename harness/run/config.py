"""YAML config -> validated :class:`RunConfig` -> the list of cells to run.

Everything is validated before anything runs; every problem becomes one
HarnessError line ``<file>: <key.path>: <what was expected>``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness.run import envs
from harness.spec.errors import HarnessError
from harness.spec.model import DEFAULT_LOSS_SCALE, DTYPE_BYTES, DTYPES, MAX_INT, ModelSpec, Problem, TaskSpec, short_repr

DEFAULT_ENV = {
    # glibc returning freed buffers to the OS on every step costs page faults that
    # dominate small steps (DESIGN.md); the same setting for every backend of a run
    "MALLOC_MMAP_THRESHOLD_": "1000000000",
    "MALLOC_TRIM_THRESHOLD_": "1000000000",
}


class _Strict(BaseModel):
    # strict: "2", "yes" and [true] are not numbers; no inf/nan (every cell would fail on them)
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)


COUNT_CAP = 10**9  # loop counts beyond this are a typo, not a plan
SECONDS_CAP = 7 * 24 * 3600.0  # a week


class TimingConfig(_Strict):
    warmup: int = Field(2, ge=0, le=COUNT_CAP, description="untimed calls after compiling")
    min_rounds: int = Field(10, ge=3, le=COUNT_CAP)
    min_time_s: float = Field(1.0, ge=0, le=SECONDS_CAP)
    max_time_s: float = Field(10.0, gt=0, le=SECONDS_CAP)
    timeout_s: float = Field(600.0, gt=0, le=SECONDS_CAP, description="per worker request (init, warm-up, a round, training)")
    round_s: Optional[float] = Field(None, gt=0, le=SECONDS_CAP, description="target length of one round; default min_time_s / min_rounds")
    verify: bool = Field(True, description="check each cell's own step against the reference before timing it")
    speedup_precision: Optional[float] = Field(
        None, ge=1e-9, lt=1, description="keep taking rounds until every speedup's 95% interval is within this share "
                                     "of its value (0.02: +-2%), or max_time_s per cell; unset: the floor alone")
    processes: int = Field(1, ge=1, le=16, description="fresh worker processes per timed cell, taking its rounds in turn; "
                                                      "a speedup's interval then covers how far they disagree")
    min_processes: int = Field(2, ge=1, le=16, description="fresh worker processes every timed cell's rounds come from at "
                                                          "least, over its passes (each pass starts ceil(min_processes / "
                                                          "passes) when processes is fewer), so that every absolute time, "
                                                          "the baseline's and a lone backend's too, samples what differs "
                                                          "between processes (memory layout, allocator state, the kernels "
                                                          "a library picked), as pyperf's do; the spread between them is "
                                                          "recorded. A speedup's interval covers only processes and passes")
    passes: int = Field(1, ge=1, le=16, description="visits to each comparison group, spread over the run, each with "
                                                   "fresh worker processes and its share of the rounds; a speedup's "
                                                   "interval then covers how far the passes disagree")
    max_passes: Optional[int] = Field(None, ge=1, le=16, description="with speedup_precision: further passes while "
                                                                    "the target is unmet (default: passes)")

    @model_validator(mode="after")
    def _consistent(self) -> "TimingConfig":
        """The rules between the settings, here so that every timing (a document's, a sweep point's) meets
        them and nothing downstream repairs one: a cap below the floor, fewer passes at most than at least."""
        if self.max_time_s < self.min_time_s:
            raise ValueError(f"max_time_s: expected at least timing.min_time_s ({self.min_time_s}), got {self.max_time_s}")
        if self.max_passes is not None and self.max_passes < self.passes:
            raise ValueError(f"max_passes: expected at least timing.passes ({self.passes}), got {self.max_passes}")
        return self


class TrainConfig(_Strict):
    epochs: int = Field(1, ge=1, le=COUNT_CAP)
    lr: float = Field(0.005, gt=0)
    eval_every: int = Field(500, ge=1, le=COUNT_CAP, description="examples between evaluations")
    target_loss: Optional[float] = None
    patience: int = Field(2, ge=1, le=COUNT_CAP)
    time_budget_s: Optional[float] = Field(None, gt=0, le=SECONDS_CAP)
    halve_lr_on_rise: bool = False
    loss_scale: float = Field(DEFAULT_LOSS_SCALE, gt=0, le=2.0 ** 32,
                              description="dtype float16 only: the static loss scale (SPEC.md, \"Reduced precision\")")


IntOrList = Union[int, list[int]]
StrOrList = Union[str, list[str]]


# ``name`` becomes a folder under results/: one plain folder name, never a path
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
# variables the harness itself sets up for a worker; a config's env must not replace them
RESERVED_ENV = ("HARNESS_", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUNBUFFERED")
# variables the harness sets from a cell's own settings (threads:, device:), which would override the config's
# value: refused, so that what a run records is what its workers got
OVERRIDDEN_ENV = {**{v: "threads:" for v in envs.THREAD_VARS}, "HL_NUM_THREADS": "threads:",
                  **{v: "device:" for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")}}
# variables that make the dynamic loader load code of the config's choosing into every worker
LOADER_ENV = ("LD_", "DYLD_", "GCONV_PATH")
ENV_VALUE_CAP = 128 * 1024 - 1  # bytes of one NAME=value (the kernel's MAX_ARG_STRLEN, with its NUL)
ENV_TOTAL_CAP = 512 * 1024  # bytes of every variable together (the kernel also counts the inherited ones)
THREADS_CAP = 4096


class RawConfig(_Strict):
    name: str = Field(..., min_length=1)
    description: str = ""
    seed: int = Field(0, ge=0, le=MAX_INT)
    dtype: StrOrList = "float32"
    model: dict[str, Any] = Field(default_factory=dict)
    task: dict[str, Any] = Field(default_factory=lambda: {"kind": "random", "input_size": 32})
    workloads: list[Literal["forward", "train_step", "train"]] = Field(default_factory=lambda: ["train_step"], min_length=1)
    batch: IntOrList = 1
    threads: IntOrList = 1
    backends: list[str] = Field(..., min_length=1)
    baseline: Optional[Union[str, dict[str, str]]] = None  # one name, or one per device {cpu: ..., gpu: ...}
    sweep: dict[str, list[Any]] = Field(default_factory=dict)
    device: StrOrList = "cpu"
    timing: TimingConfig = Field(default_factory=TimingConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    env: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_ENV))
    # package -> version: companions added to the environment of every backend named with a version
    # (jax@0.4.38); a name's own pins win
    versions: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not NAME_PATTERN.fullmatch(v):
            raise ValueError(f"expected a plain folder name (letters, digits, '.', '_', '-', '+'; no '/'), got {short_repr(v)}")
        return v

    @field_validator("batch", "threads", mode="before")
    @classmethod
    def _positive(cls, v, info):
        values = v if isinstance(v, list) else [v]
        cap = THREADS_CAP if info.field_name == "threads" else MAX_INT
        if not values or any(isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= cap for x in values):
            raise ValueError(f"expected a positive integer or a list of them{' (at most %d)' % cap if cap < MAX_INT else ''}, "
                             f"got {short_repr(v)}")
        return values

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v):
        values = v if isinstance(v, list) else [v]
        bad = [x for x in values if x not in DTYPES]
        if bad or not values:
            raise ValueError(f"expected one of {', '.join(DTYPES)} (or a list), got {short_repr(v)}")
        return values

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        values = v if isinstance(v, list) else [v]
        bad = [x for x in values if x not in ("cpu", "gpu")]
        if bad or not values:
            raise ValueError(f"expected cpu or gpu (or a list), got {short_repr(v)}")
        return values

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v):
        if not isinstance(v, dict):
            raise ValueError(f"expected a mapping of variable name -> text, got {short_repr(v)}")
        total = 0
        for k, val in v.items():
            if not isinstance(k, str) or not k or "=" in k or "\0" in k:
                raise ValueError(f"expected variable names without '=' or NUL, got {short_repr(k)}")
            if k.startswith(RESERVED_ENV):
                raise ValueError(f"{k} is set by the harness itself (it chooses backends and worker plumbing), "
                                 f"expected other variable names")
            if k in OVERRIDDEN_ENV:
                raise ValueError(f"{k} is set for every worker from the cell's {OVERRIDDEN_ENV[k]} setting, "
                                 f"which would override this value; use {OVERRIDDEN_ENV[k]} instead")
            if k.startswith(LOADER_ENV):
                raise ValueError(f"{short_repr(k)} makes the dynamic loader load code into every worker; "
                                 f"a config may not set loader variables")
            if not isinstance(val, str) or "\0" in val:
                raise ValueError(f"expected text values (quote numbers), got {k}: {short_repr(val)}")
            size = len(k.encode("utf-8", "surrogatepass")) + 1 + len(val.encode("utf-8", "surrogatepass"))
            if size > ENV_VALUE_CAP:
                raise ValueError(f"expected a value of at most {ENV_VALUE_CAP // 1024} KB (a process's limit for "
                                 f"one variable), got {k}: {size // 1024} KB")
            total += size + 1
        if total > ENV_TOTAL_CAP:
            raise ValueError(f"expected at most {ENV_TOTAL_CAP // 1024} KB of variables in all, got {total // 1024} KB")
        return {**DEFAULT_ENV, **v}


@dataclass(frozen=True)
class Cell:
    """One measurement: a backend on one problem, with its threads and data."""

    backend: str
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

    @property
    def group_key(self) -> str:
        """Cells that differ only by backend share a key and are timed side by side. The key holds every
        setting that changes a result, so two cells with one key are the same measurement."""
        p = self.problem
        sweep = ",".join(f"{k}={v}" for k, v in self.point.items())
        key = (f"{p.workload}|{p.device}|{p.dtype}|{p.model.describe()}|{self.task.kind}|T={p.seq_len}"
               f"|D={p.input_size}|O={p.output_size}|B={p.batch}|threads={self.threads}|{sweep}")
        settings = self.settings_key()
        return f"{key}|{settings}" if settings else key

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
                if section == "train" and k == "loss_scale" and self.problem.dtype != "float16":
                    continue  # read by float16 steps alone
                if v != getattr(default, k) and f"{section}.{k}" not in self.point:
                    parts.append(f"{section}.{k}={v}")
        if self.seed:
            parts.append(f"seed={self.seed}")
        parts += [f"env.{k}={v}" for k, v in sorted(self.env.items()) if DEFAULT_ENV.get(k) != v]
        return ",".join(parts)

    @property
    def cell_id(self) -> str:
        return f"{self.group_key}|{self.backend}"


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
        return list(dict.fromkeys(b for raw, _ in self.parts for b in raw.backends))

    @property
    def task_files(self) -> dict[str, str]:
        """The text files the tasks read (task.path, resolved against the config's folder) -> their sha256."""
        return {point["task"].path: point["task_sha256"] for _, points in self.parts for point in points
                if point.get("task_sha256")}

    def groups(self) -> list[list[Cell]]:
        """The comparison groups, in the config's order: the cells of one problem, baseline first."""
        return [list(g) for _, g in itertools.groupby(self.cells(), key=lambda c: c.group_key)]

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
                scale = point["train"].loss_scale if dtype == "float16" else None
                prob = Problem(point["model"], d_in, d_out, task.tokens, dtype, batch, task.seq_len, device, workload,
                               scale)
                for b in order:
                    cells.append(Cell(b, prob, task, threads, point["values"], point["train"], point["timing"],
                                      baseline, dict(r.env), r.seed, point.get("task_sha256")))
        # the same measurement asked for twice (a repeated sweep value, a document repeating another) runs
        # once; a group's cells stay together in the order their group first appears
        groups: dict[str, dict[str, Cell]] = {}
        for cell in cells:
            groups.setdefault(cell.group_key, {}).setdefault(cell.cell_id, cell)
        return [cell for group in groups.values() for cell in group.values()]

    def check_memory(self, limit_mb: float | None = None) -> None:
        """Refuse, before anything runs, a config whose comparison group would need more memory than
        the machine has (the group's workers run side by side), showing the estimate."""
        if limit_mb is None:
            from harness.run.client import memory_limit_mb

            limit_mb = memory_limit_mb()
        if not limit_mb:
            return
        groups: dict[str, list[Cell]] = {}
        for cell in self.cells():
            groups.setdefault(cell.group_key, []).append(cell)
        for group in groups.values():
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
    t = cell.timing  # TimingPolicy.worker_processes, read without the worker layer
    return max(t.processes, -(-t.min_processes // t.passes))


_DEFAULT_TRAIN = TrainConfig()
_DEFAULT_TIMING = TimingConfig()
_DEFAULT_TASK = TaskSpec()


def _fmt_mb(mb: float) -> str:
    return f"{mb / 1024:.3g} GB" if mb >= 1024 else f"{mb:.3g} MB"


def estimate_bytes(cell: Cell) -> float:
    """A lower estimate of one cell's worker memory: parameters with their gradients and a copy,
    the activations BPTT keeps (T x B x H per layer and gate), the outputs, and the data set."""
    p, m, task = cell.problem, cell.problem.model, cell.task
    item = DTYPE_BYTES[p.master_dtype]  # mixed precision keeps parameters, gradients and state in float32
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


def _devices_of(full_name: str) -> tuple[str, ...]:
    """The devices a backend implements (none when it cannot be imported here)."""
    import backends as registry

    try:
        return registry.backend_class(registry.split_name(full_name)[0]).devices
    except HarnessError:
        return ()


def _loc(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _format_pydantic(exc: ValidationError, path: str, prefix: tuple = ()) -> HarnessError:
    """One line for a validation error: the file, the key path (``prefix`` first, for a section validated
    alone) and what was expected. A rule between a model's fields names its field first (``field: ...``)."""
    err = exc.errors()[0]
    loc = prefix + tuple(err["loc"])
    head, sep, rest = err["msg"].removeprefix("Value error, ").partition(": ")
    if err["type"] == "value_error" and sep and head.isidentifier() and head != "expected":
        loc, err = loc + (head,), {**err, "msg": rest}
    where = _loc(loc)
    if err["type"] == "extra_forbidden":
        parent = err["loc"][:-1]
        model = RawConfig
        for part in parent:
            ann = model.model_fields[part].annotation
            model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else model
        valid = ", ".join(model.model_fields)
        return HarnessError(f"{path}: {where}: unknown key; valid keys are {valid}")
    if err["type"] == "missing":
        return HarnessError(f"{path}: {where}: required key is missing")
    msg = err["msg"].removeprefix("Value error, ")
    if "expected" not in msg:
        for said, meant in (("Input should be", "expected"), ("a valid integer", "an integer"), ("a valid number", "a number"),
                            ("a valid boolean", "true or false"), ("a valid string", "text"), ("a valid list", "a list"),
                            ("a valid dictionary", "a mapping")):
            msg = msg.replace(said, meant)
        msg = f"{msg}, got {short_repr(err.get('input'))}"
    return HarnessError(f"{path}: {where}: {msg}")


# -- strict YAML ----------------------------------------------------------------------------------
MAX_DEPTH = 40  # nesting levels; real configs use 4
MAX_CONFIG_BYTES = 1 << 20  # real configs are a few KB
MAX_EXPANDED_NODES = 100_000  # nodes once every alias is expanded; real configs have a few hundred


class _YamlRefused(Exception):
    def __init__(self, mark, message: str):
        super().__init__(message)
        self.mark = mark


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also refuses what a config never needs and a hostile file uses:
    duplicate keys (silently, the last would win), deep nesting (the composer recurses), aliases
    that refer to their own node, alias bombs (a few hundred bytes expanding to gigabytes), and
    integers no consumer can hold."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._open_anchors: set[str] = set()
        self._size: dict[int, int] = {}  # id(node) -> node count once expanded
        self._total = 0  # over the documents so far

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise _YamlRefused(event.start_mark, f"alias *{event.anchor} refers to the node that contains it")
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _YamlRefused(event.start_mark, f"nested more than {MAX_DEPTH} levels deep")
        anchor = getattr(event, "anchor", None)
        if anchor:
            self._open_anchors.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open_anchors.discard(anchor)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
            self._no_duplicate_keys(node)
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        size = 1 + sum(self._size.get(id(c), 1) for c in children)
        if parent is None:  # a document's root: count every document of the file together
            self._total += size
            size = self._total
        if size > MAX_EXPANDED_NODES:
            raise _YamlRefused(node.start_mark, f"expands to more than {MAX_EXPANDED_NODES} values "
                                                f"once its aliases are expanded (an alias bomb?)")
        self._size[id(node)] = size
        return node

    @staticmethod
    def _no_duplicate_keys(node) -> None:
        seen = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            ident = (key.tag, key.value)
            if ident in seen:
                raise _YamlRefused(key.start_mark, f"duplicate key {short_repr(key.value)} "
                                                   f"(first at line {seen[ident].line + 1})")
            seen[ident] = key.start_mark

    def construct_yaml_int(self, node):
        self._no_yaml11_number(node)
        value = super().construct_yaml_int(node)
        if abs(value) > MAX_INT:
            raise _YamlRefused(node.start_mark, f"expected an integer below 2**63, got {short_repr(node.value)}")
        return value


    @staticmethod
    def _no_yaml11_number(node, octal: bool = True) -> None:
        """YAML 1.1 reads ``010`` as octal 8 and ``1:30`` as sexagesimal 90, where a reader means ten and
        a time or a ratio: refused, with the spellings that say what is meant."""
        text = node.value.replace("_", "").lstrip("+-")
        if ":" in text:
            raise _YamlRefused(node.start_mark, f"{short_repr(node.value)} is a base-60 number in YAML 1.1 "
                                                f"(1:30 reads as 90); write the number itself, or quote it for text")
        if octal and len(text) > 1 and text[0] == "0" and text[1].isdigit():
            raise _YamlRefused(node.start_mark, f"{short_repr(node.value)} is an octal number in YAML 1.1 "
                                                f"(010 reads as 8); write it without leading zeros, or quote it for text")

    def construct_yaml_float(self, node):
        self._no_yaml11_number(node, octal=False)
        return super().construct_yaml_float(node)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)


def _where(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"


def parse_yaml(path: str) -> list:
    """The documents of a YAML file, through :class:`StrictLoader`; HarnessError naming the file and
    the place on anything it cannot read."""
    try:
        st = Path(path).stat()
        if not stat.S_ISREG(st.st_mode):
            raise HarnessError(f"{path}: expected a regular file holding a config, got "
                               f"{'a folder' if stat.S_ISDIR(st.st_mode) else 'a device, pipe or socket'}")
        if st.st_size > MAX_CONFIG_BYTES:
            raise HarnessError(f"{path}: expected a config of at most {MAX_CONFIG_BYTES >> 20} MB, "
                               f"got {st.st_size / 2**20:.1f} MB")
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:  # it grew since
            raise HarnessError(f"{path}: expected a config of at most {MAX_CONFIG_BYTES >> 20} MB")
    except OSError as exc:
        raise HarnessError(f"{path}: cannot read config: {exc.strerror}") from None
    except ValueError as exc:  # a NUL in the path
        raise HarnessError(f"{short_repr(path)}: cannot read config: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise HarnessError(f"{path}: line {line}: expected UTF-8 text, got byte 0x{data[exc.start]:02x}") from None
    try:
        return list(yaml.load_all(text, Loader=StrictLoader))
    except _YamlRefused as exc:
        raise HarnessError(f"{path}: {_where(exc.mark)}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        what = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise HarnessError(f"{path}: {_where(exc.problem_mark or exc.context_mark)}: not valid YAML: {what}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow, anywhere in the file
        line = text[: exc.position].count("\n") + 1
        raise HarnessError(f"{path}: line {line}: not valid YAML: {exc.reason} character "
                           f"{chr(exc.character)!r} is not allowed") from None
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError) as exc:
        raise HarnessError(f"{path}: not valid YAML: {short_repr(str(exc), 120)}") from None


SWEEPABLE = {
    "model": {f.name for f in dataclasses.fields(ModelSpec)},
    "task": {f.name for f in dataclasses.fields(TaskSpec)},
    "train": set(TrainConfig.model_fields),
    "timing": set(TimingConfig.model_fields),
}


def _set_path(mapping: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = mapping
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


MAX_CELLS = 20_000  # a week of cells at 30 s each; more is a runaway sweep
REPLACED_KEYS = {"sweep", "profiles"}  # a later document's own sweep/profiles replace the first one's
# mappings that are one choice among alternatives ({truncated: K} or {tail: K}), so replaced whole
REPLACED_LEAVES = {"bptt"}


def _merge(base: dict, over: dict, top: bool = True) -> dict:
    out = dict(base)
    for k, v in over.items():
        deep = (isinstance(v, dict) and isinstance(out.get(k), dict) and not (top and k in REPLACED_KEYS)
                and k not in REPLACED_LEAVES)
        out[k] = _merge(out[k], v, top=False) if deep else v
    return out


def load_config(path: str | Path, backends_override: list[str] | None = None, profile: str | None = None) -> RunConfig:
    """Read and fully validate a YAML config (and check every backend name exists).

    ``profile`` names an entry of each document's ``profiles:`` mapping (a later document
    inherits the first one's unless it has its own), merged over that document: e.g. the
    full DeepBench list behind ``--profile full``.
    """
    path = str(path)
    docs = [d for d in parse_yaml(path) if d is not None]
    if not docs:
        raise HarnessError(f"{path}: the file holds no config")
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            where = f" (document {i + 1})" if len(docs) > 1 else ""
            raise HarnessError(f"{path}: expected a mapping of config keys at the top level{where}")
    sources = [docs[0]] + [_merge(docs[0], d) for d in docs[1:]]
    for i, src in enumerate(sources):
        profiles = src.pop("profiles", None) or {}
        where = f"{path}: document {i + 1}: profiles" if i else f"{path}: profiles"
        if not isinstance(profiles, dict):
            raise HarnessError(f"{where}: expected a mapping of profile name -> config keys")
        if profile is None:
            continue
        if profile not in profiles:
            raise HarnessError(f"{where}: no profile {profile!r} (known: {', '.join(profiles) or 'none defined'})")
        if not isinstance(profiles[profile], dict):
            raise HarnessError(f"{where}.{profile}: expected a mapping of config keys")
        sources[i] = _merge(src, profiles[profile])
    for i, doc in enumerate(docs[1:], 2):
        if "name" in doc and doc["name"] != docs[0].get("name"):
            raise HarnessError(f"{path}: document {i}: name: the first document names the run "
                               f"({short_repr(docs[0].get('name'))}); expected no other name, got {short_repr(doc['name'])}")
    base = Path(path).absolute().parent
    digests: dict[str, str] = {}
    parts = []
    for i, source in enumerate(sources):
        label = f"{path}: document {i + 1}" if len(sources) > 1 and i > 0 else path
        own = docs[i] if profile is None else _merge(docs[i], (docs[i].get("profiles") or {}).get(profile) or {})
        parts.append(_load_part(source, label, backends_override, base, digests, own))
    n_cells = sum(len(points) * len(raw.device) * len(raw.dtype) * len(raw.workloads) * len(raw.batch)
                  * len(raw.threads) * len(raw.backends) for raw, points in parts)
    if n_cells > MAX_CELLS:
        raise HarnessError(f"{path}: sweep, batch, threads, backends: expected at most {MAX_CELLS} cells, got {n_cells}")
    config = RunConfig(parts, path, docs)
    _check_baselines_agree(config)
    config.check_memory()
    return config


def _check_baselines_agree(config: RunConfig) -> None:
    """Cells of two documents that are the same measurement run once, in one comparison group with one
    baseline: a later document that names another baseline for such a group is refused, not dropped."""
    owner: dict[str, tuple[int, str]] = {}  # group key -> (document, its baseline)
    for i, (raw, points) in enumerate(config.parts):
        part = RunConfig([(raw, points)], config.path, config.source)
        for cell in part.cells():
            first = owner.setdefault(cell.group_key, (i, cell.baseline))
            if first[1] != cell.baseline:
                p = cell.problem
                raise HarnessError(
                    f"{config.path}: document {i + 1}: baseline: its {p.workload} {p.model.describe()} B={p.batch} "
                    f"cells are the same measurements as document {first[0] + 1}'s, which are timed against "
                    f"{first[1]}; expected that baseline, got {cell.baseline}")


def _check_text_file(file: str, where: str) -> None:
    """A task's text must be a regular file (not a folder, /dev/zero or a pipe that never ends)."""
    try:
        st = Path(file).stat()
    except (OSError, ValueError):
        raise HarnessError(f"{where}: no such file {short_repr(file)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise HarnessError(f"{where}: expected a regular text file, got {short_repr(file)} (not a regular file)")


def _check_baseline(raw: RawConfig, name: str, where: str, versions: dict[str, str]) -> str:
    """A baseline's canonical name (with the config's ``versions`` if it pins one); it must be one of the
    configured backends."""
    import backends as registry

    try:
        name = registry.validate_name(name, versions)
    except HarnessError as exc:
        raise HarnessError(f"{where}: {exc}") from None
    if name not in raw.backends:
        raise HarnessError(f"{where}: expected one of the configured backends ({', '.join(raw.backends)}), got {name!r}")
    return name


def _versions(raw: RawConfig, path: str, own: dict) -> dict[str, str]:
    """The document's ``versions:`` as canonical pins (package -> one exact version). A document that
    sets them itself must name a backend with a version (``name@version``), whose environment they join."""
    from harness.spec.environments import parse_pins

    out = {}
    for package, version in raw.versions.items():
        try:
            pins = parse_pins(f"{package}@{version}")
            if len(pins) != 1:
                raise ValueError(f"expected one exact version, got {version!r}")
        except ValueError as exc:
            raise HarnessError(f"{path}: versions.{package}: {exc}") from None
        out.update(pins)
    if out and "versions" in own and not any("@" in b for b in raw.backends):
        first = next(iter(raw.versions))
        raise HarnessError(f"{path}: versions.{first}: pins a companion package in the environments of backends "
                           f"named with a version, and backends ({', '.join(raw.backends)}) names none; expected "
                           f"at least one backend named NAME@VERSION")
    return out


def _file_digest(file: str, where: str) -> str:
    """The sha256 of a task's text file (read as the workers read it, up to their size cap)."""
    from harness.spec.data import MAX_TEXT_BYTES

    st = Path(file).stat()
    if st.st_size > MAX_TEXT_BYTES:
        raise HarnessError(f"{where}: expected a text file of at most {MAX_TEXT_BYTES >> 20} MB, "
                           f"got {st.st_size >> 20} MB")
    digest = hashlib.sha256()
    try:
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise HarnessError(f"{where}: cannot read {short_repr(file)}: {exc.strerror}") from None
    return digest.hexdigest()


# train settings a timed step reads (its update's rate); the others belong to workload train
STEP_TRAIN_KEYS = {"lr", "loss_scale"}


def _load_part(source: dict, path: str, backends_override: list[str] | None, base: Path | None = None,
               digests: dict | None = None, own: dict | None = None):
    import backends as registry

    base = base if base is not None else Path.cwd()
    digests = digests if digests is not None else {}

    if backends_override:
        source = {**source, "backends": backends_override}
        named = source.get("baseline")
        if isinstance(named, dict):  # keep the per-device baselines that are still in the list
            source["baseline"] = {d: b for d, b in named.items() if b in backends_override} or None
        elif named not in backends_override:
            source["baseline"] = backends_override[0]
    try:
        raw = RawConfig.model_validate(source)
    except ValidationError as exc:
        raise _format_pydantic(exc, path) from None

    # --backends may leave out the pinned backends the document's versions: were written for
    versions = _versions(raw, path, {} if backends_override else own or source)
    for i, name in enumerate(raw.backends):
        try:
            raw.backends[i] = registry.validate_name(name, versions)
        except HarnessError as exc:
            raise HarnessError(f"{path}: backends[{i}]: {exc}") from None
    if len(set(raw.backends)) != len(raw.backends):
        raise HarnessError(f"{path}: backends: each backend may appear once")
    if isinstance(raw.baseline, dict):
        for device in raw.baseline:
            if device not in raw.device:
                raise HarnessError(f"{path}: baseline.{device}: expected a device the config runs on ({', '.join(raw.device)})")
        raw.baseline = {d: _check_baseline(raw, b, f"{path}: baseline.{d}", versions) for d, b in raw.baseline.items()}
    elif raw.baseline is not None:
        raw.baseline = _check_baseline(raw, raw.baseline, f"{path}: baseline", versions)

    if "train" not in raw.workloads:
        # a train setting of a document that trains nothing would only tell apart cells that measure the same
        own_train = (own or source).get("train")
        extra = sorted(set(own_train) - STEP_TRAIN_KEYS) if isinstance(own_train, dict) else []
        swept = [k.strip() for key in raw.sweep for k in key.split(",")
                 if k.strip().startswith("train.") and k.strip()[6:] not in STEP_TRAIN_KEYS]
        if extra or swept:
            what = f"train.{extra[0]}" if extra else f"sweep.{swept[0]}"
            raise HarnessError(f"{path}: {what}: applies to workload train only (a timed step reads train.lr "
                               f"and, in float16, train.loss_scale alone), and this document runs {', '.join(raw.workloads)}; expected it in a "
                               f"document with workloads: [train]")
    seen_keys: dict[str, str] = {}
    for key, values in raw.sweep.items():
        paths = key.split(",")
        for one in paths:
            if one.strip() in seen_keys:
                raise HarnessError(f"{path}: sweep.{key}: {one.strip()} is swept twice (also in "
                                   f"sweep.{seen_keys[one.strip()]}); expected each key once")
            seen_keys[one.strip()] = key
            section, _, leaf = one.strip().partition(".")
            if one.strip() != one and len(paths) == 1:
                raise HarnessError(f"{path}: sweep.{short_repr(key)}: expected a key without surrounding spaces")
            if section not in SWEEPABLE or leaf not in SWEEPABLE[section]:
                sections = ", ".join(f"{s}.<key>" for s in SWEEPABLE)
                raise HarnessError(f"{path}: sweep.{key}: no such scalar key to sweep (expected {sections} with a valid key)")
        if not values:
            raise HarnessError(f"{path}: sweep.{key}: expected a non-empty list of values")
        if len(paths) > 1 and not all(isinstance(v, list) and len(v) == len(paths) for v in values):
            raise HarnessError(f"{path}: sweep.{key}: a sweep over {len(paths)} keys zips them; expected a list of {len(paths)}-element lists")

    n_points = math.prod(len(v) for v in raw.sweep.values())
    if n_points > MAX_CELLS:
        raise HarnessError(f"{path}: sweep: expected at most {MAX_CELLS} combinations, got {n_points}")
    points = []
    keys = list(raw.sweep)
    for combo in itertools.product(*(raw.sweep[k] for k in keys)):
        values = {}
        for key, value in zip(keys, combo):
            paths = [p.strip() for p in key.split(",")]
            values.update(zip(paths, value) if len(paths) > 1 else [(key, value)])
        doc = {"model": copy.deepcopy(raw.model), "task": copy.deepcopy(raw.task),
               "train": raw.train.model_dump(), "timing": raw.timing.model_dump()}
        for k, v in values.items():
            _set_path(doc, k, v)
        where = f"sweep {', '.join(f'{k}={v!r}' for k, v in values.items())}: " if values else ""
        try:
            model = ModelSpec.from_mapping(doc["model"])
            task = TaskSpec.from_mapping(doc["task"])
            section = "train"
            train = TrainConfig.model_validate(doc["train"])
            section = "timing"
            timing = TimingConfig.model_validate(doc["timing"])
        except HarnessError as exc:
            raise HarnessError(f"{path}: {where}{exc}") from None
        except ValidationError as exc:
            raise HarnessError(f"{path}: {where}{_format_pydantic(exc, path, (section,)).args[0].split(': ', 1)[1]}") from None
        if task.kind in ("lm_markov", "lm_text") and model.head != "softmax_xent":
            raise HarnessError(f"{path}: {where}model.head: task {task.kind} needs softmax_xent, got {model.head!r}")
        if task.kind in ("sobel", "frame_diff") and model.head != "mse":
            raise HarnessError(f"{path}: {where}model.head: task {task.kind} needs mse, got {model.head!r}")
        digest = None
        if task.kind == "lm_text" and task.path != "sample":
            # a relative path names a file beside the config, wherever the run is started from (and the
            # workers, which start in the project's folder, get the resolved one)
            where_path = f"{path}: {where}task.path"
            try:
                resolved = os.path.normpath(base / Path(task.path).expanduser())
            except (ValueError, RuntimeError):
                raise HarnessError(f"{where_path}: no such file {short_repr(task.path)}") from None
            _check_text_file(resolved, where_path)
            task = dataclasses.replace(task, path=resolved)
            if resolved not in digests:
                digests[resolved] = _file_digest(resolved, where_path)
            digest = digests[resolved]
        if "train" in raw.workloads:
            small = [b for b in raw.batch if b > task.n_eval or b > task.n_sequences]
            if small:
                raise HarnessError(f"{path}: {where}batch: {small[0]} exceeds task.n_eval ({task.n_eval}) or task.n_sequences ({task.n_sequences}) needed by workload train")
        points.append({"model": model, "task": task, "train": train, "timing": timing, "values": values,
                       "task_sha256": digest})
    return raw, points
