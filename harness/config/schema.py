"""The schema of a config: every key, its type and bounds, as pydantic models (``RawConfig`` and its
sections ``TimingConfig``, ``TrainConfig``), and one line per validation error
(``<file>: <key.path>: <what was expected>``).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness.spec.environments import THREAD_VARS
from harness.spec.errors import HarnessError
from harness.spec.timing import TimingRules
from harness.spec.model import DEFAULT_LOSS_SCALE, DTYPES, MAX_INT, short_repr

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


class TimingConfig(_Strict, TimingRules):
    """The ``timing:`` settings; the rules that follow from them are :class:`harness.spec.timing.TimingRules`'."""

    warmup: int = Field(2, ge=0, le=COUNT_CAP, description="untimed calls after compiling")
    min_rounds: int = Field(10, ge=3, le=COUNT_CAP, description="timed rounds every cell of a comparison group takes at least")
    min_time_s: float = Field(1.0, ge=0, le=SECONDS_CAP, description="seconds of timed calls every cell takes at least")
    max_time_s: float = Field(10.0, gt=0, le=SECONDS_CAP, description="cap on the timed seconds per cell of the group, "
                              "whatever the precision target (at least min_time_s)")
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
                                                          "passes) when processes is fewer), as pyperf's do; their spread "
                                                          "is recorded, and a speedup's interval covers it")
    passes: Optional[int] = Field(None, ge=1, le=16, description="visits to each comparison group, spread over the run, "
                                  "each with fresh worker processes and its share of the rounds; unset: a pass for each "
                                  "of min_processes' processes, at most two (one where processes is over 1)")
    max_passes: Optional[int] = Field(None, ge=1, le=16, description="with speedup_precision: further passes while "
                                                                    "the target is unmet (default: passes)")

    @model_validator(mode="after")
    def _consistent(self) -> "TimingConfig":
        """The rules between the settings, here so that every timing (a document's, a sweep point's) meets
        them and nothing downstream repairs one: a cap below the floor, fewer passes at most than at least."""
        if self.max_time_s < self.min_time_s:
            raise ValueError(f"max_time_s: expected at least timing.min_time_s ({self.min_time_s}), got {self.max_time_s}")
        if self.max_passes is not None and self.max_passes < self.pass_count:
            raise ValueError(f"max_passes: expected at least timing.passes ({self.pass_count}), got {self.max_passes}")
        return self


