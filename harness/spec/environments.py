"""Where the harness keeps isolated environments and caches, and what a backend declares about
the environment it needs.

The one place both sides agree on: backends find their compile caches and their environment's
folder here (they are handed these folders, never the running layer), and
:mod:`harness.run.envs` builds the environments that backends declare with a :class:`Recipe`
(``environment = "theano"`` and ``recipe = Recipe(...)`` on the backend class). Everything lives
under ``.harness/`` in the project folder, or ``HARNESS_HOME``.

An environment may also be a *pin set*: packages at exact versions, ``jax@0.4.38+jaxlib@0.4.38``
(:func:`parse_pins`). Its name is that text (packages sorted), and its recipe follows from the name
(:func:`pinned_recipe`): the pins and what every worker imports besides its backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

MARKER = "harness-env.json"
#: what a worker imports besides its backend's library (harness.worker.worker and the spec layer)
WORKER_PACKAGES = ("numpy", "PyYAML")

# The variables that size the thread pools of BLAS, OpenMP and friends: a worker gets all of them
# set to its cell's thread count.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS")



def thread_variables(threads: int) -> dict[str, str]:
    """The variables that give a worker its cell's thread count: the one channel it travels by, set
    before the worker's first import (a BLAS sizes its pool when it loads) and read back by
    :func:`worker_threads`."""
    return {var: str(int(threads)) for var in THREAD_VARS}


def worker_threads(environ=None) -> int:
    """The thread count this worker was started with (:func:`thread_variables`); 1 where none was set
    (a cell run in this process, as the tests do)."""
    text = (os.environ if environ is None else environ).get(THREAD_VARS[0], "")
    return int(text) if text.isdigit() and int(text) > 0 else 1

@dataclass(frozen=True)
class Recipe:
    """What an isolated environment holds and how it is finished after installing."""

    packages: tuple[str, ...]
    #: newest Python the pinned packages support (numpy 1.23.5 has no wheels past 3.11)
    max_python: tuple[int, int] = (3, 13)
    min_python: tuple[int, int] = (3, 9)
    #: a statement that must run in the new environment (catches broken installs early)
    check: str | None = None
    #: a backend to time with and without the OpenBLAS shim; the faster choice is kept
    blas_probe: str | None = None
    #: the environment needs a C++ compiler at run time (Theano compiles its graphs)
    needs_cxx: bool = False


def home() -> Path:
    """The folder the harness owns for environments and caches."""
    root = os.environ.get("HARNESS_HOME")
    return Path(root) if root else Path(__file__).resolve().parents[2] / ".harness"


def cache_dir(tool: str) -> Path:
    """The persistent compile cache of ``tool`` (jax, pytensor, halide, ...), shared by every process of
    one environment: an isolated environment (another version of the library) keeps caches of its own."""
    env = current_env()
    return home() / "cache" / tool if env is None else env_cache_dir(env) / tool


def env_cache_dir(name: str) -> Path:
    """The compile caches of the processes that run in environment ``name`` (outside its folder, so that
    the runner can prepare them before the environment is built)."""
    return home() / "cache" / "envs" / name


def env_dir(name: str) -> Path:
    """Where environment ``name`` lives (whether or not it exists)."""
    return home() / "envs" / name


def _read_marker(name: str) -> tuple[dict | None, str | None]:
    """The marker of environment ``name`` and, when it is there but not what creating the environment
    writes, why not."""
    path = env_dir(name) / MARKER
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:  # a folder in its place, no permission, not UTF-8
        return None, f"{MARKER}: cannot be read ({getattr(exc, 'strerror', None) or type(exc).__name__})"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return None, f"{MARKER}: not JSON ({str(exc)[:60]})"
    if not isinstance(data, dict):
        return None, f"{MARKER}: expected a JSON object, got a {type(data).__name__}"
    packages, recipe = data.get("packages", {}), data.get("recipe", [])
    if not (isinstance(packages, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in packages.items())):
        return None, f"{MARKER}: packages: expected a mapping of package -> version"
    if not (isinstance(recipe, list) and all(isinstance(p, str) for p in recipe)):
        return None, f"{MARKER}: recipe: expected a list of requirements"
    return data, None


def marker(name: str) -> dict | None:
    """What the finished environment ``name`` recorded about itself (None: not (completely) created, or
    its marker is damaged: :func:`damage` says)."""
    return _read_marker(name)[0]


def damage(name: str) -> str | None:
    """Why environment ``name`` cannot be used as it is: its marker is there but damaged (None: sound, or
    not created yet)."""
    return _read_marker(name)[1]


def env_python(name: str) -> Path | None:
    """The environment's interpreter, or None when it has not been (completely) created."""
    py = env_dir(name) / "bin" / "python"
    return py if py.exists() and marker(name) is not None else None


