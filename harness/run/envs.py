"""Isolated environments for backends whose stack conflicts with the main one.

Environments live under ``.harness/envs/<name>`` in the project folder (override with
``HARNESS_HOME``). A backend whose class names ``environment = "<name>"`` runs its
workers and its conformance check with that environment's Python. The project itself
is not installed there: workers import it from the source tree through ``PYTHONPATH``
(see :func:`worker_environ`), so an environment only holds its recipe's packages.

Two kinds, built the same way: those a backend class declares (``environment = "theano"``
and its :class:`Recipe`), and pin sets named by a backend name that pins versions
(``jax@0.4.38`` runs in the environment ``jax@0.4.38``, whose recipe follows from its name:
:func:`harness.spec.environments.pinned_recipe`).

An environment's OpenBLAS builds may be older than the CPU they run on and fall back to a generic
kernel there (Prescott on a CPU with AVX-512): :func:`check_kernels` finds the kernel each build picks on
this CPU and the best core type every such build knows (``OPENBLAS_CORETYPE``), once per CPU, and the
runner sets it for the environment's workers (:func:`core_type`, config ``fix_blas_kernel``).

Creation uses ``uv`` when it is on ``PATH`` (much faster), otherwise ``python -m venv``
and pip. It is serialised by a file lock, and an environment counts as existing only
once its marker file is written, so an interrupted creation is simply redone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness.run import machine
from harness.worker import lifeline, measure
from harness.spec import environments, tuning, writes
# the folders and the recipe type live in the spec layer, where backends read them
from harness.spec.environments import MARKER, THREAD_VARS, Recipe, current_env, env_dir, env_python, home  # noqa: F401
from harness.spec.environments import damaged_reason, marker as _marker
from harness.spec.errors import HarnessError
from harness.spec.model import short_repr

# creations that failed in this process, by folder: the other cells of a run that need the environment
# get the same answer at once instead of another installer run (a later process tries again)
_FAILED: dict[Path, str] = {}


def _stale(name: str) -> bool:
    """True when the environment was built from other packages than its recipe now names."""
    marker, recipe = _marker(name), find_recipe(name)
    return marker is not None and recipe is not None and marker.get("recipe") != list(recipe.packages)


def recipes() -> dict[str, Recipe]:
    """The environments the registered backends declare (``environment`` and ``recipe`` on the class)."""
    import backends

    out = {}
    for name in backends.registry():
        try:
            cls = backends.backend_class(name)
        except HarnessError:  # a plugin that cannot be imported declares nothing
            continue
        if cls.environment is not None and cls.recipe is not None:
            out[cls.environment] = cls.recipe
    return out


def find_recipe(name: str) -> Recipe | None:
    """The recipe of environment ``name``: a backend's declared one, or a pin set's; None when neither."""
    known = recipes()
    if name in known:
        return known[name]
    if environments.is_pin_set(name):
        try:
            pins = environments.parse_pins(name)
        except ValueError:
            return None
        if environments.pins_text(pins) == name:  # the canonical spelling only: one folder per pin set
            return environments.pinned_recipe(pins)
    return None


def _recipe(name: str) -> Recipe:
    recipe = find_recipe(name)
    if recipe is None:
        raise HarnessError(f"no recipe for an isolated environment named {short_repr(name)}; known environments: "
                           f"{', '.join(recipes()) or 'none'}, or a pin set (package@version+package@version...)")
    return recipe


def env_target(name: str, removing: bool = False) -> Path:
    """The folder of environment ``name``, checked before anything is written or deleted there: one
    folder directly under ``HARNESS_HOME/envs`` (never a path, a symbolic link or the folder itself),
    of a known environment: a declared one, a canonical pin set, or (``removing``) one the harness
    built whose recipe is gone (its marker is there). HarnessError otherwise."""
    root = home() / "envs"
    if (not isinstance(name, str) or not name or name in (".", "..") or name.startswith(".")
            or "/" in name or os.sep in name or "\0" in name or len(name) > 255):
        raise HarnessError(f"environment {short_repr(name)}: expected the name of an environment (theano, "
                           f"numpy@1.26.4), not a path")
    target = root / name
    if target.is_symlink():
        raise HarnessError(f"environment {short_repr(name)}: {target} is a symbolic link, not an environment the "
                           f"harness built; remove the link yourself")
    leftover = removing and (target / MARKER).is_file()
    if find_recipe(name) is None and not leftover:
        if removing:
            raise HarnessError(f"no environment named {short_repr(name)} in {root}; expected one of "
                               f"{', '.join(r['name'] for r in list_envs()) or 'none'}")
        _recipe(name)
    if target.exists() and target.resolve().parent != root.resolve():
        raise HarnessError(f"environment {short_repr(name)}: {target} is not a folder of {root}")
    return target


def removal_name(name: str) -> str:
    """The environment ``env remove NAME`` means: a folder the harness built under that very name (one an
    older harness named by another spelling of its pins), else :func:`environment_name`'s answer."""
    root = home() / "envs"
    if name and "/" not in name and name not in (".", "..") and (root / name / MARKER).is_file():
        return name
    return environment_name(name)


