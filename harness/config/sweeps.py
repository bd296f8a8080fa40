"""Sweeps: a document's ``sweep:`` keys checked, and its points (every combination of the swept
values, zipped keys together) as resolved model, task, train and timing settings."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import math
import os
import stat
from pathlib import Path

from pydantic import ValidationError

from harness.config.schema import RawConfig, TimingConfig, TrainConfig, format_pydantic
from harness.spec.errors import HarnessError
from harness.spec.model import ModelSpec, TaskSpec, short_repr

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


def check_sweep(raw: RawConfig, path: str) -> None:
    """Each swept key is a scalar key of model, task, train or timing, swept once, with values."""
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


def sweep_points(raw: RawConfig, path: str, base: Path, digests: dict) -> list[dict]:
    """Every point of the document's sweep (one without a sweep), each with its model, task, train and
    timing settings; a task's text file is resolved against ``base`` and its digest kept in ``digests``."""
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
            raise HarnessError(f"{path}: {where}{format_pydantic(exc, path, (section,)).args[0].split(': ', 1)[1]}") from None
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
    return points


def _check_text_file(file: str, where: str) -> None:
    """A task's text must be a regular file (not a folder, /dev/zero or a pipe that never ends)."""
    try:
        st = Path(file).stat()
    except (OSError, ValueError):
        raise HarnessError(f"{where}: no such file {short_repr(file)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise HarnessError(f"{where}: expected a regular text file, got {short_repr(file)} (not a regular file)")


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
