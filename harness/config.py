"""YAML config -> validated :class:`RunConfig` -> the list of cells to run.

Everything is validated before anything runs; every problem becomes one
HarnessError line ``<file>: <key.path>: <what was expected>``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from harness.errors import HarnessError
from harness.spec import DTYPES, ModelSpec, Problem, TaskSpec

DEFAULT_ENV = {
    # glibc returning freed buffers to the OS on every step costs page faults that
    # dominate small steps (DESIGN.md); the same setting for every backend of a run
    "MALLOC_MMAP_THRESHOLD_": "1000000000",
    "MALLOC_TRIM_THRESHOLD_": "1000000000",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class TimingConfig(_Strict):
    warmup: int = Field(2, ge=0, description="untimed calls after compiling")
    min_rounds: int = Field(10, ge=3)
    min_time_s: float = Field(1.0, ge=0)
    max_time_s: float = Field(10.0, gt=0)
    timeout_s: float = Field(600.0, gt=0, description="per worker request (init, warm-up, a round, training)")
    round_s: Optional[float] = Field(None, gt=0, description="target length of one round; default min_time_s / min_rounds")
    verify: bool = Field(True, description="check each cell's own step against the reference before timing it")
    speedup_precision: Optional[float] = Field(
        None, gt=0, lt=1, description="keep taking rounds until every speedup's 95% interval is within this share "
                                     "of its value (0.02: +-2%), or max_time_s per cell; unset: the floor alone")


class TrainConfig(_Strict):
    epochs: int = Field(1, ge=1)
    lr: float = Field(0.005, gt=0)
    eval_every: int = Field(500, ge=1, description="examples between evaluations")
    target_loss: Optional[float] = None
    patience: int = Field(2, ge=1)
    time_budget_s: Optional[float] = Field(None, gt=0)
    halve_lr_on_rise: bool = False


IntOrList = Union[int, list[int]]
StrOrList = Union[str, list[str]]


class RawConfig(_Strict):
    name: str = Field(..., min_length=1)
    description: str = ""
    seed: int = 0
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

    @field_validator("batch", "threads")
    @classmethod
    def _positive(cls, v):
        values = v if isinstance(v, list) else [v]
        if not values or any(isinstance(x, bool) or x < 1 for x in values):
            raise ValueError(f"expected a positive integer or a list of them, got {v!r}")
        return values

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v):
        values = v if isinstance(v, list) else [v]
        bad = [x for x in values if x not in DTYPES]
        if bad or not values:
            raise ValueError(f"expected one of {', '.join(DTYPES)} (or a list), got {v!r}")
        return values

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        values = v if isinstance(v, list) else [v]
        bad = [x for x in values if x not in ("cpu", "gpu")]
        if bad or not values:
            raise ValueError(f"expected cpu or gpu (or a list), got {v!r}")
        return values

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v):
        if isinstance(v, dict):
            return {**DEFAULT_ENV, **{str(k): str(val) for k, val in v.items()}}
        return v


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

    @property
    def group_key(self) -> str:
        """Cells that differ only by backend share a key and are timed side by side."""
        p = self.problem
        sweep = ",".join(f"{k}={v}" for k, v in self.point.items())
        return (f"{p.workload}|{p.device}|{p.dtype}|{p.model.describe()}|{self.task.kind}|T={p.seq_len}"
                f"|D={p.input_size}|O={p.output_size}|B={p.batch}|threads={self.threads}|{sweep}")

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
                prob = Problem(point["model"], d_in, d_out, task.tokens, dtype, batch, task.seq_len, device, workload)
                for b in order:
                    cells.append(Cell(b, prob, task, threads, point["values"], point["train"], point["timing"],
                                      baseline, dict(r.env), r.seed))
        return cells


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


def _format_pydantic(exc: ValidationError, path: str) -> HarnessError:
    err = exc.errors()[0]
    where = _loc(err["loc"])
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
        msg = f"{msg}, got {err.get('input')!r}"
    return HarnessError(f"{path}: {where}: {msg}")


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
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise HarnessError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise HarnessError(f"{path}: not valid YAML: {exc}") from None
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
    parts = []
    for i, source in enumerate(sources):
        label = f"{path}: document {i + 1}" if len(sources) > 1 and i > 0 else path
        parts.append(_load_part(source, label, backends_override))
    return RunConfig(parts, path, docs)


def _check_baseline(raw: RawConfig, name: str, where: str) -> str:
    """A baseline's canonical name; it must be one of the configured backends."""
    import backends as registry

    try:
        name = registry.validate_name(name)
    except HarnessError as exc:
        raise HarnessError(f"{where}: {exc}") from None
    if name not in raw.backends:
        raise HarnessError(f"{where}: expected one of the configured backends ({', '.join(raw.backends)}), got {name!r}")
    return name