def environment_name(name: str) -> str:
    """The environment a user names: a declared one (``theano``), or the one of a backend name that pins
    versions (``jax:unroll=4@0.4.38`` -> ``jax@0.4.38``) or of a pin set (``jaxlib@0.4.38+jax@0.4.38``)."""
    import backends

    if name in recipes() or not environments.is_pin_set(name):
        return name
    if backends.ref(name).name in backends.registry():
        env = backends.environment_of(backends.validate_name(name))
        if env is not None:
            return env
    try:
        return environments.pins_text(environments.parse_pins(name))
    except ValueError as exc:
        raise HarnessError(f"environment {name!r}: {exc}") from None


# -- creation ------------------------------------------------------------------------


class _Stderr:
    """Stands in for a rich Console where none is given: progress lines on stderr."""

    def print(self, line: str, highlight: bool = False, markup: bool = True) -> None:
        print(line, file=sys.stderr, flush=True)


class _Reporter:
    """One progress line per stage, on the console given (or nowhere)."""

    def __init__(self, progress, name: str):
        self.progress, self.name = progress, name

    def __call__(self, message: str) -> None:
        if self.progress is not None:
            self.progress.print(f"env {self.name}: {message}", highlight=False, markup=False)


def can_create(name: str) -> tuple[bool, str]:
    """Cheaply: whether this machine has what creating ``name`` needs (network aside)."""
    return environments.can_create(name, _recipe(name))


class _StageError(Exception):
    pass


def _run(cmd: list[str], stage: str, env: dict | None = None) -> str:
    # the harness's own programs among them (the BLAS probe) die with this process
    proc = subprocess.run(cmd, capture_output=True, text=True, env=lifeline.child_environ(env))
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        errors = [line for line in lines if line.lower().startswith("error")  # pip's and uv's own verdict
                  and "ignored the following versions" not in line.lower()]  # a notice: every release for other Pythons
        reason = " | ".join(_short(line) for line in (errors or lines)[-6:])
        raise _StageError(f"{stage} failed (exit {proc.returncode}): {reason}")
    return proc.stdout


def _short(line: str, keep: int = 3, most: int = 400) -> str:
    """An installer's line with its list of every released version cut to the first and last few, and
    at most ``most`` characters."""
    def cut(match):
        versions = match.group(1).split(", ")
        if len(versions) <= 2 * keep:
            return match.group(0)
        return f"(from versions: {', '.join(versions[:keep])}, ..., {', '.join(versions[-keep:])})"

    line = re.sub(r"\(from versions: ([^)]*)\)", cut, line)
    return line if len(line) <= most else line[:most - 3] + "..."


