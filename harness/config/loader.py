"""A YAML file -> a validated :class:`~harness.config.cells.RunConfig`: documents merged over the first,
profiles, backend names and baselines checked, sweeps expanded (:mod:`.sweeps`).

Everything is validated before anything runs; every problem becomes one
HarnessError line ``<file>: <key.path>: <what was expected>``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import ValidationError

from harness.config.cells import RunConfig, copy_name, device_baselines, split_copy
from harness.config.schema import RawConfig, clean_env_base, format_pydantic
from harness.config.strict_yaml import parse_yaml
from harness.config.sweeps import MAX_CELLS, check_sweep, sweep_points
from harness.spec.dtype import DType
from harness.spec.errors import HarnessError
from harness.spec.model import short_repr

REPLACED_KEYS = {"sweep", "profiles"}  # a later document's own sweep/profiles replace the first one's
#: the one key read here, before the schema (it names other settings, not a setting): what the config
#: reference (docs/configs.md) says of it
PROFILES_DESCRIPTION = ("name -> config keys merged over every document by harness run CONFIG --profile NAME; "
                        "a later document without its own inherits the first one's")
# mappings that are one choice among alternatives ({truncated: K} or {tail: K}), so replaced whole
REPLACED_LEAVES = {"bptt"}


def _merge(base: dict, over: dict, top: bool = True) -> dict:
    out = dict(base)
    for k, v in over.items():
        deep = (isinstance(v, dict) and isinstance(out.get(k), dict) and not (top and k in REPLACED_KEYS)
                and k not in REPLACED_LEAVES)
        out[k] = _merge(out[k], v, top=False) if deep else v
    return out


def config_fingerprint(config) -> str:
    """A digest of everything a config asks for (each document, as validated): ``--resume`` compares it
    with the one the run was started with."""
    # a key added after runs were committed counts where it is not its default, so their fingerprints hold
    dumps = [raw.model_dump(mode="json", exclude={"fix_blas_kernel"} if raw.fix_blas_kernel else None)
             for raw, _ in config.parts]
    files = getattr(config, "task_files", None)
    payload = {"documents": dumps, "task_files": files} if files else dumps  # a changed text file is another run
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
    owner: dict = {}  # cell key -> (document, its baseline)
    for i, (raw, points) in enumerate(config.parts):
        part = RunConfig([(raw, points)], config.path, config.source)
        for cell in part.cells():
            first = owner.setdefault(cell.key, (i, cell.baseline))
            if first[1] != cell.baseline:
                p = cell.problem
                raise HarnessError(
                    f"{config.path}: document {i + 1}: baseline: its {p.workload} {p.model.describe()} B={p.batch} "
                    f"cells are the same measurements as document {first[0] + 1}'s, which are timed against "
                    f"{first[1]}; expected that baseline, got {cell.baseline}")


def _check_baseline(raw: RawConfig, name: str, where: str, versions: dict[str, str]) -> str:
    """A baseline's canonical name (with the config's ``versions`` if it pins one); it must be one of the
    configured backends."""
    import backends as registry

    try:
        plain, copy = split_copy(name)
    except HarnessError as exc:
        raise HarnessError(f"{where}: {exc}") from None
    if copy > 1:
        raise HarnessError(f"{where}: {name!r} is a copy of {plain!r}, timed beside it to check the speedup holds 1; "
                           f"the baseline is a backend itself: expected {plain!r} (baseline_twice: true adds the copy)")
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
        if isinstance(source.get("clean_env"), list):  # the clean_env names of backends still in the list
            source["clean_env"] = [n for n in source["clean_env"] if any(
                n == b or n == clean_env_base(b) for b in backends_override)] or False
    try:
        raw = RawConfig.model_validate(source)
    except ValidationError as exc:
        raise format_pydantic(exc, path) from None

    # --backends may leave out the pinned backends the document's versions: were written for
    versions = _versions(raw, path, {} if backends_override else own or source)
    for i, name in enumerate(raw.backends):
        try:
            plain, copy = split_copy(name)
            canonical = registry.validate_name(plain, versions)
        except HarnessError as exc:
            raise HarnessError(f"{path}: backends[{i}]: {exc}") from None
        raw.backends[i] = copy_name(canonical, copy)
        if copy > 1 and copy_name(canonical, copy - 1) not in raw.backends[:i]:
            raise HarnessError(f"{path}: backends[{i}]: {name!r} is a copy of {plain!r}; expected "
                               f"{copy_name(plain, copy - 1)!r} before it in the list")
    if len(set(raw.backends)) != len(raw.backends):
        raise HarnessError(f"{path}: backends: each backend may appear once")
    if isinstance(raw.baseline, dict):
        for device in raw.baseline:
            if device not in raw.device:
                raise HarnessError(f"{path}: baseline.{device}: expected a device the config runs on ({', '.join(raw.device)})")
        raw.baseline = {d: _check_baseline(raw, b, f"{path}: baseline.{d}", versions) for d, b in raw.baseline.items()}
    elif raw.baseline is not None:
        raw.baseline = _check_baseline(raw, raw.baseline, f"{path}: baseline", versions)
    if raw.baseline_twice:  # an A/A check: the baseline again, as a cell of its own, beside itself
        for b in device_baselines(raw).values():
            if copy_name(b, 2) not in raw.backends:
                raw.backends.append(copy_name(b, 2))

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
    check_sweep(raw, path)
    points = sweep_points(raw, path, base, digests)
    _check_keys_apply(raw, points, own if own is not None else source, path)
    return raw, points


# model keys of one kind of cell alone (SPEC.md): in a document none of whose models is of that kind, ignored
KIND_KEYS = {"reset_after": "gru", "peephole": "lstm"}


def _check_keys_apply(raw: RawConfig, points: list[dict], own: dict, path: str) -> None:
    """Refuse a key the document sets (itself, or by sweeping it) that none of its cells reads: a GRU's
    ``reset_after`` on Elman models, ``train.loss_scale`` (float16's) on float32 cells. Accepted, it would
    be ignored while the config seemed to ask for something."""
    own_model = own.get("model") if isinstance(own.get("model"), dict) else {}
    own_train = own.get("train") if isinstance(own.get("train"), dict) else {}
    swept = {k.strip() for key in raw.sweep for k in key.split(",")}
    kinds = sorted({point["model"].kind for point in points})
    for key, kind in KIND_KEYS.items():
        if kind not in kinds and (key in own_model or f"model.{key}" in swept):
            where = f"model.{key}" if key in own_model else f"sweep.model.{key}"
            raise HarnessError(f"{path}: {where}: applies to kind {kind} only, and this document's models are "
                               f"{', '.join(kinds)}; expected no {key} here")
    if not any(DType.of(d).loss_scaled for d in raw.dtype) and ("loss_scale" in own_train or "train.loss_scale" in swept):
        where = "train.loss_scale" if "loss_scale" in own_train else "sweep.train.loss_scale"
        raise HarnessError(f"{path}: {where}: applies to dtype float16 only (its static loss scale), and this "
                           f"document runs {', '.join(raw.dtype)}; expected no loss_scale here")
