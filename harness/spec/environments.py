"""Where the harness keeps isolated environments and caches, and what a backend declares about
the environment it needs.

The one place both sides agree on: backends find their compile caches and their environment's
folder here (they are handed these folders, never the running layer), and
:mod:`harness.run.envs` builds the environments that backends declare with a :class:`Recipe`
(``environment = "theano"`` and ``recipe = Recipe(...)`` on the backend class). Everything lives
under ``.harness/`` in the project folder, or ``HARNESS_HOME``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

MARKER = "harness-env.json"


MARKER = "harness-env.json"


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
    """The persistent compile cache of ``tool`` (jax, pytensor, halide, ...), shared by every process."""
    return home() / "cache" / tool


def env_dir(name: str) -> Path:
    """Where environment ``name`` lives (whether or not it exists)."""
    return home() / "envs" / name


def marker(name: str) -> dict | None:
    """What the finished environment ``name`` recorded about itself (None: not (completely) created)."""
    try:
        return json.loads((env_dir(name) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def env_python(name: str) -> Path | None:
    """The environment's interpreter, or None when it has not been (completely) created."""
    py = env_dir(name) / "bin" / "python"
    return py if py.exists() and marker(name) is not None else None


def current_env() -> str | None:
    """The name of the isolated environment this process runs in, or None for the main one."""
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