def _make_and_install(name: str, recipe: Recipe, target: Path, say) -> Path:
    py = target / "bin" / "python"
    uv = shutil.which("uv")
    base = environments.base_python(recipe)
    if uv is not None:
        want = base or ".".join(map(str, recipe.max_python))
        say(f"creating a virtual environment with uv (Python {want}) in {target}")
        _run([uv, "venv", "--quiet", "--python", want, str(target)], "uv venv")
        if recipe.packages:
            say(f"installing {', '.join(recipe.packages)} with uv")
            _run([uv, "pip", "install", "--quiet", "--python", str(py), *recipe.packages], "uv pip install")
        return py
    if base is None:
        raise _StageError(can_create(name)[1])
    version = _run([base, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], "finding Python").strip()
    if environments.has_pip():
        say(f"creating a virtual environment (Python {version}) in {target}")
        _run([base, "-m", "venv", "--without-pip", str(target)], "python -m venv")
        installer = [sys.executable, "-m", "pip", "--python", str(py)]
    else:  # no pip next to the harness: give the environment its own
        say(f"creating a virtual environment with pip (Python {version}) in {target}")
        _run([base, "-m", "venv", str(target)], "python -m venv")
        installer = [str(py), "-m", "pip"]
    if not recipe.packages:
        return py
    say(f"installing {', '.join(recipe.packages)} with pip")
    _run([*installer, "install", "--disable-pip-version-check", "--no-input", "--quiet", *recipe.packages],
         "pip install")
    return py


def _installed_versions(py: Path, recipe: Recipe) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))")
    found = json.loads(_run([str(py), "-c", code], "listing packages"))
    wanted = {p.split("==")[0].split(">")[0].split("<")[0].strip().lower() for p in recipe.packages}
    return {k: v for k, v in sorted(found.items()) if k.replace("_", "-") in wanted or k in wanted}


def _site_dirs(target: Path) -> list[Path]:
    return sorted(target.glob("lib/python*/site-packages"))


# -- the kernel each OpenBLAS build picks on this CPU ----------------------------------------------------------

#: in an environment's folder: per CPU, the kernels its BLAS libraries pick and the core type its workers get
KERNELS_FILE = "kernels.json"


def _cpu_key(cpu: dict) -> str:
    """What a kernel record is kept under: the CPU's vendor, family, model and a digest of its flags."""
    import hashlib

    flags = hashlib.sha1(" ".join(cpu["flags"]).encode()).hexdigest()[:12]
    return f"{cpu['vendor']} family {cpu['family']} model {cpu['model']} flags {flags}"


def _kernels(py: Path, env: dict) -> list:
    """The BLAS entries a process of that Python reports with this environment (blas_probe --kernels)."""
    out = _run([str(py), "-m", "harness.worker.blas_probe", "--kernels"], "finding the BLAS kernels", env=env)
    return json.loads(out.strip().splitlines()[-1])


