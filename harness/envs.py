"""Isolated environments for backends whose stack conflicts with the main one.

Environments live under ``.harness/envs/<name>`` in the project folder (override with
``HARNESS_HOME``). A backend whose class names ``environment = "<name>"`` runs its
workers and its conformance check with that environment's Python.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness.errors import HarnessError

# name -> what to install there besides this project (installed without its dependencies)
RECIPES: dict[str, list[str]] = {}


def home() -> Path:
    """The folder the harness owns for environments and caches."""
    root = os.environ.get("HARNESS_HOME")
    return Path(root) if root else Path(__file__).resolve().parent.parent / ".harness"


def env_dir(name: str) -> Path:
    return home() / "envs" / name


def env_python(name: str) -> Path | None:
    """The environment's interpreter, or None when it has not been created."""
    py = env_dir(name) / "bin" / "python"
    return py if py.exists() else None


def ensure_env(name: str) -> Path:
    """The environment's interpreter, creating the environment first if needed."""
    py = env_python(name)
    if py is not None:
        return py
    if name not in RECIPES:
        raise HarnessError(f"unavailable: no recipe for an isolated environment named {name!r}")
    raise HarnessError(f"unavailable: environment {name!r} does not exist; create it with `harness env create {name}`")


def worker_environ(name: str | None) -> dict[str, str]:
    """The process environment for a worker in environment ``name`` (None: the main one)."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def main_python() -> str:
    return sys.executable