def damaged_reason(name: str, why: str) -> str:
    """What a backend of a damaged environment says: the damage and the command that rebuilds it."""
    return f"environment {name!r} is damaged ({why}); `harness env create {name}` rebuilds it"


# set while the runner computes the settings of a worker that will run in another environment
_ACTING_FOR: contextvars.ContextVar[tuple[str | None] | None] = contextvars.ContextVar("acting_for", default=None)


@contextlib.contextmanager
def acting_for(name: str | None):
    """Within it :func:`current_env` (and so :func:`cache_dir`) answer for environment ``name`` (None: the
    main one): a backend's worker variables, computed by the runner, then name that environment's caches."""
    token = _ACTING_FOR.set((name,))
    try:
        yield
    finally:
        _ACTING_FOR.reset(token)


def current_env() -> str | None:
    """The name of the isolated environment this process runs in, or None for the main one."""
    acting = _ACTING_FOR.get()
    if acting is not None:
        return acting[0]
    prefix = Path(sys.prefix).resolve()
    envs = (home() / "envs").resolve()
    return prefix.name if prefix.parent == envs else None


def base_python(recipe: Recipe) -> str | None:
    """An interpreter within the recipe's Python range, or None."""
    if recipe.min_python <= sys.version_info[:2] <= recipe.max_python:
        return sys.executable
    for minor in range(recipe.max_python[1], recipe.min_python[1] - 1, -1):
        found = shutil.which(f"python{recipe.max_python[0]}.{minor}")
        if found:
            return found
    return None


def has_pip() -> bool:
    # not importlib.util.find_spec("pip"): setuptools' distutils hook takes that lookup for
    # pip starting up and switches itself off, and a later `import setuptools` (PyTensor's
    # C compiler does one) then fails in this process
    return any((Path(entry) / "pip" / "__init__.py").is_file() for entry in sys.path if entry)


def can_create(name: str, recipe: Recipe) -> tuple[bool, str]:
    """Cheaply: whether this machine has what creating environment ``name`` from ``recipe`` needs (network aside)."""
    uv = shutil.which("uv")
    if uv is None and base_python(recipe) is None:
        lo, hi = ".".join(map(str, recipe.min_python)), ".".join(map(str, recipe.max_python))
        return False, f"environment {name!r} needs Python {lo} to {hi} (or uv, which can fetch one)"
    if recipe.needs_cxx and shutil.which("g++") is None:
        return False, f"environment {name!r} needs a C++ compiler (g++) on PATH"
    return True, ""


def reachable(name: str | None, recipe: Recipe | None, availability) -> tuple[bool, str]:
    """Whether a backend whose workers run in environment ``name`` (None: the main one) can run: its own
    ``availability()`` where this process runs in that environment; from outside it, whether the environment
    exists or can be created (what the harness asks before a worker starts)."""
    if name is None or recipe is None or current_env() == name:
        return availability()
    return availability_outside(name, recipe)


def availability_outside(name: str, recipe: Recipe) -> tuple[bool, str]:
    """A backend that runs in environment ``name``, seen from outside it: available when the environment
    exists or can be created here (the one rule for every isolated environment)."""
    if env_python(name) is not None:
        return True, ""
    damaged = damage(name)
    if damaged:  # never rebuilt behind the user's back: what is in the folder may be worth a look
        return False, f"unavailable: {damaged_reason(name, damaged)}"
    ok, why = can_create(name, recipe)
    if not ok:
        return False, f"unavailable: {why}"
    return True, "environment will be created on first use"


# -- pin sets: packages at exact versions ------------------------------------------------------

_PACKAGE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
# PEP 440's grammar (its appendix), with the spellings it allows: 1.0a1 = 1.0-alpha.1, 1.0-1 = 1.0.post1,
# a local label after '+' (torch@2.5.1+cpu); no ranges, no wildcards: a pin is one version
_VERSION = re.compile(r"""
    v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?:[-_.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?:(?:-(?P<post_n1>[0-9]+))|(?:[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?))?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
""", re.VERBOSE | re.IGNORECASE)
_PRE = {"alpha": "a", "a": "a", "beta": "b", "b": "b", "c": "rc", "pre": "rc", "preview": "rc", "rc": "rc"}
#: characters of one pinned version and of a package name (real ones are under 30): an environment's
#: folder is named after its pins, and a file name holds at most 255 bytes
MAX_VERSION_CHARS = 64
MAX_PACKAGE_CHARS = 100
#: characters of a whole pin set, the name of its environment's folder
MAX_PIN_SET_CHARS = 200