def check_kernels(name: str, py: Path | None = None) -> dict:
    """Find, on this CPU, the kernel each BLAS library of environment ``name`` picks by itself (``alone``)
    and, where an OpenBLAS build falls back to a generic one on a CPU with AVX2 or AVX-512, the best core
    type every such build takes (``core_type``, :func:`harness.spec.tuning.choose_core_type`, with the
    kernels it gives in ``with_core_type``): a build that does not know a name keeps its own pick, so each
    candidate is tried. Kept in the environment's :data:`KERNELS_FILE` under this CPU; HarnessError when
    the environment's Python cannot answer."""
    py = py or env_python(name)
    if py is None:
        raise HarnessError(f"environment {name!r} does not exist")
    cpu = machine.cpu_identity()
    base = {k: v for k, v in worker_environ(name).items() if k != tuning.CORETYPE}  # each build's own pick
    try:
        alone = _kernels(py, base)
        tried: dict[str, list] = {}
        core = None
        if tuning.generic_libraries(alone) and tuning.wants_better(cpu["flags"]):
            for candidate in tuning.core_types(cpu["flags"], cpu["vendor"]):
                tried[candidate] = _kernels(py, {**base, tuning.CORETYPE: candidate})
                core = tuning.choose_core_type(cpu["flags"], cpu["vendor"], alone, tried)
                if core is not None:
                    break
    except (_StageError, OSError, ValueError) as exc:
        raise HarnessError(f"environment {name!r}: cannot tell its BLAS kernels: {exc}") from None
    record = {"cpu": f"{cpu['vendor']} family {cpu['family']} model {cpu['model']}", "alone": alone,
              "core_type": core, "with_core_type": tried.get(core) if core else None,
              "tried": sorted(tried)}
    path = env_dir(name) / KERNELS_FILE
    kept = _read_kernels(path)
    kept[_cpu_key(cpu)] = record
    writes.write_file(path, json.dumps(kept, indent=2), below=env_dir(name))
    return record