class TrainConfig(_Strict):
    epochs: int = Field(1, ge=1, le=COUNT_CAP, description="passes over the training sequences")
    lr: float = Field(0.005, gt=0, description="SGD learning rate (also what a timed train_step uses)")
    eval_every: int = Field(500, ge=1, le=COUNT_CAP, description="examples between evaluations")
    target_loss: Optional[float] = Field(None, description="training stops once the evaluation loss is at or below it "
                                         "for patience evaluations in a row; time_to_target_s is the steps' time then "
                                         "(null when never reached)")
    patience: int = Field(2, ge=1, le=COUNT_CAP, description="evaluations in a row at or below target_loss that stop training")
    time_budget_s: Optional[float] = Field(None, gt=0, le=SECONDS_CAP, description="training seconds after which a run "
                                           "stops (evaluation time excluded)")
    halve_lr_on_rise: bool = Field(False, description="halve lr when an evaluation loss rises over the one before "
                                   "(the WildML tutorial's schedule)")
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
OVERRIDDEN_ENV = {**{v: "threads:" for v in THREAD_VARS}, "HL_NUM_THREADS": "threads:",
                  **{v: "device:" for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")}}
# variables that make the dynamic loader load code of the config's choosing into every worker
LOADER_ENV = ("LD_", "DYLD_", "GCONV_PATH")
ENV_VALUE_CAP = 128 * 1024 - 1  # bytes of one NAME=value (the kernel's MAX_ARG_STRLEN, with its NUL)
ENV_TOTAL_CAP = 512 * 1024  # bytes of every variable together (the kernel also counts the inherited ones)
THREADS_CAP = 4096


def clean_env_base(backend: str) -> str:
    """The name a ``clean_env`` list may give a backend by: its registered name, without variant or pins."""
    return backend.split("@", 1)[0].split(":", 1)[0]


class RawConfig(_Strict):
    name: str = Field(..., min_length=1, json_schema_extra={"allowed": "a plain folder name: letters, digits, . _ - +"},
                      description="the run's name and its folder under results/; set by the first document only")
    description: str = Field("", description="free text, kept in run.json")
    seed: int = Field(0, ge=0, le=MAX_INT, description="seed of the shared initial parameters and of the task's data")
    dtype: StrOrList = Field("float32", json_schema_extra={"allowed": DTYPES},
                             description="number type; bfloat16 and float16 are mixed precision (docs/mixed-precision.md); "
                                         "a list sweeps it")
    model: dict[str, Any] = Field(default_factory=dict, description="the network (keys below)")
    task: dict[str, Any] = Field(default_factory=lambda: {"kind": "random", "input_size": 32},
                                 description="where the data comes from (keys below)")
    workloads: list[Literal["forward", "train_step", "train"]] = Field(
        default_factory=lambda: ["train_step"], min_length=1,
        description="what is timed: a forward pass, one SGD step, or a training run (train:)")
    batch: IntOrList = Field(1, json_schema_extra={"allowed": "positive integers"}, description="batch size, or a list to sweep")
    threads: IntOrList = Field(1, json_schema_extra={"allowed": f"1 to {THREADS_CAP}"},
                               description="threads per worker (its cores too), or a list to sweep")
    backends: list[str] = Field(..., min_length=1, json_schema_extra={"allowed": "name, name:variant, name[:variant]@version, "
                                                                                  "native@rev:REVISION, name#2"},
                                description="the backends timed, each against the baseline (harness list shows them)")
    baseline: Optional[Union[str, dict[str, str]]] = Field(
        None, description="the backend every speedup is over, or one per device {cpu: numpy, gpu: \"torch:fused\"}; "
                          "unset (or a device without one): the first backend that runs there")
    baseline_twice: bool = Field(False, description="an A/A check: the baseline timed a second time in every group, as "
                                                    "numpy#2, whose speedup must hold 1")
    sweep: dict[str, list[Any]] = Field(default_factory=dict, description="scalar key path -> list of values, one cell set "
                                        "per value; \"a,b\": [[a1, b1], ...] zips keys; a later document's replaces it")
    device: StrOrList = Field("cpu", json_schema_extra={"allowed": ("cpu", "gpu")},
                              description="where the cells run, or a list; a backend without the device is skipped with the reason")
    timing: TimingConfig = Field(default_factory=TimingConfig, description="how cells are timed (keys below)")
    train: TrainConfig = Field(default_factory=TrainConfig, description="the train workload's settings (keys below)")
    env: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_ENV),
                                description="extra worker variables, quoted text, recorded in run.json; not HARNESS_*, "
                                            "thread or device variables, or the loader's (LD_*, DYLD_*)")
    versions: dict[str, str] = Field(default_factory=dict, description="package -> version: companions added to the "
                                     "environment of every backend named with a version (jax@0.4.38); a name's own pins win")
    pair_over: list[Literal["dtype", "threads"]] = Field(
        default_factory=list, description="settings whose values share one comparison group, each cell with its paired "
                                          "ratio to the same backend at the first listed value (setting_speedup)")
    clean_env: Union[bool, list[str]] = Field(
        False, description="true (or the backends named): workers start without the caller's variables that steer a "
                           "numerical library (OPENBLAS_*, OMP_*, ...), as pyperf's do; env and the harness's own still apply")
    fix_blas_kernel: bool = Field(
        True, description="where an isolated environment's OpenBLAS is older than this CPU and falls back to a generic "
                          "kernel (Prescott on a CPU with AVX-512), its workers get the best core type it knows "
                          "(OPENBLAS_CORETYPE: SkylakeX, Haswell, Zen; recorded with origin harness, said in the "
                          "Answer); false: each library's own pick, and the Answer names the generic kernel")

    @field_validator("clean_env")
    @classmethod
    def _clean_env(cls, v):
        if isinstance(v, list) and (not v or len(set(v)) != len(v)):
            raise ValueError(f"expected true, false or a list of backend names, each once, got {short_repr(v)}")
        return v

    @model_validator(mode="after")
    def _clean_env_names(self):
        if isinstance(self.clean_env, list):
            for name in self.clean_env:
                if not any(name == b or name == clean_env_base(b) for b in self.backends):
                    raise ValueError(f"clean_env: expected names of configured backends ({', '.join(self.backends)}), "
                                     f"got {short_repr(name)}")
        return self

    def cleans(self, backend: str) -> bool:
        """True when ``backend``'s workers start without the caller's steering variables (``clean_env``)."""
        if isinstance(self.clean_env, bool):
            return self.clean_env
        # a copy (numpy#2) by its own name; a backend's name covers its copies, as its base covers its variants
        base = backend.rpartition("#")[0] if "#" in backend else backend
        return any(name in self.clean_env for name in (backend, base, clean_env_base(base)))

    @field_validator("pair_over")
    @classmethod
    def _pair_over(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"expected each of dtype, threads at most once, got {v}")
        return v

    @model_validator(mode="after")
    def _paired_settings_vary(self):
        # a setting with one value pairs nothing: refused like any other key no cell reads
        for key in self.pair_over:
            values = self.dtype if key == "dtype" else self.threads
            if len(values) < 2:
                raise ValueError(f"pair_over: {key} has the one value {values[0]}, so pairing over it pairs nothing; "
                                 f"expected settings with two or more values each ({key}: [a, b]), or no pair_over")
        return self

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


def _loc(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def format_pydantic(exc: ValidationError, path: str, prefix: tuple = ()) -> HarnessError:
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