def _load_part(source: dict, path: str, backends_override: list[str] | None):
    import backends as registry

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

    for i, name in enumerate(raw.backends):
        try:
            raw.backends[i] = registry.validate_name(name)
        except HarnessError as exc:
            raise HarnessError(f"{path}: backends[{i}]: {exc}") from None
    if len(set(raw.backends)) != len(raw.backends):
        raise HarnessError(f"{path}: backends: each backend may appear once")
    if isinstance(raw.baseline, dict):
        for device in raw.baseline:
            if device not in raw.device:
                raise HarnessError(f"{path}: baseline.{device}: expected a device the config runs on ({', '.join(raw.device)})")
        raw.baseline = {d: _check_baseline(raw, b, f"{path}: baseline.{d}") for d, b in raw.baseline.items()}
    elif raw.baseline is not None:
        raw.baseline = _check_baseline(raw, raw.baseline, f"{path}: baseline")
    if raw.timing.max_time_s < raw.timing.min_time_s:
        raise HarnessError(f"{path}: timing.max_time_s: expected at least timing.min_time_s ({raw.timing.min_time_s}), got {raw.timing.max_time_s}")

    for key, values in raw.sweep.items():
        paths = key.split(",")
        for one in paths:
            section, _, leaf = one.strip().partition(".")
            if section not in SWEEPABLE or leaf not in SWEEPABLE[section]:
                sections = ", ".join(f"{s}.<key>" for s in SWEEPABLE)
                raise HarnessError(f"{path}: sweep.{key}: no such scalar key to sweep (expected {sections} with a valid key)")
        if not values:
            raise HarnessError(f"{path}: sweep.{key}: expected a non-empty list of values")
        if len(paths) > 1 and not all(isinstance(v, list) and len(v) == len(paths) for v in values):
            raise HarnessError(f"{path}: sweep.{key}: a sweep over {len(paths)} keys zips them; expected a list of {len(paths)}-element lists")

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
            train = TrainConfig.model_validate(doc["train"])
            timing = TimingConfig.model_validate(doc["timing"])
        except HarnessError as exc:
            raise HarnessError(f"{path}: {where}{exc}") from None
        except ValidationError as exc:
            raise HarnessError(f"{path}: {where}{_format_pydantic(exc, path).args[0].split(': ', 1)[1]}") from None
        if task.kind in ("lm_markov", "lm_text") and model.head != "softmax_xent":
            raise HarnessError(f"{path}: {where}model.head: task {task.kind} needs softmax_xent, got {model.head!r}")
        if task.kind in ("sobel", "frame_diff") and model.head != "mse":
            raise HarnessError(f"{path}: {where}model.head: task {task.kind} needs mse, got {model.head!r}")
        if task.kind == "lm_text" and task.path != "sample" and not Path(task.path).exists():
            raise HarnessError(f"{path}: {where}task.path: no such file {task.path!r}")
        if "train" in raw.workloads:
            small = [b for b in raw.batch if b > task.n_eval or b > task.n_sequences]
            if small:
                raise HarnessError(f"{path}: {where}batch: {small[0]} exceeds task.n_eval ({task.n_eval}) or task.n_sequences ({task.n_sequences}) needed by workload train")
        points.append({"model": model, "task": task, "train": train, "timing": timing, "values": values})
    return raw, points