def _read_kernels(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def kernel_record(name: str, compute: bool = True) -> dict | None:
    """:func:`check_kernels`' record of environment ``name`` for this CPU; found first where the
    environment exists and has none for it yet (``compute``). None where there is none."""
    record = _read_kernels(env_dir(name) / KERNELS_FILE).get(_cpu_key(machine.cpu_identity()))
    if record is None and compute and env_python(name) is not None:
        record = check_kernels(name)
    return record


def core_type(name: str) -> str | None:
    """The ``OPENBLAS_CORETYPE`` the workers of environment ``name`` get on this CPU (None: its builds know
    it, or none can be helped)."""
    return (kernel_record(name) or {}).get("core_type")


def kernels_text(record: dict | None) -> str:
    """One line of what each library picks on this CPU: ``numpy's OpenBLAS 0.3.20 Prescott (SkylakeX by
    OPENBLAS_CORETYPE)``."""
    if record is None:
        return "not checked on this CPU"
    after = {lib.get("filepath"): lib.get("architecture") for lib in record.get("with_core_type") or []}
    parts = []
    for lib in record.get("alone") or []:
        if lib.get("user_api") not in (None, "blas"):
            continue
        path = str(lib.get("filepath") or "")
        folder = Path(path).parent
        owner = (folder.parent.name if folder.name == "lib" else folder.name).removesuffix(".libs") if path else ""
        what = tuning.library_text(lib) if tuning.is_openblas(lib) else str(lib.get("internal_api") or "?")
        text = f"{owner}'s {what} {lib.get('architecture') or 'kernel unreported'}" if owner else \
            f"{what} {lib.get('architecture') or 'kernel unreported'}"
        if tuning.is_generic(lib.get("architecture")):
            moved = after.get(lib.get("filepath"))
            text += (f" ({moved} by {tuning.CORETYPE})" if moved and record.get("core_type")
                     else " (generic; no core type it knows fits this CPU)" if record.get("tried") else " (generic)")
        parts.append(text)
    return "; ".join(parts) or "no BLAS loaded"


def _probe_blas(name: str, recipe: Recipe, target: Path, py: Path, say, rounds: int = 2) -> dict:
    """Build the OpenBLAS shim, time the probe backend with and without it, keep the faster.

    The answer depends on the thread count (a 2-thread OpenBLAS suffers most when the
    other core is busy), so it is measured, and recorded, at 1 thread and at all cores,
    in alternating processes: two BLAS thread pools in one process disturb each other.
    Each process runs with what a worker of the probe backend gets at that thread count (the
    config's default ``env``, the cores, the core type :func:`core_type` chose): it measures
    what the workers will run.
    """
    from backends import blas
    from harness.config.schema import DEFAULT_ENV

    info = blas.build_shim(target / "blas", _site_dirs(target))
    choice = {"library": info["library"], "openblas_ldflags": info["ldflags"], "reason": info["reason"],
              "by_threads": {}}
    if not info["ldflags"]:
        say(f"no OpenBLAS to link ({info['reason']}); using numpy's BLAS through its C-API")
        choice["by_threads"]["1"] = {"choice": "numpy", "ldflags": ""}
        return choice
    flags = {"numpy": "", "openblas": info["ldflags"]}
    for threads in sorted({1, os.cpu_count() or 1}):
        say(f"timing {recipe.blas_probe} at {threads} thread(s) with numpy's BLAS and with "
            f"{Path(info['library']).name}, {rounds} alternating rounds")
        _, settings = worker_settings(recipe.blas_probe, "cpu", "float32", threads, dict(DEFAULT_ENV), ensure=False)
        env = process_environ(name, settings, DEFAULT_ENV)[0]
        if env.get(tuning.CORETYPE):
            choice["variables"] = {tuning.CORETYPE: env[tuning.CORETYPE]}
        samples: dict[str, list[float]] = {"numpy": [], "openblas": []}
        for r in range(rounds):
            for key in measure.round_order(["numpy", "openblas"], r):
                out = _run([str(py), "-m", "harness.worker.blas_probe", "--backend", recipe.blas_probe,
                            "--ldflags", f"{key}={flags[key]}"], "BLAS probe", env=env)
                samples[key].append(json.loads(out.strip().splitlines()[-1])["median_ms"][key])
        med = {key: min(values) for key, values in samples.items()}  # the least disturbed process
        best = "openblas" if med["openblas"] < med["numpy"] else "numpy"
        choice["by_threads"][str(threads)] = {"choice": best, "ldflags": flags[best], "median_ms": med,
                                              "samples_ms": samples}
        say(f"BLAS at {threads} thread(s): {best} ({med['numpy']:.2f} ms per step with numpy's BLAS, "
            f"{med['openblas']:.2f} ms with OpenBLAS)")
    choice["probe"] = ("sgd_step, elman H=100 vocab=8000 T=20 B=1 float32: per setting the best of "
                       f"{rounds} processes' medians of 40 steps")
    return choice


def _lock(name: str):
    from harness.spec.environments import held_lock

    return held_lock(home() / "envs", name)


def create_env(name: str, force: bool = False, progress=None) -> Path:
    """Build environment ``name`` from its recipe (rebuild with ``force``); returns its Python."""
    from backends import blas

    recipe = _recipe(name)
    target = env_target(name)
    say = _Reporter(progress, name)
    with _lock(name):
        existing = env_python(name)
        if existing is not None and not force and not _stale(name):
            say(f"already exists at {target}")
            return existing
        if target.exists():
            damaged = environments.damage(name)
            why = ("its recipe changed" if _stale(name) else f"it is damaged: {damaged}" if damaged
                   else "rebuilding")
            say(f"removing the old environment at {target} ({why})")
            shutil.rmtree(target)
        started = time.monotonic()
        try:
            py = _make_and_install(name, recipe, target, say)
            if recipe.check:
                say(f"checking the installation ({recipe.check})")
                _run([str(py), "-c", recipe.check], "import check", env=worker_environ(name))
            versions = _installed_versions(py, recipe)
            say(f"BLAS kernels on this CPU: {kernels_text(check_kernels(name, py))}")
            if recipe.blas_probe:
                blas_choice = _probe_blas(name, recipe, target, py, say)
                writes.write_file(target / blas.CHOICE_FILE, json.dumps(blas_choice, indent=2), below=target)
        except (_StageError, OSError, HarnessError) as exc:
            shutil.rmtree(target, ignore_errors=True)
            _FAILED[target] = f"could not create environment {name!r}: {exc}"
            raise HarnessError(_FAILED[target]) from None
        _FAILED.pop(target, None)
        marker = {"name": name, "packages": versions, "recipe": list(recipe.packages), "python": str(py),
                  "created_s": round(time.monotonic() - started, 1)}
        # written whole or not at all: a marker cut short would read as a damaged environment
        writes.write_file(target / MARKER, json.dumps(marker, indent=2), below=target)
        say(f"ready in {marker['created_s']:.0f} s")
        return py


def ensure_env(name: str, progress=None) -> Path:
    """The environment's interpreter, creating the environment first if needed."""
    py = env_python(name)
    if py is not None and not _stale(name):
        return py
    _recipe(name)
    env_target(name)
    damaged = environments.damage(name)
    if damaged:  # its backends are unavailable with this reason; `harness env create` rebuilds it
        raise HarnessError(environments.damaged_reason(name, damaged))
    if env_dir(name) in _FAILED:
        raise HarnessError(_FAILED[env_dir(name)])
    ok, why = can_create(name)
    if not ok:
        raise HarnessError(f"cannot create environment {name!r}: {why}")
    return create_env(name, progress=progress if progress is not None else _Stderr())


def list_envs() -> list[dict]:
    """Every known or present environment: name, exists, damaged (why, or None), path and packages (a
    string)."""
    root, known = home() / "envs", recipes()
    names = list(known)
    if root.is_dir():
        names += sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in known)
    rows = []
    for name in names:
        marker, damaged = _marker(name), environments.damage(name)
        if damaged:
            packages = damaged_reason(name, damaged)
        elif marker is not None:
            from backends import blas

            packages = ", ".join(f"{k} {v}" for k, v in marker.get("packages", {}).items())
            choice = blas.read_choice(env_dir(name))
            if choice is not None:
                packages += f"; BLAS: {blas.describe(choice)}"
            try:
                record = kernel_record(name)
                packages += f"; kernels on this CPU: {kernels_text(record)}"
                core = (record or {}).get("core_type")
                if choice is not None and core and (choice.get("variables") or {}).get(tuning.CORETYPE) != core:
                    packages += (f"; its BLAS choice was measured without {tuning.CORETYPE}={core}: `harness env "
                                 f"create --force {name}` measures it as the workers run")
            except HarnessError as exc:
                packages += f"; kernels on this CPU: {exc}"
        elif find_recipe(name) is not None:
            packages = ", ".join(find_recipe(name).packages)
        else:
            packages = ""
        rows.append({"name": name, "exists": marker is not None, "damaged": damaged, "path": str(env_dir(name)),
                     "packages": packages})
    return rows