def normalise_package(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): ``PyYAML`` -> ``pyyaml``, ``a_b`` -> ``a-b``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def normalise_version(text: str) -> str:
    """A version in PEP 440's normal form, as pip reads it (``01.26.4`` -> ``1.26.4``, ``1.0-alpha.1`` ->
    ``1.0a1``, ``2.5.1+CPU`` -> ``2.5.1+cpu``); ValueError when it is not one PEP 440 version. Written out
    here because the worker side's environments need not hold ``packaging``."""
    from harness.spec.model import short_repr

    if len(text) > MAX_VERSION_CHARS:
        raise ValueError(f"expected a version of at most {MAX_VERSION_CHARS} characters, got {len(text)}")
    m = _VERSION.fullmatch(text)
    if m is None:
        raise ValueError(f"expected one exact PEP 440 version (like 1.26.4), got {short_repr(text, 30)}")
    out = "" if m["epoch"] is None or int(m["epoch"]) == 0 else f"{int(m['epoch'])}!"
    out += ".".join(str(int(part)) for part in m["release"].split("."))
    if m["pre_l"]:
        out += f"{_PRE[m['pre_l'].lower()]}{int(m['pre_n'] or 0)}"
    if m["post_n1"] is not None or m["post_l"]:
        out += f".post{int(m['post_n1'] or m['post_n2'] or 0)}"
    if m["dev_l"]:
        out += f".dev{int(m['dev_n'] or 0)}"
    if m["local"]:
        parts = re.split(r"[-_.]", m["local"].lower())
        out += "+" + ".".join(str(int(p)) if p.isdigit() else p for p in parts)
    return out


def split_pin_items(text: str) -> list[str]:
    """``"2.5.1+cpu+numpy@1.26.4"`` -> ``["2.5.1+cpu", "numpy@1.26.4"]``: split at each ``+`` that a
    ``package@`` follows."""
    return re.split(r"\+(?=[^+@]*@)", text)


def parse_pins(text: str) -> dict[str, str]:
    """``"jax@0.4.38+jaxlib@0.4.38"`` -> ``{"jax": "0.4.38", "jaxlib": "0.4.38"}``: packages at exact
    versions, joined by ``+``, names and versions normalised (:func:`normalise_version`), so that two
    spellings of one pin set name one environment. A ``+`` that no ``package@`` follows belongs to the
    version before it (a local label: ``torch@2.5.1+cpu``). ValueError says what is wrong."""
    from harness.spec.model import short_repr

    pins: dict[str, str] = {}
    for item in split_pin_items(text):
        package, at, version = item.partition("@")
        if not at or not _PACKAGE.fullmatch(package) or len(package) > MAX_PACKAGE_CHARS:
            raise ValueError(f"expected package@version, got {short_repr(item, 40)}")
        if len(version) > MAX_VERSION_CHARS:
            raise ValueError(f"expected one exact version after '{package}@' of at most {MAX_VERSION_CHARS} "
                             f"characters, got {len(version)} characters ({short_repr(version, 30)})")
        try:
            version = normalise_version(version)
        except ValueError:
            raise ValueError(f"expected one exact version after '{package}@' (like 1.26.4, PEP 440), "
                             f"got {short_repr(version, 30)}") from None
        key = normalise_package(package)
        if key in pins:
            raise ValueError(f"{key} is pinned twice")
        pins[key] = version
    if len(pins_text(pins)) > MAX_PIN_SET_CHARS:
        raise ValueError(f"expected pins of at most {MAX_PIN_SET_CHARS} characters (the name of their "
                         f"environment's folder), got {len(pins_text(pins))}")
    return pins


def pins_text(pins: dict[str, str]) -> str:
    """The canonical spelling of a pin set, packages sorted: the name of its environment."""
    return "+".join(f"{package}@{version}" for package, version in sorted(pins.items()))


def is_pin_set(name: str) -> bool:
    """Whether environment ``name`` is a pin set (its recipe follows from its name)."""
    return "@" in name


def pinned_recipe(pins: dict[str, str]) -> Recipe:
    """The recipe of a pin set's environment: the pins and the worker's own packages, for this Python
    (the project itself runs from its source tree, as in every isolated environment)."""
    here = sys.version_info[:2]
    rest = tuple(p for p in WORKER_PACKAGES if normalise_package(p) not in pins)
    return Recipe(packages=tuple(f"{p}=={v}" for p, v in sorted(pins.items())) + rest,
                  min_python=here, max_python=here, check="import numpy, yaml")


@contextlib.contextmanager
def held_lock(folder: Path, name: str):
    """An exclusive lock on ``folder/.NAME.lock`` while the block runs: one build of an environment or
    an engine at a time, across processes (the kernel drops it when a process dies)."""
    import fcntl

    from harness.spec import writes

    folder.mkdir(parents=True, exist_ok=True)
    with writes.open_private(folder / f".{name}.lock", "a+") as handle:  # a link there is refused, never followed
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