def remove_env(name: str) -> None:
    """Delete environment ``name`` (its compile caches go with it); only a known environment's folder
    directly under ``HARNESS_HOME/envs`` (:func:`env_target`)."""
    target = env_target(name, removing=True)
    if not target.exists():
        raise HarnessError(f"environment {name!r} does not exist (looked in {target})")
    with _lock(name):
        try:
            shutil.rmtree(target)
        except OSError as exc:
            raise HarnessError(f"environment {name!r}: cannot remove {target}: {exc.strerror or exc}") from None
        cache = environments.env_cache_dir(name)
        if cache.is_symlink():  # the link goes, never what it points at
            cache.unlink()
        else:
            shutil.rmtree(cache, ignore_errors=True)


def worker_environ(name: str | None) -> dict[str, str]:
    """The process environment for a worker in environment ``name`` (None: the main one)."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # children must find the same environments and caches as this process
    env["HARNESS_HOME"] = str(home())
    return env


# -- a worker's settings and its whole process environment --------------------------------------------------


def worker_cpus(threads: int) -> list[int]:
    """The cores a worker with ``threads`` threads is confined to: the first ``threads`` of
    the runner's own, or none (no confinement) when more threads than cores are asked for."""
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return []
    return mine[:threads] if threads <= len(mine) else []


def worker_settings(cell_backend, device: str, dtype: str, threads: int, extra: dict[str, str],
                    fix_kernel: bool = True, clean: bool = False, ensure: bool = True) -> tuple[str | None, dict]:
    """The isolated environment name and the variables the runner and the backend set for one worker
    (the cell's ``env``, the thread count, the cores, the device, the backend's own flags, and the OpenBLAS
    core type of an environment whose OpenBLAS is older than the CPU); ``cell_backend``: a
    :class:`backends.BackendRef` or a name.

    An isolated environment is built first (``ensure``): its settings read what building it chose (the
    BLAS its graphs link, the core type). ``fix_kernel`` (config ``fix_blas_kernel``) sets that core type
    unless the cell's ``env`` names one, or the caller's environment does and ``clean`` does not drop it."""
    import backends
    from harness.spec.environments import acting_for, thread_variables

    ref = backends.ref(cell_backend)
    cls = ref.backend_class()
    variant = ref.variant
    environment = backends.environment_of(ref)  # a pinned name's own, or the class's
    if environment is not None and ensure:
        ensure_env(environment)
    env = dict(extra)
    env.update(thread_variables(threads))  # the one way the worker learns its thread count
    cpus = worker_cpus(threads)
    if cpus:
        env["HARNESS_CPUS"] = ",".join(map(str, cpus))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU cell must not quietly use a GPU
    with acting_for(environment):  # the caches and flags it names are that environment's
        env.update(cls.environment_variables(cls.variant_of(variant), threads, device, dtype))
    if (environment is not None and fix_kernel and tuning.CORETYPE not in env
            and (clean or not os.environ.get(tuning.CORETYPE))):
        core = core_type(environment)
        if core is not None:
            env[tuning.CORETYPE] = core
    env["PYTHONUNBUFFERED"] = "1"
    return environment, env


#: where a worker's variable came from: the caller's environment, the config's ``env``, the harness
CALLER, CONFIG, HARNESS = "caller", "config", "harness"


def process_environ(environment: str | None, settings: dict, config_env: dict,
                    clean: bool = False) -> tuple[dict, dict]:
    """A worker's whole process environment and the record of its variables that steer a numerical library.

    The worker inherits the caller's environment, then gets ``settings`` (:func:`worker_settings`: the
    config's ``env`` and what the harness sets). With ``clean`` it inherits none of the caller's
    steering variables (``OPENBLAS_CORETYPE``, ``OMP_*``, ``MALLOC_*``, ...: :mod:`harness.spec.tuning`),
    as pyperf starts its workers: each library then picks what the CPU offers. The record maps each
    steering variable the worker got to ``{"value", "origin"}`` (origin :data:`CALLER`, :data:`CONFIG` or
    :data:`HARNESS`) and each one a clean environment left out to ``{"value", "origin": "caller",
    "removed": true}``. The core type the harness set for an OpenBLAS older than the CPU also names, as
    ``fixes``, the builds that fall back to a generic kernel without it (their BLAS entries)."""
    base = worker_environ(environment)
    removed = {k: v for k, v in tuning.steering(base).items() if k not in settings} if clean else {}
    env = {**{k: v for k, v in base.items() if k not in removed}, **settings}
    record = {}
    for k, v in tuning.steering(env).items():
        if k not in settings:
            origin = CALLER
        elif config_env.get(k) == v:
            origin = CONFIG
        else:
            origin = HARNESS
        record[k] = {"value": v, "origin": origin}
        if k == tuning.CORETYPE and origin == HARNESS and environment is not None:
            kernels = kernel_record(environment, compute=False) or {}
            if kernels.get("core_type") == v:
                record[k]["fixes"] = [{f: lib.get(f) for f in ("internal_api", "version", "architecture", "filepath")}
                                      for lib in tuning.generic_libraries(kernels.get("alone"))]
    for k, v in removed.items():
        record[k] = {"value": v, "origin": CALLER, "removed": True}
    return env, dict(sorted(record.items()))
